"""VC-Attention against exact attention on video-shaped tensors: `python -m vc_attention.kernels.demo`.

Builds q, k, v for a small latent clip (frames x height x width tokens, smooth in space and time,
with a few outlier value tokens and a spiking channel per head, as in video DiTs), groups V with
k-means, and prints the error of each variant against exact attention, each row labelled with the
backend that ran it (a fallback to torch SDPA says so). No downloads. On a CUDA GPU the backend
registry picks the fastest kernel for this GPU ("auto"), timed against torch SDPA; on a CPU the
readable reference runs (or the Triton kernels through the interpreter with --backend triton and
TRITON_INTERPRET=1).
"""

import argparse
import time

import torch

from . import BACKENDS, explain_backend, plan_v_smooth, vc_attention
from .reference import exact_attention


def video_qkv(frames=4, height=16, width=24, heads=4, head_dim=128, seed=0, device="cpu",
              dtype=torch.bfloat16):
    """Tokens of a latent clip: smooth random fields over (t, y, x), projected per head."""
    g = torch.Generator().manual_seed(seed)
    t, y, x = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    pos = torch.stack([t, y, x], -1).reshape(-1, 3).float()
    freqs = torch.randn(3, 32, generator=g) * torch.tensor([0.3, 0.25, 0.25])[:, None]
    feats = torch.cat([torch.sin(pos @ freqs), torch.cos(pos @ freqs)], -1)  # [N, 64], smooth
    N = feats.shape[0]

    def project(scale):
        w = torch.randn(heads, 64, head_dim, generator=g) * scale
        return torch.einsum("nf,hfd->hnd", feats, w)[None]

    q, k, v = project(0.4), project(0.4), project(0.3)
    outliers = torch.randint(0, N, (max(1, N // 200),), generator=g)
    v[:, :, outliers] *= 10.0  # a few tokens carry large value norms
    v[0, torch.arange(heads), :, torch.randint(0, head_dim, (heads,), generator=g)] += 4.0  # spiking channel per head
    return [a.to(device=device, dtype=dtype) for a in (q, k, v)]


def sqnr_db(out, ref):
    out, ref = out.double(), ref.double()
    return (20 * torch.log10(ref.norm() / (out - ref).norm())).item()


VARIANTS = (
    ("naive 8-bit (per-channel V, exp2 + cast P)", dict(v_smooth=False, expcast=False)),
    ("V-Smooth in sequence order (no grouping)", dict(v_smooth=True, expcast=False)),
    ("V-Smooth, k-means order", dict(v_smooth=True, expcast=False, plan=True)),
    ("V-Smooth, k-means order + ExpCast-FP8", dict(v_smooth=True, expcast=True, plan=True)),
    ("exact mode (no quantisation; only the output rounds)", dict(bits=16, plan=True)),
)


def backend_label(decision) -> str:
    """The backend that ran a row; a fallback says so (SDPA is not VC-Attention's method)."""
    return f"{decision.backend} (fallback: not low-bit)" if decision.fallback else decision.backend


def run_variants(q, k, v, plan, exact, backend):
    """[(variant, backend that ran it, SQNR dB, rel L2)] of each variant against exact attention.
    The exact mode has no fast kernel: it runs where the registry sends bits=16 under "auto"."""
    rows = []
    for name, opts in VARIANTS:
        opts = dict(opts, plan=plan if opts.get("plan") else None)
        be = "auto" if opts.get("bits") == 16 else backend
        decision = explain_backend(q, k, v, backend=be, **opts)
        out = vc_attention(q, k, v, backend=be, **opts)
        err = ((out.double() - exact).norm() / exact.norm()).item()
        rows.append((name, backend_label(decision), sqnr_db(out, exact), err))
    return rows


def format_table(rows) -> str:
    lines = ["against exact attention (float64): SQNR dB, higher is better; rel L2, lower is better",
             f"{'variant':54s} {'ran on':28s} {'SQNR dB':>8s} {'rel L2':>9s}"]
    lines += [f"{name:54s} {label:28s} {sqnr:8.2f} {err:9.2e}" for name, label, sqnr, err in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--height", type=int, default=16)
    parser.add_argument("--width", type=int, default=24)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--clusters", type=int, default=32)
    parser.add_argument("--backend", default=None,
                        help=f"auto | {' | '.join(BACKENDS)} (default: auto on CUDA, else reference)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = args.backend or ("auto" if device == "cuda" else "reference")
    q, k, v = video_qkv(args.frames, args.height, args.width, args.heads, device=device)
    B, H, N, D = q.shape
    print(f"video-shaped attention: {args.frames}x{args.height}x{args.width} tokens = N {N}, "
          f"{H} heads, head dim {D}, {q.dtype}, {device}")
    print(explain_backend(q, k, v, backend=backend))
    exact = exact_attention(q, k, v, dtype=torch.float64)
    t0 = time.perf_counter()
    plan = plan_v_smooth(v, num_clusters=args.clusters, backend="auto" if device == "cuda" else "reference")
    print(f"k-means grouping: {args.clusters} clusters per head, {time.perf_counter() - t0:.2f} s")
    print(format_table(run_variants(q, k, v, plan, exact, backend)))
    if device == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:  # the precompiled cubins run without Triton; its timer does not
            print("time: not measured (Triton's do_bench cannot be imported)")
            return
        ran = backend_label(explain_backend(q, k, v, plan=plan, backend=backend))
        ms_vc = do_bench(lambda: vc_attention(q, k, v, plan=plan, backend=backend))
        ms_sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        print(f"time (lower is better): VC-Attention on {ran} {ms_vc:.3f} ms, torch SDPA {ms_sdpa:.3f} ms "
              f"(this small shape)")


if __name__ == "__main__":
    main()
