"""Does a change to the Triton kernels' source change their machine code? Compiles the same builds
from two copies of the package (no GPU: triton.compile for a GPUTarget) and compares the SASS text
(cuobjdump -sass from Triton's own bin folder) build by build.

    python benchmarks/triton_sass_identity.py [--before REV_OR_DIR] [--after DIR] [--quick] [--out FILE]

before: a git revision of this repository (default HEAD: the committed kernels) or a folder holding a
copy of the package; after: a folder (default: this working tree). The builds (BUILDS): the
portable kernel (kernels/triton/attention.py) as kernels/precompiled/specs.py builds it (128 x 128
tiles, 8 warps, 3 stages, every V-Smooth / bias / ExpCast combination at head dim 128, one at 64),
and the mma.sync kernel (attention_mma.py) with its default tiles and its launch options, each for
sm_89, sm_90 and sm_120, specialised as Triton's JIT does (pointers 16-byte aligned, unit last
stride). A build whose option the `before` copy does not have (a constexpr it lacks) is compared only
where the option is off. Exit status 1 when any build differs (a refactor that should change nothing).
Needs a Triton with the NVIDIA backend (3.8 or 3.9 here); one compiler process at a time.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARCHS = (89, 90, 120)
PORTABLE_PTRS = dict(Q="i8", QS="fp32", QBAD="i8", K="i8", KS="fp32", KBAD="i8", VT="fp8e4nv", ONES="fp8e4nv", VS="fp32",
                     MU="fp32", BIAS="fp32", O="bf16")


def builds(quick=False):
    """[(label, kernel, module, pointers, constexprs, num_warps, num_stages, arch)]."""
    out = []
    flags = [(m, b, e) for m in (True, False) for b in (False, True) for e in (False, True)]
    if quick:
        flags = [(True, False, False), (True, True, True)]
    for arch in ARCHS:
        for D, (mean, bias, ec) in [(128, f) for f in flags] + [(64, (True, False, True))]:
            ptrs = dict(PORTABLE_PTRS, MU="fp32" if mean else None, BIAS="fp32" if bias else None)
            c = dict(HEAD_DIM=D, BLOCK_M=128, BLOCK_N=128, QK_BLK=128, V_BLK=128, HAS_MEAN=mean, HAS_BIAS=bias,
                     EXPCAST=ec, BETA=-0.35, SOFTWARE_ROUNDING=False, QK_FP8=False,
                     PV_IMPRECISE_ACC=128 if mean else 32, PV_PERM=False)
            out.append((f"portable sm_{arch} D{D} mean{int(mean)} bias{int(bias)} expcast{int(ec)}",
                        "vc_attention_fwd_kernel", "attention", ptrs, c, 8, 3, arch))
            mc = dict(HEAD_DIM=D, BLOCK_M=128, BLOCK_N=64, RUN_TILES=2, QK_BLK=128, V_BLK=128, HAS_MEAN=mean,
                      HAS_BIAS=bias, EXPCAST=ec, BETA=-0.35, SOFTWARE_ROUNDING=False, PV_ACC16=True,
                      ROWSUM_CUDA=False)
            for fma in (False, True):
                out.append((f"mma sm_{arch} D{D} mean{int(mean)} bias{int(bias)} expcast{int(ec)} exp2_fma{int(fma)}",
                            "vc_attention_mma_fwd_kernel", "attention_mma", ptrs, dict(mc, EXP2_FMA=fma), 8, 3, arch))
        if arch == 89 or quick:
            continue
        base = dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=64, RUN_TILES=2, QK_BLK=128, V_BLK=128, HAS_MEAN=True,
                    HAS_BIAS=False, EXPCAST=False, BETA=-0.35, SOFTWARE_ROUNDING=False, PV_ACC16=True,
                    ROWSUM_CUDA=False, EXP2_FMA=False)
        ptrs = dict(PORTABLE_PTRS, BIAS=None)
        for name, opts, warps, stages in (("rowsum_cuda", dict(ROWSUM_CUDA=True), 8, 3),
                                          ("fp32pv", dict(PV_ACC16=False), 8, 3),
                                          ("bn32_run4", dict(BLOCK_N=32, RUN_TILES=4), 8, 3),
                                          ("stages2", {}, 8, 2)):
            out.append((f"mma sm_{arch} option {name}", "vc_attention_mma_fwd_kernel", "attention_mma", ptrs,
                        dict(base, **opts), warps, stages, arch))
    return out


WORKER = textwrap.dedent("""
    import hashlib, importlib, importlib.util, inspect, json, pathlib, subprocess, sys, tempfile
    root = pathlib.Path(sys.argv[1]); todo = json.loads(sys.argv[2]); keep = sys.argv[3]
    spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    for label, kernel, module, ptrs, consts, warps, stages, arch in todo:
        fn = getattr(importlib.import_module("vc_attention.kernels.triton." + module), kernel)
        params = inspect.signature(fn.fn).parameters
        consts = dict(consts)
        for name in [n for n in consts if n not in params]:  # an option this copy does not have
            if consts.pop(name):
                print(json.dumps({"label": label, "skip": f"no {name} here"}), flush=True)
                break
        else:
            names = list(params)
            consts.update({n: p.default for n, p in params.items()
                           if p.default is not inspect.Parameter.empty and n not in consts})
            consts["stride_od"] = 1
            sig, attrs = {}, {}
            for i, n in enumerate(names):
                if n in consts:
                    sig[n] = "constexpr"
                elif n in ptrs:
                    if ptrs[n] is None:
                        sig[n] = "constexpr"; consts[n] = None
                    else:
                        sig[n] = "*" + ptrs[n]; attrs[(i,)] = [["tt.divisibility", 16]]
                else:
                    sig[n] = "i32"
                    if n in ("stride_ob", "stride_oh", "stride_om", "NPAD"):
                        attrs[(i,)] = [["tt.divisibility", 16]]
            ck = triton.compile(ASTSource(fn, sig, {(names.index(n),): v for n, v in consts.items()}, attrs),
                                target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(ck.asm["cubin"]); f.flush()
                sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
            body = "\\n".join(l for l in sass.splitlines() if l.strip().startswith("/*"))  # the instructions only
            if keep:
                (pathlib.Path(keep) / (label.replace(" ", "_") + ".sass")).write_text(body)
            print(json.dumps({"label": label, "sha": hashlib.sha256(body.encode()).hexdigest()[:16],
                              "instructions": body.count(";")}), flush=True)
""")


def materialise(before, tmp):
    """A folder holding the package at `before` (a folder as is, or a git revision exported)."""
    if pathlib.Path(before).is_dir():
        return pathlib.Path(before)
    dest = pathlib.Path(tmp) / "before"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", before], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def compile_all(root, todo, keep=""):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, "-c", WORKER, str(root), json.dumps(todo), keep], env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    return {r["label"]: r for r in map(json.loads, p.stdout.strip().splitlines())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="HEAD", help="git revision or folder (default HEAD)")
    ap.add_argument("--after", default=str(ROOT), help="folder (default: this working tree)")
    ap.add_argument("--quick", action="store_true", help="two flag combinations per kernel and arch")
    ap.add_argument("--keep", default="", help="write every build's SASS into this folder (before/, after/)")
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    ap.add_argument("--only", default=None, help="regex on the build labels")
    args = ap.parse_args()
    todo = builds(args.quick)
    if args.only:
        import re

        todo = [b for b in todo if re.search(args.only, b[0])]
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        before = materialise(args.before, tmp)
        got = {}
        for side, root in (("before", before), ("after", pathlib.Path(args.after))):
            keep = ""
            if args.keep:
                keep = str(pathlib.Path(args.keep) / side)
                pathlib.Path(keep).mkdir(parents=True, exist_ok=True)
            got[side] = compile_all(root, todo, keep)
    lines = [f"SASS identity, before `{args.before}` against after `{args.after}` (Triton {triton.__version__}, "
             f"{len(todo)} builds):\n", "| build | before | after | same |", "|---|---|---|---|"]
    differ = skipped = 0
    for label, *_ in todo:
        b, a = got["before"].get(label, {}), got["after"].get(label, {})
        if "skip" in b or "skip" in a:
            lines.append(f"| {label} | {b.get('skip', b.get('sha'))} | {a.get('skip', a.get('sha'))} | not compared |")
            skipped += 1
            continue
        same = b.get("sha") == a.get("sha")
        differ += not same
        lines.append(f"| {label} | {b.get('sha')} ({b.get('instructions')}) | {a.get('sha')} ({a.get('instructions')}) | "
                     f"{'yes' if same else '**no**'} |")
    lines.append(f"\n{len(todo) - differ - skipped} builds identical, {differ} differ, {skipped} not comparable "
                 f"(hash: sha256 of the SASS instruction lines; in brackets the instruction count).")
    text = "\n".join(lines)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
