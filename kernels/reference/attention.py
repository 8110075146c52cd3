"""The online-softmax recurrence of VC-Attention and the whole 8-bit pipeline, in plain PyTorch.

Per query row i and key tile j (block_n keys, aligned with V's 128-row mean blocks):

    s_ij  = scores in the log2 domain (scale and log2(e) folded in, plus any per-key bias)
    m'_i  = max(m_i, max_j s_ij);  alpha_i = 2^(m_i - m'_i);  u_ij = s_ij - m'_i  (<= 0)
            (ExpCast: m'_i is the max rounded up onto the grid (k + beta) / 8, see
             expcast.expcast_reference_point: one FMA per byte in the kernels; exact softmax
             would not change, ExpCast's bytes do a little: FIDELITY.md)
    P~_ij = P(u_ij)               exact 2^u, or the E4M3 byte of 2^(u+8) (exp2 + cast, or ExpCast)
    r_ij  = P~_ij 1               row sum of the *same* values that multiply V
    l_i  <- alpha_i l_i + r_ij
    A_i  <- alpha_i A_i + P~_ij R_j + r_ij mu_j^T      (mean restored from the row sum)
    O_i   = A_i / l_i

R is the (quantised) residual of V after its block mean mu was taken out; with mu = 0 this is the
ordinary online softmax. The recurrence runs tile by tile exactly as the kernels do, so that the P
bytes (which depend on the running max) are the same ones.
"""

import math

import torch

from .expcast import (CODES_PER_OCTAVE, EXPCAST_BETA, P_BETA, P_CARRY, P_FORMATS, TAIL_ON, decode_e4m3,
                      decode_e5m2, exp2_cast_codes, exp2_cast_codes_e5m2, expcast_codes, expcast_codes_e5m2,
                      expcast_fold_delta, expcast_reference_point, expcast_tail_codes, p_format_of)
from .nvfp4 import (NVFP4_BLOCK_N, NVFP4_MEAN_GROUP, NVFP4_SCALE_SEARCH, NVFP4_SEARCH, mean_operand_fp16,
                    nvfp4_block_values, quantize_nvfp4, quantize_p_nvfp4)
from .quant import (LOG2E, QK_BLOCK, QK_FORMATS, e4m3_second_term, fold_score_scale, quantize_e4m3_per_channel,
                    smooth_q, smoothing_mean)
from .vsmooth import V_BLOCK, block_means, demean, permute_tokens

P_MODES = ("exact", "exp2_cast", "expcast", "expcast_tail", "exp2_cast_e5m2", "expcast_e5m2", "nvfp4")
EXPCAST_MODES = ("expcast", "expcast_tail", "expcast_e5m2")  # the byte paths on ExpCast's grid reference point
# log2 of the factor each P path's values carry (the row sum l is in those units): the E4M3 bytes
# put the row maximum at 2^8 = 256, the E5M2 bytes at 2^15, NVFP4's values carry 6 x 448 = 2688 (nvfp4.py).
P_LOG2_CARRY = {"exact": 0.0, "exp2_cast": 8.0, "expcast": 8.0, "expcast_tail": 8.0,
                "exp2_cast_e5m2": P_CARRY["e5m2"], "expcast_e5m2": P_CARRY["e5m2"], "nvfp4": math.log2(6 * 448)}


def _codes_per_octave(p_mode):
    """ExpCast's grid: (k + beta) / 8 for E4M3 bytes, (k + beta) / 4 for E5M2 ones."""
    return CODES_PER_OCTAVE["e5m2" if p_mode.endswith("e5m2") else "e4m3"]

# The 8-bit options FIDELITY.md ("Error split") measured and chose, as keywords of
# reference_vc_attention, beyond the kernels' default (which the kernels match bit for bit). Per-token
# Q scales would fold into the per-row score factor (free; in no kernel yet); ExpCast's tail piece is
# in every kernel as a launch option (expcast_tail=True: one FFMA and two integer max per score).
FIDELITY_8BIT = dict(q_block=1, expcast_tail=True)


def exact_attention(q, k, v, sm_scale=None, key_bias=None, dtype=torch.float64):
    """softmax(Q K^T * scale + bias) V in high precision. [B, H, M, D], [B, H, N, D] -> [B, H, M, D]."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * sm_scale
    if key_bias is not None:
        s = s + key_bias.to(dtype)
    return torch.softmax(s, dim=-1) @ v.to(dtype)


def _p_values(u, p_mode, beta):
    if p_mode == "exact":
        return torch.exp2(u)
    if p_mode == "exp2_cast":
        return decode_e4m3(exp2_cast_codes(u))
    if p_mode == "expcast":
        return decode_e4m3(expcast_codes(u, beta))
    if p_mode == "expcast_tail":
        return decode_e4m3(expcast_tail_codes(u, beta))
    if p_mode == "exp2_cast_e5m2":
        return decode_e5m2(exp2_cast_codes_e5m2(u))
    if p_mode == "expcast_e5m2":
        return decode_e5m2(expcast_codes_e5m2(u, beta))
    if p_mode == "nvfp4":  # 4-bit: exp2, then NVFP4 per 16 keys; values carry 6 * 448 (nvfp4.py)
        return quantize_p_nvfp4(torch.exp2(u))
    raise ValueError(f"p_mode must be one of {P_MODES}, got {p_mode!r}")


def online_attention(q, k, v, *, score_scale, q_scale=None, k_scale=None, key_bias_log2=None,
                     mu=None, p_mode="exact", beta=EXPCAST_BETA, block_n=V_BLOCK,
                     dtype=torch.float32, expcast_fold=False, return_lse=False, mu_block=V_BLOCK):
    """The recurrence above. Shapes: q [B, H, M, D], k and v [B, H, N, D].

    score_scale: sm_scale * log2(e) (a float, or folded into q_scale by the caller)
    q_scale: [B, H, M] per-row factor (INT8 Q scales), k_scale: [B, H, N] per-key factor
    key_bias_log2: broadcastable to [B, H, 1, N], already multiplied by log2(e)
    mu: [B, H, ceil(N / mu_block), D] means in v's units, or None
    mu_block: keys per mean (V_BLOCK; the 4-bit path's NVFP4_MEAN_GROUP, 8): each tile restores
        its means from the row sums of P over each mean's keys
    expcast_fold: ExpCast's bytes as the INT8 kernels form them with the int32 -> fp32 conversion
        folded into the FMA (kernels/triton/online.py::expcast_fold): each tile's bytes against the
        reference point (k + beta - delta) / 8, delta = E - e, E = 1.5 * 2^23 c8, e the integer
        expcast_fold takes (floor of E in fp32 plus 1/2), with
        c8 = 8 q_scale k_scale score_scale the tile's fp32 scale, where c8 < 1/4 (else delta = 0);
        the rescale follows the point. (The kernels' other paths: no bias, E4M3 Q/K: delta = 0.)
    Returns O [B, H, M, D] in `dtype`; with return_lse also the log-sum-exp of each row's scores as
    this recurrence sums them, log2(sum_j P_j) at the final reference point, [B, H, M] in log2 units
    of the scores given (what merging the outputs of key chunks needs: sequence_parallel.py).
    """
    if block_n <= 0 or V_BLOCK % block_n:
        raise ValueError(f"block_n must divide {V_BLOCK} so a key tile never straddles two mean blocks")
    if mu_block <= 0 or V_BLOCK % mu_block or max(mu_block, block_n) % min(mu_block, block_n):
        raise ValueError(f"mu_block must divide {V_BLOCK} and divide or be a multiple of block_n={block_n}, "
                         f"got {mu_block}")
    B, H, M, D = q.shape
    N = k.shape[2]
    q = q.to(dtype)
    row_factor = torch.full((B, H, M), float(score_scale), dtype=dtype, device=q.device)
    if q_scale is not None:
        row_factor = q_scale.to(dtype) * float(score_scale)
    m = torch.full((B, H, M), -math.inf, dtype=dtype, device=q.device)
    d = torch.zeros((B, H, M), dtype=dtype, device=q.device)  # the previous tile's delta (expcast_fold)
    l = torch.zeros((B, H, M), dtype=dtype, device=q.device)
    acc = torch.zeros((B, H, M, v.shape[-1]), dtype=dtype, device=q.device)
    for j0 in range(0, N, block_n):
        j1 = min(j0 + block_n, N)
        s = q @ k[:, :, j0:j1].to(dtype).transpose(-1, -2)
        if k_scale is not None:  # one fp32 product of scales per score, as the kernels hold it
            scale = row_factor.float()[..., None] * k_scale[:, :, None, j0:j1].float()
            s = s * scale.to(dtype)
        else:
            s = s * row_factor[..., None]
        if key_bias_log2 is not None:
            s = s + key_bias_log2[..., j0:j1].to(dtype)
        # the tile's fp32 scale (one per 128 keys), times the grid's codes per octave: exact
        cpo = _codes_per_octave(p_mode)
        c8 = cpo * scale[..., 0] if p_mode in EXPCAST_MODES and expcast_fold and k_scale is not None else None
        m, d, alpha, u = online_max_step(m, d, s, p_mode=p_mode, beta=beta, c8=c8)
        p = _p_values(u, p_mode, beta).to(dtype)
        r = p.sum(dim=-1)
        l = alpha * l + r
        acc = alpha[..., None] * acc + p @ v[:, :, j0:j1].to(dtype)
        if mu is not None and mu_block >= block_n:
            acc = acc + r[..., None] * mu[:, :, j0 // mu_block, None, :].to(dtype)
        elif mu is not None:  # one row sum per mean's keys (a last partial group sums what it has)
            g0, g1 = j0 // mu_block, -(-j1 // mu_block)
            pg = torch.nn.functional.pad(p, (0, (g1 - g0) * mu_block - (j1 - j0)))
            r_g = pg.reshape(*p.shape[:-1], g1 - g0, mu_block).sum(dim=-1)
            acc = acc + r_g @ mu[:, :, g0:g1].to(dtype)
    if not return_lse:
        return acc / l[..., None]
    # l sums P against the last reference point: ExpCast's (k + beta - delta) / 8 (/ 4: E5M2), else m
    point = (m + beta - d) / _codes_per_octave(p_mode) if p_mode in EXPCAST_MODES else m
    return acc / l[..., None], point - P_LOG2_CARRY[p_mode] + torch.log2(l)


def online_max_step(m, d, s, *, p_mode, beta=EXPCAST_BETA, c8=None):
    """One key tile's update of the running max -> (m, d, alpha, u): m [B, H, M] the new running max
    (for ExpCast the integer k of its grid point (k + beta) / 8), d the tile's ExpCast byte offset
    delta (expcast_fold; 0 unless c8, the tile's fp32 scale times 8, is given), alpha the rescale of
    what came before, u = the log2 scores s [B, H, M, n] minus the reference point. E5M2 bytes
    (p_mode "expcast_e5m2"): the grid (k + beta) / 4, c8 the scale times 4."""
    cpo = _codes_per_octave(p_mode)
    if p_mode in EXPCAST_MODES:  # the reference point on ExpCast's grid (k + beta) / 8, held as k
        m_new = torch.maximum(m, expcast_reference_point(s.amax(dim=-1), beta, cpo))
    else:
        m_new = torch.maximum(m, s.amax(dim=-1))
    # A row whose keys so far are all -inf keeps m = -inf; use 0 there so u stays -inf, not NaN.
    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    if p_mode not in EXPCAST_MODES:
        return m_new, d, torch.exp2(m - m_safe), s - m_safe[..., None]
    delta = torch.zeros_like(m) if c8 is None else expcast_fold_delta(c8).to(s.dtype)
    alpha = torch.exp2((m - m_safe + delta - d) / cpo)
    return m_new, delta, alpha, s - ((m_safe + beta - delta) / cpo)[..., None]


def _expand_bias(key_bias, B, H, N, dtype):
    """Any per-key additive bias broadcastable to [B, H, 1, N] -> [B, H, 1, N] in `dtype`."""
    return key_bias.to(dtype).expand(B, H, 1, N)


def reference_vc_attention(q, k, v, *, bits=8, v_smooth=True, expcast=False, perm=None,
                           sm_scale=None, key_bias=None, beta=None, block_n=None,
                           qk_format="int8", dtype=torch.float32, q_block=QK_BLOCK, k_block=QK_BLOCK,
                           q_smooth=False, expcast_tail=TAIL_ON, return_lse=False,
                           nvfp4_search=NVFP4_SEARCH, v_mean_group=None, p_format=None, v_terms=1):
    """The whole method on [B, H, N, D] tensors (any device), returning fp32 [B, H, M, D]; with
    return_lse also each query row's log-sum-exp of its scores, [B, H, M] fp32 in natural-log units of
    softmax(Q K^T * sm_scale + bias), as the method sums them (NaN where the output is NaN).

    bits=8:  K smoothed by its token mean; Q and K INT8 (qk_format="fp8": E4M3) per 128-token
             block; V (permuted by perm,
             demeaned per 128-row block when v_smooth) quantised per channel to E4M3; P as E4M3
             bytes by exp2 + cast or ExpCast (E5M2 bytes by default: p_format); FP32 accumulation; mean restored from the row sums.
    bits=4:  NVFP4 (nvfp4.py): K smoothed by its token mean; Q and K NVFP4 along the head dim;
             V (permuted, demeaned per v_mean_group tokens when v_smooth: None = NVFP4_MEAN_GROUP,
             8; 128 = the paper's block mean) NVFP4 along the tokens (the reduction dim of P V), one
             global scale per (batch, head) each; P = exp2 (no ExpCast), then NVFP4 per 16 keys of a
             tile; same recurrence, each mean restored from the row sum of the same quantised P over
             its tokens (the group means through the kernel's fp16 operand, mean_operand_fp16).
             v_smooth=False is plain 4-bit. nvfp4_search: which of Q, K, V
             ("q", "k", "v") search their group scales (nvfp4.quantize_nvfp4; "": the usual amax
             rule for all three, plain NVFP4's).
    block_n: keys per tile of the recurrence (P's codes depend on the per-tile running max): None =
             the kernels' tiles, 128 for every bit width (NVFP4_BLOCK_N for bits 4).
    bits=16: no quantisation at all (the "exact mode"): permutation and demeaning with exact
             restoration, to show that those parts change nothing.
    8-bit options (FIDELITY.md, "Error split"; the defaults are the kernels'): q_block / k_block rows
             / keys per Q / K scale (1 = per token; a K granularity other than 128 turns the fold of
             the INT8 conversion off, it needs one K scale per tile); q_smooth: Q's token mean out
             before quantising, back as the per-key bias quant.smooth_q makes (the bias path: no
             fold); expcast_tail: ExpCast's bytes with their tail piece (expcast=True; default
             TAIL_ON, as the kernels'). FIDELITY_8BIT holds the chosen set. p_format: P's bytes
             "e4m3" or "e5m2" (expcast.py: 4 codes per octave, P carries 2^15, nothing of a long
             row's tail underflows; beta=None takes the format's, -0.35 / -0.25; no tail piece); None:
             the kernels' default (expcast.py::p_format_of: E5M2 with ExpCast, E4M3 with exp2 or the
             tail piece). v_terms: 2 = V's residual in two E4M3 terms on its per-channel scale
             (quant.e4m3_second_term; the kernels' v_terms=2, two FP8 P.V products per tile), 1 = one.
    """
    B, H, M, D = q.shape
    N = k.shape[2]
    if block_n is None:
        block_n = NVFP4_BLOCK_N if bits == 4 else V_BLOCK
    sm_scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    bias = None if key_bias is None else _expand_bias(key_bias, B, H, N, dtype)
    # K's smoothing mean on K as given, before the permutation, as the kernels' pre-pass takes it
    # (to the bit: quant.smoothing_mean says why that matters).
    k_mean = smoothing_mean(k) if bits == 8 else None
    if perm is not None:
        k, v = permute_tokens(k, perm), permute_tokens(v, perm)
        if bias is not None:
            bias = torch.gather(bias, 3, perm[:, :, None, :])
    bias_log2 = None if bias is None else bias * LOG2E

    if bits == 16:
        mu = block_means(v.to(dtype), store_dtype=None) if v_smooth else None
        r = demean(v.to(dtype), mu) if v_smooth else v.to(dtype)
        out = online_attention(q, k, r, score_scale=sm_scale * LOG2E, key_bias_log2=bias_log2,
                               mu=mu, p_mode="exact", block_n=block_n, dtype=dtype, return_lse=return_lse)
        return (out[0], out[1] / LOG2E) if return_lse else out
    if bits == 4:
        return _reference_nvfp4(q, k, v, v_smooth=v_smooth, sm_scale=sm_scale, bias=bias,
                                bias_log2=bias_log2, block_n=block_n, dtype=dtype, return_lse=return_lse,
                                search=nvfp4_search,
                                mean_group=NVFP4_MEAN_GROUP if v_mean_group is None else int(v_mean_group))
    if v_mean_group not in (None, V_BLOCK):
        raise ValueError(f"v_mean_group is a 4-bit option (the {bits}-bit path takes one mean per {V_BLOCK} rows)")
    if bits != 8:
        raise ValueError(f"the reference implements bits=4, 8 and 16 (exact mode), got bits={bits}")
    if v_terms not in (1, 2):
        raise ValueError(f"v_terms is 1 or 2 (V's residual in one or two E4M3 terms), got {v_terms!r}")

    q_in = q
    if q_smooth:  # exact: the mean's part of every score returns as a per-key bias
        k_s = torch.nan_to_num(k.float() - torch.nan_to_num(k_mean)[:, :, None, :], nan=0.0, posinf=0.0, neginf=0.0)
        qm_src = torch.nan_to_num(q.float(), nan=0.0, posinf=0.0, neginf=0.0)
        qm, q_bias = smooth_q(qm_src, k_s, sm_scale)
        q_in = q.float() - qm  # non-finite rows stay non-finite: quantize_8bit flags them
        bias_log2 = q_bias.to(dtype) * LOG2E + (0.0 if bias_log2 is None else bias_log2)
    qc, q_rows, kc, k_cols, vc, vs, mu_scaled, bad = quantize_8bit(q_in, k, v, k_mean, v_smooth=v_smooth,
                                                                   sm_scale=sm_scale, qk_format=qk_format,
                                                                   q_block=q_block, k_block=k_block,
                                                                   v_terms=v_terms)
    if p_format is None:
        p_format = p_format_of(None, expcast, bool(expcast and expcast_tail))
    if p_format not in P_FORMATS:
        raise ValueError(f"p_format must be one of {P_FORMATS}, got {p_format!r}")
    if p_format == "e5m2":
        if expcast and expcast_tail:
            raise ValueError("ExpCast's tail piece is for E4M3's subnormal band: p_format='e5m2' has none to fix")
        p_mode = "expcast_e5m2" if expcast else "exp2_cast_e5m2"
    else:
        p_mode = ("expcast_tail" if expcast_tail else "expcast") if expcast else "exp2_cast"
    if beta is None:
        beta = P_BETA[p_format]
    fold = qk_format == "int8" and bias is None and not q_smooth and k_block == QK_BLOCK
    o = online_attention(qc.float(), kc.float(), vc, score_scale=1.0, q_scale=q_rows,
                         k_scale=k_cols, key_bias_log2=bias_log2, mu=mu_scaled,
                         p_mode=p_mode, beta=beta, block_n=block_n, dtype=dtype, expcast_fold=fold,
                         return_lse=return_lse)
    o, lse2 = o if return_lse else (o, None)
    o = o * vs[:, :, None, :].to(dtype)
    if bias is not None:
        bad = bad | torch.isnan(bias).any(dim=-1)[..., None]
    o = torch.where(bad, torch.full_like(o, math.nan), o)
    return (o, smoothed_lse(lse2, q, k_mean, sm_scale, bad.any(dim=-1))) if return_lse else o


def smoothed_lse(lse2, q, k_mean, sm_scale, bad):
    """A recurrence's log2 LSE on the smoothed K (K minus its token mean k_mean [B, H, D]) -> the
    natural-log LSE of the true scores: smoothing took sm_scale * (q . k_mean) off each score of a
    row, and it comes back here (float64 for float64 input, else fp32). bad [B, H, M]: NaN rows.
    The kernels' host code uses it too (kernels/pipeline.py::vc_attention_8bit)."""
    dt = torch.float64 if lse2.dtype == torch.float64 else torch.float32
    shift = float(sm_scale) * torch.einsum("bhmd,bhd->bhm", q.to(dt), k_mean.to(dt))
    lse = lse2.to(dt) / LOG2E + shift
    return torch.where(bad, torch.full_like(lse, math.nan), lse)


def quantize_8bit(q, k, v, k_mean, *, v_smooth=True, sm_scale=None, qk_format="int8", q_block=QK_BLOCK,
                  k_block=QK_BLOCK, v_terms=1):
    """The 8-bit operands, as the kernels' pre-pass makes them (kernels/pipeline.py::prepare_8bit;
    compared bit for bit in tests/kernels/test_triton_kernels.py). k and v already permuted;
    k_mean: smoothing_mean of K as given (before the permutation). Returns (Q codes, per-row factor
    q_scale * sm_scale * log2(e) in fp32 [B, H, M], K codes, per-key scale [B, H, N], V residual
    codes, V's per-channel scales, mu / scale or None, the NaN mask [B, H, M, D] of SDPA).
    v_terms=2: the V codes returned are the sum of the two E4M3 terms (quant.e4m3_second_term), exact in fp32.

    Non-finite inputs: quantise zeros in their place and put NaN back where SDPA has it."""
    B, H, M, D = q.shape
    N = k.shape[2]
    sm_scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    k = k.float()
    k_finite = torch.isfinite(k)
    k_bad = ~k_finite.all(dim=-1).all(dim=-1)  # [B, H]: one bad key poisons every row, as in SDPA
    k = torch.where(k_finite, k, torch.zeros((), device=k.device))
    k_mean = torch.where(torch.isfinite(k_mean), k_mean, torch.zeros((), device=k.device))
    k = k - k_mean[:, :, None, :]  # K smoothing: a per-row constant in the scores, exact
    quantize_qk = QK_FORMATS[qk_format]
    qc, qs, q_bad = quantize_qk(q, q_block)
    kc, ks, _ = quantize_qk(k, k_block)
    q_rows = fold_score_scale(qs, sm_scale).repeat_interleave(q_block, dim=-1)[..., :M]
    k_cols = ks.repeat_interleave(k_block, dim=-1)[..., :N]

    v = v.float()
    v_finite = torch.isfinite(v)
    v_bad = ~v_finite.all(dim=-2)  # [B, H, D]
    v = torch.where(v_finite, v, torch.zeros((), device=v.device))
    mu = block_means(v) if v_smooth else None
    r = demean(v, mu) if v_smooth else v
    vc, vs, _ = quantize_e4m3_per_channel(r)
    if v_terms == 2:
        vc = vc + e4m3_second_term(r, vc, vs)
    mu_scaled = None if mu is None else mu / vs[:, :, None, :]
    bad = q_bad[..., None] | k_bad[:, :, None, None] | v_bad[:, :, None, :]
    return qc, q_rows, kc, k_cols, vc, vs, mu_scaled, bad


def _reference_nvfp4(q, k, v, *, v_smooth, sm_scale, bias, bias_log2, block_n, dtype, return_lse=False,
                     search=NVFP4_SEARCH, mean_group=NVFP4_MEAN_GROUP):
    """bits=4 of reference_vc_attention (K, V and bias already permuted)."""
    B, H, M, D = q.shape
    N = k.shape[2]
    k = k.float()
    k_finite = torch.isfinite(k)
    k_bad = ~k_finite.all(dim=-1).all(dim=-1)
    k = torch.where(k_finite, k, torch.zeros((), device=k.device))
    k_mean = k.mean(dim=2)
    k = k - k_mean[:, :, None, :]
    factors = {t: NVFP4_SCALE_SEARCH if t in search else (1.0,) for t in "qkv"}
    qc, qb, qs, q_bad_el = quantize_nvfp4(q, dim=-1, factors=factors["q"])
    kc, kb, ks, _ = quantize_nvfp4(k, dim=-1, factors=factors["k"])
    q_bad = q_bad_el.any(dim=-1)

    v = v.float()
    v_finite = torch.isfinite(v)
    v_bad = ~v_finite.all(dim=-2)
    v = torch.where(v_finite, v, torch.zeros((), device=v.device))
    mu = block_means(v, mean_group) if v_smooth else None
    r = demean(v, mu, mean_group) if v_smooth else v
    vc, vb, vs, _ = quantize_nvfp4(r, dim=-2, factors=factors["v"])
    if mu is None:
        mu_scaled = None
    elif mean_group == V_BLOCK:
        mu_scaled = mu / vs[:, :, None, None]
    else:  # the kernel's operand: fp16 means times one fp32 factor 2^e / sV per (batch, head)
        m16, e = mean_operand_fp16(mu)
        mu_scaled = m16.float() * (torch.exp2(e) / vs)[:, :, None, None]

    o = online_attention(nvfp4_block_values(qc, qb, -1), nvfp4_block_values(kc, kb, -1),
                         nvfp4_block_values(vc, vb, -2), score_scale=sm_scale * LOG2E,
                         q_scale=qs[..., None].expand(B, H, M), k_scale=ks[..., None].expand(B, H, N),
                         key_bias_log2=bias_log2, mu=mu_scaled, p_mode="nvfp4", block_n=block_n,
                         dtype=dtype, return_lse=return_lse, mu_block=mean_group)
    o, lse2 = o if return_lse else (o, None)
    o = o * vs[:, :, None, None].to(dtype)
    bad = q_bad[..., None] | k_bad[:, :, None, None] | v_bad[:, :, None, :]
    if bias is not None:
        bad = bad | torch.isnan(bias).any(dim=-1)[..., None]
    o = torch.where(bad, torch.full_like(o, math.nan), o)
    return (o, smoothed_lse(lse2, q.float(), k_mean, sm_scale, bad.any(dim=-1))) if return_lse else o
