"""Shared test set-up: make the repository importable as ``vc_attention`` without installing it.

The repository root is the package (pyproject maps it), so a plain checkout has no folder named
``vc_attention``; register it here always from this checkout.
"""

import importlib.util
import os
import pathlib
import sys

import pytest
import torch

# Without a GPU the Triton kernels run through Triton's interpreter (numpy on the CPU). It is chosen
# when a kernel is decorated, so it must be set before anything imports kernels/triton/.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _register_package() -> None:
    # Always the checkout under test, never a stale installed copy.
    loaded = sys.modules.get("vc_attention")
    if loaded is not None and pathlib.Path(loaded.__file__).resolve().parent == ROOT:
        return
    spec = importlib.util.spec_from_file_location(
        "vc_attention", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["vc_attention"] = module
    spec.loader.exec_module(module)


_register_package()
# Shared test helpers (tests/kernel_helpers.py) import by name under --import-mode=importlib.
sys.path.insert(0, str(ROOT / "tests"))


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present, and say so where it is not."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Under VC_REQUIRE_COMFYUI=1 (CI) the node pack's own tests must all run: a skipped test in
# tests/nodes or tests/web fails the run, whatever the skip's reason.
_REQUIRE_COMFYUI = os.environ.get("VC_REQUIRE_COMFYUI") == "1"
_COMFYUI_DIRS = ("tests/nodes/", "tests/web/")
_skipped_comfyui_tests: list = []


def pytest_runtest_logreport(report):
    if _REQUIRE_COMFYUI and report.skipped and report.nodeid.replace("\\", "/").startswith(_COMFYUI_DIRS):
        _skipped_comfyui_tests.append((report.nodeid, report.longrepr))


def pytest_sessionfinish(session, exitstatus):
    if _skipped_comfyui_tests and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _skipped_comfyui_tests:
        terminalreporter.section("VC_REQUIRE_COMFYUI=1: ComfyUI tests were skipped (this run fails)", red=True)
        for nodeid, why in _skipped_comfyui_tests:
            reason = why[2] if isinstance(why, tuple) and len(why) == 3 else str(why)
            terminalreporter.line(f"{nodeid}: {reason}")
