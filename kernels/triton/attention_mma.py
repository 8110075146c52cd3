"""Fused 8-bit VC-Attention forward for warp-level mma.sync GPUs: RTX 4090 (sm_89), RTX 5090 and
RTX PRO 6000 Blackwell (sm_120). Portable Triton; runs under TRITON_INTERPRET=1 too.

Per program: BLOCK_M queries of one (batch, head); the keys in runs of RUN_TILES tiles of BLOCK_N
keys, a run inside one 128-row V-Smooth block:
    S    = (Q_int8 K_int8^T) * q_scale * k_scale          mma.sync s8.s8 -> s32 (exact), log2 domain
    P    = E4M3 byte of 2^(S - m' + 8)                   exp2 + cast (ExpCast optional, see below)
    A16 <- alpha A16 + P @ R_fp8                          mma.sync e4m3 with an FP16 accumulator
    r   <- alpha r + P @ 1                                the same bytes: a dot with a ones tile (FP32)
    after each run:  A <- (prod alpha) A + A16 + r mu / v_scale       FP32
    O    = A v_scale / l
Readable twin: kernels/reference/workstation.py (workstation_vc_attention), which says why V's
residual codes stop at 1.75 (the FP16 accumulator then cannot overflow: 128 * 256 * 1.75 < 65,504).

Design for the card (facts: WORKSTATION.md of the shared docs). Measured figures: the sm_89 build
run on an H200 through the driver (benchmarks/workstation_proxy.py; results/workstation_proxy_h200_*:
kernel alone, TFLOP/s at 4 N^2 D H, mean of the four real shapes) and the real-clip probes
(benchmarks/workstation_fidelity.py); predictions: benchmarks/workstation_model.py. The
proxy's 1.8x over SDPA flash is out of reach: its FP8 mma.sync is slower than its BF16 one.
- P.V with an FP16 accumulator: on GeForce (4090, 5090) an FP32 accumulator halves the FP8 tensor
  rate; INT8 -> INT32 runs at the full rate, so Q.K stays exact. Proxy: 341 TFLOP/s against 275 for
  the FP32 version (there the FP32 accumulator runs at 0.75 of FP16's: 364 against 482 TFLOP/s).
- Runs of 128 keys (2 tiles of 64): the run's FP16 sum is added to FP32 once per run, which also
  pays the FP32 rescale of A and the V-Smooth mean term once per run. 128 is the longest run the
  mean term allows (one V-Smooth block) and the FP16 bound allows (128 x 256 x 1.75 < 65,504).
  Error against exact attention on the probes (three clips, N = 5,476-7,396, 4 heads, V-Smooth;
  results/workstation_fidelity_2026-12-01.json): Wan2.2-14B FP32 version 1.1777e-2, FP16 runs of
  32 / 64 / 128 keys 1.1774e-2 / 1.1777e-2 / 1.1778e-2; within +0.01% of the FP32 version on every
  clip, at every length (the 8-bit quantisation dominates). Proxy speed: runs of one tile (64 keys)
  268 TFLOP/s, of two 341.
- Row sum: P times a 64 x 16 tile of ones on the tensor cores with an FP32 accumulator (exact; an
  FP16 one would round the denominator), not decoding the bytes on the CUDA cores: 341 against 275
  TFLOP/s on the proxy (the decode's conversions cost more than its tensor work saves). It is 1/16
  of P.V's tensor work (sm_120's ptxas drops the duplicate half of the ones: 4 QMMA per run).
- Tiles: 128 queries x 64 keys, 8 warps (16 query rows per warp), 3 stages: 81,944 bytes of shared
  memory (within the ~99 KB of one block), 255 / 250 registers (sm_89 / sm_120), no local memory
  (tests/kernels/test_mma_kernel.py reads the SASS). Proxy: 128 x 128 tiles 265-295 TFLOP/s, 128 x
  32 (runs of 4) 311, 2 stages 280-317.
- Per run of 128 keys, per warp (2,048 scores; SASS of Triton 3.9): 64 IMMA.16832.S8.S8 (Q.K), 64
  QMMA.16832.F16.E4M3 (P.V), 8 (sm_120: 4) QMMA.16832.F32.E4M3 (row sum), 68 MUFU.EX2, 1,018
  (sm_120: 962) instructions in all (1,074 / 1,022 with EXP2_FMA off).
- The exp2 argument as one FFMA (EXP2_FMA, on by default): the row max is taken on the exact
  integer scores and scaled once per row (online.py's online_max_scaled: the same fp32 value for a
  scale >= 0), so x * scale - m + 8 is one FFMA instead of an FMUL and an FADD per score: 60 (sm_120)
  / 56 (sm_89) instructions fewer per run, the same tensor instructions. Only the rounding of the exp2
  argument moves (one rounding instead of two, below MUFU.EX2's own error). Proxy: 349-353 against
  339-343 TFLOP/s; the model refitted on it (benchmarks/results/workstation_model_2026-12-02_refit.md):
  RTX 5090 503 against 498 TFLOP/s, PREDICTED.
- ExpCast off by default. The per-tile model: the tensor pipe takes 0.266 clocks per score on an
  RTX 5090 (Q.K and P.V 0.125 each, the row sum's FP32-accumulating QMMA 0.016 at GeForce's half
  rate), the XU pipe (MUFU.EX2 and the F2FP casts, 16 per SM and clock) 0.099: the exponentials
  hide under the matmuls, and ExpCast's byte (an FFMA, two clamps, the byte moves) takes the 96 XU
  instructions of a run off but gives it 1,090 instructions in all on sm_120 (the default: 962), so
  it lengthens the issue time the tile does not hide: PREDICTED 490 against 501 TFLOP/s, and it costs 0.7-2.1 dB
  (METHOD.md). The paper's choice for workstation cards, and the proxy agrees (ExpCast 328 against
  341 TFLOP/s). expcast=True still works (the portable kernel's bytes).
- The INT8 P.V path, the default (PV_INT8, launch option pv_int8=True; the public call's
  pv_format "auto" and "int8"; _int8_pv, _int8_block_start): V's residual INT8 with a scale per
  (128-row block, channel), P unsigned INT8 against the row max of each key tile, every matmul IMMA
  s8 -> s32, exact per tile. Its own tiles: 128 keys (MMA_INT8_BLOCK_N, one tile per V block, so a
  run is one tile), and one Q scale per token (Q_TOKEN: the score scale is a column, the same FFMA
  per score). On real-clip probes at 52-71K tokens (this kernel through its sm_89 PTX on the H200)
  5.2-8.9 dB closer to exact attention than the E4M3 path (clean, peaked, noisy heads) and ahead of
  comfy-kitchen's INT8 attention on every clip (+2.0 dB clean, +0.9 broad; FIDELITY.md). Each tile's
  product enters the FP32 accumulator with its own factor, and the accumulator moves to the next
  block's V scales once per block. Full tiles keep the scores as 1.5 * 2^23 + x and take the row
  max on their bits (FOLD in _int8_pv): 1,071 against the E4M3 path's 958 instructions per 128 keys
  on sm_120 (1,132 without the fold), a few values spilled. Proxy: 0.98-1.03x the E4M3 path (the H200
  runs INT8 mma.sync at twice its FP8 -> FP16 rate; RTX cards at the same rate: PREDICTED 0-2% below
  on the 5090 / PRO 6000, the model 1.24x optimistic for this path on the proxy). 64-key tiles:
  +0.2-1.2 dB, 15% slower on the proxy (1,350 instructions). Holding the INT8 product and A in two
  halves of the head dim (each folded before the other is formed) gave more instructions and no
  fewer spills: not kept. benchmarks/rtx5090_check.py times both paths.
"""

import triton
import triton.language as tl

from .. import pipeline, pipeline_mma
from ..pipeline import interpreting
from ..pipeline_mma import (MMA_BLOCK_M, MMA_BLOCK_N, MMA_EXP2_FMA, MMA_INT8_BLOCK_N,  # noqa: F401
                            MMA_INT8_RUN_TILES, MMA_NUM_STAGES, MMA_NUM_WARPS, MMA_RUN_TILES, _check_tiles,
                            mma_attention_fwd, mma_constexprs, mma_q_token, mma_tiles, prepare_mma,
                            quantize_v_residual_mma)
from ..reference.expcast import EXPCAST_BETA, TAIL_ON
from . import prepass
from .attention import _int32_to_f32
from .online import (add_key_bias, expcast_bytes_fma, expcast_fold, expcast_max, finish_8bit, online_max,
                     online_max_scaled)
from .rounding import round_to_e4m3_grid

# Tiles, warps, stages and the EXP2_FMA default: kernels/pipeline_mma.py (the host code, Triton-free).


@triton.jit
def _mma_tile(
    acc16, r_run, l_i, m_i, d_i, b_q, qk_scale, ones,
    K, KS, VT, VCS, BIAS, bias_base, bh, start_n, N, NPAD, NBK,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QK_BLK: tl.constexpr,
    HAS_BIAS: tl.constexpr, EXPCAST: tl.constexpr, BETA: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr, PV_ACC16: tl.constexpr, ROWSUM_CUDA: tl.constexpr,
    MASKED: tl.constexpr, FIRST: tl.constexpr, EXP2_FMA: tl.constexpr, EXPCAST_TAIL: tl.constexpr,
    PV_INT8: tl.constexpr, Q_TOKEN: tl.constexpr = False,
):
    """One key tile: scores, P bytes, row sums and the run's P.V accumulator (FP16 or FP32; with
    PV_INT8 an FP32 one fed by the tile's exact INT32 product: _int8_pv).
    FIRST: the run's first tile (its accumulator is still zero: a fresh dot, no rescale)."""
    if PV_INT8:
        acc16, r_run, l_i, m_new, delta, alpha = _int8_pv(
            acc16, r_run, l_i, m_i, b_q, qk_scale, ones, K, KS, VT, VCS, BIAS, bias_base, bh, start_n, N, NPAD,
            NBK, HEAD_DIM, BLOCK_N, QK_BLK, HAS_BIAS, SOFTWARE_ROUNDING, MASKED, FIRST, EXP2_FMA, Q_TOKEN)
    else:
        acc16, r_run, l_i, m_new, delta, alpha = _fp8_pv(
            acc16, r_run, l_i, m_i, d_i, b_q, qk_scale, ones, K, KS, VT, BIAS, bias_base, bh, start_n, N, NPAD,
            NBK, HEAD_DIM, BLOCK_N, QK_BLK, HAS_BIAS, EXPCAST, BETA, SOFTWARE_ROUNDING, PV_ACC16, ROWSUM_CUDA,
            MASKED, FIRST, EXP2_FMA, EXPCAST_TAIL)
    return acc16, r_run, l_i, m_new, delta, alpha


@triton.jit
def _key_tile(K, KS, qk_scale, bh, start_n, N, NBK, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
              QK_BLK: tl.constexpr, MASKED: tl.constexpr):
    """A key tile's INT8 codes as Q.K's B operand ([D, BLOCK_N], K-major; keys past N read 0 when
    MASKED) and its score scale -> (offs_n, n_valid, b_kt, scale)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_valid = offs_n < N
    if MASKED:
        b_kt = tl.load(K + bh * N * HEAD_DIM + offs_n[None, :] * HEAD_DIM + offs_d[:, None],
                       mask=n_valid[None, :], other=0)
    else:
        b_kt = tl.load(K + bh * N * HEAD_DIM + offs_n[None, :] * HEAD_DIM + offs_d[:, None])
    return offs_n, n_valid, b_kt, qk_scale * tl.load(KS + bh * NBK + start_n // QK_BLK)


@triton.jit
def _fp8_pv(
    acc16, r_run, l_i, m_i, d_i, b_q, qk_scale, ones,
    K, KS, VT, BIAS, bias_base, bh, start_n, N, NPAD, NBK,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QK_BLK: tl.constexpr,
    HAS_BIAS: tl.constexpr, EXPCAST: tl.constexpr, BETA: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr, PV_ACC16: tl.constexpr, ROWSUM_CUDA: tl.constexpr,
    MASKED: tl.constexpr, FIRST: tl.constexpr, EXP2_FMA: tl.constexpr, EXPCAST_TAIL: tl.constexpr,
):
    """The E4M3 P.V tile: P bytes by exp2 + cast or ExpCast, P.V into the run's FP16 (or FP32)
    accumulator, the row sum of the same bytes on the tensor cores."""
    offs_n, n_valid, b_kt, scale = _key_tile(K, KS, qk_scale, bh, start_n, N, NBK, HEAD_DIM, BLOCK_N, QK_BLK,
                                             MASKED)
    offs_d = tl.arange(0, HEAD_DIM)
    x_off = 0.0
    e = 0.0
    delta = 0.0
    if EXPCAST and not HAS_BIAS:
        c8 = 8.0 * scale  # the scale and the int32 -> fp32 conversion ride in ExpCast's FMA
        e, delta, x_off = expcast_fold(c8)
        b_s = (tl.dot(b_q, b_kt) + 0x4B400000).to(tl.float32, bitcast=True) - (12582912.0 - x_off)
    elif EXP2_FMA and not HAS_BIAS:
        b_s = _int32_to_f32(tl.dot(b_q, b_kt))  # exact integers: the scale rides in the exp2's FFMA
        c8 = 8.0
    else:
        b_s = _int32_to_f32(tl.dot(b_q, b_kt)) * scale  # exact integers, then the log2 scale
        c8 = 8.0
        if HAS_BIAS:
            b_s = add_key_bias(b_s, BIAS, bias_base, offs_n, N, MASKED)
    if MASKED:
        b_s = tl.where(n_valid[None, :], b_s, float("-inf"))

    if EXPCAST:
        m_new, k_safe, alpha = expcast_max(m_i, (tl.max(b_s, axis=1) - x_off) * (c8 * 0.125), BETA, delta - d_i)
        b_p = expcast_bytes_fma(b_s, c8, k_safe, e, EXPCAST_TAIL)
    else:
        if EXP2_FMA and not HAS_BIAS:
            m_new, m_safe, alpha = online_max_scaled(m_i, b_s, scale)
            b_u = tl.fma(b_s, scale, (8.0 - m_safe)[:, None])  # one FFMA: scale and the max together
            if MASKED:  # -inf times a zero scale would be NaN: mask the argument, not only the scores
                b_u = tl.where(n_valid[None, :], b_u, float("-inf"))
            b_pf = tl.math.exp2(b_u)
        else:
            m_new, m_safe, alpha = online_max(m_i, b_s)
            b_pf = tl.math.exp2(b_s - (m_safe - 8.0)[:, None])  # P carries 2^8: the row max is 256
        if SOFTWARE_ROUNDING:
            b_pf = round_to_e4m3_grid(b_pf)
        b_p = b_pf.to(tl.float8e4nv)
    if ROWSUM_CUDA:
        b_r = tl.sum(b_p.to(tl.float32), axis=1)  # the bytes that multiply V, decoded
    else:
        b_r = tl.sum(tl.dot(b_p, ones), axis=1) * (1.0 / 16.0)

    b_vt = tl.load(VT + bh * HEAD_DIM * NPAD + offs_d[:, None] * NPAD + offs_n[None, :])
    if PV_ACC16 and SOFTWARE_ROUNDING:
        # Triton's interpreter would round after every product (numpy's fp16 matmul); the tensor
        # core sums a k-step before it rounds: here the tile's exact sum, rounded once, as the
        # reference with fp16_round_keys=None
        if FIRST:
            acc16 = tl.dot(b_p, tl.trans(b_vt)).to(tl.float16)
        else:
            acc16 = acc16 * alpha.to(tl.float16)[:, None]
            acc16 = (acc16.to(tl.float32) + tl.dot(b_p, tl.trans(b_vt))).to(tl.float16)
    elif PV_ACC16:
        if FIRST:
            acc16 = tl.dot(b_p, tl.trans(b_vt), out_dtype=tl.float16)
        else:
            acc16 = tl.dot(b_p, tl.trans(b_vt), acc16 * alpha.to(tl.float16)[:, None], out_dtype=tl.float16)
    elif FIRST:  # the FP32 version: a fresh FP32 dot per tile
        acc16 = tl.dot(b_p, tl.trans(b_vt))
    else:
        acc16 = acc16 * alpha[:, None] + tl.dot(b_p, tl.trans(b_vt))
    if FIRST:
        r_run = b_r
    else:
        r_run = r_run * alpha + b_r
    l_i = l_i * alpha + b_r
    return acc16, r_run, l_i, m_new, delta, alpha


@triton.jit
def _int8_pv(acc, r_run, l_i, m_i, b_q, qk_scale, ones, K, KS, VT, VCS, BIAS, bias_base, bh, start_n, N,
             NPAD, NBK, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QK_BLK: tl.constexpr,
             HAS_BIAS: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, MASKED: tl.constexpr,
             FIRST: tl.constexpr, EXP2_FMA: tl.constexpr, Q_TOKEN: tl.constexpr):
    """The INT8 P.V path's tile (kernels/reference/workstation.py, pv_accumulation="int8"): scores
    s = b_s * scale (log2), t their row max; P~ = round(255 * 2^(s - t)) as a signed byte P~ - 128;
    P~ V = (P~ - 128) V + 128 sum_k V_k exactly in INT32, the second term read per (tile, channel)
    from VCS with the magic number 0x4B400000 in it, so that the INT32 sum's bits are those of the
    fp32 1.5 * 2^23 + P~ V (|P~ V| <= 128 * 255 * 127 < 2^22); the row sum the same way with a ones
    tile (one IMMA per 16 rows and k-step; every key adds 128 back). Then straight into the FP32
    output accumulator A (a run accumulator's registers would spill) with the tile's factor
    c = 2^(t - m'), 1.5 * 2^23 c taken off in the same FFMA chain: A <- (A alpha - 1.5 * 2^23 c) + f c,
    two FFMA per accumulator element and tile (the column sums ride in the IMMA's accumulator
    input). A is held in units of the current block's V scales s_b (the kernel rescales it by
    s_(b-1) / s_b at each block: _int8_block_start). Full tiles without a key bias (FOLD) keep the
    scores as the fp32 1.5 * 2^23 + x (x the INT32 dot, the bits of the IMMA result with the magic
    added), take their row max on those bits, and let the exp2's FFMA take 1.5 * 2^23 off with the
    row max: one FADD per score fewer, the row max on integers. Q_TOKEN: qk_scale (and so the score
    scale) is one value per query row."""
    offs_n, n_valid, b_kt, scale = _key_tile(K, KS, qk_scale, bh, start_n, N, NBK, HEAD_DIM, BLOCK_N, QK_BLK,
                                             MASKED)
    offs_d = tl.arange(0, HEAD_DIM)
    FOLD: tl.constexpr = EXP2_FMA and not HAS_BIAS and not MASKED
    if Q_TOKEN:  # one Q scale per row: the score scale is a column (the same FFMA per score)
        scale2 = scale[:, None]
    else:
        scale2 = scale
    if FOLD:
        # Full tiles: the scores stay M + x (M = 1.5 * 2^23; the dot's bits plus M's, exact), the row
        # max is taken on those bits as int32 (positive floats order as their bits), and M leaves in
        # the exp2's FFMA: u = (M + x) scale - K with K just above (M + x_max) scale, so that
        # u = s - t + eps, eps = (M + x_max) scale - K < 0, |eps| < 2^-20 K (one FMA per row): every
        # byte <= 255, and eps goes back into the tile's factor c. One FADD per score fewer.
        x_bits = tl.dot(b_q, b_kt) + 0x4B400000
        b_x = x_bits.to(tl.float32, bitcast=True)
        x_max = tl.max(x_bits, axis=1).to(tl.float32, bitcast=True)
        t_row = (x_max - 12582912.0) * scale  # max(x) * scale, as below
        # K above the exact product by one multiply: scale (1 + 2^-22) rounds to at least
        # scale (1 + 2^-23), and x_max times that rounds to at least x_max scale (1 + 2^-24) > x_max scale
        k_up = x_max * (scale * 1.0000002384185791)
        if SOFTWARE_ROUNDING:  # numpy has no fused multiply-add: the exact products in float64, one rounding
            eps = (x_max.to(tl.float64) * scale - k_up).to(tl.float32)
            b_u = (b_x.to(tl.float64) * scale2 - k_up[:, None].to(tl.float64)).to(tl.float32)
        else:
            eps = tl.fma(x_max, scale, -k_up)
            b_u = tl.fma(b_x, scale2, -k_up[:, None])
        m_new = tl.maximum(m_i, t_row)  # finite: a full tile has finite scores
        alpha = tl.math.exp2(m_i - m_new)
        c = tl.math.exp2((t_row - m_new) - eps)
    else:
        b_s = _int32_to_f32(tl.dot(b_q, b_kt))  # exact integers
        if HAS_BIAS or not EXP2_FMA:  # the log2 scale (and the bias) on the scores
            b_s = b_s * scale2
            if HAS_BIAS:
                b_s = add_key_bias(b_s, BIAS, bias_base, offs_n, N, MASKED)
            scale = 1.0
            scale2 = 1.0
        if MASKED:
            b_s = tl.where(n_valid[None, :], b_s, float("-inf"))
        t_row = tl.max(b_s, axis=1) * scale  # the same fp32 value as max(b_s * scale): scale >= 0
        m_new = tl.maximum(m_i, t_row)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        t_safe = tl.where(t_row == float("-inf"), m_safe, t_row)  # no finite score in the tile: P~ = 0, c = 1
        alpha = tl.math.exp2(m_i - m_safe)
        c = tl.math.exp2(t_safe - m_safe)
        b_u = tl.fma(b_s, scale2, -t_safe[:, None])
    if MASKED:  # -inf times a zero scale would be NaN: mask the argument too
        b_u = tl.where(n_valid[None, :], b_u, float("-inf"))
    b_e = tl.math.exp2(b_u)
    # The byte: round(255 e) - 128 is the low byte of 1.5 * 2^23 - 128 + 255 e rounded once (one FFMA)
    if SOFTWARE_ROUNDING:  # numpy has no fused multiply-add: round the exact product in float64
        y = (b_e.to(tl.float64) * 255.0 + 6755399441055744.0) - 6755399441055744.0
        t = y.to(tl.float32) + (12582912.0 - 128.0)
    else:
        t = tl.fma(b_e, 255.0, 12582912.0 - 128.0)
    b_p = t.to(tl.int32, bitcast=True).to(tl.int8)
    b_r = tl.sum(tl.dot(b_p, ones), axis=1) >> 4  # 16 equal columns: sum(P~) - 128 BLOCK_N
    r = _int32_to_f32(b_r + 128 * BLOCK_N) * c
    b_vt = tl.load(VT + bh * HEAD_DIM * NPAD + offs_d[:, None] * NPAD + offs_n[None, :])  # int8 codes
    b_cs = tl.load(VCS + (bh * (NPAD // BLOCK_N) + start_n // BLOCK_N) * HEAD_DIM + offs_d)
    f = (tl.dot(b_p, tl.trans(b_vt)) + b_cs[None, :]).to(tl.float32, bitcast=True)  # 1.5 * 2^23 + P~ V
    acc = tl.fma(f, c[:, None], tl.fma(acc, alpha[:, None], (-12582912.0 * c)[:, None]))
    if FIRST:
        r_run = r
    else:
        r_run = r_run * alpha + r
    l_i = l_i * alpha + r
    return acc, r_run, l_i, m_new, 0.0, alpha


@triton.jit
def _int8_block_start(acc, VRATIO, bh, NB, run_start, offs_d, HEAD_DIM: tl.constexpr, V_BLK: tl.constexpr):
    """The INT8 path's V scales are per (128-row block, channel) and a run is one block: A, kept in
    the current block's units, is multiplied by s_(b-1) / s_b (VRATIO [BH, NB, D]; 1 for b = 0) as
    block b starts: one FMUL per accumulator element per block instead of a scale per tile."""
    return acc * tl.load(VRATIO + (bh * NB + run_start // V_BLK) * HEAD_DIM + offs_d)[None, :]


@triton.jit
def _flush_run(acc, a_run, acc_run, r_run, MU, bh, NBV, run_start, offs_d,
               HEAD_DIM: tl.constexpr, V_BLK: tl.constexpr, HAS_MEAN: tl.constexpr, PV_INT8: tl.constexpr):
    """A <- (prod alpha) A + A_run + r_run mu (V-Smooth's mean, from the run's row sums); the INT8
    path has added its tiles into A already: only the mean."""
    if not PV_INT8:
        acc = acc * a_run[:, None] + acc_run.to(tl.float32)
    if HAS_MEAN:
        mu = tl.load(MU + (bh * NBV + run_start // V_BLK) * HEAD_DIM + offs_d)
        acc = acc + r_run[:, None] * mu[None, :]
    return acc


@triton.jit
def vc_attention_mma_fwd_kernel(
    Q, QS, QBAD,
    K, KS, KBAD,
    VT, VS, MU, VCS, VRATIO,
    BIAS, stride_bias_b, stride_bias_h,
    O, stride_ob, stride_oh, stride_om, stride_od,
    LSE,
    H, M, N, NPAD, NBQ, NBK, NBV,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RUN_TILES: tl.constexpr,
    QK_BLK: tl.constexpr, V_BLK: tl.constexpr,
    HAS_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr, EXPCAST: tl.constexpr, BETA: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr, PV_ACC16: tl.constexpr, ROWSUM_CUDA: tl.constexpr,
    EXP2_FMA: tl.constexpr = MMA_EXP2_FMA, EXPCAST_TAIL: tl.constexpr = TAIL_ON, PV_INT8: tl.constexpr = False,
    Q_TOKEN: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < M
    RUN: tl.constexpr = BLOCK_N * RUN_TILES
    RUN_DTYPE: tl.constexpr = tl.float16 if PV_ACC16 and not PV_INT8 else tl.float32

    b_q = tl.load(Q + bh * M * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=m_valid[:, None], other=0)  # [BLOCK_M, D] int8
    if Q_TOKEN:  # the INT8 path's option: one Q scale per token (QS [BH, M])
        tl.static_assert(PV_INT8, "Q_TOKEN: the INT8 P.V path")
        qk_scale = tl.load(QS + bh * NBQ + offs_m, mask=m_valid, other=1.0)  # rows past M: never stored
    else:
        qk_scale = tl.load(QS + bh * NBQ + pid_m * BLOCK_M // QK_BLK)  # BLOCK_M divides QK_BLK
    if PV_INT8:
        ones = tl.full([BLOCK_N, 16], 1, tl.int8)
    else:
        ones = tl.full([BLOCK_N, 16], 1.0, tl.float32).to(tl.float8e4nv)
    bias_base = b * stride_bias_b + h * stride_bias_h

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    d_i = 0.0
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    n_runs = (N // RUN) * RUN
    for run_start in range(0, n_runs, RUN):
        if PV_INT8:
            acc = _int8_block_start(acc, VRATIO, bh, NPAD // V_BLK, run_start, offs_d, HEAD_DIM, V_BLK)
        acc_run = tl.zeros([BLOCK_M, HEAD_DIM], RUN_DTYPE)
        r_run = tl.zeros([BLOCK_M], tl.float32)
        a_run = tl.full([BLOCK_M], 1.0, tl.float32)  # the product of the run's alphas
        for t in tl.static_range(RUN_TILES):
            tile_acc, r_run, l_i, m_i, d_i, alpha = _mma_tile(
                acc if PV_INT8 else acc_run, r_run, l_i, m_i, d_i, b_q, qk_scale, ones, K, KS, VT, VCS, BIAS,
                bias_base, bh, run_start + t * BLOCK_N, N, NPAD, NBK, HEAD_DIM, BLOCK_N, QK_BLK, HAS_BIAS, EXPCAST,
                BETA, SOFTWARE_ROUNDING, PV_ACC16, ROWSUM_CUDA, MASKED=False, FIRST=t == 0, EXP2_FMA=EXP2_FMA,
                EXPCAST_TAIL=EXPCAST_TAIL, PV_INT8=PV_INT8, Q_TOKEN=Q_TOKEN)
            if PV_INT8:  # the INT8 path adds each tile into A itself
                acc = tile_acc
            else:
                acc_run = tile_acc
            a_run = a_run * alpha
        acc = _flush_run(acc, a_run, acc_run, r_run, MU, bh, NBV, run_start, offs_d, HEAD_DIM, V_BLK, HAS_MEAN,
                         PV_INT8)
    if n_runs < N:  # the last, partial run: masked tiles
        if PV_INT8:
            acc = _int8_block_start(acc, VRATIO, bh, NPAD // V_BLK, n_runs, offs_d, HEAD_DIM, V_BLK)
        acc_run = tl.zeros([BLOCK_M, HEAD_DIM], RUN_DTYPE)
        r_run = tl.zeros([BLOCK_M], tl.float32)
        a_run = tl.full([BLOCK_M], 1.0, tl.float32)
        for start_n in range(n_runs, N, BLOCK_N):
            tile_acc, r_run, l_i, m_i, d_i, alpha = _mma_tile(
                acc if PV_INT8 else acc_run, r_run, l_i, m_i, d_i, b_q, qk_scale, ones, K, KS, VT, VCS, BIAS,
                bias_base, bh, start_n, N, NPAD, NBK, HEAD_DIM, BLOCK_N, QK_BLK, HAS_BIAS, EXPCAST,
                BETA, SOFTWARE_ROUNDING, PV_ACC16, ROWSUM_CUDA, MASKED=True, FIRST=False, EXP2_FMA=EXP2_FMA,
                EXPCAST_TAIL=EXPCAST_TAIL, PV_INT8=PV_INT8, Q_TOKEN=Q_TOKEN)
            if PV_INT8:
                acc = tile_acc
            else:
                acc_run = tile_acc
            a_run = a_run * alpha
        acc = _flush_run(acc, a_run, acc_run, r_run, MU, bh, NBV, n_runs, offs_d, HEAD_DIM, V_BLK, HAS_MEAN,
                         PV_INT8)

    finish_8bit(O, acc, l_i, VS, QBAD, KBAD, b, h, bh, M, offs_m, offs_d, m_valid, stride_ob, stride_oh,
                stride_om, stride_od, HEAD_DIM, SOFTWARE_ROUNDING)
    if LSE is not None:  # log2 of the row's sum of P at its last reference point, as the portable kernel
        if PV_INT8:  # P~ carries 255 at the tile max
            lse = m_i - 7.994353436858858 + tl.math.log2(l_i)  # log2(255)
        else:
            point = (m_i + BETA - d_i) * 0.125 if EXPCAST else m_i
            lse = point - 8.0 + tl.math.log2(l_i)
        tl.store(LSE + bh * M + offs_m, lse, mask=m_valid)


# --- host code ---------------------------------------------------------------------------------

# The host code's launcher: this file's kernel and the shared pre-pass kernels, found by name.
mma_launch = pipeline.jit_launcher(globals(), vars(prepass))


def kernel_defaults(fn):
    """{name: default} of a Triton kernel's constexprs that have one (what the JIT uses when a launch
    leaves them out; a triton.compile signature must still name them as constexprs)."""
    import inspect

    return {n: p.default for n, p in inspect.signature(getattr(fn, "fn", fn)).parameters.items()
            if p.default is not inspect.Parameter.empty}


def mma_vc_attention(q, k, v, out, *, v_smooth=True, expcast=False, perm=None, sm_scale=None,
                     key_bias=None, beta=EXPCAST_BETA, launch=None, **options):
    """The whole 8-bit pipeline for mma.sync GPUs on [B, H, N, D] views (any strides), as
    triton_vc_attention (kernels/triton/attention.py): pre-pass, then the fused kernel.

    perm: [B, H, N] int64 or None; key_bias: broadcastable to [B, H, 1, N] or None; out: [B, H, M, D]
    view written in place (and returned). options: block_m, block_n, run_tiles, num_warps,
    num_stages, pv_acc16 (False: the FP32 version), rowsum_cuda (False: the ones-tile dot), exp2_fma
    (the exp2 argument as one FFMA with the scale folded; None: the kernel's default), expcast_tail
    (ExpCast's tail piece; None: the kernel's default), lse (a [B, H, M] fp32 tensor for each row's
    log-sum-exp: pipeline.vc_attention_8bit's).
    launch: a pipeline.py-style launcher (None: Triton's JIT)."""
    return pipeline_mma.mma_vc_attention(launch or mma_launch, q, k, v, out, v_smooth=v_smooth, expcast=expcast,
                                         perm=perm, sm_scale=sm_scale, key_bias=key_bias, beta=beta, **options)


def compile_mma_attention(arch: int, head_dim: int = 128, v_smooth: bool = True, has_bias: bool = False,
                          expcast: bool = False, out_dtype: str = "bf16", block_m: int = MMA_BLOCK_M,
                          block_n=None, run_tiles=None,
                          num_warps: int = MMA_NUM_WARPS, num_stages: int = MMA_NUM_STAGES,
                          pv_acc16: bool = True, rowsum_cuda: bool = False, exp2_fma=None, expcast_tail=None,
                          lse: bool = False, pv_int8: bool = False, q_token=None):
    """Compile the kernel for a CUDA target without a GPU (triton.compile + GPUTarget): arch 89
    (RTX 4090), 120 (RTX 5090 / PRO 6000). .asm holds "ptx" and "cubin"; .metadata.shared the
    shared memory per block. lse: with the LSE output; pv_int8: the INT8 P.V path; block_n /
    run_tiles / q_token (one Q scale per token): None = the path's own (as mma_attention_fwd and
    prepare_mma). Needs a process without TRITON_INTERPRET=1."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreting():
        raise RuntimeError("compile_mma_attention needs TRITON_INTERPRET unset (run it in a fresh process)")
    block_n, run_tiles = mma_tiles(pv_int8, block_n, run_tiles)
    _check_tiles(block_m, block_n, run_tiles)
    q_token = mma_q_token(pv_int8, q_token)
    ptrs = {"Q": "*i8", "QS": "*fp32", "QBAD": "*i8", "K": "*i8", "KS": "*fp32", "KBAD": "*i8",
            "VT": "*i8" if pv_int8 else "*fp8e4nv", "VS": "*fp32", "MU": "*fp32" if v_smooth else "constexpr",
            "VCS": "*i32" if pv_int8 else "constexpr", "VRATIO": "*fp32" if pv_int8 else "constexpr",
            "BIAS": "*fp32" if has_bias else "constexpr", "O": f"*{out_dtype}",
            "LSE": "*fp32" if lse else "constexpr"}
    ints = ["stride_bias_b", "stride_bias_h", "stride_ob", "stride_oh", "stride_om", "stride_od",
            "H", "M", "N", "NPAD", "NBQ", "NBK", "NBV"]
    consts = mma_constexprs(head_dim, block_m=block_m, block_n=block_n, run_tiles=run_tiles,
                            v_smooth=v_smooth, has_bias=has_bias, expcast=expcast, beta=EXPCAST_BETA,
                            software_rounding=False, pv_acc16=pv_acc16, rowsum_cuda=rowsum_cuda,
                            exp2_fma=exp2_fma, expcast_tail=expcast_tail, pv_int8=pv_int8, q_token=q_token)
    for name, value in kernel_defaults(vc_attention_mma_fwd_kernel).items():
        consts.setdefault(name, value)  # a constexpr left to its default is still a constexpr here
    if not v_smooth:
        consts["MU"] = None
    if not has_bias:
        consts["BIAS"] = None
    if not lse:
        consts["LSE"] = None
    if not pv_int8:
        consts["VCS"] = None
        consts["VRATIO"] = None
    # What Triton's JIT specialises for a typical call (as kernels/precompiled/specs.py): pointers
    # 16-byte aligned, the output's last stride 1, its other strides and NPAD multiples of 16.
    names = list(vc_attention_mma_fwd_kernel.arg_names)
    consts["stride_od"] = 1
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in consts:
            signature[name] = "constexpr"
        else:
            signature[name] = ptrs.get(name, "i32")
            if name in ptrs or name in ("stride_ob", "stride_oh", "stride_om", "NPAD"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(vc_attention_mma_fwd_kernel, signature, {(names.index(n),): v for n, v in consts.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def sass_rows(sass: str) -> list:
    """cuobjdump -sass output as [(address, predicated, opcode with modifiers, operands)]."""
    import re

    pat = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
    return [(int(m.group(1), 16), bool(m.group(2)), m.group(3), m.group(4)) for m in map(pat.search, sass.splitlines())
            if m]


def branch_target(op: str, rest: str):
    """The address a BRA jumps to, else None."""
    import re

    t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
    return int(t.group(1), 16) if t else None


def longest_loop(rows) -> tuple:
    """(first, last) address of the main loop in sass_rows' rows: of the backward branches' bodies,
    the one with the most tensor instructions, and of those the shortest (a kernel whose masked
    tail loop covers as many keys per iteration as its main loop, block_n x run_tiles = one run,
    repeats the tile with its selects added); (0, -1) without a loop."""
    loops = [(t, addr) for addr, _, op, rest in rows if (t := branch_target(op, rest)) is not None and t < addr]
    if not loops:
        return (0, -1)

    def rank(loop):
        lo, hi = loop
        return (sum(1 for a, _, op, _ in rows if lo <= a <= hi and "MMA" in op), -(hi - lo))

    return max(loops, key=rank)


def sass_profile(sass: str) -> dict:
    """Instruction counts of cuobjdump -sass output: the whole kernel ("all") and the body of its
    longest loop ("loop", the main loop over the runs of key tiles), by opcode (first word, without
    its modifiers after the first dot), plus the tensor instructions with their modifiers
    ("tensor_kinds"; "loop_tensor" counts them in the loop) and the bytes a warp reads from shared
    memory with LDSM in the loop (x4: 512 bytes). Read by the CPU tests and by
    benchmarks/workstation_model.py."""
    from collections import Counter

    parsed = sass_rows(sass)
    rows = [(addr, op, rest) for addr, _, op, rest in parsed]
    lo, hi = longest_loop(parsed)

    def count(sel):
        return Counter(op.split(".")[0] for a, op, _ in rows if sel(a))

    return {"all": count(lambda a: True), "loop": count(lambda a: lo <= a <= hi),
            "loop_instructions": sum(1 for a, _, _ in rows if lo <= a <= hi),
            "loop_tensor": dict(Counter(op for a, op, _ in rows if lo <= a <= hi and "MMA" in op)),
            "loop_ldsm_bytes": sum(128 * (4 if op.endswith(".4") else 2 if op.endswith(".2") else 1)
                                   for a, op, _ in rows if lo <= a <= hi and op.startswith("LDSM")),
            "tensor_kinds": sorted({op for _, op, _ in rows if "MMA" in op})}
