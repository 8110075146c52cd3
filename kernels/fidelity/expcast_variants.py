"""ExpCast's byte path in variants, for the fidelity study (FIDELITY.md "ExpCast tail" and "ExpCast's
reference point on the grid (k + beta)/8").

Two families, both exact models in plain PyTorch of what a kernel would compute:

- **Tail pieces.** Plain ExpCast writes c = clip_[0,120](round(8u + 120 + beta)) (u = log2 score -
  row max) and sends u < -14.9 to byte 0, where the exact E4M3 cast still has subnormal codes down to
  u = -18. ``pieces_codes`` adds affine pieces under a max (one FFMA + one FMNMX each in a kernel);
  ``fit_two_piece`` / ``fit_three_piece`` fit them in value over that band; ``band_stats`` scores a
  variant there. ``pieces_codes_magic`` models such a piece in a kernel's magic-number rounding.
  The kernels carry the piece on the main code instead (``fit_code_piece``: T(c) = round(A c + B),
  exact from the byte's FFMA result; kernels/reference/expcast.py::tail_bytes).
- **Reference point.** ``online_expcast`` is ``kernels/reference/attention.py::online_attention``
  for ExpCast with the reference point as a switch: the exact running row max (the library until
  commit 7650cad), the max snapped up onto the grid (k + beta) / 8, or the snapped point moved per
  tile by the INT8 kernels' fold of their int32 -> fp32 conversion (the library today). Same
  operations in the same order as the library, so each matches its version bit for bit;
  ``load_old_attention`` loads the old file from git to check that.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import subprocess
import sys

import torch

from ..reference.attention import LOG2E
from ..reference.expcast import (
    EXPCAST_BETA, decode_e4m3, expcast_codes, expcast_fold_delta, expcast_reference_point)
from ..reference.quant import QK_BLOCK, QK_FORMATS, quantize_e4m3_per_channel
from ..reference.vsmooth import V_BLOCK, block_means, demean, permute_tokens

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository (the package root)

MAGIC = 12582912.0  # 1.5 * 2^23: the low mantissa bits of x + MAGIC are round(x), ties to even
CHORD = (7.0 / 3.0, 122.0 / 3.0)


# ------------------------------------------------------------------------- reference byte paths


def _round_clip(x: torch.Tensor) -> torch.Tensor:
    """round half to even, clip at 0 and 120, -inf/NaN -> 0 (as the kernel's magic rounding)."""
    x = torch.nan_to_num(x.float(), nan=0.0, neginf=0.0).clamp(0.0, 120.0)
    return torch.round(x).to(torch.uint8)


def pieces_codes(u: torch.Tensor, pieces, beta: float = EXPCAST_BETA) -> torch.Tensor:
    """round(max(8u + 120 + beta, a_i u + b_i ..., 0)) as uint8 E4M3 bytes (fp32 arithmetic)."""
    u = u.float()
    x = u * 8.0 + (120.0 + beta)
    for a, b in pieces:
        x = torch.maximum(x, u * float(a) + float(b))
    return _round_clip(x)


def pieces_codes_magic(u: torch.Tensor, pieces, beta: float = EXPCAST_BETA) -> torch.Tensor:
    """Bit-level model of a u-space piece in a kernel's magic-number rounding, fp32 throughout:
    x = max(fma(u, 8, 120 + beta), fma(u, a, b), ...); t = max(x + M, M); byte = bits(t) & 0xFF.
    u * 8 is exact, so the first FFMA is one rounding either way; the tail FFMA is modelled with one
    rounding (fp64 product, exact for fp32 inputs, plus b, then fp32), where pieces_codes rounds
    u * a and then the sum: they can differ only at near-ties (counted in main and in the test)."""
    u = u.float()
    x = u * 8.0 + (120.0 + beta)
    for a, b in pieces:
        x = torch.maximum(x, (u.double() * float(torch.tensor(a).float()) + float(b)).float())
    t = x + MAGIC
    t = torch.maximum(torch.nan_to_num(t, nan=MAGIC, neginf=MAGIC), torch.tensor(MAGIC))
    return (t.view(torch.int32) & 0xFF).to(torch.uint8)


def decoded(codes: torch.Tensor) -> torch.Tensor:
    return decode_e4m3(codes)


# ----------------------------------------------------------------------------------------- fits


def _band(n=9001, lo=-18.5, hi=-14.0):
    return torch.linspace(lo, hi, n, dtype=torch.float64)


def fit_two_piece(beta=EXPCAST_BETA, lo=-18.5, hi=-14.0):
    """Least squares in value (code units) of round(max(normal, a u + b, 0)) vs 2^(u + 17) on u in
    [lo, hi] uniform; grid a in [1.5, 4], b in [25, 50], step 0.01 after a 0.05 coarse pass."""
    u = _band(2251, lo, hi)
    target = torch.exp2(u + 17.0)
    normal = u * 8.0 + 120.0 + beta

    def err(a, b):  # a, b: [K] -> [K]
        x = torch.maximum(normal[None, :], a[:, None] * u[None, :] + b[:, None]).clamp(0, 120)
        c = torch.round(x)
        val = torch.where(c < 8, c, decode_e4m3(c.to(torch.uint8)).double() * 512.0)
        return (val - target[None, :]).pow(2).mean(1)

    best = (math.inf, None)
    for step in (0.05, 0.01, 0.002):
        if best[1] is None:
            alo, ahi, blo, bhi = 1.5, 4.0, 25.0, 50.0
        else:
            a0, b0 = best[1]
            alo, ahi, blo, bhi = a0 - 5 * step, a0 + 5 * step, b0 - 25 * step, b0 + 25 * step
        A = torch.arange(alo, ahi + 1e-9, step, dtype=torch.float64)
        B = torch.arange(blo, bhi + 1e-9, step, dtype=torch.float64)
        aa, bb = torch.meshgrid(A, B, indexing="ij")
        aa, bb = aa.reshape(-1), bb.reshape(-1)
        for i0 in range(0, aa.numel(), 2048):
            e = err(aa[i0 : i0 + 2048], bb[i0 : i0 + 2048])
            j = int(e.argmin())
            if e[j] < best[0]:
                best = (e[j].item(), (aa[i0 + j].item(), bb[i0 + j].item()))
    return best[1], best[0]


def fit_three_piece(beta=EXPCAST_BETA, lo=-18.5, hi=-14.0):
    """Two sub-band pieces jointly (coordinate descent from the chord pieces through codes 1-3 and
    3-8, steps 0.05 then 0.01), same criterion as fit_two_piece."""
    u = _band(2251, lo, hi)
    target = torch.exp2(u + 17.0)
    normal = u * 8.0 + 120.0 + beta

    def err(p):
        x = normal.clone()
        for a, b in p:
            x = torch.maximum(x, a * u + b)
        c = torch.round(x.clamp(0, 120))
        val = torch.where(c < 8, c, decode_e4m3(c.to(torch.uint8)).double() * 512.0)
        return (val - target).pow(2).mean().item()

    # chords: codes 1 -> 3 over u in [-17, -15.415], codes 3 -> 8 over [-15.415, -14]
    u3 = math.log2(3) - 17
    a1 = 2.0 / (u3 + 17.0)
    a2 = 5.0 / (-14.0 - u3)
    p = [[a2, 8 + 14 * a2], [a1, 1 + 17 * a1]]
    cur = err(p)
    for step in (0.1, 0.05, 0.02, 0.01):
        improved = True
        while improved:
            improved = False
            for i in range(2):
                for j in range(2):
                    for d in (-step, step):
                        q = [list(x) for x in p]
                        q[i][j] += d
                        e = err(q)
                        if e < cur - 1e-12:
                            p, cur, improved = q, e, True
    return [tuple(x) for x in p], cur


def _band_stats(codes, beta=EXPCAST_BETA):
    """Value error stats (code units) of a byte path codes(u) on u uniform in [-18.5, -14], and its
    normal-range byte changes against plain ExpCast at the same beta."""
    u = _band(200001).float()
    target = torch.exp2(u.double() + 17.0)
    c = codes(u)
    val = decode_e4m3(c).double() * 512.0
    e = val - target
    un = torch.linspace(-14.0, 0.0, 1_000_001)
    changed = int((codes(un) != pieces_codes(un, [], beta)).sum())
    return {"band_rmse_codes": e.pow(2).mean().sqrt().item(), "band_mean_signed_codes": e.mean().item(),
            "band_mass_ratio": (val.sum() / target.sum()).item(),
            "lowest_u_nonzero": u[c > 0].min().item() if (c > 0).any() else float("nan"),
            "normal_range_bytes_changed_vs_expcast": changed}


def band_stats(pieces, beta=EXPCAST_BETA):
    """_band_stats of the u-space pieces (pieces_codes)."""
    return _band_stats(lambda u: pieces_codes(u, pieces, beta), beta)


def fit_code_piece(beta=EXPCAST_BETA, lo=-18.5, hi=-14.0, dens=(16, 32, 64, 128, 256)):
    """The kernels' tail piece: T(c) = round(A c + B) on the main code c = round(8u + 120 + beta),
    byte max(c, T(c)) clipped to [0, 120] (kernels/reference/expcast.py::tail_bytes). The same
    criterion as fit_two_piece, over A = k / den (dyadic: a kernel's FFMA on M + c is then exact)
    and B an integer (exact in that FFMA's addend, whose ulp is 1). Returns ((A, B), mse); ties in
    mse go to the smallest denominator, then the smallest A."""
    u = _band(2251, lo, hi)
    target = torch.exp2(u + 17.0)
    c = torch.round(u * 8.0 + 120.0 + beta)
    best = (math.inf, None)
    for den in dens:
        for k in range(1, den):
            a = k / den
            for b in range(-10, 11):
                code = torch.maximum(c, torch.round(c * a + b)).clamp(0, 120)
                val = torch.where(code < 8, code, decode_e4m3(code.to(torch.uint8)).double() * 512.0)
                e = (val - target).pow(2).mean().item()
                if e < best[0] - 1e-12:
                    best = (e, (a, float(b)))
    return best[1], best[0]


def code_band_stats(tail, beta=EXPCAST_BETA):
    """_band_stats of the code piece (A, B) of fit_code_piece."""
    from ..reference.expcast import tail_bytes

    return _band_stats(lambda u: tail_bytes(torch.round(u * 8.0 + (120.0 + beta)), tail), beta)


OLD_COMMIT = "7650cad"  # the last library commit whose ExpCast used the exact running row max
REFERENCES = ("exact_max", "snapped", "folded")


# ------------------------------------------------------------------------------------ recurrence


def online_expcast(q, k, v, *, reference, score_scale, q_scale=None, k_scale=None, mu=None,
                   beta=EXPCAST_BETA, block_n=V_BLOCK, dtype=torch.float32, scores=None, stats=None):
    """kernels/reference/attention.py::online_attention for p_mode "expcast", no key bias, with the
    reference point as a switch: reference="exact_max" (the recurrence until 7650cad), "snapped"
    (until e845ad3) or "folded" (HEAD: the snapped point moved per tile by delta / 8, delta the
    INT8 kernels' fold of their int32 -> fp32 conversion, kernels/triton/online.py::expcast_fold;
    with precomputed scores there is no INT8 scale: delta = 0, as "snapped"). Same operations in the
    same order as the library, so each matches its version bit for bit.

    scores: optional precomputed log2-domain scores [B, H, M, N] (then q, k, q_scale, k_scale are
    unused; measure.py's exact-QK path). stats: optional dict; adds the count of zero bytes (underflow)
    and of bytes, over real keys."""
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}")
    B, H, M = (scores.shape[:3] if scores is not None else q.shape[:3])
    N = scores.shape[3] if scores is not None else k.shape[2]
    dev = v.device
    if scores is None:
        q = q.to(dtype)
        row_factor = torch.full((B, H, M), float(score_scale), dtype=dtype, device=dev)
        if q_scale is not None:
            row_factor = q_scale.to(dtype) * float(score_scale)
    m = torch.full((B, H, M), -math.inf, dtype=dtype, device=dev)
    d = torch.zeros((B, H, M), dtype=dtype, device=dev)  # "folded": the previous tile's delta
    l = torch.zeros((B, H, M), dtype=dtype, device=dev)
    acc = torch.zeros((B, H, M, v.shape[-1]), dtype=dtype, device=dev)
    for j0 in range(0, N, block_n):
        j1 = min(j0 + block_n, N)
        if scores is not None:
            s = scores[..., j0:j1].to(dtype)
        else:
            s = q @ k[:, :, j0:j1].to(dtype).transpose(-1, -2)
            if k_scale is not None:
                s = s * (row_factor[..., None] * k_scale[:, :, None, j0:j1].to(dtype))
            else:
                s = s * row_factor[..., None]
        if reference in ("snapped", "folded"):
            m_new = torch.maximum(m, expcast_reference_point(s.amax(dim=-1), beta))
        else:
            m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        if reference in ("snapped", "folded"):
            delta = torch.zeros_like(m)
            if reference == "folded" and scores is None and k_scale is not None:
                c8 = 8.0 * (row_factor.float() * k_scale[:, :, j0, None].float())
                delta = expcast_fold_delta(c8).to(dtype)
            alpha = torch.exp2((m - m_safe + delta - d) / 8.0)
            u = s - ((m_safe + beta - delta) / 8.0)[..., None]
            d = delta
        else:
            alpha = torch.exp2(m - m_safe)
            u = s - m_safe[..., None]
        codes = expcast_codes(u, beta)
        if stats is not None:
            stats["zero_bytes"] = stats.get("zero_bytes", 0) + int((codes == 0).sum())
            stats["bytes"] = stats.get("bytes", 0) + codes.numel()
        p = decode_e4m3(codes).to(dtype)
        r = p.sum(dim=-1)
        l = alpha * l + r
        acc = alpha[..., None] * acc + p @ v[:, :, j0:j1].to(dtype)
        if mu is not None:
            acc = acc + r[..., None] * mu[:, :, j0 // V_BLOCK, None, :].to(dtype)
        m = m_new
    return acc / l[..., None]


def vs_expcast(q, k, v, perm, *, reference, beta=EXPCAST_BETA, dtype=torch.float32, stats=None):
    """reference_vc_attention(bits=8, v_smooth=True, expcast=True, perm=perm) for finite inputs
    without a key bias (the probes), on ``online_expcast``. [B, H, M, D] / [B, H, N, D] -> [B, H, M, D]."""
    B, H, M, D = q.shape
    N = k.shape[2]
    sm_scale = D ** -0.5
    k, v = permute_tokens(k, perm), permute_tokens(v, perm)
    k = k.float()
    k = k - k.mean(dim=2, keepdim=True)
    qc, qs, _ = QK_FORMATS["int8"](q)
    kc, ks, _ = QK_FORMATS["int8"](k)
    q_rows = qs.repeat_interleave(QK_BLOCK, dim=-1)[..., :M]
    k_cols = ks.repeat_interleave(QK_BLOCK, dim=-1)[..., :N]
    v = v.float()
    mu = block_means(v)
    vc, vs, _ = quantize_e4m3_per_channel(demean(v, mu))
    o = online_expcast(qc.float(), kc.float(), vc, reference=reference, score_scale=sm_scale * LOG2E,
                       q_scale=q_rows, k_scale=k_cols, mu=mu / vs[:, :, None, :], beta=beta,
                       dtype=dtype, stats=stats)
    return o * vs[:, :, None, :].to(dtype)


def exact_scores(q, k):
    """measure.quantised_scores(qk="exact"): float64 product, rounded to fp32. [M, D], [N, D] -> [M, N]."""
    return (q.double() @ k.double().T * (q.shape[-1] ** -0.5 * LOG2E)).float()


# ------------------------------------------------------------------------------ old library file


def load_old_attention(commit: str = OLD_COMMIT):
    """kernels/reference/attention.py as of `commit`, loaded as a second module of the same package
    (its relative imports resolve to the checkout's quantisers); the library itself is not touched."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:kernels/reference/attention.py"],
                         capture_output=True, text=True, check=True).stdout
    name = f"vc_attention.kernels.reference._attention_{commit}"
    path = ROOT / "kernels" / "reference" / f"_attention_{commit}.py"  # never written; names the module
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "vc_attention.kernels.reference"
    mod.__file__ = str(path)
    sys.modules[name] = mod
    exec(compile(src, f"{commit}:kernels/reference/attention.py", "exec"), mod.__dict__)  # noqa: S102 (own git file)
    assert "expcast_reference_point" not in src, "expected the exact-max recurrence"
    return mod
