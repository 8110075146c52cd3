"""The k-means assignment's distance dot on an sm_90 GPU: kernels/triton/kmeans.py's assignment
kernel with the CUDA-core fp32 dot (DOT_PRECISION="ieee", the kernel before the twelfth session)
against its 3xTF32 tensor-core variants (tile of tokens x centroids, warps), timed (do_bench medians) and their labels compared with the ieee
kernel's and with a float64 argmin on 4 heads. Random bf16 V, 64 centroids from plan_v_smooth.

    python3 benchmarks/kmeans_assign_probe.py      # needs vc_attention importable and a CUDA GPU

Result: benchmarks/results/kmeans_assign_variants_h200_2026-11-30.log (taken: 3xTF32, 128 x 32).
"""
import torch
import triton
from triton.testing import do_bench
from vc_attention.kernels import plan_v_smooth
from vc_attention.kernels.triton.kmeans import kmeans_assign_kernel  # its DOT_PRECISION is the variable here


def run(v, cen, BT, BC, prec, nw):
    B, H, N, D = v.shape
    G = B * H
    Cn = cen.shape[1]
    cnorm = (cen * cen).sum(-1).contiguous()
    lab = torch.empty((G, N), dtype=torch.int64, device=v.device)
    kmeans_assign_kernel[(triton.cdiv(N, BT), G)](v, *v.stride(), cen, cnorm, lab, H, N, Cn, HEAD_DIM=D, BLOCK_T=BT,
                                                  BLOCK_C=BC, DOT_PRECISION=prec, num_warps=nw)
    return lab


for lbl, H, N in [("Wan480p", 40, 32760), ("Wan720p", 40, 75600)]:
    g = torch.Generator(device="cuda").manual_seed(0)
    v = torch.randn(1, H, N, 128, device="cuda", generator=g).to(torch.bfloat16)
    plan = plan_v_smooth(v, num_clusters=64, iters=3, backend="triton")
    cen = plan.centroids.reshape(H, 64, 128).float().contiguous()
    base = run(v, cen, 64, 32, "ieee", 4)  # the kernel before the twelfth session
    # float64 truth on 4 heads
    x64 = v[0, :4].double(); c64 = cen[:4].double()
    d64 = (c64 * c64).sum(-1)[:, None, :] - 2.0 * x64 @ c64.transpose(1, 2)
    truth = d64.argmin(-1)
    srt = d64.sort(-1).values
    gap = (srt[..., 1] - srt[..., 0])
    print(f"{lbl}: ieee vs f64 mismatch {(base[:4] != truth).float().mean().item():.2e}; "
          f"median gap {gap.median().item():.3e}, min {gap.min().item():.3e}", flush=True)
    t = do_bench(lambda: run(v, cen, 64, 32, "ieee", 4), warmup=3, rep=100, return_mode="median")
    print(f"{lbl} current ieee 64x32 nw4: {t*1e3:8.1f} us", flush=True)  # the label of the recorded log
    for prec in ["tf32x3"]:
        for BT, BC, nw in [(64, 64, 4), (128, 64, 4), (128, 64, 8), (128, 32, 4), (64, 32, 4), (256, 64, 8)]:
            try:
                lab = run(v, cen, BT, BC, prec, nw)
                t = do_bench(lambda: run(v, cen, BT, BC, prec, nw), warmup=3, rep=100, return_mode="median")
                mm = (lab != base).float().mean().item()
                mt = (lab[:4] != truth).float().mean().item()
                print(f"{lbl} {prec} {BT}x{BC} nw{nw}: {t*1e3:8.1f} us  vs ieee {mm:.2e}  vs f64 {mt:.2e}", flush=True)
            except Exception as e:
                print(f"{lbl} {prec} {BT}x{BC} nw{nw}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
