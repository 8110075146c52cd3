"""The environment node in real ComfyUI on the CPU: registered, reports the CPU-only machine."""

import pytest

from comfy_harness import run_v3


@pytest.fixture(scope="module")
def environment(comfy_nodes):
    return comfy_nodes.NODE_CLASS_MAPPINGS["VCAttentionEnvironment"]


def test_environment_node_reports_this_machine(environment, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = run_v3(environment, self_test=True)
    (text,) = out.args
    assert out.ui.as_dict()["text"][0] == text
    assert text.startswith("VC-Attention environment")
    assert "CPU only" in text and "precompiled  refused: tensors are on cpu" in text
    assert "-> auto runs: sdpa" in text and "Self-test" in text and "passed" in text
