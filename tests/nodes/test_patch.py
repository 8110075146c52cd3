"""The patch node inside real ComfyUI (CPU): UNETLoader -> VCAttentionPatch -> KSampler(Advanced).

Tiny random Wan 2.1, Wan 2.2-5B and HunyuanVideo 1.5 models are built from ComfyUI's own classes
(conftest.py). The library's reference backend runs VC-Attention on the CPU; ``backend="auto"`` on
the CPU has no low-bit kernel and must fall back to ComfyUI's attention.
"""

import copy
import sys

import pytest
import torch

from comfy_harness import (hunyuan_conditioning, latent, load, patch, run_v3, sample,  # noqa: F401
                              wan_conditioning)

# (model file, latent channels, conditioning) per family. Latents give 192 video tokens: one full
# and one partial 128-row V block.
MODELS = {
    "wan21": ("tiny_wan21.safetensors", 16, wan_conditioning, dict(frames=3, h=16, w=16)),
    "wan22_5b": ("tiny_wan22_5b.safetensors", 48, wan_conditioning, dict(frames=3, h=16, w=16)),
    "hunyuan15": ("tiny_hunyuan15.safetensors", 32, hunyuan_conditioning, dict(frames=3, h=8, w=8)),
}
REF = dict(backend="reference", clusters=8)


def render(comfy_nodes, model, family, **kw):
    _, channels, cond, shape = MODELS[family]
    return sample(comfy_nodes, model, cond(1), cond(2), latent(channels, **shape), **kw)["samples"]


def override_of(model):
    return model.model_options["transformer_options"]["optimized_attention_override"]


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def models(comfy_nodes, model_dir):
    return {family: load(comfy_nodes, spec[0]) for family, spec in MODELS.items()}


@pytest.fixture(scope="module")
def base(comfy_nodes, models):
    """Unpatched renders (4 euler steps, cfg 2)."""
    return {family: render(comfy_nodes, m, family) for family, m in models.items()}


@pytest.fixture
def engine_module():
    """Where both patch nodes call the library (kernels.vc_attention, kernels.plan_v_smooth)."""
    return sys.modules["vc_attention.nodes.engine"]


class CallCounter:
    """Counts module calls with forward pre-hooks: the ground truth the override is checked against."""

    def __init__(self, diffusion_model):
        from comfy.ldm.flux.layers import DoubleStreamBlock, SingleStreamBlock
        from comfy.ldm.hunyuan_video.model import TokenRefinerBlock
        from comfy.ldm.wan.model import WanSelfAttention

        self.counts = {"self": 0, "other": 0}
        self.handles = []
        for module in diffusion_model.modules():
            kind = None
            if type(module) is WanSelfAttention or isinstance(module, (DoubleStreamBlock, SingleStreamBlock)):
                kind = "self"  # one self-attention call per forward
            elif isinstance(module, WanSelfAttention) or isinstance(module, TokenRefinerBlock):
                kind = "other"  # Wan cross-attention (t2v: one call), HunyuanVideo token refiner
            if kind:
                self.handles.append(module.register_forward_pre_hook(self._hook(kind)))

    def _hook(self, kind):
        def hook(module, args):
            self.counts[kind] += 1
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("family", list(MODELS))
def test_every_self_attention_call_is_permuted_and_quantised_and_no_other(comfy_nodes, models, family, engine_module,
                                                                          monkeypatch):
    seen = []
    real = engine_module.vc_attention

    def spy(q, k, v, **kw):  # the real kernel runs; the spy only records what it was given
        seen.append((kw["bits"], kw["plan"] is not None, kw["v_smooth"], kw["key_bias"] is not None))
        return real(q, k, v, **kw)

    monkeypatch.setattr(engine_module, "vc_attention", spy)
    patched = patch(comfy_nodes, models[family], bits="8", **REF).args[0]
    counter = CallCounter(models[family].model.diffusion_model)
    try:
        render(comfy_nodes, patched, family)
    finally:
        counter.remove()
    report = override_of(patched).last_report
    assert counter.counts["self"] > 0 and counter.counts["other"] > 0
    assert report.patched == counter.counts["self"] == len(seen)
    assert report.passed == {"not self-attention": counter.counts["other"]}
    assert all(bits == 8 and has_plan and smooth for bits, has_plan, smooth, _ in seen)
    assert report.backends == {"reference": counter.counts["self"]}
    assert not report.errors


def test_hunyuan_text_padding_mask_is_a_permuted_key_bias(comfy_nodes, models, engine_module, monkeypatch):
    """A padded prompt gives HunyuanVideo an additive per-key mask: still patched, mask as key_bias."""
    seen = []
    real = engine_module.vc_attention

    def spy(q, k, v, **kw):
        seen.append(kw["key_bias"])
        return real(q, k, v, **kw)

    monkeypatch.setattr(engine_module, "vc_attention", spy)
    m = models["hunyuan15"]
    lat = latent(32, **MODELS["hunyuan15"][3])
    # Only the prompt is padded: ComfyUI's HunyuanVideo builds the mask for batch 1, so the negative
    # (no mask) runs as its own batch.
    pos, neg = hunyuan_conditioning(1, padded=8), hunyuan_conditioning(2)
    reference = sample(comfy_nodes, m, pos, neg, lat)["samples"]
    monkeypatch.setenv("VC_ATTENTION_BACKEND", "exact")
    patched = patch(comfy_nodes, m, bits="8", clusters=8).args[0]
    out = sample(comfy_nodes, patched, pos, neg, lat)["samples"]
    report = override_of(patched).last_report
    assert report.patched == len(seen) > 0 and not report.errors
    masked = [b for b in seen if b is not None]
    assert masked and len(masked) < len(seen)  # prompt calls masked, negative calls not
    assert all(b.shape[-2] == 1 and (b < -1e30).sum() == 8 for b in masked)
    assert rel_err(out, reference) < 1e-5


def test_bits_off_is_bitwise_the_unpatched_render(comfy_nodes, models, base):
    patched = patch(comfy_nodes, models["wan21"], bits="off", **REF).args[0]
    out = render(comfy_nodes, patched, "wan21")
    assert torch.equal(out, base["wan21"])
    report = override_of(patched).last_report
    assert report.patched == 0 and report.passed["bits off"] > 0


@pytest.mark.parametrize("family", list(MODELS))
def test_exact_mode_matches_unpatched(comfy_nodes, models, base, family, monkeypatch):
    """VC_ATTENTION_BACKEND=exact: permutation + demeaning, no quantisation (bits 16).

    Bound: relative L2 error of the final latent < 1e-5. Exact mode and SDPA differ only by float32
    rounding (summation order, the mean taken out and added back); measured after 4 steps: about
    3e-7 on all three models.
    """
    monkeypatch.setenv("VC_ATTENTION_BACKEND", "exact")
    patched = patch(comfy_nodes, models[family], bits="8", clusters=8).args[0]
    out = render(comfy_nodes, patched, family)
    report = override_of(patched).last_report
    assert report.patched > 0 and not report.errors
    assert rel_err(out, base[family]) < 1e-5


@pytest.mark.parametrize("family", list(MODELS))
def test_8bit_reference_render_is_close(comfy_nodes, models, base, family):
    """8-bit VC-Attention (INT8 Q/K per block, E4M3 V residual, FP8 P) on the reference backend.

    Bound: relative L2 error of the final latent < 1e-2 (40 dB SQNR). Measured after 4 steps:
    1.5e-3 (Wan 2.1), 1.4e-3 (Wan 2.2-5B), 2.2e-3 (HunyuanVideo 1.5).
    """
    patched = patch(comfy_nodes, models[family], bits="8", **REF).args[0]
    out = render(comfy_nodes, patched, family)
    err = rel_err(out, base[family])
    assert 0 < err < 1e-2, err
    assert torch.isfinite(out).all()


def test_state_resets_between_runs(comfy_nodes, models):
    """The same patched model sampled twice: identical results, fresh (cold) plans each run."""
    patched = patch(comfy_nodes, models["wan21"], bits="8", **REF).args[0]
    ov = override_of(patched)
    first = render(comfy_nodes, patched, "wan21")
    r1 = ov.last_report
    second = render(comfy_nodes, patched, "wan21")
    r2 = ov.last_report
    assert r1 is not r2 and ov.runs == 2
    assert torch.equal(first, second)
    assert r1.events == r2.events and all(a == "cold" for s, _, a in r2.events if s == 0)
    assert len(ov.plans) == 0  # nothing kept after a run
    # A different shape in the next run re-plans from scratch too.
    other = sample(comfy_nodes, patched, wan_conditioning(1), wan_conditioning(2), latent(16, frames=2, h=16, w=16))
    assert torch.isfinite(other["samples"]).all() and ov.last_report.events[0][2] == "cold"


def test_original_model_is_untouched(comfy_nodes, models, base):
    m = models["wan21"]
    options = copy.copy(m.model_options["transformer_options"])
    object_patches = dict(m.object_patches)
    wrappers = copy.deepcopy(m.wrappers)
    patched = patch(comfy_nodes, m, bits="8", **REF).args[0]
    render(comfy_nodes, patched, "wan21")
    assert patched is not m
    assert m.model_options["transformer_options"] == options
    assert "optimized_attention_override" not in m.model_options["transformer_options"]
    assert m.object_patches == object_patches and m.wrappers == wrappers
    # The object patches were reverted when the original was loaded again: bitwise the same render.
    assert torch.equal(render(comfy_nodes, m, "wan21"), base["wan21"])


def test_grouping_on_expected_steps(comfy_nodes, models, engine_module, monkeypatch):
    """12 euler steps, window 0.5 (steps 0-5), refresh 2: every layer groups at 0 (cold), 2, 4 (warm)."""
    calls, perm_dtypes = [], set()
    real, real_kernel = engine_module.plan_v_smooth, engine_module.vc_attention

    def spy(v, **kw):
        calls.append((kw["iters"], kw.get("init") is not None))
        return real(v, **kw)

    def kernel_spy(q, k, v, **kw):
        perm_dtypes.add(kw["plan"].perm.dtype)
        return real_kernel(q, k, v, **kw)

    monkeypatch.setattr(engine_module, "plan_v_smooth", spy)
    monkeypatch.setattr(engine_module, "vc_attention", kernel_spy)
    patched = patch(comfy_nodes, models["wan21"], bits="8", grouping_window=0.5, refresh_every=2, **REF).args[0]
    render(comfy_nodes, patched, "wan21", steps=12)
    report = override_of(patched).last_report
    layers = 2
    assert report.grouping_steps == [0, 2, 4]
    assert report.grouping == {0: layers, 2: layers, 4: layers}
    assert [(s, a) for s, _, a in report.events] == [(0, "cold")] * layers + [(2, "warm")] * layers + [(4, "warm")] * layers
    assert calls == [(10, False)] * layers + [(2, True)] * (2 * layers)
    assert report.clustering_s > 0
    # Grouping and reuse steps hand the kernel the same kept form of the plan (int32 permutation):
    # one pre-pass variant per run, so the first reuse step compiles nothing.
    assert perm_dtypes == {torch.int32}


def test_heun_groups_once_per_step(comfy_nodes, models):
    """Heun calls the model twice per step; grouping still happens once per planned step."""
    patched = patch(comfy_nodes, models["wan21"], bits="8", grouping_window=0.5, refresh_every=2, **REF).args[0]
    render(comfy_nodes, patched, "wan21", steps=6, sampler="heun")
    report = override_of(patched).last_report
    assert report.grouping_steps == [0, 2]
    assert report.grouping == {0: 2, 2: 2}


@pytest.mark.parametrize("split,expected_high,expected_low", [
    (6, [0, 2, 4], [0]),  # split after the window: the low-noise expert groups once, on its first call
    (3, [0, 2], [0, 2]),  # split inside it: low expert groups at its first call (step 3) and at step 5
])
def test_two_expert_split(comfy_nodes, models, split, expected_high, expected_low):
    """Wan 2.2 14B style: two KSamplerAdvanced over one 12-step schedule, each expert patched by its
    own node. Steps in the reports are positions within each sampler's slice."""
    high = patch(comfy_nodes, models["wan21"], bits="8", grouping_window=0.5, refresh_every=2, **REF).args[0]
    low_model = load(comfy_nodes, "tiny_wan21_b.safetensors")
    low = patch(comfy_nodes, low_model, bits="8", grouping_window=0.5, refresh_every=2, **REF).args[0]
    _, channels, cond, shape = MODELS["wan21"]
    pos, neg = cond(1), cond(2)
    mid = sample(comfy_nodes, high, pos, neg, latent(channels, **shape), steps=12, start=0, end=split,
                 return_noise=True)
    out = sample(comfy_nodes, low, pos, neg, mid, steps=12, start=split, end=12, add_noise=False)
    rh, rl = override_of(high).last_report, override_of(low).last_report
    assert rh.grouping_steps == expected_high
    assert rl.grouping_steps == expected_low
    assert [a for s, _, a in rl.events if s == 0] == ["cold", "cold"]
    assert torch.isfinite(out["samples"]).all()


def test_cpu_auto_falls_back_to_default_attention_with_message(comfy_nodes, models, base, monkeypatch):
    """backend auto on the CPU: no low-bit kernel -> ComfyUI's own attention, said on the node."""
    # tests/conftest.py turns on Triton's CPU interpreter for the kernel tests; a user's CPU has none.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = patch(comfy_nodes, models["wan21"], bits="8", backend="auto")
    text = out.ui["text"][0]
    assert "no low-bit backend" in text
    patched = out.args[0]
    assert torch.equal(render(comfy_nodes, patched, "wan21"), base["wan21"])
    report = override_of(patched).last_report
    assert report.patched == 0 and report.passed["no low-bit backend"] > 0
    assert len(report.notes) == 1  # the reason, once


def test_4bit_runs_on_the_reference(comfy_nodes, models):
    out = patch(comfy_nodes, models["wan21"], bits="4", **REF)
    assert "4-bit on reference" in out.ui["text"][0]
    patched = out.args[0]
    render(comfy_nodes, patched, "wan21")
    assert override_of(patched).config.bits == 4 and override_of(patched).last_report.patched > 0


def test_4bit_falls_back_to_8bit_with_message(comfy_nodes, models, engine_module, monkeypatch):
    """Where no backend runs 4-bit (e.g. the Triton path on a GPU without FP4 tensor cores): the
    library's answer for bits=4 is replaced by a refusal; the node's one 4 -> 8 rule does the rest."""
    real = engine_module.safe_explain

    def no_4bit(q, k, v, **options):
        if options["bits"] == 4:
            return engine_module.Refusal("no 4-bit here (simulated)")
        return real(q, k, v, **options)

    monkeypatch.setattr(engine_module, "safe_explain", no_4bit)
    out = patch(comfy_nodes, models["wan21"], bits="4", **REF)
    text = out.ui["text"][0]
    assert "4-bit unavailable (no 4-bit here (simulated)); using 8-bit on reference" in text
    assert "8-bit on reference" in text.splitlines()[-1]
    patched = out.args[0]
    render(comfy_nodes, patched, "wan21")
    report = override_of(patched).last_report
    assert override_of(patched).config.bits == 8 and report.patched > 0
    assert report.bits == {8: report.patched}


def test_int8_pv_runs_on_the_reference_and_is_closer_than_fp8(comfy_nodes, models, base):
    """pv_format int8 on the reference backend (the RTX kernel's path, readable): the node says
    so, calls run it, and the final latent is closer to the unpatched one than with FP8 P.V
    (measured after 4 steps of the tiny Wan 2.1: 6.1e-4 against 1.5e-3 relative L2)."""
    out = patch(comfy_nodes, models["wan21"], bits="8", pv_format="int8", **REF)
    assert "8-bit, INT8 P.V on reference" in out.ui["text"][0]
    patched = out.args[0]
    got = render(comfy_nodes, patched, "wan21")
    engine = override_of(patched)
    assert engine.config.pv_format == "int8" and engine.last_report.patched > 0
    fp8 = render(comfy_nodes, patch(comfy_nodes, models["wan21"], bits="8", **REF).args[0], "wan21")
    assert rel_err(got, base["wan21"]) < rel_err(fp8, base["wan21"])


def test_default_pv_format_is_the_rtx_kernels_int8_path(comfy_nodes, models, base):
    """pv_format "auto" (the default) with the RTX kernel (backend mma, run on the CPU by Triton's
    interpreter): the node resolves it to the kernel's INT8 P.V path, says so, and every call runs it;
    pv_format fp8 keeps the E4M3 path, and the INT8 render is the closer one to the unpatched run."""
    from vc_attention.kernels import dispatch

    if not dispatch.interpreting() or not dispatch.mma_status()[0]:
        pytest.skip("needs TRITON_INTERPRET=1 and an importable kernels/triton/attention_mma.py")
    out = patch(comfy_nodes, models["wan21"], bits="8", backend="mma", clusters=8)
    assert "8-bit, INT8 P.V on mma" in out.ui["text"][0]
    got = render(comfy_nodes, out.args[0], "wan21")
    engine = override_of(out.args[0])
    assert engine.config.pv_format == "int8" and engine.last_report.backends == {"mma": engine.last_report.patched}
    fp8 = patch(comfy_nodes, models["wan21"], bits="8", backend="mma", clusters=8, pv_format="fp8")
    assert out.ui["text"][0] != fp8.ui["text"][0] and "8-bit on mma" in fp8.ui["text"][0]
    got8 = render(comfy_nodes, fp8.args[0], "wan21")
    assert override_of(fp8.args[0]).config.pv_format == "fp8"
    assert rel_err(got, base["wan21"]) < rel_err(got8, base["wan21"])


def test_int8_pv_falls_back_to_fp8_with_message(comfy_nodes, models, engine_module, monkeypatch):
    """Where no backend has the INT8 P.V path (every GPU but the RTX ones): FP8 P.V, said once."""
    real = engine_module.safe_explain

    def no_int8(q, k, v, **options):
        if options.get("pv_format") == "int8":
            return engine_module.Refusal("no INT8 P.V here (simulated)")
        return real(q, k, v, **options)

    monkeypatch.setattr(engine_module, "safe_explain", no_int8)
    out = patch(comfy_nodes, models["wan21"], bits="8", pv_format="int8", **REF)
    text = out.ui["text"][0]
    assert "INT8 P.V unavailable (no INT8 P.V here (simulated)); using FP8 P.V on reference" in text
    assert text.splitlines()[-1].startswith("8-bit on reference")
    patched = out.args[0]
    render(comfy_nodes, patched, "wan21")
    engine = override_of(patched)
    assert engine.config.pv_format == "fp8" and engine.last_report.patched > 0


def test_int8_pv_with_expcast_on_is_a_clear_error(comfy_nodes, models):
    with pytest.raises(ValueError, match="ExpCast"):
        patch(comfy_nodes, models["wan21"], bits="8", pv_format="int8", expcast="on", **REF)


def test_error_inside_override_falls_back_and_model_keeps_working(comfy_nodes, models, base, engine_module,
                                                                  monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected kernel failure")

    patched = patch(comfy_nodes, models["wan21"], bits="8", **REF).args[0]
    monkeypatch.setattr(engine_module, "vc_attention", broken)
    out = render(comfy_nodes, patched, "wan21")
    report = override_of(patched).last_report
    assert torch.equal(out, base["wan21"])  # every call fell back to ComfyUI's attention
    assert report.errors == ["RuntimeError: injected kernel failure"] and report.patched == 0
    monkeypatch.undo()
    render(comfy_nodes, patched, "wan21")
    assert override_of(patched).last_report.patched > 0 and not override_of(patched).last_report.errors


def test_block_and_step_options_keep_default_attention(comfy_nodes, models):
    patched = patch(comfy_nodes, models["wan21"], bits="8", bf16_first_blocks=1, bf16_until=0.5, **REF).args[0]
    render(comfy_nodes, patched, "wan21")
    report = override_of(patched).last_report
    # 2 layers x 4 steps x 1 batched cond/uncond call: layer 0 always default; layer 1 default on
    # steps 0-1 (sigma above the 50% point), VC on steps 2-3.
    assert report.passed["block kept on default attention"] == 4
    assert report.passed["step kept on default attention"] == 2
    assert report.patched == 2


def test_unknown_model_type_patches_nothing(comfy_nodes):
    from comfy.model_patcher import ModelPatcher

    class NotAVideoModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.diffusion_model = torch.nn.Linear(4, 4)

    m = ModelPatcher(NotAVideoModel(), torch.device("cpu"), torch.device("cpu"))
    out = patch(comfy_nodes, m, bits="8")
    assert "unknown model type" in out.ui["text"][0]
    assert "optimized_attention_override" not in out.args[0].model_options["transformer_options"]
    assert out.args[0].object_patches == {}


def test_repatching_replaces_instead_of_nesting(comfy_nodes, models):
    first = patch(comfy_nodes, models["wan21"], bits="8", **REF).args[0]
    second = patch(comfy_nodes, first, bits="8", refresh_every=2, **REF).args[0]
    ov = override_of(second)
    assert ov.inner is None and ov is not override_of(first)
    fwd = second.object_patches["diffusion_model.blocks.0.self_attn.forward"]
    assert not hasattr(fwd.original, "original")  # wraps the module's forward, not our wrapper
    assert len(second.wrappers["outer_sample"]["vc_attention"]) == 1


def test_bad_environment_value_is_a_clear_error(comfy_nodes, models, monkeypatch):
    monkeypatch.setenv("VC_ATTENTION_BACKEND", "fastest")
    with pytest.raises(ValueError, match="VC_ATTENTION_BACKEND"):
        patch(comfy_nodes, models["wan21"], bits="8")


def test_node_messages_speak_the_nodes_terms(comfy_nodes, models, engine_module, monkeypatch):
    """The node offers bits 8 / 4 / off and backend "exact"; the library's ``bits=16`` (its name
    for exact) and ``bits=N`` never reach the user: not in the node's check, not in a run's report."""
    assert engine_module.node_terms("used on request (backend='reference') or for bits=16") == (
        "used on request (backend='reference') or for backend 'exact'")
    assert engine_module.node_terms("4-bit only, bits=8 has none: use bits=8") == (
        "4-bit only, bits '8' has none: use bits '8'")
    texts = []
    for backend, env in (("auto", None), ("reference", None), ("triton", None), ("auto", "exact")):
        if env:
            monkeypatch.setenv("VC_ATTENTION_BACKEND", env)
        out = patch(comfy_nodes, models["wan21"], bits="4", backend=backend, clusters=8)
        texts.append(out.ui["text"][0])
        render(comfy_nodes, out.args[0], "wan21", steps=1)
        texts.append(override_of(out.args[0]).last_report.text())
    assert any("refused" in t for t in texts)  # the library's reasons are shown ...
    assert "exact (no quantisation) on reference" in texts[-2]
    assert not [t for t in texts if "bits=" in t or "16-bit" in t], texts  # ... in the node's words


def test_sigma_is_read_once_per_model_call_not_per_layer(comfy_nodes, models, monkeypatch):
    """Reading the step's sigma tensor is a host sync on a GPU: once per model call, shared by its layers."""
    import inspect

    reads = []
    real = torch.Tensor.__float__

    def counting(self):
        caller = inspect.currentframe().f_back
        if caller.f_code.co_filename.endswith("override.py"):
            reads.append(caller.f_code.co_name)
        return real(self)

    patched = patch(comfy_nodes, models["wan21"], bits="8", **REF).args[0]
    counter = CallCounter(patched.model.diffusion_model)
    monkeypatch.setattr(torch.Tensor, "__float__", counting)
    try:
        render(comfy_nodes, patched, "wan21", steps=4)
    finally:
        counter.remove()
    layers = 2
    model_calls = counter.counts["self"] // layers
    assert override_of(patched).last_report.patched == counter.counts["self"] > model_calls >= 4
    assert reads == ["_sigma"] * model_calls
