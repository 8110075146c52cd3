"""The patch node's run reports in /history/<prompt_id>, read back through a running server's HTTP API.

The server, the tiny models and the prompt come from tests/web/test_viewer.py (imported, not
copied). A sampling run's report is appended to the patch node's UI record as the run ends
(nodes/history.py), so it reaches the history of the prompt that ran it, also when the patch node
itself was taken from ComfyUI's cache and only the sampler ran again.
"""

import importlib.util
import json

from comfy_harness import REPO

_spec = importlib.util.spec_from_file_location("vc_web_test_viewer", REPO / "tests" / "web" / "test_viewer.py")
viewer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(viewer)  # skips this module (with the reason) where the server cannot run
server = viewer.server  # the module-scoped fixture: ComfyUI serving the pack on the CPU

PATCH_ID, SAMPLER_ID = viewer.PATCH_ID, "7"
# Loader -> VC-Attention Patch -> KSampler -> VAE decode -> preview (the prompt's patched half).
KEEP = ("1", "2", "3", "4", PATCH_ID, SAMPLER_ID, "8", "10")


def prompt(seed: int, window: float = 0.25) -> dict:
    p = {k: json.loads(json.dumps(v)) for k, v in viewer.PROMPT.items() if k in KEEP}
    p["12"] = {"class_type": "PreviewImage", "inputs": {"images": ["10", 0]}}
    p[SAMPLER_ID]["inputs"]["seed"] = seed
    p[PATCH_ID]["inputs"]["grouping_window"] = window
    return p


def runs_of(entry: dict) -> list:
    (record,) = entry["outputs"][PATCH_ID]["vc_attention"]
    assert record["status"].startswith("VC-Attention: Wan")  # the node's own check, as shown on it
    return record["runs"]


def history(url: str, prompt_id: str) -> dict:
    return json.loads(viewer._get(f"{url}/history/{prompt_id}"))[prompt_id]


def test_each_prompt_history_holds_the_report_of_its_own_run(server):
    # 1: patch node and sampler run. 2: only the seed changes: the patch node comes from the cache,
    # the sampler runs again with the same patched model. 3: the same prompt again: all cached.
    first, e1 = viewer._run_prompt(server, prompt(seed=101, window=0.35))
    second, e2 = viewer._run_prompt(server, prompt(seed=102, window=0.35))
    third, e3 = viewer._run_prompt(server, prompt(seed=102, window=0.35))
    for entry in (e1, e2, e3):
        assert entry["status"]["status_str"] == "success", entry["status"]

    (run1,) = [r for r in runs_of(history(server, first)) if r["prompt_id"] == first]
    (run2,) = [r for r in runs_of(history(server, second)) if r["prompt_id"] == second]
    for run in (run1, run2):
        assert run["sampler_node"] == SAMPLER_ID and run["errors"] == [] and run["notes"] == []
        assert run["patched"] > 0 and run["backends"] == {"reference": run["patched"]}
        assert run["bits"] == {"8": run["patched"]}
        assert run["grouping_steps"] == [0] and run["layer_plans"] == 2  # 4 steps, window 0.35: step 0
        assert run["passed"] == {"not self-attention": run["passed_through"]} and not run["compiled"]
        assert run["text"].startswith(f"VC-Attention: {run['patched']} calls patched")
    # The cached third prompt ran nothing: its outputs came from the second prompt's run, the latest listed.
    runs3 = runs_of(history(server, third))
    assert not [r for r in runs3 if r["prompt_id"] == third]
    assert runs3[-1]["prompt_id"] == second
    # The first prompt's history still says what ran in it.
    assert [r["prompt_id"] for r in runs_of(history(server, first))][0] == first


def test_bits_off_reports_every_call_passed_through(server):
    p = prompt(seed=103)
    p[PATCH_ID]["inputs"]["bits"] = "off"
    prompt_id, entry = viewer._run_prompt(server, p)
    assert entry["status"]["status_str"] == "success", entry["status"]
    (run,) = [r for r in runs_of(entry) if r["prompt_id"] == prompt_id]
    assert run["patched"] == 0 and run["backends"] == {} and run["passed"]["bits off"] > 0
    assert "bits off" in entry["outputs"][PATCH_ID]["text"][0]
