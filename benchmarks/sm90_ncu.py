"""Where the Hopper kernel's key-tile loop waits: launch it for ncu, then summarise ncu's source counters.

On the GPU machine (BENCHMARKS.md, fifth session):

    ncu --kernel-name regex:vc_attention_fwd_sm90 --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section SourceCounters \\
        -o $OUT/prof python3 benchmarks/sm90_ncu.py launch [pv_perm=True] [pingpong=True ...]
    ncu -i $OUT/prof.ncu-rep --page source --csv --print-source sass > $OUT/source.csv

then anywhere: python3 benchmarks/sm90_ncu.py summary source.csv [--lines]
(per hot loop: its stall reasons per warp; --lines: per instruction).
"""
import collections
import csv
import re
import sys


def launch(args):
    import pathlib

    import torch

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import sm90_gluon_check as C

    from vc_attention.kernels import plan_v_smooth
    from vc_attention.kernels.gluon import attention_sm90 as g
    from vc_attention.kernels.pipeline import prepare_8bit
    from vc_attention.kernels.triton.launch import triton_launch

    kw = {k: eval(v) for k, v in (a.split("=") for a in args)}
    pv_perm = kw.pop("pv_perm", True)
    B, H, N = 1, 8, 32768
    q, k, v = C.inputs(B, H, N)
    plan = plan_v_smooth(v, num_clusters=64, iters=3)
    ops, _ = prepare_8bit(triton_launch, q, k, v, v_smooth=True, perm=plan.perm, pv_perm=pv_perm)
    out = torch.empty_like(q)
    for _ in range(3):
        g.vc_attention_fwd_sm90(*ops, out, H, expcast=True, **kw)
    torch.cuda.synchronize()
    print("launched", dict(kw, pv_perm=pv_perm))


def summary(path, lines=False):
    rows = list(csv.reader(open(path)))
    hdr, data = rows[1], [r for r in rows[2:] if len(r) >= len(rows[1])]
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    addr = [int(r[ix["Address"]], 16) for r in data]
    src = [r[ix["Source"]].strip() for r in data]
    samples = [int(r[ix["Warp Stall Sampling (All Samples)"]] or 0) for r in data]
    total = sum(samples)
    for i, s in enumerate(src):  # loops: backward branches over more than 300 instructions
        m = re.search(r"BRA (0x[0-9a-f]+)", s)
        if not m or int(m.group(1), 16) >= addr[i] or int(m.group(1), 16) not in addr:
            continue
        j = addr.index(int(m.group(1), 16))
        n = sum(samples[j:i + 1])
        if i - j < 300 or n == 0:
            continue
        why = collections.Counter()
        for r in data[j:i + 1]:
            for h in stalls:
                why[h] += int(r[ix[h]] or 0)
        print(f"loop of {i - j + 1} instructions: {n} samples = {100 * n / total:.1f}% of all")
        for h, c in why.most_common(9):
            print(f"    {h[6:]:18} {100 * c / n:5.1f}%")
        if lines:
            for k in range(j, i + 1):
                top = sorted(((int(data[k][ix[h]] or 0), h[6:]) for h in stalls), reverse=True)[:2]
                print(f"   {k - j:4} {samples[k]:6} {src[k][:58]:58} " + ", ".join(f"{h}:{c}" for c, h in top if c))


if __name__ == "__main__":
    if sys.argv[1] == "launch":
        launch(sys.argv[2:])
    else:
        summary(sys.argv[2], "--lines" in sys.argv)
