"""Alternating A/B timing of the Hopper kernel: a git revision's against the working tree's, one run.

    python3 benchmarks/sm90_ab.py [--rev HEAD] [--shapes wan14b,wan480] [--rounds 3] [--exp2]
                                  [--variant NAME:key=value,...] ...

At each shape: V-Smooth (+ ExpCast, or exp2 with --exp2) on operands prepared once by the working
tree's pre-pass, as dispatch prepares them (V^T in the column order config.pv_perm_for picks); the
kernel alone, triton.testing.do_bench medians. Every round times every kernel, the order reversed
from one round to the next (the GPU's clock drifts by 1-2% over a minute); reported: the mean of
the rounds, each round's value, and the ratio to the revision's kernel. Before timing, each
kernel's output is compared with the revision's bit for bit ("same bits" or the largest
difference). --variant adds the working tree's kernel with launch keywords (e.g.
"fp32mean:mean_mma=False", "st3:stages=3"). Needs git and an sm_90 GPU.

The revision's kernels/gluon is loaded as a package of its own beside the working tree's
(vc_attention.kernels.gluon_<rev>), so its relative imports reach the working tree's pipeline; a
revision from before the kernel was split into parts has its host function in attention_sm90.py.
"""
import argparse
import importlib
import importlib.util
import pathlib
import subprocess
import sys
import tempfile

import torch
from triton.testing import do_bench

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sm90_gluon_check as C  # noqa: E402  (inputs)

from vc_attention.kernels import plan_v_smooth  # noqa: E402
from vc_attention.kernels.gluon import config, launch_sm90  # noqa: E402
from vc_attention.kernels.pipeline import prepare_8bit  # noqa: E402
from vc_attention.kernels.triton.launch import triton_launch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPES = {"wan14b": ("Wan2.2-14B 720p", 1, 40, 75600), "wan480": ("Wan 480p", 1, 40, 32760),
          "hv15": ("HunyuanVideo-1.5 720p", 1, 16, 111700), "wan5b": ("Wan2.2-5B 720p", 1, 24, 27280)}


def revision_launch(rev):
    """The host function vc_attention_fwd_sm90 of kernels/gluon at git revision `rev`."""
    sha = subprocess.run(["git", "rev-parse", "--short=12", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    name = f"gluon_{sha}"
    pkg_dir = pathlib.Path(tempfile.mkdtemp()) / name  # @gluon.jit reads its source from a file
    pkg_dir.mkdir()
    files = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:kernels/gluon"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        if f.endswith(".py"):
            (pkg_dir / f).write_bytes(subprocess.run(["git", "show", f"{rev}:kernels/gluon/{f}"], cwd=ROOT,
                                                     check=True, capture_output=True).stdout)
    full = f"vc_attention.kernels.{name}"
    spec = importlib.util.spec_from_file_location(full, pkg_dir / "__init__.py",
                                                  submodule_search_locations=[str(pkg_dir)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[full] = mod
    spec.loader.exec_module(mod)
    host = "launch_sm90" if (pkg_dir / "launch_sm90.py").exists() else "attention_sm90"
    return sha, importlib.import_module(f"{full}.{host}").vc_attention_fwd_sm90


def parse_variant(text):
    """"NAME:key=value,..." -> (NAME, {key: value}) with Python literals for the values."""
    import ast

    name, _, rest = text.partition(":")
    kw = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        kw[key.strip()] = ast.literal_eval(value.strip())
    return name, kw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--shapes", default="wan14b,wan480")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--exp2", action="store_true", help="the exp2 path instead of ExpCast")
    ap.add_argument("--variant", action="append", default=[])
    a = ap.parse_args()
    import triton

    sha, old = revision_launch(a.rev)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    expcast = not a.exp2
    kernels = [(sha, old, {}), ("tree", launch_sm90.vc_attention_fwd_sm90, {})]
    kernels += [(name, launch_sm90.vc_attention_fwd_sm90, kw) for name, kw in map(parse_variant, a.variant)]
    for key in a.shapes.split(","):
        label, B, H, N = SHAPES[key]
        q, k, v = C.inputs(B, H, N)
        plan = plan_v_smooth(v, num_clusters=64, iters=3)
        ops, _ = prepare_8bit(triton_launch, q, k, v, v_smooth=True, perm=plan.perm, pv_perm=config.pv_perm_for(),
                              mu_tf32=True)
        outs, fns = {}, {}
        for name, fn, kw in kernels:
            out = torch.empty_like(q)
            fns[name] = (lambda fn=fn, out=out, kw=kw: fn(*ops, out, H, expcast=expcast, **kw))
            fns[name]()
            outs[name] = out
        torch.cuda.synchronize()
        same = {}
        for name in fns:
            d = (outs[name].float() - outs[sha].float()).abs().max().item()
            same[name] = "same bits" if torch.equal(outs[name], outs[sha]) else f"max |diff| {d:.3g}"
        times = {name: [] for name in fns}
        for rnd in range(a.rounds):
            for name in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
                times[name].append(do_bench(fns[name], warmup=3, rep=150 if N > 50000 else 80, return_mode="median"))
        base = sum(times[sha]) / len(times[sha])
        print(f"{label} ({'ExpCast' if expcast else 'exp2'}, {a.rounds} rounds):", flush=True)
        for name, t in times.items():
            mean = sum(t) / len(t)
            print(f"  {name:14s} {mean:8.2f} ms ({' / '.join(f'{x:.2f}' for x in t)})  {mean / base:.4f}x {sha}"
                  f"  {same[name]}", flush=True)


if __name__ == "__main__":
    main()
