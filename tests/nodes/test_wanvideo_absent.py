"""VC-Attention (WanVideoWrapper) without the WanVideoWrapper pack: our pack loads, the node is
registered with the pack's WANVIDEOMODEL type, and asked to patch something else it says what is
missing. Needs real ComfyUI only (tests/nodes/conftest.py), not the WanVideoWrapper checkout."""

import pytest
import torch

from comfy_harness import run_v3


@pytest.fixture(scope="module")
def node(comfy_nodes):
    return comfy_nodes.NODE_CLASS_MAPPINGS["VCAttentionWanVideoPatch"]


def test_registered_with_the_packs_model_type(comfy_nodes, node):
    schema = node.GET_SCHEMA()
    assert comfy_nodes.NODE_DISPLAY_NAME_MAPPINGS["VCAttentionWanVideoPatch"] == "VC-Attention (WanVideoWrapper)"
    assert schema.inputs[0].get_io_type() == "WANVIDEOMODEL"
    assert schema.outputs[0].get_io_type() == "WANVIDEOMODEL"


def _core_model():
    import comfy.model_patcher

    class Base(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.diffusion_model = torch.nn.Linear(2, 2)

    return comfy.model_patcher.ModelPatcher(Base(), torch.device("cpu"), torch.device("cpu"))


def test_says_the_pack_is_missing(node, monkeypatch):
    from vc_attention.nodes import wanvideo

    monkeypatch.setattr(wanvideo, "pack_loaded", lambda: None)
    with pytest.raises(wanvideo.WanVideoPatchError, match="kijai/ComfyUI-WanVideoWrapper.*not installed"):
        run_v3(node, model=_core_model())


def test_says_the_input_is_not_a_wanvideowrapper_model(node, monkeypatch):
    from vc_attention.nodes import wanvideo

    monkeypatch.setattr(wanvideo, "pack_loaded", lambda: "x.wanvideo.modules.model")
    with pytest.raises(wanvideo.WanVideoPatchError, match="not a WanVideoWrapper model"):
        run_v3(node, model=_core_model())
    assert wanvideo.installed_runs() == 0
