"""Host-side logic of the 8-bit path, without Triton: shapes, buffers, grids, launch arguments.

The Triton kernels (kernels/triton/) and the precompiled cubins (kernels/precompiled/) run the same
host code; only the launcher differs. A launcher is a callable

    launch(kernel, grid, args, constexprs, num_warps, num_stages)

kernel: the kernel's name ("vc_attention_fwd_kernel", ...); grid: a tuple; args: the run-time
arguments by name, in the kernel's order (tensors, ints, floats, None for an absent pointer);
constexprs: the compile-time ones by name; num_stages None: Triton's default. Nothing here imports
Triton, so the precompiled path runs where Triton is missing or broken.
"""

import os

import torch

from .reference.attention import smoothed_lse
from .reference.expcast import EXPCAST_BETA, P_BETA, TAIL_ON, p_format_of  # noqa: F401  (EXPCAST_BETA: re-exported)
from .reference.quant import LOG2E, QK_BLOCK, fold_score_scale, smoothing_mean
from .reference.vsmooth import V_BLOCK

# What every 8-bit kernel (Triton, cubins, Hopper, mma.sync) takes: the backend registry
# (kernels/dispatch.py) and the cubin build (precompiled/specs.py) read these.
HEAD_DIMS = (64, 128)
IO_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Warps of the Q/K quantiser's program (one 128-token block): 16 rather than 4 halves its time on Q
# at the real shapes and takes 5-10% off K's (H200, benchmarks/results/prepass_warps_h200_2026-11-29.log;
# the same bits: every output compared); the V pre-pass is fastest with 4, so it keeps them.
QK_QUANT_WARPS = 16
V_PREPASS_WARPS = 4
V_STATS_BLOCK_D = 64  # channels per program of v_block_stats_kernel (of 32 / 64 / 128, the fastest)
V_SCALE_BLOCKS = 32  # 128-row blocks per step of v_scale_kernel's reduction
# The portable kernel's launch (the JIT and its cubins alike). One warpgroup per program of 64 query
# rows: two programs share an SM and each one's softmax overlaps the other's matmuls (a 128-row
# program of two warpgroups runs both in step, between CTA-wide barriers). V^T in the P.V operand's
# key order (pv_key): P goes from the score accumulator into the P.V operand without shuffles.
# H200, 2026-12-02, same run, kernel alone: 1.04-1.10x FlashAttention-4 at the four real shapes against
# 0.85-0.89x with 128 rows and 8 warps (BENCHMARKS.md); the same choice on sm_100, not measured there.
PORTABLE_BLOCK_M = 64
PORTABLE_NUM_WARPS = 4
PORTABLE_NUM_STAGES = 3
PORTABLE_PV_PERM = True


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


ROWSUM_ONES = 16  # rows of the ones operand: the narrowest dot Triton builds (its N >= 16)
_ONES = {}


def ones_rows(device, npad: int) -> torch.Tensor:
    """[16, npad] E4M3 ones, read by the portable kernel's row-sum dot as V^T is read (row stride
    npad), so they reach shared memory through the same pipelined copies. One per device and width,
    kept (16 bytes a key: 1.2 MB at Wan2.2-14B 720p); never written after it is made."""
    key = (str(device), int(npad))
    t = _ONES.get(key)
    if t is None:
        if len(_ONES) >= 8:  # a run sees a few sequence lengths; a long-running process may see more
            _ONES.clear()
        t = _ONES[key] = torch.ones(ROWSUM_ONES, npad, device=device).to(torch.float8_e4m3fn)
    return t


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels then run on the CPU through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def jit_launcher(*namespaces):
    """A launcher (see above) over @triton.jit kernels, found by name in these namespaces (a module's
    globals(), vars(module)) at launch time. Each Triton module builds its own from the kernels it
    defines and imports, so the kernel modules never import a launcher that imports them back."""

    def launch(kernel, grid, args, constexprs, num_warps, num_stages=None):
        fn = next((ns[kernel] for ns in namespaces if kernel in ns), None)
        if fn is None:
            raise KeyError(f"no Triton kernel {kernel!r} in this launcher's modules")
        options = {"num_warps": num_warps}
        if num_stages is not None:
            options["num_stages"] = num_stages
        fn[grid](**args, **constexprs, **options)

    return launch


def pv_key(a: int) -> int:
    """Which key of a 32-key chunk sits in column a of V^T when the pre-pass writes it in wgmma
    order (pv_perm=True). Hopper's m64nNk32 score accumulator gives each thread keys {2i, 2i + 1, 8 +
    2i, 9 + 2i, 16 + 2i, ...} of a chunk; the 8-bit A operand of the next wgmma wants operand
    positions {4i .. 4i + 3, 16 + 4i .. 16 + 4i + 3} (i = lane % 4, PTX ISA "wgmma register
    fragments"). Position a = (a4 a3 a2 a1 a0 in bits) holds key (a4 a1 a3 a2 a0): a permutation of
    the bits, so P's bytes are already in place if V^T's column a holds that key. The sum over keys
    does not care which order the columns come in. (prepass.py's PV_PERM gathers key pv_key(a) into
    column a; the Triton twin and the Gluon kernel permute P the same way.)"""
    return (a & 17) | ((a & 2) << 2) | ((a >> 1) & 6)


def _strides(x, prefix, names=("b", "h", "n", "d")):
    return {f"{prefix}{n}": s for n, s in zip(names, x.stride())}


# --- pre-pass (kernels/triton/prepass.py) ----------------------------------------------------

def quantize_qk_blocks(launch, x, perm=None, mean=None, fmt="int8", per_row=False):
    """x: [B, H, N, D] (any strides) -> codes [B*H, N, D] (int8, or float8_e4m3fn for fmt="fp8"),
    scales fp32 [B*H, NB] (per_row, int8 only: [B*H, N], one scale per token), bad_rows int8 [B*H, N].

    perm: [B*H, N] int64 gather (x'[t] = x[perm[t]]) or None; mean: [B*H, D] fp32 subtracted or None.
    """
    if fmt not in ("int8", "fp8"):
        raise ValueError(f"Q/K format must be 'int8' or 'fp8', got {fmt!r}")
    if per_row and fmt != "int8":
        raise ValueError("one scale per token is an INT8 option")
    B, H, N, D = x.shape
    NB = cdiv(N, QK_BLOCK)
    code_dtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    codes = torch.empty((B * H, N, D), dtype=code_dtype, device=x.device)
    scales = torch.empty((B * H, N if per_row else NB), dtype=torch.float32, device=x.device)
    bad_rows = torch.empty((B * H, N), dtype=torch.int8, device=x.device)
    constexprs = dict(HEAD_DIM=D, BLOCK=QK_BLOCK, HAS_PERM=perm is not None, HAS_MEAN=mean is not None,
                      FP8=fmt == "fp8", SOFTWARE_ROUNDING=interpreting())
    if per_row:  # named only when set: the launches (and cubins) without it stay as they were
        constexprs["PER_ROW"] = True
    launch("quantize_qk_block_kernel", (NB, B * H),
           dict(X=x, **_strides(x, "stride_x"), PERM=perm, MEAN=mean, CODES=codes, SCALES=scales,
                BAD_ROWS=bad_rows, H=H, N=N, NB=NB),
           constexprs, QK_QUANT_WARPS, None)
    return codes, scales, bad_rows


def quantize_v_residual(launch, v, perm=None, v_smooth=True, software_rounding=None, pv_perm=False,
                        mu_tf32=False, v_terms=1):
    """v: [B, H, N, D] (any strides) -> dict with
        vt      fp8 e4m3 [B*H, D, NPAD]  residual codes, transposed, NPAD = N rounded up to 128
                                          (pv_perm: columns of each 32-key chunk in pv_key order)
        vt_lo   fp8 e4m3 [B*H, D, NPAD]  with v_terms=2 only: V's second E4M3 term, laid out as vt
                                          (reference/quant.py::e4m3_second_term)
        pv_perm bool                     which column order vt has (the kernels read it)
        scale   fp32 [B*H, D]             per-channel scale (NaN where the channel held NaN/inf)
        mu      bf16 [B*H, NB, D] or None block means
        mu_scaled fp32 [B*H, NB, D] or None  mu / scale (the kernel adds r_ij * mu_scaled)
        mu_tf32_pairs fp32 [B*H*NB*D, 8]  with mu_tf32 and V-Smooth only: the Hopper kernel's B
                                          operand of the mean (mu_tf32_pairs)
    Three kernels: the block statistics, the per-channel scales (v_scale_kernel), the codes and the
    scaled means; no torch arithmetic in between (at the small real shapes those launches took
    about 1% of the attention kernel's time).
    """
    B, H, N, D = v.shape
    BH = B * H
    NB = cdiv(N, V_BLOCK)
    NPAD = NB * V_BLOCK
    dev = v.device
    mu, amax, bad = v_block_stats(launch, v, perm, v_smooth)
    grid = (NB, BH)
    strides = dict(zip(("stride_vb", "stride_vb_h", "stride_vn", "stride_vd"), v.stride()))
    # scale: what the codes are made with; scale_out: the same, NaN for a channel that held NaN/inf
    scale = torch.empty((BH, D), dtype=torch.float32, device=dev)
    scale_out = torch.empty((BH, D), dtype=torch.float32, device=dev)
    launch("v_scale_kernel", (BH,), dict(AMAX=amax, BAD=bad, SCALE=scale, SCALE_OUT=scale_out, NB=NB),
           dict(HEAD_DIM=D, BLOCK_B=V_SCALE_BLOCKS), V_PREPASS_WARPS, None)
    vt = torch.empty((BH, D, NPAD), dtype=torch.float8_e4m3fn, device=dev)
    if v_terms not in (1, 2):
        raise ValueError(f"v_terms is 1 or 2 (V's residual in one or two E4M3 terms), got {v_terms!r}")
    extra = {"VT_LO": torch.empty_like(vt)} if v_terms == 2 else {}
    mu_scaled = torch.empty((BH, NB, D), dtype=torch.float32, device=dev) if v_smooth else None
    mu_tf32_pairs = torch.empty((BH * NB * D, 8), dtype=torch.float32, device=dev) if v_smooth and mu_tf32 else None
    launch("v_quantize_kernel", grid,
           dict(V=v, **strides, PERM=perm, MU=mu, SCALE=scale, VT=vt, MU_SCALED=mu_scaled, MU_TF32=mu_tf32_pairs,
                H=H, N=N, NB=NB, NPAD=NPAD, **extra),
           dict(HEAD_DIM=D, BLOCK=V_BLOCK, HAS_PERM=perm is not None, V_SMOOTH=v_smooth,
                SOFTWARE_ROUNDING=interpreting() if software_rounding is None else bool(software_rounding),
                PV_PERM=bool(pv_perm)),
           V_PREPASS_WARPS, None)
    out = {"vt": vt, "scale": scale_out, "mu": mu, "mu_scaled": mu_scaled, "pv_perm": bool(pv_perm)}
    if mu_tf32_pairs is not None:
        out["mu_tf32_pairs"] = mu_tf32_pairs
    if extra:
        out["vt_lo"] = extra["VT_LO"]
    return out


def v_block_stats(launch, v, perm=None, v_smooth=True, mean_group=V_BLOCK):
    """v: [B, H, N, D] (any strides) -> per 128-row block (after the permutation perm, [B*H, N] or
    None) and channel: mu bf16 [B*H, NB * 128 / mean_group, D] (V-Smooth's means of each mean_group
    rows: the block means, or the 4-bit path's group means; None without V-Smooth), amax fp32
    [B*H, NB, D] (max |residual|), bad int8 [B*H, NB, D] (the block held NaN/inf there). The first
    kernel of the 8-bit V pre-pass, and of the NVFP4 one (kernels/triton/attention_fp4.py)."""
    B, H, N, D = v.shape
    BH = B * H
    NB = cdiv(N, V_BLOCK)
    if mean_group <= 0 or V_BLOCK % mean_group:
        raise ValueError(f"mean_group must divide {V_BLOCK}, got {mean_group}")
    mu = (torch.empty((BH, NB * (V_BLOCK // mean_group), D), dtype=torch.bfloat16, device=v.device)
          if v_smooth else None)
    amax = torch.empty((BH, NB, D), dtype=torch.float32, device=v.device)
    bad = torch.empty((BH, NB, D), dtype=torch.int8, device=v.device)
    strides = dict(zip(("stride_vb", "stride_vb_h", "stride_vn", "stride_vd"), v.stride()))
    block_d = min(V_STATS_BLOCK_D, D)
    consts = dict(HEAD_DIM=D, BLOCK=V_BLOCK, BLOCK_D=block_d, HAS_PERM=perm is not None, V_SMOOTH=v_smooth)
    if mean_group != V_BLOCK:  # only then: the 8-bit launch keeps the name of its precompiled build
        consts["MEAN_GROUP"] = mean_group
    launch("v_block_stats_kernel", (NB, BH, D // block_d),
           dict(V=v, **strides, PERM=perm, MU=mu, AMAX=amax, BAD=bad, H=H, N=N, NB=NB),
           consts, V_PREPASS_WARPS, None)
    return mu, amax, bad


def mu_tf32_pairs(mu_scaled):
    """The Hopper kernel's 3xTF32 B operand of the V-Smooth means (kernels/gluon/attention_sm90.py,
    mean_mma), readable: from mu_scaled [BH, NB, D] -> [BH * NB * D, 8], block b's rows holding in
    columns 4-7 (hi, lo, hi, 0) of block b (hi: mu with the low 13 mantissa bits cleared, lo = mu -
    hi, exact) and in columns 0-3 the same of block b - 1 (zeros for b = 0): against the kernel's A
    columns (r_hi, r_hi, r_lo), one tile in columns 4-7, or (the pair loop) two consecutive tiles in
    one wgmma. v_quantize_kernel writes the same bits in the pre-pass
    (quantize_v_residual(mu_tf32=True)); the kernel's launch builds it with this where a pre-pass
    did not."""
    BH, NB, D = mu_scaled.shape
    mu = mu_scaled.float()
    hi = (mu.view(torch.int32) & -8192).view(torch.float32)
    out = mu.new_zeros(BH, NB, D, 8)
    out[..., 4], out[..., 5], out[..., 6] = hi, mu - hi, hi
    out[:, 1:, :, :4] = out[:, :-1, :, 4:]
    return out.reshape(BH * NB * D, 8)


# --- attention (kernels/triton/attention.py) -------------------------------------------------

def vc_attention_fwd(launch, q_codes, q_scales, q_bad, k_codes, k_scales, k_bad, v_pre, out, H,
                     key_bias_log2=None, expcast=True, beta=None, block_n=128,
                     num_warps=PORTABLE_NUM_WARPS, num_stages=PORTABLE_NUM_STAGES, software_rounding=None,
                     pv_imprecise_acc=None, block_m=PORTABLE_BLOCK_M, expcast_tail=None, lse=None, p_e5m2=None):
    """Launch the fused kernel on prepared operands; see kernels/triton/attention.py vc_attention_fwd.
    expcast_tail enters the constexprs only when set (None: the kernel's default), P_E5M2 always, so
    the default launch names what kernels/precompiled/specs.py builds. beta None: the byte format's."""
    p_format = p_format_of(p_e5m2, expcast, TAIL_ON if expcast_tail is None else bool(expcast_tail))
    if p_format == "e5m2" and not expcast:
        raise ValueError("p_e5m2: ExpCast's bytes in E5M2 (exp2 + cast writes E4M3): pass expcast=True")
    if p_format == "e5m2" and expcast_tail:
        raise ValueError("ExpCast's tail piece is for E4M3's subnormal band: p_e5m2 has none to fix")
    beta = P_BETA[p_format] if beta is None else beta
    BH, M, D = q_codes.shape
    N = k_codes.shape[1]
    if V_BLOCK % block_n or QK_BLOCK % block_n:
        raise ValueError(f"block_n must divide {V_BLOCK}")
    BLOCK_M = block_m  # divides QK_BLOCK: one Q scale per program
    if QK_BLOCK % BLOCK_M:
        raise ValueError(f"block_m must divide {QK_BLOCK}")
    vt = v_pre["vt"]
    mu = v_pre["mu_scaled"]
    if pv_imprecise_acc is None:
        pv_imprecise_acc = block_n if mu is not None else 32
    pv_imprecise_acc = min(int(pv_imprecise_acc), block_n)
    NBV = 0 if mu is None else mu.shape[1]
    sb = bias_strides(key_bias_log2)
    grid = (cdiv(M, BLOCK_M), BH)
    constexprs = dict(HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=block_n, QK_BLK=QK_BLOCK, V_BLK=V_BLOCK,
                      HAS_MEAN=mu is not None, HAS_BIAS=key_bias_log2 is not None, EXPCAST=bool(expcast),
                      BETA=float(beta),
                      SOFTWARE_ROUNDING=interpreting() if software_rounding is None else bool(software_rounding),
                      QK_FP8=q_codes.dtype == torch.float8_e4m3fn,
                      PV_IMPRECISE_ACC=pv_imprecise_acc, PV_PERM=bool(v_pre.get("pv_perm", False)))
    if expcast_tail is not None:
        constexprs["EXPCAST_TAIL"] = bool(expcast_tail)
    constexprs["P_E5M2"] = p_format == "e5m2"
    extra = {"VT_LO": v_pre["vt_lo"]} if "vt_lo" in v_pre else {}  # V's second term: a second P.V dot
    launch("vc_attention_fwd_kernel", grid,
           dict(Q=q_codes, QS=q_scales, QBAD=q_bad, K=k_codes, KS=k_scales, KBAD=k_bad, **extra,
                VT=vt, ONES=ones_rows(vt.device, vt.shape[-1]), VS=v_pre["scale"], MU=mu,
                BIAS=key_bias_log2, stride_bias_b=sb[0], stride_bias_h=sb[1],
                O=out, **dict(zip(("stride_ob", "stride_oh", "stride_om", "stride_od"), out.stride())), LSE=lse,
                H=H, M=M, N=N, NPAD=vt.shape[-1], NBQ=q_scales.shape[1], NBK=k_scales.shape[1], NBV=NBV),
           constexprs, num_warps, num_stages)
    return out


def bias_strides(key_bias_log2):
    """(batch, head) strides of a [B|1, H|1, N] per-key bias, 0 along a broadcast dim or for None."""
    if key_bias_log2 is None:
        return 0, 0
    return (key_bias_log2.stride(0) if key_bias_log2.shape[0] > 1 else 0,
            key_bias_log2.stride(1) if key_bias_log2.shape[1] > 1 else 0)


def key_bias_log2(key_bias, perm, k_bad, B, H, N):
    """A per-key additive bias (broadcastable to [B, H, 1, N]) permuted with K and V and scaled to
    the log2 domain -> ([B, H, N] fp32 or None, k_bad with the (batch, head)s whose bias holds NaN)."""
    if key_bias is None:
        return None, k_bad
    bias = key_bias.float().expand(B, H, 1, N).reshape(B, H, N)
    if perm is not None:
        bias = torch.gather(bias, 2, perm.long())  # gather takes int64 indices; a kept plan's are int32
    k_bad = k_bad | torch.isnan(bias).any(dim=-1).reshape(B * H).to(torch.int8)
    return (bias * LOG2E).contiguous(), k_bad


def vc_attention_8bit(launch, q, k, v, out, *, v_smooth=True, expcast=True, perm=None, sm_scale=None,
                      key_bias=None, beta=None, qk_format="int8", attention=None,
                      pv_perm=PORTABLE_PV_PERM, mu_tf32=False, lse=None, v_terms=1, **launch_options):
    """The whole 8-bit pipeline on [B, H, N, D] views (any strides): pre-pass, then the fused kernel.

    perm: [B, H, N] int64 or None; key_bias: broadcastable to [B, H, 1, N] or None; out: [B, H, M, D]
    view written in place (and returned). launch_options: block_n, num_warps, ... (vc_attention_fwd).
    attention: the fused kernel's host function, vc_attention_fwd's arguments without `launch`
    (None: vc_attention_fwd through `launch`; the Hopper Gluon kernel passes its own, with
    pv_perm=gluon.config.pv_perm_for(): V^T in the column order its P.V operand wants, pv_key;
    and mu_tf32=True: the pre-pass also writes its tf32 B operand of the V-Smooth means).
    lse: a [B, H, M] fp32 tensor to fill with each query row's log-sum-exp (natural log, of the
    scores softmax(Q K^T * sm_scale + bias) as the kernel sums them), or None; `attention` then
    takes an lse= [BH, M] fp32 for the kernel's log2 LSE on the smoothed K (the portable kernel and
    the Hopper one do). v_terms=2: V's residual in two E4M3 terms (quantize_v_residual's vt_lo), two
    FP8 P.V products per key tile (the portable and Hopper kernels).
    """
    if attention is None:
        def attention(*args, **kwargs):
            return vc_attention_fwd(launch, *args, **kwargs)
    operands, bias = prepare_8bit(launch, q, k, v, v_smooth=v_smooth, perm=perm, sm_scale=sm_scale,
                                  key_bias=key_bias, qk_format=qk_format, pv_perm=pv_perm, mu_tf32=mu_tf32,
                                  v_terms=v_terms)
    lse2 = lse_buffer(q, lse)
    if lse2 is not None:
        launch_options["lse"] = lse2
    attention(*operands, out, q.shape[1], key_bias_log2=bias, expcast=expcast, beta=beta, **launch_options)
    fill_lse(lse, lse2, q, k, sm_scale, operands)
    return out


def lse_buffer(q, lse):
    """The [BH, M] fp32 buffer a fused kernel writes its log2 LSE into, when the caller asked for
    the LSE (lse a [B, H, M] tensor), else None."""
    B, H, M, _ = q.shape
    return None if lse is None else torch.empty((B * H, M), dtype=torch.float32, device=q.device)


def fill_lse(lse, lse2, q, k, sm_scale, operands):
    """lse <- the natural-log LSE of the true scores from the kernel's log2 LSE on the smoothed K
    (reference.attention.smoothed_lse), NaN on the rows the kernel wrote NaN (operands: the pre-pass's
    (q_codes, q_scales, q_bad, k_codes, k_scales, k_bad, v_pre)). Nothing when lse is None."""
    if lse is None:
        return
    B, H, M, D = q.shape
    q_bad, k_bad = operands[2], operands[5]
    bad = ((q_bad != 0) | (k_bad != 0)[:, None]).view(B, H, M)
    lse.copy_(smoothed_lse(lse2.view(B, H, M), q, smoothing_mean(k), D ** -0.5 if sm_scale is None else sm_scale, bad))


def prepare_8bit(launch, q, k, v, *, v_smooth=True, perm=None, sm_scale=None, key_bias=None,
                 qk_format="int8", pv_perm=False, mu_tf32=False, v_terms=1):
    """The 8-bit pre-pass on [B, H, N, D] views: ((q_codes, q_scales, q_bad, k_codes, k_scales,
    k_bad, v_pre), key_bias_log2), the operands every fused kernel (Triton, Gluon, cubins) takes."""
    B, H, M, D = q.shape
    N = k.shape[2]
    sm_scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    perm_flat = None if perm is None else perm.reshape(B * H, N).contiguous()
    # K smoothing: the token mean, taken before the permutation by the reference's own call (to the
    # bit: smoothing_mean). A non-finite K makes it NaN; the quantiser flags those rows and the
    # whole (batch, head) becomes NaN, as in SDPA.
    k_mean = smoothing_mean(k).reshape(B * H, D).contiguous()
    q_codes, q_scales, q_bad = quantize_qk_blocks(launch, q, fmt=qk_format)
    q_scales = fold_score_scale(q_scales, sm_scale)
    k_codes, k_scales, k_bad_rows = quantize_qk_blocks(launch, k, perm_flat, k_mean, fmt=qk_format)
    k_bad = k_bad_rows.amax(dim=1)
    v_pre = quantize_v_residual(launch, v, perm_flat, v_smooth, pv_perm=pv_perm, mu_tf32=mu_tf32, v_terms=v_terms)
    bias, k_bad = key_bias_log2(key_bias, perm, k_bad, B, H, N)
    return (q_codes, q_scales, q_bad, k_codes, k_scales, k_bad, v_pre), bias


# --- k-means (kernels/triton/kmeans.py) ------------------------------------------------------

# 128 tokens x 32 centroids per step of the assignment: the fastest of 64/128 x 32/64 on the H200
# (128 x 64 needs more shared memory than it has: 3xTF32 keeps both halves of each operand).
KMEANS_BLOCK_T, KMEANS_BLOCK_C, KMEANS_BLOCK_R = 128, 32, 64
# The assignment's distance dot in 3xTF32 on the tensor cores: fp32-level accuracy (the small x small
# term is all it drops; a bf16 x is exact in TF32, so then only the centroid's split is approximate)
# at 5.7x the speed of the CUDA-core "ieee" dot (H200, Wan 480p: 3.74 -> 0.65 ms; the labels of 4
# heads equal a float64 argmin's).
KMEANS_DOT_PRECISION = "tf32x3"


def kmeans_assign(launch, x, centroids):
    """x: [B, H, N, D] (any strides), centroids: [G = B*H, C, D] fp32 -> labels [G, N] int64."""
    B, H, N, D = x.shape
    G = B * H
    C = centroids.shape[1]
    centroids = centroids.contiguous()
    cnorm = (centroids * centroids).sum(-1).contiguous()
    labels = torch.empty((G, N), dtype=torch.int64, device=x.device)
    launch("kmeans_assign_kernel", (cdiv(N, KMEANS_BLOCK_T), G),
           dict(X=x, **_strides(x, "stride_x"), C=centroids, CNORM=cnorm, LABELS=labels, H=H, N=N, NUM_C=C),
           dict(HEAD_DIM=D, BLOCK_T=KMEANS_BLOCK_T, BLOCK_C=KMEANS_BLOCK_C, DOT_PRECISION=KMEANS_DOT_PRECISION),
           4, None)
    return labels


def sort_by_label(labels, num_clusters):
    """Stable sort of the labels -> (order [G, N] int64, starts [G, C + 1] int64 cluster offsets)."""
    sorted_labels, order = torch.sort(labels, dim=-1, stable=True)
    bounds = torch.arange(num_clusters + 1, device=labels.device, dtype=labels.dtype)
    starts = torch.searchsorted(sorted_labels, bounds.expand(labels.shape[0], -1).contiguous())
    return order, starts


def kmeans_update(launch, x, order, starts, centroids):
    B, H, N, D = x.shape
    G = B * H
    C = centroids.shape[1]
    new = torch.empty_like(centroids)
    launch("kmeans_update_kernel", (C, G),
           dict(X=x, **_strides(x, "stride_x"), ORDER=order, STARTS=starts, C_OLD=centroids, C_NEW=new,
                H=H, N=N, NUM_C=C),
           dict(HEAD_DIM=D, BLOCK_R=KMEANS_BLOCK_R), 4, None)
    return new


def kmeans(launch, x, centroids, iters):
    """Lloyd iterations from the given centroids. x: [B, H, N, D]; centroids: [B*H, C, D] fp32.
    Returns (labels [G, N], centroids [G, C, D], order [G, N]: the stable sort of labels)."""
    C = centroids.shape[1]
    centroids = centroids.float().contiguous()
    for _ in range(iters):
        order, starts = sort_by_label(kmeans_assign(launch, x, centroids), C)
        centroids = kmeans_update(launch, x, order, starts, centroids)
    labels = kmeans_assign(launch, x, centroids)
    order, _ = sort_by_label(labels, C)
    return labels, centroids, order
