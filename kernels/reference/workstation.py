"""The 8-bit method as the mma.sync kernel computes it (RTX 4090 sm_89, RTX 5090 / PRO 6000 sm_120).

Same quantisers and P bytes as reference_vc_attention(bits=8) (attention.py), with two differences
that the workstation kernel (kernels/triton/attention_mma.py) needs:

- **P.V in FP16 inside a run of keys, FP32 across runs** ("fp32+fp16", SageAttention2++). GeForce
  tensor cores run FP8 with an FP16 accumulator at twice the FP32-accumulator rate. Per run of
  run_keys keys (inside one 128-row V-Smooth block):
      A16   <- fp16(fp16(alpha) A16) ; A16 <- fp16(A16 + P~_q R_q)   per tile, rounded to fp16
      r_run <- alpha r_run + r
      A     <- (prod alpha over the run) A + A16 + r_run mu^T            fp32, once per run
  so the mean term and the FP32 rescale are paid once per run, not per tile.
- **V's residual codes at most V_MAX = 448 / 2^8 = 1.75** (instead of 448) so that the FP16
  accumulator cannot overflow: P~ <= 256 (the byte of 2^8) and a run holds at most 128 keys, so
  |A16| <= 128 * 256 * 1.75 = 57,344 < 65,504. Against the 448-scaled codes these are the same codes
  times 2^-8 wherever they stay normal (|code| >= 2^-6 here, >= 4 there); smaller ones go onto the
  subnormal grid (step 2^-9): an absolute error of at most 2^-10 of a channel whose largest code is
  1.75, far below the E4M3 error of its large values.

pv_accumulation="fp32" is the same recurrence with FP32 everywhere (the kernel's PV_ACC16=False),
the "FP32 version" whose error the run length is held to. fp16_round_keys: how many keys the tensor
core sums before it rounds to FP16: None = a whole tile at once (Triton's interpreter), 32 for one
mma.sync m16n8k32 step (the hardware's granularity; its rounding inside a step is not specified and
is modelled as exact).

pv_accumulation="int8" is the INT8 P.V path (the kernel's PV_INT8; FIDELITY.md): V's residual as
INT8 with one scale per (128-row V-Smooth block, channel) (127 uniform steps, where E4M3 keeps 3
mantissa bits, and each block's own range), P as unsigned INT8 against each key tile's own row
maximum t, P.V exact in INT32 per tile (INT8 with INT32 accumulation runs at the full tensor rate on
GeForce cards), then into FP32 with the tile's factor 2^(t - m) and the block's scales s_b:
    p~   = round(255 * 2^(s - t))                          integers 0..255, ties to even
    A   <- alpha A + 2^(t - m') (p~ @ R_int8) s_b          p~ @ R_int8 exact in INT32
    r   <- alpha r + 2^(t - m') sum(p~)                    the same bytes (exact)
    A   <- A + r_run mu                                    once per run, mu in V's units
    O    = A / l
The 1/255 of P cancels between A and the row sum. No ExpCast (its byte is an E4M3 code).
"""

import math

import torch

from .attention import _expand_bias, _p_values, online_max_step, quantize_8bit
from .expcast import EXPCAST_BETA
from .quant import LOG2E, E4M3_MAX, QK_BLOCK, quantize_e4m3_per_channel, quantize_int8_per_block_channel
from .vsmooth import V_BLOCK, block_means, demean, permute_tokens

V_MAX = E4M3_MAX / 256.0  # 1.75: the largest V residual code of the FP16-accumulating kernel
FP16_MAX = 65504.0
PV_ACCUMULATIONS = ("fp16_run", "fp32", "int8")
P_U8_MAX = 255.0  # the INT8 path's P: unsigned bytes against the tile's row max
# The INT8 path's key tile, over which P's bytes share one row max: a whole 128-row V block. Against
# 64-key tiles it gives up 0.2-1.3 dB on the real-clip probes (FIDELITY.md) for 15% of the kernel's
# time on the proxy (BENCHMARKS.md): half the per-tile FP32 work, one tile per V block.
INT8_P_KEYS = 128
# The INT8 path's Q: one scale per token (Q per 128-token block elsewhere). With P and V in INT8 the
# Q/K term is the largest left: +0.9 dB on clean and +2.5 dB on broad heads of the real-clip probes
# (simulated, FIDELITY.md), at the kernel's cost of a per-row instead of a per-program scale.
INT8_Q_BLOCK = 1


def _fp16(x):
    return x.to(torch.float16).to(x.dtype)


def run_attention(q, k, v, *, q_scale, k_scale, key_bias_log2=None, mu=None, expcast=False,
                  beta=EXPCAST_BETA, block_n=64, run_keys=128, pv_accumulation="fp16_run",
                  fp16_round_keys=None, expcast_fold=False, v_block_scale=None, fold_scores=True,
                  dtype=torch.float32):
    """online_attention (attention.py) with P.V accumulated per run of run_keys keys (see above).
    q, k: codes as floats; q_scale [B, H, M] per-row factor (score scale folded in), k_scale
    [B, H, N]; v: residual codes; mu: [B, H, NB, D] means over the V scale, or None.
    v_block_scale: [B, H, NB, D] V scales per (block, channel) applied per tile (the INT8 path; mu
    then in V's units), or None."""
    if pv_accumulation not in PV_ACCUMULATIONS:
        raise ValueError(f"pv_accumulation must be one of {PV_ACCUMULATIONS}, got {pv_accumulation!r}")
    if V_BLOCK % run_keys or run_keys % block_n:
        raise ValueError(f"run_keys must divide {V_BLOCK} and be a multiple of block_n")
    acc16_mode = pv_accumulation == "fp16_run"
    int8_mode = pv_accumulation == "int8"
    if int8_mode and expcast:
        raise ValueError("ExpCast writes FP8 bytes: the INT8 P.V path takes exp2 (expcast=False)")
    p_mode = "expcast" if expcast else "exp2_cast"
    B, H, M, D = q.shape
    N = k.shape[2]
    q = q.to(dtype)
    m = torch.full((B, H, M), -math.inf, dtype=dtype, device=q.device)
    d = torch.zeros((B, H, M), dtype=dtype, device=q.device)
    l = torch.zeros((B, H, M), dtype=dtype, device=q.device)
    acc = torch.zeros((B, H, M, v.shape[-1]), dtype=dtype, device=q.device)
    for r0 in range(0, N, run_keys):
        a_run = torch.ones((B, H, M), dtype=dtype, device=q.device)
        r_run = torch.zeros_like(l)
        acc_run = torch.zeros_like(acc)
        for j0 in range(r0, min(r0 + run_keys, N), block_n):
            j1 = min(j0 + block_n, N)
            scale = q_scale.float()[..., None] * k_scale[:, :, None, j0:j1].float()
            x = q @ k[:, :, j0:j1].to(dtype).transpose(-1, -2)  # exact integers (codes)
            s = x * scale.to(dtype)
            if key_bias_log2 is not None:
                s = s + key_bias_log2[..., j0:j1].to(dtype)
            if int8_mode:
                # the kernel folds full tiles of full runs without a key bias (the rest are its masked tiles)
                folded = fold_scores and key_bias_log2 is None and j1 <= (N // run_keys) * run_keys
                p, c, m, alpha = _p_u8_tile(s, m, (x, scale[..., 0]) if folded else None)
                p = p.to(dtype)
                r = c * p.sum(dim=-1)
            else:
                c8 = 8.0 * scale[..., 0] if expcast and expcast_fold else None
                m, d, alpha, u = online_max_step(m, d, s, p_mode=p_mode, beta=beta, c8=c8)
                p = _p_values(u, p_mode, beta).to(dtype)
                r = p.sum(dim=-1)
            l = alpha * l + r
            r_run = alpha * r_run + r
            a_run = a_run * alpha
            vt = v[:, :, j0:j1].to(dtype)
            if int8_mode:  # an exact integer product (<= 128 * 255 * 127 < 2^22 per tile)
                pv = p @ vt
                if v_block_scale is not None:
                    pv = pv * v_block_scale[:, :, j0 // V_BLOCK, None, :].to(dtype)
                acc_run = alpha[..., None] * acc_run + c[..., None] * pv
            elif acc16_mode:
                acc_run = _fp16(acc_run * _fp16(alpha)[..., None])
                step = fp16_round_keys or (j1 - j0)
                for s0 in range(0, j1 - j0, step):
                    acc_run = _fp16(acc_run + p[..., s0:s0 + step] @ vt[:, :, s0:s0 + step])
            else:
                acc_run = alpha[..., None] * acc_run + p @ vt
        acc = a_run[..., None] * acc + acc_run
        if mu is not None:
            acc = acc + r_run[..., None] * mu[:, :, r0 // V_BLOCK, None, :].to(dtype)
    return acc / l[..., None]


def _p_u8_tile(s, m, fold=None):
    """The INT8 path's P for one tile of log2 scores s [B, H, M, n] -> (p~, c, m', alpha): p~ =
    round(255 * 2^(s - t)) with t the tile's row max, c = 2^(t - m') <= 1 its factor against the new
    running max m', alpha = 2^(m - m'). Rows with no finite score yet keep m = -inf (p~ = 0).
    fold = (x, scale): the kernel's full tiles without a key bias, s = x * scale from the exact
    integer dot x [B, H, M, n] and the tile's scale [B, H, M]. They keep 1.5 * 2^23 + x and take it
    off in the exponent with K, the row max's product rounded just above its exact value (one fp32
    multiply by scale (1 + 2^-22)): p~ = round(255 * 2^(s - t + eps)) with eps = exact - K < 0,
    and c = 2^(t - m' - eps) (attention_mma.py::_int8_pv, FOLD)."""
    t = s.amax(dim=-1)
    m_new = torch.maximum(m, t)
    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    t_safe = torch.where(torch.isneginf(t), m_safe, t)  # a tile with no finite score: p~ = 0, c = 1
    if fold is None:
        e = torch.exp2(s - t_safe[..., None])
        c = torch.exp2(t_safe - m_safe)
    else:
        x, scale = (a.float() for a in fold)
        x_m = x.amax(dim=-1) + 12582912.0  # exact: |x| < 2^21
        k_up = x_m * (scale * 1.0000002384185791)  # two fp32 multiplies, as the kernel
        eps = (x_m.double() * scale.double() - k_up.double()).float()  # one rounding (the FMA)
        u = ((x + 12582912.0).double() * scale.double()[..., None] - k_up.double()[..., None]).float()
        e = torch.exp2(u)
        c = torch.exp2((t_safe - m_safe) - eps)
    p = torch.round(e.double() * P_U8_MAX).to(s.dtype)  # the exact product rounded once (the FMA)
    return p, c, m_new, torch.exp2(m - m_safe)


def workstation_vc_attention(q, k, v, *, v_smooth=True, expcast=False, perm=None, sm_scale=None,
                             key_bias=None, beta=EXPCAST_BETA, block_n=None, run_keys=128,
                             pv_accumulation="fp16_run", fp16_round_keys=None, v_max=V_MAX,
                             dtype=torch.float32, q_block=None, fold_scores=True):
    """reference_vc_attention(bits=8) as the mma.sync kernel computes it: [B, H, N, D] -> fp32.
    Q/K INT8 per 128-token block (K smoothed), V residual E4M3 per channel with codes up to v_max,
    P by exp2 + cast (or ExpCast), P.V per pv_accumulation / run_keys (see the module docstring);
    pv_accumulation="int8": V residual INT8 per (128-row block, channel), P unsigned INT8 per tile
    (v_max unused). block_n: the key tile (None: the kernel's, 64 keys; INT8_P_KEYS for "int8");
    q_block: query rows per Q scale (None: the kernel's, 128; INT8_Q_BLOCK for "int8").
    fold_scores: "int8" only, the kernel's folded full tiles (_p_u8_tile); False: P~ against the exact
    row max everywhere, as the kernel's exp2_fma=False build and the fidelity simulation compute it."""
    if block_n is None:
        block_n = INT8_P_KEYS if pv_accumulation == "int8" else 64
    if q_block is None:
        q_block = INT8_Q_BLOCK if pv_accumulation == "int8" else QK_BLOCK
    B, H, M, D = q.shape
    N = k.shape[2]
    sm_scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    bias = None if key_bias is None else _expand_bias(key_bias, B, H, N, dtype)
    from .quant import smoothing_mean

    k_mean = smoothing_mean(k)
    if perm is not None:
        k, v = permute_tokens(k, perm), permute_tokens(v, perm)
        if bias is not None:
            bias = torch.gather(bias, 3, perm[:, :, None, :])
    bias_log2 = None if bias is None else bias * LOG2E
    qc, q_rows, kc, k_cols, _, _, _, bad = quantize_8bit(q, k, v, k_mean, v_smooth=v_smooth, sm_scale=sm_scale,
                                                         q_block=q_block)
    vf = v.float()
    vf = torch.where(torch.isfinite(vf), vf, torch.zeros((), device=vf.device))
    mu = block_means(vf) if v_smooth else None
    residual = demean(vf, mu) if v_smooth else vf
    block_scale = None
    if pv_accumulation == "int8":
        vc, block_scale, _ = quantize_int8_per_block_channel(residual, V_BLOCK)
        vs = torch.ones_like(block_scale[:, :, 0])  # the scales are applied per tile, mu in V's units
    else:
        vc, vs, _ = quantize_e4m3_per_channel(residual, max_code=v_max)
    mu_scaled = None if mu is None else mu / vs[:, :, None, :]
    o = run_attention(qc.float(), kc.float(), vc, q_scale=q_rows, k_scale=k_cols, key_bias_log2=bias_log2,
                      mu=mu_scaled, expcast=expcast, beta=beta, block_n=block_n, run_keys=run_keys,
                      pv_accumulation=pv_accumulation, fp16_round_keys=fp16_round_keys,
                      expcast_fold=expcast and bias is None, v_block_scale=block_scale,
                      fold_scores=fold_scores, dtype=dtype)
    o = o * vs[:, :, None, :].to(dtype)
    if bias is not None:
        bad = bad | torch.isnan(bias).any(dim=-1)[..., None]
    return torch.where(bad, torch.full_like(o, math.nan), o)
