"""benchmarks/comfyui_e2e.py on tiny models in real ComfyUI on the CPU, so that the H200 script cannot rot.

The script runs as a child process (as on the device: its own ComfyUI start-up, the pack loaded by
ComfyUI's custom-node loader) with ``--tiny --device cpu`` (dim 256, 2 heads, 2 layers, 4 steps, the
readable reference backend). Checked: the CSV and JSON fields; that the patched run ran VC-Attention
(the run report's backend and call count); that grouping and reuse steps are both present and timed;
that the --trace summary finds the kernel op and the plans; and that it stays well under a minute of
CPU. In process: the real configurations are what ComfyUI's own detection makes of them.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import resource
import subprocess
import sys

import pytest

from comfy_harness import COMFYUI_PATH, REPO

SCRIPT = REPO / "benchmarks" / "comfyui_e2e.py"


def _script():
    spec = importlib.util.spec_from_file_location("comfyui_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)  # stdlib only at import time: no ComfyUI here
    return module


e2e = _script()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--models", "wan22-14b,hunyuan15",
         "--trace", "wan22-14b", "--comfyui", str(COMFYUI_PATH), "--out-dir", str(out), "--stem", "e2e"],
        capture_output=True, text=True, timeout=600, cwd=str(REPO),
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(out / "e2e.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    data = json.loads((out / "e2e.json").read_text())
    return dict(stdout=proc.stdout, rows=rows, data=data, cpu_s=cpu_s)


def test_files_carry_the_fields(tiny_run):
    rows, data = tiny_run["rows"], tiny_run["data"]
    assert list(rows[0]) == e2e.COLUMNS
    for key in ("card", "date", "command", "commit", "torch", "comfyui", "rows", "configs", "traces"):
        assert data[key] not in (None, ""), key
    assert data["comfyui"] == "0.29.0"
    assert "--tiny" in data["command"]
    assert "not a quality measure" in data["note"]
    assert {(r["model"], r["variant"]) for r in rows} == {
        (m, v) for m in ("wan22-14b", "hunyuan15") for v in ("default", "vc8")}
    assert all(r["card"] == data["card"] and r["commit"] == data["commit"] for r in rows)
    # the table is printed last
    assert tiny_run["stdout"].rstrip().splitlines()[-1].startswith("hunyuan15")


@pytest.mark.parametrize("model,layers", [("wan22-14b", 2), ("hunyuan15", 3)])
def test_patched_run_ran_vc_attention_with_grouping_and_reuse_steps(tiny_run, model, layers):
    data = tiny_run["data"]
    config = next(c for c in data["configs"] if c["model"] == model)
    extra = config["extra"]["vc8"]
    assert extra["errors"] == []
    row = next(r for r in data["rows"] if r["model"] == model and r["variant"] == "vc8")
    assert row["backend"] == f"reference:{extra['patched_calls']}"
    steps = config["steps_detail"]["vc8"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    # Every self-attention layer ran VC-Attention at every step (CFG batched or not).
    assert extra["patched_calls"] in (layers * len(steps), 2 * layers * len(steps))
    # 4 steps, window 0.75, refresh 2: cold grouping at step 0, warm at 2, plans reused at 1 and 3.
    assert [s["kind"] for s in steps] == ["cold", "reuse", "warm", "reuse"]
    assert extra["grouping_steps"] == [0, 2] and row["grouping_steps"] == "0c,2w"
    for s in steps:
        assert s["s"] > 0 and 0 < s["self_attn_s"] <= s["attn_s"] <= s["s"]
    assert row["s_per_grouping_step"] > 0 and row["s_per_reuse_step"] > 0
    # derived from the measured cold / warm / reuse steps (CPU timings are noisy: only its presence here)
    assert isinstance(row["grouping_extra_share_20_derived"], float)
    assert isinstance(row["grouping_extra_share_40_derived"], float)
    assert 0 < row["attn_share_reuse"] < 1
    # The unpatched run: ComfyUI's attention, four timed steps, no grouping.
    default = config["steps_detail"]["default"]
    assert [s["kind"] for s in default] == ["plain"] * 4 and all(s["s"] > 0 for s in default)
    # 8-bit attention perturbs the final latent a little, and the run stays finite.
    assert 1e-5 < row["rel_l2_vs_default"] < 0.1
    assert row["finite"] is True


def test_trace_finds_the_kernel_and_the_plans(tiny_run):
    traces = tiny_run["data"]["traces"]
    assert [t["model"] for t in traces] == ["wan22-14b"]
    for trace in traces:
        steps = trace["steps"]
        assert set(steps) == {"0", "1", "2", "3"}
        assert all(s["calls"] > 0 and s["kernel_ms"] > 0 for s in steps.values())
        assert steps["0"]["plan_ms"] > 0 and steps["2"]["plan_ms"] > 0
        assert steps["1"]["plan_ms"] == 0 and steps["3"]["plan_ms"] == 0
        # Wan's [B, N, H*D] layout reaches the kernel as views: no copies around it, and on reuse
        # steps no casts either; a grouping step casts once per layer, keeping its new plan's
        # permutation as int32 (nodes/schedule.py PlanEntry).
        assert all(s["counts"].get("copy", 0) == 0 for s in steps.values())
        assert steps["1"]["counts"].get("cast", 0) == 0 and steps["3"]["counts"].get("cast", 0) == 0
        assert steps["0"]["counts"].get("cast", 0) == steps["0"]["calls"]
        assert steps["2"]["counts"].get("cast", 0) == steps["2"]["calls"]
    assert "--trace wan22-14b tiny" in tiny_run["stdout"]


def test_well_under_a_minute_of_cpu(tiny_run):
    # CPU time, not wall time: the CI machine's cores are shared.
    print(f"comfyui_e2e.py --tiny: {tiny_run['cpu_s']:.1f} s of CPU")
    assert tiny_run["cpu_s"] < 45, tiny_run["cpu_s"]


def test_real_sizes_are_the_issue_shapes():
    m = e2e.MODELS
    assert e2e.tokens(m["wan22-14b"], m["wan22-14b"].sizes["720p"]) == 75_600
    assert e2e.tokens(m["wan22-14b"], m["wan22-14b"].sizes["480p"]) == 32_760
    assert e2e.tokens(m["wan22-5b"], m["wan22-5b"].sizes["720p"]) == 27_280
    assert e2e.tokens(m["hunyuan15"], m["hunyuan15"].sizes["720p"]) == 111_700


@pytest.mark.parametrize("name,billions", [("wan22-14b", 14.3), ("wan22-5b", 5.0), ("hunyuan15", 8.3)])
def test_real_configurations_are_detected_by_comfyui(comfy_nodes, name, billions):
    """The released configuration's keys and shapes (the ComfyUI class on the meta device) are
    detected by ComfyUI as the supported model the real checkpoint loads as."""
    import comfy.model_detection

    spec = e2e.MODELS[name]
    sd = e2e.skeleton_state_dict(spec)
    config = comfy.model_detection.model_config_from_unet(sd, "")
    assert type(config).__name__ == spec.detected_as
    expected = {k: v for k, v in spec.kwargs.items() if k in config.unet_config and k not in ("patch_size", "axes_dim")}
    assert {k: config.unet_config[k] for k in expected} == expected
    params = sum(t.numel() for t in sd.values()) / 1e9
    assert abs(params - billions) / billions < 0.05, params
