"""Ahead-of-time build of the 8-bit kernels into cubins, one folder per GPU architecture.

    python -m vc_attention.kernels.precompiled.build --arch 90 100 120 --out DIR [--only REGEX] [--jobs N]

writes DIR/sm_<arch>/<kernel>-<hash>.cubin and DIR/sm_<arch>/manifest.json. Needs Triton (and its
bundled ptxas), not a GPU: triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32)) runs on
a CPU-only machine. The manifest records, per cubin: the kernel name, variant key (pointer types,
constexprs, num_warps, num_stages), the run-time parameters in ABI order, how many parameters Triton
appended (global / profile scratch pointers; read from the PTX entry, so the loader matches the
Triton version that built it), shared memory, scratch sizes, the launch assumptions, and a sha256.

Packaging: one wheel carries every architecture's folder (see kernels/precompiled/README.md).
"""

import argparse
import concurrent.futures
import hashlib
import json
import os
import pathlib
import re
import sys
import time

from . import specs

MANIFEST_FORMAT = 1


def _import_kernels():
    """The @triton.jit kernels, compiled (never interpreted) whatever TRITON_INTERPRET says."""
    os.environ["TRITON_INTERPRET"] = "0"
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

    rules = specs.KERNELS[variant["kernel"]]
    names = list(fn.arg_names)
    pointer_types, constexprs = variant["pointers"], variant["constexprs"]
    signature, consts, attrs, params = {}, {}, {}, []
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            consts[name] = constexprs[name]
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
        "pointers": pointer_types, "constexprs": constexprs, "tags": variant["tags"],
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


def _worker(arch, chunk, out_dir, keep_ptx):
    import triton

    kernels = _import_kernels()
    entries = []
    for variant in chunk:
        cubin, entry, ptx = compile_variant(kernels[variant["kernel"]], variant, arch)
        (out_dir / entry["file"]).write_bytes(cubin)
        if keep_ptx:
            (out_dir / entry["file"].replace(".cubin", ".ptx")).write_text(ptx)
        entries.append(entry)
    return entries, triton.__version__


def build(archs, out, only=None, jobs=1, keep_ptx=False, log=print, select=None):
    """Build the variants for each arch; `only`: a regex on the variant label (specs.variant_label:
    "kernel NAME=value ..."), `select`: a predicate on the variant dict. Returns {arch: manifest path}."""
    out = pathlib.Path(out)
    selected = [v for v in specs.variants() if (only is None or re.search(only, v["label"]))
                and (select is None or select(v))]
    if not selected:
        raise SystemExit(f"no variant matches --only {only!r}")
    written = {}
    for arch in archs:
        arch_dir = out / f"sm_{arch}"
        arch_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        jobs = max(1, min(jobs, len(selected)))
        chunks = [selected[i::jobs] for i in range(jobs)]
        entries, versions = [], set()
        if jobs == 1:
            e, ver = _worker(arch, selected, arch_dir, keep_ptx)
            entries, versions = e, {ver}
        else:
            with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
                for e, ver in pool.map(_worker, [arch] * jobs, chunks, [arch_dir] * jobs, [keep_ptx] * jobs):
                    entries += e
                    versions.add(ver)
        order = {v["key"]: i for i, v in enumerate(selected)}
        entries.sort(key=lambda e: order[e["key"]])
        manifest = {
            "format": MANIFEST_FORMAT, "arch": int(arch), "target": f"cuda:sm_{arch}",
            "triton_version": versions.pop(), "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": sys.version.split()[0], "kernels": entries,
        }
        path = arch_dir / "manifest.json"
        path.write_text(json.dumps(manifest, indent=1))
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
