"""NVFP4, written out plainly: E2M1 values, one E4M3 scale per 16 elements, one FP32 scale per tensor.

E2M1 (sign, 2 exponent bits, 1 mantissa bit) has the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, codes
0..7 in that order; bit 3 of a 4-bit code is the sign. Rounding is to nearest, ties to the even code
(the one whose mantissa bit is 0), saturating at 6 -- what `cvt.rn.satfinite.e2m1x2.f32` does:

    |y| in   [0, 0.25] (0.25, 0.75) [0.75, 1.25] (1.25, 1.75) [1.75, 2.5] (2.5, 3.5) [3.5, 5] (5, inf)
    value        0         0.5           1           1.5           2          3         4        6

The scale rule (the usual NVFP4 recipe; the "tensor" is one (batch, head) slice, i.e. what one
kernel program sees, so that every scale is a scalar there):

    s      = amax(|x| over the slice) / (6 * 448)              FP32 "global" scale (1 if amax = 0)
    b_g    = E4M3( amax(|x| over group g) / (6 * s) )           per 16 elements along the reduction
                                                                dim, round to nearest even, <= 448
    code   = E2M1( x * RN(1 / (b_g * s)) )                      0 where b_g rounded to 0
    x_hat  = code * b_g * s

Q, K and V (quantised before the kernel) search the block scale instead (quantize_nvfp4's
factors, NVFP4_SCALE_SEARCH): b_g = E4M3(amax_g / (6 s) * f) for the f of a short list that gives
the group the smallest largest element error, f = 1 being the rule above (factors=(1.0,) alone:
plain NVFP4). A scale rounded down clips the group's largest elements; one rounded up, or a smaller
one that clips a lone outlier, can fit the rest of the group better.

With the rule above, b_g rounded to nearest, x / (b_g s) may reach 6 * (1 + 2^-4) = 6.375 before saturation:
the clipping error (<= 0.375 b_g s) stays inside the half-step at the top of the grid (1.0 b_g s),
so the element error is bounded by half the E2M1 spacing at its magnitude times b_g s:
0.25 b_g s for |code| <= 2, 0.5 for <= 4, 1.0 above (about amax_g / 6 * 1.06 at worst).

Divisions are IEEE (true_div, reciprocal) so that the Triton pre-pass (div_rn) produces the same codes
bit for bit; x is multiplied by the reciprocal of its group's unit (one division per group).

P (the softmax probabilities, 0 < p <= 1 after the running max) uses the fixed global scale
s_P = 1 / (6 * 448): b_g = E4M3(amax_g * 448), code = E2M1(p * (6 * 448 / b_g)). P then carries the
factor 6 * 448 = 2688 (as the 8-bit P carries 2^8); it cancels in O = A / l because the row sum l is
taken over the same decoded values.
"""

import torch

from .quant import E4M3_MAX, reciprocal, round_to_e4m3, true_div

E2M1_MAX = 6.0
NVFP4_GROUP = 16
NVFP4_BLOCK_N = 128  # keys per tile of the 4-bit recurrence (the Triton kernel's tile; see attention_fp4.py)
NVFP4_RANGE = E2M1_MAX * E4M3_MAX  # 2688: amax / 2688 is the global scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision points between consecutive codes; ">" means a tie goes down (to the even code below),
# ">=" up (to the even code above). code = number of points passed.
_E2M1_POINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                (5.0, False))


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 y -> 4-bit E2M1 codes (uint8 0..15; bit 3 = sign), nearest, ties to even, saturating.
    NaN gives code 0 (callers flag non-finite inputs before)."""
    y = y.float()
    a = y.abs()
    mag = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for point, inclusive in _E2M1_POINTS:
        mag += (a >= point if inclusive else a > point).to(torch.uint8)
    return mag | ((y < 0) & (mag > 0)).to(torch.uint8) << 3


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 0..15) -> fp32 values."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = lut[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to the E2M1 grid (nearest, ties to even, saturating at 6)."""
    return decode_e2m1(e2m1_codes(y))


def _group_view(x: torch.Tensor, dim: int, group: int):
    """Move `dim` last and split it into groups of `group` (zero-padded): -> [..., G, group], pad."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    pad = (-n) % group
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group), n


def _ungroup(y: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    y = y.reshape(*y.shape[:-2], -1)[..., :n]
    return y.movedim(-1, dim)


def global_scale(x: torch.Tensor, lead_dims: int = 2) -> torch.Tensor:
    """Per-slice FP32 scale amax / (6 * 448) over all dims after the first `lead_dims` (1 where the
    slice is all zero). x must be finite. Returns shape x.shape[:lead_dims]."""
    amax = x.float().abs().reshape(*x.shape[:lead_dims], -1).amax(dim=-1)
    return torch.where(amax > 0, true_div(amax, NVFP4_RANGE), torch.ones_like(amax))


# The group scale's search (quantize_nvfp4): candidates b = E4M3(amax / (6 s) * f), the first the
# usual rule; each group keeps the one with the smallest largest element error. Measured on the
# real-clip probes (FIDELITY.md): Q's, K's and V's searched +0.7 dB at the attention output (five
# candidates, adding 1.125 and 0.875: +0.8), nothing in the attention kernel; the pre-pass pays for
# it (BENCHMARKS.md). NVFP4_SEARCH: which of "q", "k", "v" search.
NVFP4_SCALE_SEARCH = (1.0, 1.0625, 0.9375)
NVFP4_SEARCH = "qkv"

# V-Smooth's mean at 4 bits: one per 8 tokens of the permuted V (ours; the paper's is one per 128-row
# block, mean group 128 here). At 4 bits the 16-token groups still see most of a 128-row block's
# range around its mean; the means of the finer groups take it out (FIDELITY.md: over the block mean
# +1.7 to +2.0 dB at the attention output on 5-7K-token probes, +0.4 to +1.0 at 52-71K tokens). The
# kernel restores them from the row sums of P per 8 keys, 16 per 128-key tile: exactly the K of one
# FP16 mma (mean_operand_fp16).
NVFP4_MEAN_GROUP = 8


def mean_operand_fp16(mu: torch.Tensor, lead_dims: int = 2):
    """The 4-bit kernel's operand of V-Smooth's group means: mu [B, H, G, D] (bf16 values, any
    float dtype) -> (mu * 2^-e as fp16, e) with one power of two 2^e per (batch, head) that puts
    max |mu| * 2^-e in (2^14, 2^15] (e = 0 for zero means). A bf16 value times a power of two is an
    fp16 value inside fp16's normal range, so the operand is the stored mean exactly there; a mean
    below 2^-28 of the head's largest underflows into fp16's subnormals (an error under 2^-38 of it).
    The kernel takes the row sums of P per group in fp16 too (for groups of 8 exact: one E4M3 scale
    times at most 8 E2M1 codes, 11 significant bits)."""
    amax = mu.float().abs().amax(dim=tuple(range(lead_dims, mu.dim())))
    e = torch.where(amax > 0, torch.ceil(torch.log2(torch.where(amax > 0, amax, 1.0))) - 15, 0.0)
    # log2 is exact at powers of two; elsewhere its rounding can move the ceil by one either way
    e = torch.where(amax * torch.exp2(-e) > 2.0 ** 15, e + 1, e)
    e = torch.where((amax > 0) & (amax * torch.exp2(-e) <= 2.0 ** 14), e - 1, e)
    e_b = e.reshape(*e.shape, *([1] * (mu.dim() - lead_dims)))
    return (mu.float() * torch.exp2(-e_b)).to(torch.float16), e


def quantize_nvfp4(x: torch.Tensor, dim: int = -1, group: int = NVFP4_GROUP, lead_dims: int = 2,
                   scale: torch.Tensor = None, factors=NVFP4_SCALE_SEARCH):
    """x: [B, H, ...] -> (codes uint8 0..15 shaped like x, block scales fp32 (E4M3 values) shaped
    like x with `dim` replaced by ceil(n / group) groups, global scale fp32 [B, H], bad bool like x).

    Groups run along `dim` (the reduction dim of the matmul that consumes x); a partial last group
    is padded with zeros. Non-finite elements are quantised as 0 and flagged in `bad`.
    `scale` overrides the global scale (shape x.shape[:lead_dims]).
    factors: the group scale's candidates b = E4M3(amax / (6 s) * f) in order; each group keeps the
    first with the smallest max |y - E2M1(y)| * b s over its elements, y = x * RN(1 / (b s)) (every
    step exact or one IEEE rounding, so the Triton pre-pass makes the same choice bit for bit).
    (1.0,): the usual rule alone (plain NVFP4).
    """
    x = x.float()
    bad = ~torch.isfinite(x)
    x = torch.where(bad, torch.zeros((), device=x.device), x)
    s = global_scale(x, lead_dims) if scale is None else scale.float()
    xg, n = _group_view(x, dim, group)
    s_g = s.reshape(*s.shape, *([1] * (xg.dim() - lead_dims)))
    amax = xg.abs().amax(dim=-1, keepdim=True)
    base = true_div_t(amax, s_g * E2M1_MAX)
    best = None
    for f in factors:
        bscale = round_to_e4m3(base * f)
        unit = bscale * s_g
        y = xg * torch.where(unit > 0, reciprocal(torch.where(unit > 0, unit, torch.ones_like(unit))),
                             torch.zeros_like(unit))
        codes = e2m1_codes(y)
        err = _group_error(y, codes, unit, amax)
        if best is None:
            best = (codes, bscale, err)
        else:
            keep = err < best[2]
            best = tuple(torch.where(keep, new, old) for new, old in zip((codes, bscale, err), best))
    codes, bscale, _ = best
    return _ungroup(codes, n, dim), bscale.squeeze(-1).movedim(-1, dim), s, bad


def _group_error(y, codes, unit, amax):
    """max |y - E2M1(y)| * unit per group: |y| - |value| is exact (Sterbenz: the value is y's
    nearest grid point, y < 12), the max is exact, one rounding in the product; a scale that
    rounded to 0 under a nonzero group counts as infinite error."""
    d = (y.abs() - decode_e2m1(codes).abs()).abs().amax(dim=-1, keepdim=True)
    return torch.where(unit > 0, d * unit, torch.where(amax > 0, torch.full_like(d, float("inf")), d))


def true_div_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b (tensors), IEEE on every device (a tensor divisor is never turned into a reciprocal)."""
    return a / b


def dequantize_nvfp4(codes, bscale, s, dim: int = -1, group: int = NVFP4_GROUP, lead_dims: int = 2):
    """Inverse of quantize_nvfp4: code * block scale * global scale, fp32, shaped like codes."""
    vals, n = _group_view(decode_e2m1(codes), dim, group)
    b = bscale.movedim(dim, -1)[..., None]
    s_b = s.float().reshape(*s.shape, *([1] * (vals.dim() - lead_dims)))
    return _ungroup(vals * b * s_b, n, dim)


def nvfp4_block_values(codes, bscale, dim: int = -1, group: int = NVFP4_GROUP):
    """code * block scale (the global scale left out, as the kernels fold it into one scalar)."""
    vals, n = _group_view(decode_e2m1(codes), dim, group)
    return _ungroup(vals * bscale.movedim(dim, -1)[..., None], n, dim)


def quantize_p_nvfp4(p: torch.Tensor, group: int = NVFP4_GROUP) -> torch.Tensor:
    """Softmax probabilities p in [0, 1] (rows along the last dim, the keys) -> the decoded NVFP4
    values of p * 2688, as the kernel computes them: per 16 keys b = E4M3(amax * 448),
    code = E2M1(p * (2688 / b)) (0 where b = 0), value = code * b."""
    pg, n = _group_view(p.float(), -1, group)
    b = round_to_e4m3(pg.amax(dim=-1, keepdim=True) * E4M3_MAX)
    recip = true_div_t(torch.full_like(b, NVFP4_RANGE), torch.where(b > 0, b, torch.ones_like(b)))
    y = torch.where(b > 0, pg * recip, torch.zeros_like(pg))
    return _ungroup(decode_e2m1(e2m1_codes(y)) * b, n, -1)
