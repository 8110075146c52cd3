"""How the tests find ComfyUI and WanVideoWrapper (tests/comfy_harness.py), without either installed:
a pack inside ``ComfyUI/custom_nodes/`` finds the ComfyUI two folders up and a WanVideoWrapper beside
it, with no variable set, also when the pack folder is a symlink to the checkout."""

import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent

PROBE = "import comfy_harness as h; print(h.COMFYUI_PATH); print(h.find_wanvideowrapper())"


def _fake_comfyui(root: pathlib.Path) -> pathlib.Path:
    comfy = root / "ComfyUI"
    (comfy / "comfy").mkdir(parents=True)
    (comfy / "comfy" / "model_patcher.py").write_text("")
    (comfy / "main.py").write_text("")
    (comfy / "custom_nodes" / "ComfyUI-WanVideoWrapper" / "wanvideo").mkdir(parents=True)
    return comfy


def _probe(cwd: pathlib.Path, **env) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_PATH", "WANVIDEOWRAPPER_PATH")}
    clean.update(PWD=str(cwd), PYTHONPATH=str(cwd / "tests"), **env)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=clean, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_a_pack_in_custom_nodes_finds_its_comfyui(tmp_path):
    comfy = _fake_comfyui(tmp_path)
    pack = comfy / "custom_nodes" / "ComfyUI-VC-Attention"
    pack.symlink_to(TESTS.parent, target_is_directory=True)
    assert _probe(pack) == [str(comfy), str(comfy / "custom_nodes" / "ComfyUI-WanVideoWrapper")]


def test_the_variables_win(tmp_path):
    comfy = _fake_comfyui(tmp_path)
    pack = comfy / "custom_nodes" / "ComfyUI-VC-Attention"
    pack.symlink_to(TESTS.parent, target_is_directory=True)
    assert _probe(pack, COMFYUI_PATH="/elsewhere", WANVIDEOWRAPPER_PATH="/wvw") == ["/elsewhere", "/wvw"]


def test_outside_custom_nodes_nothing_is_guessed(tmp_path):
    if TESTS.parent.parent.name == "custom_nodes":
        pytest.skip("this checkout is itself inside a custom_nodes folder")
    assert _probe(TESTS.parent) == ["None", "None"]


def test_ci_fails_instead_of_skipping_the_comfyui_tests():
    """VC_REQUIRE_COMFYUI=1 (set by .ci/run): a missing ComfyUI is an error, not a silent skip."""
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}
    env.update(COMFYUI_PATH="/nonexistent-comfyui", VC_REQUIRE_COMFYUI="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(TESTS / "nodes" / "test_schedule.py")],
                         cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0, out.stdout[-2000:]
    assert "VC_REQUIRE_COMFYUI=1" in out.stdout + out.stderr
