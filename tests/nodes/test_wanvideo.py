"""VC-Attention (WanVideoWrapper) against a real checkout of kijai/ComfyUI-WanVideoWrapper, on the CPU.

The checkout is found as tests/comfy_harness.py says (WANVIDEOWRAPPER_PATH first); without it (or
without the few packages its model module imports: accelerate, gguf, ftfy, einops) this module is
skipped and the reason printed. Only the pack's model code is imported (its package root, which loads
every node and diffusers, is bypassed by registering bare packages for it).

The model is a LongCat-shaped ``WanModel(is_longcat=True)`` from the pack's own classes, randomly
initialised: the pack's LongCat code paths key on hidden size 4096 (32 heads of 128, as LongCat-Video),
so the width is real; 2 blocks, a small SwiGLU FFN and 16 text tokens keep it about 300M parameters.
The sampler's part is what WanVideoSampler does: deep-copy the patched clone's
``model_options["transformer_options"]`` at the start of a run and pass that copy to every model call
with ``current_step`` / ``current_step_percentage`` / ``is_uncond``.
"""

from __future__ import annotations

import copy
import gc
import importlib
import importlib.util
import math
import os
import pathlib
import sys
import types

import pytest
import torch

from comfy_harness import find_wanvideowrapper, run_v3, unavailable

WVW = find_wanvideowrapper()
PKG = "wanvideowrapper_under_test"


def _missing() -> str | None:
    if WVW is None or not (WVW / "wanvideo" / "modules" / "model.py").exists():
        return (f"WanVideoWrapper not found (WANVIDEOWRAPPER_PATH={WVW}; or a checkout of "
                "kijai/ComfyUI-WanVideoWrapper there)")
    if not (WVW / "LongCat" / "layers.py").exists():
        return f"the WanVideoWrapper checkout at {WVW} predates LongCat support (no LongCat/layers.py)"
    absent = [m for m in ("accelerate", "gguf", "ftfy", "einops") if importlib.util.find_spec(m) is None]
    if absent:
        return f"WanVideoWrapper's model module needs {', '.join(absent)}: pip install {' '.join(absent)}"
    return None


_MISSING = _missing()
if _MISSING:
    unavailable(f"tests/nodes/test_wanvideo.py: {_MISSING}", module_level=True)

F, H, W = 3, 4, 4  # latent frames, height, width -> 3 x 2 x 2 = 12 tokens (4 per frame)
DIM, HEADS, BLOCKS, TEXT_DIM, TEXT_LEN = 4096, 32, 2, 64, 16
EXACT = dict(bits="8", backend="exact")  # the node's validation mode: reference, no quantisation
SUBSET = "keys are a subset of the sequence (condition/reference tokens) or padded"


@pytest.fixture(scope="module")
def pack(comfy_nodes):
    """The pack's modules, imported from the checkout without running its package __init__."""
    def bare(name, path):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        module.__package__ = name
        sys.modules[name] = module

    bare(PKG, WVW)
    bare(f"{PKG}.wanvideo", WVW / "wanvideo")
    bare(f"{PKG}.wanvideo.modules", WVW / "wanvideo" / "modules")
    model = importlib.import_module(f"{PKG}.wanvideo.modules.model")
    loading = importlib.import_module(f"{PKG}.nodes_model_loading")
    return types.SimpleNamespace(model=model, loading=loading)


@pytest.fixture(scope="module")
def wv():
    from vc_attention.nodes import wanvideo

    return wanvideo


@pytest.fixture(scope="module")
def longcat(pack):
    """(WANVIDEOMODEL patcher, its WanModel): built like the pack's loader does, random weights."""
    from accelerate import init_empty_weights

    import comfy.model_patcher

    cpu = torch.device("cpu")
    with init_empty_weights():
        dm = pack.model.WanModel(model_type="t2v", dim=DIM, in_features=DIM, out_features=DIM, ffn_dim=256,
                                 ffn2_dim=256, text_dim=TEXT_DIM, num_heads=HEADS, num_layers=BLOCKS, in_dim=16,
                                 out_dim=16, is_longcat=True, attention_mode="sdpa", main_device=cpu,
                                 offload_device=cpu, dtype=torch.float32).eval()
        layers = importlib.import_module(f"{PKG}.LongCat.layers")
        for block in dm.blocks:
            # The loader's state dict gives cross_attn.k/v their [dim, dim] shape (the class passes
            # qk_norm positionally into kv_dim); the FFN is shrunk: it plays no part in attention.
            block.cross_attn.k = torch.nn.Linear(DIM, DIM)
            block.cross_attn.v = torch.nn.Linear(DIM, DIM)
            block.ffn = layers.FeedForwardSwiGLU(dim=DIM, hidden_dim=384)
    dm = dm.to_empty(device=cpu)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in dm.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * math.prod(p.shape[1:]) ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    dm.text_len = TEXT_LEN
    dm.rope_embedder.k = 0  # what WanVideoSampler sets for the "comfy" RoPE
    dm.rope_embedder.num_frames = F
    base = pack.loading.WanVideoModel(pack.loading.WanVideoModelConfig(), dm, cpu)
    patcher = comfy.model_patcher.ModelPatcher(base, cpu, cpu)
    return patcher, dm


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, F, H, W, generator=g), torch.randn(8, TEXT_DIM, generator=g)


@pytest.fixture(scope="module")
def unpatched():
    """Unpatched outputs by number of condition latents (filled by the first test that computes one)."""
    return {}


class Recorder:
    """Stands in for the pack's dispatcher: counts the calls that reach it, then runs it."""

    def __init__(self, original):
        self.original = original
        self.calls = []

    def __call__(self, q, k, v, *args, **kwargs):
        self.calls.append((q.shape[1], k.shape[1], "transformer_options" in kwargs))
        return self.original(q, k, v, *args, **kwargs)


@pytest.fixture
def recorder(pack, monkeypatch):
    rec = Recorder(pack.model.attention)
    monkeypatch.setattr(pack.model, "attention", rec)
    return rec


def forward(dm, inputs, options, step=0, steps=10, cond_latents=0, uncond=False):
    x, ctx = inputs
    with torch.no_grad():
        out = dm([x], torch.tensor([900.0]), [ctx], F * H * W // 4, device=torch.device("cpu"),
                 current_step=step, current_step_percentage=step / steps, last_step=step == steps - 1,
                 is_uncond=uncond, longcat_num_cond_latents=cond_latents, transformer_options=options)
    return out[0][0]


def patch_node(comfy_nodes, patcher, **inputs):
    node = comfy_nodes.NODE_CLASS_MAPPINGS["VCAttentionWanVideoPatch"]
    return run_v3(node, model=patcher, **inputs)


def clean(dm, wv, original_attention):
    """Nothing of ours left on the model or in the pack's module."""
    assert wv.installed_runs() == 0
    assert all("forward" not in b.self_attn.__dict__ for b in dm.blocks)
    assert len(dm._forward_pre_hooks) == 0
    assert dm.blocks[0].self_attn.forward.__func__ is type(dm.blocks[0].self_attn).forward
    assert sys.modules[f"{PKG}.wanvideo.modules.model"].attention is original_attention


@pytest.mark.parametrize("cond_latents", [0, 1], ids=["t2v", "condition-frame"])
def test_patch_fires_on_whole_sequence_self_attention_exact_and_removed(
        comfy_nodes, pack, wv, longcat, inputs, recorder, unpatched, cond_latents):
    patcher, dm = longcat
    ref = unpatched[cond_latents] = forward(dm, inputs, {}, cond_latents=cond_latents)
    # unpatched: per block the pack's dispatcher sees self-attention (1, or 2 with a condition
    # frame: noise queries over all keys, condition queries over condition keys) and cross-attention
    per_block = 1 + (cond_latents > 0) + 1
    assert len(recorder.calls) == BLOCKS * per_block
    recorder.calls.clear()

    out = patch_node(comfy_nodes, patcher, **EXACT)
    patched = out.args[0]
    assert "LongCat-Video (2 self-attention layers" in out.ui["text"][0]
    assert wv.SPEC_KEY not in patcher.model_options.get("transformer_options", {})  # input untouched
    assert wv.installed_runs() == 0  # nothing installed until a sampler runs the clone

    options = copy.deepcopy(patched.model_options["transformer_options"])  # WanVideoSampler's start
    run = options[wv.SPEC_KEY]
    assert isinstance(run, wv.WanVideoRun) and wv.installed_runs() == 1
    got = forward(dm, inputs, options, cond_latents=cond_latents)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())

    report = run.report
    assert report.patched == BLOCKS  # one whole-sequence self-attention call per block
    assert dict(report.backends) == {"reference": BLOCKS}
    if cond_latents:
        assert dict(report.passed) == {SUBSET: BLOCKS}  # condition queries over condition keys
        n_cond = cond_latents * H * W // 4
        # LongCat's cross-attention takes the noise tokens only
        noise = F * H * W // 4 - n_cond
        assert sorted(recorder.calls) == sorted([(n_cond, n_cond, True)] * BLOCKS + [(noise, TEXT_LEN, False)] * BLOCKS)
    else:
        assert report.passed_total == 0
        assert all(not has_options for _, _, has_options in recorder.calls)  # cross-attention only
        assert len(recorder.calls) == BLOCKS
    assert sorted(report.grouping_steps) == [0]

    spec = patched.model_options["transformer_options"][wv.SPEC_KEY]
    del options, run
    gc.collect()  # the end of the sampler node: its copy of the options goes
    clean(dm, wv, recorder)
    assert spec.last_report is report
    recorder.calls.clear()
    again = forward(dm, inputs, {}, cond_latents=cond_latents)
    assert torch.equal(again, ref)
    assert len(recorder.calls) == BLOCKS * per_block


def test_step_schedule_from_the_packs_step_info(comfy_nodes, pack, wv, longcat, inputs, recorder):
    patcher, dm = longcat
    patched = patch_node(comfy_nodes, patcher, grouping_window=0.5, refresh_every=2, **EXACT).args[0]
    options = copy.deepcopy(patched.model_options["transformer_options"])
    run = options[wv.SPEC_KEY]
    # 8 steps, window 0.5 (steps 0-3), refresh 2: a block groups at step 0 and re-groups at 2
    forward(dm, inputs, options, step=0, steps=8)
    forward(dm, inputs, options, step=2, steps=8)
    forward(dm, inputs, options, step=2, steps=8, uncond=True)  # the uncond pass has its own plans
    assert run.report.grouping == {0: BLOCKS, 2: 2 * BLOCKS}
    assert [e[2] for e in run.report.events] == ["cold"] * BLOCKS + ["warm"] * BLOCKS + ["cold"] * BLOCKS
    assert run.steps_seen == {0, 2}
    del options, run
    gc.collect()
    clean(dm, wv, recorder)


def test_window_and_refresh_match_the_core_node(comfy_nodes, pack, wv, longcat):
    """40 steps, window 0.25, refresh 4 -> groupings at steps 0, 4, 8 (the core node's example),
    through the real per-call dispatch (small tensors, the pack's dispatcher as the fallback)."""
    _, dm = longcat
    config = wv.resolve_config("8", 0.25, 4, 8, "auto", 0, 0, 0.0, "exact")
    spec = wv.WanVideoPatchSpec(config, dm)
    options = copy.deepcopy({wv.SPEC_KEY: spec})
    run = options[wv.SPEC_KEY]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 128, 1, 128, generator=g) for _ in range(3))
    original = pack.model.attention
    call = dict(k_lens=torch.tensor([128]), attention_mode="sdpa", heads=1, transformer_options=options)
    for step in range(40):
        run.begin_call({"current_step": torch.tensor(step), "current_step_percentage": step / 40})
        out = run.attention(0, original, q, k, v, (), call)
        if step == 0:
            torch.testing.assert_close(out, original(q, k, v, **call), rtol=1e-5, atol=1e-5)
    assert run.report.grouping_steps == [0, 4, 8]
    # a key subset (LongCat condition tokens) and the user's special modes pass through
    run.attention(0, original, q[:, :32], k[:, :32], v[:, :32], (), call)
    passed = []  # (sageattn_ultravico needs its CUDA kernel: a stand-in receives the pass-through)
    run.attention(0, lambda *a, **kw: passed.append(kw["attention_mode"]), q, k, v, (),
                  dict(call, attention_mode="sageattn_ultravico"))
    assert passed == ["sageattn_ultravico"]
    assert dict(run.report.passed) == {SUBSET: 1, "attention mode sageattn_ultravico": 1}
    del options, run, call
    gc.collect()
    assert wv.installed_runs() == 0


def test_a_new_run_replaces_a_run_left_installed(comfy_nodes, pack, wv, longcat, inputs, recorder):
    """An exception can keep a run's options alive (traceback): the next run removes it first, and
    an unpatched call meanwhile goes to the pack's dispatcher."""
    patcher, dm = longcat
    patched = patch_node(comfy_nodes, patcher, **EXACT).args[0]
    stale = copy.deepcopy(patched.model_options["transformer_options"])
    forward(dm, inputs, {})  # an unpatched model call: nothing routed
    assert stale[wv.SPEC_KEY].report.patched == 0
    fresh = copy.deepcopy(patched.model_options["transformer_options"])
    assert wv.installed_runs() == 1 and stale[wv.SPEC_KEY].installed.released
    forward(dm, inputs, fresh)
    assert fresh[wv.SPEC_KEY].report.patched == BLOCKS
    del stale, fresh
    gc.collect()
    clean(dm, wv, recorder)


def test_bypass_and_bits_off(comfy_nodes, pack, wv, longcat, inputs, recorder, unpatched):
    patcher, dm = longcat
    # the unpatched model (what a bypassed node passes on) installs nothing when a run copies its options
    copy.deepcopy(patcher.model_options.get("transformer_options", {}))
    assert wv.installed_runs() == 0
    ref = unpatched[0] if 0 in unpatched else forward(dm, inputs, {})
    patched = patch_node(comfy_nodes, patcher, bits="off").args[0]
    options = copy.deepcopy(patched.model_options["transformer_options"])
    assert torch.equal(forward(dm, inputs, options), ref)
    assert dict(options[wv.SPEC_KEY].report.passed) == {"bits off": BLOCKS}
    del options
    gc.collect()
    clean(dm, wv, recorder)


def test_shared_workflow_is_derived_from_the_packs_longcat_example():
    """workflows/vc_longcat_video_t2v.json is what build_longcat_workflow.py makes from this checkout's
    example, and every WanVideoWrapper node and input it uses exists in this checkout."""
    import json
    import re

    from comfy_harness import REPO

    spec = importlib.util.spec_from_file_location("build_longcat_workflow",
                                                  REPO / "workflows" / "build_longcat_workflow.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    committed = (REPO / "workflows" / "vc_longcat_video_t2v.json").read_text(encoding="utf-8")
    workflow = json.loads(committed)
    example = WVW / build.SOURCE
    fresh = build.build_from(example)
    if fresh["extra"]["vc_attention"]["source_sha256"] != workflow["extra"]["vc_attention"]["source_sha256"]:
        pytest.skip(f"this checkout's {build.SOURCE} differs from the one the workflow was built from")
    assert build.render(fresh) == committed
    source = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in WVW.glob("nodes*.py"))
    for node in workflow["nodes"]:
        if node["type"].startswith("WanVideo"):
            assert re.search(rf'"{node["type"]}"\s*:', source), f"{node['type']} is not a node of this checkout"
