"""Alternating A/B of the Hopper kernel against patched copies of it (thirteenth session).

    python3 benchmarks/sm90_patch_ab.py [--expcast 0|1] [--shapes wan14b,hv15,wan5b,wan480] [--rounds R]
        NAME=[PATCH][:kw=value,...] ...

Each NAME is today's kernel (kernels/gluon/attention_sm90.py) with PATCH, a unified diff such as
benchmarks/results/sm90_*.patch, applied to a copy of it, and/or with launch keywords (e.g.
"st2=:stages=2", "pp=:pingpong=True,mean_mma=True"). At each shape, V-Smooth on operands prepared
once (pipeline.prepare_8bit), kernel alone, ExpCast unless --expcast 0:
  1. every variant's output against today's: max |difference| (0: the same bits; a patch marked
     "timing only" in its first lines computes something else on purpose);
  2. R rounds of do_bench medians, every other round in reverse order (the H200's clock drifts with
     its power cap), reported as the mean, the change against today and each round.
--dry-run applies the patches and imports the copies without a GPU (a CPU check of the patches).
Needs an sm_90 GPU otherwise. The thirteenth session's rows (BENCHMARKS.md) were measured with its
development copy (same steps, variants named by environment variables):
results/sm90_thirteenth_session_ab_h200_2026-11-30.log.
"""
import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPES = {"wan14b": ("Wan2.2-14B 720p", 1, 40, 75600), "hv15": ("HunyuanVideo-1.5 720p", 1, 16, 111700),
          "wan5b": ("Wan2.2-5B 720p", 1, 24, 27280), "wan480": ("Wan 480p", 1, 40, 32760)}


def apply_unified_diff(src, diff):
    """`src` with the hunks of a one-file unified diff applied; each hunk's old lines must occur in
    `src` exactly once (no fuzz: a patch that no longer applies says so)."""
    lines = src.splitlines(keepends=True)
    hunks, cur = [], None
    for ln in diff.splitlines(keepends=True):
        if ln.startswith("@@"):
            cur = ([], [])
            hunks.append(cur)
        elif cur is not None and ln[:1] in (" ", "-", "+"):
            body = ln[1:] if ln.endswith("\n") else ln[1:] + "\n"
            if ln[0] in " -":
                cur[0].append(body)
            if ln[0] in " +":
                cur[1].append(body)
        elif cur is not None and ln.startswith("\\"):
            continue
    for old, new in hunks:
        starts = [i for i in range(len(lines) - len(old) + 1) if lines[i:i + len(old)] == old]
        if len(starts) != 1:
            raise ValueError(f"a hunk of the patch matches {len(starts)} places (needs 1): {old[:3]}")
        i = starts[0]
        lines[i:i + len(old)] = new
    return "".join(lines)


def parse_variant(spec):
    name, _, rest = spec.partition("=")
    patch, _, kws = rest.partition(":")
    kw = {k: eval(v) for k, v in (x.split("=", 1) for x in kws.split(",") if x)}
    return name, (patch or None), kw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--expcast", type=int, default=1)
    ap.add_argument("--shapes", default="wan14b,hv15,wan5b,wan480")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sm90_kernel_versions import module_from_source

    from vc_attention.kernels.gluon import attention_sm90 as today

    src = (ROOT / "kernels" / "gluon" / "attention_sm90.py").read_text()
    variants = [("today", today, {})]
    for spec in a.variants:
        name, patch, kw = parse_variant(spec)
        mod = today
        if patch:
            edited = apply_unified_diff(src, pathlib.Path(patch).read_text())
            mod = module_from_source(edited, "attention_sm90_" + re.sub(r"\W", "_", name))
        variants.append((name, mod, kw))
        print(f"{name}: {'patch ' + patch if patch else 'today'} {kw or ''}", flush=True)
    if a.dry_run:
        return 0

    import torch
    from triton.testing import do_bench

    import sm90_gluon_check as C

    from vc_attention.kernels import plan_v_smooth
    from vc_attention.kernels.pipeline import prepare_8bit
    from vc_attention.kernels.triton.launch import triton_launch

    ec = bool(a.expcast)
    print(torch.cuda.get_device_name(), "expcast" if ec else "exp2", flush=True)
    for key in a.shapes.split(","):
        label, B, H, N = SHAPES[key]
        q, k, v = C.inputs(B, H, N)
        plan = plan_v_smooth(v, num_clusters=64, iters=3)
        ops, _ = prepare_8bit(triton_launch, q, k, v, v_smooth=True, perm=plan.perm, pv_perm=today.pv_perm_for())
        outs = {}
        for name, mod, kw in variants:
            o = torch.full_like(q, float("nan"))
            mod.vc_attention_fwd_sm90(*ops, o, H, expcast=ec, **kw)
            torch.cuda.synchronize()
            outs[name] = o
        for name, _, _ in variants[1:]:
            d = (outs[name].float() - outs["today"].float()).abs().max().item()
            print(f"  {label} {name}: max|diff| vs today {d:.3e}, NaN {int(torch.isnan(outs[name]).sum())}", flush=True)
        times = {name: [] for name, _, _ in variants}
        out = torch.empty_like(q)
        for rnd in range(a.rounds):
            for name, mod, kw in (variants if rnd % 2 == 0 else variants[::-1]):
                f = lambda: mod.vc_attention_fwd_sm90(*ops, out, H, expcast=ec, **kw)  # noqa: E731
                times[name].append(do_bench(f, warmup=2, rep=500 if N > 50000 else 250, return_mode="median"))
        base = sum(times["today"]) / a.rounds
        print(f"{label}: " + "; ".join(
            f"{n} {sum(t) / a.rounds:.2f} ms ({sum(t) / a.rounds / base - 1:+.1%}; {' / '.join(f'{x:.1f}' for x in t)})"
            for n, t in times.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
