"""V-Smooth and ExpCast measured on attention probes built from real clips (FIDELITY.md).

One command (CPU is enough; ~11 min on 2 cores with the defaults), in a venv with the package
installed (``pip install -e ".[test]"``: the probes need Pillow) and matplotlib for the plots:

    python benchmarks/fidelity/measure.py

Writes ``benchmarks/results/fidelity_*.csv`` and ``benchmarks/results/fidelity_*.png``.
``--quick`` runs a small configuration (a smoke test). The probes are ``vc_attention.kernels.fidelity.probes``,
the simulated variants and error measures ``vc_attention.kernels.fidelity.simulate``.

What is measured (per head, then averaged; see FIDELITY.md for the tables and the caveats):

1. ``fidelity_energy.csv``: share of block energy removed by the 128-row block mean,
   sum_j n_j ||mu_j||^2 / sum_t ||v_t||^2 (pooled over a head) and the mean of the per-block shares,
   for sequential order, a fixed 2x8x8 spatiotemporal cube order, k-means order (plan_v_smooth, 64
   clusters, 10 Lloyd iterations) and a balanced k-means (same, with equal cluster sizes).
2. ``fidelity_vquant.csv``: V error after V-Smooth's per-channel E4M3 residual quantisation (block
   means stored in bf16), as relative MSE ||V - V_q||^2 / ||V||^2 and relative RMSE (its root), for
   plain per-channel FP8 (no demeaning), sequential, Hadamard-rotated V (sequential), cube, k-means,
   balanced k-means.
3. ``fidelity_output.csv``: attention-output error against exact float64 attention on a query subset
   (4 blocks of 128 contiguous queries per head, all keys): relative L2, cosine, SQNR dB, and the split
   O - O_q = E_P + E_V with E_P = (P - P_q) V, E_V = P_q (V - V_q) (METHOD.md 3.9), for: naive FP8,
   V-Smooth sequential (demean only), V-Smooth k-means with exp2+cast P, with ExpCast P, with the
   decorrelated ExpCast (per-key log offsets), a SageAttention-1-like baseline, and P-path-only
   diagnostics (exact Q/K and V) of the ExpCast deficit (tail underflow, subnormal band, headroom).
4. ``fidelity_expcast_tv.csv``: Proposition 3.1 on every query row of shorter probes of the same
   token density (2 latent frames, 24 heads per clip: 243K rows): TV(softmax, ExpCast) and TV(softmax, exp2+cast), underflow mass tau,
   bound checks, byte agreement with the exact cast.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import platform
import time
from dataclasses import asdict

import torch

from vc_attention.kernels.fidelity.probes import CLIPS, ProbeConfig, build_probe
from vc_attention.kernels.fidelity.simulate import (
    CONFIGS, expcast_rows, make_orders, output_metrics, query_blocks, simulate, synthetic_agreement, v_quant_error,
    energy_share, hadamard, pyplot, write_csv, TV_BOUND)
from vc_attention.kernels.reference.attention import reference_vc_attention

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clips", default=",".join(CLIPS))
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--latent-frames", type=int, default=6)
    ap.add_argument("--patch", type=int, default=8)
    ap.add_argument("--sigma", type=float, default=0.0)
    ap.add_argument("--query-blocks", type=int, default=4)
    ap.add_argument("--tv-heads", type=int, default=24, help="heads per clip whose every row enters the TV study")
    ap.add_argument("--tv-latent-frames", type=int, default=2, help="latent frames of the TV probes")
    ap.add_argument("--quick", action="store_true", help="small smoke configuration")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tag", default="", help="suffix for the output files")
    args = ap.parse_args(argv)
    if args.quick:
        args.heads, args.latent_frames, args.patch, args.query_blocks, args.tv_heads, args.tv_latent_frames = 2, 4, 16, 2, 2, 4
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"_{args.tag}" if args.tag else ""
    stamp = {"date": datetime.date.today().isoformat(), "machine": f"CPU {platform.machine()} "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}"}
    print(stamp)
    energy_rows, vq_rows, out_rows, tv_rows, block_shares = [], [], [], [], {}
    tv_all = {}
    agree_tot = {}
    H128 = hadamard(128)
    t_start = time.time()
    for clip in args.clips.split(","):
        t0 = time.time()
        cfg = ProbeConfig(clip=clip, heads=args.heads, latent_frames=args.latent_frames,
                          patch=args.patch, sigma=args.sigma)
        probe = build_probe(cfg)
        N = probe.n
        print(f"[{clip}] grid {probe.grid} N={N} built in {time.time() - t0:.1f}s", flush=True)
        t0 = time.time()
        orders = make_orders(probe)
        print(f"  orders in {time.time() - t0:.1f}s", flush=True)
        base = {"clip": clip, "N": N, "grid": "x".join(map(str, probe.grid)), "sigma": cfg.sigma}
        qidx = query_blocks(N, args.query_blocks, seed=7)
        for h in range(args.heads):
            v = probe.v[0, h]
            row = {**base, "head": h}
            for name, perm in orders.items():
                pooled, per_block = energy_share(v[perm[h]])
                row[f"share_{name}"] = pooled
                row[f"blockmean_share_{name}"] = per_block.mean().item()
                block_shares.setdefault(name, []).append(per_block)
            energy_rows.append(row)
            vrow = {**base, "head": h}
            vrow["relmse_plain_fp8"], vrow["relrmse_plain_fp8"] = v_quant_error(v, demean_blocks=False)
            vrow["relmse_sequential"], vrow["relrmse_sequential"] = v_quant_error(v)
            vrow["relmse_hadamard"], vrow["relrmse_hadamard"] = v_quant_error(v, rotate=H128)
            for name in ("cube", "kmeans", "balanced_kmeans"):
                vrow[f"relmse_{name}"], vrow[f"relrmse_{name}"] = v_quant_error(v[orders[name][h]])
            vq_rows.append(vrow)
        print(f"  energy/vquant done {time.time() - t_start:.0f}s", flush=True)

        # attention outputs: query subset, all keys, one head at a time
        t0 = time.time()
        qs = probe.q[0, :, qidx]
        for h in range(args.heads):
            q, k, v = qs[h], probe.k[0, h], probe.v[0, h]
            o_ref = (torch.softmax(q.double() @ k.double().T * q.shape[-1] ** -0.5, -1) @ v.double())
            p_cache = {}
            for label, mm, qk, order, v_exact in CONFIGS:
                perm = orders[order][h]
                pq, vq, vp = simulate(q, k, v, perm, method=mm, qk=qk, v_exact=v_exact)
                o = pq.double() @ vq.double()
                if order not in p_cache:
                    p_cache[order] = torch.softmax(q.double() @ k[perm].double().T * q.shape[-1] ** -0.5, -1)
                p = p_cache[order]
                e_p = (p - pq.double()) @ vp.double()
                e_v = pq.double() @ (vp.double() - vq.double())
                out_rows.append({**base, "head": h, "qk": qk, "v": "exact" if v_exact else "quantised",
                                 "method": label, **output_metrics(o_ref, o, e_p, e_v)})
            del p_cache
            if h == 0:  # cross-check the dense simulation against the library's reference pipeline
                for m, kw in (("naive", dict(v_smooth=False, expcast=False, perm=None)),
                              ("vs_exp2", dict(v_smooth=True, expcast=False, perm=orders["kmeans"][h][None, None])),
                              ("vs_expcast", dict(v_smooth=True, expcast=True, perm=orders["kmeans"][h][None, None]))):
                    o_lib = reference_vc_attention(q[None, None], k[None, None], v[None, None], **kw)[0, 0]
                    r = next(x for x in out_rows if x["clip"] == clip and x["head"] == h and x["method"] == m)
                    r["lib_rel_l2"] = output_metrics(o_ref, o_lib)["rel_l2"]
                    r["lib_vs_sim_rel"] = ((o_lib.double() - o_ref).norm() / o_ref.norm()).item() / r["rel_l2"] - 1
            print(f"  head {h}: " + " ".join(f"{x['method']}={x['sqnr_db']:.1f}" for x in out_rows
                                              if x["head"] == h and x["clip"] == clip), flush=True)
        print(f"  outputs in {time.time() - t0:.0f}s", flush=True)

    # ExpCast Proposition 3.1: every row of shorter probes (real token density, 2 latent frames,
    # tv_heads heads per clip) so that >= 200K rows fit the CPU budget
    for clip in args.clips.split(","):
        t0 = time.time()
        tp = build_probe(ProbeConfig(clip=clip, heads=args.tv_heads, latent_frames=args.tv_latent_frames,
                                     patch=args.patch, sigma=args.sigma))
        for h in range(args.tv_heads):
            rows, agree = expcast_rows(tp.q[0, h], tp.k[0, h])
            for n, t in rows.items():
                tv_all.setdefault(n, []).append(t)
            for n, c in agree.items():
                agree_tot[n] = agree_tot.get(n, 0) + c
        print(f"[{clip}] TV: {args.tv_heads} heads x N={tp.n} rows in {time.time() - t0:.0f}s", flush=True)

    # ---- summaries
    tv = {n: torch.cat(v).double() for n, v in tv_all.items()}
    nrows = tv["tv_expcast"].numel()
    bound = TV_BOUND + tv["tau_sub"]
    no_under = tv["tau_sub"] == 0
    qf = lambda t, x: torch.quantile(t[torch.randperm(t.numel())[:1_000_000]] if t.numel() > 1_000_000 else t, x).item()  # noqa: E731
    for name in ("tv_expcast", "tv_exp2cast"):
        t = tv[name]
        tv_rows.append({"quantity": name, "rows": nrows, "mean": t.mean().item(), "p50": qf(t, 0.5),
                        "p99": qf(t, 0.99), "max": t.max().item(),
                        "rows_over_0.0364": int((t >= TV_BOUND).sum()),
                        "rows_over_0.0364+tau": int((t >= bound).sum())})
    for name in ("tau0", "tau_sub"):
        t = tv[name]
        tv_rows.append({"quantity": name, "rows": nrows, "mean": t.mean().item(), "p50": qf(t, 0.5),
                        "p99": qf(t, 0.99), "max": t.max().item(),
                        "rows_tau_zero": int((t == 0).sum())})
    tv_rows.append({"quantity": "tv_expcast_rows_without_underflow", "rows": int(no_under.sum()),
                    "mean": tv["tv_expcast"][no_under].mean().item() if no_under.any() else float("nan"),
                    "max": tv["tv_expcast"][no_under].max().item() if no_under.any() else float("nan")})
    agree_row = {"quantity": "byte_agreement_probe", "rows": nrows,
                 "normal_equal_share": agree_tot["normal_equal"] / max(1, agree_tot["normal_total"]),
                 "normal_elements": agree_tot["normal_total"],
                 "subnormal_band_equal_share": agree_tot["sub_equal"] / max(1, agree_tot["sub_total"]),
                 "subnormal_band_elements": agree_tot["sub_total"],
                 "normal_off_by_more_than_one": agree_tot["off_by_more"]}
    tv_rows.append(agree_row)
    for name, d in synthetic_agreement().items():
        tv_rows.append({"quantity": f"byte_agreement_uniform_{name}", **d})
    for r in tv_rows:
        r.update(stamp)

    for rows in (energy_rows, vq_rows, out_rows):
        for r in rows:
            r.update(stamp)
    write_csv(out / f"fidelity_energy{tag}.csv", energy_rows)
    write_csv(out / f"fidelity_vquant{tag}.csv", vq_rows)
    write_csv(out / f"fidelity_output{tag}.csv", out_rows)
    write_csv(out / f"fidelity_expcast_tv{tag}.csv", tv_rows)
    cfg_row = asdict(ProbeConfig(heads=args.heads, latent_frames=args.latent_frames, patch=args.patch,
                                 sigma=args.sigma))
    cfg_row.pop("clip")
    write_csv(out / f"fidelity_config{tag}.csv", [{**cfg_row, "clips": args.clips,
                                                   "query_blocks": args.query_blocks, **stamp,
                                                   "total_s": round(time.time() - t_start)}])
    summarise(energy_rows, vq_rows, out_rows, tv_rows)
    plots(out, tag, block_shares, vq_rows, out_rows, tv)
    print(f"total {time.time() - t_start:.0f}s; wrote {out}/fidelity_*{tag}.csv/png")


def _mean(rows, key, **filt):
    xs = [r[key] for r in rows if all(r.get(a) == b for a, b in filt.items()) and key in r]
    return sum(xs) / len(xs) if xs else float("nan")


def summarise(energy_rows, vq_rows, out_rows, tv_rows):
    print("\n== block energy removed (pooled share, mean over heads) ==")
    for n in ("sequential", "cube", "kmeans", "balanced_kmeans"):
        print(f"  {n:16s} {100 * _mean(energy_rows, f'share_{n}'):6.2f}%   per-block mean "
              f"{100 * _mean(energy_rows, f'blockmean_share_{n}'):6.2f}%")
    print("== V relative MSE (mean over heads) and ratio to sequential ==")
    seq = _mean(vq_rows, "relmse_sequential")
    for n in ("plain_fp8", "sequential", "hadamard", "cube", "kmeans", "balanced_kmeans"):
        m = _mean(vq_rows, f"relmse_{n}")
        print(f"  {n:16s} {m:.4e}  x{m / seq:.3f}")
    print("== attention output (mean over heads) ==")
    for label, *_ in CONFIGS:
        s = _mean(out_rows, "sqnr_db", method=label)
        print(f"  {label:12s} SQNR {s:6.2f} dB  relL2 {_mean(out_rows, 'rel_l2', method=label):.3e}"
              f"  cos {_mean(out_rows, 'cosine', method=label):.7f}"
              f"  value share {100 * _mean(out_rows, 'value_share', method=label):5.1f}%")
    print("== ExpCast TV ==")
    for r in tv_rows:
        print("  ", {k: v for k, v in r.items() if k not in ("date", "machine")})


def plots(out, tag, block_shares, vq_rows, out_rows, tv):
    plt = pyplot()
    if plt is None:
        return

    names = ["sequential", "cube", "kmeans", "balanced_kmeans"]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=90)
    bins = torch.linspace(0, 1, 51).numpy()
    for n in names:
        x = torch.cat(block_shares[n]).numpy()
        ax.hist(x, bins=bins, histtype="step", lw=1.5, density=True, label=f"{n} (mean {100 * x.mean():.1f}%)")
    ax.set_xlabel("share of a 128-row block's energy removed by its mean")
    ax.set_ylabel("density (all blocks, heads, clips)")
    ax.set_title("V-Smooth block energy removed, by token order (our probes)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"fidelity_energy{tag}.png")
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=90)
    vn = ["plain_fp8", "sequential", "hadamard", "cube", "kmeans", "balanced_kmeans"]
    seq = _mean(vq_rows, "relmse_sequential")
    vals = [_mean(vq_rows, f"relmse_{n}") for n in vn]
    axes[0].bar(range(len(vn)), [v / seq for v in vals], color="tab:blue")
    paper = {"sequential": 1.0, "hadamard": 1.0, "cube": 1.74 / 1.81, "kmeans": 1.28 / 1.81,
             "balanced_kmeans": 1.17 / 1.81}
    axes[0].scatter([vn.index(k) for k in paper], list(paper.values()), color="k", marker="_", s=300,
                    zorder=3, label="paper (ratio)")
    axes[0].set_xticks(range(len(vn)))
    axes[0].set_xticklabels(vn, rotation=30, ha="right", fontsize=8)
    axes[0].set_ylabel("V rel. MSE / sequential")
    axes[0].set_title("V quantisation error (E4M3 residual)", fontsize=9)
    axes[0].legend(fontsize=8)
    labels = [c[0] for c in CONFIGS]
    for j, key in enumerate(("sqnr_db", "sqnr_EP_db")):
        vals = [_mean(out_rows, key, method=m) for m in labels]
        axes[1].bar([i + 0.4 * j for i in range(len(labels))], vals, width=0.4,
                    label="total" if j == 0 else "P term only (E_P)")
    axes[1].set_xticks([i + 0.2 for i in range(len(labels))])
    axes[1].set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    axes[1].set_ylabel("output SQNR vs exact (dB)")
    axes[1].set_title("attention output error by method", fontsize=9)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"fidelity_errors{tag}.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=90)
    b = torch.linspace(0, 0.06, 61).numpy()
    for n, lab in (("tv_expcast", "ExpCast"), ("tv_exp2cast", "exp2 + cast")):
        t = tv[n].numpy()
        ax.hist(t, bins=b, histtype="step", lw=1.5, density=True, label=f"{lab} (mean {100 * t.mean():.2f}%)")
    ax.axvline(TV_BOUND, color="k", ls="--", lw=1, label="bound 3.64%")
    ax.set_xlabel("per-row TV(softmax, quantised P)")
    ax.set_title(f"ExpCast Prop. 3.1 on {tv['tv_expcast'].numel():,} rows (our probes)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"fidelity_expcast_tv{tag}.png")
    plt.close(fig)


if __name__ == "__main__":
    main()
