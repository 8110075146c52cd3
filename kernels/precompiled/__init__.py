"""Precompiled cubins of the 8-bit kernels, launched through the CUDA driver without Triton.

    build.py     python -m vc_attention.kernels.precompiled.build --arch 89 90 100 120 --out DIR
    loader.py    cubin loading and launching (cuda-bindings or ctypes on libcuda), arch and source checks
    specs.py     which kernels and variants are built for which architecture; the variant key build
                 and loader share; the kernels' source hashes
    ptx.py       the mma.sync kernel's sm_89 PTX through Triton, for checks on newer GPUs (needs Triton)

Where cubins are looked for, first match wins: the folders in VC_ATTENTION_CUBINS (os.pathsep
separated), then this package's cubins/ folder (what a wheel ships). Each holds sm_<arch>/ folders
with a manifest.json. A GPU with no folder of its own, newer than sm_89, runs the sm_89 folder's
PTX (the driver JIT-compiles it; status and the doctor say so). Nothing here imports Triton.
"""

import functools
import logging
import os
import pathlib
from typing import Optional

from . import specs
from .loader import (CubinKernels, PrecompiledError, SourceMismatchError, WrongArchError, check_sources,  # noqa: F401
                     cubin_arch, get_driver, read_manifest)

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


def select(arch, archs=None):
    """(folder, via_ptx) for this GPU architecture: its own cubins, else (newer than sm_89 only) the
    newest PTX folder older than it; PrecompiledError with the reason when neither exists."""
    archs = available_archs() if archs is None else archs
    if arch in archs:
        return archs[arch], False
    older = [a for a in sorted(archs) if a in specs.PTX_ARCHS and a < arch]
    if older:
        return archs[older[-1]], True
    raise PrecompiledError(no_cubin_reason(arch, archs))


@functools.lru_cache(maxsize=None)
def _kernels_for(device_index: int, arch: int, folder: str, ptx: bool = False):
    return CubinKernels(folder, device_index, arch, ptx=ptx)


def kernels_for_device(device) -> CubinKernels:
    """The cubins for a CUDA device (cached). Raises PrecompiledError (WrongArchError) with the reason."""
    import torch

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    arch = major * 10 + minor
    folder, via_ptx = select(arch)
    if via_ptx:
        _log_once(fallback_note(arch))
    return _kernels_for(index, arch, str(folder), via_ptx)


_noted = set()


def _log_once(message):
    if message not in _noted:
        _noted.add(message)
        logging.getLogger("vc_attention").warning(message)


def fallback_note(arch, archs=None) -> str:
    """What runs on an architecture without cubins of its own ("" when it has them or nothing runs)."""
    archs = available_archs() if archs is None else archs
    try:
        folder, via_ptx = select(arch, archs)
    except PrecompiledError:
        return ""
    if not via_ptx:
        return ""
    built = int(folder.name[3:])
    return (f"precompiled: no cubins for sm_{arch}, so the sm_{built} PTX runs, JIT-compiled by the CUDA "
            f"driver for sm_{arch} (the first load of each kernel compiles; sm_{built}'s mma.sync code, not "
            f"this GPU's own tensor-core instructions)")


def no_cubin_reason(arch, archs=None) -> str:
    archs = available_archs() if archs is None else archs
    where = ", ".join(str(r) for r in cubin_roots())
    if not archs:
        return (f"no precompiled cubins installed (looked in {where}); build them with "
                f"python -m vc_attention.kernels.precompiled.build --arch {arch}")
    others = ", ".join(f"sm_{a}" for a in sorted(archs))
    ptx = [f"sm_{a}" for a in sorted(archs) if a in specs.PTX_ARCHS]
    tail = f", and the {ptx[0]} PTX only on {ptx[0]} and newer" if ptx else ""
    return (f"no cubins for sm_{arch} (found {others}; a cubin runs only on the architecture it was "
            f"built for, so those are refused here{tail})")


def jit_twin(arch) -> str:
    """The registry record whose JIT kernel the precompiled backend runs on this arch ("mma" / "triton")."""
    try:
        folder, _ = select(arch)
        kernel = next((e["kernel"] for e in read_manifest(folder)["kernels"] if e["tags"].get("role") == "attention"),
                      None)
    except PrecompiledError:
        kernel = specs.attention_kernel(arch)
    return specs.KERNELS[kernel]["record"] if kernel else "triton"


@functools.lru_cache(maxsize=None)
def status(arch: int) -> tuple:
    """(ok, reason, attention configs {(head_dim, dtype)}) for this GPU architecture: cubins present,
    for this arch, and a CUDA driver to launch them. Does not load any cubin."""
    try:
        folder, via_ptx = select(arch)
        manifest = read_manifest(folder)
        if int(manifest["arch"]) != int(folder.name[3:]):
            raise WrongArchError(f"{folder}/manifest.json says sm_{manifest['arch']}, the folder {folder.name}")
        check_sources(manifest, folder)
        get_driver()
        _probe(arch, folder, manifest, via_ptx)
    except PrecompiledError as exc:
        return False, str(exc), frozenset()
    except Exception as exc:  # never let the cubins' check break dispatch: a reason instead
        return False, f"the precompiled check failed: {type(exc).__name__}: {exc}", frozenset()
    return True, "", complete_configs(manifest, ("attention", "prepass"), ptx=via_ptx)


def _probe(arch, folder, manifest, ptx=False):
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
        _kernels_for(index, arch, str(folder), ptx).function(entry)


def complete_configs(manifest, roles, ptx=False):
    """{(head_dim, dtype)} for which the manifest holds every variant of these roles that its
    architecture is built with (specs.variants(arch); ptx: with their PTX); a variant without a dtype
    tag (its operands are the pre-pass's own) is needed for every dtype."""
    from .specs import IO_DTYPES, variants

    have = {e["key"] for e in manifest["kernels"] if not ptx or "ptx" in e}
    need = {}
    for v in variants(int(manifest["arch"])):
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
                             key_bias=None, pv_int8=False, **launch_options):
    """The 8-bit pipeline (kernels/pipeline.py) on the cubins for q's device. Arguments as
    triton_vc_attention; out: [B, H, M, D] view written in place (unit last-dim stride). pv_int8:
    the INT8 P.V path, which the mma.sync cubins (sm_89 / sm_120 and their PTX) have."""
    from .. import pipeline

    launcher = kernels_for_device(q.device)
    if perm is not None and not perm.dtype.is_floating_point and perm.element_size() != 8:
        perm = perm.long()  # the cubins are built for int64 gathers; the JIT specialises on either
    if launcher.attention_kernel == "vc_attention_mma_fwd_kernel":  # sm_89 / sm_120 (and their PTX)
        from ..pipeline_mma import mma_vc_attention

        if launch_options:
            raise TypeError(f"the mma.sync cubins take no launch options, got {sorted(launch_options)}")
        return mma_vc_attention(launcher, _ready(q), _ready(k), _ready(v), out, v_smooth=v_smooth,
                                expcast=expcast, perm=perm, sm_scale=sm_scale, key_bias=key_bias, pv_int8=pv_int8)
    if pv_int8:
        raise NotImplementedError("the portable kernel's cubins have no INT8 P.V path (the mma.sync ones do)")
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
    if (x.shape[-1], dtype) not in complete_configs(kernels.manifest, ("kmeans",), ptx=kernels.ptx):
        return f"no k-means cubin for head dim {x.shape[-1]}, {x.dtype}"
    return None
