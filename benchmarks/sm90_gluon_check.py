"""The Hopper Gluon kernel against its portable Triton twin, on the GPU: correctness, then speed.

    python3 benchmarks/sm90_gluon_check.py [--quick] [--variants] [--out results.csv]

1. Correctness at small and odd shapes (V-Smooth or plain V, ExpCast or exp2, key bias, M != N):
   the Gluon kernel (kernels/gluon/attention_sm90.py) and the Triton twin
   (kernels/triton/attention.py) run on the same prepared operands with the same key-tile width, so
   their E4M3 bytes are the same and only fp32 summation order differs; both are also compared
   with the float64 reference of the method (reference_vc_attention) and exact attention.
2. The same at the full Wan2.2-14B 720p size for 4 heads (all query rows of 2 blocks + the last).
3. Speed, kernel alone (operands prepared outside the timer), Wan2.2-14B 720p (H=40, N=75,600):
   twin (128-key tiles, its default) and Gluon variants; torch SDPA cuDNN as the in-run anchor
   (FA4 BF16 is timed by benchmarks/attention_speed.py in the peers run).
"""
import argparse
import csv
import datetime
import sys

import torch
from triton.testing import do_bench

from vc_attention.kernels import plan_v_smooth
from vc_attention.kernels.gluon.config import block_n_for
from vc_attention.kernels.gluon.launch_sm90 import vc_attention_fwd_sm90
from vc_attention.kernels.pipeline import prepare_8bit
from vc_attention.kernels.reference import exact_attention, reference_vc_attention
from vc_attention.kernels.triton.attention import vc_attention_fwd
from vc_attention.kernels.triton.launch import triton_launch


GLUON_OPTIONS = {}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(B, H, N, D=128, M=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    M = N if M is None else M
    q = torch.randn(B, H, M, D, device="cuda", generator=g).to(torch.bfloat16)
    k = (torch.randn(B, H, N, D, device="cuda", generator=g) + 0.3).to(torch.bfloat16)
    v = torch.randn(B, H, N, D, device="cuda", generator=g)
    v[:, :, ::997] *= 12
    v += torch.linspace(-1, 2, D, device="cuda")
    return q, k, v.to(torch.bfloat16)


def prepare(q, k, v, perm, v_smooth, key_bias=None, pv_perm=False):
    """The library's own 8-bit pre-pass (kernels/pipeline.py): the operands both kernels take (pv_perm:
    V^T's columns in wgmma order, pipeline.pv_key, which both kernels read; the Hopper kernel's
    dispatch asks for gluon.config.pv_perm_for())."""
    return prepare_8bit(triton_launch, q, k, v, v_smooth=v_smooth, perm=perm, key_bias=key_bias, pv_perm=pv_perm)


def correctness(rows_out, B, H, N, M=None, v_smooth=True, expcast=True, bias=False, block_n=None, stages=4,
                rows=None):
    q, k, v = inputs(B, H, N, M=M)
    plan = plan_v_smooth(v, num_clusters=16, iters=4) if v_smooth else None
    perm = plan.perm if plan is not None else None
    key_bias = None
    if bias:
        key_bias = torch.zeros(B, 1, 1, N, device="cuda")
        key_bias[..., ::7] = -3.0
        key_bias[..., 5::11] = float("-inf")
    ops, kb2 = prepare(q, k, v, perm, v_smooth, key_bias)
    o_t = torch.full_like(q, float("nan"))
    o_g = torch.full_like(q, float("nan"))
    opts = dict(dict(block_n=block_n, stages=stages), **GLUON_OPTIONS)
    if opts["block_n"] is None:  # the kernel's own choice per build
        opts["block_n"] = block_n_for(v_smooth, bias, expcast)
    block_n = opts["block_n"]
    vc_attention_fwd(*ops, o_t, H, key_bias_log2=kb2, expcast=expcast, block_n=block_n)
    vc_attention_fwd_sm90(*ops, o_g, H, key_bias_log2=kb2, expcast=expcast, **opts)
    torch.cuda.synchronize()
    sel = slice(None) if rows is None else rows
    ref = reference_vc_attention(q[:, :, sel], k, v, bits=8, v_smooth=v_smooth, expcast=expcast, perm=perm,
                                 key_bias=key_bias, block_n=block_n, dtype=torch.float64)
    ex = exact_attention(q[:, :, sel], k, v, key_bias=key_bias, dtype=torch.float32)
    r = dict(case=f"B{B} H{H} N{N} M{q.shape[2]} vs={int(v_smooth)} ec={int(expcast)} bias={int(bias)} "
                  f"bn={block_n} st={stages}",
             gluon_vs_twin=rel(o_g[:, :, sel], o_t[:, :, sel]),
             gluon_vs_ref=rel(o_g[:, :, sel], ref), twin_vs_ref=rel(o_t[:, :, sel], ref),
             bf16_floor=rel(ref.to(torch.bfloat16), ref),
             gluon_vs_exact=rel(o_g[:, :, sel], ex), twin_vs_exact=rel(o_t[:, :, sel], ex),
             nan_g=int(torch.isnan(o_g[:, :, sel]).sum()), nan_t=int(torch.isnan(o_t[:, :, sel]).sum()))
    print("  ".join(f"{k}={v:.3e}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    rows_out.append(r)


def speed(rows_out, variants, quick):
    B, H, N, D = 1, 40, 75600, 128
    q, k, v = inputs(B, H, N)
    plan = plan_v_smooth(v, num_clusters=64, iters=3)
    flops = 4 * N * N * D * H * B
    rep = 100 if quick else 300
    qh, kh, vh = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), warmup=20, rep=rep,
                      return_mode="median")
    rows_out.append(dict(provider="SDPA cuDNN bf16", ms=ms, tflops=flops / ms / 1e9))
    print(f"SDPA cuDNN bf16: {ms:.1f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    cases = []
    for vs in (True, False):
        ops, _ = prepare(q, k, v, plan.perm if vs else None, vs)
        out = torch.empty_like(q)
        for ec in ((True, False) if vs else (False,)):
            tag = ("V-Smooth" if vs else "plain") + (" + ExpCast" if ec else " exp2")
            cases.append((f"twin bn128 {tag}", lambda ops=ops, out=out, ec=ec: vc_attention_fwd(
                *ops, out, H, expcast=ec)))
            # (key tile, ring stages): the shipped default (block_n_for) first
            grid = [(None, 4)] if not variants else [(None, 4), (64, 4), (128, 4), (128, 3)]
            for bn, st in grid:
                cases.append((f"gluon bn{bn or 'auto'} st{st} {tag}",
                              lambda ops=ops, out=out, ec=ec, bn=bn, st=st: vc_attention_fwd_sm90(
                                  *ops, out, H, expcast=ec, block_n=bn, stages=st)))
    for name, fn in cases:
        try:
            fn()
            torch.cuda.synchronize()
            ms = do_bench(fn, warmup=10, rep=rep, return_mode="median")
            rows_out.append(dict(provider=name, ms=ms, tflops=flops / ms / 1e9))
            print(f"{name}: {ms:.1f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as e:  # one failing variant must not stop the run
            rows_out.append(dict(provider=name, error=repr(e)[:300]))
            print(f"{name}: FAILED {e!r}"[:400], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__,
          datetime.date.today(), flush=True)
    rows = []
    for opts in ({"block_n": 64}, {}):  # 64-key tiles everywhere, and each build's own width
        GLUON_OPTIONS.clear()
        GLUON_OPTIONS.update(opts)
        print(opts, flush=True)
        correctness(rows, 1, 2, 333)
        correctness(rows, 2, 3, 1000, M=777, v_smooth=False, expcast=False, bias=True)
    GLUON_OPTIONS.clear()
    correctness(rows, 1, 2, 333, expcast=False)
    correctness(rows, 2, 3, 1000, M=777, v_smooth=False, expcast=False, bias=True)
    correctness(rows, 1, 2, 4096 + 77, bias=True)
    correctness(rows, 1, 2, 4096 + 77, stages=3)
    correctness(rows, 1, 2, 64)
    correctness(rows, 1, 4, 75600, rows=torch.cat([torch.arange(0, 256), torch.arange(75600 - 80, 75600)]).cuda())
    if not a.skip_speed:
        speed(rows, a.variants, a.quick)
    if a.out:
        keys = sorted({k for r in rows for k in r})
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, keys)
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
