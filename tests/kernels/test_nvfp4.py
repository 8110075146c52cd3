"""4-bit NVFP4 path (issue 6) on the CPU: the E2M1 grid and scale rule, the 4-bit reference, the Triton
kernel through the interpreter (its decoded twin; see below), compilation for sm_100 / sm_120 without
a GPU, and the per-architecture dispatch.

Bounds stated here were measured on video_like_qkv data (tests/kernel_helpers.py):
- NVFP4 round trip of Gaussian data: relative L2 error about 0.08-0.10 (asserted < 0.11).
- 4-bit reference attention vs exact (float64) attention, N = 512, D = 64: relative L2 error
  0.032-0.045 over 4 seeds (asserted < 0.06); the 8-bit path is at 0.005-0.007.
- V-Smooth 4-bit (k-means plan + demeaning) vs plain 4-bit, N = 1024: 0.024 vs 0.028-0.032 relative
  L2 error (15-23% lower on 4 of 4 seeds; 5-20% at N = 512); asserted lower by 5% on one seed.
"""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vc_attention.kernels import dispatch, explain_backend, plan_v_smooth, vc_attention
from vc_attention.kernels.dispatch import CallSpec, choose_backend
from vc_attention.kernels.reference import exact_attention, permute_tokens, reference_vc_attention
from vc_attention.kernels.reference.nvfp4 import (E2M1_VALUES, NVFP4_MEAN_GROUP, NVFP4_RANGE, decode_e2m1,
                                                  dequantize_nvfp4, e2m1_codes, mean_operand_fp16,
                                                  quantize_nvfp4, quantize_p_nvfp4, round_to_e2m1)
from vc_attention.kernels.reference.quant import round_to_e4m3
from vc_attention.kernels.reference.vsmooth import block_means, demean

from kernel_helpers import rel_l2, video_like_qkv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                 reason="runs the Triton kernels through TRITON_INTERPRET=1 (CPU)")


# --- the E2M1 grid ------------------------------------------------------------------------------

def test_every_e2m1_value_round_trips_exactly():
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes)
    assert values[:8].tolist() == list(E2M1_VALUES) and values[8:].tolist() == [-v for v in E2M1_VALUES]
    assert torch.equal(round_to_e2m1(values), values)
    again = e2m1_codes(values)
    assert torch.equal(again[codes != 8], codes[codes != 8])  # -0 comes back as +0 (same value)


def test_midpoints_round_to_even_and_saturate():
    mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expect = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # the code with mantissa bit 0
    assert torch.equal(round_to_e2m1(mid), expect)
    assert torch.equal(round_to_e2m1(-mid), -expect)
    up, down = torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)
    grid = torch.tensor(E2M1_VALUES)
    above = grid[torch.searchsorted(grid, mid)]        # the grid value just above each midpoint
    below = grid[torch.searchsorted(grid, mid) - 1]
    assert torch.equal(round_to_e2m1(up), above) and torch.equal(round_to_e2m1(down), below)
    assert round_to_e2m1(torch.tensor([6.2, 1e30, -7.0])).tolist() == [6.0, 6.0, -6.0]


def test_rounding_is_nearest_on_a_dense_sweep():
    y = torch.linspace(-7, 7, 20001)
    r = round_to_e2m1(y)
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES[1:]))
    best = (y[:, None] - grid[None, :]).abs().min(dim=1).values
    assert torch.equal((y - r).abs(), best)


# --- the scale rule and round-trip bounds -------------------------------------------------------

@pytest.mark.parametrize("dim", [-1, -2])
def test_scale_rule_and_round_trip_bound(dim):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 200, 64, generator=g)
    x[0, 1, 7] *= 40.0  # an outlier token
    codes, bscale, s, bad = quantize_nvfp4(x, dim=dim, factors=(1.0,))  # the usual rule alone
    assert not bad.any()
    amax = x.abs().flatten(2).amax(-1)
    assert torch.equal(s, amax / torch.full_like(amax, NVFP4_RANGE))
    # block scale = E4M3(group amax / (6 s)); the group holding the slice's amax gets 448
    xg = torch.nn.functional.pad(x.movedim(dim, -1), (0, (-x.shape[dim]) % 16)).unflatten(-1, (-1, 16))
    gamax = xg.abs().amax(-1)
    expect = round_to_e4m3(gamax / (s[..., None, None] * 6.0))
    assert torch.equal(bscale.movedim(dim, -1), expect)
    assert bscale.max() == 448.0 and bscale.flatten(2).amax(-1).eq(448.0).all()
    # elementwise: |x - x_hat| <= half the E2M1 spacing at |x| / unit, times unit = b * s
    xh = dequantize_nvfp4(codes, bscale, s, dim=dim)
    unit = (expect * s[..., None, None])[..., None].expand_as(xg).flatten(-2)
    unit = unit[..., : x.shape[dim]].movedim(-1, dim)
    y = (x / unit).abs()
    half = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
    assert ((x - xh).abs() <= half * unit * (1 + 1e-6)).all()
    # Gaussian data: relative L2 round-trip error about 0.08-0.10
    assert rel_l2(xh, x) < 0.11


@pytest.mark.parametrize("dim", [-1, -2])
def test_scale_search_keeps_the_best_candidate(dim):
    """The group-scale search (NVFP4_SCALE_SEARCH, the default): every group's scale is one of the
    candidates E4M3(amax / (6 s) f), its largest element error is never above the usual rule's
    (f = 1 is a candidate) and below it on many groups, and the round trip is closer overall."""
    from vc_attention.kernels.reference.nvfp4 import NVFP4_SCALE_SEARCH

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 200, 64, generator=g)
    x[0, 1, 7] *= 40.0
    c0, b0, s0, _ = quantize_nvfp4(x, dim=dim, factors=(1.0,))
    c1, b1, s1, _ = quantize_nvfp4(x, dim=dim)
    assert NVFP4_SCALE_SEARCH[0] == 1.0 and torch.equal(s0, s1)
    xg = torch.nn.functional.pad(x.movedim(dim, -1), (0, (-x.shape[dim]) % 16)).unflatten(-1, (-1, 16))
    base = xg.abs().amax(-1) / (s0[..., None, None] * 6.0)
    cands = torch.stack([round_to_e4m3(base * f) for f in NVFP4_SCALE_SEARCH])
    assert (cands == b1.movedim(dim, -1)[None]).any(0).all()

    def group_err(c, b):
        xh = dequantize_nvfp4(c, b, s0, dim=dim)
        e = torch.nn.functional.pad((x - xh).abs().movedim(dim, -1), (0, (-x.shape[dim]) % 16))
        return e.unflatten(-1, (-1, 16)).amax(-1)

    e0, e1 = group_err(c0, b0), group_err(c1, b1)
    assert (e1 <= e0 * (1 + 1e-6)).all()
    assert (e1 < e0 * 0.99).float().mean() > 0.2
    assert rel_l2(dequantize_nvfp4(c1, b1, s1, dim=dim), x) < rel_l2(dequantize_nvfp4(c0, b0, s0, dim=dim), x)


def test_non_finite_and_zero_inputs():
    x = torch.zeros(1, 1, 4, 32)
    x[0, 0, 1, 3] = float("nan")
    x[0, 0, 2, 5] = float("inf")
    x[0, 0, 3, :16] = 1.0
    codes, bscale, s, bad = quantize_nvfp4(x)
    assert bad[0, 0, 1, 3] and bad[0, 0, 2, 5] and bad.sum() == 2
    xh = dequantize_nvfp4(codes, bscale, s)
    assert xh[0, 0, :3].eq(0).all()  # all-zero groups: block scale 0, codes 0
    assert torch.allclose(xh[0, 0, 3], x[0, 0, 3], rtol=1e-6, atol=0)


def test_p_quantisation_carries_2688_and_keeps_the_row_max():
    g = torch.Generator().manual_seed(1)
    p = torch.exp2(-8 * torch.rand(3, 5, 128, generator=g))
    p[..., ::16] = 1.0  # every group holds its own max 1: b = 448, code 6 -> 2688 exactly
    vals = quantize_p_nvfp4(p)
    assert (vals[..., ::16] == NVFP4_RANGE).all()
    assert rel_l2(vals / NVFP4_RANGE, p) < 0.12
    assert quantize_p_nvfp4(torch.zeros(1, 32)).eq(0).all()


# --- 4-bit reference attention -------------------------------------------------------------------

def test_8bit_reference_unchanged_by_the_4bit_code():
    """bits=8 still takes the 8-bit path: the quantised P differs from the 4-bit one."""
    q, k, v = video_like_qkv(1, 2, 256, 64, seed=3)
    o8 = reference_vc_attention(q, k, v, bits=8)
    o4 = reference_vc_attention(q, k, v, bits=4)
    ex = exact_attention(q, k, v).float()
    assert rel_l2(o8, ex) < 0.01 < rel_l2(o4, ex)


@pytest.mark.parametrize("seed", [0, 1])
def test_4bit_reference_close_to_exact(seed):
    q, k, v = video_like_qkv(1, 2, 512, 64, seed=seed)
    ex = exact_attention(q, k, v).float()
    for v_smooth in (True, False):
        assert rel_l2(reference_vc_attention(q, k, v, bits=4, v_smooth=v_smooth), ex) < 0.06


@pytest.mark.parametrize("group", [128, NVFP4_MEAN_GROUP, 16])
def test_4bit_exact_parts_change_nothing_without_quantisation(group):
    """The 4-bit recurrence with mean restoration (the block means, or one mean per `group` keys from
    the row sums of P over each group's keys, a last partial group included), P left unquantised, is
    exact attention."""
    from vc_attention.kernels.reference import online_attention
    from vc_attention.kernels.reference.attention import LOG2E

    q, k, v = video_like_qkv(1, 2, 200, 32, seed=4, dtype=torch.float64)
    v = v + torch.linspace(-3, 3, 200, dtype=torch.float64)[None, None, :, None]  # means that differ per group
    mu = block_means(v, group, store_dtype=None)
    o = online_attention(q, k, demean(v, mu, group), score_scale=32 ** -0.5 * LOG2E, mu=mu, dtype=torch.float64,
                         mu_block=group)
    assert rel_l2(o, exact_attention(q, k, v)) < 1e-12


def test_mean_operand_is_the_stored_mean_exactly():
    """The kernel's fp16 operand of the group means (mean_operand_fp16): one power of two per (batch,
    head) puts the largest mean in (2^14, 2^15]; every bf16 mean inside fp16's normal range comes
    back exactly, including a head whose means are far above fp16's range and an all-zero head."""
    g = torch.Generator().manual_seed(3)
    mu = torch.randn(2, 3, 40, 16, generator=g) * torch.tensor([1e-3, 1.0, 5e6])[None, :, None, None]
    mu[1, 0] = 0.0
    mu = mu.to(torch.bfloat16).float()
    m16, e = mean_operand_fp16(mu)
    assert m16.dtype == torch.float16 and e.shape == (2, 3)
    peak = m16.float().abs().amax(dim=(2, 3))
    live = mu.abs().amax(dim=(2, 3)) > 0
    assert ((peak[live] > 2 ** 14) & (peak[live] <= 2 ** 15)).all() and (e[~live] == 0).all()
    back = m16.float() * torch.exp2(e)[:, :, None, None]
    normal = m16.float().abs() >= 2 ** -14
    assert torch.equal(back[normal], mu[normal])
    assert ((back - mu).abs() <= 2.0 ** -24 * torch.exp2(e)[:, :, None, None]).all()  # the subnormal rest


@pytest.mark.parametrize("seed", [0, 2])
def test_4bit_group_means_beat_the_block_mean_on_drifting_values(seed):
    """V whose mean drifts along the tokens inside each 128-row block: the 4-bit default's mean per
    8 tokens is closer to exact attention than the block mean (relative L2 error 7-11% lower on seeds
    0-3, the Q/K and P errors unchanged; asserted 5%). The real-clip gain is
    test_fidelity_claims.py's."""
    q, k, v = video_like_qkv(1, 2, 512, 64, seed=seed)
    g = torch.Generator().manual_seed(seed)
    v = v + 4 * torch.sin(torch.arange(512) / 9.0)[None, None, :, None] * torch.randn(1, 2, 1, 64, generator=g)
    ex = exact_attention(q, k, v).float()
    block = rel_l2(reference_vc_attention(q, k, v, bits=4, v_mean_group=128), ex)
    group = rel_l2(reference_vc_attention(q, k, v, bits=4), ex)
    assert group < 0.95 * block


@pytest.mark.parametrize("seed", [1])
def test_v_smooth_4bit_beats_plain_4bit_on_outlier_tokens(seed):
    q, k, v = video_like_qkv(1, 2, 1024, 64, seed=seed)
    ex = exact_attention(q, k, v).float()
    plan = plan_v_smooth(v, num_clusters=16, backend="reference")
    plain = rel_l2(reference_vc_attention(q, k, v, bits=4, v_smooth=False), ex)
    smooth = rel_l2(reference_vc_attention(q, k, v, bits=4, v_smooth=True, perm=plan.perm), ex)
    assert smooth < 0.95 * plain


def test_4bit_reference_nan_policy():
    q, k, v = video_like_qkv(1, 1, 64, 32, seed=5)
    q[0, 0, 3, 0] = float("nan")
    v[0, 0, 9, 4] = float("inf")
    o = reference_vc_attention(q, k, v, bits=4)
    assert o[0, 0, 3].isnan().all() and o[0, 0, :, 4].isnan().all()
    keep = torch.ones_like(o, dtype=torch.bool)
    keep[0, 0, 3] = False
    keep[0, 0, :, 4] = False
    assert torch.isfinite(o[keep]).all()


# --- the Triton kernel through the interpreter ----------------------------------------------------

@interpreter
def test_prepass_codes_are_the_reference_codes_bit_for_bit():
    from vc_attention.kernels.triton.attention_fp4 import quantize_qk_nvfp4, quantize_v_nvfp4

    B, H, N, D = 1, 2, 200, 64
    q, k, v = video_like_qkv(B, H, N, D, seed=6)
    g = torch.Generator().manual_seed(0)
    perm = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).view(B, H, N)

    def packed(c):  # codes [.., L] -> bytes [.., L/2], the first in the low nibble
        return c[..., 0::2] | (c[..., 1::2] << 4)

    def e4m3_bytes(b):
        return b.to(torch.float8_e4m3fn).view(torch.uint8)

    k_mean = k.mean(dim=2, dtype=torch.float32)
    kp = quantize_qk_nvfp4(k, perm.reshape(B * H, N), k_mean.reshape(B * H, D).contiguous())
    c, b, s, _ = quantize_nvfp4(permute_tokens(k, perm) - k_mean[:, :, None, :])
    assert torch.equal(kp["codes"], packed(c).reshape(B * H, N, D // 2))
    assert torch.equal(kp["scales"], e4m3_bytes(b).reshape(B * H, N, D // 16))
    assert torch.equal(kp["gscale"], s.reshape(B * H))
    for v_smooth, group in ((True, NVFP4_MEAN_GROUP), (True, 128), (False, NVFP4_MEAN_GROUP)):
        vp = quantize_v_nvfp4(v, perm.reshape(B * H, N), v_smooth, mean_group=group)
        vv = permute_tokens(v, perm)
        mu = block_means(vv, group) if v_smooth else None
        r = demean(vv, mu, group) if v_smooth else vv
        c, b, s, _ = quantize_nvfp4(r, dim=-2)
        ct = torch.nn.functional.pad(c.transpose(-1, -2), (0, 256 - N)).reshape(B * H, D, 256)
        assert torch.equal(vp["codes"], packed(ct))
        assert torch.equal(vp["scales"][..., : -(-N // 16)], e4m3_bytes(b.transpose(-1, -2)).reshape(B * H, D, -1))
        assert torch.equal(vp["gscale"], s.reshape(B * H))
        if not v_smooth:
            continue
        n_mu = mu.shape[2]  # the pre-pass writes zero means for the groups of the last block past N
        assert torch.equal(vp["mu"][:, :n_mu].float(), mu.reshape(B * H, n_mu, D))
        assert not vp["mu"][:, n_mu:].float().any()
        if group == 128:
            assert torch.equal(vp["mu_scaled"], vp["mu"].float() / vp["gscale"][:, None, None])
        else:  # the kernel's operand: mean_operand_fp16 and the factor 2^e / sV
            m16, e = mean_operand_fp16(vp["mu"], lead_dims=1)
            assert torch.equal(vp["mu16"], m16) and torch.equal(vp["mu_factor"], torch.exp2(e) / vp["gscale"])


@interpreter
@pytest.mark.parametrize("case", [
    dict(D=64, N=200, M=136, v_smooth=True, perm=True, bias=True, dtype=torch.bfloat16),
    dict(D=128, N=150, M=150, v_smooth=False, perm=False, bias=False, dtype=torch.float32),
    dict(D=64, N=300, M=70, v_smooth=True, perm=True, bias=False, dtype=torch.float32, drift=True),
])
def test_kernel_twin_matches_the_reference(case):
    """The kernel with NATIVE=False (each dot_scaled replaced by decode + fp16 dot, exact products)
    against reference_vc_attention(bits=4): partial key tiles, a partial query block, permutation,
    a padding bias, NaN rows and channels."""
    from vc_attention.kernels.triton.attention_fp4 import triton_vc_attention_fp4

    B, H, D, N, M = 1, 2, case["D"], case["N"], case["M"]
    q, k, v = video_like_qkv(B, H, N, D, seed=7)
    if case.get("drift"):  # means far from zero that move along the tokens: the group means matter
        v = v + 3 + 2 * torch.sin(torch.arange(N) / 5.0)[None, None, :, None]
    q = q[:, :, :M].clone()
    g = torch.Generator().manual_seed(1)
    perm = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).view(B, H, N) if case["perm"] else None
    bias = None
    if case["bias"]:
        bias = torch.zeros(B, 1, 1, N)
        bias[..., -23:] = -math.inf
    if case["v_smooth"]:
        q[0, 1, 5, 2] = float("nan")
        v[0, 0, 11, 7] = float("nan")
    q, k, v = (t.to(case["dtype"]) for t in (q, k, v))
    out = torch.empty(q.shape, dtype=case["dtype"])
    triton_vc_attention_fp4(q, k, v, out, v_smooth=case["v_smooth"], perm=perm, key_bias=bias, native=False)
    ref = reference_vc_attention(q, k, v, bits=4, v_smooth=case["v_smooth"], perm=perm, key_bias=bias)
    assert torch.equal(out.isnan(), ref.isnan())
    ok = ~ref.isnan()
    tol = 1e-3 if case["dtype"] == torch.float32 else 5e-3
    assert rel_l2(out.float()[ok], ref[ok]) < tol
    assert rel_l2(out.float()[ok], exact_attention(q, k, v, key_bias=bias).float()[ok]) < 0.08


@interpreter
@pytest.mark.parametrize("opts", [dict(e2m1_magic=False, rowsum_dot=False, mean_group=128),
                                  dict(rowsum_dot=False, mean_group=128), dict(mean_group=128),
                                  dict(mean_group=16), dict(mean_f16_acc=True), dict(k_order=False),
                                  dict(block_n=64)],
                         ids=["compare", "rowsum-cuda", "block-mean", "mean-per-16", "mean-f16-acc",
                              "key-order-off", "64-key-tiles"])
def test_kernel_options_compute_the_reference(opts):
    """The 4-bit kernel's launch options against the same reference: the seven-comparison E2M1
    rounding (the same codes as the default's magic add), the row sum on the CUDA cores (the same
    decoded values summed in another order; the block mean, the group means take their row sums from
    the tensor cores), the paper's block mean and a mean per 16 keys (against the reference's), the
    means' mma with an FP16 accumulator (GeForce's default: fp16 sums of scaled row sums), K's
    tile in key order (P through shared memory: the same values) and 64-key tiles (against the
    reference's 64-key tiles), partial key and query tiles, V-Smooth, a bias."""
    from vc_attention.kernels.triton.attention_fp4 import triton_vc_attention_fp4

    q, k, v = video_like_qkv(1, 2, 136, 64, seed=11)
    v = v + 2 * torch.cos(torch.arange(136) / 4.0)[None, None, :, None]
    bias = torch.zeros(1, 1, 1, 136)
    bias[..., -9:] = -math.inf
    out = torch.empty_like(q)
    triton_vc_attention_fp4(q, k, v, out, key_bias=bias, native=False, **opts)
    ref = reference_vc_attention(q, k, v, bits=4, key_bias=bias, block_n=opts.get("block_n"),
                                 v_mean_group=opts.get("mean_group"))
    assert rel_l2(out, ref) < 1e-3


def test_group_means_refuse_what_the_kernel_cannot_hold():
    """The group means need their row sums from the tensor cores and at most 16 groups per tile:
    clear errors, not a silent other mean."""
    from vc_attention.kernels.triton.attention_fp4 import launch_fp4, prepare_fp4

    q, k, v = video_like_qkv(1, 1, 64, 32, seed=1)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="tensor cores"):
        launch_fp4(prepare_fp4(q, k, v), out, native=False, rowsum_dot=False)
    with pytest.raises(ValueError, match="up to 16"):
        launch_fp4(prepare_fp4(q, k, v, mean_group=4), out, native=False)
    with pytest.raises(ValueError, match="4-bit option"):
        reference_vc_attention(q, k, v, bits=8, v_mean_group=16)


def test_4bit_refuses_head_dims_it_cannot_tile():
    """A head dim that is not a power of two (96: the public call's dispatch refuses it first) gets
    a clear error from the 4-bit pre-pass, not a compiler's."""
    from vc_attention.kernels.triton.attention_fp4 import prepare_fp4

    q, k, v = video_like_qkv(1, 1, 64, 96, seed=1)
    with pytest.raises(ValueError, match="head dim 96"):
        prepare_fp4(q, k, v)


try:  # a Triton kernel over the kernels' E2M1 rounding (the module imports without Triton)
    import triton
    import triton.language as tl

    from vc_attention.kernels.triton.attention_fp4 import _e2m1_round_abs

    @triton.jit
    def _e2m1_round_kernel(X, C, V, MAGIC: tl.constexpr, BELOW_8: tl.constexpr, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        code, val = _e2m1_round_abs(tl.load(X + o), MAGIC, BELOW_8)
        tl.store(C + o, code)
        tl.store(V + o, val)
except ImportError:
    _e2m1_round_kernel = None


@interpreter
def test_magic_e2m1_rounding_is_the_reference_rounding():
    """The kernels' E2M1 rounding by one magic add (_e2m1_round_abs, MAGIC) gives the reference's
    codes and values (kernels/reference/nvfp4.py) on a dense sweep of [0, 10], on every decision point
    and its two fp32 neighbours (the ties go to the even code), and on huge inputs (saturated to 6);
    BELOW_8 (no clamp) the same below 8. The seven comparisons (MAGIC=False) as well."""
    if _e2m1_round_kernel is None:
        pytest.skip("Triton is not installed")
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.375])
    sweep = torch.cat([torch.linspace(0, 7.99, 8192), points, torch.nextafter(points, torch.tensor(0.0)),
                       torch.nextafter(points, torch.tensor(9.0)), torch.tensor([0.0, 1e-40, 7.999])])
    huge = torch.tensor([8.0, 9.5, 2.0 ** 25, 1e30, 3e38])
    for magic, below_8, x in ((True, True, sweep), (True, False, torch.cat([sweep, huge])), (False, False, sweep)):
        x = torch.cat([x, torch.zeros((-len(x)) % 1024)])
        code = torch.empty(len(x), dtype=torch.int32)
        val = torch.empty(len(x))
        _e2m1_round_kernel[(len(x) // 1024,)](x, code, val, MAGIC=magic, BELOW_8=below_8, BLOCK=1024)
        want = e2m1_codes(x)
        assert torch.equal(code, want.int()), (magic, below_8, x[code != want.int()][:5])
        assert torch.equal(val, decode_e2m1(want)), (magic, below_8)


def test_p_scale_reciprocal_is_correctly_rounded():
    """The compiled kernel's 2688 / b for P's group scales (_recip_2688: the hardware reciprocal r,
    q = 2688 r, then q + (2688 - b q) r, each step rounded to fp32) is the IEEE quotient the reference
    divides by, for every E4M3 value b, whatever r's error: every r within 64 ulp of 1 / b is tried
    (PTX's rcp.approx.f32 is within 1). Exact rational arithmetic, each operation rounded to fp32 to
    nearest even. Without the correction step it fails."""
    import struct
    from fractions import Fraction

    def bits(x):
        return struct.unpack("<I", struct.pack("<f", x))[0]

    def f32(b):
        return struct.unpack("<f", struct.pack("<I", b))[0]

    def rn(x):  # the fp32 nearest to the rational x (normal or 0 here), ties to even
        if x == 0:
            return 0.0
        near = struct.unpack("<f", struct.pack("<f", float(x)))[0]
        return min((f32(bits(near) + d) for d in (-1, 0, 1)), key=lambda c: (abs(Fraction(c) - x), bits(c) & 1))

    def fma(a, b, c):
        return rn(Fraction(a) * Fraction(b) + Fraction(c))

    scales = [float(round_to_e4m3(torch.tensor(float(m) * 2.0 ** (e - 9) if e == 0 else (8 + m) * 2.0 ** (e - 10))))
              for e in range(16) for m in range(8)]
    scales = sorted({b for b in scales if b > 0})
    assert len(scales) == 126 and scales[0] == 2.0 ** -9 and scales[-1] == 448.0
    uncorrected = 0
    for b in scales:
        want = rn(Fraction(2688) / Fraction(b))
        for ulps in range(-64, 65, 3):
            r = f32(bits(rn(1 / Fraction(b))) + ulps)
            q = rn(Fraction(r) * 2688)
            uncorrected += q != want
            assert fma(fma(-b, q, 2688.0), r, q) == want, (b, ulps)
    assert uncorrected > 1000


@interpreter
def test_interpreter_reads_nvfp4_scales():
    """Triton 3.9's interpreter decodes every dot_scaled scale as an E8M0 exponent byte
    (runtime/interpreter.py: _dot_scaled_scale_to_f32 shifts the byte into the fp32 exponent), so an
    E4M3 scale of 1.0 (byte 0x38) reads as 2^-71. The kernel's native path therefore cannot be checked
    here; its math is the NATIVE=False twin above, and the native path runs on the H200
    (tests/gpu/test_nvfp4_gpu.py). This test starts passing, and should then be turned into a native
    check, once the interpreter reads E4M3 scales."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot(A, S, O):
        a = tl.load(A + tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :])  # [16, 32] e2m1
        s = tl.load(S + tl.arange(0, 16)[:, None] * 2 + tl.arange(0, 2)[None, :]).to(tl.float8e4nv, bitcast=True)
        b = tl.load(A + tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :])  # [16 (K/2), 16]
        o = tl.dot_scaled(a, s, "e2m1", b, s, "e2m1")
        tl.store(O + tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :], o)

    a = torch.full((16, 16), 0x22, dtype=torch.uint8)  # every element 1.0
    s = torch.full((16, 2), 0x38, dtype=torch.uint8)   # E4M3 1.0
    o = torch.empty(16, 16)
    dot[(1,)](a, s, o)
    if not torch.allclose(o, torch.full_like(o, 32.0)):
        pytest.skip(f"the interpreter misreads E4M3 dot_scaled scales (1 x 1 x 32 gave {o[0, 0].item():.3g}, "
                    "as if the scale byte were E8M0): the kernel is checked through its twin here")


# --- compiling for Blackwell without a GPU ---------------------------------------------------------

COMPILE = textwrap.dedent("""
    import importlib.util, json, pathlib, sys
    root = pathlib.Path(sys.argv[1])
    spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
    from vc_attention.kernels.triton.attention_fp4 import compile_fp4_attention
    ck = compile_fp4_attention(int(sys.argv[2]))
    lines = [l.strip() for l in ck.asm["ptx"].splitlines() if "block_scale" in l]
    print(json.dumps({"mma": sorted({l.split(" ")[1] if l.startswith("@") else l.split(" ")[0] for l in lines}),
                      "cubin": len(ck.asm.get("cubin", b"")), "shared": ck.metadata.shared}))
""")


def _version(text):
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2])


def test_kernel_compiles_for_sm100_and_sm120():
    """The attention kernel (D=128, 128x128 tiles, V-Smooth, native dot_scaled with E4M3 group-16
    scales) compiles to NVFP4 block-scaled MMAs for both Blackwell targets, with no GPU present.
    A fresh process: under TRITON_INTERPRET=1 @triton.jit builds interpreted functions."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    procs = {arch: subprocess.Popen([sys.executable, "-c", COMPILE, ROOT, str(arch)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for arch in (100, 120)}
    import triton

    got = {}
    for arch, p in procs.items():
        out, err = p.communicate(timeout=300)
        if p.returncode != 0 and _version(triton.__version__) < (3, 9):
            # Triton 3.8's sm_100 pipeline fails on this kernel (TritonGPUOptimizeAccumulatorInit);
            # 3.9 compiles it. .ci/run runs this test again with Triton 3.9, where it must pass.
            pytest.xfail(f"triton {triton.__version__} cannot compile the NVFP4 kernel for sm_{arch} "
                         f"(3.9 can): {err.strip().splitlines()[-1][:300]}")
        assert p.returncode == 0, err[-2000:]
        got[arch] = json.loads(out.strip().splitlines()[-1])
        assert got[arch]["cubin"] > 0
    # sm_100: tcgen05 with NVFP4 (E2M1 x E2M1, E4M3 scale per 16), not MXFP4 (E8M0 per 32)
    assert got[100]["mma"] == ["tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16"]
    # sm_120: warp-level mma.sync, 4 scales (ue4m3) per 64-element k step = one per 16
    assert got[120]["mma"] == [
        "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1.f32.ue4m3"]
    assert got[120]["shared"] <= 99 * 1024  # fits an RTX 5090's shared memory per block


COMPILE_PREPASS = textwrap.dedent("""
    import collections, importlib.util, json, pathlib, re, subprocess, sys, tempfile
    root = pathlib.Path(sys.argv[1])
    spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
    import triton
    from vc_attention.kernels.triton.attention_fp4 import compile_fp4_prepass
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = {}
    for arch in (90, 120):
        for tensor in ("v", "qk"):
            ck = compile_fp4_prepass(arch, tensor)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(ck.asm["cubin"]); f.flush()
                sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
            ops = collections.Counter(m.group(1).split(".")[0] for m in
                                      re.finditer(r"/\\*[0-9a-f]{4,}\\*/\\s+(?:@!?U?P[T0-9]+\\s+)?([A-Z][A-Z0-9_]*)", sass))
            out[f"{tensor}{arch}"] = dict(ops)
    print(json.dumps(out))
""")


def test_prepass_quantisers_keep_their_registers():
    """The 4-bit pre-pass quantisers with the group-scale search, compiled for sm_90 and sm_120 as
    prepare_fp4 launches them: no local memory (32 rows of Q / K with 8 warps; V with one 16-token
    group per thread, V_ROWS = 16 and 2 warps, where 128 rows spilled hundreds of values), and V's
    group reductions inside the thread (no shuffles: its transposed 64-token tile with 8 warps had
    them, and 15 barriers, and took 2.7x as long on the H200, BENCHMARKS.md)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, "-c", COMPILE_PREPASS, ROOT], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for name, ops in got.items():
        assert ops.get("LDL", 0) == 0 and ops.get("STL", 0) == 0, (name, ops.get("LDL"), ops.get("STL"))
        assert ops.get("STG", 0) > 0, name  # the codes are stored: a real build was read
    for arch in (90, 120):
        assert got[f"v{arch}"].get("SHFL", 0) == 0 and got[f"v{arch}"].get("BAR", 0) <= 4, got[f"v{arch}"]


COMPILE_SM90 = textwrap.dedent("""
    import importlib.util, json, pathlib, sys
    root = pathlib.Path(sys.argv[1])
    spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
    from vc_attention.kernels.triton.attention_fp4 import compile_fp4_attention
    ck = compile_fp4_attention(90, out_dtype="fp32")
    ptx = [l.strip() for l in ck.asm["ptx"].splitlines()]
    print(json.dumps({"block_scale": sum("block_scale" in l for l in ptx),
                      "wgmma": sorted({l.split(" ")[0] for l in ptx if l.startswith("wgmma.mma_async")}),
                      "cubin": len(ck.asm.get("cubin", b""))}))
""")


def test_native_kernel_compiles_for_sm90_emulated():
    """The same native kernel (tl.dot_scaled, e2m1 + E4M3 group-16 scales) compiled for the H200
    (sm_90, no FP4 tensor cores): Triton decomposes each dot_scaled into an e2m1 and E4M3 upcast to
    bf16, a multiply (exact) and a bf16 wgmma (the group means' FP16 dot: one f16 wgmma);
    tests/gpu/test_nvfp4_gpu.py runs it against the reference there. Triton 3.8 and 3.9 build it; 3.6 (torch 2.11's pin, the H200 machine's) cannot:
    its sm_90 decomposition only takes E8M0 uint8 scales (arith.extui on the f8E4M3FN scale), so an
    xfail says so there."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, "-c", COMPILE_SM90, ROOT], env=env, capture_output=True,
                       text=True, timeout=300)
    import triton

    if p.returncode != 0 and _version(triton.__version__) < (3, 8):
        errors = [l for l in p.stderr.splitlines() if "error:" in l or "Assertion" in l]
        pytest.xfail(f"triton {triton.__version__} cannot decompose an E4M3-scaled dot_scaled for "
                     f"sm_90 (3.8 and 3.9 can): {(errors or p.stderr.splitlines() or [''])[0][:300]}")
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["cubin"] > 0
    assert got["block_scale"] == 0  # no FP4 tensor-core instruction on Hopper: emulated
    assert all(".f32." in w for w in got["wgmma"]), got["wgmma"]
    assert sum(".bf16.bf16" in w for w in got["wgmma"]) == 2, got["wgmma"]  # n128: Q.K, P.V; n16: the row sums
    assert [w for w in got["wgmma"] if ".bf16.bf16" not in w] == ["wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16"]


# --- dispatch ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,halved", [("NVIDIA GeForce RTX 5090", True), ("NVIDIA GeForce RTX 4090", True),
                                         ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", False),
                                         ("NVIDIA B200", False), ("NVIDIA H200", False)])
def test_means_accumulate_in_fp16_on_geforce_cards_only(monkeypatch, name, halved):
    """launch_fp4's default for the means' FP16 mma: an FP16 accumulator where the card halves the
    FP32-accumulating rate (GeForce), FP32 elsewhere (and off the GPU)."""
    from vc_attention.kernels.triton.attention_fp4 import halved_fp32_accumulation

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert halved_fp32_accumulation(torch.device("cuda", 0)) is halved
    assert halved_fp32_accumulation(torch.device("cpu")) is False

def spec_for(capability, monkeypatch, bits=4, triton=(3, 9)):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(dispatch, "triton_status", lambda: (True, ""))
    monkeypatch.setattr(dispatch, "triton_version", lambda: triton)
    return CallSpec(device_type="cuda", capability=dispatch.device_capability(torch.device("cuda")),
                    dtype=torch.bfloat16, head_dim=128, bits=bits)


@pytest.mark.parametrize("capability", [(10, 0), (10, 3), (12, 0), (12, 1)])
def test_4bit_runs_the_nvfp4_kernel_on_blackwell(monkeypatch, capability):
    decision = choose_backend(spec_for(capability, monkeypatch))
    assert decision.backend == "triton" and decision.low_bit and decision.bits == 4
    assert not decision.expcast and "4-bit NVFP4" in str(decision)


@pytest.mark.parametrize("capability,triton,runs", [((10, 0), (3, 8), False), ((10, 0), (3, 6), False),
                                                    ((12, 0), (3, 6), True), ((10, 0), (3, 9), True)])
def test_4bit_needs_a_triton_that_builds_the_kernel_for_this_gpu(monkeypatch, capability, triton, runs):
    decision = choose_backend(spec_for(capability, monkeypatch, triton=triton))
    assert (decision.backend == "triton") == runs
    if not runs:
        why = decision.reasons["triton"]
        assert "cannot build the 4-bit NVFP4 kernel" in why and "3.9 or newer" in why, why


@pytest.mark.parametrize("capability", [(9, 0), (8, 9), (8, 0)])
def test_4bit_elsewhere_is_refused_with_the_reason_and_8bit_still_runs(monkeypatch, capability):
    decision = choose_backend(spec_for(capability, monkeypatch))
    assert decision.backend == "sdpa" and not decision.low_bit
    why = decision.reasons["triton"]
    assert "FP4 tensor cores" in why and "sm_%d%d" % capability in why
    eight = choose_backend(spec_for(capability, monkeypatch, bits=8))
    assert eight.low_bit == (capability >= (8, 9))
    with pytest.raises(RuntimeError, match="FP4 tensor cores"):
        choose_backend(spec_for(capability, monkeypatch), "triton")


def test_4bit_through_the_public_api_on_cpu(monkeypatch):
    q, k, v = video_like_qkv(1, 1, 64, 64, seed=8)
    ref = reference_vc_attention(q, k, v, bits=4)
    assert torch.equal(vc_attention(q, k, v, bits=4, backend="reference"), ref)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        decision = explain_backend(q, k, v, bits=4)
        assert decision.backend == "triton" and decision.bits == 4
        assert rel_l2(vc_attention(q, k, v, bits=4), ref) < 1e-3
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    decision = explain_backend(q, k, v, bits=4)
    assert decision.backend == "sdpa" and "not a CUDA GPU" in decision.reasons["triton"]
