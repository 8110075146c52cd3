"""Quantisers of the method, written out plainly.

Q and K: INT8 with one scale per block of 128 tokens (SageAttention-style; K is smoothed first by
subtracting its token mean, which is exact for softmax). INT8 rather than FP8 for Q/K: both run at the
same tensor-core rate on Hopper, and INT8's uniform grid keeps more bits for the scores.

V residual: FP8 E4M3 with one scale per channel over all tokens of a (batch, head), as
SageAttention's per-channel V.

Non-finite inputs: the quantisers replace them by 0 so no kernel ever sees NaN codes, and return
flags so the attention can put NaN back where SDPA would have NaN (see attention.py).
"""

import math

import torch

LOG2E = math.log2(math.e)
INT8_MAX = 127.0
E4M3_MAX = 448.0
QK_BLOCK = 128  # tokens per Q/K scale; the kernels' tiles divide it


def true_div(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c rounded as IEEE division on every device. (On CUDA, torch divides by a Python scalar
    as a multiplication by its reciprocal, which can differ in the last bit; the kernels divide
    exactly, and the scales must agree to the bit for the codes to agree.)"""
    return x / torch.full_like(x, c)


def smoothing_mean(k: torch.Tensor) -> torch.Tensor:
    """K's token mean [B, H, D] in fp32, subtracted before K is quantised (exact for softmax: a
    constant per query row). Taken on K as the caller passes it, before any permutation, by this
    one call in the reference and in the kernels' pre-pass (kernels/pipeline.py) alike: a mean one
    bit apart gives K scales one bit apart, and under ExpCast's folded conversion
    (kernels/triton/online.py::expcast_fold) a scale's last bit moves its tile's byte grid, which
    flips about 0.1% of the tile's bytes (measured: 3-6e-4 relative change of the whole output at
    N = 4,096 for one scale). NaN or inf when K holds them (those heads become NaN)."""
    return k.mean(dim=2, dtype=torch.float32)


def fold_score_scale(q_scales: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Q's block scales times sm_scale * log2(e): the factor the kernels hold, one fp32 product of
    fp32 operands on every device (full_like, as true_div: no dependence on how torch treats a
    Python scalar on a device, and no host-to-device copy in the pre-pass)."""
    return q_scales * torch.full_like(q_scales, sm_scale * LOG2E)


def reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1 / x rounded as IEEE division on every device (torch.reciprocal may be approximate on a
    GPU). The quantisers multiply by the reciprocal of the scale rather than divide by the scale:
    on the GPU a division per element cost a third to a half of their instructions."""
    return torch.ones_like(x) / x


def _per_block_scales(x: torch.Tensor, block: int, qmax: float):
    """The per-block part shared by the Q/K quantisers: (x with non-finite values zeroed,
    scale of each row's block [B, H, N, 1], scales [B, H, ceil(N/block)], bad_rows [B, H, N]).
    scale = max|x| over the block / qmax (1 where the block is all zero)."""
    B, H, N, D = x.shape
    x = x.float()
    finite = torch.isfinite(x)
    bad_rows = ~finite.all(dim=-1)
    x = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
    nb = -(-N // block)
    xp = torch.nn.functional.pad(x, (0, 0, 0, nb * block - N))
    amax = xp.reshape(B, H, nb, block * D).abs().amax(dim=-1)
    scales = torch.where(amax > 0, true_div(amax, qmax), torch.ones_like(amax))
    per_row = scales.repeat_interleave(block, dim=-1)[..., :N, None]
    return x, per_row, scales, bad_rows


def quantize_int8_per_block(x: torch.Tensor, block: int = QK_BLOCK):
    """x: [B, H, N, D] -> (codes int8 [B, H, N, D], scales fp32 [B, H, ceil(N/block)], bad_rows bool [B, H, N]).

    scale = max|x| over the block / 127 (1 where the block is all zero); codes = round(x * (1 / scale)):
    the exact product rounded once to the nearest integer, ties to even (the kernels' FMA; the
    float64 product of two fp32 numbers is exact). Non-finite elements are quantised as 0 and their
    rows are flagged.
    """
    x, per_row, scales, bad_rows = _per_block_scales(x, block, INT8_MAX)
    codes = torch.round(x.double() * reciprocal(per_row).double()).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scales, bad_rows


def quantize_fp8_per_block(x: torch.Tensor, block: int = QK_BLOCK):
    """Like quantize_int8_per_block, on the E4M3 grid: scale = max|x| / 448 per block of tokens;
    codes returned as fp32 values on the grid. (The alternative Q/K format: no int->float
    conversion of the scores in the kernel, but 3 mantissa bits instead of INT8's 7.)"""
    x, per_row, scales, bad_rows = _per_block_scales(x, block, E4M3_MAX)
    return round_to_e4m3(x * reciprocal(per_row)), scales, bad_rows


QK_FORMATS = {"int8": quantize_int8_per_block, "fp8": quantize_fp8_per_block}


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the E4M3 grid (round to nearest even, saturating at 448), back as fp32."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def e4m3_second_term(r: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """V's residual in two E4M3 terms on one per-channel scale (the kernels' v_terms=2): the E4M3 codes of
    what rounding r to `codes` left, r / scale - codes, on the grid of quantize_e4m3_per_channel
    (|remainder| <= half a step of a code, so at most 16). codes + second term is exact in fp32 (two
    4-bit significands a few octaves apart) and carries 7-8 significant bits where one code has 4:
    the kernels run P V_hi + P V_lo as two FP8 products into one accumulator."""
    y = r.float() * reciprocal(scales)[..., None, :]
    y = torch.where(torch.isfinite(y), y, torch.zeros((), dtype=y.dtype, device=y.device))
    return round_to_e4m3(y - codes)


def quantize_e4m3_per_channel(r: torch.Tensor, max_code: float = E4M3_MAX):
    """r: [B, H, N, D] -> (codes as fp32 values on the E4M3 grid, scales fp32 [B, H, D], bad_channels bool [B, H, D]).

    scale[d] = max_t |r[t, d]| / max_code (1 where the channel is all zero); codes = e4m3(r * (1 / scale)).
    max_code: the largest code, 448 (E4M3's largest); a kernel that accumulates P V in fp16 takes a
    smaller one. Non-finite elements are quantised as 0 and their channels flagged.
    """
    r = r.float()
    finite = torch.isfinite(r)
    bad_channels = ~finite.all(dim=-2)
    r = torch.where(finite, r, torch.zeros((), dtype=r.dtype, device=r.device))
    amax = r.abs().amax(dim=-2)
    scales = torch.where(amax > 0, true_div(amax, max_code), torch.ones_like(amax))
    codes = round_to_e4m3(r * reciprocal(scales)[..., None, :])
    return codes, scales, bad_channels


def quantize_int8_per_block_channel(r: torch.Tensor, block: int = QK_BLOCK):
    """r: [B, H, N, D] -> (codes as fp32 integers in [-127, 127], scales fp32 [B, H, ceil(N/block), D],
    bad_channels bool [B, H, D]): scale = max |r| / 127 per (block of `block` rows, channel) (1 where
    that block's channel is all zero), codes = round(r * (1 / scale)) with the exact product rounded
    once, ties to even (the kernels' FMA, as quantize_int8_per_block). Non-finite elements are
    quantised as 0 and their channels flagged."""
    r = r.float()
    finite = torch.isfinite(r)
    bad_channels = ~finite.all(dim=-2)
    r = torch.where(finite, r, torch.zeros((), dtype=r.dtype, device=r.device))
    B, H, N, D = r.shape
    nb = -(-N // block)
    amax = torch.nn.functional.pad(r.abs(), (0, 0, 0, nb * block - N)).reshape(B, H, nb, block, D).amax(dim=3)
    scales = torch.where(amax > 0, true_div(amax, INT8_MAX), torch.ones_like(amax))
    per_row = scales.repeat_interleave(block, dim=2)[:, :, :N]
    codes = torch.round(r.double() * reciprocal(per_row).double()).clamp(-INT8_MAX, INT8_MAX)
    return codes.float(), scales, bad_channels


def smooth_q(q: torch.Tensor, k: torch.Tensor, sm_scale: float):
    """Q smoothing (an option, off by default): Q's token mean qm [B, H, 1, D] (fp32) comes out of Q
    before quantising and returns as a per-key bias sm_scale * (qm . k_j) [B, H, 1, N], so that
    (q_i - qm) . k_j * sm_scale + bias_j = q_i . k_j * sm_scale exactly in exact arithmetic. In the
    kernels the bias rides the existing per-key bias input (one FADD per score). k: the K the scores
    use (smoothed or not: K's smoothing shifts every bias of a row by one constant). q and k finite.
    Returns (qm, bias), in fp32 (float64 for float64 inputs: the exactness test)."""
    dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
    qm = q.to(dt).mean(dim=2, keepdim=True)
    bias = (k.to(dt) @ qm.transpose(-1, -2)).transpose(-1, -2) * sm_scale
    return qm, bias
