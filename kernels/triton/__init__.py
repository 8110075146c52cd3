"""Triton kernels of VC-Attention (8-bit path). Each file holds one part of the method:

    rounding.py   E4M3 and bf16 rounding helpers shared by the kernels
    online.py     the online-softmax recurrence shared by the 8-bit and 4-bit attention kernels
                  (running max, mean restoration from the row sums, the output store)
    kmeans.py     fused k-means assignment and deterministic centroid update (V-Smooth grouping)
    prepass.py    fused quantisers: Q/K INT8 per block (K gathered by the plan, smoothed);
                  V gathered, demeaned per 128 rows, residual to E4M3 per channel, stored K-major
    attention.py  the fused forward attention (INT8 QK^T, online softmax, P by exp2+cast or
                  ExpCast, FP8 PV on the residual, mean restored from the row sums)

Importing this package needs Triton; kernels/dispatch.py decides whether it is used and says why not.
"""
