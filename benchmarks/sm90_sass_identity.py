"""Is the Hopper kernel of the working tree the same machine code as at a git revision? On the CPU.

    python3 benchmarks/sm90_sass_identity.py [--rev HEAD] [--builds NAME,...] [--keep DIR]

Compiles every build of kernels/gluon that dispatch runs or a test asks for (BUILDS: ExpCast or exp2,
V-Smooth or plain V, key bias or not, V^T in key or wgmma order, the mean on the tensor cores or
not, 64-key tiles, 3 ring stages, the PTX pass on or off) for sm_90 twice, from the revision's
kernels/gluon and from the working tree's, and compares the SASS instruction by instruction
(cuobjdump from Triton's wheel). A refactoring of the kernel that is meant to change nothing must
print "identical" for every build on every Triton in use; run it once per Triton (the interpreter
or PYTHONPATH decides which). Exit status 1 if any build differs.

A build is named by keywords of compile_sm90 (kernels/gluon/launch_sm90.py); a revision from before
the kernel was split into parts (one kernels/gluon/attention_sm90.py) is compiled through its own
signature_and_constexprs with the same keywords.
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

# name -> compile_sm90 keywords. pv_perm is set per build: both column orders are dispatched
# (pv_perm_for: by Triton release) and tested.
_BASE = {
    "expcast": dict(expcast=True),
    "expcast_bias": dict(expcast=True, has_bias=True),
    "exp2": dict(expcast=False),
    "exp2_bias": dict(expcast=False, has_bias=True),
    "plain_expcast": dict(expcast=True, has_mean=False),
    "plain_expcast_bias": dict(expcast=True, has_mean=False, has_bias=True),
    "plain_exp2": dict(expcast=False, has_mean=False),
    "plain_exp2_bias": dict(expcast=False, has_mean=False, has_bias=True),
}
BUILDS = {}
for _order, _pv in (("key", False), ("wgmma", True)):
    for _name, _kw in _BASE.items():
        BUILDS[f"{_name}_{_order}"] = dict(_kw, pv_perm=_pv)
BUILDS.update({
    "expcast_wgmma_fp32_mean": dict(expcast=True, pv_perm=True, mean_mma=False),  # bit for bit the twin's
    "expcast_key_mean_mma": dict(expcast=True, pv_perm=False, mean_mma=True),
    "expcast_wgmma_no_ptx_pass": dict(expcast=True, pv_perm=True, ptx_pass=False),
    "expcast_wgmma_bn64": dict(expcast=True, pv_perm=True, block_n=64),
    "expcast_key_bn64": dict(expcast=True, pv_perm=False, block_n=64),
    "expcast_wgmma_stages3": dict(expcast=True, pv_perm=True, stages=3),
})

# Runs in a fresh process (Gluon does not build under TRITON_INTERPRET=1): the package from the
# repository root, its kernels/gluon replaced by GLUON_DIR; writes NAME.cubin into OUT.
_COMPILE = textwrap.dedent("""
    import contextlib, importlib.util, json, pathlib, sys
    root, gluon_dir, out = (pathlib.Path(a) for a in sys.argv[1:4])
    builds = json.loads(sys.argv[4])

    def package(name, path):
        spec = importlib.util.spec_from_file_location(name, path / "__init__.py",
                                                      submodule_search_locations=[str(path)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    package("vc_attention", root)
    import vc_attention.kernels  # noqa: F401
    for name in [m for m in sys.modules if m.startswith("vc_attention.kernels.gluon")]:
        del sys.modules[name]
    package("vc_attention.kernels.gluon", gluon_dir)
    try:
        from vc_attention.kernels.gluon.launch_sm90 import compile_sm90
    except ImportError:  # one-file kernel (attention_sm90.py holds the launch too)
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.experimental.gluon._runtime import GluonASTSource
        from vc_attention.kernels.gluon import attention_sm90 as A

        def compile_sm90(ptx_pass=True, **kw):
            sig, cx = A.signature_and_constexprs(**kw)
            with A.ptx_pass_installed() if ptx_pass else contextlib.nullcontext():
                return triton.compile(GluonASTSource(A.vc_attention_fwd_sm90_kernel, sig, cx),
                                      target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cx["num_warps"]))
    for name, kw in builds.items():
        (out / (name + ".cubin")).write_bytes(compile_sm90(**kw).asm["cubin"])
        print(name, flush=True)
""")


def gluon_tree(rev, dest):
    """kernels/gluon as at git revision `rev`, written into dest."""
    files = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:kernels/gluon"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    dest.mkdir(parents=True)
    for f in files:
        if f.endswith(".py"):
            (dest / f).write_bytes(subprocess.run(["git", "show", f"{rev}:kernels/gluon/{f}"], cwd=ROOT, check=True,
                                                  capture_output=True).stdout)
    return dest


def compile_all(gluon_dir, builds, out, cache):
    """Compile `builds` from gluon_dir into out/NAME.cubin, with and without the PTX pass in processes
    and caches of their own (Triton 3.6 keys its cache without the stage hook)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for with_pass in (True, False):
        group = {n: kw for n, kw in builds.items() if kw.get("ptx_pass", True) == with_pass}
        if not group:
            continue
        env["TRITON_CACHE_DIR"] = str(cache) + ("" if with_pass else "_without_pass")  # fresh: nothing reused
        p = subprocess.run([sys.executable, "-c", _COMPILE, str(ROOT), str(gluon_dir), str(out), json.dumps(group)],
                           env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"compiling {gluon_dir} failed:\n{p.stderr[-4000:]}")


def sass(cubin):
    """The instruction lines of a cubin's SASS (address, instruction, encoding), headers dropped."""
    import triton

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    text = subprocess.run([str(tool), "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith("/*")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--builds", help="comma-separated names of BUILDS (default: all)")
    ap.add_argument("--keep", help="a directory for the cubins (default: a temporary one); the revision's "
                                   "cubins found there are reused (one directory per Triton)")
    ap.add_argument("--rev-only", action="store_true", help="compile the revision's builds only")
    a = ap.parse_args()
    import triton

    names = a.builds.split(",") if a.builds else list(BUILDS)
    builds = {n: BUILDS[n] for n in names}
    work = pathlib.Path(a.keep or tempfile.mkdtemp(prefix="sm90_sass_"))
    missing = {n: kw for n, kw in builds.items() if not (work / "rev" / f"{n}.cubin").exists()}
    if missing:
        old_dir = work / "rev_gluon"
        if not old_dir.exists():
            gluon_tree(a.rev, old_dir)
        compile_all(old_dir, missing, work / "rev", work / "cache_rev")
    if a.rev_only:
        return 0
    compile_all(ROOT / "kernels" / "gluon", builds, work / "tree", work / "cache_tree")
    print(f"Triton {triton.__version__}, {a.rev} against the working tree, sm_90:")
    differ = 0
    for n in names:
        old, new = sass(work / "rev" / f"{n}.cubin"), sass(work / "tree" / f"{n}.cubin")
        if old == new:
            print(f"  {n:28s} identical ({len(new) // 2} instructions)")
        else:
            differ += 1
            first = next((i for i, (x, y) in enumerate(zip(old, new)) if x != y), min(len(old), len(new)))
            print(f"  {n:28s} DIFFERS: {len(old) // 2} -> {len(new) // 2} instructions, first at line {first}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
