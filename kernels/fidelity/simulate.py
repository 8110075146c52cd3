"""V-Smooth and ExpCast simulated on probe heads, and the error measures of the fidelity study.

Each function works on one head's tensors in plain PyTorch, built from the library's readable
reference (``kernels/reference``): the token orders (sequence, fixed cube, k-means, balanced k-means),
the share of block energy the 128-row mean removes, V's error after the per-channel E4M3 residual
quantisation, the attention output of each variant (``simulate``) against exact float64 attention
with the split of its error into a P term and a V term (METHOD.md section 3.9), and ExpCast's
total-variation bound (Proposition 3.1) row by row. ``benchmarks/fidelity/measure.py`` runs them over
the probes and writes the tables of FIDELITY.md; ``tests/kernels/test_fidelity_claims.py`` pins the
directions of those tables on a small probe.
"""

from __future__ import annotations

import csv
import functools
import math

import torch

from ..plan import plan_v_smooth
from ..reference.attention import LOG2E
from ..reference.expcast import (EXPCAST_BETA, EXPCAST_BETA_E5M2, decode_e4m3, decode_e5m2, exp2_cast_codes,
                                 exp2_cast_codes_e5m2, expcast_codes, expcast_codes_e5m2, expcast_tail_codes)
from ..reference.kmeans import initial_centroids
from ..reference.quant import QK_BLOCK, e4m3_second_term, quantize_e4m3_per_channel, quantize_int8_per_block
from ..reference.vsmooth import V_BLOCK, block_means, demean
from .probes import cube_order

TV_BOUND = 0.0364

# (label, simulate method, Q/K path, key order, V exact?)
CONFIGS = [
    ("naive", "naive", "int8", "sequential", False),  # naive FP8: per-channel V, exp2 + cast P
    ("sage1", "sage1", "int8", "sequential", False),  # SageAttention-1-like: INT8 Q/K, FP16 P and V
    ("vs_seq_exp2", "vs_exp2", "int8", "sequential", False),  # demeaning without the k-means order
    ("vs_exp2", "vs_exp2", "int8", "kmeans", False),  # V-Smooth, exp2 + cast P
    ("vs_expcast", "vs_expcast", "int8", "kmeans", False),  # V-Smooth + ExpCast (beta = -0.35)
    ("vs_decor", "vs_decor", "int8", "kmeans", False),  # V-Smooth + decorrelated ExpCast
    # the P path alone: exact Q/K scores, exact V, only P quantised
    ("P_exp2", "vs_exp2", "exact", "kmeans", True),
    ("P_expcast", "vs_expcast", "exact", "kmeans", True),
    ("P_decor", "vs_decor", "exact", "kmeans", True),
    # diagnostics and candidate byte paths for the ExpCast deficit (P path alone)
    ("P_exp2_flush", "vs_exp2_flush", "exact", "kmeans", True),
    ("P_expcast_sub", "vs_expcast_sub", "exact", "kmeans", True),
    ("P_expcast_hr", "vs_expcast_hr", "exact", "kmeans", True),
]

# ----------------------------------------------------------------------------------------- orders


def balanced_kmeans(x: torch.Tensor, num_clusters: int = 64, iters: int = 10, seed: int = 0):
    """A simple balanced k-means on [N, D]: Lloyd iterations whose assignment step gives every
    cluster at most cap = ceil(N / C) tokens (greedy rounds: each unassigned token proposes to its
    nearest cluster with room left; a cluster keeps its closest proposers). Same seeded init as
    plan_v_smooth. Returns labels [N]."""
    x = x.double()
    N = x.shape[0]
    C = min(num_clusters, N)
    cap = -(-N // C)
    cent = initial_centroids(x[None], C, seed)[0].double()
    for it in range(iters + 1):
        d = (cent * cent).sum(-1)[None, :] - 2.0 * x @ cent.T  # [N, C]
        pref = d.argsort(dim=1)
        labels = torch.full((N,), -1, dtype=torch.long)
        room = torch.full((C,), cap, dtype=torch.long)
        ptr = torch.zeros(N, dtype=torch.long)
        todo = torch.arange(N)
        while todo.numel():
            prop = pref[todo, ptr[todo]]
            dist = d[todo, prop]
            o1 = torch.argsort(dist, stable=True)
            o2 = torch.argsort(prop[o1], stable=True)
            order = o1[o2]  # proposals sorted by (cluster, distance)
            ps = prop[order]
            first = torch.searchsorted(ps, ps, right=False)
            rank = torch.arange(ps.numel()) - first
            acc_sorted = rank < room[ps]
            acc = torch.zeros_like(acc_sorted)
            acc[order] = acc_sorted
            labels[todo[acc]] = prop[acc]
            room -= torch.bincount(prop[acc], minlength=C)
            ptr[todo[~acc]] += 1
            todo = todo[~acc]
        if it == iters:
            break
        sums = torch.zeros(C, x.shape[1], dtype=x.dtype).index_add_(0, labels, x)
        cnt = torch.bincount(labels, minlength=C).clamp(min=1)
        cent = sums / cnt[:, None]
    return labels


def make_orders(probe, clusters=64, iters=10):
    """name -> perm [H, N] int64."""
    H, N = probe.v.shape[1], probe.v.shape[2]
    seq = torch.arange(N).expand(H, N).contiguous()
    cube = cube_order(probe.grid).expand(H, N).contiguous()
    plan = plan_v_smooth(probe.v, num_clusters=clusters, iters=iters, backend="reference")
    bal = torch.stack([torch.sort(balanced_kmeans(probe.v[0, h], clusters, iters), stable=True).indices
                       for h in range(H)])
    return {"sequential": seq, "cube": cube, "kmeans": plan.perm[0], "balanced_kmeans": bal}


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


# ------------------------------------------------------------------------------ 1. block energy


def energy_share(v: torch.Tensor, block: int = V_BLOCK):
    """v: [N, D] in its processing order -> (pooled share, per-block shares [nb])."""
    v = v.double()
    N, D = v.shape
    nb = -(-N // block)
    vp = torch.nn.functional.pad(v, (0, 0, 0, nb * block - N)).view(nb, block, D)
    counts = torch.full((nb,), float(block), dtype=torch.float64)
    counts[-1] = N - (nb - 1) * block
    mu = vp.sum(1) / counts[:, None]
    removed = counts * mu.pow(2).sum(-1)
    total = vp.pow(2).sum((1, 2))
    return (removed.sum() / total.sum()).item(), (removed / total)


# ------------------------------------------------------------------------------ 2. V quantisation


def v_quant_error(v: torch.Tensor, demean_blocks: bool = True, rotate: torch.Tensor | None = None):
    """v: [N, D] in processing order -> (relative MSE, relative RMSE) of V-Smooth's value path:
    (optional Hadamard rotation), 128-row block means stored in bf16, per-channel E4M3 residual."""
    x = v.double()
    if rotate is not None:
        x = x @ rotate
    xf = x.float()[None, None]
    mu = block_means(xf) if demean_blocks else torch.zeros(1, 1, 1, x.shape[1])
    r = demean(xf, mu) if demean_blocks else xf
    codes, scales, _ = quantize_e4m3_per_channel(r)
    rq = codes * scales[..., None, :]
    xq = (demean(rq, -mu) if demean_blocks else rq)[0, 0].double()  # rq + mu
    if rotate is not None:
        xq = xq @ rotate.T
    err = (xq - v.double()).pow(2).sum() / v.double().pow(2).sum()
    return err.item(), math.sqrt(err.item())


# ------------------------------------------------------------------------- 3. attention outputs


def _tiles_online(s_log2: torch.Tensor, p_fn, block_n: int = V_BLOCK):
    """Online-softmax bytes exactly as the recurrence makes them, in dense form.

    s_log2: [M, N] scores in the log2 domain. Per key tile t, the running max m_t (cummax over
    tiles), u = s - m_t, P~ = p_fn(u); the tile's final weight is P~ * 2^(m_t - m_last).
    Returns the unnormalised effective weights W [M, N] (so O = W V / W 1)."""
    M, N = s_log2.shape
    nt = -(-N // block_n)
    pad = nt * block_n - N
    sp = torch.nn.functional.pad(s_log2, (0, pad), value=-math.inf).view(M, nt, block_n)
    m_t = torch.cummax(sp.amax(-1), dim=1).values  # [M, nt]
    u = sp - m_t[..., None]
    p = p_fn(u)
    w = p * torch.exp2(m_t - m_t[:, -1:])[..., None]
    return w.view(M, nt * block_n)[:, :N]


def quantised_scores(q, k, sm_scale, qk: str, q_block=QK_BLOCK, k_block=QK_BLOCK):
    """q [M, D], k [N, D] (already permuted) -> log2-domain scores [M, N] as the kernels see them."""
    if qk == "exact":
        return (q.double() @ k.double().T * (sm_scale * LOG2E)).float()
    k = k.float() - k.float().mean(0, keepdim=True)  # K smoothing (exact for softmax)
    qc, qs, _ = quantize_int8_per_block(q.float()[None, None], q_block)
    kc, ks, _ = quantize_int8_per_block(k[None, None], k_block)
    q_rows = qs.repeat_interleave(q_block, -1)[0, 0, : q.shape[0]]
    k_cols = ks.repeat_interleave(k_block, -1)[0, 0, : k.shape[0]]
    s = qc[0, 0].float() @ kc[0, 0].float().T
    return s * (q_rows[:, None] * (sm_scale * LOG2E)) * k_cols[None, :]


def _expcast_headroom(u, beta=EXPCAST_BETA):
    """ExpCast with P scaled by 2^8.75 instead of 2^8: codes up to 126 (= 448, 0x7E, never 0x7F),
    0.75 binade more range at the bottom; same cost (a different constant)."""
    x = (8.0 * (u.float() + 8.75) + 56.0 + beta).clamp(0.0, 126.0)
    return decode_e4m3(torch.round(x).to(torch.uint8))


P_PATHS = {
    "exp2": lambda u: decode_e4m3(exp2_cast_codes(u)),
    "expcast": lambda u, beta=EXPCAST_BETA: decode_e4m3(expcast_codes(u, beta)),
    # diagnostics of the ExpCast deficit (not kernels):
    # exp2 + cast, flushed to 0 wherever ExpCast's byte is 0 (u < ~-14.9): ExpCast's underflow alone
    "exp2_flush": lambda u: decode_e4m3(exp2_cast_codes(u)) * (expcast_codes(u) > 0),
    # ExpCast, but exp2 + cast bytes where u < -14 (E4M3's subnormal band): the tail done right
    "expcast_sub": lambda u, beta=EXPCAST_BETA: torch.where(
        u < -14.0, decode_e4m3(exp2_cast_codes(u)), decode_e4m3(expcast_codes(u, beta))),
    "expcast_hr": _expcast_headroom,
}


def simulate(q, k, v, perm, *, method: str, beta=EXPCAST_BETA, qk="int8", delta_seed=1234, v_exact=False):
    """One head, dense. q [M, D], k and v [N, D] in token order, perm [N].

    Returns (P_q [M, N] normalised effective probabilities over the *permuted* keys,
             V_q [N, D] effective dequantised values in permuted order, V_p [N, D] exact permuted V),
    so that O_q = P_q V_q. Methods:
      naive       INT8 Q/K (K smoothed), V per-channel E4M3 (no demeaning), P = E4M3(2^(u+8))
      vs_exp2     V-Smooth: block means + per-channel E4M3 residual, P by exp2 + cast
      vs_expcast  V-Smooth, P by ExpCast-FP8 (beta)
      vs_decor    V-Smooth, ExpCast on u + delta_j - 1 with a random per-key delta_j in [0, 1) (fixed
                  seed); compensated exactly by w_j = 2^(1 - delta_j): V's residual rows are scaled
                  by w_j before quantisation and the row sums l, r use the weights P~ w (a dot with a
                  w column instead of the ones column)
    v_exact=True keeps V exact (only the P path is quantised; with vs_decor the w_j scaling is exact).
      sage1       SageAttention-1-like: INT8 Q (128-token blocks) / K (64-token blocks, smoothed),
                  P = 2^u in FP16, V in FP16, FP32 accumulation, l from FP32 P
    """
    sm_scale = q.shape[-1] ** -0.5
    kp, vp = k[perm], v[perm].float()
    if method == "sage1":
        s = quantised_scores(q, kp, sm_scale, qk, QK_BLOCK, 64)
        w_fp32 = _tiles_online(s, torch.exp2)
        w16 = _tiles_online(s, lambda u: torch.exp2(u).half().float())
        pq = w16 / w_fp32.sum(-1, keepdim=True)
        return pq, vp.half().float(), vp
    s = quantised_scores(q, kp, sm_scale, qk)
    smooth = method != "naive"
    mu = block_means(vp[None, None]) if smooth else torch.zeros(1, 1, 1, vp.shape[1])
    r = demean(vp[None, None], mu) if smooth else vp[None, None]
    wkey = None
    if method == "vs_decor":
        g = torch.Generator().manual_seed(delta_seed)
        delta = torch.rand(vp.shape[0], generator=g)
        s = s + (delta - 1.0)[None, :]
        wkey = torch.exp2(1.0 - delta)
        r = r * wkey[:, None]
    codes, scales, _ = quantize_e4m3_per_channel(r)
    rq = (codes * scales[..., None, :])[0, 0]
    if wkey is not None:
        rq = rq / wkey[:, None]
    vq = rq + mu[0, 0].repeat_interleave(V_BLOCK, 0)[: vp.shape[0]] if smooth else rq
    p_fn = P_PATHS["expcast" if method == "vs_decor" else method.replace("vs_", "").replace("naive", "exp2")]
    if "expcast" in method or method == "vs_decor":
        p_fn = functools.partial(p_fn, beta=beta)
    w = _tiles_online(s, p_fn)
    if wkey is not None:
        w = w * wkey[None, :]
    return w / w.sum(-1, keepdim=True), (vp if v_exact else vq), vp


def output_metrics(o_ref, o, e_p=None, e_v=None):
    o_ref, o = o_ref.double(), o.double()
    err = (o - o_ref).pow(2).sum()
    ref = o_ref.pow(2).sum()
    row = {
        "rel_l2": math.sqrt(err / ref),
        "cosine": (torch.nn.functional.cosine_similarity(o.flatten(), o_ref.flatten(), dim=0)).item(),
        "sqnr_db": 10 * math.log10(ref / err),
    }
    if e_p is not None:
        ep, ev = e_p.double().pow(2).sum(), e_v.double().pow(2).sum()
        row["value_share"] = (ev / (ep + ev)).item()
        row["rel_l2_EP"] = math.sqrt(ep / ref)
        row["sqnr_EP_db"] = 10 * math.log10(ref / ep) if ep > 0 else float("inf")
        row["rel_l2_EV"] = math.sqrt(ev / ref)
        row["rel_l2_EP_plus_EV"] = math.sqrt((e_p + e_v).double().pow(2).sum() / ref)
    return row


def query_blocks(n: int, n_blocks: int, seed: int) -> torch.Tensor:
    nb = n // QK_BLOCK
    g = torch.Generator().manual_seed(seed)
    chosen = torch.sort(torch.randperm(nb, generator=g)[:n_blocks]).values
    return (chosen[:, None] * QK_BLOCK + torch.arange(QK_BLOCK)[None, :]).reshape(-1)


# --------------------------------------------------------------------------------- 4. ExpCast TV


def expcast_rows(q, k, beta=EXPCAST_BETA, chunk=1024):
    """All rows of one head with exact (fp32) scores and the exact row max (u = s - max_j s <= 0).

    Returns per-row tensors (tv_expcast, tv_exp2cast, tau0 = softmax mass on bytes ExpCast flushes to 0,
    tau_sub = softmax mass on u < -14, where E4M3 goes subnormal) and byte-agreement counts."""
    sm = q.shape[-1] ** -0.5 * LOG2E
    kT = k.float().T.contiguous()
    out = {n: [] for n in ("tv_expcast", "tv_exp2cast", "tau0", "tau_sub")}
    agree = {"normal_equal": 0, "normal_total": 0, "sub_equal": 0, "sub_total": 0, "off_by_more": 0}
    for i0 in range(0, q.shape[0], chunk):
        s = (q[i0 : i0 + chunk].float() * sm) @ kT
        u = s - s.amax(-1, keepdim=True)
        p = torch.exp2(u)
        p /= p.sum(-1, keepdim=True)
        ce = expcast_codes(u, beta)
        cx = exp2_cast_codes(u)
        pe = decode_e4m3(ce)
        pe /= pe.sum(-1, keepdim=True)
        px = decode_e4m3(cx)
        px /= px.sum(-1, keepdim=True)
        out["tv_expcast"].append(0.5 * (p - pe).abs().sum(-1, dtype=torch.float64))
        out["tv_exp2cast"].append(0.5 * (p - px).abs().sum(-1, dtype=torch.float64))
        out["tau0"].append((p * (ce == 0)).sum(-1, dtype=torch.float64))
        sub = u < -14.0
        out["tau_sub"].append((p * sub).sum(-1, dtype=torch.float64))
        eq = ce == cx
        normal = ~sub
        agree["normal_equal"] += int((eq & normal).sum())
        agree["normal_total"] += int(normal.sum())
        band = sub & (u >= -15.0)
        agree["sub_equal"] += int((eq & band).sum())
        agree["sub_total"] += int(band.sum())
        agree["off_by_more"] += int((((ce.int() - cx.int()).abs() > 1) & normal).sum())
    return {n: torch.cat(v) for n, v in out.items()}, agree


def synthetic_agreement(beta=EXPCAST_BETA, n=1_000_000):
    """Byte agreement on u uniform over one doubling [-1, 0) and over the normal range [-14, 0)."""
    res = {}
    for name, lo in (("one_doubling", -1.0), ("normal_range", -14.0), ("subnormal_band", -15.0)):
        hi = -14.0 if name == "subnormal_band" else 0.0
        u = lo + (hi - lo) * (torch.arange(n, dtype=torch.float64) + 0.5) / n
        ce, cx = expcast_codes(u.float(), beta), exp2_cast_codes(u.float())
        d = (ce.int() - cx.int()).abs()
        res[name] = {"equal": (d == 0).double().mean().item(), "off_by_one": (d == 1).double().mean().item(),
                     "max_code_diff": int(d.max())}
    return res


def write_csv(path, rows):
    if not rows:
        return
    keys = list(rows[0].keys())
    for r in rows[1:]:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed (the
    scripts' plots are optional; their CSVs are always written)."""
    try:
        import matplotlib
    except ImportError:
        print("plots skipped: matplotlib is not installed (the CSVs are written)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------- 5. configurable paths, three-term split
#
# One head, dense, every quantisation choice a field of QuantConfig, and the output error split
# into three terms that add up to the whole error (benchmarks/fidelity/error_split.py):
#   O_ref = softmax(S) V                      exact scores, float64
#   O_1   = softmax(S_q) V                    Q/K term   E_QK = O_1 - O_ref  (quantised scores, exact P, V)
#   O_2   = (W_q V) / l                       P term     E_P  = O_2 - O_1    (the bytes of P, the row sum)
#   O_3   = (W_q V_q) / l                     V term     E_V  = O_3 - O_2    (V's quantisation)
# W_q are the effective P values of the online recurrence (each tile's bytes against its running
# reference point, rescaled to the last), l the row sum the kernel divides by.

from dataclasses import dataclass, replace  # noqa: E402

CK_HADAMARD_SEED = 0  # signs of our stand-in for comfy-kitchen's "fixed signed H128" (not published)


@dataclass(frozen=True)
class QuantConfig:
    """One attention path. Q/K: qk "exact" | "int8" | "bf16" | "fp16"; q_group rows per Q scale (int)
    or "ck" (SageAttention2 per-thread: 32 scales per 128 rows, a scale for the 4 rows r, r + 8, ...
    of a warp's 32); k_group keys per K scale (int) or "ck" (4 scales per 128-key tile, keys with the
    same (j mod 8) // 2, the mma accumulator's thread columns); k_smooth "mean" | "none" | "anchor"
    (subtract one sampled key when that shrinks K's range: our model of comfy-kitchen's detector);
    q_smooth: subtract Q's token mean, add q_mean . k_j back as a per-key bias; hadamard: a signed
    H128 rotation of Q and K before quantising (exact for Q K^T).
    V: "exact" | "e4m3" (per channel) | "e4m3_block" (per 128-row block and channel) | "int8" (per
    channel) | "int8_block" | "fp16" | "bf16"; v_smooth: 128-row block means out (bf16), restored from the row sums;
    order "sequential" | "kmeans" (the V-Smooth plan). P: "exact" | "exp2" (exp2 + E4M3 cast) |
    "expcast" | "expcast_tail" (ExpCast + the subnormal-band piece) | "exp2_e5m2" | "expcast_e5m2" (P in E5M2) | "u8" (round(255 p) against the
    running max) | "u8_tile" (round(255 p / p_tile_max): comfy-kitchen's unsigned INT8 P, our model) |
    "u7_tile" (the same on 0..127) | "fp16" | "bf16"; ref_point "max" (exact running max) | "grid"
    (ExpCast's (k + beta) / 8, the library's); row_sum "same" (the P values that multiply V) | "fp32"
    (exact 2^u); block_n keys per tile of the running max."""
    qk: str = "int8"
    q_group: object = 128
    k_group: object = 128
    k_smooth: str = "mean"
    q_smooth: bool = False
    hadamard: bool = False
    v: str = "e4m3"
    v_smooth: bool = False
    order: str = "sequential"
    p: str = "exp2"
    ref_point: str = "max"
    row_sum: str = "same"
    block_n: int = V_BLOCK



# The configurations of the study. Ours as the library has them; peers as their sources describe them.
_OURS_QK = dict(qk="int8", q_group=128, k_group=128, k_smooth="mean")
SPLIT_CONFIGS = {
    "plain8": QuantConfig(**_OURS_QK, v="e4m3", p="exp2"),
    "vs_exp2": QuantConfig(**_OURS_QK, v="e4m3", v_smooth=True, order="kmeans", p="exp2"),
    # the library's 8-bit default: V-Smooth + ExpCast on the grid reference point
    "vs_expcast": QuantConfig(**_OURS_QK, v="e4m3", v_smooth=True, order="kmeans", p="expcast",
                              ref_point="grid"),
    "vs_expcast_tail": QuantConfig(**_OURS_QK, v="e4m3", v_smooth=True, order="kmeans",
                                   p="expcast_tail", ref_point="grid"),
    # comfy-kitchen 0.2.40 int8_attention, D = 128, long K (its docstring and buffer shapes):
    # signed H128 on Q and K, INT8 Q per thread group (32 scales / 128 rows), INT8 K 4 scales per
    # 128-key tile, K shifted by a representative key, INT8 V per channel, unsigned INT8 P, FP32
    # softmax arithmetic (row sum of the FP32 exponentials). Its P scale is not published: P against
    # each tile's own row max reproduces the measured kernel on random inputs (FIDELITY.md), P
    # against the running max does not.
    "comfy_kitchen": QuantConfig(qk="int8", q_group="ck", k_group="ck", k_smooth="anchor", hadamard=True,
                                 v="int8", p="u8_tile", row_sum="fp32"),
    # the same with P against the running max (the other reading of its P scale)
    "comfy_kitchen_run": QuantConfig(qk="int8", q_group="ck", k_group="ck", k_smooth="anchor", hadamard=True,
                                     v="int8", p="u8", row_sum="fp32"),
    # SageAttention 1: INT8 Q per 128, K per 64 (smoothed), FP16 P and V, row sum of FP32 P
    "sage1": QuantConfig(qk="int8", q_group=128, k_group=64, v="fp16", p="fp16", row_sum="fp32", block_n=64),
    # FlashAttention with bf16 inputs: Q, K, V bf16, P rounded to bf16 for P V, FP32 row sum
    "bf16": QuantConfig(qk="bf16", k_smooth="none", v="bf16", p="bf16", row_sum="fp32"),
}


def group_ids(n: int, spec, tile: int = QK_BLOCK, device=None) -> torch.Tensor:
    """Scale index of each of n rows (Q) or keys (K) for a granularity spec."""
    i = torch.arange(n, device=device)
    if spec == "ck_q":  # 4 warps x 8 thread groups per 128 rows; group g of warp w: rows w*32 + g + 8t
        return (i // 128) * 32 + ((i % 128) // 32) * 8 + i % 8
    if spec == "ck_k":  # 4 per tile: the thread columns {8t + 2c, 8t + 2c + 1} of an m16n8 accumulator
        return (i // tile) * 4 + (i % 8) // 2
    return i // int(spec)


def quantise_int8_groups(x: torch.Tensor, ids: torch.Tensor):
    """x [N, D] -> (dequantised fp32 [N, D]) with one scale amax / 127 per group of rows."""
    x = x.float()
    ng = int(ids.max()) + 1
    amax = torch.zeros(ng, device=x.device).scatter_reduce(0, ids, x.abs().amax(-1), reduce="amax")
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))[ids][:, None]
    return torch.round(x.double() / scale.double()).clamp(-127, 127).float() * scale


def signed_hadamard(d: int, seed: int = CK_HADAMARD_SEED) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    signs = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0).double()
    return signs[:, None] * hadamard(d)  # diag(s) H: orthonormal


def anchor_key(k: torch.Tensor, samples: int = 64) -> torch.Tensor:
    """Our model of comfy-kitchen's K shift (its detector is compiled, not published): among `samples`
    evenly spaced keys take the one that minimises max |K - k_a| over the samples; subtract it only if
    that is below max |K| there. Returns the key to subtract (zeros for no shift)."""
    idx = torch.linspace(0, k.shape[0] - 1, min(samples, k.shape[0]), device=k.device).long()
    ks = k[idx].double()
    spans = (ks[None, :, :] - ks[:, None, :]).abs().amax(dim=(1, 2))  # [candidates]
    best = int(spans.argmin())
    return k[idx[best]].float() if spans[best] < ks.abs().max() else torch.zeros_like(k[0]).float()


def config_scores(q_all: torch.Tensor, qidx: torch.Tensor, k: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """Log2-domain scores [M, N] as a path sees them. q_all [Nq, D] every query (Q's scales and mean
    are taken over the whole sequence, as the kernels' pre-pass), qidx the rows kept, k [N, D]."""
    c = q_all.shape[-1] ** -0.5 * LOG2E
    if cfg.qk == "exact":
        return (q_all[qidx].double() @ k.double().T * c).float()
    if cfg.qk in ("bf16", "fp16"):
        dt = torch.bfloat16 if cfg.qk == "bf16" else torch.float16
        return (q_all[qidx].to(dt).double() @ k.to(dt).double().T * c).float()
    q, kk = q_all.double(), k.double()
    if cfg.hadamard:
        hm = signed_hadamard(q.shape[-1]).to(q.device)
        q, kk = q @ hm, kk @ hm
    if cfg.k_smooth == "mean":
        kk = kk - kk.mean(0, keepdim=True)
    elif cfg.k_smooth == "anchor":
        kk = kk - anchor_key(kk.float()).double()
    bias = None
    if cfg.q_smooth:  # exact: (q_i - qm) . k_j + qm . k_j = q_i . k_j; the second term is a per-key bias
        qm = q.mean(0, keepdim=True)
        q = q - qm
        bias = (kk.float() @ qm.float().T)[:, 0].double()  # fp32, as a pre-pass would store it
    qg = "ck_q" if cfg.q_group == "ck" else cfg.q_group
    kg = "ck_k" if cfg.k_group == "ck" else cfg.k_group
    qd = quantise_int8_groups(q, group_ids(q.shape[0], qg, device=q.device))[qidx]
    kd = quantise_int8_groups(kk, group_ids(kk.shape[0], kg, device=q.device))
    s = qd.double() @ kd.double().T
    if bias is not None:
        s = s + bias[None, :]
    return (s * c).float()


def _p_config(u: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    if cfg.p == "exact":
        return torch.exp2(u)
    if cfg.p == "exp2":
        return decode_e4m3(exp2_cast_codes(u))
    if cfg.p == "expcast":
        return decode_e4m3(expcast_codes(u))
    if cfg.p == "expcast_tail":  # the kernels' byte map (kernels/reference/expcast.py::tail_bytes)
        return decode_e4m3(expcast_tail_codes(u))
    if cfg.p == "exp2_e5m2":
        return decode_e5m2(exp2_cast_codes_e5m2(u))
    if cfg.p == "expcast_e5m2":
        return decode_e5m2(expcast_codes_e5m2(u))
    if cfg.p == "u8":  # against the running max
        return torch.round(torch.exp2(u) * 255.0) / 255.0
    if cfg.p in ("u8_tile", "u7_tile"):  # against each tile's own row max (a per-row, per-tile P scale)
        top = 255.0 if cfg.p == "u8_tile" else 127.0  # u7: P in a signed byte's 0..127
        tm = u.amax(-1, keepdim=True)
        tm = torch.where(torch.isneginf(tm), torch.zeros_like(tm), tm)
        return torch.round(torch.exp2(u - tm) * top) / top * torch.exp2(tm)
    if cfg.p in ("fp16", "bf16"):
        return torch.exp2(u).to(torch.float16 if cfg.p == "fp16" else torch.bfloat16).float()
    raise ValueError(cfg.p)


TILE_REF_FLOOR = 20.0  # octaves: how far under the running max a tile's reference point may sit


def config_weights(s: torch.Tensor, cfg: QuantConfig):
    """Scores [M, N] -> (W_q [M, N] the P values that multiply V, l [M] the row sum divided by),
    rescaled to the last tile's reference point (the online recurrence in dense form)."""
    M, N = s.shape
    bn = cfg.block_n
    nt = -(-N // bn)
    sp = torch.nn.functional.pad(s, (0, nt * bn - N), value=-math.inf).view(M, nt, bn)
    tmax = sp.amax(-1)
    # ExpCast's grid (k + beta) / c, c codes per octave
    c, beta = (4.0, EXPCAST_BETA_E5M2) if cfg.p.endswith("e5m2") else (8.0, EXPCAST_BETA)
    if cfg.ref_point == "grid":  # the grid point at or above the running max
        kt = torch.cummax(torch.ceil(c * tmax - beta), dim=1).values
        m_t = (kt + beta) / c
    elif cfg.ref_point in ("tile", "tile_grid"):
        # each tile's own row max (no lower than TILE_REF_FLOOR octaves under the running max, which
        # bounds the rescale), on ExpCast's grid for "tile_grid": P's bytes use their whole range in
        # every tile, so a long row's far tiles do not underflow
        m_t = torch.maximum(tmax, torch.cummax(tmax, dim=1).values - TILE_REF_FLOOR)
        if cfg.ref_point == "tile_grid":
            m_t = (torch.ceil(c * m_t - beta) + beta) / c
    else:
        m_t = torch.cummax(tmax, dim=1).values
    u = sp - m_t[..., None]
    resc = torch.exp2(m_t - m_t[:, -1:])[..., None]
    w = (_p_config(u, cfg) * resc).view(M, nt * bn)[:, :N]
    l = w.sum(-1) if cfg.row_sum == "same" else (torch.exp2(u) * resc).view(M, nt * bn)[:, :N].sum(-1)
    return w, l


def _block_amax(r: torch.Tensor, block: int = V_BLOCK) -> torch.Tensor:
    """max |r| over each (block of rows, channel), repeated back to r's rows: [N, D]."""
    n = r.shape[0]
    nb = -(-n // block)
    rp = torch.nn.functional.pad(r.abs(), (0, 0, 0, nb * block - n)).view(nb, block, -1).amax(1)
    return rp.repeat_interleave(block, 0)[:n]


def config_values(v: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """V [N, D] in processing order -> the values P multiplies, dequantised (block means restored)."""
    v = v.float()
    mu = block_means(v[None, None]) if cfg.v_smooth else torch.zeros(1, 1, 1, v.shape[1], device=v.device)
    r = demean(v[None, None], mu)[0, 0] if cfg.v_smooth else v
    if cfg.v == "exact":
        rq = r
    elif cfg.v == "e4m3":
        codes, scales, _ = quantize_e4m3_per_channel(r[None, None])
        rq = (codes * scales[..., None, :])[0, 0]
    elif cfg.v == "e4m3x2":  # two E4M3 terms on one per-channel scale: hi, and the rounding it left
        codes, scales, _ = quantize_e4m3_per_channel(r[None, None])
        rq = ((codes + e4m3_second_term(r[None, None], codes, scales)) * scales[..., None, :])[0, 0]
    elif cfg.v == "e4m3_block":  # one scale per (128-row block, channel)
        amax = _block_amax(r)
        sc = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        rq = (r / sc).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sc
    elif cfg.v in ("int8", "int8_block"):  # per channel, or per (128-row block, channel)
        if cfg.v == "int8":
            amax = r.abs().amax(0, keepdim=True)
        else:
            amax = _block_amax(r)
        sc = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        rq = torch.round(r / sc).clamp(-127, 127) * sc
    elif cfg.v in ("fp16", "bf16"):
        rq = r.to(torch.float16 if cfg.v == "fp16" else torch.bfloat16).float()
    else:
        raise ValueError(cfg.v)
    return rq + mu[0, 0].repeat_interleave(V_BLOCK, 0)[: v.shape[0]] if cfg.v_smooth else rq


def error_split(q_all, qidx, k, v, perm, cfg: QuantConfig, o_ref=None):
    """One head: q_all [Nq, D], k and v [N, D] in token order, perm [N] the key order (used when
    cfg.order is "kmeans"; else sequence order). Returns (O_3, dict of metrics): SQNR of the whole
    error and of each term alone (dB), the terms' energy shares, relative L2 and cosine."""
    if cfg.order == "sequential":
        perm = torch.arange(k.shape[0], device=k.device)
    kp, vp = k[perm], v[perm].double()
    if o_ref is None:
        o_ref = torch.softmax(q_all[qidx].double() @ k.double().T * q_all.shape[-1] ** -0.5, -1) @ v.double()
    s = config_scores(q_all, qidx, kp, cfg)
    o1 = torch.softmax(s.double() * math.log(2.0), -1) @ vp
    w, l = config_weights(s, cfg)
    o2 = (w.double() @ vp) / l.double()[:, None]
    o3 = (w.double() @ config_values(vp.float(), cfg).double()) / l.double()[:, None]
    ref = o_ref.pow(2).sum().item()
    terms = {"qk": o1 - o_ref, "p": o2 - o1, "v": o3 - o2}
    en = {n: t.pow(2).sum().item() for n, t in terms.items()}
    err = (o3 - o_ref).pow(2).sum().item()
    db = lambda e: 10 * math.log10(ref / e) if e > 0 else float("inf")  # noqa: E731
    row = {"sqnr_db": db(err), "rel_l2": math.sqrt(err / ref),
           "cosine": torch.nn.functional.cosine_similarity(o3.flatten(), o_ref.flatten(), dim=0).item()}
    tot = sum(en.values())
    for n in terms:
        row[f"sqnr_{n}_db"] = db(en[n])
        row[f"share_{n}"] = en[n] / tot if tot > 0 else 0.0
    return o3, row


def config_with(base: str | QuantConfig, **changes) -> QuantConfig:
    return replace(SPLIT_CONFIGS[base] if isinstance(base, str) else base, **changes)
