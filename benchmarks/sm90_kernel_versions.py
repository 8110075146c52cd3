"""Versions of the Hopper Gluon kernel side by side on the GPU: correctness against today's Triton
twin, then speed at Wan2.2-14B 720p (V-Smooth + ExpCast, kernel alone, one process).

    python3 benchmarks/sm90_kernel_versions.py [--rev SHA ...] [--variant NAME:kw=value,... ...]

--rev loads kernels/gluon/attention_sm90.py as it was at a git revision (e.g. 7650cad: one 8-warp
partition; 954060c: warp-specialised, one-FMA ExpCast; 39bf0dc / b3900bd: the mean row by TMA,
64-key tiles; 0bafb78: 128-key tiles, the row sum on the tensor cores);
--variant times today's kernel with launch keywords (e.g. "st3:stages=3", "k64:block_n=64"). Each
version is compared with the twin at its own key-tile width (bit-identical since 0bafb78). Revisions
before 954060c write ExpCast bytes against the exact row max, today's twin against the snapped
reference point (kernels/reference/expcast.py), so their "vs twin" shows that byte difference
(~1e-3), not a bug.
Needs git (for --rev) and an sm_90 GPU. The step table of BENCHMARKS.md (third session) was
measured with this harness's development copy (results/sm90_ws_*.log).
"""
import argparse
import importlib.util
import pathlib
import subprocess
import sys
import tempfile

import torch
from triton.testing import do_bench

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sm90_gluon_check as C  # noqa: E402  (inputs, prepare)

from vc_attention.kernels import plan_v_smooth  # noqa: E402
from vc_attention.kernels.gluon import attention_sm90 as today  # noqa: E402
from vc_attention.kernels.reference import reference_vc_attention  # noqa: E402
from vc_attention.kernels.triton.attention import vc_attention_fwd  # noqa: E402


def load_revision(rev):
    """attention_sm90.py at `rev` as a module (its package-relative import made absolute)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{rev}:kernels/gluon/attention_sm90.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    return module_from_source(src, f"attention_sm90_{rev}")


def module_from_source(src, name):
    """A version of attention_sm90.py's source as a module named `name` (its package-relative imports
    made absolute; written to a temporary file, which @gluon.jit reads)."""
    src = src.replace("from ..", "from vc_attention.kernels.")
    path = pathlib.Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", nargs="*", default=[])
    ap.add_argument("--variant", nargs="*", default=[])
    a = ap.parse_args()
    variants = {"today": today.vc_attention_fwd_sm90}
    width = {"today": today.block_n_for}  # key-tile width per build: the twin runs with the same
    # V^T's column order per build (pipeline.pv_key): revisions older than pv_perm_for read key order
    order = {"today": today.pv_perm_for()}
    for rev in a.rev:
        mod = load_revision(rev)
        variants[rev] = mod.vc_attention_fwd_sm90
        width[rev] = getattr(mod, "block_n_for", lambda *_, bn=mod.BLOCK_N: bn)
        order[rev] = mod.pv_perm_for() if hasattr(mod, "pv_perm_for") else False
    for spec in a.variant:
        name, kws = spec.split(":", 1)
        kw = {k: eval(v) for k, v in (x.split("=") for x in kws.split(","))}
        variants[name] = (lambda kw: lambda *args, **k: today.vc_attention_fwd_sm90(*args, **kw, **k))(kw)
        width[name] = (lambda bn: lambda *f: bn or today.block_n_for(*f))(kw.get("block_n"))
        order[name] = order["today"]
    print(torch.cuda.get_device_name(), flush=True)
    cases = [(1, 2, 4096 + 77, None, True, True, True), (2, 3, 1000, 777, False, False, True),
             (1, 2, 333, None, True, False, False), (1, 4, 16384, None, True, True, False),
             (1, 2, 64, None, True, True, False), (1, 2, 130, None, True, True, True)]
    for B, H, N, M, vs, ec, bias in cases:
        q, k, v = C.inputs(B, H, N, M=M)
        perm = plan_v_smooth(v, num_clusters=16, iters=4).perm if vs else None
        kb = None
        if bias:
            kb = torch.zeros(B, 1, 1, N, device="cuda")
            kb[..., ::7] = -3.0
            kb[..., 5::11] = float("-inf")
        prepared = {pv: C.prepare(q, k, v, perm, vs, kb, pv_perm=pv) for pv in set(order.values())}
        twins, refs = {}, {}
        for name, fn in variants.items():
            bn = width[name](vs, bias, ec)
            ops, kb2 = prepared[order[name]]
            if (bn, order[name]) not in twins:  # the twin reads V^T in the same order (bit-identical)
                twins[bn, order[name]] = torch.full_like(q, float("nan"))
                vc_attention_fwd(*ops, twins[bn, order[name]], H, key_bias_log2=kb2, expcast=ec, block_n=bn)
            if bn not in refs:
                refs[bn] = None if N >= 5000 else reference_vc_attention(
                    q, k, v, bits=8, v_smooth=vs, expcast=ec, perm=perm, key_bias=kb, block_n=bn, dtype=torch.float64)
            twin, ref = twins[bn, order[name]], refs[bn]
            o = torch.full_like(q, float("nan"))
            fn(*ops, o, H, key_bias_log2=kb2, expcast=ec)
            torch.cuda.synchronize()
            extra = f"  vs reference {rel(o, ref):.2e} (twin {rel(twin, ref):.2e})" if ref is not None else ""
            print(f"B{B} H{H} N{N} M{M} v_smooth={int(vs)} expcast={int(ec)} bias={int(bias)} {name} ({bn} keys): "
                  f"vs twin {rel(o, twin):.2e}  NaN {int(torch.isnan(o).sum())}{extra}", flush=True)
    B, H, N = 1, 40, 75600
    q, k, v = C.inputs(B, H, N)
    plan = plan_v_smooth(v, num_clusters=64, iters=3)
    prepared = {pv: C.prepare(q, k, v, plan.perm, True, pv_perm=pv)[0] for pv in set(order.values())}
    out = torch.empty_like(q)
    flops = 4 * N * N * 128 * H
    for name, fn in variants.items():
        f = lambda fn=fn, ops=prepared[order[name]]: fn(*ops, out, H, expcast=True)  # noqa: E731
        f()
        torch.cuda.synchronize()
        ms = do_bench(f, warmup=5, rep=1000, return_mode="median")
        print(f"Wan2.2 720p V-Smooth+ExpCast {name}: {ms:.1f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
