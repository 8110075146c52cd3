"""tests/nodes: real ComfyUI, in process, on the CPU (helpers in tests/comfy_harness.py).

Without ComfyUI (found as tests/comfy_harness.py says) or its requirements every test here is
skipped and the reason is printed; `pytest -rs` lists it again. Under VC_REQUIRE_COMFYUI=1 (CI) that
is a failure instead.
"""

import sys

import pytest

from comfy_harness import REQUIRED, build_hunyuan15, build_wan, comfyui_missing, start_comfyui

_MISSING = comfyui_missing()
if _MISSING:
    if REQUIRED:
        raise pytest.UsageError(f"VC_REQUIRE_COMFYUI=1 but tests/nodes cannot run: {_MISSING}")
    print(f"\n*** SKIPPING tests/nodes: {_MISSING} ***\n", file=sys.stderr)


def pytest_collection_modifyitems(config, items):
    here = str(config.rootpath / "tests" / "nodes")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.comfyui)
            if _MISSING:
                item.add_marker(pytest.mark.skip(reason=_MISSING))


@pytest.fixture(scope="session")
def comfy_nodes():
    """ComfyUI's ``nodes`` module, with its built-in nodes and ours registered."""
    start_comfyui()
    import nodes

    return nodes


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, comfy_nodes):
    """A diffusion_models folder with the tiny models, registered with ComfyUI's folder_paths."""
    import folder_paths

    root = tmp_path_factory.mktemp("diffusion_models")
    build_wan(root / "tiny_wan21.safetensors", channels=16, seed=1)
    build_wan(root / "tiny_wan21_b.safetensors", channels=16, seed=2)
    build_wan(root / "tiny_wan22_5b.safetensors", channels=48, seed=3)
    build_hunyuan15(root / "tiny_hunyuan15.safetensors", seed=4)
    folder_paths.add_model_folder_path("diffusion_models", str(root), is_default=True)
    return root


