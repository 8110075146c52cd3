"""4-bit NVFP4 fidelity next to the 8-bit one, on the same attention probes built from real
clips as measure.py (vc_attention.kernels.fidelity.probes), through the readable reference (the Triton kernel matches it: see
tests/kernels/test_nvfp4.py and tests/gpu/test_nvfp4_gpu.py).

    python benchmarks/fidelity/nvfp4_fidelity.py            # ~1 min on 2 CPU cores
    python benchmarks/fidelity/nvfp4_fidelity.py --quick    # smoke

Per clip and head: attention output on a query subset (contiguous 128-row blocks, all keys) against
exact float64 attention: relative L2, cosine, SQNR (dB), for
    8-bit plain        INT8 Q/K, per-channel E4M3 V (no demeaning), exp2 + cast P
    8-bit V-Smooth     the same with the k-means plan (64 clusters, 10 iterations) and demeaning
    4-bit ..., amax scales  NVFP4 with the usual group scale rule (plain NVFP4 as SageAttention3 has it)
    4-bit plain        NVFP4 Q/K/V/P (kernels/reference/nvfp4.py) with the Q/K/V group-scale search, no demeaning
    4-bit V-Smooth seq the same with demeaning in sequence order (no grouping)
    4-bit V-Smooth     the same with the k-means plan and a mean per 8 tokens (the 4-bit default)
    4-bit V-Smooth, V search only  the default with Q's and K's group scales by the usual rule
    4-bit V-Smooth, block mean (, amax scales)  one mean per 128-row block, as the paper (and the usual scales)
    4-bit V-Smooth, mean per 16 / 32  coarser groups
and two diagnostics of the value path alone (Q, K, P exact; only V NVFP4, along the tokens):
    V-only 4-bit plain / V-only 4-bit V-Smooth (k-means plan, demeaned per 8 tokens or per 128-row
    block, means restored exactly)
Caveat: the 4-bit Q global scale (one per head) is taken over the query subset, not all queries;
Q's E4M3 group scales make that a small effect. Writes benchmarks/results/fidelity_nvfp4.csv.
"""

import argparse
import csv
import datetime
import math
import pathlib
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
from vc_attention.kernels.plan import plan_v_smooth  # noqa: E402
from vc_attention.kernels.reference.attention import LOG2E, online_attention, reference_vc_attention  # noqa: E402,E501
from vc_attention.kernels.reference.nvfp4 import NVFP4_MEAN_GROUP, dequantize_nvfp4, quantize_nvfp4  # noqa: E402
from vc_attention.kernels.reference.vsmooth import block_means, demean, permute_tokens  # noqa: E402

from vc_attention.kernels.fidelity.probes import CLIPS, build_probe  # noqa: E402

CONFIGS = [  # label, bits, v_smooth, use the k-means plan, NVFP4 search (None: the default), V mean group
    ("8-bit plain", 8, False, False, None, None),
    ("8-bit V-Smooth", 8, True, True, None, None),
    ("4-bit plain, amax scales", 4, False, False, "", None),
    ("4-bit V-Smooth, amax scales", 4, True, True, "", None),
    ("4-bit plain", 4, False, False, None, None),
    ("4-bit V-Smooth seq", 4, True, False, None, None),
    ("4-bit V-Smooth", 4, True, True, None, None),
    ("4-bit V-Smooth, V search only", 4, True, True, "v", None),
    ("4-bit V-Smooth, block mean", 4, True, True, None, 128),
    ("4-bit V-Smooth, block mean, amax scales", 4, True, True, "", 128),
    ("4-bit V-Smooth, mean per 16", 4, True, True, None, 16),
    ("4-bit V-Smooth, mean per 32", 4, True, True, None, 32),
]


def metrics(o, ref):
    o, ref = o.double(), ref.double()
    err, nrm = (o - ref).pow(2).sum(), ref.pow(2).sum()
    return {"rel_l2": math.sqrt(err / nrm), "sqnr_db": 10 * math.log10(nrm / err),
            "cosine": torch.nn.functional.cosine_similarity(o.flatten(), ref.flatten(), dim=0).item()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clips", default=",".join(CLIPS))
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--latent-frames", type=int, default=4)
    ap.add_argument("--patch", type=int, default=8)
    ap.add_argument("--query-blocks", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fidelity_nvfp4.csv"))
    args = ap.parse_args(argv)
    if args.quick:
        args.heads, args.latent_frames, args.patch, args.query_blocks = 2, 4, 16, 2
    rows = []
    t_start = time.time()
    for clip in args.clips.split(","):
        probe = build_probe(clip=clip, heads=args.heads, latent_frames=args.latent_frames, patch=args.patch)
        q, k, v = probe.q, probe.k, probe.v
        N = q.shape[2]
        nb = N // 128
        g = torch.Generator().manual_seed(7)
        blocks = torch.sort(torch.randperm(nb, generator=g)[: args.query_blocks]).values
        rows_idx = (blocks[:, None] * 128 + torch.arange(128)[None, :]).reshape(-1)
        qs = q[:, :, rows_idx]
        ref = torch.softmax(qs.double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v.double()
        plan = plan_v_smooth(v, num_clusters=64, iters=10, backend="reference")
        outs = {label: reference_vc_attention(qs, k, v, bits=bits, v_smooth=v_smooth,
                                              perm=plan.perm if use_plan else None, v_mean_group=group,
                                              **({} if search is None else {"nvfp4_search": search}))
                for label, bits, v_smooth, use_plan, search, group in CONFIGS}
        sc = q.shape[-1] ** -0.5 * LOG2E
        c, b, s, _ = quantize_nvfp4(v, dim=-2, factors=(1.0,))
        outs["V-only 4-bit plain"] = online_attention(qs, k, dequantize_nvfp4(c, b, s, dim=-2), score_scale=sc)
        kp, vp = permute_tokens(k, plan.perm), permute_tokens(v, plan.perm)
        for label, group in (("V-only 4-bit V-Smooth", NVFP4_MEAN_GROUP), ("V-only 4-bit V-Smooth, block mean", 128)):
            mu = block_means(vp, group)
            c, b, s, _ = quantize_nvfp4(demean(vp, mu, group), dim=-2, factors=(1.0,))
            outs[label] = online_attention(qs, kp, dequantize_nvfp4(c, b, s, dim=-2), mu=mu, mu_block=group,
                                           score_scale=sc)
        for label, o in outs.items():
            for h in range(q.shape[1]):
                rows.append({"clip": clip, "N": N, "head": h, "method": label,
                             **metrics(o[:, h], ref[:, h])})
        print(f"[{clip}] N={N} done {time.time() - t_start:.0f}s", flush=True)

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{datetime.date.today()}  mean over heads ({out}):")
    print(f"| {'clip':10s} | {'method':20s} | rel L2 | SQNR dB | cosine |")
    print("|---|---|---|---|---|")
    for clip in args.clips.split(","):
        for label in [c[0] for c in CONFIGS] + ["V-only 4-bit plain", "V-only 4-bit V-Smooth",
                                                "V-only 4-bit V-Smooth, block mean"]:
            sel = [r for r in rows if r["clip"] == clip and r["method"] == label]
            mean = {key: sum(r[key] for r in sel) / len(sel) for key in ("rel_l2", "sqnr_db", "cosine")}
            print(f"| {clip:10s} | {label:20s} | {mean['rel_l2']:.4f} | {mean['sqnr_db']:.1f} | "
                  f"{mean['cosine']:.5f} |")


if __name__ == "__main__":
    main()
