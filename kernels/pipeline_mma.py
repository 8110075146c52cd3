"""The mma.sync attention kernel's host code (kernels/triton/attention_mma.py), without Triton.

The kernel's module imports Triton; the precompiled backend launches the same kernel's cubins on
sm_89 / sm_120 where Triton may be missing. Both run this code with their own launcher (Triton's
JIT there, the cubins in kernels/precompiled/), so the pre-pass kernels, grids, arguments,
constexprs, warps and stages are the same by construction and a cubin built by the same Triton
gives the JIT's bits.
"""

import torch

from . import pipeline
from .pipeline import cdiv, interpreting
from .reference.expcast import EXPCAST_BETA
from .reference.quant import INT8_MAX, QK_BLOCK, fold_score_scale, smoothing_mean, true_div
from .reference.vsmooth import V_BLOCK
from .reference.workstation import INT8_P_KEYS, INT8_Q_BLOCK, V_MAX

MMA_BLOCK_M, MMA_BLOCK_N, MMA_RUN_TILES, MMA_NUM_WARPS, MMA_NUM_STAGES = 128, 64, 2, 8, 3
# The INT8 P.V path's tiles: one 128-key tile per V block (P's bytes against its row max)
MMA_INT8_BLOCK_N, MMA_INT8_RUN_TILES = INT8_P_KEYS, V_BLOCK // INT8_P_KEYS
MMA_INT8_Q_TOKEN = INT8_Q_BLOCK == 1  # and its Q: one scale per token
# The exp2 argument as one FFMA with the score scale folded (online_max_scaled): the kernel's
# default for EXP2_FMA (precompiled builds that do not name it get this value). On: 60 (sm_120) / 56
# (sm_89) fewer instructions per run of 128 keys per warp; the same tensor instructions, MUFU.EX2
# and shared memory (tests/kernels/test_workstation_sass.py).
MMA_EXP2_FMA = True


def quantize_v_residual_mma(launch, v, perm=None, v_smooth=True, v_max=V_MAX, int8=False):
    """The V pre-pass of pipeline.quantize_v_residual with the residual codes at most v_max (1.75):
    the same block statistics and code kernels, another per-channel scale (amax / v_max). int8: the
    INT8 P.V path's codes instead, integers in [-127, 127] with one scale s_b per (128-row block,
    channel) (amax / 127): "ratio" [BH, NB, D] = s_(b-1) / s_b (1 for b = 0), by which the kernel
    rescales its accumulator as block b starts, "mu_scaled" = mu / s_b per block, and "scale" the
    last block's s_b (the kernel's final per-channel factor; NaN for a channel that held NaN / inf)."""
    B, H, N, D = v.shape
    BH = B * H
    NB = cdiv(N, V_BLOCK)
    NPAD = NB * V_BLOCK
    mu, amax, bad = pipeline.v_block_stats(launch, v, perm, v_smooth)
    bad_channel = bad.amax(dim=1) != 0
    if int8:  # every block's amax is finite and >= 0
        scale = torch.where(amax > 0, true_div(amax, INT8_MAX), torch.ones_like(amax))  # [BH, NB, D]
        ratio = torch.ones_like(scale)
        ratio[:, 1:] = scale[:, :-1] / scale[:, 1:]  # IEEE division
        scale_out = torch.where(bad_channel, torch.full_like(scale[:, -1], float("nan")), scale[:, -1])
    else:
        amax = amax.amax(dim=1)  # [BH, D]
        scale = torch.where(amax > 0, true_div(amax, v_max), torch.ones_like(amax))
        scale_out = torch.where(bad_channel, torch.full_like(scale, float("nan")), scale)
    vt = torch.empty((BH, D, NPAD), dtype=torch.int8 if int8 else torch.float8_e4m3fn, device=v.device)
    mu_scaled = torch.empty((BH, NB, D), dtype=torch.float32, device=v.device) if v_smooth else None
    strides = dict(zip(("stride_vb", "stride_vb_h", "stride_vn", "stride_vd"), v.stride()))
    launch("v_quantize_kernel", (NB, BH),
           dict(V=v, **strides, PERM=perm, MU=mu, SCALE=scale, VT=vt, MU_SCALED=mu_scaled, MU_TF32=None,
                H=H, N=N, NB=NB, NPAD=NPAD),
           dict(HEAD_DIM=D, BLOCK=V_BLOCK, HAS_PERM=perm is not None, V_SMOOTH=v_smooth,
                SOFTWARE_ROUNDING=interpreting(), PV_PERM=False,
                **({"INT8": True, "SCALE_PER_BLOCK": True} if int8 else {})),
           pipeline.V_PREPASS_WARPS, None)
    out = {"vt": vt, "scale": scale_out, "mu": mu, "mu_scaled": mu_scaled, "pv_perm": False}
    if int8:
        out["ratio"] = ratio
    return out


def int8_column_sums(vt, block_n):
    """The INT8 P.V path's per-(key tile, channel) constant, [BH, NPAD / block_n, D] int32:
    0x4B400000 + 128 * sum of the tile's V codes. The kernel writes P~ - 128 as a signed byte; adding
    this to its INT32 product gives the bits of the fp32 1.5 * 2^23 + P~ V (attention_mma.py)."""
    BH, D, NPAD = vt.shape
    sums = vt.view(BH, D, NPAD // block_n, block_n).sum(dim=-1, dtype=torch.int32)
    return (sums * 128 + 0x4B400000).transpose(1, 2).contiguous()


def prepare_mma(launch, q, k, v, *, v_smooth=True, perm=None, sm_scale=None, key_bias=None, pv_int8=False,
                q_token=None):
    """pipeline.prepare_8bit with quantize_v_residual_mma: ((q_codes, q_scales, q_bad, k_codes,
    k_scales, k_bad, v_pre), key_bias_log2); pv_int8: V's codes for the INT8 P.V path; q_token: one
    Q scale per token (q_scales [BH, M]; None: the path's default, on for the INT8 path)."""
    q_token = mma_q_token(pv_int8, q_token)
    B, H, M, D = q.shape
    N = k.shape[2]
    sm_scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    perm_flat = None if perm is None else perm.reshape(B * H, N).contiguous()
    k_mean = smoothing_mean(k).reshape(B * H, D).contiguous()
    q_codes, q_scales, q_bad = pipeline.quantize_qk_blocks(launch, q, per_row=q_token)
    q_scales = fold_score_scale(q_scales, sm_scale)
    k_codes, k_scales, k_bad_rows = pipeline.quantize_qk_blocks(launch, k, perm_flat, k_mean)
    k_bad = k_bad_rows.amax(dim=1)
    v_pre = quantize_v_residual_mma(launch, v, perm_flat, v_smooth, int8=pv_int8)
    bias, k_bad = pipeline.key_bias_log2(key_bias, perm, k_bad, B, H, N)
    return (q_codes, q_scales, q_bad, k_codes, k_scales, k_bad, v_pre), bias


def mma_constexprs(D, *, block_m, block_n, run_tiles, v_smooth, has_bias, expcast, beta,
                   software_rounding, pv_acc16, rowsum_cuda, exp2_fma=None, expcast_tail=None, pv_int8=False,
                   q_token=False):
    """The kernel's constexprs for a launch. Options added after the precompiled specs were written
    (exp2_fma, expcast_tail, pv_int8, q_token) enter only when set (None / False: the kernel's default), so
    the default launch names what kernels/precompiled/specs.py builds."""
    c = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, RUN_TILES=run_tiles, QK_BLK=QK_BLOCK,
             V_BLK=V_BLOCK, HAS_MEAN=bool(v_smooth), HAS_BIAS=bool(has_bias), EXPCAST=bool(expcast),
             BETA=float(beta), SOFTWARE_ROUNDING=bool(software_rounding), PV_ACC16=bool(pv_acc16),
             ROWSUM_CUDA=bool(rowsum_cuda))
    if exp2_fma is not None:
        c["EXP2_FMA"] = bool(exp2_fma)
    if expcast_tail is not None:
        c["EXPCAST_TAIL"] = bool(expcast_tail)
    if pv_int8:
        c["PV_INT8"] = True
    if q_token:
        c["Q_TOKEN"] = True
    return c


def mma_tiles(pv_int8, block_n=None, run_tiles=None):
    """(block_n, run_tiles) of a launch: those given, else the path's own (the INT8 path's runs are
    its V blocks, so its run length follows from block_n)."""
    if block_n is None:
        block_n = MMA_INT8_BLOCK_N if pv_int8 else MMA_BLOCK_N
    if run_tiles is None:
        run_tiles = V_BLOCK // block_n if pv_int8 else MMA_RUN_TILES
    return block_n, run_tiles


def mma_q_token(pv_int8, q_token=None):
    """Whether a launch takes one Q scale per token: as given, else the path's own (the INT8 path's)."""
    return pv_int8 and MMA_INT8_Q_TOKEN if q_token is None else bool(q_token)


def _check_tiles(block_m, block_n, run_tiles):
    if QK_BLOCK % block_m:
        raise ValueError(f"block_m must divide {QK_BLOCK}, got {block_m}")
    if run_tiles < 1 or V_BLOCK % (block_n * run_tiles):
        raise ValueError(f"a run (block_n x run_tiles = {block_n} x {run_tiles}) must divide the "
                         f"{V_BLOCK}-row V-Smooth block")


def mma_attention_fwd(launch, q_codes, q_scales, q_bad, k_codes, k_scales, k_bad, v_pre, out, H,
                      key_bias_log2=None, expcast=False, beta=EXPCAST_BETA, block_m=MMA_BLOCK_M,
                      block_n=None, run_tiles=None, num_warps=MMA_NUM_WARPS,
                      num_stages=MMA_NUM_STAGES, pv_acc16=True, rowsum_cuda=False, software_rounding=None,
                      exp2_fma=None, expcast_tail=None, lse=None):
    """Launch the fused kernel on operands from prepare_mma. out: [B, H, M, D] view (any strides).
    exp2_fma: None = the kernel's default (MMA_EXP2_FMA); expcast_tail: None = the kernel's default
    (reference/expcast.py::TAIL_ON); lse: [BH, M] fp32 for each row's log2 LSE, or None. The INT8
    P.V path runs where v_pre holds INT8 codes (prepare_mma(pv_int8=True)). block_n / run_tiles:
    None = the path's own (MMA_BLOCK_N x MMA_RUN_TILES; INT8: MMA_INT8_BLOCK_N x MMA_INT8_RUN_TILES)."""
    vt = v_pre["vt"]
    pv_int8 = vt.dtype == torch.int8
    block_n, run_tiles = mma_tiles(pv_int8, block_n, run_tiles)
    _check_tiles(block_m, block_n, run_tiles)
    BH, M, D = q_codes.shape
    N = k_codes.shape[1]
    mu = v_pre["mu_scaled"]
    if pv_int8 and expcast:
        raise ValueError("ExpCast writes FP8 bytes: the INT8 P.V path takes exp2 (expcast=False)")
    q_token = q_scales.shape[1] == M and M > cdiv(M, QK_BLOCK)  # one Q scale per token (prepare_mma)
    if q_token and not pv_int8:
        raise ValueError("one Q scale per token is an option of the INT8 P.V path")
    if pv_int8 and block_n * run_tiles != V_BLOCK:
        raise ValueError(f"the INT8 P.V path's runs are its {V_BLOCK}-row V blocks (block_n x run_tiles = "
                         f"{block_n} x {run_tiles})")
    vcs = int8_column_sums(vt, block_n) if pv_int8 else None
    sb = pipeline.bias_strides(key_bias_log2)
    sr = interpreting() if software_rounding is None else software_rounding
    launch("vc_attention_mma_fwd_kernel", (cdiv(M, block_m), BH),
           dict(Q=q_codes, QS=q_scales, QBAD=q_bad, K=k_codes, KS=k_scales, KBAD=k_bad,
                VT=vt, VS=v_pre["scale"], MU=mu, VCS=vcs, VRATIO=v_pre.get("ratio"), BIAS=key_bias_log2,
                stride_bias_b=sb[0], stride_bias_h=sb[1],
                O=out, **dict(zip(("stride_ob", "stride_oh", "stride_om", "stride_od"), out.stride())), LSE=lse,
                H=H, M=M, N=N, NPAD=vt.shape[-1], NBQ=q_scales.shape[1], NBK=k_scales.shape[1],
                NBV=0 if mu is None else mu.shape[1]),
           mma_constexprs(D, block_m=block_m, block_n=block_n, run_tiles=run_tiles, v_smooth=mu is not None,
                          has_bias=key_bias_log2 is not None, expcast=expcast, beta=beta,
                          software_rounding=sr, pv_acc16=pv_acc16, rowsum_cuda=rowsum_cuda,
                          exp2_fma=exp2_fma, expcast_tail=expcast_tail, pv_int8=pv_int8, q_token=q_token),
           num_warps, num_stages)
    return out


def mma_vc_attention(launch, q, k, v, out, *, v_smooth=True, expcast=False, perm=None, sm_scale=None,
                     key_bias=None, beta=EXPCAST_BETA, lse=None, pv_int8=False, q_token=None, **options):
    """The whole 8-bit pipeline for mma.sync GPUs through `launch` (a pipeline.py launcher): pre-pass,
    then the fused kernel; arguments as attention_mma.mma_vc_attention (lse: as
    pipeline.vc_attention_8bit's; pv_int8: the INT8 P.V path; q_token: prepare_mma's)."""
    operands, bias = prepare_mma(launch, q, k, v, v_smooth=v_smooth, perm=perm, sm_scale=sm_scale,
                                 key_bias=key_bias, pv_int8=pv_int8, q_token=q_token)
    lse2 = pipeline.lse_buffer(q, lse)
    mma_attention_fwd(launch, *operands, out, q.shape[1], key_bias_log2=bias, expcast=expcast,
                      beta=beta, lse=lse2, **options)
    pipeline.fill_lse(lse, lse2, q, k, sm_scale, operands)
    return out
