"""How long a run of FP16 P.V accumulation may be (kernels/triton/attention_mma.py): the error of the
mma.sync kernel's arithmetic (its readable reference, kernels/reference/workstation.py) against
exact attention on the real-clip probes (fidelity/probes.py), for the FP32 version and for FP16
runs of 32, 64 and 128 keys (FP16 rounding every 32-key mma.sync step), next to the portable
8-bit reference (448-scaled V codes, FP32). V-Smooth with a k-means plan, exp2 + cast.

    python benchmarks/workstation_fidelity.py [--frames 4] [--heads 4] [--out results.json]

CPU, a few minutes. Prints one row per (clip, variant): relative L2 error of the output and its
SQNR in dB (mean over heads), then the spread over heads.
"""

import argparse
import datetime
import json
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from attention_speed import register_package  # noqa: E402

register_package()

import torch  # noqa: E402

from vc_attention.kernels.fidelity.probes import CLIPS, build_probe  # noqa: E402
from vc_attention.kernels import plan_v_smooth  # noqa: E402
from vc_attention.kernels.reference import reference_vc_attention  # noqa: E402
from vc_attention.kernels.reference.workstation import workstation_vc_attention  # noqa: E402

VARIANTS = {
    "portable 8-bit (V codes to 448, FP32)": lambda q, k, v, p: reference_vc_attention(q, k, v, perm=p, block_n=64),
    "mma FP32 version": lambda q, k, v, p: workstation_vc_attention(q, k, v, perm=p, pv_accumulation="fp32"),
    "mma FP16 run 32 keys": lambda q, k, v, p: workstation_vc_attention(q, k, v, perm=p, block_n=32, run_keys=32,
                                                                          fp16_round_keys=32),
    "mma FP16 run 64 keys": lambda q, k, v, p: workstation_vc_attention(q, k, v, perm=p, run_keys=64, fp16_round_keys=32),
    "mma FP16 run 128 keys (default)": lambda q, k, v, p: workstation_vc_attention(q, k, v, perm=p, fp16_round_keys=32),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for clip in CLIPS:
        probe = build_probe(clip=clip, latent_frames=args.frames, heads=args.heads)
        q, k, v = probe.q, probe.k, probe.v
        perm = plan_v_smooth(v, backend="reference").perm
        exact = torch.cat([torch.softmax((q[:, h:h + 1].double() @ k[:, h:h + 1].double().transpose(-1, -2))
                                         * q.shape[-1] ** -0.5, dim=-1) @ v[:, h:h + 1].double()
                           for h in range(q.shape[1])], dim=1)
        for name, fn in VARIANTS.items():
            o = fn(q, k, v, perm).double()
            err = [float((o[:, h] - exact[:, h]).norm() / exact[:, h].norm()) for h in range(q.shape[1])]
            row = dict(clip=clip, N=q.shape[2], variant=name, rel_l2=sum(err) / len(err),
                       sqnr_db=sum(-20 * math.log10(e) for e in err) / len(err), per_head=err)
            rows.append(row)
            print(f"{clip:10s} N={q.shape[2]:6d} {name:40s} rel L2 {row['rel_l2']:.4e}  SQNR {row['sqnr_db']:.2f} dB",
                  flush=True)
    result = dict(date=datetime.date.today().isoformat(), command="python benchmarks/workstation_fidelity.py "
                  + " ".join(sys.argv[1:]), rows=rows)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n| clip | variant | rel. L2 vs exact | SQNR dB | change vs FP32 version |\n|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["clip"] == r["clip"] and b["variant"] == "mma FP32 version")
        print(f"| {r['clip']} | {r['variant']} | {r['rel_l2']:.4e} | {r['sqnr_db']:.2f} | "
              f"{100 * (r['rel_l2'] / base['rel_l2'] - 1):+.2f}% |")


if __name__ == "__main__":
    main()
