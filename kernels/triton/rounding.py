"""Rounding helpers shared by the Triton kernels (E4M3 and bf16)."""

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3_grid(x):
    """Round fp32 x to the nearest E4M3 value (ties to even), still as fp32.

    The hardware conversion (cvt.rn.satfinite.e4m3x2.f32) already does this; the kernels call it
    first only when SOFTWARE_ROUNDING is set (under the interpreter), because Triton's interpreter (3.9) converts
    wrongly when rounding carries into the exponent (7.96 -> 4 instead of 8). On exactly
    representable inputs both conversions agree, so the interpreter then computes what the GPU does.
    Normals: round the fp32 mantissa to 3 bits on the bit pattern. Subnormals (|x| < 2^-6) sit on
    a fixed 2^-9 grid: adding and removing 2^14 (whose fp32 ulp is 2^-9) rounds them there.
    """
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    normal = rounded.to(tl.float32, bitcast=True)
    ax = tl.abs(x)
    sub = (ax + 16384.0) - 16384.0
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(ax < 0.015625, sub, normal)


@triton.jit
def int8_codes(x, inv, SOFTWARE_ROUNDING: tl.constexpr):
    """x * inv rounded once to the nearest integer, ties to even, clamped to [-127, 127], as int8.

    One FMA against M = 1.5 * 2^23, whose ulp is 1, rounds the exact product (never its fp32
    rounding first; the reference: torch.round of the float64 product, exact); the explicit fma is
    what makes it one rounding. It leaves t = M + y (|y| < 2^22), whose bits are 0x4B400000 + y, and
    the low byte of that is y in two's complement; the clamp is taken on t (the same order), so the
    code is the low byte of t's bits: per element one FFMA and two FMNMX, against FFMA + FADD + two
    FMNMX + F2I (sm_90 SASS of the Q/K quantiser). Under the interpreter (numpy has no fused
    multiply-add) the rounding is done in float64, where the product is exact, and t = y + M exactly;
    the same bit steps follow."""
    if SOFTWARE_ROUNDING:
        y = (x.to(tl.float64) * inv.to(tl.float64) + 6755399441055744.0) - 6755399441055744.0
        t = y.to(tl.float32) + 12582912.0
    else:
        t = tl.fma(x, inv, 12582912.0)
    t = tl.minimum(tl.maximum(t, 12582912.0 - 127.0), 12582912.0 + 127.0)
    return t.to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def round_to_bf16(x):
    """fp32 -> bf16 rounded to nearest even, done on the bit pattern.

    Triton's interpreter converts fp32 -> bf16 by truncation, the GPU by rounding. The block means
    (one [D] vector per 128 rows, so the cost is nil) always go through this, so both store the
    value the reference stores; bf16 outputs go through it under the interpreter only. NaN stays
    NaN and inf stays inf.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == ~0xFFFF
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
