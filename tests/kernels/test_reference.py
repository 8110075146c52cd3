"""The exact parts of the method, in the readable reference: they must change nothing."""

import math

import pytest
import torch

from vc_attention.kernels.reference import (
    block_means,
    demean,
    exact_attention,
    online_attention,
    permute_tokens,
    quantize_e4m3_per_channel,
    quantize_int8_per_block,
    reference_vc_attention,
)
from vc_attention.kernels.reference.attention import LOG2E

from kernel_helpers import rel_l2, video_like_qkv


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_joint_permutation_is_exact(seed, with_bias):
    """softmax(Q K[pi]^T) V[pi] == softmax(Q K^T) V for non-causal attention (fp64, ~1e-12),
    with a per-key bias permuted the same way."""
    g = torch.Generator().manual_seed(seed)
    B, H, N, D = 2, 3, 203, 32
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    bias = None
    if with_bias:
        bias = torch.zeros(B, 1, 1, N, dtype=torch.float64)
        bias[..., -37:] = -math.inf  # text padding
        bias[..., :10] = torch.randn(B, 1, 1, 10, generator=g, dtype=torch.float64)
    perm = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).view(B, H, N)
    kp, vp = permute_tokens(k, perm), permute_tokens(v, perm)
    bp = None if bias is None else torch.gather(bias.expand(B, H, 1, N), 3, perm[:, :, None, :])
    ref = exact_attention(q, k, v, key_bias=bias)
    out = exact_attention(q, kp, vp, key_bias=bp)
    assert (out - ref).abs().max().item() < 1e-12
    # The reference pipeline in exact mode, given the permutation, agrees too.
    full = reference_vc_attention(q, k, v, bits=16, perm=perm, key_bias=bias, dtype=torch.float64)
    assert (full - ref).abs().max().item() < 1e-12


@pytest.mark.parametrize("N", [77, 128, 300])
def test_mean_restoration_is_exact_without_quantisation(N):
    """Demeaning V per 128-row block and adding mu back from the row sums changes nothing when the
    residual is not quantised (mu is rounded to bf16 first, and R is taken against that value)."""
    q, k, v = video_like_qkv(1, 2, N, 64, seed=N, dtype=torch.float64)
    mu = block_means(v)
    assert mu.shape == (1, 2, -(-N // 128), 64)
    assert torch.equal(mu, mu.to(torch.bfloat16).double())  # stored in 16 bits
    r = demean(v, mu)
    scale = 64 ** -0.5 * LOG2E
    with_mean = online_attention(q, k, r, score_scale=scale, mu=mu, dtype=torch.float64)
    plain = online_attention(q, k, v, score_scale=scale, dtype=torch.float64)
    exact = exact_attention(q, k, v)
    assert (with_mean - exact).abs().max().item() < 1e-12
    assert (plain - exact).abs().max().item() < 1e-12


def test_block_mean_of_partial_last_block_averages_only_its_rows():
    v = torch.zeros(1, 1, 130, 4, dtype=torch.float64)
    v[0, 0, 128:] = 3.0
    mu = block_means(v, store_dtype=None)
    assert torch.equal(mu[0, 0, 1], torch.full((4,), 3.0, dtype=torch.float64))


@pytest.mark.parametrize("block_n", [32, 64, 128])
def test_online_recurrence_equals_softmax(block_n):
    q, k, v = video_like_qkv(2, 2, 333, 64, seed=5, dtype=torch.float64)
    bias = torch.zeros(2, 1, 1, 333, dtype=torch.float64)
    bias[0, ..., 300:] = -math.inf
    out = online_attention(q, k, v, score_scale=0.125 * LOG2E, key_bias_log2=bias * LOG2E,
                           block_n=block_n, dtype=torch.float64)
    ref = exact_attention(q, k, v, sm_scale=0.125, key_bias=bias)
    assert (out - ref).abs().max().item() < 1e-12


def test_online_recurrence_rejects_tiles_that_straddle_mean_blocks():
    q, k, v = video_like_qkv(1, 1, 50, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="must divide 128"):
        online_attention(q, k, v, score_scale=1.0, block_n=96)


def test_int8_block_quantiser():
    x = torch.randn(1, 2, 300, 64, dtype=torch.float64) * 3
    codes, scales, bad = quantize_int8_per_block(x)
    assert codes.dtype == torch.int8 and scales.shape == (1, 2, 3) and not bad.any()
    assert codes.abs().max() == 127
    deq = codes.double() * scales.repeat_interleave(128, -1)[..., :300, None]
    assert (deq - x).abs().max() <= scales.max() / 2 + 1e-12  # half a step at most


def test_e4m3_per_channel_quantiser_uses_one_scale_per_channel_over_all_tokens():
    r = torch.randn(1, 1, 500, 8)
    r[..., 3] *= 100
    codes, scales, bad = quantize_e4m3_per_channel(r)
    assert scales.shape == (1, 1, 8) and not bad.any()
    assert torch.allclose(scales[0, 0], r.abs().amax(dim=2)[0, 0] / 448)
    assert torch.equal(codes, codes.to(torch.float8_e4m3fn).float())  # on the E4M3 grid
    assert rel_l2(codes * scales[..., None, :], r) < 0.04


def test_8bit_reference_is_close_to_exact_and_v_smooth_helps_with_outlier_tokens():
    q, k, v = video_like_qkv(1, 4, 512, 128, seed=11)
    exact = exact_attention(q, k, v).float()
    plain = reference_vc_attention(q, k, v, bits=8, v_smooth=False)
    smooth = reference_vc_attention(q, k, v, bits=8, v_smooth=True)
    assert rel_l2(plain, exact) < 0.05
    assert rel_l2(smooth, exact) < rel_l2(plain, exact)
