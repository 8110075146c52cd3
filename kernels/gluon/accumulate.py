"""Folding a key tile's products into the output: O <- alpha O + P V_residual + r mu, l <- alpha l + r.

r is the row sum of P's bytes, taken on the tensor cores as P times a [block_n, 8] tile of ones
(every column of the product is r), and mu V-Smooth's mean of the tile's block. Two ways to add r mu:

- accumulate: the fp32 FMA, mu read from shared memory (the mean row came with the tile by TMA),
  the Triton twin's arithmetic and order;
- Schedule.mean_mma: a tf32 wgmma r mu^T chained onto P.V's accumulator a tile late (no shared loads,
  64 FFMA fewer per thread per tile, no wait of its own), in 3xTF32: r = r_hi + r_lo and
  mu = mu_hi + mu_lo (pipeline.mu_tf32_pairs), the sum r_hi mu_hi + r_hi mu_lo + r_lo mu_hi, about
  2^-21 of r mu where an fp32 FMA has 2^-24. The row sum l is then kept as [rows, 4] in rs's even
  columns (row_sum_update), so it needs no reduction across lanes either.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import _core as _glcore
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_accumulator


@_glcore.builtin
def acc_relayout(acc, layout, _semantic=None):
    """An accumulator, in flight or not, seen in another layout with the same registers (checked:
    assert_trivial). mean_mma chains its tf32 wgmma onto P.V's FP8 one: their accumulators differ
    only in the instruction's K (32 vs 8), which Gluon's types carry, and gl.convert_layout refuses a
    wgmma still in flight. (A builtin: Gluon's public API has no relayout of an in-flight
    accumulator.)"""
    layout = _glcore._unwrap_if_constexpr(layout)
    if isinstance(acc, warpgroup_mma_accumulator):
        t = _semantic.convert_layout(_glcore.tensor(acc.handle, acc.type.tensor_type), layout, assert_trivial=True)
        return warpgroup_mma_accumulator(t.handle, t.type)
    return _semantic.convert_layout(acc, layout, assert_trivial=True)


@gluon.jit
def accumulate(o, l_i, pv, rs, alpha, mu_buf, cfg: gl.constexpr):
    """O <- alpha O + P V_residual + r mu ; l <- alpha l + r, in fp32, with r from rs = P times the ones
    tile (its 8 columns are all r) and mu V-Smooth's mean row of the tile (plain V: no mean)."""
    o_layout: gl.constexpr = cfg.o_layout
    r = gl.convert_layout(gl.max(rs, axis=1), gl.SliceLayout(1, o_layout))
    alpha = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    l_i = l_i * alpha + r
    o = o * gl.expand_dims(alpha, 1) + pv
    if cfg.numerics.has_mean:
        mu = mu_buf.load(o_layout)  # [1, D]: this tile's mean row, by TMA with the tile
        o = o + gl.expand_dims(r, 1) * mu
    return o, l_i


@gluon.jit
def tf32_terms(w, n_even, ROWS: gl.constexpr):
    """[ROWS, 8] row values (rs's layout: every column the row's value) -> [ROWS, 4], column c held
    by lane c: (r_hi, r_hi, r_lo, r_hi), r = r_hi + r_lo in tf32 parts (mean_operand)."""
    r4, _ = gl.split(gl.reshape(w, [ROWS, 4, 2]))
    hi = (r4.to(gl.int32, bitcast=True) & -8192).to(gl.float32, bitcast=True)  # tf32: 10 mantissa bits
    return gl.where(n_even == 4, r4 - hi, hi)  # A's column 2 (rs's column 4) holds r_lo


@gluon.jit
def mean_operand(w, n_even, cfg: gl.constexpr):
    """mean_mma: the A operand [ROWS, 8] of the tf32 wgmma r mu^T; w is r already scaled to the
    reference point of the P.V it rides on. A's columns 4-7 (r_hi, r_hi, r_lo, r_hi) meet B's rows
    4-7 (mu_hi, mu_lo, mu_hi, 0) of the tile's block; columns 0-3 (B's rows 0-3 hold the block before,
    pipeline.mu_tf32_pairs) are zeros. rs's 8 columns are all r, each thread holding columns 2c,
    2c + 1 (c = lane % 4); the tf32 A fragment wants columns c, c + 4 in that thread: a renaming of
    registers, no exchange between lanes."""
    ROWS: gl.constexpr = cfg.tiles.rows
    new = tf32_terms(w, n_even, ROWS)
    old = new * 0.0  # zeros, computed: constant zeros in an A operand make ptxas serialise every wgmma (C7511)
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(old, new), [0, 2, 1]), [ROWS, 8]), cfg.mu_a_layout)


@gluon.jit
def row_sum_update(l4, rs, alpha, cfg: gl.constexpr):
    """mean_mma: l <- alpha l + r kept as [ROWS, 4] (every column l) in rs's even columns."""
    ROWS: gl.constexpr = cfg.tiles.rows
    rs_layout: gl.constexpr = cfg.rs_layout
    alpha8, _ = gl.broadcast(gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, rs_layout)), 1), rs)
    alpha4, _ = gl.split(gl.reshape(alpha8, [ROWS, 4, 2]))
    r4, _ = gl.split(gl.reshape(rs, [ROWS, 4, 2]))
    return l4 * alpha4 + r4
