"""The backend registry (kernels/dispatch.py) on the CPU: its choice per GPU generation with the
device's answers monkeypatched, every refusal reason as explain_backend prints it, the k-means
choice, one run function per record, and the demo's table labels."""

import types

import pytest
import torch

from vc_attention.kernels import BACKENDS, demo, dispatch, explain_backend, plan_v_smooth, vc_attention
from vc_attention.kernels.dispatch import REGISTRY, CallSpec, choose_backend, choose_kmeans
from vc_attention.kernels.precompiled.specs import attention_kernel

from kernel_helpers import video_like_qkv

NO_CUBINS = "no precompiled cubins installed (test)"


@pytest.fixture
def gpu(monkeypatch):
    """gpu(capability, ...) makes the registry see a CUDA device of that compute capability (None:
    no GPU), with Triton, Gluon and the mma module importable or not, and returns its CallSpec."""

    def make(capability, *, bits=8, triton=True, gluon=True, mma=True, triton_version=(3, 9),
             cubins=False, **fields):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(dispatch, "triton_status", lambda: (True, "") if triton else (
            False, "Triton kernels cannot be imported: ImportError: no triton (test)"))
        monkeypatch.setattr(dispatch, "gluon_status", lambda: (True, "") if gluon else (
            False, "the Gluon Hopper kernel cannot be imported: ImportError: no gluon (test)"))
        monkeypatch.setattr(dispatch, "mma_status", lambda: (True, "") if mma else (
            False, "the mma.sync kernel (kernels/triton/attention_mma.py) cannot be imported: "
                   "ModuleNotFoundError: no attention_mma (test)"))
        monkeypatch.setattr(dispatch, "triton_version", lambda: triton_version)
        monkeypatch.setattr(dispatch, "precompiled_status", lambda cap: (
            (True, "", frozenset({(128, "bf16")})) if cubins else (False, NO_CUBINS, frozenset())))
        # a full install: the arch's own cubins where the specs build some, else the sm_89 PTX
        monkeypatch.setattr(dispatch, "cubins_kernel", lambda cap: (
            attention_kernel(cap[0] * 10 + cap[1]) or attention_kernel(89)) if cubins else None)
        spec = dict(device_type="cuda" if capability else "cpu", dtype=torch.bfloat16, head_dim=128, bits=bits,
                    interpreting=False)
        spec.update(fields)
        return CallSpec(capability=dispatch.device_capability(torch.device(spec["device_type"])), **spec)

    return make


# What "auto" runs per GPU and bit width: (backend, ExpCast by default) for bits 8, then for bits 4.
CHOICES = {
    (8, 0): (("sdpa", False), ("sdpa", False)),  # no FP8 tensor cores
    (8, 9): (("mma", False), ("sdpa", False)),  # RTX 4090: mma.sync; no FP4 tensor cores
    (9, 0): (("gluon", True), ("sdpa", False)),  # H100 / H200: the Hopper kernel; no FP4
    (10, 0): (("triton", True), ("triton", False)),  # B200: the portable kernel; NVFP4
    (12, 0): (("mma", False), ("triton", False)),  # RTX 5090 / PRO 6000: mma.sync; NVFP4
    None: (("sdpa", False), ("sdpa", False)),  # no GPU (and not under the interpreter)
}


@pytest.mark.parametrize("capability", list(CHOICES), ids=lambda c: "no GPU" if c is None else f"sm_{c[0]}{c[1]}")
@pytest.mark.parametrize("bits", [8, 4])
def test_auto_choice_per_gpu(gpu, capability, bits):
    backend, expcast = CHOICES[capability][0 if bits == 8 else 1]
    decision = choose_backend(gpu(capability, bits=bits))
    assert (decision.backend, decision.expcast) == (backend, expcast), str(decision)
    assert decision.low_bit == (backend != "sdpa") and decision.fallback == (backend == "sdpa")
    assert decision.bits == (bits if decision.low_bit else None)
    # every backend before the chosen one is refused, with its reason; none after it is tried
    assert list(decision.reasons) == list(BACKENDS[:BACKENDS.index(backend)])


@pytest.mark.parametrize("capability", list(CHOICES), ids=lambda c: "no GPU" if c is None else f"sm_{c[0]}{c[1]}")
def test_exact_mode_runs_the_reference_everywhere(gpu, capability):
    decision = choose_backend(gpu(capability, bits=16))
    assert decision.backend == "reference" and decision.low_bit and decision.bits == 16


@pytest.mark.parametrize("capability", [(8, 9), (12, 0)])
def test_without_the_mma_module_the_portable_kernel_runs_and_says_why(gpu, capability):
    decision = choose_backend(gpu(capability, mma=False))
    assert decision.backend == "triton"
    assert "attention_mma.py) cannot be imported" in decision.reasons["mma"]
    assert "  mma refused: the mma.sync kernel (kernels/triton/attention_mma.py) cannot be imported" in str(decision)


def test_mma_on_request_elsewhere_raises_with_the_gpus_it_is_for(gpu):
    with pytest.raises(RuntimeError, match=r"sm_89 \(RTX 4090\) and sm_120 .*this GPU is sm_90"):
        choose_backend(gpu((9, 0)), "mma")


def test_hopper_without_gluon_runs_the_portable_kernel_and_says_why(gpu):
    decision = choose_backend(gpu((9, 0), gluon=False))
    assert decision.backend == "triton" and decision.expcast
    assert "  gluon refused: the Gluon Hopper kernel cannot be imported" in str(decision)


def test_hopper_with_exp2_runs_the_gluon_kernel_too(gpu):
    decision = choose_backend(gpu((9, 0)), expcast=False)
    assert decision.backend == "gluon" and decision.expcast is False


def test_cubins_come_before_the_jit_but_after_the_mma_kernel(gpu):
    assert choose_backend(gpu((10, 0), cubins=True)).backend == "precompiled"
    assert choose_backend(gpu((8, 9), cubins=True)).backend == "mma"
    assert choose_backend(gpu((8, 9), cubins=True, mma=False)).backend == "precompiled"
    assert choose_backend(gpu((8, 9), cubins=True, triton=False)).backend == "precompiled"  # no Triton at all


def test_under_the_interpreter_auto_takes_the_portable_kernel_and_mma_runs_on_request(gpu):
    spec = gpu(None, interpreting=True)
    decision = choose_backend(spec)
    assert decision.backend == "triton"
    assert "runs on the CPU on request (backend='mma')" in decision.reasons["mma"]
    assert choose_backend(spec, "mma").backend == "mma"
    assert choose_backend(gpu(None, interpreting=True, bits=4)).backend == "triton"


# Every refusal reason the registry gives, as explain_backend prints it: (the call, backend, words).
REFUSALS = [
    (dict(capability=(9, 0), bits=4), "gluon", "the Hopper kernel: 8-bit only, bits=4 has none"),
    (dict(capability=(9, 0), bits=16), "triton", "the Triton kernels: 8-bit and 4-bit only, bits=16 has none"),
    (dict(capability=(9, 0), bits=4), "precompiled", "the cubins: 8-bit only, bits=4 has none"),
    (dict(capability=(12, 0), bits=4), "mma", "the mma.sync kernel: 8-bit only, bits=4 has none"),
    (dict(capability=(9, 0), per_key_mask_only=False), "gluon", "a query-dependent or causal mask"),
    (dict(capability=(9, 0), per_key_mask_only=False), "reference", "a query-dependent or causal mask"),
    (dict(capability=None), "gluon", "tensors are on cpu, not a CUDA GPU (Gluon kernels do not run"),
    (dict(capability=None), "mma", "not a CUDA GPU (set TRITON_INTERPRET=1 and backend='mma'"),
    (dict(capability=None), "precompiled", "not a CUDA GPU (cubins run through the CUDA driver)"),
    (dict(capability=None), "triton", "not a CUDA GPU (set TRITON_INTERPRET=1 to run the kernels"),
    (dict(capability=(8, 9)), "gluon", "the Gluon kernel uses Hopper's wgmma and TMA (sm_90); this GPU is sm_89"),
    (dict(capability=(9, 0), gluon=False), "mma", "this GPU is sm_90"),
    (dict(capability=(8, 0)), "triton", "FP8 tensor cores need sm_89 or newer; this GPU is sm_80"),
    (dict(capability=(8, 0)), "precompiled", "FP8 tensor cores need sm_89 or newer; this GPU is sm_80"),
    (dict(capability=(9, 0), bits=4), "triton", "needs FP4 tensor cores (sm_100 B200, sm_120 RTX 5090 / RTX PRO "
                                                 "6000); this GPU is sm_90: use bits=8"),
    (dict(capability=(10, 0), bits=4, triton_version=(3, 8)), "triton",
     "Triton 3.8 cannot build the 4-bit NVFP4 kernel for sm_100 (Triton 3.9 or newer can)"),
    (dict(capability=(9, 0), head_dim=64), "gluon", "head dim 64 (the Hopper kernel: head dim 128 only)"),
    (dict(capability=(9, 0), head_dim=96), "triton", "head dim 96 (the Triton kernels: head dim 64 or 128 only)"),
    (dict(capability=(8, 9), head_dim=96), "mma", "head dim 96"),
    (dict(capability=(9, 0), dtype=torch.float64), "triton", "dtype torch.float64 (the Triton kernels: bfloat16, float16 or float32 only)"),
    (dict(capability=(8, 0)), "reference", "the readable reference is slow: used on request"),
    (dict(capability=(9, 0), triton=False), "triton", "Triton kernels cannot be imported: ImportError"),
    (dict(capability=(9, 0), triton=False), "gluon", "Triton kernels cannot be imported"),  # its pre-pass
    (dict(capability=(9, 0), gluon=False), "gluon", "the Gluon Hopper kernel cannot be imported"),
    (dict(capability=(8, 9), mma=False), "mma", "attention_mma.py) cannot be imported"),
    (dict(capability=(10, 0)), "precompiled", NO_CUBINS),
    (dict(capability=(10, 0), cubins=True, dtype=torch.float16), "precompiled",
     "the cubins for this GPU have no kernel for head dim 128 with torch.float16"),
]


@pytest.mark.parametrize("call,name,words", REFUSALS)
def test_every_refusal_reason_is_printed(gpu, call, name, words):
    decision = choose_backend(gpu(**call), log_fallback=False)
    assert decision.backend != name
    assert words in decision.reasons[name], decision.reasons[name]
    assert f"  {name} refused: {decision.reasons[name]}" in str(decision).splitlines()
    if name != "reference":  # the same reason when asked for by name ("auto"'s own rule aside)
        with pytest.raises(RuntimeError, match="cannot run this call") as error:
            choose_backend(gpu(**call), name)
        assert words in str(error.value)


def test_every_record_refuses_somewhere():
    """The table above reaches every low-bit record, and every record's kind of refusal."""
    assert {name for _, name, _ in REFUSALS} == set(BACKENDS) - {"sdpa"}


def test_explain_backend_prints_the_reasons_of_a_real_cpu_call(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = video_like_qkv(1, 2, 64, 64)
    text = str(explain_backend(q, k, v))
    assert text.splitlines()[0] == "VC-Attention backend: sdpa"
    for name in ("gluon", "mma", "precompiled", "triton"):
        assert f"  {name} refused: tensors are on cpu, not a CUDA GPU" in text
    assert "  reference refused: the readable reference is slow" in text


def test_the_decision_names_its_kernel(gpu):
    assert str(choose_backend(gpu((9, 0)))).splitlines()[0] == (
        "VC-Attention backend: gluon (8-bit Hopper kernel, P by ExpCast)")
    assert str(choose_backend(gpu((8, 9)))).splitlines()[0] == (
        "VC-Attention backend: mma (8-bit mma.sync kernel, P by exp2 + cast)")
    assert str(choose_backend(gpu((12, 0), bits=4))).splitlines()[0] == (
        "VC-Attention backend: triton (4-bit NVFP4, P by exp2 + NVFP4 per 16 keys)")
    assert str(choose_backend(gpu((10, 0)), expcast=False)).splitlines()[0] == (
        "VC-Attention backend: triton (8-bit, P by exp2 + cast)")


def test_unknown_backend_and_bits_are_refused_with_the_names():
    spec = CallSpec(device_type="cpu", capability=None, dtype=torch.float32, head_dim=64, bits=8)
    with pytest.raises(ValueError, match="'mma'"):
        choose_backend(spec, "cuda")
    with pytest.raises(ValueError, match="bits must be one of"):
        choose_backend(CallSpec(device_type="cpu", capability=None, dtype=torch.float32, head_dim=64, bits=3))


def test_records_are_one_per_name_and_each_has_a_kernel_for_its_bits():
    assert BACKENDS == ("gluon", "mma", "precompiled", "triton", "reference", "sdpa")
    for record in REGISTRY.values():
        assert record.description and record.kernels
        assert len(set(record.bits)) == len(record.bits)
    assert REGISTRY["triton"].bits == (8, 4) and REGISTRY["reference"].bits == (8, 4, 16)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_the_custom_op_runs_each_cpu_record(backend):
    """The op calls the named record's run function: the same values as calling it directly."""
    q, k, v = video_like_qkv(1, 2, 64, 64, dtype=torch.float32)
    out = torch.ops.vc_attention.attention(q, k, v, None, None, None, False, 8, True, False, 0.125, "HND", backend)
    if backend == "sdpa":
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125)
    else:
        from vc_attention.kernels.reference import reference_vc_attention

        want = reference_vc_attention(q, k, v, bits=8, v_smooth=True, sm_scale=0.125, dtype=torch.float32)
    assert torch.equal(out, want)


def test_the_mma_record_runs_its_kernel_under_the_interpreter(monkeypatch):
    """backend='mma' on the CPU (TRITON_INTERPRET=1) runs kernels/triton/attention_mma.py through the
    registry: the same bytes as calling mma_vc_attention directly, its INT8 P.V path by default
    (pv_format="auto") and its FP8 one with pv_format="fp8"."""
    if not dispatch.interpreting() or not dispatch.mma_status()[0]:
        pytest.skip("needs TRITON_INTERPRET=1 and an importable kernels/triton/attention_mma.py")
    from vc_attention.kernels.triton.attention_mma import mma_vc_attention

    q, k, v = video_like_qkv(1, 1, 128, 64, seed=3)
    for pv_format, pv_int8 in (("auto", True), ("fp8", False)):
        out = vc_attention(q, k, v, backend="mma", pv_format=pv_format)
        want = torch.empty_like(q)
        mma_vc_attention(q, k, v, want, v_smooth=True, expcast=False, sm_scale=64 ** -0.5, pv_int8=pv_int8)
        assert torch.equal(out, want), pv_format


# --- pv_format="int8": the INT8 P.V path ----------------------------------------------------------

@pytest.mark.parametrize("capability", [(8, 9), (12, 0)], ids=["sm_89", "sm_120"])
def test_int8_pv_runs_the_mma_kernel_on_rtx_cards_and_says_so(gpu, capability):
    decision = choose_backend(gpu(capability, pv_int8=True))
    assert decision.backend == "mma" and decision.pv_int8 and not decision.expcast
    assert str(decision).splitlines()[0] == ("VC-Attention backend: mma (8-bit mma.sync kernel, P by exp2 + INT8 "
                                             "per key tile, V's residual INT8 per block)")


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), None], ids=["sm_90", "sm_100", "no GPU"])
def test_int8_pv_elsewhere_raises_with_every_reason(gpu, capability):
    """No silent SDPA: where no kernel has the path, "auto" raises and names each backend's reason."""
    with pytest.raises(RuntimeError, match="no VC-Attention backend can run this call: .*has no INT8 P.V path"):
        choose_backend(gpu(capability, pv_int8=True))
    with pytest.raises(RuntimeError, match="backend 'triton' cannot run this call: .*has no INT8 P.V path"):
        choose_backend(gpu(capability or (9, 0), pv_int8=True), "triton")


def test_int8_pv_without_triton_takes_the_mma_cubins_and_not_the_portable_ones(gpu):
    decision = choose_backend(gpu((12, 0), triton=False, mma=False, cubins=True, pv_int8=True))
    assert decision.backend == "precompiled" and decision.pv_int8
    decision = choose_backend(gpu((12, 1), triton=False, mma=False, cubins=True, pv_int8=True))
    assert decision.backend == "precompiled"  # a newer GPU: the sm_89 PTX, the mma.sync kernel's
    with pytest.raises(RuntimeError, match="cubins for sm_90 run the portable kernel, which has no INT8 P.V path"):
        choose_backend(gpu((9, 0), triton=False, gluon=False, cubins=True, pv_int8=True), "precompiled")


@pytest.mark.parametrize("capability,backend,pv_int8", [
    ((8, 9), "mma", True), ((12, 0), "mma", True), ((9, 0), "gluon", False), ((10, 0), "triton", False),
    (None, "sdpa", False)], ids=["sm_89", "sm_120", "sm_90", "sm_100", "no GPU"])
def test_auto_pv_format_is_int8_where_the_kernel_makes_it_its_default(gpu, capability, backend, pv_int8):
    """pv_format="auto" (the default): the RTX kernel runs its INT8 P.V path, every other backend FP8
    (and "auto" never raises for it, unlike pv_format="int8")."""
    decision = choose_backend(gpu(capability, pv_auto=True))
    assert (decision.backend, decision.pv_int8) == (backend, pv_int8)
    if pv_int8:
        assert not decision.expcast and "INT8 per key tile" in str(decision)


def test_auto_pv_format_takes_fp8_for_expcast_other_bits_and_portable_cubins(gpu):
    assert not choose_backend(gpu((12, 0), pv_auto=True), expcast=True).pv_int8  # ExpCast asked: E4M3 bytes
    decision = choose_backend(gpu((12, 0), pv_auto=True), expcast=True)
    assert decision.backend == "mma" and decision.expcast
    four = choose_backend(gpu((12, 0), bits=4, pv_auto=True))
    assert four.backend == "triton" and not four.pv_int8
    assert not choose_backend(gpu((12, 0), pv_auto=True), "reference").pv_int8  # the reference: as asked
    cubins = choose_backend(gpu((12, 0), triton=False, mma=False, cubins=True, pv_auto=True))
    assert cubins.backend == "precompiled" and cubins.pv_int8  # the mma.sync kernel's cubins
    portable = choose_backend(gpu((9, 0), triton=False, gluon=False, cubins=True, pv_auto=True))
    assert portable.backend == "precompiled" and not portable.pv_int8  # the portable kernel's: FP8


def test_int8_pv_through_the_public_call_is_its_kernel_and_its_reference():
    """backend='reference' runs the INT8 path's readable reference through the custom op; under the
    interpreter backend='mma' runs the kernel, and the two agree."""
    from vc_attention.kernels.reference.workstation import workstation_vc_attention

    q, k, v = video_like_qkv(1, 2, 200, 64, seed=4)
    plan = plan_v_smooth(v, num_clusters=8, backend="reference")
    ref = vc_attention(q, k, v, plan=plan, backend="reference", pv_format="int8")
    want = workstation_vc_attention(q, k, v, perm=plan.perm, pv_accumulation="int8")
    assert torch.equal(ref, want)
    assert explain_backend(q, k, v, backend="reference", pv_format="int8").pv_int8
    if dispatch.interpreting() and dispatch.mma_status()[0]:
        out = vc_attention(q, k, v, plan=plan, backend="mma", pv_format="int8")
        assert ((out - ref).norm() / ref.norm()).item() < 1e-3


def test_int8_pv_bad_combinations_are_refused():
    q, k, v = video_like_qkv(1, 1, 64, 64)
    for kwargs, words in ((dict(pv_format="int4"), "pv_format must be one of"),
                          (dict(pv_format="int8", bits=4), "8-bit path"),
                          (dict(pv_format="int8", expcast=True), "ExpCast writes FP8 bytes")):
        with pytest.raises(ValueError, match=words):
            vc_attention(q, k, v, backend="reference", **kwargs)


# --- the k-means step ---------------------------------------------------------------------------------

def test_kmeans_on_cpu_runs_the_reference_and_says_why_not_the_kernels(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(1, 2, 64, 16)
    name, _, reasons = choose_kmeans(x)
    assert name == "reference" and list(reasons) == ["precompiled", "triton"]
    assert all("not a CUDA GPU" in why for why in reasons.values())
    with pytest.raises(RuntimeError, match="k-means backend 'triton' cannot run here: .*not a CUDA GPU"):
        choose_kmeans(x, "triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        plan_v_smooth(x, num_clusters=4, backend="gluon")


def test_kmeans_under_the_interpreter_takes_the_kernel_on_request_only(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(1, 2, 64, 16)
    assert choose_kmeans(x)[0] == "reference"  # "auto" keeps the interpreter out of the plan
    assert choose_kmeans(x, "triton")[0] == "triton"


def test_kmeans_on_a_gpu_prefers_the_cubins_then_triton(monkeypatch):
    from vc_attention.kernels import precompiled

    x = types.SimpleNamespace(device=torch.device("cuda"))  # only its device is read before a kernel runs
    monkeypatch.setattr(dispatch, "triton_status", lambda: (True, ""))
    monkeypatch.setattr(precompiled, "kmeans_available", lambda x: None)
    assert choose_kmeans(x)[0] == "precompiled"
    monkeypatch.setattr(precompiled, "kmeans_available", lambda x: "no k-means cubin (test)")
    name, _, reasons = choose_kmeans(x)
    assert name == "triton" and reasons == {"precompiled": "no k-means cubin (test)"}
    monkeypatch.setattr(dispatch, "triton_status", lambda: (False, "Triton kernels cannot be imported (test)"))
    name, _, reasons = choose_kmeans(x)
    assert name == "reference" and reasons["triton"] == "Triton kernels cannot be imported (test)"


def test_every_kmeans_backend_gives_the_same_plan_on_the_cpu():
    """The k-means functions share one signature; on the CPU the interpreter's kernel matches the
    reference's labels (tests/kernels/test_kmeans.py checks it in depth)."""
    if not dispatch.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    v = video_like_qkv(1, 1, 96, 32, dtype=torch.float32, seed=5)[2]
    a = plan_v_smooth(v, num_clusters=4, iters=3, backend="reference")
    b = plan_v_smooth(v, num_clusters=4, iters=3, backend="triton")
    assert torch.equal(a.labels, b.labels) and torch.equal(a.perm, b.perm)


# --- the demo's table -----------------------------------------------------------------------------

SMALL = ["--frames", "1", "--height", "8", "--width", "16", "--heads", "1", "--clusters", "4"]


def test_demo_labels_every_row_with_the_backend_that_ran_it(capsys):
    demo.main(SMALL + ["--backend", "reference"])
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("against exact attention"))
    assert "SQNR dB, higher is better" in lines[head] and "rel L2, lower is better" in lines[head]
    assert lines[head + 1].split()[:3] == ["variant", "ran", "on"]
    rows = lines[head + 2:]
    assert len(rows) == len(demo.VARIANTS)
    for (name, _), row in zip(demo.VARIANTS, rows):
        assert row.startswith(name) and row[54:].split()[0] == "reference"


def test_demo_says_when_a_row_fell_back_to_sdpa(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # no low-bit kernel for 8-bit on this CPU
    demo.main(SMALL + ["--backend", "auto"])
    out = capsys.readouterr().out
    rows = out.splitlines()[-len(demo.VARIANTS):]
    assert all("sdpa (fallback: not low-bit)" in row for row in rows[:-1])
    assert rows[-1].startswith("exact mode") and rows[-1][54:].split()[0] == "reference"
