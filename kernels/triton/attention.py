"""Fused 8-bit VC-Attention forward (portable Triton; runs under TRITON_INTERPRET=1 too).

Per program: one block of queries (64 by default, kernels/pipeline.py's PORTABLE_BLOCK_M) of one
(batch, head), looping over all key tiles of 128:
    S   = (Q_int8 K_int8^T) * q_scale * k_scale               exact int32 dot, log2 domain
    P   = E4M3 byte of 2^(S - m' + 8): exp2 + cast, or ExpCast (the byte from the log score, one
          FMA per score: m' is the row max rounded up onto the grid (k + beta) / 8, online.py; with
          its tail piece for E4M3's subnormal band, one FFMA and one FMNMX more: EXPCAST_TAIL)
    l  <- alpha l + P @ 1                                     same bytes, on the tensor cores
    A  <- alpha A + P @ R_fp8 + sum(P) mu_j / v_scale         fresh fp32 dot, added in fp32
          (v_terms=2: P @ R_fp8 + P @ R2_fp8, R2 the E4M3 codes of what R's rounding left)
    O   = A v_scale / l
Readable twin: kernels/reference/attention.py (online_attention, reference_vc_attention).
"""

import triton
import triton.language as tl

from .. import pipeline
from ..pipeline import PORTABLE_BLOCK_M, PORTABLE_NUM_STAGES, PORTABLE_NUM_WARPS
from ..reference.expcast import TAIL_ON
from . import prepass
from .online import add_key_bias, expcast_bytes_fma, expcast_fold, expcast_max, finish_8bit, fold_tile, online_max
from .rounding import round_to_e4m3_grid

# The host code's launcher over this file's kernel and the pre-pass's (found by name when launched).
triton_launch = pipeline.jit_launcher(globals(), vars(prepass))


@triton.jit
def _int32_to_f32(x):
    """Exact int32 -> fp32 for |x| < 2^22 without the I2F instruction (which runs at MUFU rate,
    like exp2): put x into the mantissa of 1.5 * 2^23 and subtract. An INT8 QK^T dot over D <= 128
    stays below 128 * 127 * 127 < 2^21."""
    return (x + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _attention_tile(
    acc, l_i, m_i, d_i, b_q, qk_scale, ONES,
    K, KS, VT, MU, BIAS, bias_base, bh, b_idx, start_n, N, NPAD, NBK, NBV,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QK_BLK: tl.constexpr, V_BLK: tl.constexpr,
    HAS_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr, EXPCAST: tl.constexpr, BETA: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr, QK_FP8: tl.constexpr, PV_IMPRECISE_ACC: tl.constexpr,
    PV_PERM: tl.constexpr, MASKED: tl.constexpr, TAIL: tl.constexpr, P_E5M2: tl.constexpr = False, VT_LO=None,
):
    """One key tile of the online softmax (MASKED only for the last, partial tile). d_i: the previous
    tile's ExpCast byte offset (expcast_fold), 0 before the first. P_E5M2: ExpCast's bytes as E5M2
    (4 codes per octave: c8 is then the scale times 4). VT_LO: V's second E4M3 term, a second P.V
    dot into the same fp32 tile (the launch option v_terms=2), or None."""
    CPO: tl.constexpr = 4.0 if P_E5M2 else 8.0
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_valid = offs_n < N
    if MASKED:
        b_kt = tl.load(K + bh * N * HEAD_DIM + offs_n[None, :] * HEAD_DIM + offs_d[:, None],
                       mask=n_valid[None, :], other=0.0)  # [D, BLOCK_N] int8 or E4M3, K-major
    else:
        b_kt = tl.load(K + bh * N * HEAD_DIM + offs_n[None, :] * HEAD_DIM + offs_d[:, None])
    # Q and K scales are per 128 tokens and the tiles divide 128: one scalar per tile.
    scale = qk_scale * tl.load(KS + bh * NBK + start_n // QK_BLK)
    x_off = 0.0  # what the scores carry on top of x (expcast_fold)
    e = 0.0
    delta = 0.0
    if EXPCAST and not HAS_BIAS and not QK_FP8:
        # The scale and (while c8 < 1/4) the int32 -> fp32 conversion ride in ExpCast's FMA
        # (expcast_fold): the scores in log2 units are (b_s - x_off) * scale.
        c8 = CPO * scale
        e, delta, x_off = expcast_fold(c8)
        b_raw = (tl.dot(b_q, b_kt) + 0x4B400000).to(tl.float32, bitcast=True)
        if c8 < 0.25:
            # Folded (the usual case): the scores are x' as they are, no subtract per score, and
            # |8 s| <= c8 * 128 * 127^2 < 2^19 keeps the FMA exact, so no byte passes 120 and the
            # clip at 120 goes too (expcast_bytes_fma).
            m_new, alpha, b_p = _expcast_tile(b_raw, m_i, d_i, c8, e, delta, x_off, n_valid, BETA, MASKED,
                                              TAIL, CLIP_HI=False, P_E5M2=P_E5M2)
        else:
            m_new, alpha, b_p = _expcast_tile(b_raw - 12582912.0, m_i, d_i, c8, e, delta, x_off, n_valid, BETA,
                                              MASKED, TAIL, CLIP_HI=True, P_E5M2=P_E5M2)
    else:
        if EXPCAST and not HAS_BIAS:
            b_s = tl.dot(b_q, b_kt)  # E4M3 Q, K: the scale rides in ExpCast's FMA
            c8 = CPO * scale
        else:
            if QK_FP8:
                b_raw = tl.dot(b_q, b_kt)
            else:
                b_raw = _int32_to_f32(tl.dot(b_q, b_kt))  # exact integers
            b_s = b_raw * scale  # [BLOCK_M, BLOCK_N], log2 domain
            c8 = CPO
            if HAS_BIAS:
                b_s = add_key_bias(b_s, BIAS, bias_base, offs_n, N, MASKED)
        if EXPCAST:
            m_new, alpha, b_p = _expcast_tile(b_s, m_i, d_i, c8, 0.0, 0.0, 0.0, n_valid, BETA, MASKED, TAIL,
                                              CLIP_HI=True, P_E5M2=P_E5M2)
        else:
            tl.static_assert(not P_E5M2, "P_E5M2: ExpCast's bytes (exp2 + cast writes E4M3)")
            if MASKED:
                b_s = tl.where(n_valid[None, :], b_s, float("-inf"))
            m_new, m_safe, alpha = online_max(m_i, b_s)
            b_pf = tl.math.exp2(b_s - (m_safe - 8.0)[:, None])  # P carries 2^8: the row max is 256
            if SOFTWARE_ROUNDING:
                b_pf = round_to_e4m3_grid(b_pf)
            b_p = b_pf.to(tl.float8e4nv)
    if PV_PERM:
        # V^T's columns come in wgmma order (pipeline.pv_key): put P's keys in the same order, as
        # the Hopper kernel does (there it costs nothing; the P bytes stay the same).
        b_p = tl.reshape(tl.permute(tl.reshape(b_p, [b_p.shape[0], BLOCK_N // 32, 2, 2, 2, 2, 2]),
                                    [0, 1, 2, 4, 5, 3, 6]), [b_p.shape[0], BLOCK_N])
    # The row sum of the same E4M3 values that multiply V, on the tensor cores (a dot with a tile
    # of ones) rather than by decoding every byte on the CUDA cores. (Decoding instead measured
    # NaN rows on the H200 with Triton 3.6 at N >= 3000, not understood yet: BENCHMARKS.md.)
    # The ones come from memory, addressed like V^T, so they ride the same asynchronous copies
    # into shared memory; a constant tile is stored there anew every tile with two more barriers.
    b_ones = tl.load(ONES + tl.arange(0, 16)[:, None] * NPAD + offs_n[None, :])  # [16, BLOCK_N]
    b_r = tl.sum(tl.dot(b_p, tl.trans(b_ones)), axis=1) * (1.0 / 16.0)

    b_vt = tl.load(VT + bh * HEAD_DIM * NPAD + offs_d[:, None] * NPAD + offs_n[None, :])
    # A fresh fp32 dot per tile, added in fp32: no ~22-bit FP8 accumulation across tiles.
    b_pv = tl.dot(b_p, tl.trans(b_vt), max_num_imprecise_acc=PV_IMPRECISE_ACC)
    if VT_LO is not None:
        b_vlo = tl.load(VT_LO + bh * HEAD_DIM * NPAD + offs_d[:, None] * NPAD + offs_n[None, :])
        # accumulated on the tensor cores (no bound on the imprecise sums: with one, Hopper would add a
        # fresh partial product into b_pv on the CUDA cores), as the Hopper kernel does
        b_pv = tl.dot(b_p, tl.trans(b_vlo), b_pv)
    acc, l_i = fold_tile(acc, l_i, alpha, b_r, b_pv, MU, bh, NBV, start_n, offs_d, HEAD_DIM, V_BLK, HAS_MEAN)
    return acc, l_i, m_new, delta


@triton.jit
def _expcast_tile(b_s, m_i, d_i, c8, e, delta, x_off, n_valid, BETA: tl.constexpr, MASKED: tl.constexpr,
                  TAIL: tl.constexpr, CLIP_HI: tl.constexpr, P_E5M2: tl.constexpr = False):
    """ExpCast on one tile of scores b_s, in log2 units (b_s - x_off) c8 / CPO -> (k_new, alpha, bytes)
    (CPO codes per octave: 8, or 4 with P_E5M2). CLIP_HI=False only where the caller has proved that
    no byte passes 120."""
    CPO: tl.constexpr = 4.0 if P_E5M2 else 8.0
    if MASKED:
        b_s = tl.where(n_valid[None, :], b_s, float("-inf"))
    m_new, k_safe, alpha = expcast_max(m_i, (tl.max(b_s, axis=1) - x_off) * (c8 * (1.0 / CPO)), BETA, delta - d_i,
                                       CPO)
    return m_new, alpha, expcast_bytes_fma(b_s, c8, k_safe, e, TAIL, CLIP_HI, P_E5M2)


@triton.jit
def vc_attention_fwd_kernel(
    Q, QS, QBAD,
    K, KS, KBAD,
    VT, ONES, VS, MU,
    BIAS, stride_bias_b, stride_bias_h,
    O, stride_ob, stride_oh, stride_om, stride_od,
    LSE,
    H, M, N, NPAD, NBQ, NBK, NBV,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_BLK: tl.constexpr, V_BLK: tl.constexpr,
    HAS_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr, EXPCAST: tl.constexpr, BETA: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr, QK_FP8: tl.constexpr, PV_IMPRECISE_ACC: tl.constexpr,
    PV_PERM: tl.constexpr, EXPCAST_TAIL: tl.constexpr = TAIL_ON, P_E5M2: tl.constexpr = False, VT_LO=None,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < M

    b_q = tl.load(Q + bh * M * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=m_valid[:, None], other=0.0)  # [BLOCK_M, D] int8 or E4M3
    qk_scale = tl.load(QS + bh * NBQ + pid_m * BLOCK_M // QK_BLK)  # BLOCK_M divides QK_BLK
    bias_base = b * stride_bias_b + h * stride_bias_h

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    d_i = 0.0
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    n_full = (N // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i, d_i = _attention_tile(
            acc, l_i, m_i, d_i, b_q, qk_scale, ONES, K, KS, VT, MU, BIAS, bias_base, bh, b, start_n,
            N, NPAD, NBK, NBV, HEAD_DIM, BLOCK_N, QK_BLK, V_BLK, HAS_MEAN, HAS_BIAS, EXPCAST,
            BETA, SOFTWARE_ROUNDING, QK_FP8, PV_IMPRECISE_ACC, PV_PERM, MASKED=False, TAIL=EXPCAST_TAIL,
            P_E5M2=P_E5M2, VT_LO=VT_LO)
    if n_full < N:
        acc, l_i, m_i, d_i = _attention_tile(
            acc, l_i, m_i, d_i, b_q, qk_scale, ONES, K, KS, VT, MU, BIAS, bias_base, bh, b, n_full,
            N, NPAD, NBK, NBV, HEAD_DIM, BLOCK_N, QK_BLK, V_BLK, HAS_MEAN, HAS_BIAS, EXPCAST,
            BETA, SOFTWARE_ROUNDING, QK_FP8, PV_IMPRECISE_ACC, PV_PERM, MASKED=True, TAIL=EXPCAST_TAIL,
            P_E5M2=P_E5M2, VT_LO=VT_LO)

    finish_8bit(O, acc, l_i, VS, QBAD, KBAD, b, h, bh, M, offs_m, offs_d, m_valid, stride_ob, stride_oh,
                stride_om, stride_od, HEAD_DIM, SOFTWARE_ROUNDING)
    if LSE is not None:  # log2 of the row's sum of P at its last reference point (reference: online_attention)
        CPO: tl.constexpr = 4.0 if P_E5M2 else 8.0
        point = (m_i + BETA - d_i) * (1.0 / CPO) if EXPCAST else m_i
        carry = 15.0 if P_E5M2 else 8.0  # P's row maximum: 2^15 (E5M2), 2^8 (E4M3)
        tl.store(LSE + bh * M + offs_m, point - carry + tl.math.log2(l_i), mask=m_valid)


def vc_attention_fwd(q_codes, q_scales, q_bad, k_codes, k_scales, k_bad, v_pre, out, H,
                     key_bias_log2=None, expcast=True, beta=None, block_n=128,
                     num_warps=PORTABLE_NUM_WARPS, num_stages=PORTABLE_NUM_STAGES, software_rounding=None,
                     pv_imprecise_acc=None, block_m=PORTABLE_BLOCK_M, expcast_tail=None, lse=None, p_e5m2=None):
    """Launch the fused kernel on prepared operands (kernels/triton/prepass.py). The tiles, warps
    and stages default to kernels/pipeline.py's PORTABLE_* (why there).

    q_codes [BH, M, D] int8 or E4M3 (k_codes the same), q_scales [BH, NBQ] (sm_scale * log2 e folded in), q_bad [BH, M] int8,
    k_codes [BH, N, D] int8, k_scales [BH, NBK], k_bad [BH] int8, v_pre from quantize_v_residual,
    out: [B, H, M, D] view (any strides) written in place, key_bias_log2: [B|1, H|1, N] fp32 or None.
    software_rounding: None = only under the interpreter (on a GPU it changes no value: tested).
    pv_imprecise_acc: how many K elements of the FP8 P V dot Hopper may sum in its reduced-precision
        accumulator before promoting to fp32. None: the whole tile with V-Smooth, 32 without.
        Measured on the H200 (bf16 outputs against the float64 reference rounded to bf16): plain
        8-bit V (not centred, same-sign sums) deviates 1.2e-3 with whole-tile accumulation and
        3e-4 with promotion every 32; V-Smooth's centred residual deviates 3e-4 either way, so it
        keeps the faster default (promotion costs ~9%).
    expcast_tail: ExpCast's tail piece on (True) or off (False, the paper's byte map); None: the
        kernel's default (kernels/reference/expcast.py::TAIL_ON).
    p_e5m2: ExpCast's bytes as E5M2 (True) or E4M3 (False); None: the default (E5M2 with ExpCast:
        kernels/reference/expcast.py::p_format_of; the host always names P_E5M2).
        beta is then the format's (reference/expcast.py::P_BETA) unless given.
    lse: [BH, M] fp32 written with each row's log2 LSE of the scores as the kernel sums them (on
        the smoothed K, before reference.attention.smoothed_lse), or None.
    Host code: kernels/pipeline.py (shared with the precompiled cubins).
    """
    return pipeline.vc_attention_fwd(
        triton_launch, q_codes, q_scales, q_bad, k_codes, k_scales, k_bad, v_pre, out, H,
        key_bias_log2=key_bias_log2, expcast=expcast, beta=beta, block_n=block_n, num_warps=num_warps,
        num_stages=num_stages, software_rounding=software_rounding, pv_imprecise_acc=pv_imprecise_acc,
        block_m=block_m, expcast_tail=expcast_tail, lse=lse, p_e5m2=p_e5m2)


def triton_vc_attention(q, k, v, out, *, v_smooth=True, expcast=True, perm=None, sm_scale=None,
                        key_bias=None, beta=None, qk_format="int8", **launch):
    """The whole 8-bit pipeline on [B, H, N, D] views (any strides): pre-pass, then the fused kernel.

    perm: [B, H, N] int64 or None; key_bias: broadcastable to [B, H, 1, N] or None; out: [B, H, M, D]
    view written in place (and returned). qk_format: "int8" (default; SageAttention-style, 7 bits
    for the scores) or "fp8" (E4M3: no int->float conversion per score). launch: block_n,
    num_warps, num_stages, block_m, pv_perm (V^T in the P.V operand's key order), ... for tuning; v_terms=2:
    V's residual in two E4M3 terms, a second P.V dot per tile (reference: v_terms=2).
    Host code: kernels/pipeline.py.
    """
    return pipeline.vc_attention_8bit(triton_launch, q, k, v, out, v_smooth=v_smooth, expcast=expcast,
                                      perm=perm, sm_scale=sm_scale, key_bias=key_bias, beta=beta,
                                      qk_format=qk_format, **launch)
