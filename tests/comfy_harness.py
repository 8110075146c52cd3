"""Real ComfyUI in process on the CPU, and tiny random models built from ComfyUI's own classes.

Shared by tests/nodes and tests/web (imported by name: tests/ is on sys.path, see tests/conftest.py).

Which ComfyUI (first match):
1. ``COMFYUI_PATH``, when set;
2. the ComfyUI this pack is installed in: the checkout sits at ``ComfyUI/custom_nodes/<pack>/``, so
   two folders up holds ComfyUI's ``main.py`` (how a user runs the tests inside their own install).
WanVideoWrapper likewise: ``WANVIDEOWRAPPER_PATH``, else a sibling pack folder in ``custom_nodes/``.

Without them these tests are skipped with the reason printed, except where ``VC_REQUIRE_COMFYUI=1``
(CI sets it): there a missing ComfyUI, WanVideoWrapper, Chromium or Playwright fails the run instead.
"""

from __future__ import annotations

import asyncio
import math
import os
import pathlib
import sys

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]


def _pack_dirs() -> list[pathlib.Path]:
    """This checkout's folder, resolved and as the shell names it: a pack is often a symlink inside
    custom_nodes/, and the shell's $PWD keeps that name where the process's cwd does not."""
    dirs = [REPO, pathlib.Path(os.path.abspath(__file__)).parents[1]]
    pwd = os.environ.get("PWD")
    if pwd:
        here = pathlib.Path(pwd)
        for d in (here, *here.parents):
            if d.resolve() == REPO:
                dirs.append(d)
                break
    return list(dict.fromkeys(dirs))


REQUIRED = os.environ.get("VC_REQUIRE_COMFYUI") == "1"


def _is_comfyui(path: pathlib.Path) -> bool:
    return (path / "main.py").is_file() and (path / "comfy" / "model_patcher.py").is_file()


def find_comfyui() -> pathlib.Path | None:
    """COMFYUI_PATH, else the ComfyUI whose custom_nodes/ holds this pack, else None."""
    if os.environ.get("COMFYUI_PATH"):
        return pathlib.Path(os.environ["COMFYUI_PATH"])
    for pack in _pack_dirs():
        if pack.parent.name == "custom_nodes" and _is_comfyui(pack.parent.parent):
            return pack.parent.parent
    return None


def find_wanvideowrapper() -> pathlib.Path | None:
    """WANVIDEOWRAPPER_PATH, else a WanVideoWrapper pack beside this one in custom_nodes/, else None."""
    if os.environ.get("WANVIDEOWRAPPER_PATH"):
        return pathlib.Path(os.environ["WANVIDEOWRAPPER_PATH"])
    for pack in _pack_dirs():
        if pack.parent.name == "custom_nodes":
            for sibling in sorted(pack.parent.iterdir()):
                if "wanvideowrapper" in sibling.name.lower() and (sibling / "wanvideo").is_dir():
                    return sibling
    return None


COMFYUI_PATH = find_comfyui()


def unavailable(reason: str, *, module_level: bool = False):
    """Skip (a user's machine without ComfyUI) or, under VC_REQUIRE_COMFYUI=1, fail: a CI run must
    never pass with the node pack's own tests skipped."""
    if REQUIRED:
        pytest.fail(f"VC_REQUIRE_COMFYUI=1 but: {reason}", pytrace=False)
    print(f"\n*** SKIPPING: {reason} ***\n", file=sys.stderr)
    pytest.skip(reason, allow_module_level=module_level)


def comfyui_missing() -> str | None:
    """Why real ComfyUI cannot run here (None: it can)."""
    if COMFYUI_PATH is None:
        return ("no ComfyUI found (run the tests from ComfyUI/custom_nodes/<pack>/, or set COMFYUI_PATH "
                "to a ComfyUI v0.29 folder); the node tests need real ComfyUI")
    if not (COMFYUI_PATH / "comfy" / "model_patcher.py").exists():
        return f"no ComfyUI at COMFYUI_PATH={COMFYUI_PATH}; the node tests need real ComfyUI v0.29"
    try:
        import kornia  # noqa: F401
        import torchvision  # noqa: F401  (ComfyUI imports it at start-up)
    except ImportError as e:
        return (f"ComfyUI's requirements are not installed in this Python ({e}); "
                "pip install -r $COMFYUI_PATH/requirements.txt")
    return None


_STARTED = False


def start_comfyui():
    """Import ComfyUI on the CPU and register its built-in nodes and ours (once per process)."""
    global _STARTED
    if _STARTED:
        return
    sys.path.insert(0, str(COMFYUI_PATH))
    saved_argv = sys.argv
    sys.argv = ["main.py", "--cpu", "--disable-all-custom-nodes"]
    try:
        import comfy.options

        comfy.options.enable_args_parsing()
        import nodes
    finally:
        sys.argv = saved_argv
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))

    # Register our extension exactly as nodes.load_custom_node does for a V3 pack.
    import vc_attention

    extension = asyncio.run(vc_attention.comfy_entrypoint())
    for node_cls in asyncio.run(extension.get_node_list()):
        schema = node_cls.GET_SCHEMA()
        nodes.NODE_CLASS_MAPPINGS[schema.node_id] = node_cls
        nodes.NODE_DISPLAY_NAME_MAPPINGS[schema.node_id] = schema.display_name
    _STARTED = True


# -- tiny random models from ComfyUI's own classes ----------------------------------------------

def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """ComfyUI's ops skip weight init; fill every parameter deterministically."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            fan_in = math.prod(p.shape[1:])
            p.data = torch.randn(p.shape, generator=g) * fan_in ** -0.5
        elif "norm" in name and name.endswith("weight"):
            p.data = torch.ones(p.shape)
        else:
            p.data = torch.randn(p.shape, generator=g) * 0.02


def _save(model, path: pathlib.Path) -> str:
    import safetensors.torch

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(state, str(path))
    return str(path)


def build_wan(path: pathlib.Path, *, channels: int = 16, layers: int = 2, seed: int = 0) -> str:
    """Tiny Wan: channels 16 -> detected as Wan 2.1, 48 -> Wan 2.2 TI2V-5B."""
    import comfy.ops
    from comfy.ldm.wan.model import WanModel

    model = WanModel(model_type="t2v", in_dim=channels, dim=256, ffn_dim=512, text_dim=4096,
                     out_dim=channels, num_heads=2, num_layers=layers, operations=comfy.ops.disable_weight_init)
    _init_weights(model, seed)
    return _save(model, path)


def build_hunyuan15(path: pathlib.Path, *, seed: int = 0) -> str:
    """Tiny HunyuanVideo 1.5 (byT5, vision input and cond-type embedding: detected as 1.5)."""
    import comfy.ops
    from comfy.ldm.hunyuan_video.model import HunyuanVideo

    model = HunyuanVideo(
        image_model="hunyuan_video", in_channels=65, out_channels=32, vec_in_dim=None, context_in_dim=3584,
        hidden_size=256, mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=1, axes_dim=[16, 56, 56],
        theta=256, patch_size=[1, 1, 1], qkv_bias=True, guidance_embed=False, byt5=True, meanflow=False,
        use_cond_type_embedding=True, vision_in_dim=1152, meanflow_sum=True,
        operations=comfy.ops.disable_weight_init)
    _init_weights(model, seed)
    return _save(model, path)


def load(comfy, name: str):
    """UNETLoader, as a workflow would; fp32 weights so CPU results are deterministic and exact."""
    return comfy.UNETLoader().load_unet(name, "default")[0]


def wan_conditioning(seed: int, tokens: int = 512):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, tokens, 4096, generator=g) * 0.1, {}]]


def hunyuan_conditioning(seed: int, *, padded: int = 0):
    """3584-dim text context; ``padded`` trailing tokens masked out (a text-padding mask)."""
    g = torch.Generator().manual_seed(seed)
    extra = {"pooled_output": torch.zeros(1, 768)}
    if padded:
        mask = torch.ones(1, 24, dtype=torch.long)  # integer, as text encoders give it
        mask[:, -padded:] = 0
        extra["attention_mask"] = mask
    return [[torch.randn(1, 24, 3584, generator=g) * 0.1, extra]]


def latent(channels: int, frames: int = 5, h: int = 16, w: int = 16):
    return {"samples": torch.zeros(1, channels, frames, h, w)}


def sample(comfy, model, positive, negative, lat, *, steps=4, cfg=2.0, sampler="euler", scheduler="simple",
           seed=0, start=None, end=None, add_noise=True, return_noise=False):
    """nodes.common_ksampler, the function behind KSampler and KSamplerAdvanced."""
    if start is None and end is None:
        return comfy.common_ksampler(model, seed, steps, cfg, sampler, scheduler, positive, negative, lat)[0]
    return comfy.common_ksampler(model, seed, steps, cfg, sampler, scheduler, positive, negative, lat,
                                 disable_noise=not add_noise, start_step=start, last_step=end,
                                 force_full_denoise=not return_noise)[0]


def patch(comfy, model, **inputs):
    """Run the VCAttentionPatch node the way ComfyUI's executor calls a V3 node."""
    node = comfy.NODE_CLASS_MAPPINGS["VCAttentionPatch"]
    return run_v3(node, model=model, **inputs)


def run_v3(node_cls, **inputs):
    """Execute a V3 node through its class clone with hidden inputs, like execution.py does."""
    clone = node_cls.PREPARE_CLASS_CLONE({"hidden_inputs": {"UNIQUE_ID": "42"}})
    return node_cls.execute.__func__(clone, **inputs)
