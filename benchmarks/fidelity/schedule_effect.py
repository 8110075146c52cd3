"""Schedule effect: how stale may V-Smooth's permutation be, on captured ComfyUI inputs.

With ComfyUI's Python (the capture runs real ComfyUI, found as the tests find it):

    python benchmarks/fidelity/capture_tiny_wan.py --out capture/
    python benchmarks/fidelity/schedule_effect.py --capture capture/capture.pt

Input: the per-step self-attention inputs of the tiny random Wan 2.1 model that real ComfyUI sampled
(capture_tiny_wan.py; the trajectory is ComfyUI's default attention, so every schedule below sees the
same q, k, v and the error is the per-call error, not accumulated over steps).

Plans are made exactly as the node makes them (``vc_attention.kernels.fidelity.schedule.Planner``): the first grouping of a layer is a
cold k-means (``plan_v_smooth``, 64 clusters, 10 Lloyd iterations), every later one is warm-started from
the previous centroids (2 iterations); whether a step groups is ``nodes.schedule.plan_action`` with the
call's step and whether its sigma is inside the window. One plan per (layer, cond/uncond batch), as the
node's plan cache keys it. Schedules:

- ``fresh``: group at every step (window 1.0, refresh 1);
- ``refresh4``: group every 4 steps for the whole run (window 1.0, refresh 4: the paper's refresh);
- ``window25``: the node's default: group every 4 steps inside the first 25% of the schedule
  (sigma above ``model_sampling.percent_to_sigma(0.25)``), then reuse the last plan;
- ``once``: group at step 0 only and reuse for the whole run (window 0);
- ``sequential``: no permutation (block demeaning in sequence order);
- ``naive``: no demeaning (naive FP8: per-channel E4M3 V).

For each call: the library's ``reference_vc_attention`` (bits 8, INT8 Q/K, E4M3 V residual, P by
exp2 + cast or ExpCast, beta -0.35) against float64 ``exact_attention``, all keys, on one random
128-row query block per call of the first CFG half (the uncond half: ComfyUI batches the call with
cond_or_uncond = (1, 0)) (``--query-blocks``, ``--halves``; the CPU budget; the
same rows for every schedule, so the comparison between schedules is paired): relative L2 and SQNR dB
over those rows (both heads); and the share of block energy removed
by the 128-row block mean, sum_j n_j ||mu_j||^2 / sum_t ||v_t||^2 per (batch, head), averaged over
both CFG halves and both heads (all tokens).

Writes ``benchmarks/results/fidelity_schedule.csv`` (one row per call x schedule x P path) and prints
the summary table that FIDELITY.md quotes.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import time

import torch

from vc_attention.kernels.fidelity.schedule import SCHEDULES, Planner, above, energy_share, errors, query_rows
from vc_attention.kernels.reference import exact_attention, reference_vc_attention

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"

ORDERS = list(SCHEDULES) + ["sequential", "naive"]
P_PATHS = {"exp2": False, "expcast": True}


def measure(capture: dict, *, outputs=True, query_blocks=1, halves=1, log=print) -> list[dict]:
    calls = sorted(capture["calls"], key=lambda c: (c["step"], c["block_index"]))
    window_sigma = capture["window_sigma"]
    planners = {name: Planner(fn, refresh, window_sigma) for name, (fn, refresh) in SCHEDULES.items()}
    rows = []
    t0 = time.time()
    for i, c in enumerate(calls):
        q, k, v = c["q"], c["k"], c["v"]
        # Outputs: all keys, a subset of the queries, the first `halves` CFG halves (the CPU budget).
        oq, ok, ov = (q[:halves, :, query_rows(q.shape[2], query_blocks, seed=i)], k[:halves], v[:halves])
        key = (c["layer"], c["cond_or_uncond"])
        plans = {}
        for name, planner in planners.items():
            plans[name] = planner.plan(key, c["step"], c["sigma"], v)
        plans["sequential"] = (None, None)
        plans["naive"] = (None, None)
        o_ref = exact_attention(oq, ok, ov) if outputs else None
        cache = {}  # identical plans (same tensor) give identical outputs: compute once
        for name in ORDERS:
            plan, plan_step = plans[name]
            perm = None if plan is None else plan.perm
            ident = ("naive",) if name == "naive" else (id(perm),)
            share = energy_share(v, perm) if name != "naive" else torch.zeros(1)
            for p_name, expcast in P_PATHS.items():
                row = dict(step=c["step"], sigma=round(c["sigma"], 6), layer=c["layer"],
                           block_index=c["block_index"], in_window=int(above(c["sigma"], window_sigma)),
                           schedule=name, plan_step="" if plan_step is None else plan_step,
                           plan_age="" if plan_step is None else c["step"] - plan_step, p_path=p_name,
                           energy_removed=float(share.mean()), energy_removed_min=float(share.min()))
                if outputs:
                    ck = ident + (p_name,)
                    if ck not in cache:
                        o = reference_vc_attention(oq, ok, ov, bits=8, v_smooth=name != "naive", expcast=expcast,
                                                   perm=None if perm is None else perm[:halves])
                        cache[ck] = errors(o_ref, o)
                    row["rel_l2"], row["sqnr_db"] = cache[ck]
                rows.append(row)
        if (i + 1) % 5 == 0 or i + 1 == len(calls):
            log(f"  {i + 1}/{len(calls)} calls, {time.time() - t0:.0f}s", flush=True)
    return rows


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def summary(rows: list[dict], last_step: int) -> str:
    """Markdown table: per schedule, SQNR / rel. L2 (exp2, ExpCast) and energy removed,
    averaged over all calls, the calls after the window, and the last step."""
    parts = {"all": lambda r: True, "after window": lambda r: not r["in_window"],
             "last step": lambda r: r["step"] == last_step}
    lines = ["| order / schedule | part | calls | SQNR dB exp2 | SQNR dB ExpCast | rel. L2 exp2 | "
             "rel. L2 ExpCast | energy removed | mean plan age (steps) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in ORDERS:
        for part, sel in parts.items():
            e = [r for r in rows if r["schedule"] == name and r["p_path"] == "exp2" and sel(r)]
            x = [r for r in rows if r["schedule"] == name and r["p_path"] == "expcast" and sel(r)]
            ages = [r["plan_age"] for r in e if r["plan_age"] != ""]
            energy = "-" if name == "naive" else f"{100 * _mean(r['energy_removed'] for r in e):.1f}%"
            age = f"{_mean(ages):.1f}" if ages else "-"
            lines.append(
                f"| {name} | {part} | {len(e)} | {_mean(r['sqnr_db'] for r in e):.2f} | "
                f"{_mean(r['sqnr_db'] for r in x):.2f} | {_mean(r['rel_l2'] for r in e):.3e} | "
                f"{_mean(r['rel_l2'] for r in x):.3e} | {energy} | {age} |")
    return "\n".join(lines)


def per_step(rows: list[dict]) -> str:
    """Markdown table: energy removed and SQNR (exp2) per step, mean over layers."""
    steps = sorted({r["step"] for r in rows})
    names = [n for n in ORDERS if n != "naive"]
    head = "| step | sigma | in window | " + " | ".join(f"energy {n}" for n in names) + " | " + \
        " | ".join(f"dB {n}" for n in ORDERS) + " |"
    lines = [head, "|" + "---|" * (3 + len(names) + len(ORDERS))]
    for s in steps:
        sel = [r for r in rows if r["step"] == s and r["p_path"] == "exp2"]
        cells = [str(s), f"{sel[0]['sigma']:.4f}", "yes" if sel[0]["in_window"] else "no"]
        cells += [f"{100 * _mean(r['energy_removed'] for r in sel if r['schedule'] == n):.1f}%" for n in names]
        cells += [f"{_mean(r['sqnr_db'] for r in sel if r['schedule'] == n):.2f}" for n in ORDERS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(rows[0])
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capture", type=pathlib.Path, default=pathlib.Path("capture/capture.pt"))
    ap.add_argument("--query-blocks", type=int, default=1,
                    help="128-row query blocks per call (random, fixed per call); 0: all queries")
    ap.add_argument("--halves", type=int, default=1, help="CFG halves (batch entries) whose outputs are measured")
    ap.add_argument("--csv", type=pathlib.Path, default=RESULTS / "fidelity_schedule.csv")
    a = ap.parse_args(argv)
    capture = torch.load(a.capture, weights_only=False)
    cfg = capture["config"]
    print(f"capture: {len(capture['calls'])} calls, config {cfg}")
    print(f"sample_sigmas {[round(s, 4) for s in capture['sample_sigmas']]}, window sigma {capture['window_sigma']:.4f}")
    print(f"outputs: query blocks per call {a.query_blocks or 'all'}, CFG halves {a.halves}")
    rows = measure(capture, query_blocks=a.query_blocks, halves=a.halves)
    write_csv(a.csv, rows)
    last = max(r["step"] for r in rows)
    print("\n" + summary(rows, last) + "\n\n" + per_step(rows))
    print(f"\nwrote {a.csv}")


if __name__ == "__main__":
    main()
