"""Online k-means on the GPU for V-Smooth's grouping, per (batch, head) over value tokens.

- Assignment: one fused kernel; each program holds a tile of tokens and walks over the centroids,
  keeping the running argmin of ||c||^2 - 2 x.c (no N x C distance matrix in memory), the dot in
  3xTF32 on the tensor cores.
- Update: deterministic, sort-based. Tokens are stably sorted by label (the sort is also the
  permutation V-Smooth needs); one program per (group, cluster) sums its members in that fixed
  order. No float atomics, so the same input and seed give the same bits on every run.
Readable twin: kernels/reference/kmeans.py.
"""

import triton
import triton.language as tl

from .. import pipeline

# The host code's launcher over this file's kernels (found by name when launched).
kmeans_launch = pipeline.jit_launcher(globals())


@triton.jit
def kmeans_assign_kernel(
    X, stride_xb, stride_xh, stride_xn, stride_xd,
    C, CNORM, LABELS,
    H, N, NUM_C,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_t = tl.program_id(0)
    g = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    t_valid = offs_t < N
    b_x = tl.load(X + (g // H) * stride_xb + (g % H) * stride_xh + offs_t[:, None] * stride_xn + offs_d[None, :] * stride_xd,
                  mask=t_valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_T, D]
    best = tl.full([BLOCK_T], float("inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_T], tl.int32)
    for c0 in range(0, NUM_C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_valid = offs_c < NUM_C
        b_ct = tl.load(C + g * NUM_C * HEAD_DIM + offs_c[None, :] * HEAD_DIM + offs_d[:, None],
                       mask=c_valid[None, :], other=0.0)  # [D, BLOCK_C]
        b_cn = tl.load(CNORM + g * NUM_C + offs_c, mask=c_valid, other=float("inf"))
        # DOT_PRECISION: pipeline.KMEANS_DOT_PRECISION (3xTF32 on the tensor cores)
        b_d = b_cn[None, :] - 2.0 * tl.dot(b_x, b_ct, input_precision=DOT_PRECISION)  # [BLOCK_T, BLOCK_C]
        tile_min = tl.min(b_d, axis=1)
        tile_arg = tl.argmin(b_d, axis=1).to(tl.int32) + c0
        better = tile_min < best  # strict: ties keep the lower cluster index
        best = tl.where(better, tile_min, best)
        best_idx = tl.where(better, tile_arg, best_idx)
    tl.store(LABELS + g * N + offs_t, best_idx.to(tl.int64), mask=t_valid)


@triton.jit
def kmeans_update_kernel(
    X, stride_xb, stride_xh, stride_xn, stride_xd,
    ORDER, STARTS, C_OLD, C_NEW,
    H, N, NUM_C,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
):
    c = tl.program_id(0)
    g = tl.program_id(1)
    start = tl.load(STARTS + g * (NUM_C + 1) + c)
    end = tl.load(STARTS + g * (NUM_C + 1) + c + 1)
    offs_d = tl.arange(0, HEAD_DIM)
    total = tl.zeros([HEAD_DIM], tl.float32)
    for r0 in range(start, end, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_valid = offs_r < end
        idx = tl.load(ORDER + g * N + offs_r, mask=r_valid, other=0)
        b_x = tl.load(X + (g // H) * stride_xb + (g % H) * stride_xh + idx[:, None] * stride_xn + offs_d[None, :] * stride_xd,
                      mask=r_valid[:, None], other=0.0).to(tl.float32)
        total += tl.sum(b_x, axis=0)
    count = end - start
    old = tl.load(C_OLD + (g * NUM_C + c) * HEAD_DIM + offs_d)
    new = tl.where(count > 0, total / tl.maximum(count, 1).to(tl.float32), old)  # empty: keep
    tl.store(C_NEW + (g * NUM_C + c) * HEAD_DIM + offs_d, new)


# Host code (grids, buffers): kernels/pipeline.py, shared with the precompiled cubins.

def kmeans_assign(x, centroids):
    """x: [B, H, N, D] (any strides), centroids: [G = B*H, C, D] fp32 -> labels [G, N] int64."""
    return pipeline.kmeans_assign(kmeans_launch, x, centroids)


sort_by_label = pipeline.sort_by_label


def kmeans_update(x, order, starts, centroids):
    return pipeline.kmeans_update(kmeans_launch, x, order, starts, centroids)


def kmeans_triton(x, centroids, iters):
    """Lloyd iterations from the given centroids. x: [B, H, N, D]; centroids: [B*H, C, D] fp32.
    Returns (labels [G, N], centroids [G, C, D], order [G, N]: the stable sort of labels)."""
    return pipeline.kmeans(kmeans_launch, x, centroids, iters)
