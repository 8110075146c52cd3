"""Ahead-of-time build of the 8-bit kernels into cubins, one folder per GPU architecture.

    python -m vc_attention.kernels.precompiled.build --arch 90 100 120 --out DIR [--only REGEX] [--jobs N]

writes DIR/sm_<arch>/<kernel>-<hash>.cubin and DIR/sm_<arch>/manifest.json (for sm_89 also each
variant's PTX, the fallback for newer GPUs without cubins: specs.PTX_ARCHS). Needs Triton (and its
bundled ptxas), not a GPU: triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32)) runs on
a CPU-only machine. The manifest records, per cubin: the kernel name, variant key (pointer types,
constexprs, num_warps, num_stages), the run-time parameters in ABI order, how many parameters Triton
appended (global / profile scratch pointers; read from the PTX entry, so the loader matches the
Triton version that built it), shared memory, scratch sizes, the launch assumptions, and a sha256;
per folder: the architecture, the Triton version and each kernel's source hash (specs.source_hash),
which the loader compares with the installed source before it launches anything.

Reproducible: the same source, Triton and architectures give the same bytes (no line info, hence no
source paths, in the cubins; built_at is SOURCE_DATE_EPOCH when set; files in a fixed order).

Packaging: one wheel carries every architecture's folder (see kernels/precompiled/README.md).
"""

import argparse
import concurrent.futures
import ctypes
import hashlib
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

from . import specs

MANIFEST_FORMAT = specs.MANIFEST_FORMAT


ADDR_NO_RANDOMIZE = 0x0040000  # linux/personality.h


def _scratch_dir():
    """A temp folder whose path has the same length on every run (see _pin_ptxas)."""
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="vcab-", dir=base)  # /tmp/vcab-1a2b3c4d


def _pin_ptxas(scratch):
    """Make ptxas's output a function of its input. Blackwell's ptxas (13.x, sm_100) picks registers
    depending on its address layout: the same PTX gave two different cubins run to run (the same
    instructions, registers renamed). With address randomisation off (inherited by the ptxas that
    Triton starts from this process, as `setarch -R` does) and its file arguments of one length
    (Triton names its temp files in `scratch`), the output repeats."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        current = libc.personality(0xFFFFFFFF)
        if current != -1:
            libc.personality(current | ADDR_NO_RANDOMIZE)
    tempfile.tempdir = scratch


def _import_kernels():
    """The @triton.jit kernels, compiled (never interpreted) whatever TRITON_INTERPRET says."""
    os.environ["TRITON_INTERPRET"] = "0"
    # No line info: it embeds the source files' absolute paths, so the bytes would depend on where
    # the package sits (and it changes no instruction).
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
    import importlib

    return {name: getattr(importlib.import_module(k["module"]), name) for name, k in specs.KERNELS.items()}


def ptx_params(ptx: str, name: str):
    """The .param types of the kernel's PTX entry, in order (e.g. ['u64', 'u32', ...])."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if not m:
        raise RuntimeError(f"no .entry {name} in the PTX")
    return re.findall(r"\.param\s+\.(\w+)", m.group(1))


def ptx_version(ptx: str):
    m = re.search(r"^\.version\s+(\S+)", ptx, re.M)
    return m.group(1) if m else None


def compile_variant(fn, variant, arch):
    """Compile one variant for one arch -> (cubin bytes, manifest entry, ptx)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import inspect

    rules = specs.KERNELS[variant["kernel"]]
    names = list(fn.arg_names)
    pointer_types, constexprs = variant["pointers"], variant["constexprs"]
    # Constexprs with a default that the variant does not name: the default, as the JIT takes it
    # for a launch that leaves them out (the loader finds such a launch by the same key).
    defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
                if p.default is not inspect.Parameter.empty and n not in constexprs and n not in pointer_types}
    signature, consts, attrs, params = {}, {}, {}, []
    for i, name in enumerate(names):
        if name in constexprs or name in defaults:
            signature[name] = "constexpr"
            consts[name] = constexprs[name] if name in constexprs else defaults[name]
        elif name in pointer_types:
            if pointer_types[name] is None:
                signature[name] = "constexpr"
                consts[name] = None
            else:
                signature[name] = "*" + pointer_types[name]
                attrs[(i,)] = [["tt.divisibility", 16]]
                params.append([name, signature[name]])
        elif name in rules["one"]:
            signature[name] = "constexpr"
            consts[name] = 1
        else:
            signature[name] = "i32"
            if name in rules["div16"]:
                attrs[(i,)] = [["tt.divisibility", 16]]
            params.append([name, "i32"])
    missing = set(constexprs) - set(names)
    if missing:
        raise ValueError(f"{variant['kernel']}: constexprs {sorted(missing)} are not kernel arguments")
    options = {"num_warps": variant["num_warps"]}
    if variant["num_stages"] is not None:
        options["num_stages"] = variant["num_stages"]
    # Constexprs keyed by (argument index,): the form every Triton since 3.3 accepts.
    consts = {(names.index(name),): value for name, value in consts.items()}
    compiled = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", arch, 32),
                              options=options)
    md = compiled.metadata
    ptx = compiled.asm["ptx"]
    cubin = compiled.asm["cubin"]
    abi = ptx_params(ptx, md.name)
    extra = len(abi) - len(params)
    if extra < 0:
        raise RuntimeError(f"{md.name}: the PTX entry has {len(abi)} parameters, fewer than the "
                           f"{len(params)} run-time arguments")
    sha = hashlib.sha256(cubin).hexdigest()
    entry = {
        "kernel": variant["kernel"], "name": md.name, "key": variant["key"],
        "file": f"{variant['kernel']}-{sha[:16]}.cubin", "sha256": sha,
        "pointers": pointer_types, "constexprs": constexprs, "defaults": defaults, "tags": variant["tags"],
        "num_warps": md.num_warps, "num_stages": variant["num_stages"], "num_ctas": getattr(md, "num_ctas", 1),
        "shared": md.shared, "params": params, "ptx_params": abi, "extra_params": extra,
        "global_scratch_size": getattr(md, "global_scratch_size", 0),
        "global_scratch_align": getattr(md, "global_scratch_align", 1),
        "profile_scratch_size": getattr(md, "profile_scratch_size", 0),
        "profile_scratch_align": getattr(md, "profile_scratch_align", 1),
        "launch_cooperative_grid": bool(getattr(md, "launch_cooperative_grid", False)),
        "launch_pdl": bool(getattr(md, "launch_pdl", False)),
        "assume": {"aligned16": [p for p, _ in params if p in pointer_types],
                   "one": [n for n in rules["one"] if n in names],
                   "div16": [n for n in rules["div16"] if n in names]},
        "ptx_version": ptx_version(ptx),
        "target": str(getattr(md, "arch", arch)),
    }
    return cubin, entry, ptx


def ptx_target(ptx: str):
    m = re.search(r"^\.target\s+(\w+)", ptx, re.M)
    return m.group(1) if m else None


def _worker(arch, chunk, out_dir, keep_ptx, scratch):
    import triton

    _pin_ptxas(scratch)
    kernels = _import_kernels()
    entries = []
    for variant in chunk:
        cubin, entry, ptx = compile_variant(kernels[variant["kernel"]], variant, arch)
        (out_dir / entry["file"]).write_bytes(cubin)
        if keep_ptx or arch in specs.PTX_ARCHS:
            data = ptx.encode()
            entry["ptx"] = entry["file"].replace(".cubin", ".ptx")
            entry["ptx_sha256"] = hashlib.sha256(data).hexdigest()
            entry["ptx_target"] = ptx_target(ptx)
            (out_dir / entry["ptx"]).write_bytes(data)
        entries.append(entry)
    return entries, triton.__version__


def built_at():
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(epoch) if epoch else None))


def build(archs, out, only=None, jobs=1, keep_ptx=False, log=print, select=None):
    """Build the variants for each arch; `only`: a regex on the variant label (specs.variant_label:
    "kernel NAME=value ..."), `select`: a predicate on the variant dict. Returns {arch: manifest path}."""
    out = pathlib.Path(out)
    written = {}
    for arch in archs:
        selected = [v for v in specs.variants(arch) if (only is None or re.search(only, v["label"]))
                    and (select is None or select(v))]
        if not selected:
            raise SystemExit(f"no variant for sm_{arch} matches --only {only!r}")
        arch_dir = out / f"sm_{arch}"
        arch_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        n_jobs = max(1, min(jobs, len(selected)))
        chunks = [selected[i::n_jobs] for i in range(n_jobs)]
        entries, versions = [], set()
        scratch, tempdir = _scratch_dir(), tempfile.tempdir
        try:
            if n_jobs == 1:
                e, ver = _worker(arch, selected, arch_dir, keep_ptx, scratch)
                entries, versions = e, {ver}
            else:
                with concurrent.futures.ProcessPoolExecutor(n_jobs) as pool:
                    for e, ver in pool.map(_worker, [arch] * n_jobs, chunks, [arch_dir] * n_jobs,
                                           [keep_ptx] * n_jobs, [scratch] * n_jobs):
                        entries += e
                        versions.add(ver)
        finally:
            tempfile.tempdir = tempdir
            shutil.rmtree(scratch, ignore_errors=True)
        order = {v["key"]: i for i, v in enumerate(selected)}
        entries.sort(key=lambda e: order[e["key"]])
        if len(versions) != 1:
            raise RuntimeError(f"the compiler processes ran different Tritons: {sorted(versions)}")
        names = sorted({e["kernel"] for e in entries})
        manifest = {
            "format": MANIFEST_FORMAT, "arch": int(arch), "target": f"cuda:sm_{arch}",
            "triton_version": versions.pop(), "built_at": built_at(), "python": sys.version.split()[0],
            "sources": {k: {"sha256": specs.source_hash(k), "files": specs.source_files(k)} for k in names},
            "kernels": entries,
        }
        keep = {"manifest.json"} | {e["file"] for e in entries} | {e["ptx"] for e in entries if "ptx" in e}
        for stale in arch_dir.iterdir():  # an earlier build's files would ship with this one
            if stale.is_file() and stale.suffix in (".cubin", ".ptx") and stale.name not in keep:
                stale.unlink()
        path = arch_dir / "manifest.json"
        path.write_bytes(json.dumps(manifest, indent=1).encode())  # "\n" line ends on every OS
        written[arch] = path
        log(f"sm_{arch}: {len(entries)} cubins in {time.time() - t0:.0f} s -> {path}")
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m vc_attention.kernels.precompiled.build",
                                     description="AOT-compile VC-Attention's 8-bit kernels into cubins.")
    parser.add_argument("--arch", type=int, nargs="+", default=list(specs.DEFAULT_ARCHS),
                        help="compute capabilities as numbers: 89 90 100 120 (default: all four)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "cubins"),
                        help="output folder (default: the package's cubins/ folder, which the loader searches)")
    parser.add_argument("--only", default=None, help="regex on the variant label, e.g. 'vc_attention_fwd.*HEAD_DIM=128'")
    parser.add_argument("--jobs", type=int, default=1, help="compiler processes")
    parser.add_argument("--keep-ptx", action="store_true", help="also write the PTX next to each cubin")
    args = parser.parse_args(argv)
    build(args.arch, args.out, args.only, args.jobs, args.keep_ptx)


if __name__ == "__main__":
    main()
