"""Alternating A/B timing of the Hopper kernel's schedule options (seventh and eighth sessions).

    python3 benchmarks/sm90_ab.py [--edits]

Times today's dispatched build (in wgmma order: FA3's ping-pong of the two consumer warpgroups and
V-Smooth's mean as a tf32 wgmma riding on P.V, _schedule_applies; on Triton 3.6 two key tiles per
loop trip, pair_loop_pays) against each option alone, against neither ("classic": the sixth
session's schedule), against the one-tile loop, and against the row max on floats instead of the
int32 dot ("float max", an edited copy), V-Smooth + ExpCast, kernel alone, at
Wan2.2-14B 720p, HunyuanVideo-1.5 720p, Wan2.2-5B 720p and Wan 480p: two rounds, the second in
reverse order, reported as the mean and both values (the GPU's clock drifts by ~1-2% over a minute).
--edits adds the sixth session's copies with one change each, timed with the classic schedule:
  nofold  the int32 -> fp32 conversion's float subtract kept in the no-clip copy (the bytes are then
          formed without kernels/triton/online.py::expcast_fold: timing only);
  notree  the row max by gl.max (a chain of dependent FMNMX) instead of _row_max's tree.
Needs an sm_90 GPU. Results: benchmarks/results/sm90_schedule_experiments_*.log (this comparison, its
section 8), sm90_fold_flag_mean_*.log (the edits), sm90_eighth_session_ab_*.log (the eighth session's
development copy of it).
"""
import pathlib
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sm90_gluon_check as C  # noqa: E402  (inputs)
from sm90_kernel_versions import module_from_source  # noqa: E402

from vc_attention.kernels import plan_v_smooth  # noqa: E402
from vc_attention.kernels.gluon import attention_sm90 as today  # noqa: E402
from vc_attention.kernels.pipeline import prepare_8bit  # noqa: E402
from vc_attention.kernels.triton.launch import triton_launch  # noqa: E402

EDITS = {
    "nofold": ("        if not FOLD_ALL:\n            x = x - (12582912.0 - carried)",
               "        x = x - (12582912.0 - carried)"),
    "notree": ("_row_max(x, BLOCK_N, s_layout) - carried", "gl.max(x, axis=1) - carried"),
}
# the eighth session's row max on the int32 dot, undone (timed with the dispatched schedule)
FLOAT_MAX = ("FOLD_ALL and not MASKED and not QK_FP8 and PV_PERM)", "False)")
SHAPES = [("Wan2.2-14B 720p", 1, 40, 75600), ("HunyuanVideo-1.5 720p", 1, 16, 111700), ("Wan2.2-5B 720p", 1, 24, 27280),
          ("Wan 480p", 1, 40, 32760)]


def edited_copy(name, old, new):
    src = pathlib.Path(today.__file__).read_text()
    assert src.count(old) == 1, f"{name}: the edit no longer applies"
    return module_from_source(src.replace(old, new), f"attention_sm90_{name}")


def main():
    print(torch.cuda.get_device_name(), flush=True)
    classic = dict(pingpong=False, mean_mma=False)
    variants = [("default", today, {}), ("classic", today, classic),
                ("pingpong only", today, dict(pingpong=True, mean_mma=False)),
                ("mean_mma only", today, dict(pingpong=False, mean_mma=True)),
                ("one-tile loop", today, dict(pair_loop=False)),
                ("float max", edited_copy("floatmax", *FLOAT_MAX), {})]
    if "--edits" in sys.argv:
        variants += [(n + ",classic", edited_copy(n, *e), classic) for n, e in EDITS.items()]
    for label, B, H, N in SHAPES:
        q, k, v = C.inputs(B, H, N)
        plan = plan_v_smooth(v, num_clusters=64, iters=3)
        ops, _ = prepare_8bit(triton_launch, q, k, v, v_smooth=True, perm=plan.perm, pv_perm=today.pv_perm_for())
        times = {n: [] for n, _, _ in variants}
        for rnd in range(2):
            for name, mod, kw in (variants if rnd == 0 else variants[::-1]):
                out = torch.empty_like(q)
                f = lambda: mod.vc_attention_fwd_sm90(*ops, out, H, expcast=True, **kw)  # noqa: E731
                f()
                torch.cuda.synchronize()
                times[name].append(do_bench(f, warmup=3, rep=150 if N > 50000 else 80, return_mode="median"))
        print(f"{label}: " + "; ".join(f"{n} {sum(t) / len(t):.2f} ms ({' / '.join(f'{x:.1f}' for x in t)})"
                                       for n, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
