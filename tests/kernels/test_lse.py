"""The log-sum-exp that ring attention merges key chunks by (kernels/sequence_parallel.py).

The reference's LSE is log sum_j P_j at its final reference point, in the units of the scores it
sums, with K's smoothing shift put back: exactly logsumexp(Q K^T * scale + bias) in the exact mode,
the method's own sum at 8 and 4 bits. The portable Triton kernel writes the same value (its state
at the end of the row, the same formula); the merge of two key chunks by it gives the whole.
"""

import math

import pytest
import torch

from vc_attention.kernels import dispatch, plan_v_smooth, vc_attention, vc_attention_lse
from vc_attention.kernels.dispatch import CallSpec, choose_backend
from vc_attention.kernels.reference import reference_vc_attention

from kernel_helpers import fma_is_fused, video_like_qkv

triton = pytest.importorskip("triton")
from vc_attention.kernels.triton.attention import triton_vc_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def exact_lse(q, k, sm_scale, bias=None):
    s = q.double() @ k.double().transpose(-1, -2) * sm_scale
    return torch.logsumexp(s if bias is None else s + bias.double(), dim=-1)


def test_reference_lse_in_the_exact_mode_is_logsumexp():
    q, k, v = video_like_qkv(1, 2, 300, 64, seed=1)
    bias = torch.where(torch.arange(300) % 7 == 0, -1e4, 0.0)[None, None, None, :]
    for b in (None, bias):
        _, lse = reference_vc_attention(q, k, v, bits=16, key_bias=b, dtype=torch.float64, return_lse=True)
        assert (lse - exact_lse(q, k, 64 ** -0.5, b)).abs().max().item() < 1e-12


@pytest.mark.parametrize("bits,expcast,bound", [(8, False, 0.02), (8, True, 0.04), (4, False, 0.15)])
def test_reference_lse_is_the_methods_sum(bits, expcast, bound):
    """At 8 and 4 bits the LSE is that of the quantised scores and P: close to the exact one (the
    bound: what the quantisation moves it on these inputs, a few times over), and it is what
    normalises the output: exp(lse) times the output's row sums the values as the method does."""
    q, k, v = video_like_qkv(1, 2, 300, 64, seed=2)
    plan = plan_v_smooth(v, num_clusters=8, backend="reference")
    o, lse = reference_vc_attention(q, k, v, bits=bits, expcast=expcast, perm=plan.perm, return_lse=True)
    assert torch.equal(o, reference_vc_attention(q, k, v, bits=bits, expcast=expcast, perm=plan.perm))
    assert (lse.double() - exact_lse(q, k, 64 ** -0.5)).abs().max().item() < bound


def _kernel_lse(q, k, v, **options):
    out = torch.empty_like(q)
    lse = torch.full(q.shape[:3], math.nan, device=q.device)
    triton_vc_attention(q, k, v, out, lse=lse, **options)
    return out, lse


@pytest.mark.parametrize("case", ["exp2", "expcast_folded", "expcast_unfolded", "expcast_bias", "exp2_bias"])
def test_portable_kernel_lse_is_the_reference_lse(case):
    q, k, v = (t.to(DEVICE) for t in video_like_qkv(1, 2, 333, 64, seed=3))
    if case == "expcast_unfolded":  # large Q and K scales: c8 >= 1/4, the INT8 conversion not folded
        q, k = q * 15.0, k * 15.0
    bias = None
    if case.endswith("bias"):
        bias = torch.where(torch.arange(333, device=DEVICE) % 5 == 0, -3.0, 0.0)[None, None, None, :]
    expcast = case.startswith("expcast")
    if expcast and not fma_is_fused(DEVICE):
        # ExpCast's default E5M2 bytes where tl.fma rounds twice: a peaked row's largest byte moves
        # one code (19%), its output and LSE with it; Triton 3.9 runs these in CI (.ci/run)
        pytest.skip(f"SKIPPED LOUDLY: Triton {triton.__version__}'s tl.fma rounds twice on this device")
    plan = plan_v_smooth(v, num_clusters=8, backend="reference")
    out, lse = _kernel_lse(q, k, v, expcast=expcast, perm=plan.perm, key_bias=bias)
    ref_o, ref_lse = reference_vc_attention(q, k, v, bits=8, expcast=expcast, perm=plan.perm, key_bias=bias,
                                            return_lse=True)
    assert not torch.isnan(lse).any()
    # The same bytes give the same LSE up to fp32 sums in another order. A byte the kernel rounds
    # the other way (a score one bit apart: the rare flip the output tests allow) moves its row's
    # output and LSE together; such rows stay rare and close.
    # Where tl.fma rounds twice (Triton 3.8's interpreter) the folded bytes flip often, each by one
    # E4M3 step (1/16 of the byte at most): then the rows' agreement and that looser bound hold.
    same_row = (out - ref_o).abs().amax(dim=-1) <= 1e-5
    d = (lse - ref_lse).abs()
    assert d[same_row].max().item() < 2e-5
    if fma_is_fused(DEVICE):
        assert (~same_row).float().mean().item() <= 0.01 and d.max().item() < 1e-3
    else:
        assert d.max().item() < 1e-2


@pytest.mark.parametrize("case", ["exp2", "expcast", "exp2_bias"])
def test_mma_kernel_lse_is_the_reference_lse(case):
    """The RTX kernel (mma.sync; interpreter on request) against the reference with its 64-key tiles
    (P's bytes follow each tile's running max): the same rows agree to fp32 rounding, a rare byte
    flip (its exp2 argument is rounded once, EXP2_FMA) moves a row a little."""
    q, k, v = (t.to(DEVICE) for t in video_like_qkv(1, 2, 333, 64, seed=3))
    bias = None
    if case.endswith("bias"):
        bias = torch.where(torch.arange(333, device=DEVICE) % 5 == 0, -3.0, 0.0)[None, None, None, :]
    expcast = case == "expcast"
    plan = plan_v_smooth(v, num_clusters=8, backend="reference")
    _, lse = vc_attention_lse(q, k, v, plan=plan, backend="mma", expcast=expcast, key_bias=bias, pv_format="fp8")
    _, ref_lse = reference_vc_attention(q, k, v, bits=8, expcast=expcast, perm=plan.perm, key_bias=bias,
                                        return_lse=True, block_n=64, p_format="e4m3")  # its ExpCast: E4M3
    d = (lse - ref_lse).abs()
    assert not torch.isnan(lse).any()
    if fma_is_fused(DEVICE) or not expcast:
        assert d.max().item() < 1e-3 and (d > 2e-5).float().mean().item() <= 0.01
    else:  # Triton 3.8's interpreter rounds ExpCast's folded FMA twice: bytes flip often (as above)
        assert d.max().item() < 1e-2


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_mma_kernel_int8_lse_is_the_exact_lse(bias):
    """The RTX kernel's default, its INT8 P.V path (pv_format="auto"), writes the LSE of the scores
    it quantised: within 0.02 of the exact one (as on the GPU, tests/gpu/test_mma_gpu.py; its
    reference has no LSE)."""
    q, k, v = (t.to(DEVICE) for t in video_like_qkv(1, 2, 333, 64, seed=3))
    kb = torch.where(torch.arange(333, device=DEVICE) % 5 == 0, -3.0, 0.0)[None, None, None, :] if bias else None
    plan = plan_v_smooth(v, num_clusters=8, backend="reference")
    _, lse = vc_attention_lse(q, k, v, plan=plan, backend="mma", key_bias=kb)
    s = (q.float() @ k.float().transpose(-1, -2)) * 64 ** -0.5 + (0 if kb is None else kb)
    assert not torch.isnan(lse).any()
    assert (lse - torch.logsumexp(s, dim=-1)).abs().max().item() < 0.02


def test_merging_two_key_chunks_by_the_lse_gives_the_whole():
    """The ring rule in one process: each key chunk with its own plan, merged by the kernel's LSE,
    is the exact attention in the exact mode, and at 8 bits as close to it as one call."""
    q, k, v = video_like_qkv(1, 2, 512, 64, seed=4)
    halves = (slice(0, 256), slice(256, 512))
    for bits, backend in ((16, "reference"), (8, "triton")):
        parts = []
        for h in halves:
            kc, vc = k[:, :, h], v[:, :, h]
            parts.append(vc_attention_lse(q, kc, vc, bits=bits, backend=backend,
                                          plan=plan_v_smooth(vc, num_clusters=8, backend="reference")))
        (o1, l1), (o2, l2) = parts
        lse = torch.logaddexp(l1, l2)
        merged = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
        exact = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 64 ** -0.5, -1) @ v.double()
        err = ((merged.double() - exact).norm() / exact.norm()).item()
        if bits == 16:
            assert err < 1e-6
        else:
            one = vc_attention(q, k, v, plan=plan_v_smooth(v, num_clusters=8, backend="reference"), backend=backend)
            assert err < 1.5 * ((one.double() - exact).norm() / exact.norm()).item()


def test_only_backends_that_write_the_lse_are_chosen():
    """The registry's one decision: a call that needs the LSE goes to a kernel that writes it (the
    Hopper, mma.sync and portable kernels, the reference); the cubins refuse it, and say so."""
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    spec = CallSpec(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, head_dim=128, bits=8,
                    needs_lse=True)
    assert "log-sum-exp" in dispatch.refusal(dispatch.REGISTRY["precompiled"], spec, "precompiled")
    assert all(dispatch.REGISTRY[name].kernel(8).lse for name in ("gluon", "mma", "triton", "reference"))
    with pytest.raises(RuntimeError, match="log-sum-exp"):  # 4 bits on a CPU: nothing writes it
        vc_attention_lse(q.float(), q.float(), q.float(), bits=4)
    assert choose_backend(CallSpec.from_tensors(q, bits=8, needs_lse=True)).backend in ("triton", "reference")
