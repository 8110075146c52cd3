"""Variants of the V pre-pass's block statistics (kernels/triton/prepass.py::v_block_stats_kernel as
it was before the twelfth session) on an sm_90 GPU: channels per program (BLOCK_D), warps, and the
non-finite flag as a float max instead of an int32 sum, timed (do_bench medians) and their outputs
(means, max |residual|, flags) compared with the library's kernel of the day ("today": before the
twelfth session 128 channels and the int32 flag; from f909f2b the taken variant itself). Random bf16 V with a
NaN and an inf, a random permutation.

    python3 benchmarks/v_stats_probe.py             # needs vc_attention importable and a CUDA GPU

Result: benchmarks/results/v_stats_variants_h200_2026-11-30.log (taken: 64 channels, 4 warps, the
float flag).
"""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from vc_attention.kernels.pipeline import V_PREPASS_WARPS, V_STATS_BLOCK_D
from vc_attention.kernels.triton.prepass import _load_v_block
from vc_attention.kernels.triton.rounding import round_to_bf16
from vc_attention.kernels.triton.launch import triton_launch


@triton.jit
def stats_v(V, stride_vb, stride_vb_h, stride_vn, stride_vd, PERM, MU, AMAX, BAD, H, N, NB,
            HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_PERM: tl.constexpr,
            V_SMOOTH: tl.constexpr, SPLIT_BAD: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    b = bh // H
    h = bh % H
    offs_t = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    b_v, finite, valid = _load_v_block(V, stride_vb, stride_vb_h, stride_vn, stride_vd, PERM, b, h, bh, offs_t,
                                       offs_d, N, HAS_PERM)
    if V_SMOOTH:
        count = tl.minimum(N - pid_n * BLOCK, BLOCK).to(tl.float32)
        mu = round_to_bf16(tl.math.div_rn(tl.sum(b_v, axis=0), count))
        tl.store(MU + (bh * NB + pid_n) * HEAD_DIM + offs_d, mu)
        b_v = tl.where(valid[:, None], b_v - mu.to(tl.float32)[None, :], 0.0)
    if SPLIT_BAD:
        # non-finite -> +inf in the max: one reduction for both (amax of finite residuals is finite)
        m = tl.max(tl.where(finite, tl.abs(b_v), float("inf")), axis=0)
        bad = m == float("inf")
        amax = tl.where(bad, tl.max(tl.abs(b_v), axis=0), m)
    else:
        amax = tl.max(tl.abs(b_v), axis=0)
        bad = tl.sum((~finite & valid[:, None]).to(tl.int32), axis=0) > 0
    tl.store(AMAX + (bh * NB + pid_n) * HEAD_DIM + offs_d, amax)
    tl.store(BAD + (bh * NB + pid_n) * HEAD_DIM + offs_d, bad.to(tl.int8))


def run(v, perm, BD, nw, split_bad):
    B, H, N, D = v.shape
    NB = triton.cdiv(N, 128)
    mu = torch.empty((B * H, NB, D), dtype=torch.bfloat16, device=v.device)
    amax = torch.empty((B * H, NB, D), dtype=torch.float32, device=v.device)
    bad = torch.empty((B * H, NB, D), dtype=torch.int8, device=v.device)
    stats_v[(NB, B * H, D // BD)](v, *v.stride(), perm, mu, amax, bad, H, N, NB, HEAD_DIM=D, BLOCK=128,
                                  BLOCK_D=BD, HAS_PERM=True, V_SMOOTH=True, SPLIT_BAD=split_bad, num_warps=nw)
    return mu, amax, bad


def today(v, perm):
    B, H, N, D = v.shape
    NB = triton.cdiv(N, 128)
    mu = torch.empty((B * H, NB, D), dtype=torch.bfloat16, device=v.device)
    amax = torch.empty((B * H, NB, D), dtype=torch.float32, device=v.device)
    bad = torch.empty((B * H, NB, D), dtype=torch.int8, device=v.device)
    strides = dict(zip(("stride_vb", "stride_vb_h", "stride_vn", "stride_vd"), v.stride()))
    bd = min(V_STATS_BLOCK_D, D)
    triton_launch("v_block_stats_kernel", (NB, B * H, D // bd), dict(V=v, **strides, PERM=perm, MU=mu, AMAX=amax,
                  BAD=bad, H=H, N=N, NB=NB), dict(HEAD_DIM=D, BLOCK=128, BLOCK_D=bd, HAS_PERM=True, V_SMOOTH=True),
                  V_PREPASS_WARPS, None)
    return mu, amax, bad


for lbl, H, N in [("Wan480p", 40, 32760), ("Wan5B", 24, 27280)]:
    g = torch.Generator(device="cuda").manual_seed(0)
    v = torch.randn(1, H, N, 128, device="cuda", generator=g).to(torch.bfloat16)
    v[0, 3, 100, 5] = float("nan"); v[0, 7, 2000, 90] = float("inf")
    perm = torch.stack([torch.randperm(N, device="cuda", generator=g) for _ in range(H)]).contiguous()
    ref = today(v, perm)
    t = do_bench(lambda: today(v, perm), warmup=5, rep=100, return_mode="median")
    print(f"{lbl} today: {t*1e3:7.1f} us", flush=True)
    for BD, nw, sb in [(128, 4, False), (128, 8, False), (64, 4, False), (64, 2, False), (32, 2, False), (128, 4, True), (64, 4, True), (32, 1, False)]:
        try:
            out = run(v, perm, BD, nw, sb)
            t = do_bench(lambda: run(v, perm, BD, nw, sb), warmup=5, rep=100, return_mode="median")
            mu_eq = torch.equal(out[0], ref[0]); mu_diff = (out[0].float() - ref[0].float()).abs().max().item()
            print(f"{lbl} BD={BD} nw={nw} split_bad={sb}: {t*1e3:7.1f} us  mu equal {mu_eq} (max diff {mu_diff:.2e}) "
                  f"amax equal {torch.equal(out[1], ref[1])} bad equal {torch.equal(out[2], ref[2])}", flush=True)
        except Exception as e:
            print(f"{lbl} BD={BD} nw={nw}: FAILED {type(e).__name__} {str(e)[:150]}", flush=True)
