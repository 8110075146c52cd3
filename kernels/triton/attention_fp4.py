"""Fused 4-bit (NVFP4) VC-Attention forward for Blackwell: sm_100 (B200) and sm_120 (RTX 5090,
RTX PRO 6000), through `tl.dot_scaled` with e2m1 operands and E4M3 group-16 scales.

Triton 3.9 takes NVFP4 natively: a scale tensor of dtype float8e4nv with K/16 columns makes
`tl.dot_scaled(..., "e2m1", ...)` compile to `tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`
on sm_100 and `mma.sync ... kind::mxf4nvf4.block_scale.scale_vec::4X ... ue4m3` on sm_120 (checked by
tests/kernels/test_nvfp4.py without a GPU). uint8 scales with K/32 columns would be MXFP4 (E8M0).

Per program: BLOCK_M queries of one (batch, head), looping over key tiles of BLOCK_N:
    S   = dot_scaled(Q_fp4, Q_e4m3 scales, K_fp4^T, K scales) * (sQ sK sm_scale log2 e)
    p   = 2^(S - m')                                   exp2: no ExpCast for NVFP4
    P   = NVFP4 of p * 6 * 448, per 16 keys: b = E4M3(amax * 448), code = E2M1(p * 2688 / b)
    r_g = sum over group g's keys of code * b          the row sums per mean group (8 keys), and
    l  <- alpha l + sum_g r_g                          their sum: the same values that multiply V
    A  <- alpha A + sum_g r_g mu_g / sV + dot_scaled(P, b, V_res_fp4, V scales)
    O   = A sV / l
V-Smooth's means are one per 8 tokens of the permuted V (NVFP4_MEAN_GROUP; MEAN_GROUP = 128: the
paper's one per block, sum(P) mu_j / sV). Readable twin: kernels/reference/nvfp4.py and
reference_vc_attention(bits=4).

Defaults: BLOCK_M = 128 queries, BLOCK_N = 128 keys per tile (FP4_BLOCK_N), 8 warps, 2 stages.
Design for sm_120 (SASS of Triton 3.9, one warp's main loop per 128-key tile, 16 query rows;
tests/kernels/test_workstation_sass.py reads it; PREDICTED rates: benchmarks/workstation_model.py --fp4): 68
block-scaled FP4 mma.sync (OMMA, FP32 accumulator: 32 Q.K, 32 P.V, 4 for the row sums) and 16 FP16
mma.sync for the means (HMMA m16n8k16: the 16 groups' row sums times their means, 8 channels each)
against 1,411 instructions, no local memory in the loop, 32 KiB of shared memory. With the block
mean: 66 OMMA (the duplicate half of the row sum's equal columns dropped), 1,395 instructions. The
tile is issue-bound on the RTX PRO 6000, P's quantisation most of it; on GeForce cards, which halve
an FP16 mma's rate with an FP32 accumulator, the means' mma makes it tensor-bound, so there it
accumulates in FP16 (MEAN_F16_ACC, launch_fp4's default on GeForce: 1,487 instructions, PREDICTED
598 against 568 TFLOP/s on an RTX 5090; the block mean 681):
    GROUPED means (the default): the row-sum product's ones tile is block-diagonal (column g holds
        ones on group g's keys), so it gives the 16 row sums per group where it gave 16 copies of
        the row sum; their sum is the row sum. They are exact in fp16 (a 16-key scale group's b
        times at most 8 codes: 11 significant bits), the means' operand is fp16 scaled by one
        power of two per head (mean_operand_fp16: the stored bf16 mean exactly), the product times
        2^e / sV joins the rescaled accumulator.
    K_ORDER (default on): K's tile is loaded in the P.V operand's key order (_operand_keys), so P's
        codes leave the score accumulator already in the registers the FP4 A operand reads, and are
        relabelled back to key order for free (_key_order); without it Triton takes P through
        shared memory (16 byte stores, a CTA barrier, 16 byte loads per 64 keys).
    The accumulator, rescaled and with the V-Smooth mean, is the P.V dot's own accumulator input.
    P's 2688 / b by the hardware reciprocal and one exact correction (_recip_2688), not div.rn.
    The score scale rides in the exp2's FFMA (online_max_scaled), as in the 8-bit kernels.
    E2M1_MAGIC (default on): P's E2M1 rounding by one magic add whose constant comes from the
        operand's exponent bits (_e2m1_round_abs): the reference's codes, no per-element predicate.
    ROWSUM_DOT (default on): the row sum on the tensor cores (P times a tile of E2M1 ones), so the
        rounding's values are not needed, only its codes.
    E2M1_CVT (off; native on sm_100 / sm_120 only): the hardware's cvt.rn.satfinite.e2m1x2.f32, 898
        instructions per 128 keys; checked only on such a card (benchmarks/rtx5090_check.py), never here.
Per 128 keys (Triton 3.9), each choice undone alone: without K_ORDER 1,604 instructions; with the
block mean, the row sum on the CUDA cores 1,586 (Triton 3.8 alike); 64-key tiles 994 per 64 keys (the
rescale and the row statistics twice as often, and the means' mma half empty).

NATIVE=False replaces each dot_scaled by its definition (decode e2m1, multiply by the decoded E4M3
scale, fp16 tl.dot: every code * scale, |v| <= 6 * 448 on a 2^-10 grid, is exact in fp16). It is
what runs under TRITON_INTERPRET=1, whose dot_scaled (Triton 3.9) reads every scale as an E8M0
exponent byte (and whose tl.dot on bf16 operands returns garbage, hence fp16), and what runs on GPUs
without FP4 tensor cores when asked for explicitly (tests on the H200).

Which Triton builds NATIVE=True for which target (compiled for the target without a GPU):
    Triton 3.9: sm_100, sm_120 natively; sm_90 emulated (Triton's DecomposeScaledBlocked: e2m1 and
                the E4M3 scale upcast to bf16, multiplied, bf16 wgmma with fp32 accumulation: the
                same products as the twin, exactly).
    Triton 3.8: sm_120, sm_90 (emulated); sm_100 fails (TritonGPUOptimizeAccumulatorInit).
    Triton 3.6 (torch 2.11's pin): sm_120 only. sm_100 fails in TritonGPUOptimizeAccumulatorInit,
                which drops the source of the scales' tmem_alloc ("uninitialized alloc must have a
                mutable memdesc type"). sm_90 fails: 3.6's decomposition knows only E8M0 uint8
                scales (it zero-extends the scale byte into the bf16 exponent: arith.extui on
                f8E4M3FN; with fast_math=False it asserts first, building an integer 0xFF NaN mask),
                and uint8 scales mean E8M0 per 32 elements (MXFP4), so no spelling of NVFP4 reaches
                it. On the H200 the native kernel is tested with a Triton 3.9 carried there
                (benchmarks/nvfp4_triton39_pack.sh); under 3.6 tests/gpu/test_nvfp4_gpu.py xfails.

Layouts (all written by the pre-pass below; two E2M1 codes per byte, the first in the low nibble):
    Q  [BH, M, D/2] u8 + [BH, M, D/16] E4M3 bytes + [BH] fp32     packed along D (the QK^T reduction)
    K  [BH, N, D/2] u8 + [BH, N, D/16]             + [BH] fp32     K-major for the B operand
    V  [BH, D, NPAD/2] u8 + [BH, D, NPAD/16]       + [BH] fp32     packed along tokens (the P V
                                                                    reduction), K-major, zero-padded
"""

import torch
import triton
import triton.language as tl

from ..reference.nvfp4 import (NVFP4_BLOCK_N, NVFP4_GROUP, NVFP4_MEAN_GROUP, NVFP4_RANGE, NVFP4_SEARCH,
                               mean_operand_fp16)
from ..pipeline import V_BLOCK, interpreting, key_bias_log2, v_block_stats
from ..reference.quant import LOG2E, true_div
from .online import online_max, online_max_scaled, store_output
from .prepass import prepass_launch as triton_launch
from .rounding import round_to_e4m3_grid

GROUP = NVFP4_GROUP  # 16 elements per E4M3 scale
TOKEN_BLOCK = V_BLOCK  # rows per pre-pass program (and per V mean block)
# Q / K rows per quantiser program: the group-scale search keeps its registers with 32 rows and 8
# warps on sm_90 and sm_120 (128 rows spill hundreds of values: SASS read without a GPU)
QK_ROWS = 32
# V tokens and warps per quantiser program (nvfp4_quantize_v_kernel): one 16-token group per thread,
# in-thread reductions, no spills on sm_90 / sm_120; on the H200 at Wan2.2-14B 720p with the search
# 4.9 ms for V against 13.1 with 64 tokens on a transposed tile and 8 warps (same codes)
V_ROWS = 16
V_WARPS = 2
# Keys per tile (the module docstring has the SASS): 128 keep no local memory in the main loop and
# issue fewer instructions per key than 64; 32 do not compile (the FP4 mma.sync's K step is 64).
FP4_BLOCK_N = NVFP4_BLOCK_N  # 128


def _no_contraction():
    """The pre-pass quantiser's compile option: no FMA contraction (_quantize_rows says why); the
    interpreter takes no compile options (and contracts nothing)."""
    return {} if interpreting() else {"enable_fp_fusion": False}


# ----------------------------------------------------------------------------- E2M1 / E4M3 helpers

@triton.jit
def _e2m1_round_abs(a, MAGIC: tl.constexpr = True, BELOW_8: tl.constexpr = False):
    """a >= 0 (fp32, finite) -> (code 0..7 as int32, its value as fp32): nearest, ties to even,
    saturating at 6.

    MAGIC: E2M1 is a grid of step g = 0.5 below 2, 1 in [2, 4), 2 in [4, 8), and its ties-to-even
    code is the even multiple of g, so t = a + c with c = 1.5 * 2^23 g (whose ulp is g) rounds a onto
    the grid in one fp32 add, ties to even, and holds n = round(a / g) in its low mantissa bits:
    value min(t - c, 6), code min(n + 2 log2(2 g), 7). c is built from a's exponent field E (g = 2^(E - 128)
    from 2 on, 0.5 below): bits(c) = max(E, 127) + 22 in the exponent, 0x400000 below it, so
    2 log2(2 g) = bits(c) / 2^22 - 299: integer operations only, no comparison whose predicate would
    be kept per element. About 10 instructions an element on sm_120 against about 21 for the seven
    comparisons of the decision points of kernels/reference/nvfp4.py (MAGIC=False); the same codes and
    values for every a (tested). Steps past 8 (g = 4, 8, ...) still give code 7 and value 6.
    BELOW_8: the caller guarantees a < 2^100 (P: p * 2688 / b < 9), so the clamp that keeps bits(c)
    finite for any input is left out."""
    if MAGIC:
        if not BELOW_8:
            a = tl.minimum(a, 8.0)  # saturates to 6 either way; keeps bits(c) finite for any input
        e = a.to(tl.int32, bitcast=True) & 0x7F800000
        cb = tl.maximum(e, 0x3F800000) + 0x0B400000  # 1.5 * 2^23 g
        c = cb.to(tl.float32, bitcast=True)
        t = a + c
        code = tl.minimum((t.to(tl.int32, bitcast=True) & 0xFF) + ((cb >> 22) - 299), 7)
        return code, tl.minimum(t - c, 6.0)
    c0 = (a > 0.25).to(tl.int32)
    c1 = (a >= 0.75).to(tl.int32)
    c2 = (a > 1.25).to(tl.int32)
    c3 = (a >= 1.75).to(tl.int32)
    c4 = (a > 2.5).to(tl.int32)
    c5 = (a >= 3.5).to(tl.int32)
    c6 = (a > 5.0).to(tl.int32)
    low = c0 + c1 + c2 + c3
    code = low + c4 + c5 + c6
    value = 0.5 * low.to(tl.float32) + (c4 + c5).to(tl.float32) + 2.0 * c6.to(tl.float32)
    return code, value


@triton.jit
def _e4m3_round(x, SOFTWARE_ROUNDING: tl.constexpr):
    """fp32 x >= 0 -> (E4M3 byte as uint8, its value as fp32), nearest even, saturating at 448."""
    x = tl.minimum(x, 448.0)
    if SOFTWARE_ROUNDING:
        x = round_to_e4m3_grid(x)
    f8 = x.to(tl.float8e4nv)
    return f8.to(tl.uint8, bitcast=True), f8.to(tl.float32)


@triton.jit
def _recip_2688(b, SOFTWARE_ROUNDING: tl.constexpr):
    """2688 / b rounded to nearest (IEEE division) for P's E4M3 group scales b (0 -> 0).
    Compiled: the hardware reciprocal r, q = 2688 r, then one correction q + (2688 - b q) r, the
    residual exact in the FMA (b has 4 significant bits): correctly rounded for every E4M3 b whatever
    r's error up to 64 ulp (tests/kernels/test_nvfp4.py proves it; PTX's rcp.approx.f32 is within 1).
    4 instructions, where div.rn adds a refinement, a range check (FCHK) and a slow path."""
    bs = tl.where(b > 0, b, 1.0)
    if SOFTWARE_ROUNDING:
        q = tl.math.div_rn(tl.zeros_like(bs) + 2688.0, bs)
    else:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [bs], dtype=tl.float32,
                                      is_pure=True, pack=1)
        q = r * 2688.0
        q = tl.fma(tl.fma(-bs, q, 2688.0), r, q)
    return tl.where(b > 0, q, 0.0)


@triton.jit
def _pack_last(codes, R: tl.constexpr, C: tl.constexpr):
    """int32 codes [R, C] (0..15) -> uint8 [R, C/2], element 2i in the low nibble of byte i."""
    lo, hi = tl.split(tl.reshape(codes, [R, C // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _e2m1_decode(c):
    """4-bit codes (int32, 0..15) -> fp32 values."""
    m = (c & 7).to(tl.float32)
    v = tl.where(m <= 4.0, 0.5 * m, tl.where(m == 7.0, 6.0, m - 2.0))
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _per_element(g, R: tl.constexpr, G: tl.constexpr):
    """A value per group [R, G] -> [R, G * 16], repeated over the group's 16 elements."""
    return tl.reshape(tl.broadcast_to(g[:, :, None], [R, G, 16]), [R, G * 16])


@triton.jit
def _expand_scales(s_u8, R: tl.constexpr, G: tl.constexpr):
    """E4M3 bytes [R, G] -> fp32 [R, G * 16] (each scale repeated over its group)."""
    return _per_element(s_u8.to(tl.float8e4nv, bitcast=True).to(tl.float32), R, G)


@triton.jit
def _nvfp4_dot(a, a_sc, b, b_sc, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
               NATIVE: tl.constexpr, acc=None):
    """[M, K] x [K, N] in NVFP4 (+ acc, fp32 [M, N], or None) -> fp32 [M, N].
    a: u8 [M, K/2] packed along K, a_sc: E4M3 bytes [M, K/16]; b: u8 [K/2, N] packed along K,
    b_sc: E4M3 bytes [N, K/16] (not transposed, as tl.dot_scaled wants)."""
    if NATIVE:
        return tl.dot_scaled(a, a_sc.to(tl.float8e4nv, bitcast=True), "e2m1",
                             b, b_sc.to(tl.float8e4nv, bitcast=True), "e2m1", acc)
    else:
        ai = a.to(tl.int32)
        av = _e2m1_decode(tl.reshape(tl.join(ai & 15, ai >> 4), [M, K]))
        av = av * _expand_scales(a_sc, M, K // 16)
        bi = b.to(tl.int32)
        bv = _e2m1_decode(tl.reshape(tl.permute(tl.join(bi & 15, bi >> 4), (0, 2, 1)), [K, N]))
        bv = bv * tl.trans(_expand_scales(b_sc, N, K // 16))
        return tl.dot(av.to(tl.float16), bv.to(tl.float16), acc)


@triton.jit
def _scale_candidate(x, amax, base, s, f, R: tl.constexpr, C: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
    """One group-scale candidate b = E4M3(base f): (codes int32 [R, C], b as fp32 [R, C/16], the
    group's error max |y - E2M1(y)| b s), y = x RN(1 / (b s)), as kernels/reference/nvfp4.py."""
    _, b = _e4m3_round(base * f, SOFTWARE_ROUNDING)
    unit = b * s
    inv = tl.where(unit > 0, tl.math.div_rn(tl.full(unit.shape, 1.0, tl.float32), tl.where(unit > 0, unit, 1.0)), 0.0)
    y = x * _per_element(inv, R, C // 16)
    mag, val = _e2m1_round_abs(tl.abs(y))
    d = tl.max(tl.reshape(tl.abs(tl.abs(y) - val), [R, C // 16, 16]), axis=2)
    err = tl.where(unit > 0, d * unit, tl.where(amax > 0, float("inf"), d))
    return tl.where((y < 0) & (mag > 0), mag | 8, mag), b, err


@triton.jit
def _quantize_rows(x, s, R: tl.constexpr, C: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
                   SEARCH: tl.constexpr):
    """x fp32 [R, C] (finite), global scale s -> (packed u8 [R, C/2], E4M3 scale bytes [R, C/16]),
    groups of 16 along C: b = E4M3(amax / (6 s) f), code = E2M1(x RN(1 / (b s))); f = 1, or with
    SEARCH the best of the reference's NVFP4_SCALE_SEARCH per group, in the same order (a loop, so
    that one candidate at a time holds registers; it carries b as fp32, its byte taken after: Triton
    3.6 miscompiled a byte tensor carried through it). The launch turns FMA contraction off: the
    reference rounds the product x / (b s) before the E2M1 rounding adds to it."""
    xg = tl.reshape(x, [R, C // 16, 16])
    amax = tl.max(tl.abs(xg), axis=2)
    base = tl.math.div_rn(amax, s * 6.0)
    codes, b, err = _scale_candidate(x, amax, base, s, 1.0, R, C, SOFTWARE_ROUNDING)
    if SEARCH:
        for i in range(1, 3):  # NVFP4_SCALE_SEARCH[1:]
            f = tl.where(i == 1, 1.0625, 0.9375)
            c2, b2, e2 = _scale_candidate(x, amax, base, s, f, R, C, SOFTWARE_ROUNDING)
            keep = e2 < err  # the earlier candidate on ties
            codes = tl.where(_per_element(keep, R, C // 16), c2, codes)
            b = tl.where(keep, b2, b)
            err = tl.where(keep, e2, err)
    b_u8 = b.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # b is an E4M3 value: exact
    return _pack_last(codes, R, C), b_u8


# ----------------------------------------------------------------------------- pre-pass

@triton.jit
def _load_rows(X, sxb, sxh, sxn, sxd, PERM, MEAN, b, h, bh, offs_t, offs_d, N,
               HEAD_DIM: tl.constexpr, HAS_PERM: tl.constexpr, HAS_MEAN: tl.constexpr):
    valid = offs_t < N
    if HAS_PERM:
        src = tl.load(PERM + bh * N + offs_t, mask=valid, other=0)
    else:
        src = offs_t
    x = tl.load(X + b * sxb + h * sxh + src[:, None] * sxn + offs_d[None, :] * sxd,
                mask=valid[:, None], other=0.0).to(tl.float32)
    finite = tl.abs(x) < float("inf")
    x = tl.where(finite, x, 0.0)
    if HAS_MEAN:
        x = tl.where(finite & valid[:, None], x - tl.load(MEAN + bh * HEAD_DIM + offs_d)[None, :], 0.0)
    return x, finite, valid


@triton.jit
def qk_stats_kernel(X, sxb, sxh, sxn, sxd, PERM, MEAN, AMAX, BAD_ROWS, H, N, NB,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_PERM: tl.constexpr,
                    HAS_MEAN: tl.constexpr):
    """Per (128-token block, batch x head): max |x| (after permutation and K smoothing), bad rows."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_t = pid * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    x, finite, valid = _load_rows(X, sxb, sxh, sxn, sxd, PERM, MEAN, b, h, bh, offs_t, offs_d, N,
                                  HEAD_DIM, HAS_PERM, HAS_MEAN)
    tl.store(AMAX + bh * NB + pid, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    bad = tl.sum((~finite).to(tl.int32), axis=1) > 0
    tl.store(BAD_ROWS + bh * N + offs_t, bad.to(tl.int8), mask=valid)


@triton.jit
def nvfp4_quantize_kernel(X, sxb, sxh, sxn, sxd, PERM, MEAN, GS, CODES, SCALES, H, N,
                          HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_PERM: tl.constexpr,
                          HAS_MEAN: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, SEARCH: tl.constexpr = True):
    """Q or K (permuted by PERM, less MEAN): CODES [BH, N, D/2], SCALES [BH, N, D/16], groups of 16
    along the head dim."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_t = pid * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    x, finite, valid = _load_rows(X, sxb, sxh, sxn, sxd, PERM, MEAN, b, h, bh, offs_t, offs_d, N,
                                  HEAD_DIM, HAS_PERM, HAS_MEAN)
    s = tl.load(GS + bh)
    packed, sc = _quantize_rows(x, s, BLOCK, HEAD_DIM, SOFTWARE_ROUNDING, SEARCH)
    offs_c = tl.arange(0, HEAD_DIM // 2)
    offs_g = tl.arange(0, HEAD_DIM // 16)
    tl.store(CODES + (bh * N + offs_t[:, None]) * (HEAD_DIM // 2) + offs_c[None, :], packed,
             mask=valid[:, None])
    tl.store(SCALES + (bh * N + offs_t[:, None]) * (HEAD_DIM // 16) + offs_g[None, :], sc,
             mask=valid[:, None])


@triton.jit
def nvfp4_quantize_v_kernel(X, sxb, sxh, sxn, sxd, PERM, MU, GS, CODES, SCALES, H, N, NB, NPAD,
                            HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_PERM: tl.constexpr,
                            V_SMOOTH: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, SEARCH: tl.constexpr,
                            MEAN_GROUP: tl.constexpr, V_BLK: tl.constexpr = 128):
    """V's residual along the tokens (the P.V reduction): CODES [BH, D, NPAD/2], SCALES [BH, D,
    NPAD/16], zeros past N; V_SMOOTH: each row less the mean of its MEAN_GROUP rows (MU [BH, NB *
    V_BLK / MEAN_GROUP, D]). The tile is loaded as [groups, channels, 16 tokens], each 16-token scale
    group on the last axis, so that its reductions stay inside a thread (V_ROWS, V_WARPS); a
    transposed [channels, tokens] tile made them cross warps through shared memory, 2.7x slower."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    G: tl.constexpr = BLOCK // 16
    offs_t = pid * BLOCK + tl.arange(0, G)[:, None, None] * 16 + tl.arange(0, 16)[None, None, :]  # [G, 1, 16]
    offs_d = tl.arange(0, HEAD_DIM)[None, :, None]  # [1, D, 1]
    valid = offs_t < N
    if HAS_PERM:
        src = tl.load(PERM + bh * N + offs_t, mask=valid, other=0)
    else:
        src = offs_t
    x = tl.load(X + b * sxb + h * sxh + src * sxn + offs_d * sxd, mask=valid, other=0.0).to(tl.float32)
    x = tl.where(tl.abs(x) < float("inf"), x, 0.0)  # the non-finite flags come from v_block_stats
    if V_SMOOTH:
        mu_row = bh * NB * (V_BLK // MEAN_GROUP) + offs_t // MEAN_GROUP
        x = tl.where(valid, x - tl.load(MU + mu_row * HEAD_DIM + offs_d).to(tl.float32), 0.0)
    s = tl.load(GS + bh)
    packed, sc = _quantize_rows(tl.reshape(x, [G * HEAD_DIM, 16]), s, G * HEAD_DIM, 16, SOFTWARE_ROUNDING, SEARCH)
    offs_r = tl.arange(0, G * HEAD_DIM)  # row r: group r // D, channel r % D
    row = (bh * HEAD_DIM + offs_r % HEAD_DIM)
    group = pid * G + offs_r // HEAD_DIM
    tl.store(CODES + row[:, None] * (NPAD // 2) + group[:, None] * 8 + tl.arange(0, 8)[None, :], packed)
    tl.store(SCALES + row[:, None] * (NPAD // 16) + group[:, None], sc)


def _software_rounding(flag):
    return interpreting() if flag is None else bool(flag)


def quantize_qk_nvfp4(x, perm=None, mean=None, software_rounding=None, scale_search=True):
    """x: [B, H, N, D] (any strides) -> dict(codes u8 [BH, N, D/2], scales u8 (E4M3) [BH, N, D/16],
    gscale fp32 [BH], bad_rows int8 [BH, N]). perm: [BH, N] gather or None; mean: [BH, D] fp32 or None."""
    B, H, N, D = x.shape
    BH = B * H
    NB = triton.cdiv(N, TOKEN_BLOCK)
    dev = x.device
    amax = torch.empty((BH, NB), dtype=torch.float32, device=dev)
    bad_rows = torch.empty((BH, N), dtype=torch.int8, device=dev)
    qk_stats_kernel[(NB, BH)](x, *x.stride(), perm, mean, amax, bad_rows, H, N, NB, HEAD_DIM=D,
                              BLOCK=TOKEN_BLOCK, HAS_PERM=perm is not None,
                              HAS_MEAN=mean is not None, num_warps=4)
    amax = amax.amax(dim=1)
    gscale = torch.where(amax > 0, true_div(amax, NVFP4_RANGE), torch.ones_like(amax))
    codes = torch.empty((BH, N, D // 2), dtype=torch.uint8, device=dev)
    scales = torch.empty((BH, N, D // GROUP), dtype=torch.uint8, device=dev)
    nvfp4_quantize_kernel[(triton.cdiv(N, QK_ROWS), BH)](
        x, *x.stride(), perm, mean, gscale, codes, scales, H, N, HEAD_DIM=D, BLOCK=QK_ROWS,
        HAS_PERM=perm is not None, HAS_MEAN=mean is not None,
        SOFTWARE_ROUNDING=_software_rounding(software_rounding), SEARCH=bool(scale_search), num_warps=8,
        **_no_contraction())
    return {"codes": codes, "scales": scales, "gscale": gscale, "bad_rows": bad_rows}


def quantize_v_nvfp4(v, perm=None, v_smooth=True, software_rounding=None, scale_search=True,
                     mean_group=NVFP4_MEAN_GROUP):
    """v: [B, H, N, D] -> dict(codes u8 [BH, D, NPAD/2], scales u8 (E4M3) [BH, D, NPAD/16],
    gscale fp32 [BH], bad int8 [BH, D] (channel held NaN/inf), mean_group, and with V-Smooth
    mu bf16 [BH, NPAD / mean_group, D] (the means taken out) and the kernel's operand of them:
    mean_group 128 (the block means): mu_scaled fp32 (mu / gscale); the group means:
    mu16 fp16 (mu * 2^-e, mean_operand_fp16) and mu_factor fp32 [BH] (2^e / gscale)).
    NPAD = N rounded up to 128."""
    B, H, N, D = v.shape
    BH = B * H
    NB = triton.cdiv(N, V_BLOCK)
    NPAD = NB * V_BLOCK
    dev = v.device
    mu, amax, bad = v_block_stats(triton_launch, v, perm, v_smooth, mean_group)
    amax = amax.amax(dim=(1, 2))
    gscale = torch.where(amax > 0, true_div(amax, NVFP4_RANGE), torch.ones_like(amax))
    codes = torch.empty((BH, D, NPAD // 2), dtype=torch.uint8, device=dev)
    scales = torch.empty((BH, D, NPAD // GROUP), dtype=torch.uint8, device=dev)
    nvfp4_quantize_v_kernel[(NPAD // V_ROWS, BH)](
        v, *v.stride(), perm, mu, gscale, codes, scales, H, N, NB, NPAD, HEAD_DIM=D, BLOCK=V_ROWS,
        HAS_PERM=perm is not None, V_SMOOTH=v_smooth, SOFTWARE_ROUNDING=_software_rounding(software_rounding),
        SEARCH=bool(scale_search), MEAN_GROUP=mean_group, V_BLK=V_BLOCK, num_warps=V_WARPS, **_no_contraction())
    out = {"codes": codes, "scales": scales, "gscale": gscale, "mu": mu, "bad": bad.amax(dim=1),
           "mean_group": mean_group, "mu_scaled": None, "mu16": None, "mu_factor": None}
    if mu is not None and mean_group == V_BLOCK:
        out["mu_scaled"] = mu.float() / gscale[:, None, None]
    elif mu is not None:
        out["mu16"], e = mean_operand_fp16(mu, lead_dims=1)
        out["mu_factor"] = torch.exp2(e) / gscale
    return out


# ----------------------------------------------------------------------------- attention

@triton.jit
def _operand_keys(BLOCK_N: tl.constexpr):
    """The key each column of S holds when K's tile is loaded in this order: key offset bits
    (b5 b4 b3 b2 b1 b0) of column n are n's with the fields b4 b3 and b2 b1 swapped (an involution)."""
    n = tl.arange(0, BLOCK_N)
    return (n & ~0x1E) | ((n >> 2) & 0x6) | ((n << 2) & 0x18)


@triton.jit
def _key_order(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[rows, BLOCK_N] in S's column order (_operand_keys) -> key order: the same swap of bit fields."""
    x = tl.reshape(p, [BLOCK_M, BLOCK_N // 64, 2, 2, 2, 2, 2, 2])
    x = tl.permute(x, [0, 1, 2, 5, 6, 3, 4, 7])
    return tl.reshape(x, [BLOCK_M, BLOCK_N])


@triton.jit
def _fp4_tile(acc, l_i, m_i, q, q_sc, qk_scale, K, KS, VT, VS, MU, mu_factor, BIAS, bias_base, bh, start_n, N,
              NPAD, NBV, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              V_BLK: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr,
              NATIVE: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, MASKED: tl.constexpr,
              E2M1_MAGIC: tl.constexpr, ROWSUM_DOT: tl.constexpr, E2M1_CVT: tl.constexpr,
              K_ORDER: tl.constexpr, MEAN_GROUP: tl.constexpr, MEAN_F16_ACC: tl.constexpr):
    if K_ORDER:
        offs_n = start_n + _operand_keys(BLOCK_N)  # S's column n is key offs_n[n]
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_d2 = tl.arange(0, HEAD_DIM // 2)
    offs_dg = tl.arange(0, HEAD_DIM // 16)
    n_valid = offs_n < N
    # K^T [D/2, BLOCK_N] (packed along D) and its scales [BLOCK_N, D/16].
    if MASKED:
        kt = tl.load(K + (bh * N + offs_n[None, :]) * (HEAD_DIM // 2) + offs_d2[:, None],
                     mask=n_valid[None, :], other=0)
        k_sc = tl.load(KS + (bh * N + offs_n[:, None]) * (HEAD_DIM // 16) + offs_dg[None, :],
                       mask=n_valid[:, None], other=0)
    else:
        kt = tl.load(K + (bh * N + offs_n[None, :]) * (HEAD_DIM // 2) + offs_d2[:, None])
        k_sc = tl.load(KS + (bh * N + offs_n[:, None]) * (HEAD_DIM // 16) + offs_dg[None, :])
    x = _nvfp4_dot(q, q_sc, kt, k_sc, BLOCK_M, BLOCK_N, HEAD_DIM, NATIVE)
    if HAS_BIAS:
        s = x * qk_scale + tl.load(BIAS + bias_base + offs_n, mask=n_valid, other=0.0)[None, :]
        if MASKED:
            s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new, m_safe, alpha = online_max(m_i, s)
        p = tl.math.exp2(s - m_safe[:, None])  # in [0, 1]
    else:
        # the score scale rides in the exp2's FFMA: the row max on the raw dot, scaled once per row
        # (the same fp32 value as the max of the scaled scores: qk_scale > 0)
        if MASKED:
            x = tl.where(n_valid[None, :], x, float("-inf"))
        m_new, m_safe, alpha = online_max_scaled(m_i, x, qk_scale)
        u = tl.fma(x, qk_scale, -m_safe[:, None])
        if MASKED:  # -inf times the scale stays -inf; a NaN could only come from a zero scale
            u = tl.where(n_valid[None, :], u, float("-inf"))
        p = tl.math.exp2(u)  # in [0, 1]

    if K_ORDER:
        p = _key_order(p, BLOCK_M, BLOCK_N)
    # P -> NVFP4 per 16 keys: b = E4M3(amax * 448), code = E2M1(p * (2688 / b)); values carry 2688.
    pg = tl.reshape(p, [BLOCK_M, BLOCK_N // 16, 16])
    b_u8, b = _e4m3_round(tl.max(pg, axis=2) * 448.0, SOFTWARE_ROUNDING)
    recip = _recip_2688(b, SOFTWARE_ROUNDING)
    if E2M1_CVT and NATIVE:
        # The hardware's E2M1 conversion (cvt.rn.satfinite.e2m1x2.f32, sm_100a / sm_120a: nearest,
        # ties to even, saturating, as the reference), two codes per instruction, already packed
        # (element 2i in the low nibble); the row sum then needs the tensor cores (no values here).
        lo, hi = tl.split(tl.reshape(pg * recip[:, :, None], [BLOCK_M, BLOCK_N // 2, 2]))
        p_packed = tl.inline_asm_elementwise(
            "{ .reg .b8 t; cvt.rn.satfinite.e2m1x2.f32 t, $2, $1; cvt.u32.u8 $0, t; }", "=r,r,r", [lo, hi],
            dtype=tl.int32, is_pure=True, pack=1).to(tl.uint8)
    else:
        code, val = _e2m1_round_abs(pg * recip[:, :, None], E2M1_MAGIC, BELOW_8=True)
        p_packed = _pack_last(tl.reshape(code, [BLOCK_M, BLOCK_N]), BLOCK_M, BLOCK_N)
    # Row sum of the same decoded values that multiply V (denominator consistency): on the tensor
    # cores (ROWSUM_DOT, the default) as P times 16 columns of E2M1 ones (scale 1.0: each product
    # code * b exact, FP32 accumulation), 1/16 of P.V's tensor work; or on the CUDA cores from the
    # rounding's values. With the group means (MEAN_GROUP < V_BLK) column c holds ones only on the
    # keys of mean c (BLOCK_N / MEAN_GROUP <= 16 groups): the row sums per group (each product exact,
    # as is their sum within one 16-key scale group), whose sum is r; otherwise every column is r,
    # exactly, and their max is it.
    GROUPED: tl.constexpr = HAS_MEAN and MEAN_GROUP < V_BLK
    if ROWSUM_DOT or (E2M1_CVT and NATIVE) or GROUPED:
        if GROUPED:
            keys = 2 * tl.arange(0, BLOCK_N // 2)[:, None]  # the first key of each byte (pairs never split a group)
            ones = tl.where(keys // MEAN_GROUP == tl.arange(0, 16)[None, :], 0x22, 0).to(tl.uint8)
        else:
            ones = tl.full([BLOCK_N // 2, 16], 0x22, tl.uint8)  # two E2M1 1.0 codes per byte
        ones_sc = tl.full([16, BLOCK_N // 16], 0x38, tl.uint8)  # E4M3 1.0
        rs = _nvfp4_dot(p_packed, b_u8, ones, ones_sc, BLOCK_M, 16, BLOCK_N, NATIVE)
        r = tl.sum(rs, axis=1) if GROUPED else tl.max(rs, axis=1)
    else:
        r = tl.sum(tl.sum(val, axis=2) * b, axis=1)

    # V residual [BLOCK_N/2, D] (packed along tokens) and its scales [D, BLOCK_N/16].
    offs_n2 = start_n // 2 + tl.arange(0, BLOCK_N // 2)
    offs_ng = start_n // 16 + tl.arange(0, BLOCK_N // 16)
    vv = tl.load(VT + (bh * HEAD_DIM + offs_d[None, :]) * (NPAD // 2) + offs_n2[:, None])
    v_sc = tl.load(VS + (bh * HEAD_DIM + offs_d[:, None]) * (NPAD // 16) + offs_ng[None, :])
    # O <- (alpha O + means) + P V_residual: the rescaled accumulator, with the means, is the dot's own
    # (so no zeroed accumulator to add, and ptxas keeps O in the registers the loop carries it in)
    acc = acc * alpha[:, None]
    if GROUPED:
        # sum_g r_g mu_g: one FP16 mma with K = the tile's 16 group slots (the row sums per group in
        # fp16: exact for groups of 8, one scale b times at most 8 codes = 11 significant bits;
        # coarser groups round to fp16 there; the means as mean_operand_fp16 wrote them, rows past
        # the tile's groups zero), then times 2^e / sV (mu_factor) into the FP32 accumulator
        offs_g = tl.arange(0, 16)
        mu = tl.load(MU + (bh * NBV + start_n // MEAN_GROUP + offs_g[:, None]) * HEAD_DIM + offs_d[None, :],
                     mask=(offs_g < BLOCK_N // MEAN_GROUP)[:, None], other=0.0)
        if MEAN_F16_ACC:
            # GeForce cards run an FP16 mma at half rate with an FP32 accumulator, full rate with an
            # FP16 one. The row sums times 2^-18 keep every partial sum in fp16's range: a tile's row
            # sum is at most 128 * 2688 = 1.3125 * 2^18, a mean operand at most 2^15, so |sum| <=
            # 43,008 < 65,504. What it rounds (fp16 sums: 2^-11 of the mean term; row sums under
            # 2^-6, 2^-18 of the largest, flush to zero) is far below 4-bit's own error.
            t = tl.dot((rs * 0.000003814697265625).to(tl.float16), mu, out_dtype=tl.float16)
            acc = acc + t.to(tl.float32) * (mu_factor * 262144.0)
        else:
            acc = acc + tl.dot(rs.to(tl.float16), mu) * mu_factor
    elif HAS_MEAN:
        mu = tl.load(MU + (bh * NBV + start_n // V_BLK) * HEAD_DIM + offs_d)
        acc = acc + r[:, None] * mu[None, :]
    acc = _nvfp4_dot(p_packed, b_u8, vv, v_sc, BLOCK_M, HEAD_DIM, BLOCK_N, NATIVE, acc)
    l_i = l_i * alpha + r
    return acc, l_i, m_new


@triton.jit
def vc_attention_fp4_fwd_kernel(
    Q, QSC, QK_SCALE, QBAD, K, KSC, KBAD, VT, VSC, VG, VBAD, MU, MUF,
    BIAS, stride_bias_b, stride_bias_h,
    O, stride_ob, stride_oh, stride_om, stride_od,
    H, M, N, NPAD, NBV,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_BLK: tl.constexpr,
    HAS_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr, NATIVE: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr, E2M1_MAGIC: tl.constexpr = True, ROWSUM_DOT: tl.constexpr = True,
    E2M1_CVT: tl.constexpr = False, K_ORDER: tl.constexpr = True, MEAN_GROUP: tl.constexpr = 8,
    MEAN_F16_ACC: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < M
    q = tl.load(Q + (bh * M + offs_m[:, None]) * (HEAD_DIM // 2) + tl.arange(0, HEAD_DIM // 2)[None, :],
                mask=m_valid[:, None], other=0)
    q_sc = tl.load(QSC + (bh * M + offs_m[:, None]) * (HEAD_DIM // 16) + tl.arange(0, HEAD_DIM // 16)[None, :],
                   mask=m_valid[:, None], other=0)
    qk_scale = tl.load(QK_SCALE + bh)
    bias_base = b * stride_bias_b + h * stride_bias_h
    mu_factor = tl.load(MUF + bh) if HAS_MEAN and MEAN_GROUP < V_BLK else 1.0

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Whole V-Smooth blocks (their mean added once, with the last tile), then the last block's full
    # tiles and the partial tile, each with its mean.
    n_full = (N // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i = _fp4_tile(acc, l_i, m_i, q, q_sc, qk_scale, K, KSC, VT, VSC, MU, mu_factor, BIAS,
                                  bias_base, bh, start_n, N, NPAD, NBV, HEAD_DIM, BLOCK_M, BLOCK_N,
                                  V_BLK, HAS_MEAN, HAS_BIAS, NATIVE, SOFTWARE_ROUNDING, MASKED=False,
                                  E2M1_MAGIC=E2M1_MAGIC, ROWSUM_DOT=ROWSUM_DOT,
                                  E2M1_CVT=E2M1_CVT, K_ORDER=K_ORDER, MEAN_GROUP=MEAN_GROUP,
                                  MEAN_F16_ACC=MEAN_F16_ACC)
    if n_full < N:
        acc, l_i, m_i = _fp4_tile(acc, l_i, m_i, q, q_sc, qk_scale, K, KSC, VT, VSC, MU, mu_factor, BIAS,
                                  bias_base, bh, n_full, N, NPAD, NBV, HEAD_DIM, BLOCK_M, BLOCK_N,
                                  V_BLK, HAS_MEAN, HAS_BIAS, NATIVE, SOFTWARE_ROUNDING, MASKED=True,
                                  E2M1_MAGIC=E2M1_MAGIC, ROWSUM_DOT=ROWSUM_DOT,
                                  E2M1_CVT=E2M1_CVT, K_ORDER=K_ORDER, MEAN_GROUP=MEAN_GROUP,
                                  MEAN_F16_ACC=MEAN_F16_ACC)

    o = acc / l_i[:, None] * tl.load(VG + bh)
    bad = (tl.load(QBAD + bh * M + offs_m, mask=m_valid, other=0) != 0) | (tl.load(KBAD + bh) != 0)
    bad = bad[:, None] | (tl.load(VBAD + bh * HEAD_DIM + offs_d) != 0)[None, :]
    store_output(O, o, bad, b, h, offs_m, offs_d, m_valid, stride_ob, stride_oh, stride_om, stride_od,
                 SOFTWARE_ROUNDING)


def native_default(device: torch.device) -> bool:
    """dot_scaled on the FP4 tensor cores where they exist (sm_100, sm_120); the decoded twin under
    the interpreter and elsewhere."""
    if interpreting() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] in (10, 12)


def prepare_fp4(q, k, v, *, v_smooth=True, perm=None, sm_scale=None, key_bias=None,
                software_rounding=None, scale_search=NVFP4_SEARCH, mean_group=NVFP4_MEAN_GROUP):
    """The pre-pass of the 4-bit pipeline: NVFP4 Q, K (permuted, smoothed), V residual (permuted,
    demeaned), scales, flags and the bias, as a dict for launch_fp4 (timed separately by benchmarks).
    scale_search: which of "q", "k", "v" take each group's E4M3 scale as the best of the reference's
    NVFP4_SCALE_SEARCH candidates (default NVFP4_SEARCH: all three; "": the usual amax rule, plain
    NVFP4's). mean_group: V-Smooth's tokens per mean (NVFP4_MEAN_GROUP, 8; 128: the block means)."""
    B, H, M, D = q.shape
    N = k.shape[2]
    if D not in (32, 64, 128, 256):  # Triton's block shapes are powers of two
        raise ValueError(f"head dim {D}: the NVFP4 kernel takes 32, 64, 128 or 256")
    sr = _software_rounding(software_rounding)
    sm_scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    perm_flat = None if perm is None else perm.reshape(B * H, N).contiguous()
    # K smoothing (subtract the token mean: exact for softmax); a non-finite K makes the mean NaN and
    # its (batch, head) NaN through the bad-row flags, as in SDPA.
    k_mean = k.mean(dim=2, dtype=torch.float32).reshape(B * H, D).contiguous()
    search = "qkv" if scale_search is True else (scale_search or "")
    qp = quantize_qk_nvfp4(q, software_rounding=sr, scale_search="q" in search)
    kp = quantize_qk_nvfp4(k, perm_flat, k_mean, software_rounding=sr, scale_search="k" in search)
    vp = quantize_v_nvfp4(v, perm_flat, v_smooth, software_rounding=sr, scale_search="v" in search,
                          mean_group=mean_group)
    bias, k_bad = key_bias_log2(key_bias, perm, kp["bad_rows"].amax(dim=1), B, H, N)
    return {"q": qp, "k": kp, "v": vp, "k_bad": k_bad, "bias": bias, "H": H, "M": M, "N": N, "D": D,
            "qk_scale": (qp["gscale"] * (sm_scale * LOG2E)) * kp["gscale"], "software_rounding": sr}


def halved_fp32_accumulation(device: torch.device) -> bool:
    """GeForce cards (RTX 4090, RTX 5090) run FP16 / FP8 mma at half rate with an FP32 accumulator
    (NVIDIA's Ada and Blackwell architecture papers); the RTX PRO 6000 and data-centre GPUs do not."""
    return device.type == "cuda" and "GeForce" in torch.cuda.get_device_name(device)


def launch_fp4(prep, out, *, native=None, block_m=128, block_n=FP4_BLOCK_N, num_warps=8, num_stages=2,
               e2m1_magic=None, rowsum_dot=None, e2m1_cvt=None, k_order=None, mean_f16_acc=None):
    """The fused 4-bit kernel on prepare_fp4's operands; out: [B, H, M, D] view, written in place.
    block_n: keys per tile (the running max, hence P's codes, is per tile: compare with
    reference_vc_attention(..., block_n=the same)). e2m1_magic (P's E2M1 rounding by one magic add,
    the same codes), rowsum_dot (the row sum on the tensor cores), e2m1_cvt (the hardware's E2M1
    conversion, native sm_100 / sm_120 only; the row sum then on the tensor cores; numerics checked
    only on such a card, by benchmarks/rtx5090_check.py): None = the kernel's defaults.
    mean_f16_acc: the group means' FP16 mma with an FP16 accumulator (None: on GeForce cards, where
    an FP32 one halves its rate; PREDICTED 598 against 568 TFLOP/s on an RTX 5090)."""
    if block_n % 32 or V_BLOCK % block_n:
        raise ValueError(f"block_n must be a multiple of 32 dividing {V_BLOCK}")
    native = native_default(out.device) if native is None else bool(native)
    fp4_cores = out.device.type == "cuda" and torch.cuda.get_device_capability(out.device)[0] in (10, 12)
    if native and fp4_cores and block_n < 64:
        raise ValueError(f"block_n {block_n}: the FP4 tensor cores need 64 or 128 (their mma's K step is 64)")
    if e2m1_cvt and not (native and fp4_cores):
        raise ValueError("e2m1_cvt needs the native kernel on sm_100 / sm_120 (cvt ... e2m1x2 is sm_100a / sm_120a)")
    qp, kp, vp, bias = prep["q"], prep["k"], prep["v"], prep["bias"]
    sb = (0, 0) if bias is None else (bias.stride(0), bias.stride(1))
    mean_group = vp["mean_group"]
    grouped = vp["mu"] is not None and mean_group < V_BLOCK
    if grouped and block_n % mean_group:
        raise ValueError(f"block_n {block_n} must hold whole mean groups of {mean_group} keys")
    if grouped and block_n // mean_group > 16:
        raise ValueError(f"{block_n // mean_group} mean groups per tile: the kernel takes up to 16 "
                         f"(mean_group >= block_n / 16)")
    if grouped and rowsum_dot is False:
        raise ValueError("the group means take their row sums from the tensor cores (rowsum_dot)")
    mu = vp["mu16"] if grouped else vp["mu_scaled"]
    BH = qp["gscale"].shape[0]
    grid = (triton.cdiv(prep["M"], block_m), BH)
    vc_attention_fp4_fwd_kernel[grid](
        qp["codes"], qp["scales"], prep["qk_scale"], qp["bad_rows"], kp["codes"], kp["scales"],
        prep["k_bad"], vp["codes"], vp["scales"], vp["gscale"], vp["bad"], mu, vp["mu_factor"],
        bias, sb[0], sb[1],
        out, *out.stride(),
        prep["H"], prep["M"], prep["N"], vp["codes"].shape[-1] * 2, 0 if mu is None else mu.shape[1],
        HEAD_DIM=prep["D"], BLOCK_M=block_m, BLOCK_N=block_n, V_BLK=V_BLOCK, HAS_MEAN=mu is not None,
        HAS_BIAS=bias is not None, NATIVE=native, SOFTWARE_ROUNDING=prep["software_rounding"],
        MEAN_GROUP=mean_group,
        MEAN_F16_ACC=halved_fp32_accumulation(out.device) if mean_f16_acc is None else bool(mean_f16_acc),
        num_warps=num_warps, num_stages=num_stages,
        **{k: bool(v) for k, v in (("E2M1_MAGIC", e2m1_magic), ("ROWSUM_DOT", rowsum_dot), ("E2M1_CVT", e2m1_cvt),
                                   ("K_ORDER", k_order)) if v is not None},
    )
    return out


def triton_vc_attention_fp4(q, k, v, out, *, v_smooth=True, perm=None, sm_scale=None, key_bias=None,
                            native=None, software_rounding=None, scale_search=NVFP4_SEARCH,
                            mean_group=NVFP4_MEAN_GROUP, **launch):
    """The whole 4-bit pipeline on [B, H, N, D] views (any strides): pre-pass, then the fused kernel.
    Same arguments as kernels/triton/attention.py's triton_vc_attention (no ExpCast: NVFP4 P is exp2).
    native: tl.dot_scaled (True) or its decoded twin (False); None: native on sm_100 / sm_120 only.
    scale_search, mean_group: prepare_fp4's. launch: launch_fp4's options."""
    prep = prepare_fp4(q, k, v, v_smooth=v_smooth, perm=perm, sm_scale=sm_scale, key_bias=key_bias,
                       software_rounding=software_rounding, scale_search=scale_search, mean_group=mean_group)
    return launch_fp4(prep, out, native=native, **launch)


def compile_fp4_attention(arch: int, head_dim: int = 128, v_smooth: bool = True, has_bias: bool = False,
                          native: bool = True, out_dtype: str = "bf16", block_m: int = 128,
                          block_n: int = FP4_BLOCK_N,
                          num_warps: int = 8, num_stages: int = 2, e2m1_magic: bool = True,
                          rowsum_dot: bool = True, e2m1_cvt: bool = False, k_order: bool = True,
                          mean_group: int = NVFP4_MEAN_GROUP, mean_f16_acc: bool = False):
    """Compile the attention kernel for a CUDA target without a GPU (triton.compile + GPUTarget):
    arch 100 (B200), 120 (RTX 5090 / RTX PRO 6000), 90 (H200, dot_scaled emulated). Returns the
    compiled kernel; .asm["ptx"] holds the PTX (look for kind::mxf4nvf4 ... block_scale).
    Needs a process without TRITON_INTERPRET=1 (under it @triton.jit makes interpreted functions)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptrs = {"Q": "*u8", "QSC": "*u8", "QK_SCALE": "*fp32", "QBAD": "*i8", "K": "*u8", "KSC": "*u8",
            "KBAD": "*i8", "VT": "*u8", "VSC": "*u8", "VG": "*fp32", "VBAD": "*i8",
            "MU": ("*fp16" if mean_group < V_BLOCK else "*fp32") if v_smooth else "constexpr",
            "MUF": "*fp32" if v_smooth and mean_group < V_BLOCK else "constexpr",
            "BIAS": "*fp32" if has_bias else "constexpr",
            "stride_bias_b": "i32", "stride_bias_h": "i32", "O": f"*{out_dtype}"}
    ints = ["stride_ob", "stride_oh", "stride_om", "stride_od", "H", "M", "N", "NPAD", "NBV"]
    consts = {"HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "V_BLK": V_BLOCK,
              "HAS_MEAN": v_smooth, "HAS_BIAS": has_bias, "NATIVE": native, "SOFTWARE_ROUNDING": False,
              "E2M1_MAGIC": bool(e2m1_magic), "ROWSUM_DOT": bool(rowsum_dot), "E2M1_CVT": bool(e2m1_cvt),
              "K_ORDER": bool(k_order), "MEAN_GROUP": int(mean_group), "MEAN_F16_ACC": bool(mean_f16_acc)}
    if not v_smooth:
        consts["MU"] = None
    if not (v_smooth and mean_group < V_BLOCK):
        consts["MUF"] = None
    if not has_bias:
        consts["BIAS"] = None
    # What Triton's JIT specialises for a typical call (as compile_mma_attention): every pointer
    # 16-byte aligned, the output's last stride 1, its other strides and NPAD multiples of 16.
    # Without these hints the byte loads of the scales stay one LDG per byte (68 per tile on sm_120).
    consts["stride_od"] = 1
    signature = dict(ptrs, **{n: "i32" for n in ints if n not in consts},
                     **{n: "constexpr" for n in consts if n not in ptrs})
    names = list(vc_attention_fp4_fwd_kernel.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if (n in ptrs and signature[n].startswith("*")) or n in ("stride_ob", "stride_oh", "stride_om", "NPAD")}
    if interpreting():
        raise RuntimeError("compile_fp4_attention needs TRITON_INTERPRET unset (run it in a fresh process)")
    src = ASTSource(vc_attention_fp4_fwd_kernel, {n: signature[n] for n in names},
                    {(names.index(n),): v for n, v in consts.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_fp4_prepass(arch: int, tensor: str = "v", head_dim: int = 128, scale_search: bool = True):
    """Compile the 4-bit pre-pass quantiser for a CUDA target without a GPU, as prepare_fp4 launches
    it: tensor "v" (nvfp4_quantize_v_kernel: V_ROWS tokens, V_WARPS warps, V-Smooth's means per
    NVFP4_MEAN_GROUP, a permutation) or "qk" (nvfp4_quantize_kernel: QK_ROWS rows, 8 warps, K's
    permutation and mean). Returns the compiled kernel (.asm["cubin"] for its SASS)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreting():
        raise RuntimeError("compile_fp4_prepass needs TRITON_INTERPRET unset (run it in a fresh process)")
    common = {"X": "*bf16", "sxb": "i32", "sxh": "i32", "sxn": "i32", "sxd": "i32", "PERM": "*i64",
              "GS": "*fp32", "CODES": "*u8", "SCALES": "*u8", "H": "i32", "N": "i32"}
    if tensor == "v":
        kernel, warps = nvfp4_quantize_v_kernel, V_WARPS
        signature = dict(common, MU="*bf16", NB="i32", NPAD="i32")
        consts = {"HEAD_DIM": head_dim, "BLOCK": V_ROWS, "HAS_PERM": True, "V_SMOOTH": True,
                  "SOFTWARE_ROUNDING": False, "SEARCH": bool(scale_search), "MEAN_GROUP": NVFP4_MEAN_GROUP,
                  "V_BLK": V_BLOCK}
    elif tensor == "qk":
        kernel, warps = nvfp4_quantize_kernel, 8
        signature = dict(common, MEAN="*fp32")
        consts = {"HEAD_DIM": head_dim, "BLOCK": QK_ROWS, "HAS_PERM": True, "HAS_MEAN": True,
                  "SOFTWARE_ROUNDING": False, "SEARCH": bool(scale_search)}
    else:
        raise ValueError(f"tensor must be 'v' or 'qk', got {tensor!r}")
    names = list(kernel.arg_names)
    signature.update({n: "constexpr" for n in consts})
    src = ASTSource(kernel, {n: signature[n] for n in names}, {(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, **_no_contraction()})
