"""Probes behind BENCHMARKS.md's tenth session (issue 4): where the Hopper kernel's last percents go.

    python3 benchmarks/h200_probes.py fixed      # per-program fixed cost: H=44 (197 full waves of
                                                 # 132 SMs), M = 75,600 queries, N = 75,600 / 18,944 /
                                                 # 9,472 / 4,736 keys (and H=40), alternating rounds
    python3 benchmarks/h200_probes.py tail       # wave quantisation: one H=44 preparation launched on
                                                 # its first H' = 40..44 heads (179.09 .. 197 waves)
    python3 benchmarks/h200_probes.py clocks     # SM clock and power (nvidia-smi every 100 ms) while
                                                 # cuDNN BF16 and the kernel run back to back, 4 s each
    python3 benchmarks/h200_probes.py parts [Wan5B,Wan480p]   # each part of the pre-pass alone
    python3 benchmarks/h200_probes.py kmeans [Wan480p,Wan720p]  # each part of a grouping step alone
    python3 benchmarks/h200_probes.py prepass [Wan5B,Wan480p,Wan720p]
                                                 # the pre-pass quantisers with 4 / 8 / 16 warps: times
                                                 # and bit equality of every output

V-Smooth + ExpCast, the dispatched Gluon kernel alone (operands prepared outside the timer), random
data of benchmarks/sm90_gluon_check.py::inputs, do_bench medians. Needs an sm_90 GPU (and nvidia-smi
for `clocks`). Results: benchmarks/results/sm90_tenth_session_probes_h200_2026-11-29.log,
prepass_warps_h200_2026-11-29.log.
"""
import datetime
import math
import pathlib
import subprocess
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sm90_gluon_check as C  # noqa: E402  (inputs)

from vc_attention.kernels import pipeline as P  # noqa: E402
from vc_attention.kernels import plan_v_smooth  # noqa: E402
from vc_attention.kernels.gluon import attention_sm90 as today  # noqa: E402
from vc_attention.kernels.triton.launch import triton_launch  # noqa: E402

SHAPES = {"Wan720p": (1, 40, 75600), "HV720p": (1, 16, 111700), "Wan5B": (1, 24, 27280), "Wan480p": (1, 40, 32760)}


def prepared(H, N, M=None):
    q, k, v = C.inputs(1, H, N, M=M)
    plan = plan_v_smooth(v, num_clusters=64, iters=3)
    ops, _ = P.prepare_8bit(triton_launch, q, k, v, v_smooth=True, perm=plan.perm, pv_perm=today.pv_perm_for())
    return q, k, v, plan, ops


def alternate(fns, rounds, rep):
    """fns: {label: fn}; rounds forwards and backwards in turn -> {label: [ms per round]}."""
    res = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            res[name].append(do_bench(fns[name], warmup=3, rep=rep, return_mode="median"))
    return res


def fixed():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    M = 75600
    fns = {}
    for H, N in ((44, 75600), (44, 9472), (44, 4736), (44, 18944), (40, 75600)):
        q, _, _, _, ops = prepared(H, N, M=M)
        o = torch.empty_like(q)
        fns[(H, N)] = (lambda ops=ops, o=o, H=H: today.vc_attention_fwd_sm90(*ops, o, H, expcast=True))
        fns[(H, N)]()
    torch.cuda.synchronize()
    res = alternate(fns, 6, 60)
    for (H, N), ts in res.items():
        items = H * math.ceil(M / 128)
        t = sorted(ts)[len(ts) // 2]
        print(f"H={H} M={M} N={N} items={items} waves={items / sms:.2f} tiles={math.ceil(N / 128)} med={t:.3f} "
              f"({'/'.join(f'{x:.2f}' for x in ts)}) us/prog={1000 * t / math.ceil(items / sms):.2f}", flush=True)


def tail():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    N, HMAX = 75600, 44
    q, _, _, _, ops = prepared(HMAX, N)

    def cut(x, h):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == HMAX:
            return x[:h]
        if isinstance(x, dict):
            return {kk: cut(vv, h) for kk, vv in x.items() if kk != "mu_tf32_pairs"}
        return x

    fns = {}
    for h in (40, 41, 42, 43, 44):
        o = torch.empty(1, h, N, 128, device="cuda", dtype=torch.bfloat16)
        oh = [cut(x, h) for x in ops]
        fns[h] = (lambda oh=oh, o=o, h=h: today.vc_attention_fwd_sm90(*oh, o, h, expcast=True))
        fns[h]()
    torch.cuda.synchronize()
    res = alternate(fns, 8, 60)
    for h, ts in res.items():
        t = sum(ts) / len(ts)
        w = h * math.ceil(N / 128) / sms
        print(f"H={h} waves={w:.2f} ceil={math.ceil(w)} mean={t:.3f} ({'/'.join(f'{x:.2f}' for x in ts)}) "
              f"ms/wave={t / w:.4f} ms/ceilwave={t / math.ceil(w):.4f}", flush=True)


def clocks():
    B, H, N = SHAPES["Wan720p"]
    q, k, v, _, ops = prepared(H, N)
    o = torch.empty_like(q)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def ours():
        return today.vc_attention_fwd_sm90(*ops, o, H, expcast=True)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    ours(), cudnn()
    torch.cuda.synchronize()
    path = "/tmp/h200_probes_smi.csv"
    with open(path, "w") as log:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,"
                                "clocks_event_reasons.active", "--format=csv,noheader", "-lms", "100"], stdout=log)
        marks = []
        for _ in range(3):
            for name, fn in (("cudnn", cudnn), ("ours", ours)):
                torch.cuda.synchronize()
                t0, n = time.time(), 0
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                while time.time() - t0 < 4.0:
                    fn()
                    n += 1
                    if n % 4 == 0:
                        torch.cuda.synchronize()
                e1.record()
                torch.cuda.synchronize()
                marks.append((name, t0, time.time(), e0.elapsed_time(e1) / n))
        time.sleep(0.3)
        smi.terminate()
    rows = []
    for line in open(path):
        p = [x.strip() for x in line.split(",")]
        try:
            ts = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        except ValueError:
            continue
        rows.append((ts, float(p[1].split()[0]), float(p[2].split()[0]), float(p[3]), p[4]))
    for name, t0, t1, ms in marks:
        sel = [r for r in rows if t0 + 0.5 <= r[0] <= t1]  # the first 0.5 s of a phase left out
        if not sel:
            print(name, ms, "no samples", flush=True)
            continue
        print(f"{name:6s} {ms:8.2f} ms/call  SM clock {sum(r[1] for r in sel) / len(sel):6.0f} MHz  "
              f"power {sum(r[2] for r in sel) / len(sel):6.1f} W  temp {sel[-1][3]:.0f} C  samples {len(sel)}  "
              f"reasons {sorted({r[4] for r in sel})}", flush=True)


def prepass(shapes):
    kernels = {"quantize_qk_block_kernel", "v_block_stats_kernel", "v_quantize_kernel"}

    def launch_nw(nw):
        def f(kernel, grid, args, constexprs, num_warps, num_stages=None):
            return triton_launch(kernel, grid, args, constexprs, nw if kernel in kernels else num_warps, num_stages)
        return f

    def flat(x):
        if isinstance(x, torch.Tensor):
            return [x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x]
        if isinstance(x, dict):
            return [t for kk in sorted(x) for t in flat(x[kk])]
        if isinstance(x, (list, tuple)):
            return [t for e in x for t in flat(e)]
        return []

    for lbl in shapes:
        B, H, N = SHAPES[lbl]
        q, k, v, plan, ops = prepared(H, N)
        pf = plan.perm.reshape(B * H, N).contiguous()
        km = k.mean(dim=2, dtype=torch.float32).reshape(B * H, 128).contiguous()
        ref, res = None, {}
        for nw in (4, 8, 16):
            L = launch_nw(nw)

            def f():
                return P.prepare_8bit(L, q, k, v, v_smooth=True, perm=plan.perm, pv_perm=today.pv_perm_for())

            ts = flat(f())
            torch.cuda.synchronize()
            ref = ts if ref is None else ref
            same = all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(ts, ref))
            tq = do_bench(lambda: P.quantize_qk_blocks(L, q), warmup=5, rep=60, return_mode="median")
            tk = do_bench(lambda: P.quantize_qk_blocks(L, k, pf, km), warmup=5, rep=60, return_mode="median")
            tv = do_bench(lambda: P.quantize_v_residual(L, v, pf, True, pv_perm=today.pv_perm_for()),
                          warmup=5, rep=60, return_mode="median")
            res[nw] = do_bench(f, warmup=5, rep=100, return_mode="median")
            print(f"{lbl} nw={nw}: prepare_8bit {res[nw]:.3f} ms (Q {tq:.3f}, K quant {tk:.3f}, V {tv:.3f}) "
                  f"outputs equal to nw=4: {same}", flush=True)
        o = torch.empty_like(q)
        t = do_bench(lambda: today.vc_attention_fwd_sm90(*ops, o, H, expcast=True), warmup=3, rep=100,
                     return_mode="median")
        print(f"{lbl} kernel {t:.3f} ms; prepare_8bit share "
              + ", ".join(f"nw={nw} {100 * x / t:.1f}%" for nw, x in res.items()), flush=True)


def parts(shapes):
    """Each part of the pre-pass alone against plain copies of V (BENCHMARKS.md, eleventh session):
    where its time goes (the permutation's gather, K's mean, the quantisers' arithmetic)."""
    L = triton_launch
    pv = today.pv_perm_for()
    for lbl in shapes:
        _, H, N = SHAPES[lbl]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, H, N, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
        rp = torch.stack([torch.randperm(N, device="cuda", generator=g) for _ in range(H)]).contiguous()
        km = plan_v_smooth(v, num_clusters=64, iters=3).perm.reshape(H, N).contiguous()
        mean = P.smoothing_mean(k).reshape(H, 128).contiguous()
        rows = {
            "copy V (read + write bf16)": lambda: v.clone(),
            "gather V by a randperm (index_select)": lambda: v.index_select(2, rp[0]),
            "K smoothing_mean": lambda: P.smoothing_mean(k),
            "K mean of every 16th token": lambda: k[:, :, ::16].mean(dim=2, dtype=torch.float32),
            "quantize Q": lambda: P.quantize_qk_blocks(L, q),
            "quantize K, mean, no permutation": lambda: P.quantize_qk_blocks(L, k, None, mean),
            "quantize K, mean, randperm": lambda: P.quantize_qk_blocks(L, k, rp, mean),
            "quantize K, mean, k-means permutation": lambda: P.quantize_qk_blocks(L, k, km, mean),
            "V pre-pass, no permutation": lambda: P.quantize_v_residual(L, v, None, True, pv_perm=pv, mu_tf32=True),
            "V pre-pass, randperm": lambda: P.quantize_v_residual(L, v, rp, True, pv_perm=pv, mu_tf32=True),
            "V pre-pass, k-means permutation": lambda: P.quantize_v_residual(L, v, km, True, pv_perm=pv, mu_tf32=True),
            "whole prepare_8bit, k-means permutation": lambda: P.prepare_8bit(
                L, q, k, v, perm=km.view(1, H, N), pv_perm=pv, mu_tf32=True),
        }
        for name, f in rows.items():
            f()
            torch.cuda.synchronize()
            print(f"{lbl:8s} {name:42s} {do_bench(f, warmup=5, rep=200, return_mode='median') * 1e3:8.1f} us",
                  flush=True)
        print(f"{lbl:8s} one bf16 tensor: {H * N * 256 / 1e6:.0f} MB", flush=True)


def kmeans_parts(shapes, clusters=64):
    """The grouping step's parts alone (a warm plan_v_smooth with 2 iterations is 3 assignments, 3
    stable sorts, 2 updates and the plan's counts): which of them makes its time."""
    from vc_attention.kernels.pipeline import kmeans_assign, kmeans_update, sort_by_label

    L = triton_launch
    for lbl in shapes:
        _, H, N = SHAPES[lbl]
        g = torch.Generator(device="cuda").manual_seed(0)
        v = torch.randn(1, H, N, 128, device="cuda", generator=g).to(torch.bfloat16)
        plan = plan_v_smooth(v, num_clusters=clusters, iters=3, backend="triton")
        cen = plan.centroids.reshape(H, clusters, 128).float().contiguous()
        labels = kmeans_assign(L, v, cen)
        order, starts = sort_by_label(labels, clusters)
        rows = {
            "plan_v_smooth warm, 2 iterations": lambda: plan_v_smooth(v, init=plan, iters=2, backend="triton"),
            "kmeans_assign": lambda: kmeans_assign(L, v, cen),
            "sort_by_label": lambda: sort_by_label(labels, clusters),
            "kmeans_update": lambda: kmeans_update(L, v, order, starts, cen),
            "plan counts (scatter_add_)": lambda: torch.zeros((H, clusters), dtype=torch.int64, device="cuda")
            .scatter_add_(1, labels, torch.ones_like(labels)),
        }
        for name, f in rows.items():
            f()
            torch.cuda.synchronize()
            print(f"{lbl:8s} {name:42s} {do_bench(f, warmup=3, rep=200, return_mode='median') * 1e3:8.1f} us",
                  flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    print(torch.cuda.get_device_name(), flush=True)
    if what == "fixed":
        fixed()
    elif what == "tail":
        tail()
    elif what == "clocks":
        clocks()
    elif what == "prepass":
        prepass((sys.argv[2] if len(sys.argv) > 2 else "Wan5B,Wan480p,Wan720p").split(","))
    elif what == "kmeans":
        kmeans_parts((sys.argv[2] if len(sys.argv) > 2 else "Wan480p,Wan720p").split(","))
    elif what == "parts":
        parts((sys.argv[2] if len(sys.argv) > 2 else "Wan5B,Wan480p").split(","))
    else:
        sys.exit(__doc__)
