"""Precompiled cubins of the 8-bit kernels, launched through the CUDA driver without Triton.

    build.py   python -m vc_attention.kernels.precompiled.build --arch 90 100 120 --out DIR
    loader.py  cubin loading and launching (cuda-bindings or ctypes on libcuda), arch checks
    specs.py   which kernels and variants are built; the variant key build and loader share

Where cubins are looked for, first match wins: the folders in VC_ATTENTION_CUBINS (os.pathsep
separated), then this package's cubins/ folder (what a wheel ships). Each holds sm_<arch>/ folders
with a manifest.json. Nothing here imports Triton.
"""

import functools
import os
import pathlib
from typing import Optional

from .loader import CubinKernels, PrecompiledError, WrongArchError, cubin_arch, get_driver, read_manifest  # noqa: F401

PACKAGE_CUBINS = pathlib.Path(__file__).resolve().parent / "cubins"


def cubin_roots():
    roots = [pathlib.Path(p) for p in os.environ.get("VC_ATTENTION_CUBINS", "").split(os.pathsep) if p]
    return roots + [PACKAGE_CUBINS]


def available_archs():
    """{arch: folder} of every sm_<arch> folder with a manifest, first root first."""
    found = {}
    for root in cubin_roots():
        if not root.is_dir():
            continue
        for sub in sorted(root.glob("sm_*")):
            try:
                arch = int(sub.name[3:])
            except ValueError:
                continue
            if (sub / "manifest.json").is_file() and arch not in found:
                found[arch] = sub
    return found


@functools.lru_cache(maxsize=None)
def _kernels_for(device_index: int, arch: int, folder: str):
    return CubinKernels(folder, device_index, arch)


def kernels_for_device(device) -> CubinKernels:
    """The cubins for a CUDA device (cached). Raises PrecompiledError (WrongArchError) with the reason."""
    import torch

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    arch = major * 10 + minor
    archs = available_archs()
    if arch not in archs:
        raise PrecompiledError(no_cubin_reason(arch, archs))
    return _kernels_for(index, arch, str(archs[arch]))


def no_cubin_reason(arch, archs=None) -> str:
    archs = available_archs() if archs is None else archs
    where = ", ".join(str(r) for r in cubin_roots())
    if not archs:
        return (f"no precompiled cubins installed (looked in {where}); build them with "
                f"python -m vc_attention.kernels.precompiled.build --arch {arch}")
    others = ", ".join(f"sm_{a}" for a in sorted(archs))
    return (f"no cubins for sm_{arch} (found {others}; a cubin runs only on the architecture it was "
            f"built for, so those are refused here)")


@functools.lru_cache(maxsize=None)
def status(arch: int) -> tuple:
    """(ok, reason, attention configs {(head_dim, dtype)}) for this GPU architecture: cubins present,
    for this arch, and a CUDA driver to launch them. Does not load any cubin."""
    archs = available_archs()
    if arch not in archs:
        return False, no_cubin_reason(arch, archs), frozenset()
    try:
        manifest = read_manifest(archs[arch])
        if int(manifest["arch"]) != arch:
            raise WrongArchError(f"{archs[arch]}/manifest.json says sm_{manifest['arch']}, the folder sm_{arch}")
        get_driver()
        _probe(arch, archs[arch], manifest)
    except PrecompiledError as exc:
        return False, str(exc), frozenset()
    except Exception as exc:  # never let the cubins' check break dispatch: a reason instead
        return False, f"the precompiled check failed: {type(exc).__name__}: {exc}", frozenset()
    return True, "", complete_configs(manifest, ("attention", "prepass"))


def _probe(arch, folder, manifest):
    """Load one attention cubin on the current GPU when it is of this arch, so that a cubin the
    driver rejects (e.g. from a newer ptxas than the driver knows) is a refusal, not a crash."""
    import torch

    if not torch.cuda.is_available():
        return
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    entry = next((e for e in manifest["kernels"] if e["tags"].get("role") == "attention"), None)
    if major * 10 + minor != arch or entry is None:
        return
    with torch.cuda.device(index):
        _kernels_for(index, arch, str(folder)).function(entry)


def complete_configs(manifest, roles):
    """{(head_dim, dtype)} for which the manifest holds every variant of these roles (specs.py); a
    variant without a dtype tag (its operands are the pre-pass's own) is needed for every dtype."""
    from .specs import IO_DTYPES, variants

    have = {e["key"] for e in manifest["kernels"]}
    need = {}
    for v in variants():
        if v["tags"]["role"] in roles:
            for io in ([v["tags"]["dtype"]] if "dtype" in v["tags"] else IO_DTYPES):
                need.setdefault((v["tags"]["head_dim"], io), set()).add(v["key"])
    return frozenset(c for c, keys in need.items() if keys <= have)


def _ready(x):
    """x itself if it meets the cubins' assumptions (unit last-dim stride, other strides multiples
    of 16 elements, 16-byte aligned), else a contiguous copy: same values, so the same results."""
    import torch

    if x is None:
        return None
    ok = x.stride(-1) == 1 and all(s % 16 == 0 for s in x.stride()[:-1]) and x.data_ptr() % 16 == 0
    # A fresh tensor, not .contiguous(): that keeps odd strides of size-1 dims.
    return x if ok else torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


def precompiled_vc_attention(q, k, v, out, *, v_smooth=True, expcast=True, perm=None, sm_scale=None,
                             key_bias=None, **launch_options):
    """The 8-bit pipeline (kernels/pipeline.py) on the cubins for q's device. Arguments as
    triton_vc_attention; out: [B, H, M, D] view written in place (unit last-dim stride)."""
    from .. import pipeline

    launcher = kernels_for_device(q.device)
    return pipeline.vc_attention_8bit(launcher, _ready(q), _ready(k), _ready(v), out, v_smooth=v_smooth,
                                      expcast=expcast, perm=perm, sm_scale=sm_scale, key_bias=key_bias,
                                      **launch_options)


def precompiled_kmeans(x, centroids, iters):
    """k-means for V-Smooth's plan on the cubins (kernels/pipeline.py kmeans)."""
    from .. import pipeline

    return pipeline.kmeans(kernels_for_device(x.device), _ready(x), centroids, iters)


def kmeans_available(x) -> Optional[str]:
    """None when the k-means cubins can run on x, else the reason."""
    if x.device.type != "cuda":
        return "not a CUDA tensor"
    import torch

    from .specs import TORCH_TO_TRITON

    major, minor = torch.cuda.get_device_capability(x.device)
    ok, why, _ = status(major * 10 + minor)
    if not ok:
        return why
    dtype = TORCH_TO_TRITON.get(str(x.dtype).replace("torch.", ""))
    try:
        kernels = kernels_for_device(x.device)
    except PrecompiledError as exc:
        return str(exc)
    if (x.shape[-1], dtype) not in complete_configs(kernels.manifest, ("kmeans",)):
        return f"no k-means cubin for head dim {x.shape[-1]}, {x.dtype}"
    return None
