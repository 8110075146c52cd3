"""One key tile's scores -> P's FP8 bytes in the P.V operand's registers, with the online-softmax state.

The arithmetic is the Triton twin's (kernels/triton/attention.py::_attention_tile and
kernels/triton/online.py), rounding for rounding, so that with the same key tiles the two kernels
write the same bytes:

- scores: s = (x - carried) c8 / 8 in log2 units from the INT8 dot x and the two block scales.
  ExpCast without a key bias keeps the raw product and moves the scale, and while c8 < 1/4 the
  int32 -> fp32 conversion too, into the byte's FFMA (online.py::expcast_fold);
- ExpCast: the state is the integer k of the reference point (k + beta) / CODES on the grid (8 codes
  per octave for E4M3 bytes, 4 for E5M2 ones, the default: numerics.p_e5m2), and the
  byte is one FFMA per score (with the tail piece, an option: one FFMA more and the clips on int32),
  clipped to [0, 120]; the clip at 120 is dropped in the consumer copy
  whose scales prove it idle (launch_sm90.no_clip_flags), and there the conversion is folded for
  every tile (FOLD_ALL);
- exp2 + cast: the running max m, P = exp2(s - m + 8) converted to E4M3 (P carries 2^8);
- the row max of full tiles on the int32 dot where that is exact (INT_MAX): ptxas fuses pairs of
  max.s32 into VIMNMX3 (row_max's tree), the value converted once.

With V^T in wgmma order (Schedule.pv_perm) P's values are relabelled into the operand's order
(operand_order: a renaming of registers) and carried to the next step's P.V as 32-bit words
(pack_words, ptx.py); unpacked by from_words into the operand.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..reference.expcast import EXPCAST_TAIL

TAIL_A = gl.constexpr(EXPCAST_TAIL[0])  # ExpCast's tail piece T(c) = round(A c + B) (reference/expcast.py)
TAIL_B = gl.constexpr(EXPCAST_TAIL[1])


@gluon.jit
def int32_to_f32(x):
    """Exact int32 -> fp32 for |x| < 2^22 without I2F (kernels/triton/attention.py::_int32_to_f32)."""
    return (x + 0x4B400000).to(gl.float32, bitcast=True) - 12582912.0


@gluon.jit
def operand_order(p, BLOCK_N: gl.constexpr, PV_PERM: gl.constexpr):
    """P's [rows, BLOCK_N] scores or bytes relabelled into the P.V wgmma's operand order. With PV_PERM
    (V^T's columns written in wgmma order by the pre-pass: kernels/pipeline.py::pv_key) the A
    operand's position a of each 32-key chunk holds key pv_key(a): exactly the value the score
    accumulator already keeps in that thread, so this is a renaming of registers (without it Triton
    moves P between lanes: ~100 SHFL / SEL / PRMT per tile)."""
    if PV_PERM:
        rows: gl.constexpr = p.shape[0]
        # key offset bits (b4 b3 b2 b1 b0) -> operand position bits (b4 b2 b1 b3 b0)
        x = gl.reshape(p, [rows, BLOCK_N // 32, 2, 2, 2, 2, 2])
        x = gl.permute(x, [0, 1, 2, 4, 5, 3, 6])
        p = gl.reshape(x, [rows, BLOCK_N])
    return p


@gluon.jit
def from_words(w, P_E5M2: gl.constexpr = False):
    """[R, K / 4] int32 words -> [R, K] E4M3 (P_E5M2: E5M2) bytes (byte i of word m is element 4m + i)."""
    rows: gl.constexpr = w.shape[0]
    cols: gl.constexpr = w.shape[1] * 4
    b0 = (w & 0xFF).to(gl.uint8)
    b1 = ((w >> 8) & 0xFF).to(gl.uint8)
    b2 = ((w >> 16) & 0xFF).to(gl.uint8)
    b3 = ((w >> 24) & 0xFF).to(gl.uint8)
    x = gl.join(gl.join(b0, b2), gl.join(b1, b3))  # [R, K / 4, 2 (bit 1), 2 (bit 0)]
    # One return: Triton 3.6's front end compares the types of every return, even behind a constexpr.
    if P_E5M2:
        p = gl.reshape(x, [rows, cols]).to(gl.float8e5, bitcast=True)
    else:
        p = gl.reshape(x, [rows, cols]).to(gl.float8e4nv, bitcast=True)
    return p


@gluon.jit
def pv_operand(p8, cfg: gl.constexpr):
    """P as the A operand of the P.V and P.ones wgmma: its bytes (already in operand order; with
    pv_perm the conversion lowers to nothing), or with flag_pack its 32-bit words, unpacked."""
    if cfg.schedule.flag_pack:
        p8 = from_words(p8, cfg.numerics.p_e5m2)
    return gl.convert_layout(p8, cfg.p_layout)


@gluon.jit
def scores(s_acc, k_scale, BIAS, bias_base, start_n, N, qk_scale, cfg: gl.constexpr, MASKED: gl.constexpr,
           FOLD_ALL: gl.constexpr):
    """The wgmma accumulator of Q K^T -> (x, c8, e, delta, carried): scores s = (x - carried) c8 / 8
    in log2 units, as the twin's _attention_tile. FOLD_ALL: the no-clip copy, whose scales prove
    c8 < 1/4 for every tile (no_clip_flags), so x is the dot's bits plus those of 1.5 * 2^23 with no
    float subtract: one instruction per score less, the twin's values bit for bit."""
    BLOCK_N: gl.constexpr = cfg.tiles.block_n
    EXPCAST: gl.constexpr = cfg.numerics.expcast
    HAS_BIAS: gl.constexpr = cfg.numerics.has_bias
    scale = qk_scale * k_scale
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, cfg.s_layout))
    e = 0.0
    delta = 0.0
    carried = 0.0
    if EXPCAST and not HAS_BIAS:
        c8 = cfg.numerics.codes * scale  # 8 codes per octave (E4M3 bytes), 4 (E5M2)
        fold = c8 < 0.25  # kernels/triton/online.py::expcast_fold
        a = c8 * 8388608.0
        b = c8 * 4194304.0
        if FOLD_ALL:  # fold holds for every tile (no_clip_flags): the same values without the selects
            e = gl.floor((a + b) + 0.5)
            delta = (a - e) + b
            carried = 12582912.0
        else:
            e = gl.where(fold, gl.floor((a + b) + 0.5), 0.0)
            delta = gl.where(fold, (a - e) + b, 0.0)
            carried = gl.where(fold, 12582912.0, 0.0)
        x = (s_acc + 0x4B400000).to(gl.float32, bitcast=True)
        if not FOLD_ALL:
            x = x - (12582912.0 - carried)
    else:
        x = int32_to_f32(s_acc)
        x = x * scale
        c8 = cfg.numerics.codes
        if not EXPCAST:
            c8 = 8.0 * scale  # exp2's INT_MAX: the row max as max(dot) * scale (softmax_bytes)
        if HAS_BIAS:
            if MASKED:
                b = gl.load(BIAS + bias_base + offs_n, mask=offs_n < N, other=0.0)
            else:
                b = gl.load(BIAS + bias_base + offs_n)
            x = x + gl.expand_dims(b, 0)
    if MASKED:
        x = gl.where(gl.expand_dims(offs_n < N, 0), x, float("-inf"))
    return x, c8, e, delta, carried


@gluon.jit
def row_max(x, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """max over axis 1 of the [rows, BLOCK_N] scores in the wgmma layout: each thread holds 2 BLOCK_N / 8
    keys of a row (key bits 0 and 3.. in registers, bits 1-2 across 4 lanes). gl.max reduces a
    thread's keys one after the other (a chain of 31 dependent ops at 128 keys); on int32 (the
    dot's raw accumulator: softmax_bytes' INT_MAX) this tree takes them three at a time,
    max(max(a, b), c), which ptxas fuses into one VIMNMX3: 16 ops per row instead of 31; floats
    (sm_90 has no three-input float max) pair halves, 5 levels. Then the 4 lanes. (max is exact:
    no value changes.)"""
    rows: gl.constexpr = x.shape[0]
    # key = 8 n + 2 c + b -> [rows, n, c, b] -> [rows, c, n, b]: one thread's keys last
    y = gl.permute(gl.reshape(x, [rows, BLOCK_N // 8, 4, 2]), [0, 2, 1, 3])
    w: gl.constexpr = BLOCK_N // 4  # keys per thread per row
    if x.dtype == gl.int32:
        a, b = gl.split(gl.reshape(y, [rows, 4, w // 2, 2]))
        a0, a1 = gl.split(gl.reshape(a, [rows, 4, w // 4, 2]))
        b0, d = gl.split(gl.reshape(b, [rows, 4, w // 4, 2]))
        t = gl.maximum(gl.maximum(a0, a1), b0)  # w / 4 maxima of 3 keys; d: w / 4 keys not yet taken
        for i in gl.static_range(3 if BLOCK_N == 128 else 2):
            t0, t1 = gl.split(gl.reshape(t, [rows, 4, w // (8 << i), 2]))
            d0, d = gl.split(gl.reshape(d, [rows, 4, w // (8 << i), 2]))
            t = gl.maximum(gl.maximum(t0, t1), d0)
        t = gl.maximum(t, d)
    else:  # pairs
        t = gl.reshape(y, [rows, 4, w])
        for i in gl.static_range(5 if BLOCK_N == 128 else 4):
            a, b = gl.split(gl.reshape(t, [rows, 4, w // (2 << i), 2]))
            t = gl.maximum(a, b)
    return gl.convert_layout(gl.max(gl.reshape(t, [rows, 4]), axis=1), gl.SliceLayout(1, s_layout))


@gluon.jit
def tail_clip(t, CLIP_HI: gl.constexpr):
    """ExpCast's tail piece and the clips on the byte's FFMA result t = M + c (M = 1.5 * 2^23, c the
    main code): max(c, round(A c + B)) clipped to [0, 120] (reference/expcast.py::tail_bytes), as the
    twin's expcast_bytes_fma. The piece is one FFMA, t A + (M (1 - A) + B) = M + round(A c + B) (exact:
    A = 3/16, B an integer); all three values lie in [2^23, 2^24), where fp32 order is int32 order, so
    the max of t, the piece and M (the clip at 0) is taken on int32 (ptxas makes two VIMNMX of it, not
    one VIMNMX3: it does not fuse a max with an immediate)."""
    t2 = gl.fma(t, TAIL_A, 12582912.0 * (1.0 - TAIL_A) + TAIL_B)
    ti = gl.maximum(gl.maximum(t.to(gl.int32, bitcast=True), t2.to(gl.int32, bitcast=True)), 0x4B400000)
    if CLIP_HI:
        ti = gl.minimum(ti, 0x4B400078)  # M + 120
    return ti.to(gl.float32, bitcast=True)


@gluon.jit
def softmax_bytes(x, c8, e, dd, carried, m_i, s_int, cfg: gl.constexpr, CLIP_HI: gl.constexpr,
                  INT_MAX: gl.constexpr):
    """Online-softmax step on one tile of scores -> (P in operand order, new running state, alpha).
    ExpCast: identical to the twin's expcast_max + expcast_bytes_fma. CLIP_HI=False drops the clip at
    byte 120, which cannot bind while |8 s| < 2^23 (it does from about 2^24, where k's rounding of
    the row max lets a byte pass 120: tests/kernels/test_gluon_sm90.py); the caller proves
    |8 s| < 2^21 first (no_clip_flags). e, dd, carried: scores' fold of the int32 -> fp32 conversion
    (0 where nothing is folded): the addend takes off e, alpha follows dd (this tile's delta minus the
    last one's), the row max takes off carried. With flag_pack P is returned in fp32 (ExpCast's FFMA
    results, or exp2's values), for pack_words after the caller's wait; else as FP8 bytes (E5M2 with p_e5m2). ExpCast's
    tail piece (cfg.numerics.expcast_tail, off by default) is the twin's: tail_clip
    (kernels/triton/online.py::expcast_bytes_fma)."""
    BLOCK_N: gl.constexpr = cfg.tiles.block_n
    BETA: gl.constexpr = cfg.numerics.beta
    PV_PERM: gl.constexpr = cfg.schedule.pv_perm
    FLAG_PACK: gl.constexpr = cfg.schedule.flag_pack
    TAIL: gl.constexpr = cfg.numerics.expcast_tail
    s_layout: gl.constexpr = cfg.s_layout
    p_layout: gl.constexpr = cfg.p_layout
    CODES: gl.constexpr = cfg.numerics.codes  # ExpCast's grid (k + beta) / CODES: 8 (E4M3 bytes) or 4 (E5M2)
    if cfg.numerics.expcast:
        if INT_MAX:
            # Full tiles of the no-clip copy: x - carried = s, the int32 dot, exactly (scores'
            # FOLD_ALL, |s| < 2^21), so the row max is taken on s, where max.s32 pairs fuse into
            # VIMNMX3 (one op per 2 keys), and converted once. Every row has a finite reference
            # point from tile 0 on (tile 0 has a key; these scales are finite): no -inf case.
            k_new = gl.maximum(m_i, gl.ceil(CODES * (row_max(s_int, BLOCK_N, s_layout).to(gl.float32)
                                                     * (c8 * (1.0 / CODES))) - BETA))
            k_safe = k_new
        else:
            k_new = gl.maximum(m_i, gl.ceil(CODES * ((row_max(x, BLOCK_N, s_layout) - carried) * (c8 * (1.0 / CODES)))
                                            - BETA))
            k_safe = gl.where(k_new == float("-inf"), 0.0, k_new)
        alpha = gl.exp2((m_i - k_safe + dd) * (1.0 / CODES))
        if FLAG_PACK:
            # Returned unpacked (fp32 in operand order): pack_words packs after the caller's wait
            # for P.V. Without the clip at 120 the magic is 2^23 (flag_pack_words' zero flag); 2^23 + b
            # rounds to the same integer b as 1.5 * 2^23 + b (ulp 1 in both, same parity). The tail
            # piece needs the main code c exact below 0 as well (ulp 1: 1.5 * 2^23), so with it the
            # no-clip copy clips at 0 too (tail_clip) and packs the low bytes (pack_words' LOW_BYTES).
            if TAIL:
                t = tail_clip(gl.fma(x, c8, gl.expand_dims(((12582912.0 + 120.0) - e) - k_safe, 1)),
                              CLIP_HI)
            elif CLIP_HI:
                t = gl.fma(x, c8, gl.expand_dims(((12582912.0 + 120.0) - e) - k_safe, 1))
                t = gl.minimum(gl.maximum(t, 12582912.0), 12582912.0 + 120.0)
            else:
                t = gl.fma(x, c8, gl.expand_dims(((8388608.0 + 120.0) - e) - k_safe, 1))
            p = gl.convert_layout(operand_order(t, BLOCK_N, PV_PERM), p_layout)
        else:
            t = gl.fma(x, c8, gl.expand_dims(((12582912.0 + 120.0) - e) - k_safe, 1))
            if TAIL:
                t = tail_clip(t, CLIP_HI)
            else:
                t = gl.maximum(t, 12582912.0)
                if CLIP_HI:
                    t = gl.minimum(t, 12582912.0 + 120.0)
            p = (t.to(gl.int32, bitcast=True) & 0xFF).to(gl.uint8)
            if cfg.numerics.p_e5m2:
                p = p.to(gl.float8e5, bitcast=True)
            else:
                p = p.to(gl.float8e4nv, bitcast=True)
            p = gl.convert_layout(operand_order(p, BLOCK_N, PV_PERM), p_layout)
        return p, k_new, alpha
    else:
        if INT_MAX:
            # Full tiles without a key bias: the row max on the int32 dot (VIMNMX3 tree, row_max)
            # times the scale (c8 / 8), once: the same value as the max of x = dot * scale (the
            # product rounds monotonically), without a multiply and a chained FMNMX per score.
            m_new = gl.maximum(m_i, row_max(s_int, BLOCK_N, s_layout).to(gl.float32) * (c8 * 0.125))
        else:
            m_new = gl.maximum(m_i, gl.max(x, axis=1))
        # Rows whose keys so far are all -inf keep m = -inf: subtract 0 there (u = -inf, not NaN).
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(x - gl.expand_dims(m_safe - 8.0, 1))  # P carries 2^8
        if not FLAG_PACK:
            p = p.to(gl.float8e4nv)
        # flag_pack: fp32 in operand order, converted and packed by pack_words (ptx.e4m3_words)
        return gl.convert_layout(operand_order(p, BLOCK_N, PV_PERM), p_layout), m_new, alpha
