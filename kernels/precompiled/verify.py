"""Check a cubin build against the claim: every kernel has a cubin for every architecture it claims.

    python -m vc_attention.kernels.precompiled.verify [ROOT] [--arch 89 90 100 120] [--only REGEX]

ROOT defaults to the folders the loader searches (VC_ATTENTION_CUBINS, then this package's cubins/),
so on an installed wheel it checks what the wheel ships. Per architecture (specs.RECORD_ARCHS and the
shared pre-pass / k-means kernels, specs.variants(arch)): a folder with a manifest of the current
format, exactly the claimed variants, each file present with its recorded sha256, each cubin's ELF
header of that architecture, the PTX of specs.PTX_ARCHS present with a portable target, and every
kernel's source hash equal to the installed source's. Prints one line per architecture and every
problem; exit status 1 when there is any. Needs neither Triton nor a GPU.
"""

import argparse
import hashlib
import pathlib
import re
import sys

from . import available_archs, cubin_roots, specs
from .loader import PrecompiledError, check_sources, cubin_arch, ptx_arch, read_manifest


def check_arch_folder(folder, arch, only=None):
    """(summary dict, problems) for one sm_<arch> folder."""
    folder = pathlib.Path(folder)
    problems = []
    try:
        manifest = read_manifest(folder)
    except PrecompiledError as exc:
        return {}, [str(exc)]
    if int(manifest.get("arch", -1)) != arch:
        problems.append(f"{folder}/manifest.json says sm_{manifest.get('arch')}, expected sm_{arch}")
    want = {v["key"]: v for v in specs.variants(arch) if only is None or re.search(only, v["label"])}
    have = {e["key"]: e for e in manifest["kernels"]}
    for key in sorted(set(want) - set(have)):
        problems.append(f"sm_{arch}: no cubin for {want[key]['label']}")
    for key in sorted(set(have) - set(want)):
        problems.append(f"sm_{arch}: a cubin nobody claims: {have[key]['kernel']} {have[key]['file']}")
    n_ptx = 0
    for e in manifest["kernels"]:
        path = folder / e["file"]
        if not path.is_file():
            problems.append(f"sm_{arch}: {e['file']} is missing")
            continue
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != e["sha256"]:
            problems.append(f"sm_{arch}: {e['file']} does not match its sha256")
        try:
            if cubin_arch(data) != arch:
                problems.append(f"sm_{arch}: {e['file']} is a cubin for sm_{cubin_arch(data)}")
        except PrecompiledError as exc:
            problems.append(f"sm_{arch}: {e['file']}: {exc}")
        if "ptx" in e:
            ptx = folder / e["ptx"]
            if not ptx.is_file() or hashlib.sha256(ptx.read_bytes()).hexdigest() != e["ptx_sha256"]:
                problems.append(f"sm_{arch}: {e['ptx']} is missing or does not match its sha256")
            else:
                n_ptx += 1
        if arch in specs.PTX_ARCHS:
            try:
                if "ptx" not in e or ptx_arch(e.get("ptx_target")) != arch:
                    problems.append(f"sm_{arch}: no portable sm_{arch} PTX for {e['file']} (the fallback for newer GPUs)")
            except ValueError as exc:
                problems.append(f"sm_{arch}: {e['file']}: {exc}")
    try:
        check_sources(manifest, folder)
        sources = "match the installed source"
    except PrecompiledError as exc:
        problems.append(str(exc))
        sources = "DO NOT match the installed source"
    attention = sorted({e["kernel"] for e in manifest["kernels"] if e["tags"].get("role") == "attention"})
    if attention and attention != [specs.attention_kernel(arch)]:
        problems.append(f"sm_{arch}: attention kernels {attention}, the claim is {specs.attention_kernel(arch)}")
    summary = {"arch": arch, "folder": str(folder), "cubins": len(manifest["kernels"]), "ptx": n_ptx,
               "attention": attention, "triton": manifest.get("triton_version"),
               "ptx_isa": sorted({e.get("ptx_version") for e in manifest["kernels"]} - {None}),
               "bytes": sum((folder / e["file"]).stat().st_size for e in manifest["kernels"]
                            if (folder / e["file"]).is_file()),
               "sources": sources}
    return summary, problems


def verify(root=None, archs=specs.DEFAULT_ARCHS, only=None):
    """(summaries, problems) of the build under root (None: the loader's search path)."""
    if root is None:
        found = available_archs()
    else:
        root = pathlib.Path(root)
        found = {int(p.name[3:]): p for p in root.glob("sm_*") if p.name[3:].isdigit()}
    summaries, problems = [], []
    for arch in archs:
        if arch not in found:
            where = root if root is not None else ", ".join(str(r) for r in cubin_roots())
            problems.append(f"sm_{arch}: no cubin folder (looked in {where})")
            continue
        summary, p = check_arch_folder(found[arch], arch, only)
        summaries.append(summary)
        problems += p
    return summaries, problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vc_attention.kernels.precompiled.verify",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("root", nargs="?", default=None, help="folder of sm_<arch>/ folders (default: the loader's)")
    parser.add_argument("--arch", type=int, nargs="+", default=list(specs.DEFAULT_ARCHS))
    parser.add_argument("--only", default=None, help="expect only the variants whose label matches (as build --only)")
    args = parser.parse_args(argv)
    summaries, problems = verify(args.root, tuple(args.arch), args.only)
    for s in summaries:
        print(f"sm_{s['arch']}: {s['cubins']} cubins ({s['bytes'] / 1e6:.1f} MB), {s['ptx']} PTX, attention "
              f"{', '.join(s['attention']) or 'none'}, Triton {s['triton']}, PTX ISA {', '.join(s['ptx_isa'])}, "
              f"sources {s['sources']} ({s['folder']})")
    for p in problems:
        print(f"PROBLEM: {p}")
    print(f"{len(summaries)} architectures checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
