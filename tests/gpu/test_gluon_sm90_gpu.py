"""On a Hopper GPU (marked `gpu`): the Gluon kernel against its Triton twin and the reference.

The two kernels take the same prepared operands; with the same key-tile width (block_n_for) their
P bytes are the same, and since the Gluon kernel takes the row sum as the twin does (P times a tile
of ones on the tensor cores) and adds the fp32 tiles in the same order, the outputs are bit-identical
(every case below), except with V-Smooth's mean on the tensor cores (mean_mma: within 2^-18 of the
output's scale in fp32). Against the float64 reference
of the method with the same tiles, both rounded to bf16: < 1e-3, as for the twin
(tests/gpu/test_gpu_real_size.py says why).
"""

import pytest
import torch

from vc_attention.kernels import explain_backend, plan_v_smooth, vc_attention
from vc_attention.kernels.pipeline import prepare_8bit
from vc_attention.kernels.reference import reference_vc_attention

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)
try:
    from vc_attention.kernels.gluon import config
    from vc_attention.kernels.gluon import launch_sm90 as G
except Exception as exc:  # a Triton without Gluon's Hopper API
    pytest.skip(f"SKIPPED LOUDLY: the Gluon Hopper kernel cannot be imported: {exc}", allow_module_level=True)

from vc_attention.kernels.gluon.config import block_n_for  # noqa: E402
from vc_attention.kernels.gluon.launch_sm90 import vc_attention_fwd_sm90  # noqa: E402
from vc_attention.kernels.triton.attention import vc_attention_fwd  # noqa: E402
from vc_attention.kernels.triton.launch import triton_launch  # noqa: E402


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(B, H, N, M=None, D=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, N if M is None else M, D, device="cuda", generator=g).to(torch.bfloat16)
    k = (torch.randn(B, H, N, D, device="cuda", generator=g) + 0.3).to(torch.bfloat16)
    v = torch.randn(B, H, N, D, device="cuda", generator=g)
    v[:, :, ::997] *= 12  # outlier tokens
    v += torch.linspace(-1, 2, D, device="cuda")  # per-channel offsets (what V-Smooth removes)
    return q, k, v.to(torch.bfloat16)


def prepare(q, k, v, perm, v_smooth, key_bias=None, pv_perm=False):
    """The library's own 8-bit pre-pass (kernels/pipeline.py): the operands both kernels take
    (pv_perm: V^T's columns in wgmma order, pipeline.pv_key; both kernels then permute P alike)."""
    return prepare_8bit(triton_launch, q, k, v, v_smooth=v_smooth, perm=perm, key_bias=key_bias, pv_perm=pv_perm)


CASES = {  # B, H, N, M, v_smooth, expcast, bias[, factor on q and k]
    "vsmooth_expcast_N333": (1, 2, 333, None, True, True, False),
    "plain_expcast_N1000": (1, 2, 1000, None, False, True, False),
    # scores large enough that _no_clip_flags keeps ExpCast's clip at byte 120 (the other loop copy)
    "vsmooth_expcast_clipped_N1000": (1, 2, 1000, None, True, True, False, 60.0),
    "vsmooth_exp2_N333": (1, 2, 333, None, True, False, False),
    "vsmooth_exp2_bias_N1000": (1, 2, 1000, None, True, False, True),  # 128-key tiles with a bias
    "plain_exp2_N1000": (1, 2, 1000, None, False, False, False),  # 64-key tiles, P as words in wgmma order
    "plain_bias_M777_N1000": (2, 3, 1000, 777, False, False, True),
    "vsmooth_expcast_bias_N4173": (1, 2, 4173, None, True, True, True),
    "one_tile_N64": (1, 2, 64, None, True, True, False),
    "wan720p_4heads": (1, 4, 75_600, None, True, True, False),
}


@pytest.mark.parametrize("order", ["key_order", "wgmma_order"])
@pytest.mark.parametrize("case", list(CASES))
def test_gluon_matches_twin_and_reference(case, order):
    B, H, N, M, v_smooth, expcast, bias, *factor = CASES[case]
    q, k, v = inputs(B, H, N, M)
    if factor:
        q, k = q * factor[0], k * factor[0]
    plan = plan_v_smooth(v, num_clusters=16, iters=4) if v_smooth else None
    perm = None if plan is None else plan.perm
    key_bias = None
    if bias:
        key_bias = torch.zeros(B, 1, 1, N, device="cuda")
        key_bias[..., ::7] = -3.0
        key_bias[..., 5::11] = float("-inf")  # padded keys
    ops, kb2 = prepare(q, k, v, perm, v_smooth, key_bias, pv_perm=order == "wgmma_order")
    block_n = block_n_for(v_smooth, bias, expcast)
    noclip = G.no_clip_flags(ops[1], ops[4], q.shape[-1], bias)
    if expcast and not bias:  # which copy of the loop runs: without the clip at 120 unless the scores are huge
        assert bool(noclip.all()) == (not factor) and bool(noclip.any()) == (not factor), noclip
    twin, fast = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    vc_attention_fwd(*ops, twin, H, key_bias_log2=kb2, expcast=expcast, block_n=block_n)
    vc_attention_fwd_sm90(*ops, fast, H, key_bias_log2=kb2, expcast=expcast)
    torch.cuda.synchronize()
    assert not torch.isnan(fast).any()
    if config.mean_on_tensor_cores(expcast, order == "wgmma_order", v_smooth, bias):
        # dispatched with mean_mma: V-Smooth's mean in 3xTF32 on the tensor cores, within 2^-18 of the
        # output's scale of the twin's fp32 FMA (fp32 outputs compared); without it the same bytes as
        # the twin, bit for bit
        twin32 = torch.full(q.shape, float("nan"), device="cuda")
        fast32 = torch.full(q.shape, float("nan"), device="cuda")
        vc_attention_fwd(*ops, twin32, H, key_bias_log2=kb2, expcast=expcast, block_n=block_n)
        vc_attention_fwd_sm90(*ops, fast32, H, key_bias_log2=kb2, expcast=expcast)
        classic = torch.full_like(q, float("nan"))
        vc_attention_fwd_sm90(*ops, classic, H, key_bias_log2=kb2, expcast=expcast, mean_mma=False)
        torch.cuda.synchronize()
        assert (fast32 - twin32).abs().max().item() <= 2.0 ** -18 * twin32.abs().max().item()
        assert torch.equal(classic, twin), rel_l2(classic, twin)
    else:
        assert torch.equal(fast, twin), rel_l2(fast, twin)
    rows = torch.arange(q.shape[2], device="cuda")
    if q.shape[2] > 1024:  # Q is quantised per 128-row block: a block-aligned slice keeps its codes
        rows = torch.cat([rows[:256], rows[q.shape[2] - q.shape[2] % 128:]])
    ref = reference_vc_attention(q[:, :, rows], k, v, bits=8, v_smooth=v_smooth, expcast=expcast, perm=perm,
                                 key_bias=key_bias, block_n=block_n, dtype=torch.float64)
    assert rel_l2(fast[:, :, rows], ref.to(fast.dtype)) < 1e-3


def test_auto_runs_the_gluon_kernel_on_hopper():
    q, k, v = inputs(1, 2, 1000)
    plan = plan_v_smooth(v, num_clusters=16, iters=4)
    decision = explain_backend(q, k, v, plan=plan)
    assert decision.backend == "gluon" and decision.expcast, str(decision)
    out = vc_attention(q, k, v, plan=plan)
    ref = reference_vc_attention(q, k, v, bits=8, v_smooth=True, expcast=True, perm=plan.perm,
                                 block_n=block_n_for(True, False, True), dtype=torch.float64)
    assert rel_l2(out, ref.to(out.dtype)) < 1e-3
    # and on (B, N, H, D) views, as ComfyUI hands them over
    out_nhd = vc_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), plan=plan, layout="NHD")
    assert torch.equal(out_nhd.transpose(1, 2), out)


@pytest.mark.parametrize("N", [64, 128, 1000, 4173])
def test_wgmma_order_with_the_fp32_mean_matches_the_twin(N):
    """In wgmma order P is packed into words by PRMT (flag_pack) and the column order changes which
    register holds which key; with the fp32 mean (mean_mma=False) the output stays the twin's bit for
    bit, on one partial tile, one full tile, odd N and several tiles."""
    q, k, v = inputs(1, 3, N)
    plan = plan_v_smooth(v, num_clusters=16, iters=4)
    ops, _ = prepare(q, k, v, plan.perm, True, pv_perm=True)
    twin, fast = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    vc_attention_fwd(*ops, twin, 3, expcast=True, block_n=block_n_for(True, False, True))
    vc_attention_fwd_sm90(*ops, fast, 3, expcast=True, mean_mma=False)
    torch.cuda.synchronize()
    assert torch.equal(fast, twin), rel_l2(fast, twin)


@pytest.mark.parametrize("N", [64, 128, 1000, 4173, 16_384])
def test_mean_mma_option_stays_at_the_twin(N):
    """The tf32 wgmma for V-Smooth's mean (mean_mma=True; dispatched in wgmma order, asked for here in
    the order this Triton dispatches) sums r mu in 3xTF32 on the tensor cores, a tile late on P.V's
    accumulator: not bit-identical to the twin's fp32 FMA, but within 2^-18 of the output's scale in
    fp32, and as close to the float64 reference as the twin (the bf16 floor); on one partial tile,
    one full tile, odd N and several tiles."""
    q, k, v = inputs(1, 2, N)
    plan = plan_v_smooth(v, num_clusters=16, iters=4)
    ops, _ = prepare(q, k, v, plan.perm, True, pv_perm=config.pv_perm_for())
    twin = torch.full(q.shape, float("nan"), device="cuda")
    fast = torch.full(q.shape, float("nan"), device="cuda")
    vc_attention_fwd(*ops, twin, 2, expcast=True, block_n=block_n_for(True, False, True))
    vc_attention_fwd_sm90(*ops, fast, 2, expcast=True, mean_mma=True)
    torch.cuda.synchronize()
    assert not torch.isnan(fast).any()
    assert (fast - twin).abs().max().item() <= 2.0 ** -18 * twin.abs().max().item()
    rows = torch.arange(N, device="cuda")
    if N > 1024:
        rows = torch.cat([rows[:256], rows[N - N % 128:]])
    ref = reference_vc_attention(q[:, :, rows], k, v, bits=8, v_smooth=True, expcast=True, perm=plan.perm,
                                 block_n=block_n_for(True, False, True), dtype=torch.float64)
    err, floor = rel_l2(fast[:, :, rows], ref), rel_l2(twin[:, :, rows], ref)
    assert err <= 1.01 * floor + 1e-7, (err, floor)


@pytest.mark.parametrize("N", [64, 1000, 4173, 16_384])
def test_prepass_writes_the_mean_operand(N):
    """The pre-pass writes the Hopper kernel's tf32 B operand of the V-Smooth means on the GPU
    (quantize_v_residual(mu_tf32=True), v_quantize_kernel) with the bits of the readable
    construction (pipeline.mu_tf32_pairs), and mu / scale with torch's IEEE division; the kernel's
    output is then the same as with the operand built on the host; the public call passes it."""
    from vc_attention.kernels import pipeline

    q, k, v = inputs(2, 3, N)
    plan = plan_v_smooth(v, num_clusters=16, iters=4)
    ops, _ = prepare_8bit(triton_launch, q, k, v, v_smooth=True, perm=plan.perm, pv_perm=config.pv_perm_for(),
                          mu_tf32=True)
    vp = ops[6]
    assert not torch.isnan(vp["scale"]).any()  # finite inputs: the handed-on scale is the codes' scale
    assert torch.equal(vp["mu_scaled"], vp["mu"].float() / vp["scale"][:, None, :])
    assert torch.equal(vp["mu_tf32_pairs"], pipeline.mu_tf32_pairs(vp["mu_scaled"]))
    with_prepass = torch.full(q.shape, float("nan"), device="cuda")
    with_host = torch.full(q.shape, float("nan"), device="cuda")
    vc_attention_fwd_sm90(*ops, with_prepass, 3, expcast=True)
    ops_host = list(ops)
    ops_host[6] = {key: val for key, val in vp.items() if key != "mu_tf32_pairs"}
    vc_attention_fwd_sm90(*ops_host, with_host, 3, expcast=True)
    torch.cuda.synchronize()
    assert not torch.isnan(with_prepass).any() and torch.equal(with_prepass, with_host)
    out = vc_attention(q, k, v, plan=plan)  # dispatched: the Gluon kernel, operand from the pre-pass
    assert torch.equal(out, with_prepass.to(out.dtype))


@pytest.mark.parametrize("order", ["key_order", "wgmma_order"])
@pytest.mark.parametrize("factor", [1.0, 60.0])  # 60: huge scores, the loop copy with the clip at 120
def test_tail_piece_on_and_off_match_the_twin(order, factor):
    """ExpCast with its tail piece (the launch option expcast_tail=True) and without it (the default, the
    paper's byte map): the Gluon kernel and its twin write the same output bits either way, and the
    piece changes the output (rows of 16K keys reach E4M3's subnormal band)."""
    B, H, N = 1, 2, 16_384
    q, k, v = inputs(B, H, N)
    q, k = q * factor, k * factor
    plan = plan_v_smooth(v, num_clusters=16, iters=4)
    ops, kb2 = prepare(q, k, v, plan.perm, True, None, pv_perm=order == "wgmma_order")
    outs = {}
    for tail in (True, False):
        twin, fast = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
        vc_attention_fwd(*ops, twin, H, expcast=True, expcast_tail=tail)
        vc_attention_fwd_sm90(*ops, fast, H, expcast=True, expcast_tail=tail, mean_mma=False)
        torch.cuda.synchronize()
        assert torch.equal(fast, twin), (tail, rel_l2(fast, twin))
        outs[tail] = fast
    if factor == 1.0:
        assert not torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("case", list(CASES))
def test_gluon_lse_is_the_twins(case):
    """The log-sum-exp ring attention merges by (kernels/sequence_parallel.py): the Hopper kernel's
    log2 LSE from its final reference point and row sum, against the twin's (the same bytes; the
    row sums in another order: fp32 rounding); the outputs stay the ones without the LSE, bit for
    bit."""
    B, H, N, M, v_smooth, expcast, bias, *factor = CASES[case]
    q, k, v = inputs(B, H, N, M)
    if factor:
        q, k = q * factor[0], k * factor[0]
    plan = plan_v_smooth(v, num_clusters=16, iters=4) if v_smooth else None
    key_bias = None
    if bias:
        key_bias = torch.zeros(B, 1, 1, N, device="cuda")
        key_bias[..., ::7] = -3.0
        key_bias[..., 5::11] = float("-inf")
    ops, kb2 = prepare(q, k, v, None if plan is None else plan.perm, v_smooth, key_bias)
    block_n = block_n_for(v_smooth, bias, expcast)
    BH, Mq = ops[0].shape[:2]
    outs, lses = [], []
    for run in (lambda o, r: vc_attention_fwd(*ops, o, H, key_bias_log2=kb2, expcast=expcast, block_n=block_n, lse=r),
                lambda o, r: vc_attention_fwd_sm90(*ops, o, H, key_bias_log2=kb2, expcast=expcast, lse=r)):
        out, lse = torch.full_like(q, float("nan")), torch.full((BH, Mq), float("nan"), device="cuda")
        run(out, lse)
        outs.append(out)
        lses.append(lse)
    plain = torch.full_like(q, float("nan"))
    vc_attention_fwd_sm90(*ops, plain, H, key_bias_log2=kb2, expcast=expcast)
    torch.cuda.synchronize()
    assert not torch.isnan(lses[1]).any()
    torch.testing.assert_close(lses[1], lses[0], rtol=0, atol=1e-5)
    assert torch.equal(outs[1], plain)


def scaled_case(B, H, N, factor, bias):
    """inputs() with Q and K times factor, a key bias masking the last 300 keys (or None), a k-means plan."""
    q, k, v = inputs(B, H, N)
    q, k = q * factor, k * factor
    kb = None
    if bias:
        kb = torch.zeros(B, 1, 1, N, device="cuda")
        kb[..., N - 300:] = float("-inf")
    return q, k, v, kb, plan_v_smooth(v, num_clusters=16, iters=4)


E5M2_CASES = {  # B, H, N, bias, factor on q and k
    "vsmooth_N333": (1, 2, 333, False, 1.0), "vsmooth_bias_N4173": (1, 2, 4173, True, 1.0),
    "vsmooth_clipped_N1000": (1, 2, 1000, False, 60.0), "wan720p_4heads": (1, 4, 75_600, False, 1.0),
}


@pytest.mark.parametrize("order", ["key_order", "wgmma_order"])
@pytest.mark.parametrize("case", list(E5M2_CASES))
def test_e5m2_bytes_match_the_twin_and_reference(case, order):
    """ExpCast's bytes as E5M2 (the default; P.V and P.ones as e5m2 x e4m3 wgmma): the Gluon
    kernel and its twin write the same output bits (both loop copies: the clipped one at factor 60),
    the same LSE, and both stay within 1e-3 of the float64 reference with p_format="e5m2"."""
    B, H, N, bias, factor = E5M2_CASES[case]
    q, k, v, kb, plan = scaled_case(B, H, N, factor, bias)
    ops, kb2 = prepare(q, k, v, plan.perm, True, kb, pv_perm=order == "wgmma_order")
    twin, fast = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    lse_t = torch.empty(B * H, N, device="cuda")
    lse_f = torch.empty(B * H, N, device="cuda")
    block_n = block_n_for(True, bias, True)
    vc_attention_fwd(*ops, twin, H, key_bias_log2=kb2, expcast=True, p_e5m2=True, lse=lse_t, block_n=block_n)
    vc_attention_fwd_sm90(*ops, fast, H, key_bias_log2=kb2, expcast=True, p_e5m2=True, mean_mma=False, lse=lse_f)
    torch.cuda.synchronize()
    assert not torch.isnan(fast).any()
    assert torch.equal(fast, twin), rel_l2(fast, twin)
    assert torch.equal(lse_f, lse_t)
    if N <= 4173:
        ref = reference_vc_attention(q.double(), k.double(), v.double(), bits=8, v_smooth=True, expcast=True,
                                     perm=plan.perm, key_bias=kb, p_format="e5m2", dtype=torch.float64,
                                     block_n=block_n)
        assert rel_l2(fast, ref.to(fast.dtype)) < 1e-3
    default, e4m3 = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    vc_attention_fwd_sm90(*ops, default, H, key_bias_log2=kb2, expcast=True, mean_mma=False)
    vc_attention_fwd_sm90(*ops, e4m3, H, key_bias_log2=kb2, expcast=True, p_e5m2=False, mean_mma=False)
    assert torch.equal(default, fast)  # E5M2 is ExpCast's default byte format (P_E5M2_ON)
    assert not torch.equal(e4m3, fast)  # the other byte format, not a no-op option


V_TERMS_CASES = {  # B, H, N, expcast, bias, factor on q and k
    "expcast_N333": (1, 2, 333, True, False, 1.0), "expcast_bias_N4173": (1, 2, 4173, True, True, 1.0),
    "expcast_clipped_N1000": (1, 2, 1000, True, False, 60.0), "exp2_N1000": (1, 2, 1000, False, False, 1.0),
    "wan720p_4heads": (1, 4, 75_600, True, False, 1.0),
}


@pytest.mark.parametrize("order", ["key_order", "wgmma_order"])
@pytest.mark.parametrize("case", list(V_TERMS_CASES))
def test_v_in_two_terms_matches_the_twin_and_reference(case, order):
    """V's residual in two E4M3 terms (pre-pass v_terms=2, launch option v_terms): the Gluon kernel's
    second P.V wgmma chained onto the first and the twin's second dot write the same output bits with
    the fp32 mean (with the mean on the tensor cores within 2^-18 of the output's scale, fp32 outputs),
    both stay within 1e-3 of the float64 reference with v_terms=2, and the second term moves the output
    (not a no-op: the one-term output differs)."""
    B, H, N, expcast, bias, factor = V_TERMS_CASES[case]
    q, k, v, kb, plan = scaled_case(B, H, N, factor, bias)
    ops, kb2 = prepare_8bit(triton_launch, q, k, v, v_smooth=True, perm=plan.perm, key_bias=kb,
                            pv_perm=order == "wgmma_order", v_terms=2)
    assert "vt_lo" in ops[6]
    block_n = block_n_for(True, bias, expcast)
    twin, fast = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    vc_attention_fwd(*ops, twin, H, key_bias_log2=kb2, expcast=expcast, block_n=block_n)
    vc_attention_fwd_sm90(*ops, fast, H, key_bias_log2=kb2, expcast=expcast, mean_mma=False)
    torch.cuda.synchronize()
    assert not torch.isnan(fast).any()
    assert torch.equal(fast, twin), rel_l2(fast, twin)
    if config.mean_on_tensor_cores(expcast, order == "wgmma_order", True, bias):
        twin32 = torch.full(q.shape, float("nan"), device="cuda")
        fast32 = torch.full(q.shape, float("nan"), device="cuda")
        vc_attention_fwd(*ops, twin32, H, key_bias_log2=kb2, expcast=expcast, block_n=block_n)
        vc_attention_fwd_sm90(*ops, fast32, H, key_bias_log2=kb2, expcast=expcast)
        torch.cuda.synchronize()
        assert (fast32 - twin32).abs().max().item() <= 2.0 ** -18 * twin32.abs().max().item()
    rows = torch.arange(N, device="cuda")
    if N > 4173:  # Q is quantised per 128-row block: a block-aligned slice keeps its codes
        rows = torch.cat([rows[:256], rows[N - N % 128:]])
    ref = reference_vc_attention(q[:, :, rows].double(), k.double(), v.double(), bits=8, v_smooth=True,
                                 expcast=expcast, perm=plan.perm, key_bias=kb, dtype=torch.float64, block_n=block_n,
                                 v_terms=2)
    assert rel_l2(fast[:, :, rows], ref.to(fast.dtype)) < 1e-3
    one = torch.full_like(q, float("nan"))
    ops1, _ = prepare_8bit(triton_launch, q, k, v, v_smooth=True, perm=plan.perm, key_bias=kb,
                           pv_perm=order == "wgmma_order")
    vc_attention_fwd_sm90(*ops1, one, H, key_bias_log2=kb2, expcast=expcast, mean_mma=False)
    assert not torch.equal(one, fast)
