"""Shared test set-up: make the repository importable as ``vc_attention`` without installing it.

The repository root is the package (pyproject maps it), so a plain checkout has no folder named
``vc_attention``; register it here always from this checkout.
"""

import importlib.util
import pathlib
import sys

import pytest

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


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present (the device machine), never silently elsewhere."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu); run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
