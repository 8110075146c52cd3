"""The kernels of one public vc_attention(..., backend="gluon") call (V-Smooth + ExpCast, a plan
given: a non-grouping step) by CUDA time, from the torch profiler over 5 calls, at Wan 480p and
Wan2.2-5B: what the pre-pass launches besides the attention kernel. Needs an sm_90 GPU.

    python3 benchmarks/prep_profile.py

Result: benchmarks/results/prep_profile_h200_2026-11-30.log.
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from vc_attention.kernels import plan_v_smooth, vc_attention  # noqa: E402
import sm90_gluon_check as C  # noqa: E402  (inputs)


def main():
    for lbl, H, N in [("Wan480p", 40, 32760), ("Wan5B", 24, 27280)]:
        q, k, v = C.inputs(1, H, N)
        plan = plan_v_smooth(v, num_clusters=64, iters=3)

        def call():
            return vc_attention(q, k, v, bits=8, v_smooth=True, expcast=True, plan=plan, backend="gluon")

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        print(lbl, flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
