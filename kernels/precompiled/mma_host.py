"""Host code of the mma.sync attention kernel (kernels/triton/attention_mma.py), without Triton.

attention_mma.py holds its kernel and its host code in one module, which imports Triton; the
precompiled backend launches that kernel's cubins on sm_89 / sm_120 where Triton may be missing, so
the host code is mirrored here, call for call: the same pre-pass kernels, grids, arguments,
constexprs, warps and stages, so a cubin built by the same Triton gives the JIT's bits.
tests/kernels/test_precompiled.py records both host codes' launches and compares them.
"""

import torch

from .. import pipeline
from ..pipeline import cdiv, interpreting
from ..reference.expcast import EXPCAST_BETA
from ..reference.quant import QK_BLOCK, fold_score_scale, smoothing_mean, true_div
from ..reference.vsmooth import V_BLOCK
from ..reference.workstation import V_MAX

MMA_BLOCK_M, MMA_BLOCK_N, MMA_RUN_TILES, MMA_NUM_WARPS, MMA_NUM_STAGES = 128, 64, 2, 8, 3


def quantize_v_residual_mma(launch, v, perm=None, v_smooth=True, v_max=V_MAX):
    """attention_mma.quantize_v_residual_mma: V's residual codes at most v_max (1.75)."""
    B, H, N, D = v.shape
    BH = B * H
    NB = cdiv(N, V_BLOCK)
    NPAD = NB * V_BLOCK
    mu, amax, bad = pipeline.v_block_stats(launch, v, perm, v_smooth)
    amax = amax.amax(dim=1)
    scale = torch.where(amax > 0, true_div(amax, v_max), torch.ones_like(amax))
    scale_out = torch.where(bad.amax(dim=1) != 0, torch.full_like(scale, float("nan")), scale)
    vt = torch.empty((BH, D, NPAD), dtype=torch.float8_e4m3fn, device=v.device)
    mu_scaled = torch.empty((BH, NB, D), dtype=torch.float32, device=v.device) if v_smooth else None
    strides = dict(zip(("stride_vb", "stride_vb_h", "stride_vn", "stride_vd"), v.stride()))
    launch("v_quantize_kernel", (NB, BH),
           dict(V=v, **strides, PERM=perm, MU=mu, SCALE=scale, VT=vt, MU_SCALED=mu_scaled, MU_TF32=None,
                H=H, N=N, NB=NB, NPAD=NPAD),
           dict(HEAD_DIM=D, BLOCK=V_BLOCK, HAS_PERM=perm is not None, V_SMOOTH=v_smooth,
                SOFTWARE_ROUNDING=interpreting(), PV_PERM=False),
           pipeline.V_PREPASS_WARPS, None)
    return {"vt": vt, "scale": scale_out, "mu": mu, "mu_scaled": mu_scaled, "pv_perm": False}


def prepare_mma(launch, q, k, v, *, v_smooth=True, perm=None, sm_scale=None, key_bias=None):
    """attention_mma.prepare_mma."""
    B, H, M, D = q.shape
    N = k.shape[2]
    sm_scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    perm_flat = None if perm is None else perm.reshape(B * H, N).contiguous()
    k_mean = smoothing_mean(k).reshape(B * H, D).contiguous()
    q_codes, q_scales, q_bad = pipeline.quantize_qk_blocks(launch, q)
    q_scales = fold_score_scale(q_scales, sm_scale)
    k_codes, k_scales, k_bad_rows = pipeline.quantize_qk_blocks(launch, k, perm_flat, k_mean)
    k_bad = k_bad_rows.amax(dim=1)
    v_pre = quantize_v_residual_mma(launch, v, perm_flat, v_smooth)
    bias, k_bad = pipeline.key_bias_log2(key_bias, perm, k_bad, B, H, N)
    return (q_codes, q_scales, q_bad, k_codes, k_scales, k_bad, v_pre), bias


def mma_attention_fwd(launch, q_codes, q_scales, q_bad, k_codes, k_scales, k_bad, v_pre, out, H,
                      key_bias_log2=None, expcast=False, beta=EXPCAST_BETA):
    """attention_mma.mma_attention_fwd with its default tiles (the ones the cubins are built with)."""
    BH, M, D = q_codes.shape
    N = k_codes.shape[1]
    vt = v_pre["vt"]
    mu = v_pre["mu_scaled"]
    sb = pipeline.bias_strides(key_bias_log2)
    launch("vc_attention_mma_fwd_kernel", (cdiv(M, MMA_BLOCK_M), BH),
           dict(Q=q_codes, QS=q_scales, QBAD=q_bad, K=k_codes, KS=k_scales, KBAD=k_bad,
                VT=vt, VS=v_pre["scale"], MU=mu, BIAS=key_bias_log2, stride_bias_b=sb[0], stride_bias_h=sb[1],
                O=out, **dict(zip(("stride_ob", "stride_oh", "stride_om", "stride_od"), out.stride())),
                H=H, M=M, N=N, NPAD=vt.shape[-1], NBQ=q_scales.shape[1], NBK=k_scales.shape[1],
                NBV=0 if mu is None else mu.shape[1]),
           dict(HEAD_DIM=D, BLOCK_M=MMA_BLOCK_M, BLOCK_N=MMA_BLOCK_N, RUN_TILES=MMA_RUN_TILES, QK_BLK=QK_BLOCK,
                V_BLK=V_BLOCK, HAS_MEAN=mu is not None, HAS_BIAS=key_bias_log2 is not None,
                EXPCAST=bool(expcast), BETA=float(beta), SOFTWARE_ROUNDING=interpreting(), PV_ACC16=True,
                ROWSUM_CUDA=False),
           MMA_NUM_WARPS, MMA_NUM_STAGES)
    return out


def mma_vc_attention(launch, q, k, v, out, *, v_smooth=True, expcast=False, perm=None, sm_scale=None,
                     key_bias=None, beta=EXPCAST_BETA):
    """attention_mma.mma_vc_attention through `launch` (a pipeline.py launcher: the cubins)."""
    operands, bias = prepare_mma(launch, q, k, v, v_smooth=v_smooth, perm=perm, sm_scale=sm_scale,
                                 key_bias=key_bias)
    return mma_attention_fwd(launch, *operands, out, q.shape[1], key_bias_log2=bias, expcast=expcast, beta=beta)
