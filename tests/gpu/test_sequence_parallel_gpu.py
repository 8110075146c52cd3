"""On the GPU (marked `gpu`): VC-Attention as yunchang's local attention over NCCL, at Wan 480p.

One GPU holds one rank, so this is Ulysses of degree 1: it checks the CUDA path through yunchang
(NCCL groups, its one-rank ring step, bf16 tensors in its [B, N, H, D] layout, the dispatched
kernel) against a direct vc_attention call with the same plan, bit for bit, and the method against
exact attention. Ring attention's LSE from the dispatched and the portable kernel at the same
size, against exact attention's. Several ranks over gloo: tests/parallel; several GPUs need a
machine that has them.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

yunchang = pytest.importorskip("yunchang", reason="yunchang (the sequence-parallel engine) is not installed")

from vc_attention.kernels import explain_backend, plan_v_smooth, vc_attention, vc_attention_lse  # noqa: E402
from vc_attention.kernels.reference import exact_attention  # noqa: E402
from vc_attention.kernels.sequence_parallel import StepClock, vc_long_context_attention  # noqa: E402

B, N, H, D = 1, 32_760, 40, 128


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    import torch.distributed as dist

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    init = tmp_path_factory.mktemp("nccl") / "init"
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    yunchang.set_seq_parallel_pg(1, 1, 0, 1)
    yield
    dist.destroy_process_group()


def test_yunchang_local_attention_at_wan_480p(nccl_group):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, N, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    k = (torch.randn(B, N, H, D, device="cuda", generator=g) + 0.3).to(torch.bfloat16)
    v = torch.randn(B, N, H, D, device="cuda", generator=g).to(torch.bfloat16)
    clock = StepClock()
    clock.begin(0, 8)
    attn = vc_long_context_attention(H, clock=clock)
    out = attn(q, k, v)
    backend = explain_backend(q, k, v, layout="NHD").backend
    plan = plan_v_smooth(v, layout="NHD", heads=(0, H))
    direct = vc_attention(q, k, v, plan=plan, layout="NHD")
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.equal(out, direct), f"{backend}: max diff {(out.float() - direct.float()).abs().max()}"
    # the method against exact attention: 1,024 query rows of 4 heads (HND for the reference)
    hq, hk, hv = (t[:, :, :4].transpose(1, 2) for t in (q[:, :1024], k, v))
    exact = exact_attention(hq, hk, hv, dtype=torch.float32)
    got = out[:, :1024, :4].transpose(1, 2).float()
    assert ((got - exact).norm() / exact.norm()).item() < 5e-2


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_kernel_lse_at_wan_480p(backend):
    """vc_attention_lse with the kernel "auto" picks on this GPU (the Hopper one on an H200) and with
    the portable one: the output is the plain call's, bit for bit, and the LSE the exact one's to the
    method's error (1,024 rows of 4 heads of the bf16 inputs, in float64)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    plan = plan_v_smooth(v, layout="NHD")
    out, lse = vc_attention_lse(q, k, v, plan=plan, layout="NHD", backend=backend)
    assert torch.equal(out, vc_attention(q, k, v, plan=plan, layout="NHD", backend=backend))
    assert lse.shape == (B, H, N) and not torch.isnan(lse).any()
    hq, hk = (t[:, :, :4].transpose(1, 2).double() for t in (q[:, :1024], k))
    exact = torch.logsumexp(hq @ hk.transpose(-1, -2) * D ** -0.5, dim=-1)
    assert (lse[:, :4, :1024].double() - exact).abs().max().item() < 0.05
