"""Fused quantisers that run before the attention kernel (one read of Q, K, V each, roughly).

- Q: INT8 (or E4M3) per block of 128 tokens, non-finite rows flagged.
- K: gathered by the V-Smooth permutation, smoothed (token mean subtracted), like Q per block of 128.
- V: gathered by the same permutation; per 128-row block the mean (stored bf16) is taken out and the
  residual quantised to E4M3 with one scale per channel, written transposed ([D, N], K-major: the
  layout Hopper's FP8 wgmma needs for the B operand of P V). Three kernels: block statistics, the
  per-channel scales (v_scale_kernel), then the codes with the block means over the scale (and, for
  the Hopper kernel, their tf32 B operand). Rows past N are written as zeros so
  the padded last tile contributes nothing. With PV_PERM the columns of each 32-key chunk are
  written in wgmma order (pipeline.pv_key): the order in which the Hopper kernel's score
  accumulator already holds P's bytes, so P becomes the P.V operand without moving between lanes.

Readable twin: kernels/reference/quant.py and vsmooth.py.
"""

import torch
import triton
import triton.language as tl

from .. import pipeline
from .rounding import int8_codes, round_to_bf16, round_to_e4m3_grid

# The host code's launcher over this file's kernels (found by name when launched).
prepass_launch = pipeline.jit_launcher(globals())


@triton.jit
def _load_rows(X, stride_xb, stride_xh, stride_xn, stride_xd, PERM, b, h, bh, offs_t, offs_d, N,
               HAS_PERM: tl.constexpr):
    """Rows offs_t of Q, K or V (through the permutation), fp32 as stored (rows past N: 0), and their
    mask."""
    valid = offs_t < N
    if HAS_PERM:
        src = tl.load(PERM + bh * N + offs_t, mask=valid, other=0)
    else:
        src = offs_t
    p_x = X + b * stride_xb + h * stride_xh + src[:, None] * stride_xn + offs_d[None, :] * stride_xd
    return tl.load(p_x, mask=valid[:, None], other=0.0).to(tl.float32), valid


@triton.jit
def quantize_qk_block_kernel(
    X, stride_xb, stride_xh, stride_xn, stride_xd,
    PERM, MEAN, CODES, SCALES, BAD_ROWS,
    H, N, NB,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_PERM: tl.constexpr, HAS_MEAN: tl.constexpr,
    FP8: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, PER_ROW: tl.constexpr = False,
):
    """One program per (block of 128 tokens, batch x head): codes [BH, N, D] (int8, or E4M3 when
    FP8), scales [BH, NB], bad_rows [BH, N]. PER_ROW (int8): one scale per token, scales [BH, N]."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_t = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    b_x, valid = _load_rows(X, stride_xb, stride_xh, stride_xn, stride_xd, PERM, b, h, bh, offs_t, offs_d, N,
                            HAS_PERM)  # [BLOCK, D]
    finite = tl.abs(b_x) < float("inf")  # False for NaN and +-inf
    # The row flag as a float max (an int32 sum kept a second compare per element) and one select
    # with the mean: with int8_codes, sm_90 SASS (Triton 3.6, 16 warps) per thread Q 872 -> 696, K
    # with its mean and the permutation 928 -> 752 (the quantisers are bound by instruction issue).
    bad = tl.max(tl.where(finite, 0.0, 1.0), axis=1) > 0
    if HAS_MEAN:
        b_x = tl.where(finite & valid[:, None], b_x - tl.load(MEAN + bh * HEAD_DIM + offs_d)[None, :], 0.0)
    else:
        b_x = tl.where(finite, b_x, 0.0)
    amax = tl.max(tl.abs(b_x), axis=1)  # per row
    if not PER_ROW:
        amax = tl.max(amax, axis=0)
    # The scale and its reciprocal by IEEE division (div_rn), as the reference (plain `/` may compile
    # to an approximate divide); the codes by a multiply with the reciprocal: one IEEE division per
    # element was a third of the kernel's instructions (sm_90 SASS, Triton 3.6, 16 warps: 1264 -> 872 per
    # thread for Q, 1424 -> 920 for K with its mean).
    if FP8:
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        y = b_x * tl.math.div_rn(1.0, scale)
        if SOFTWARE_ROUNDING:
            y = round_to_e4m3_grid(y)
        codes = y.to(tl.float8e4nv)
    else:
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
        inv = tl.math.div_rn(1.0, scale)
        if PER_ROW:  # a scale per row: the reciprocal as a column
            inv = inv[:, None]
        codes = int8_codes(b_x, inv, SOFTWARE_ROUNDING)
    tl.store(CODES + bh * N * HEAD_DIM + offs_t[:, None] * HEAD_DIM + offs_d[None, :], codes,
             mask=valid[:, None])
    if PER_ROW:
        tl.store(SCALES + bh * N + offs_t, scale, mask=valid)
    else:
        tl.store(SCALES + bh * NB + pid_n, scale)
    tl.store(BAD_ROWS + bh * N + offs_t, bad.to(tl.int8), mask=valid)


def quantize_qk_blocks(x, perm=None, mean=None, fmt="int8", per_row=False):
    """x: [B, H, N, D] (any strides) -> codes [B*H, N, D] (int8, or float8_e4m3fn for fmt="fp8"),
    scales fp32 [B*H, NB] ([B*H, N] per_row), bad_rows int8 [B*H, N]. Host code: kernels/pipeline.py.

    perm: [B*H, N] int64 gather (x'[t] = x[perm[t]]) or None; mean: [B*H, D] fp32 subtracted or None.
    """
    return pipeline.quantize_qk_blocks(prepass_launch, x, perm, mean, fmt, per_row=per_row)


@triton.jit
def _load_v_block(V, stride_vb, stride_vh, stride_vn, stride_vd, PERM, b, h, bh, offs_t, offs_d, N,
                  HAS_PERM: tl.constexpr):
    b_v, valid = _load_rows(V, stride_vb, stride_vh, stride_vn, stride_vd, PERM, b, h, bh, offs_t, offs_d, N,
                            HAS_PERM)
    finite = tl.abs(b_v) < float("inf")
    return tl.where(finite, b_v, 0.0), finite, valid


@triton.jit
def v_block_stats_kernel(
    V, stride_vb, stride_vb_h, stride_vn, stride_vd,
    PERM, MU, AMAX, BAD,
    H, N, NB,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_PERM: tl.constexpr,
    V_SMOOTH: tl.constexpr, MEAN_GROUP: tl.constexpr = 128,
):
    """Per (128-row block, batch x head, BLOCK_D channels): the mean of each MEAN_GROUP rows (bf16;
    BLOCK: the block mean, the 8-bit path's; the 4-bit path's groups of 8: MU [BH, NB * BLOCK /
    MEAN_GROUP, D], zeros for groups wholly past N), and per channel the block's max |residual| and
    whether it held a non-finite value. The host reduces AMAX over blocks. (Every statistic is per
    channel, so the channels split over programs: 64 per program with 4 warps took 364 -> 208 us at
    Wan 480p on the H200, with the flag below.)"""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_t = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    b_v, finite, valid = _load_v_block(V, stride_vb, stride_vb_h, stride_vn, stride_vd, PERM, b, h,
                                       bh, offs_t, offs_d, N, HAS_PERM)
    if V_SMOOTH:
        if MEAN_GROUP == BLOCK:
            count = tl.minimum(N - pid_n * BLOCK, BLOCK).to(tl.float32)
            mu = round_to_bf16(tl.math.div_rn(tl.sum(b_v, axis=0), count))
            tl.store(MU + (bh * NB + pid_n) * HEAD_DIM + offs_d, mu)
            b_v = tl.where(valid[:, None], b_v - mu.to(tl.float32)[None, :], 0.0)
        else:
            G: tl.constexpr = BLOCK // MEAN_GROUP
            offs_g = pid_n * G + tl.arange(0, G)
            count = tl.minimum(tl.maximum(N - offs_g * MEAN_GROUP, 0), MEAN_GROUP).to(tl.float32)
            total = tl.sum(tl.reshape(b_v, [G, MEAN_GROUP, BLOCK_D]), axis=1)
            mu = round_to_bf16(tl.math.div_rn(total, tl.maximum(count, 1.0)[:, None]))
            tl.store(MU + (bh * NB * G + offs_g[:, None]) * HEAD_DIM + offs_d[None, :], mu)
            mu_rows = tl.reshape(tl.broadcast_to(mu.to(tl.float32)[:, None, :], [G, MEAN_GROUP, BLOCK_D]),
                                 [BLOCK, BLOCK_D])
            b_v = tl.where(valid[:, None], b_v - mu_rows, 0.0)
    amax = tl.max(tl.abs(b_v), axis=0)
    # the non-finite flag as a float max (+inf where a value was not finite; rows past N load 0, so
    # they are finite): an int32 sum here cost more than both max reductions together
    bad = tl.max(tl.where(finite, tl.abs(b_v), float("inf")), axis=0) == float("inf")
    tl.store(AMAX + (bh * NB + pid_n) * HEAD_DIM + offs_d, amax)
    tl.store(BAD + (bh * NB + pid_n) * HEAD_DIM + offs_d, bad.to(tl.int8))


@triton.jit
def v_scale_kernel(AMAX, BAD, SCALE, SCALE_OUT, NB, HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program per batch x head: the per-channel max |residual| over the NB blocks of
    v_block_stats_kernel -> SCALE = amax / 448 (IEEE division; 1 for an all-zero channel), what the
    codes are made with, and SCALE_OUT, the scale handed on: NaN where a block of the channel held
    a non-finite value (so the output channel is NaN, as in SDPA)."""
    bh = tl.program_id(0)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_b = tl.arange(0, BLOCK_B)
    amax = tl.zeros([HEAD_DIM], dtype=tl.float32)  # every block's amax is >= 0 (and finite)
    bad = tl.zeros([HEAD_DIM], dtype=tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        rows = b0 + offs_b
        inside = (rows < NB)[:, None]
        offs = (bh * NB + rows)[:, None] * HEAD_DIM + offs_d[None, :]
        amax = tl.maximum(amax, tl.max(tl.load(AMAX + offs, mask=inside, other=0.0), axis=0))
        bad = tl.maximum(bad, tl.max(tl.load(BAD + offs, mask=inside, other=0).to(tl.int32), axis=0))
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    tl.store(SCALE + bh * HEAD_DIM + offs_d, scale)
    tl.store(SCALE_OUT + bh * HEAD_DIM + offs_d, tl.where(bad != 0, float("nan"), scale))


@triton.jit
def v_quantize_kernel(
    V, stride_vb, stride_vb_h, stride_vn, stride_vd,
    PERM, MU, SCALE, VT, MU_SCALED, MU_TF32,
    H, N, NB, NPAD,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HAS_PERM: tl.constexpr, V_SMOOTH: tl.constexpr,
    SOFTWARE_ROUNDING: tl.constexpr, PV_PERM: tl.constexpr, INT8: tl.constexpr = False,
    SCALE_PER_BLOCK: tl.constexpr = False, VT_LO=None,
):
    """Residual / per-channel scale -> E4M3 (INT8: integers in [-127, 127], the workstation kernel's
    INT8 P.V path; SCALE_PER_BLOCK: SCALE is [BH, NB, D], one scale per block and channel), stored
    transposed: VT [BH, D, NPAD] (zeros past N);
    PV_PERM: column a of each 32-key chunk holds key pipeline.pv_key(a) (the rows are gathered in
    that order, so the stores stay contiguous). With V-Smooth also the block's mean over the scale,
    MU_SCALED [BH, NB, D] fp32 (what the fused kernels add), and where MU_TF32 is given the Hopper
    kernel's 3xTF32 B operand of it, [BH * NB * D, 8] (pipeline.mu_tf32_pairs). VT_LO (E4M3 only;
    None: not written): V's second E4M3 term, the codes of what the first left (y - code), laid out
    as VT (reference/quant.py::e4m3_second_term)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_t = pid_n * BLOCK + tl.arange(0, BLOCK)  # the VT columns this program writes
    offs_d = tl.arange(0, HEAD_DIM)
    offs_k = offs_t  # the key each column holds
    if PV_PERM:  # column a of each 32-key chunk holds key pv_key(a): gather rows, store contiguous
        offs_k = (offs_t & ~14) | ((offs_t & 2) << 2) | ((offs_t >> 1) & 6)
    # Non-finite values pass through to y (NaN / inf in, NaN / inf out: the residual and the
    # multiply keep them) and are zeroed there, from y itself: a mask of finite inputs kept alive
    # until then cost ~4 instructions per element (packed into predicate bits and back; sm_90 SASS,
    # Triton 3.6, 4 warps: 2192 -> 1656 per thread).
    b_v, valid = _load_rows(V, stride_vb, stride_vb_h, stride_vn, stride_vd, PERM, b, h, bh, offs_k, offs_d,
                            N, HAS_PERM)
    if SCALE_PER_BLOCK:
        scale = tl.load(SCALE + (bh * NB + pid_n) * HEAD_DIM + offs_d)
    else:
        scale = tl.load(SCALE + bh * HEAD_DIM + offs_d)
    if V_SMOOTH:
        mu = tl.load(MU + (bh * NB + pid_n) * HEAD_DIM + offs_d).to(tl.float32)
        b_v = b_v - mu[None, :]
        row = (bh * NB + pid_n) * HEAD_DIM + offs_d  # this block's rows of [BH * NB * D, ...]
        mu_s = tl.math.div_rn(mu, scale)  # IEEE division, as torch's mu / scale
        tl.store(MU_SCALED + row, mu_s)
        if MU_TF32 is not None:
            # tf32 parts: hi = mu_s with the low 13 mantissa bits cleared, lo = mu_s - hi (exact);
            # columns 4-7 of this block's rows (hi, lo, hi, 0), and the same in columns 0-3 of the
            # next block's rows; block 0's columns 0-3 are zeros
            hi = (mu_s.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
            lo = mu_s - hi
            c = tl.arange(0, 4)[None, :]
            terms = tl.where(c == 1, lo[:, None], tl.where(c == 3, 0.0, hi[:, None]))  # [D, 4]
            tl.store(MU_TF32 + row[:, None] * 8 + 4 + c, terms)
            tl.store(MU_TF32 + (row[:, None] + HEAD_DIM) * 8 + c, terms,
                     mask=c < (pid_n + 1 < NB).to(tl.int32) * 4)  # all, or none for the last block
            tl.store(MU_TF32 + row[:, None] * 8 + c, tl.zeros_like(terms),
                     mask=c < (pid_n == 0).to(tl.int32) * 4)
    inv = tl.math.div_rn(1.0, scale)
    y = b_v * inv[None, :]  # a multiply, as in the Q/K quantiser (SASS: 4088 -> 2192)
    keep = valid[:, None] & (tl.abs(y) < float("inf"))
    if INT8:  # the exact product rounded once (int8_codes), as the reference
        codes = int8_codes(tl.where(keep, b_v, 0.0), inv[None, :], SOFTWARE_ROUNDING)
    else:
        y = tl.where(keep, y, 0.0)
        y_code = y
        if SOFTWARE_ROUNDING:
            y_code = round_to_e4m3_grid(y)
        codes = y_code.to(tl.float8e4nv)
    p_vt = VT + bh * HEAD_DIM * NPAD + offs_d[None, :] * NPAD + offs_t[:, None]
    tl.store(p_vt, codes)
    if VT_LO is not None:
        tl.static_assert(not INT8, "V's second term is an E4M3 one")
        y_lo = y - codes.to(tl.float32)  # exact: y and its code share the leading bits
        if SOFTWARE_ROUNDING:
            y_lo = round_to_e4m3_grid(y_lo)
        tl.store(VT_LO + bh * HEAD_DIM * NPAD + offs_d[None, :] * NPAD + offs_t[:, None], y_lo.to(tl.float8e4nv))


def quantize_v_residual(v, perm=None, v_smooth=True, software_rounding=None, pv_perm=False, mu_tf32=False,
                        v_terms=1):
    """v: [B, H, N, D] (any strides) -> dict with vt, scale, mu, mu_scaled, pv_perm and, with
    mu_tf32, mu_tf32_pairs; with v_terms=2, vt_lo (kernels/pipeline.py)."""
    return pipeline.quantize_v_residual(prepass_launch, v, perm, v_smooth, software_rounding, pv_perm, mu_tf32,
                                        v_terms)
