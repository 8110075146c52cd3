"""Triton kernels of VC-Attention. Each file holds one part of the method:

    rounding.py       E4M3 and bf16 rounding helpers shared by the kernels
    online.py         the online-softmax recurrence shared by the attention kernels (running max,
                      mean restoration from the row sums, the output store)
    kmeans.py         fused k-means assignment and deterministic centroid update (V-Smooth grouping)
    prepass.py        fused quantisers: Q/K INT8 per block (K gathered by the plan, smoothed);
                      V gathered, demeaned per 128 rows, residual to E4M3 per channel, stored K-major
    attention.py      the portable fused 8-bit forward (INT8 QK^T, online softmax, P by exp2 + cast
                      or ExpCast, FP8 PV on the residual, mean restored from the row sums)
    attention_mma.py  the 8-bit forward for mma.sync GPUs (sm_89, sm_120)
    attention_fp4.py  the 4-bit NVFP4 forward and its pre-pass (sm_100, sm_120)
    launch.py         one launcher over the 8-bit kernels by name, for the host code of
                      kernels/pipeline.py (each kernel file also builds its own)

Importing this package needs Triton; kernels/dispatch.py decides whether it is used and says why not.
"""
