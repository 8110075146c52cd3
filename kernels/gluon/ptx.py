"""The kernel's hand-written PTX, each piece an instruction or two that Gluon has no op for.

- fence.acq_rel.cta: a point ptxas does not move a wgmma wait across (attention_sm90.py's step);
- P's bytes packed four to a 32-bit word, the register form the P.V wgmma reads (flag_pack):
  by PRMT from ExpCast's FFMA results, or by the E4M3 conversion itself on the exp2 path.

(The ring's named barriers are ring.py's stage_barrier.)

Every asm takes and returns 32-bit registers (pack=1): `dummy` arguments exist because
inline_asm_elementwise needs a tensor operand.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def fence_cta(dummy):
    """fence.acq_rel.cta (MEMBAR.ALL.CTA)."""
    gl.inline_asm_elementwise("fence.acq_rel.cta;\n mov.b32 $0, $1;", "=r,r", [dummy], gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def quads(x):
    """[R, K] -> the four [R, K / 4] tensors of elements 4m, 4m + 1, 4m + 2, 4m + 3 (registers of one
    thread in the operand layout: a renaming)."""
    rows: gl.constexpr = x.shape[0]
    cols: gl.constexpr = x.shape[1]
    e, o = gl.split(gl.reshape(x, [rows, cols // 4, 2, 2]))  # last axis: element parity
    x0, x2 = gl.split(e)
    x1, x3 = gl.split(o)
    return x0, x1, x2, x3


@gluon.jit
def pack_words(t, LOW_BYTES: gl.constexpr, EXPCAST: gl.constexpr):
    """flag_pack: the softmax's fp32 results (operand order) -> the 32-bit words of P's bytes the loop
    carries. ExpCast (FFMA results): flag_pack_words for the no-clip copy's 2^23 + b; LOW_BYTES (t
    already clipped, within [M, M + 120], M = 1.5 * 2^23: the clipped copy, and every copy with the
    tail piece) the low bytes, 3 PRMT per word as Triton packs bytes. exp2 (P's values): e4m3_words."""
    if not EXPCAST:
        return e4m3_words(t)
    if LOW_BYTES:
        t0, t1, t2, t3 = quads(t)
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 pa, pb;
            prmt.b32 pa, $1, $2, 0x0040;
            prmt.b32 pb, $3, $4, 0x0040;
            prmt.b32 $0, pa, pb, 0x5410;
            }""",
            "=r,r,r,r,r", [t0, t1, t2, t3], gl.int32, is_pure=True, pack=1)
    return flag_pack_words(t)


@gluon.jit
def flag_pack_words(t):
    """ExpCast without the clip at 120: FFMA results t = 2^23 + b -> bytes max(b, 0), four to a 32-bit
    word, by PRMT. For b >= 0, t lies in [2^23, 2^24), its ulp is 1 and its low byte is b (b <= 120:
    the no-clip copy only); for b < 0 (down to -2^22: the caller's |8 s| < 2^21) t falls into the
    binade below, whose exponent's low bit (bit 23, the top bit of byte 2) is 1: that bit zeroes the
    byte. Two PRMTs pair the low bytes and the flag bytes of t0, t1 and of t2, t3, two more gather the
    bytes and the flags (sign-replicated: 0xFF or 0x00), one LOP3 masks: 5 instructions per 4 scores
    where the clip at 0 and the packing take 7."""
    t0, t1, t2, t3 = quads(t)
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 pa, pb, u, m;
        prmt.b32 pa, $1, $2, 0x6240;
        prmt.b32 pb, $3, $4, 0x6240;
        prmt.b32 u, pa, pb, 0x5410;
        prmt.b32 m, pa, pb, 0xFEBA;
        not.b32 m, m;
        and.b32 $0, u, m;
        }""",
        "=r,r,r,r,r", [t0, t1, t2, t3], gl.int32, is_pure=True, pack=1)


@gluon.jit
def e4m3_words(t):
    """The exp2 path: P's fp32 values (operand order) -> E4M3 bytes four to a 32-bit word, by the
    conversion `.to(gl.float8e4nv)` lowers to (cvt.rn.satfinite.e4m3x2.f32, two values each) and one
    merge: the same bytes, 3 instructions per 4 scores. (Carried as bytes, Triton unpacked the
    conversion's byte pairs and repacked them into the wgmma operand: SHF, LOP3, PRMT.)"""
    t0, t1, t2, t3 = quads(t)
    return gl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
        cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
        mov.b32 $0, {lo, hi};
        }""",
        "=r,r,r,r,r", [t0, t1, t2, t3], gl.int32, is_pure=True, pack=1)
