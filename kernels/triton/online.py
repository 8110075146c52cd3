"""The online-softmax recurrence shared by the 8-bit and the 4-bit fused kernels.

Per key tile j of one block of query rows (log2 domain, s = the tile's scores):
    m_j = max(m_{j-1}, max_k s),  alpha = 2^(m_{j-1} - m_j)
    l_j = alpha l_{j-1} + r_j,    O_j = alpha O_{j-1} + P_j V_residual + r_j mu_j
with r_j the row sum of the same quantised P that multiplies V, and mu_j the V-Smooth mean of the
128-key block the tile lies in (added in fp32: the mean is never quantised). The kernels differ only
in how they make P and P V (kernels/triton/attention.py, attention_fp4.py).
"""

import triton
import triton.language as tl

from ..reference.expcast import EXPCAST_TAIL
from .rounding import round_to_bf16

EXPCAST_TAIL_A = tl.constexpr(EXPCAST_TAIL[0])  # ExpCast's tail piece T(c) = round(A c + B)
EXPCAST_TAIL_B = tl.constexpr(EXPCAST_TAIL[1])


@triton.jit
def _running_max(m_i, tile_max):
    """-> (m_new, m_safe, alpha). Rows whose keys so far are all -inf keep m = -inf: m_safe is 0
    there, so s - m_safe stays -inf (not NaN) and alpha is 0."""
    m_new = tl.maximum(m_i, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    return m_new, m_safe, alpha


@triton.jit
def online_max(m_i, s):
    """The running max over a tile of scores s -> (m_new, m_safe, alpha) (_running_max)."""
    return _running_max(m_i, tl.max(s, axis=1))


@triton.jit
def online_max_scaled(m_i, x, scale):
    """online_max of s = x * scale from the unscaled scores x: max(x) * scale is the same fp32 value
    as max(x * scale) for a scale >= 0 (rounding is monotonic; the kernels' score scales are products
    of block amaxes and sm_scale log2 e > 0), one multiply per row instead of one per score."""
    m_new = tl.maximum(m_i, tl.max(x, axis=1) * scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    return m_new, m_safe, alpha


@triton.jit
def finish_8bit(O, acc, l_i, VS, QBAD, KBAD, b, h, bh, M, offs_m, offs_d, m_valid,
                stride_ob, stride_oh, stride_om, stride_od, HEAD_DIM: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
    """O = A v_scale / l, NaN where a query row or the (batch, head)'s keys held a non-finite value."""
    b_vs = tl.load(VS + bh * HEAD_DIM + offs_d)
    b_o = acc / l_i[:, None] * b_vs[None, :]
    bad = (tl.load(QBAD + bh * M + offs_m, mask=m_valid, other=0) != 0) | (tl.load(KBAD + bh) != 0)
    store_output(O, b_o, bad[:, None], b, h, offs_m, offs_d, m_valid, stride_ob, stride_oh, stride_om,
                 stride_od, SOFTWARE_ROUNDING)


@triton.jit
def expcast_max(k_i, tile_max, BETA: tl.constexpr, dd, CPO: tl.constexpr = 8.0):
    """ExpCast's running reference point -> (k_new, k_safe, alpha).

    ExpCast writes round(8 (u + 8) + 56 + beta) with u = s - m'. Taking m' on the grid (k + beta) / 8,
    k an integer (the smallest such point at or above the max: k = ceil(8 max - beta)), makes the
    byte round(8 s - k + 120), which the kernels form in one fused multiply-add (expcast_bytes_fma);
    the reference does the same (kernels/reference/expcast.py::expcast_reference_point, with what
    it costs in fidelity). The state is k itself (exact in fp32), so the rescale
    alpha = 2^((k_old - k_new + dd) / 8) is exact as well; dd is the change of the tile's byte
    offset delta (expcast_fold; 0 where nothing is folded). Rows with no finite score keep k = -inf.
    CPO: codes per octave, 8 for E4M3 bytes, 4 for E5M2 ones (grid (k + beta) / 4, byte
    round(4 s - k + 120): kernels/reference/expcast.py)."""
    k_new = tl.maximum(k_i, tl.ceil(CPO * tile_max - BETA))
    k_safe = tl.where(k_new == float("-inf"), 0.0, k_new)
    alpha = tl.math.exp2((k_i - k_safe + dd) * (1.0 / CPO))
    return k_new, k_safe, alpha


@triton.jit
def expcast_fold(c8):
    """ExpCast with the int32 -> fp32 conversion folded into its FMA -> (e, delta, carried).

    The INT8 Q.K dot x arrives as x' = 1.5 * 2^23 + x (its bits plus those of 1.5 * 2^23: exact, one
    integer add, no float subtract). x' c8 = x c8 + E with E = 1.5 * 2^23 c8; the FMA's addend takes
    off an integer e next to E (exact, and so is the addend) and the byte becomes
    round(8 s - k + 120 + delta), delta = E - e: the tile's bytes are taken against the reference
    point (k + beta - delta) / 8 rather than (k + beta) / 8, which exact softmax does not see and the
    rescale follows (expcast_max's dd). e = floor(fp32(a + b) + 1/2) with a = 2^23 c8, b = 2^22 c8
    (both exact), delta = (a - e) + b: both adds are exact (a - e is a multiple of ulp(a) about half
    its size, and delta of ulp(b)), so every implementation, with or without a fused FMA, gets the
    same e and the exact delta; |delta| <= 1/2 + ulp(E) / 2 <= 5/8, and the largest byte stays <= 120
    (8 s - k <= -0.35). One float subtract per score less. Only while c8 < 1/4 (E < 2^22: exact);
    else e = delta = 0 and the caller subtracts 1.5 * 2^23 as before. carried: what the caller's
    scores x' - (1.5 * 2^23 - carried) still carry on top of x (1.5 * 2^23 when folded, else 0)."""
    fold = c8 < 0.25
    a = c8 * 8388608.0  # E = a + b, both exact (powers of two)
    b = c8 * 4194304.0
    e = tl.where(fold, tl.floor((a + b) + 0.5), 0.0)
    delta = tl.where(fold, (a - e) + b, 0.0)  # both adds exact (see above): delta = E - e exactly
    carried = tl.where(fold, 12582912.0, 0.0)
    return e, delta, carried


@triton.jit
def expcast_bytes_fma(x, c8, k_safe, e, TAIL: tl.constexpr, CLIP_HI: tl.constexpr = True,
                      P_E5M2: tl.constexpr = False):
    """ExpCast bytes for scores s = x c8 / 8 (or x' = 1.5 * 2^23 + x with e = expcast_fold's) against
    the reference point of expcast_max: round(x c8 - k + 120 [+ delta]) clipped to [0, 120], as E4M3.

    One FFMA per score: x c8 + (M + 120 - e - k) with M = 1.5 * 2^23 rounds once, to an integer, in
    the low mantissa bits (ties to even, the reference's rounding); max(., M) sends every byte below 0
    (and -inf) to 0. Exact while |8 max| and |k| stay below 2^21 (scores within +-2^18 log2 units);
    then x c8 - k <= -0.35 and the byte never passes 120, so the clip at 120 (min(., M + 120))
    changes nothing there. It is for scores beyond (huge logits, or a huge finite key bias such as
    -1e9), where fp32 cannot hold the FMA exactly: the byte can then never become negative or the
    NaN code, and such rows degrade to coarse but finite weights. CLIP_HI=False drops that clip
    where the caller has proved the bound (the folded INT8 path: c8 < 1/4 and no key bias).

    TAIL: ExpCast's tail piece (kernels/reference/expcast.py::tail_bytes), max(c, round(A c + B)) on
    the main code c before the clips: from t = M + c one more FFMA, t A + (M (1 - A) + B) = M + A c + B,
    rounds once to M + round(A c + B) (A = 3/16 dyadic, B an integer: the product and the addend are
    exact). t, the piece and M all lie in [2^23, 2^24), where fp32 order is int32 order: the max of
    the three (with the clip at 0) and the clip at 120 are taken on int32.

    P_E5M2: the same bytes read as E5M2 (c8 then holds the scale times 4: kernels/reference/expcast.py)."""
    t = tl.fma(x, c8, ((12582912.0 + 120.0) - e) - k_safe[:, None])
    if TAIL:
        t2 = tl.fma(t, EXPCAST_TAIL_A, 12582912.0 * (1.0 - EXPCAST_TAIL_A) + EXPCAST_TAIL_B)
        bits = tl.maximum(tl.maximum(t.to(tl.int32, bitcast=True), t2.to(tl.int32, bitcast=True)), 0x4B400000)
        if CLIP_HI:
            bits = tl.minimum(bits, 0x4B400078)
        bits = bits & 0xFF
    else:
        t = tl.maximum(t, 12582912.0)
        if CLIP_HI:
            t = tl.minimum(t, 12582912.0 + 120.0)
        bits = t.to(tl.int32, bitcast=True) & 0xFF
    # One return: Triton 3.6's front end compares the types of every return, even behind a constexpr.
    if P_E5M2:
        p = bits.to(tl.uint8).to(tl.float8e5, bitcast=True)
    else:
        p = bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return p


@triton.jit
def add_key_bias(s, BIAS, bias_base, offs_n, N, MASKED: tl.constexpr):
    """s + the per-key bias (log2 units) of the tile's keys; keys past N of a partial tile read 0."""
    if MASKED:
        b_bias = tl.load(BIAS + bias_base + offs_n, mask=offs_n < N, other=0.0)
    else:
        b_bias = tl.load(BIAS + bias_base + offs_n)
    return s + b_bias[None, :]


@triton.jit
def fold_tile(acc, l_i, alpha, r, pv, MU, bh, NBV, start_n, offs_d,
              HEAD_DIM: tl.constexpr, V_BLK: tl.constexpr, HAS_MEAN: tl.constexpr):
    """O <- alpha O + P V_residual + r mu ; l <- alpha l + r (V-Smooth's mean from the row sums)."""
    l_i = l_i * alpha + r
    acc = acc * alpha[:, None] + pv
    if HAS_MEAN:
        mu = tl.load(MU + (bh * NBV + start_n // V_BLK) * HEAD_DIM + offs_d)
        acc = acc + r[:, None] * mu[None, :]
    return acc, l_i


@triton.jit
def store_output(O, o, bad, b, h, offs_m, offs_d, m_valid, stride_ob, stride_oh, stride_om, stride_od,
                 SOFTWARE_ROUNDING: tl.constexpr):
    """NaN where `bad` (a non-finite input, as SDPA would give), then the tile in O's dtype."""
    o = tl.where(bad, float("nan"), o)
    if SOFTWARE_ROUNDING and O.dtype.element_ty == tl.bfloat16:
        o = round_to_bf16(o)  # the interpreter would truncate; the GPU rounds to nearest even
    p_o = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(p_o, o.to(O.dtype.element_ty), mask=m_valid[:, None])
