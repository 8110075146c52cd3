"""The probability byte P, two ways (8-bit kernels; P is scaled by 2^8 so the largest code is 256).

u = (s - m_i) log2(e) <= 0 is the online-softmax log score of one element.

- exp2 + cast: p = E4M3(2^(u + 8)), rounded to nearest even.
- ExpCast-FP8: an E4M3 byte read as an integer is about 8 log2(v) + 56, so write it directly:
      c(u) = clip_[0, 120](round(8 (u + 8) + 56 + beta)),  beta = -0.35
  and reinterpret c as E4M3. 120 is the byte of 256 = 2^8; 127 (0x7F) would be NaN and is never
  reached. Both the numerator (P V) and the row sum l use the same decoded bytes.
"""

import torch

EXPCAST_BETA = -0.35
P_LOG2_SCALE = 8.0  # P carries a factor 2^8: the row maximum is the byte 120 = 256
MAX_CODE = 120


def expcast_codes(u: torch.Tensor, beta: float = EXPCAST_BETA) -> torch.Tensor:
    """ExpCast bytes (uint8) for log2 scores u <= 0. -inf gives 0. Round half to even, as the
    kernel's magic-constant rounding does."""
    x = 8.0 * (u.float() + P_LOG2_SCALE) + 56.0 + beta
    x = torch.nan_to_num(x, nan=0.0, neginf=0.0).clamp(0.0, float(MAX_CODE))
    return torch.round(x).to(torch.uint8)


# ExpCast's tail piece: E4M3's subnormal codes 1-7 decode linearly (m * 2^-9), not on ExpCast's
# log line, so below 2^-14.9 of the row maximum the line writes 0 and just above it codes that are
# up to 4x too small. On long rows that band carries a visible share of the row's mass (FIDELITY.md,
# "ExpCast tail"). The piece is a second line on the main code c itself, T(c) = round(A c + B), and
# the byte is max(c, T(c)) clipped to [0, 120]: A = 3/16 and B = 4 are the least-squares fit in
# value over u in [-18.5, -14] (kernels/fidelity/expcast_variants.py::fit_code_piece) with A
# dyadic and B an integer, so that a kernel forms T from its FFMA result M + c exactly with one more
# FFMA (M + c) A + (M (1 - A) + B): kernels/triton/online.py::expcast_bytes_fma.
EXPCAST_TAIL = (0.1875, 4.0)
# Off by default: on the H200 the piece costs 11-16% of the Hopper kernel's time for +4.7 dB at
# 22-30K tokens with E4M3 bytes (FIDELITY.md, BENCHMARKS.md), and the default E5M2 bytes (below) have
# no subnormal band to fix; every kernel takes it as a launch option (expcast_tail=True, with E4M3
# bytes) and the reference as a keyword.
TAIL_ON = False


def expcast_tail_codes(u: torch.Tensor, beta: float = EXPCAST_BETA, tail=EXPCAST_TAIL) -> torch.Tensor:
    """ExpCast bytes with the tail piece: c = round(8 (u + 8) + 56 + beta) unclipped, then
    max(c, round(A c + B)) clipped to [0, 120]; -inf gives 0. Every byte with c >= 5 equals
    expcast_codes' (there the piece lies below the line)."""
    return tail_bytes(torch.round(8.0 * (u.float() + P_LOG2_SCALE) + 56.0 + beta), tail)


def tail_bytes(c: torch.Tensor, tail=EXPCAST_TAIL) -> torch.Tensor:
    """Main codes c (integers as fp32, unclipped; -inf allowed) -> the bytes with the tail piece.
    A c + B is exact in fp32 (A dyadic, |c| < 2^20), so one round-half-even gives the kernels' byte."""
    c = torch.nan_to_num(c.float(), nan=-1.0e6, neginf=-1.0e6).clamp(min=-1.0e6)
    x = torch.maximum(c, torch.round(c * tail[0] + tail[1]))
    return x.clamp(0.0, float(MAX_CODE)).to(torch.uint8)


def expcast_reference_point(row_max: torch.Tensor, beta: float = EXPCAST_BETA, codes: float = 8.0) -> torch.Tensor:
    """The integer k of ExpCast's reference point m' = (k + beta) / 8: the smallest point of that
    grid at or above the row max (k = ceil(8 max - beta); -inf stays -inf).

    Exact softmax is the same for any m' >= the max; on this grid u = s - m' gives
    8 (u + 8) + 56 + beta = 8 s - k + 120, so the byte is round(8 s - k + 120): the kernels form it
    in one fused multiply-add (kernels/triton/online.py::expcast_bytes_fma) and rescale by the exact
    2^((k_old - k_new) / 8). ExpCast's bytes do depend on m': with the exact max the row's largest
    value is always the exact byte 120; here it is 119 or 120, which costs 0.14 dB at the output on
    the real-clip probes (FIDELITY.md, "ExpCast's reference point"). With INT8 Q/K the kernels also
    fold the dot's int32 -> fp32 conversion into that FMA, which moves each tile's point by delta / 8,
    |delta| <= 5/8 (kernels/triton/online.py::expcast_fold; the reference's online_attention
    expcast_fold does the same). codes: codes per octave (CODES_PER_OCTAVE: 4 for E5M2 P, whose grid
    is (k + beta) / 4 and byte round(4 s - k + 120))."""
    return torch.ceil(codes * row_max - beta)


def expcast_fold_delta(c8: torch.Tensor) -> torch.Tensor:
    """delta of the INT8 kernels' fold (kernels/triton/online.py::expcast_fold) for fp32 tile scales
    c8, in float64: E - e with E = 1.5 * 2^23 c8 and e the integer the kernels take (floor of E in
    fp32 plus 1/2); 0 where c8 >= 1/4 (not folded)."""
    e = torch.floor((c8 * 8388608.0 + c8 * 4194304.0) + 0.5)  # fp32, as the kernels
    return torch.where(c8 < 0.25, 12582912.0 * c8.double() - e.double(), 0.0)


def exp2_cast_codes(u: torch.Tensor) -> torch.Tensor:
    """exp2 + E4M3 cast bytes (uint8) for log2 scores u <= 0."""
    p = torch.exp2(u.float() + P_LOG2_SCALE)
    return p.to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bytes -> fp32 values."""
    return codes.view(torch.float8_e4m3fn).float()


# P in E5M2 (2 mantissa bits, 5 exponent bits): the same byte line at 4 codes per octave,
#     c5(u) = clip_[0, 120](round(4 (u + 15) + 60 + beta5)),  120 the byte of 2^15,
# so P carries 2^15 and the reference point's grid is (k + beta5) / 4. E5M2's normal range reaches
# 2^-29 of the row maximum (E4M3's 2^-14): no part of a long row's tail underflows, where E4M3's
# loses the band that carries a visible share of the mass at 30-110K keys (FIDELITY.md, "P in
# E5M2"); each byte is coarser. Hopper's wgmma takes E5M2 P against E4M3 V at the FP8 rate.
# beta5 = -0.25: a sweep over -0.35 .. 0 on the probes moved the P term by < 1 dB (best at -0.175 /
# -0.1, -0.25 0.3 dB below); -0.25 keeps the kernels' proof that the row maximum's byte stays <= 120
# with the fold's |delta| <= 5/8 (kernels/triton/online.py::expcast_fold): 120 - 0.25 + 0.625 + 1/16 < 120.5.
P_FORMATS = ("e4m3", "e5m2")
CODES_PER_OCTAVE = {"e4m3": 8.0, "e5m2": 4.0}
P_CARRY = {"e4m3": P_LOG2_SCALE, "e5m2": 15.0}  # log2 of the factor P's values carry
EXPCAST_BETA_E5M2 = -0.25
P_BETA = {"e4m3": EXPCAST_BETA, "e5m2": EXPCAST_BETA_E5M2}
# The default byte format of ExpCast's P in the portable and Hopper kernels and the reference (launch
# option p_e5m2, the reference's p_format): E5M2. On the H200 at 52-71K tokens it is +7.8 dB over
# E4M3 bytes at the same speed (FIDELITY.md, "P in E5M2"; BENCHMARKS.md). exp2 + cast P stays E4M3,
# as does the mma.sync kernel's ExpCast option (kernels/triton/attention_mma.py).
P_E5M2_ON = True


def p_format_of(p_e5m2, expcast=True, tail=False) -> str:
    """A launch's p_e5m2 -> "e4m3" | "e5m2". None: the default, E5M2 for ExpCast where P_E5M2_ON,
    E4M3 for exp2 + cast and for ExpCast with its tail piece (an E4M3 piece). An explicit
    p_e5m2=True without ExpCast or with the tail piece is the caller's error to raise."""
    if p_e5m2 is None:
        return "e5m2" if P_E5M2_ON and expcast and not tail else "e4m3"
    return "e5m2" if p_e5m2 else "e4m3"


def expcast_codes_e5m2(u: torch.Tensor, beta: float = EXPCAST_BETA_E5M2) -> torch.Tensor:
    """ExpCast bytes for E5M2 P (uint8) for log2 scores u <= 0; -inf gives 0."""
    x = 4.0 * (u.float() + P_CARRY["e5m2"]) + 60.0 + beta
    x = torch.nan_to_num(x, nan=0.0, neginf=0.0).clamp(0.0, float(MAX_CODE))
    return torch.round(x).to(torch.uint8)


def exp2_cast_codes_e5m2(u: torch.Tensor) -> torch.Tensor:
    """exp2 + E5M2 cast bytes (uint8) for log2 scores u <= 0."""
    return torch.exp2(u.float() + P_CARRY["e5m2"]).to(torch.float8_e5m2).view(torch.uint8)


def decode_e5m2(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E5M2 bytes -> fp32 values."""
    return codes.view(torch.float8_e5m2).float()
