"""One Wan2.2-14B-sized transformer block forward, BF16 attention against VC-Attention (BENCHMARKS.md).

    python3 benchmarks/block_forward.py [--n 75600] [--quick] [--out block_forward.csv]
    TRITON_INTERPRET=1 python3 benchmarks/block_forward.py --smoke     # CPU check that it runs

The block is written here with plain torch.nn (no ComfyUI), after Wan's WanAttentionBlock:
    x [1, N, 5120] bf16, time modulation e [1, 6, 5120] (adaLN shift/scale/gate),
    self-attention:  LayerNorm (no affine) -> modulate -> q, k, v Linear(5120, 5120) -> RMSNorm on
                     q and k -> RoPE (a plain 1-D rotary in fp32, cost-alike to Wan's 3-D RoPE) ->
                     attention over N tokens, 40 heads x 128 -> o Linear -> gated residual
    cross-attention: LayerNorm (affine) -> q Linear on x, k, v Linear on 512 text tokens, RMSNorm on
                     q and k -> SDPA (default backend, the same in every variant: V-Smooth is for
                     video self-attention only) -> o Linear -> residual
    FFN:             LayerNorm -> modulate -> Linear(5120, 13824) -> GELU(tanh) -> Linear(13824, 5120)
                     -> gated residual
Random weights (nn.Linear's default init), random inputs (never zeros), torch.inference_mode.

Only the self-attention call differs between the variants:
    SDPA cuDNN        torch SDPA, cuDNN backend, on [B, H, N, D] views (as ComfyUI passes them)
    SDPA flash        torch SDPA, flash backend (ComfyUI's default path)
    FA4 BF16          flash_attn.cute.interface.flash_attn_func on [B, N, H, D] (skipped if absent)
    VC V-Smooth+ExpCast / exp2   vc_attention(layout="NHD", backend="triton", plan=frozen plan)
                      (VC Hopper: backend="gluon", the sm_90 kernel):
                      a non-grouping step of the schedule (quantisers + kernel inside the timer)
    VC grouping step  plan_v_smooth(v, init=plan, iters=2) + vc_attention (a step that regroups)
    no attention      self-attention replaced by v (the cost of everything else in the block)
The frozen plan is made once, outside the timer, from the block's own value tensor (10 k-means
iterations). Each variant's block output delta (out - x) is compared with the first baseline's
(rel-L2), as a sanity check. Speedup = baseline ms / ms, baseline FA4 (cuDNN when FA4 is absent).
"""

import argparse
import os
import pathlib
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from attention_speed import (ROOT, CsvSink, Skip, Timer, env_info, finish_row, free_memory,  # noqa: E402
                             import_fa4, load_library, package_version, short_error, slug)

FULL = dict(dim=5120, heads=40, ffn=13824, n=75_600, text=512)
SMOKE = dict(dim=256, heads=2, ffn=512, n=300, text=16)


def build_block(torch, dim, heads, ffn, eps=1e-6):
    nn = torch.nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
            self.norm_q, self.norm_k = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = heads
            self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)
            self.norm1 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
            self.norm2 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
            self.norm3 = nn.LayerNorm(dim, eps=eps, elementwise_affine=True)
            self.self_attn = Attention()
            self.cross_attn = Attention()
            self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, dim))

        def forward(self, x, e, context, cos, sin, attn_fn):
            B, N, C = x.shape
            H, D = self.heads, C // self.heads
            e = (self.modulation + e).chunk(6, dim=1)
            sa = self.self_attn
            y = self.norm1(x) * (1 + e[1]) + e[0]
            q = rope(torch, sa.norm_q(sa.q(y)).view(B, N, H, D), cos, sin)
            k = rope(torch, sa.norm_k(sa.k(y)).view(B, N, H, D), cos, sin)
            v = sa.v(y).view(B, N, H, D)
            y = attn_fn(q, k, v).reshape(B, N, C)  # [B, N, H, D] in, [B, N, H, D] out
            x = x + sa.o(y) * e[2]
            ca = self.cross_attn
            y = self.norm3(x)
            L = context.shape[1]
            q = ca.norm_q(ca.q(y)).view(B, N, H, D).transpose(1, 2)
            k = ca.norm_k(ca.k(context)).view(B, L, H, D).transpose(1, 2)
            v = ca.v(context).view(B, L, H, D).transpose(1, 2)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)
            x = x + ca.o(y)
            y = self.ffn(self.norm2(x) * (1 + e[4]) + e[3])
            return x + y * e[5]

    return Block()


def rope_tables(torch, n, head_dim, device):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]  # [1, N, 1, D/2]


def rope(torch, x, cos, sin):
    """Rotary embedding on pairs (x0, x1) of the head dim, in fp32, back to x's dtype."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def attention_variants(lib, state, smoke):
    """[(name, kind, setup)]; setup() -> attn_fn(q, k, v) on [B, N, H, D] -> [B, N, H, D]."""
    torch = lib["torch"]
    F = torch.nn.functional
    vc_attention, plan_v_smooth = lib["vc_attention"], lib["plan_v_smooth"]

    def gpu_only():
        if smoke:
            raise Skip("needs CUDA (smoke run)")

    def sdpa(which):
        def setup():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            if which == "math":
                be = SDPBackend.MATH
            else:
                gpu_only()
                be = SDPBackend.CUDNN_ATTENTION if which == "cudnn" else SDPBackend.FLASH_ATTENTION

            def attn(q, k, v):
                with sdpa_kernel(be):
                    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
                return o.transpose(1, 2)

            return attn

        return setup

    def fa4():
        gpu_only()
        try:
            fa = import_fa4()
        except Exception as exc:
            raise Skip(f"FA4 not importable ({short_error(exc)})")

        def attn(q, k, v):
            r = fa(q, k, v)
            return r[0] if isinstance(r, tuple) else r

        return attn

    def vc(expcast, grouping=False, backend="triton"):
        def setup():
            if backend != "triton" and not smoke:
                from vc_attention.kernels import dispatch

                if torch.cuda.get_device_capability() != (9, 0) or not dispatch.gluon_status()[0]:
                    raise Skip("the Gluon kernel runs on Hopper (sm_90) only")
            elif backend != "triton":
                raise Skip("needs CUDA (smoke run)")

            def attn(q, k, v):
                plan = state["plan"]
                if plan is None:  # the first call makes the frozen plan (outside any timer)
                    plan = state["plan"] = plan_v_smooth(v, layout="NHD", iters=state["iters_cold"],
                                                         num_clusters=state["clusters"], backend="triton")
                if grouping:
                    plan = plan_v_smooth(v, init=plan, layout="NHD", iters=state["iters_warm"], backend="triton")
                return vc_attention(q, k, v, bits=8, v_smooth=True, expcast=expcast, plan=plan, layout="NHD",
                                    backend=backend)

            return attn

        return setup

    def none():
        return lambda q, k, v: v

    variants = [
        ("block, FA4 BF16 attention", "baseline", fa4),
        ("block, SDPA cuDNN attention", "baseline", sdpa("cudnn")),
        ("block, VC Hopper V-Smooth+ExpCast", "vc", vc(True, backend="gluon")),
        ("block, VC V-Smooth+ExpCast", "vc", vc(True)),
        ("block, VC V-Smooth exp2", "vc", vc(False)),
        ("block, VC grouping step (kmeans x2)", "vc", vc(True, grouping=True)),
        ("block, no self-attention", "aux", none),
        ("block, SDPA flash attention", "baseline", sdpa("flash")),
    ]
    if smoke:
        variants.insert(0, ("block, SDPA math attention (CPU)", "baseline", sdpa("math")))
    return variants


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=FULL["n"], help="video tokens (default 75600: Wan2.2-14B 720p)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--out", default="", help="CSV path (default benchmarks/results/block_forward_<gpu>_<date>.csv)")
    ap.add_argument("--deadline-s", type=float, default=120.0, help="stop starting variants after this")
    ap.add_argument("--smoke", action="store_true", help="tiny block on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    t_start = time.perf_counter()
    if args.smoke:
        device, cfg = torch.device("cpu"), dict(SMOKE)
        timer = Timer(torch, device, cpu_reps=1)
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA GPU: run on a CUDA GPU, or use --smoke on the CPU")
        device, cfg = torch.device("cuda"), dict(FULL, n=args.n)
        timer = Timer(torch, device, rep_ms=150.0 if args.quick else 400.0, min_reps=3 if args.quick else 5)
    lib = load_library(torch)
    info = env_info(torch, device)
    info["mode"] = "smoke" if args.smoke else ("quick" if args.quick else "full")
    out = pathlib.Path(args.out) if args.out else (
        pathlib.Path("/tmp/block_forward_smoke.csv") if args.smoke else
        ROOT / "benchmarks" / "results" / f"block_forward_{slug(info['gpu'])}_{info['date'][:10]}.csv")
    dim, H, N = cfg["dim"], cfg["heads"], cfg["n"]
    D = dim // H
    shape_name = f"block-d{dim}-h{H}-n{N}"
    print(f"gpu {info['gpu']} | torch {info['torch']} | triton {info['triton']} | commit {info['commit']} | "
          f"kernels src {info['src_hash']} | flash-attn-4 {package_version('flash-attn-4')} | {info['date']}")
    print(f"Wan-style block: dim {dim}, {H} heads x {D}, ffn {cfg['ffn']}, N={N} video tokens, "
          f"{cfg['text']} text tokens, bf16; CSV -> {out}", flush=True)

    torch.manual_seed(0)
    dtype = torch.bfloat16
    with torch.device(device):
        block = build_block(torch, dim, H, cfg["ffn"]).to(dtype).eval()
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, N, dim, device=device, generator=g).to(dtype)
    e = (0.1 * torch.randn(1, 6, dim, device=device, generator=g)).to(dtype)
    context = torch.randn(1, cfg["text"], dim, device=device, generator=g).to(dtype)
    cos, sin = rope_tables(torch, N, D, device)
    state = {"plan": None, "clusters": 8 if args.smoke else 64, "iters_cold": 1 if args.smoke else 10,
             "iters_warm": 1 if args.smoke else 2}
    attn_flops = 4.0 * N * N * D * H
    sink = CsvSink(out, info)
    rows, ref_delta = [], None
    deadline = t_start + args.deadline_s
    try:
        with torch.inference_mode():
            for name, kind, setup in attention_variants(lib, state, args.smoke):
                row = {"shape": shape_name, "B": 1, "H": H, "N": N, "D": D, "provider": name, "kind": kind}
                if time.perf_counter() > deadline:
                    row["note"] = "skipped: time budget spent"
                else:
                    t0 = time.perf_counter()
                    try:
                        attn = setup()
                        fn = lambda: block(x, e, context, cos, sin, attn)  # noqa: E731
                        delta = (fn() - x).float()
                        first_s = time.perf_counter() - t0
                        if kind != "aux":
                            if ref_delta is None:
                                ref_delta = delta
                                row["note"] = "delta reference"
                            else:
                                row["rel_l2"] = ((delta - ref_delta).norm() / ref_delta.norm()).item()
                                row["cosine"] = torch.nn.functional.cosine_similarity(
                                    delta.flatten(), ref_delta.flatten(), dim=0).item()
                        delta = None
                        row["ms"] = timer(fn)
                        if first_s > 5.0:
                            row["note"] = (row.get("note", "") + f"; first call {first_s:.1f} s").strip("; ")
                    except Skip as exc:
                        row["note"] = f"skipped: {exc}"
                    except Exception as exc:
                        row["note"] = "ERROR " + short_error(exc)
                        if args.verbose:
                            traceback.print_exc()
                    finally:
                        fn = attn = None
                        free_memory(torch)
                finish_row(row, next((r for r in rows if r["kind"] == "baseline" and "ms" in r), None),
                           rows, sink)
                print(f"  {name:<40s} " + (f"{row['ms']:10.3f} ms" if "ms" in row else " " * 13)
                      + (f"  [{row['note']}]" if row.get("note") else ""), flush=True)
    finally:
        sink.close()

    base = next((r for r in rows if r["kind"] == "baseline" and "ms" in r), None)
    none = next((r for r in rows if r["kind"] == "aux" and "ms" in r), None)
    print("\n" + "=" * 112)
    print(f"{'variant':<40s} {'ms':>9s} {'speedup':>8s} {'attn ms':>8s} {'attn TF/s':>9s} {'rel-L2':>9s}  note")
    print("-" * 112)
    for r in rows:
        ms = f"{r['ms']:9.2f}" if "ms" in r else f"{'-':>9s}"
        sp = f"{r['speedup']:7.3f}x" if "speedup" in r else f"{'':>8s}"
        att = tf = ""
        if none is not None and "ms" in r and r["kind"] != "aux":
            a = r["ms"] - none["ms"]
            att = f"{a:.1f}"
            tf = f"{attn_flops / (a * 1e-3) / 1e12:.0f}" if a > 0 else ""
        rel = f"{r['rel_l2']:9.2e}" if "rel_l2" in r else f"{'':>9s}"
        print(f"{r['provider']:<40s} {ms} {sp} {att:>8s} {tf:>9s} {rel}  {r.get('note', '')}")
    if base is not None:
        print(f"speedup = {base['provider']} ms / ms; attn ms = block ms - 'no self-attention' ms "
              f"(self-attention incl. its quantisers); paper: 1.13x end to end on H200")
    print(f"total {time.perf_counter() - t_start:.1f} s; CSV written to {out}")


if __name__ == "__main__":
    main()
