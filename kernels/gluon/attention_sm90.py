"""Fused 8-bit VC-Attention forward for Hopper (sm_90), in Gluon: TMA ring + asynchronous wgmma.

The arithmetic of the portable Triton kernel (kernels/triton/attention.py, its "twin") on the same
prepared operands (kernels/pipeline.py): INT8 (or E4M3) Q/K with one scale per 128 tokens, P as
E4M3 bytes (ExpCast in one FFMA per score against a reference point on the grid (k + beta) / 8, the
INT8 dot's int32 -> fp32 conversion folded into that FFMA: kernels/triton/online.py::expcast_max,
expcast_fold; or exp2 + cast), a fresh fp32 P.V tile per key tile added in
fp32, the row sum as P times a tile of ones on the tensor cores, V-Smooth's mean added in fp32 from
that row sum. With the same key-tile width (block_n_for) the output is the twin's bit for bit
(measured on the H200 at every shape of tests/gpu, Wan2.2 720p included), except where the mean
goes through the tensor cores in 3xTF32 (mean_mma, dispatched in wgmma order: within 2^-18 of the
twin's fp32 output, tests/gpu/test_gluon_sm90_gpu.py).

What differs is the schedule, which plain Triton does not express on Hopper:
- warp specialisation: a producer warp (24 registers) streams K, V^T and V-Smooth's mean row of
  each tile through a STAGES-deep shared-memory ring by TMA; two consumer warpgroups (240 registers
  each), each its own partition with 64 of the block's 128 query rows, hand a stage back by an
  mbarrier arrive ("empty", count 2; NAMED_RING builds: every warp on a named barrier, below), so
  the warpgroups never wait for each other (no CTA-wide barrier per tile: measured 256 -> 228 ms at
  Wan2.2 720p against the single-partition version);
- the score matmul of tile j and the P.V and P.ones matmuls of tile j - 1 are issued asynchronously
  (wgmma) before the softmax of tile j, so the tensor cores run while the CUDA cores turn scores
  into bytes (FlashAttention-3's intra-warpgroup overlap);
- 128-key tiles where the registers allow (V-Smooth without a key bias: 209 -> 182 ms), the row sum
  on the tensor cores (182 -> 159 ms: 2.5 instructions per score fewer), and a copy of the consumer
  without ExpCast's clip at byte 120 for the (batch, head)s whose scales prove it idle (-> 151-155 ms;
  _no_clip_flags);
- V^T's columns in wgmma order (pv_perm, pipeline.pv_key; where it pays on the Triton in use:
  pv_perm_for): P's bytes are then the P.V operand in the registers the score accumulator left them
  in, with no exchange between lanes (154 -> 141 ms, the same output bit for bit);
- in the no-clip copy, ExpCast's fold of the int32 -> fp32 conversion for every tile (_scores'
  FOLD_ALL: one float subtract per score less, -4 to -5%), the row max as a tree (_row_max), and P
  packed by PRMT with the clip at 0 read from the FFMA result's exponent bit (flag_pack, _flag_pack:
  5 instructions per 4 scores instead of 7; on by default where it applies): 141 -> 129 ms at Wan2.2
  720p, the same output bit for bit (BENCHMARKS.md, sixth session);
- with V^T in wgmma order, V-Smooth + ExpCast and no key bias (_schedule_applies): FA3's ping-pong
  of the two consumer warpgroups on hardware named barriers (pingpong, PP_BAR below) and V-Smooth's
  mean as a 3xTF32 wgmma that rides on P.V's accumulator a tile late (mean_mma: no shared loads, 64
  FFMA fewer per tile, no wait of its own; 548 -> 467 instructions per tile). Together 134 -> 128.5
  ms at Wan2.2 720p and -4.5% at Wan2.2-5B, level at HunyuanVideo and Wan 480p (alternating A/B);
  each alone was not clearly faster (the ping-pong -2%, the lagged mean -4% to +5% by shape and
  run). The output is no longer the twin's bit for bit: within 2^-18 of it in fp32 (measured: 5e-7
  relative), the same distance to the float64 reference (BENCHMARKS.md, seventh session);
- in the no-clip copy in wgmma order, the row max taken on the INT8 dot's int32 accumulator, where
  ptxas fuses pairs of max.s32 into VIMNMX3 (_row_max; 467 -> 429 instructions per tile), and, where
  pair_loop_pays (Triton 3.6), two key tiles per loop trip so that P's next words are packed before
  the wait for P.V into the other register set (pair_loop): 128.6 -> 125.0 ms at Wan2.2 720p in an
  alternating A/B, the same output bit for bit (BENCHMARKS.md, eighth session);
- in the pair loop, the two tiles' V-Smooth means in one tf32 wgmma (K = 8 holds both tiles' three
  tf32 terms; pipeline.mu_tf32_pairs gives each block's B tile the block before it in columns 0-3): one wgmma as
  long as a k-step of P.V saved per two tiles, at 3-4 spilled values per tile; alternating A/B
  against the eighth session's kernel -0.3 / -4.8 / -1.6 / -2.2% at Wan2.2 720p / HunyuanVideo /
  Wan2.2-5B / Wan 480p, within 2^-18 of the one-tile loop's output (BENCHMARKS.md, ninth session);
- on the exp2 path (no ExpCast) in wgmma order: P's bytes written as the operand's 32-bit words by the
  conversion itself (flag_pack, _cvt_words), and on full tiles of V-Smooth without a key bias the row
  max on the int32 dot as in the no-clip copy: 902 -> 575 instructions per tile, 178.9 -> 143.3 ms at
  Wan2.2 720p (0.97x -> 1.21x FA4 BF16), the same output bit for bit (BENCHMARKS.md, thirteenth
  session);
- in the builds with the mean on the tensor cores (MEAN_MMA, the dispatched ExpCast build), no
  warpgroup barrier left in the key-tile loop: ring stages handed back by every consumer warp on a
  named barrier (NAMED_RING, STAGE_BAR), and the bar.sync Triton puts before each consumer mbarrier
  wait deleted from the PTX (ptx_pass); and the wait for P.V held after the bytes by a CTA fence
  (HOLD_PV_WAIT, in _step; ptxas had moved it up to the wait for S_j). With the one-tile loop and
  without the ping-pong (both pair_loop and pingpong stay launch options): 123.4 -> 115.1 ms at
  Wan2.2 720p, -2.2 / -6.2 / -1.2% at HunyuanVideo-1.5 / Wan2.2-5B / Wan 480p in an alternating A/B,
  1 bf16 ulp from the pair loop's output (within 2^-18 in fp32); 1.48-1.54x FA4 BF16 in the same run
  (BENCHMARKS.md, fourteenth session).

Gluon's mbarrier.arrive is partition-level (a barrier over the calling partition's threads, then one
arrival), hence one arrival per consumer partition per stage. The ones tile comes by TMA: stored
from registers into its swizzled buffer it gave wrong products in Gluon on Triton 3.6
(benchmarks/sm90_rowsum_probe.py). Measured alternatives (H200, Triton 3.6, BENCHMARKS.md,
benchmarks/results/sm90_*.log): FA3-style ping-pong of the two consumers through two more mbarriers
(Gluon exposes no named barriers) gave nothing at 64-key tiles and +0.8% at 128; both warpgroups in
one 8-warp consumer partition was slower (its arrive couples them again); issuing S_{j+1} before the
softmax of tile j (S carried in registers) was slower; P.V accumulated in O inside the wgmma was
slower at 64 and 128 keys (128: 222 vs 182 ms), and so was folding tile j - 1 while S_j runs (202
vs 182 ms); the exact row max as ExpCast's reference point costs 4% (165 vs 159 ms, FIDELITY.md);
I2FP instead of the two-instruction int32 -> fp32 conversion gave -2% / -1% / +0.2% (Wan 720p /
Wan2.2-5B / HunyuanVideo) and is not taken; P through shared memory is slower; the mean once per
128-key block behind a branch was slower than once per tile; the V-Smooth mean as a bf16 wgmma into
P.V's accumulator does not build (one accumulator cannot serve an FP8 and a bf16 wgmma).

Also measured and not taken, thirteenth session (patches in benchmarks/results/sm90_*_2026-11-30.patch,
timed by benchmarks/sm90_patch_ab.py): the fold's integer add as IMAD on the FMA pipe (-1% to +2.6%:
ncu shows neither the ALU nor the FMA pipe near its limit); P's words through shared memory so that
ptxas waits for P.V after the softmax (+6 to +11%: the STSM addresses spill); the row sum's wgmma
issued after P's packing (ptxas serialises every wgmma, C7511); two ring stages (47 spills per two
tiles). Without the row sum's wgmma the loop would be 2.5% faster at most (timing only).

Also measured and not taken (seventh session, benchmarks/results/sm90_schedule_experiments_*.log):
the loop rotated so that S_{j+1} is issued before the softmax of tile j and P_j V_j right after it
(+3 to +11%); the wait for P.V held after the row max by a data-dependent bar.sync (ptxas otherwise
hoists it to right after the wait for S; level or slower, also with the ping-pong); 5 stages.
Timing-only builds: without P.V and P.ones 96 ms instead of 135 (the two products are not hidden
behind the softmax), with P read from shared memory instead of registers -3%. (pv_in_o, P.V
accumulated into O by the FP8 wgmma, FA3's way, was 1% faster at 2.5x the twin's distance to the
reference; removed in the sixth session. The first mean_mma waited for its own wgmma after P.V's
and was slower; it was replaced by the lagged one.)

Gluon does not run under TRITON_INTERPRET=1: CI compiles this kernel for sm_90 and checks its SASS
(tests/kernels/test_gluon_sm90.py); tests/gpu checks it against the twin and the reference.
"""

import contextlib
import hashlib
import re

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import _core as _glcore
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_accumulator,
    warpgroup_mma_wait,
)

# Gluon's API moves between Triton releases; the TMA load is tma.async_copy_global_to_shared in
# 3.6 (the H200 machine's) and tma.async_load later.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

STAGES = 4
BLOCK_M = 128  # query rows per CTA: two consumer warpgroups of 64
BLOCK_N = 128  # keys per tile where the registers allow it (block_n_for); 64 elsewhere
NUM_WARPS = 4  # the launch's num_warps = the default partition = one consumer warpgroup
CONSUMER_REGS = 240  # per thread, after setmaxnreg: 2 x 128 x 240 + 128 x 24 (padded warps) <= 64K
PRODUCER_REGS = 24


@_glcore.builtin
def _acc_relayout(acc, layout, _semantic=None):
    """An accumulator, in flight or not, seen in another layout with the same registers (checked:
    assert_trivial). MEAN_MMA chains its tf32 wgmma onto P.V's FP8 one: their accumulators differ
    only in the instruction's K (32 vs 8), which Gluon's types carry, and gl.convert_layout refuses a
    wgmma still in flight."""
    layout = _glcore._unwrap_if_constexpr(layout)
    if isinstance(acc, warpgroup_mma_accumulator):
        t = _semantic.convert_layout(_glcore.tensor(acc.handle, acc.type.tensor_type), layout, assert_trivial=True)
        return warpgroup_mma_accumulator(t.handle, t.type)
    return _semantic.convert_layout(acc, layout, assert_trivial=True)


@gluon.jit
def _int32_to_f32(x):
    """Exact int32 -> fp32 for |x| < 2^22 without I2F (kernels/triton/attention.py::_int32_to_f32)."""
    return (x + 0x4B400000).to(gl.float32, bitcast=True) - 12582912.0


@gluon.jit
def _operand_order(p, BLOCK_N: gl.constexpr, PV_PERM: gl.constexpr):
    """P's [rows, BLOCK_N] scores or bytes relabelled into the P.V wgmma's operand order. With PV_PERM
    (V^T's columns written in wgmma order by the pre-pass: kernels/pipeline.py::pv_key) the A
    operand's position a of each 32-key chunk holds key pv_key(a): exactly the value the score
    accumulator already keeps in that thread, so this is a renaming of registers (without it Triton
    moves P between lanes: ~100 SHFL / SEL / PRMT per tile, a quarter of the loop's time on the
    H200, ncu)."""
    if PV_PERM:
        rows: gl.constexpr = p.shape[0]
        # key offset bits (b4 b3 b2 b1 b0) -> operand position bits (b4 b2 b1 b3 b0)
        x = gl.reshape(p, [rows, BLOCK_N // 32, 2, 2, 2, 2, 2])
        x = gl.permute(x, [0, 1, 2, 4, 5, 3, 6])
        p = gl.reshape(x, [rows, BLOCK_N])
    return p


@gluon.jit
def _pv_operand(p8, p_layout: gl.constexpr, FLAG_PACK: gl.constexpr):
    """P as the A operand of the P.V and P.ones wgmma: its bytes (already in operand order:
    _operand_order; with PV_PERM the conversion lowers to nothing), or with FLAG_PACK its 32-bit
    words (_flag_pack), unpacked."""
    if FLAG_PACK:
        p8 = _from_words(p8)
    return gl.convert_layout(p8, p_layout)


@gluon.jit
def _quads(x):
    """[R, K] -> the four [R, K / 4] tensors of elements 4m, 4m + 1, 4m + 2, 4m + 3 (registers of one
    thread in the operand layout: a renaming)."""
    rows: gl.constexpr = x.shape[0]
    cols: gl.constexpr = x.shape[1]
    e, o = gl.split(gl.reshape(x, [rows, cols // 4, 2, 2]))  # last axis: element parity
    x0, x2 = gl.split(e)
    x1, x3 = gl.split(o)
    return x0, x1, x2, x3


@gluon.jit
def _from_words(w):
    """FLAG_PACK: [R, K / 4] int32 words -> [R, K] E4M3 bytes (byte i of word m is element 4m + i)."""
    rows: gl.constexpr = w.shape[0]
    cols: gl.constexpr = w.shape[1] * 4
    b0 = (w & 0xFF).to(gl.uint8)
    b1 = ((w >> 8) & 0xFF).to(gl.uint8)
    b2 = ((w >> 16) & 0xFF).to(gl.uint8)
    b3 = ((w >> 24) & 0xFF).to(gl.uint8)
    x = gl.join(gl.join(b0, b2), gl.join(b1, b3))  # [R, K / 4, 2 (bit 1), 2 (bit 0)]
    return gl.reshape(x, [rows, cols]).to(gl.float8e4nv, bitcast=True)


@gluon.jit
def _pack_words(t, CLIP_HI: gl.constexpr, EXPCAST: gl.constexpr):
    """FLAG_PACK: the softmax's fp32 results (operand order) -> the 32-bit words of P's bytes the
    loop carries. ExpCast (FFMA results): _flag_pack without the clip at 120; with it (t clipped to
    [M, M + 120], M = 1.5 * 2^23) the low bytes, 3 PRMT per word as Triton packs bytes. exp2 (P's
    values): _cvt_words."""
    if not EXPCAST:
        return _cvt_words(t)
    if CLIP_HI:
        t0, t1, t2, t3 = _quads(t)
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 pa, pb;
            prmt.b32 pa, $1, $2, 0x0040;
            prmt.b32 pb, $3, $4, 0x0040;
            prmt.b32 $0, pa, pb, 0x5410;
            }""",
            "=r,r,r,r,r", [t0, t1, t2, t3], gl.int32, is_pure=True, pack=1)
    return _flag_pack(t)


@gluon.jit
def _cvt_words(t):
    """FLAG_PACK on the exp2 path: P's fp32 values (operand order) -> E4M3 bytes four to a 32-bit word,
    by the conversion `.to(gl.float8e4nv)` lowers to (cvt.rn.satfinite.e4m3x2.f32, two values each)
    and one merge: the same bytes, 3 instructions per 4 scores. Carried as bytes, Triton unpacked the
    conversion's byte pairs and repacked them into the wgmma operand (SHF, LOP3, PRMT: about 250
    instructions per 128-key tile more, sm_90 SASS, Triton 3.6)."""
    t0, t1, t2, t3 = _quads(t)
    return gl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
        cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
        mov.b32 $0, {lo, hi};
        }""",
        "=r,r,r,r,r", [t0, t1, t2, t3], gl.int32, is_pure=True, pack=1)


@gluon.jit
def _flag_pack(t):
    """FLAG_PACK: ExpCast FFMA results t = 2^23 + b -> bytes max(b, 0), four to a 32-bit word, by
    PRMT. For b >= 0, t lies in [2^23, 2^24), its ulp is 1 and its low byte is b (b <= 120: the
    no-clip copy only); for b < 0 (down to -2^22: the caller's |8 s| < 2^21) t falls into the binade
    below, whose exponent's low bit (bit 23, the top bit of byte 2) is 1: that bit zeroes the byte.
    Two PRMTs pair the low bytes and the flag bytes of t0, t1 and of t2, t3, two more gather the
    bytes and the flags (sign-replicated: 0xFF or 0x00), one LOP3 masks: 5 instructions per 4 scores
    where the clip at 0 and the packing take 7. The words are what the loop carries to the next step's
    P.V (bytes carried as bytes are unpacked and repacked by Triton: _pv_operand)."""
    t0, t1, t2, t3 = _quads(t)
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
def _scores(s_acc, k_scale, BIAS, bias_base, start_n, N, qk_scale,
            s_layout: gl.constexpr, BLOCK_N: gl.constexpr, QK_BLK: gl.constexpr,
            QK_FP8: gl.constexpr, HAS_BIAS: gl.constexpr, EXPCAST: gl.constexpr, MASKED: gl.constexpr,
            FOLD_ALL: gl.constexpr):
    """The wgmma accumulator of Q K^T -> (x, c8, e, delta, carried): scores s = (x - carried) c8 / 8
    in log2 units, as the twin's _attention_tile (ExpCast without a bias keeps the raw product and
    moves the scale, and while c8 < 1/4 the int32 -> fp32 conversion too, into the byte's FMA:
    kernels/triton/online.py::expcast_fold). FOLD_ALL: the no-clip copy, whose scales prove
    c8 < 1/4 for every tile (_no_clip_flags), so x is the dot's bits plus those of 1.5 * 2^23 with
    no float subtract: one instruction per score less, the twin's values bit for bit."""
    scale = qk_scale * k_scale
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    e = 0.0
    delta = 0.0
    carried = 0.0
    if EXPCAST and not HAS_BIAS and not QK_FP8:
        c8 = 8.0 * scale
        fold = c8 < 0.25  # kernels/triton/online.py::expcast_fold
        a = c8 * 8388608.0
        b = c8 * 4194304.0
        if FOLD_ALL:  # fold holds for every tile (_no_clip_flags): the same values without the selects
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
        if QK_FP8:
            x = s_acc
        else:
            x = _int32_to_f32(s_acc)
        if EXPCAST and not HAS_BIAS:
            c8 = 8.0 * scale
        else:
            x = x * scale
            c8 = 8.0
            if not EXPCAST:
                c8 = 8.0 * scale  # exp2's INT_MAX: the row max as max(dot) * scale (_softmax_bytes)
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
def _row_max(x, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """max over axis 1 of the [rows, BLOCK_N] scores in the wgmma layout: each thread holds 2 BLOCK_N / 8
    keys of a row (key bits 0 and 3.. in registers, bits 1-2 across 4 lanes). gl.max reduces a
    thread's keys one after the other (a chain of 31 dependent ops at 128 keys); on int32 (the
    dot's raw accumulator: _softmax_bytes' INT_MAX) this tree takes them three at a time,
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
    else:  # pairs (the float build as measured before: the same count, its registers unchanged)
        t = gl.reshape(y, [rows, 4, w])
        for i in gl.static_range(5 if BLOCK_N == 128 else 4):
            a, b = gl.split(gl.reshape(t, [rows, 4, w // (2 << i), 2]))
            t = gl.maximum(a, b)
    return gl.convert_layout(gl.max(gl.reshape(t, [rows, 4]), axis=1), gl.SliceLayout(1, s_layout))


@gluon.jit
def _named_barrier(bar_id: gl.constexpr, threads: gl.constexpr, SYNC: gl.constexpr, dummy):
    """bar.sync / bar.arrive on a hardware named barrier (ids 0-2 are Triton's own here), through
    inline PTX: Gluon has no named-barrier op. `dummy` is any scalar tensor (the asm needs one)."""
    if SYNC:
        gl.inline_asm_elementwise(f"bar.sync {bar_id}, {threads};\n mov.b32 $0, $1;", "=r,r", [dummy],
                                  gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise(f"bar.arrive {bar_id}, {threads};\n mov.b32 $0, $1;", "=r,r", [dummy],
                                  gl.int32, is_pure=False, pack=1)


# PINGPONG (a launch option; dispatched with MEAN_MMA from the seventh to the thirteenth session):
# FlashAttention-3's ordering of the two consumer warpgroups' wgmma issue on hardware named barriers.
# Warpgroup ME waits on barrier PP_BAR + ME (its 128 threads + the other warpgroup's 128 arrivals)
# before issuing S_j, P.V and P.ones, then arrives on PP_BAR + 1 - ME; warpgroup 1 arrives once up
# front so warpgroup 0 goes first, and warpgroup 0 takes that last arrival after its loop, so every
# barrier ends balanced.
# (The mbarrier version measured +0.8% at 128-key tiles: BENCHMARKS.md.)
PP_BAR = gl.constexpr(8)

# NAMED_RING (the builds with MEAN_MMA): ring stages go back to the producer on hardware named barriers
# STAGE_BAR + stage instead of the "empty" mbarriers. Every consumer warp arrives (bar.arrive, no wait)
# once its own wait for the tile's wgmma batch has returned (a warp's wgmma reads of the stage are then
# complete), and the producer's bar.sync completes with all STAGE_THREADS. Gluon's mbarrier.arrive is
# partition-level: a warpgroup barrier (bar.sync over its 128 threads) before one arrival, once per key
# tile. (On the exp2 path, which keeps the fp32 mean, this ring measured slower: BENCHMARKS.md,
# fourteenth session.)
STAGE_BAR = gl.constexpr(10)  # ids 10 .. 10 + STAGES - 1 (0-3 are Triton's, 8-9 the ping-pong's)
STAGE_THREADS = gl.constexpr(2 * NUM_WARPS * 32 + 32)  # both consumer warpgroups and the producer warp


@gluon.jit
def _stage_barrier(stage, SYNC: gl.constexpr):
    """bar.arrive (consumer warps: stage `stage` is read) or bar.sync (producer: wait until it is) on named
    barrier STAGE_BAR + stage, a runtime id (PTX takes a register). The PTX comment (RING_MARK) marks
    the builds whose consumer mbarrier waits ptx_pass rewrites."""
    bid = stage + STAGE_BAR
    if SYNC:
        gl.inline_asm_elementwise(f"bar.sync $1, {STAGE_THREADS};\n mov.b32 $0, $1;", "=r,r", [bid], gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise(f"{_RING_MARK}\n bar.arrive $1, {STAGE_THREADS};\n mov.b32 $0, $1;",
                                  "=r,r", [bid], gl.int32, is_pure=False, pack=1)


@gluon.jit
def _fence_cta(dummy):
    """fence.acq_rel.cta (MEMBAR.ALL.CTA), where it holds the wait for P.V in place (_step, HOLD_PV_WAIT)."""
    gl.inline_asm_elementwise("fence.acq_rel.cta;\n mov.b32 $0, $1;", "=r,r", [dummy], gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _softmax_bytes(x, c8, e, dd, carried, m_i, EXPCAST: gl.constexpr, BETA: gl.constexpr, CLIP_HI: gl.constexpr,
                   BLOCK_N: gl.constexpr, PV_PERM: gl.constexpr, FLAG_PACK: gl.constexpr, p_layout: gl.constexpr,
                   s_layout: gl.constexpr, s_int, INT_MAX: gl.constexpr):
    """Online-softmax step on one tile of scores -> (P as E4M3 bytes in operand order, new running
    state, alpha). ExpCast: identical to the twin's expcast_max + expcast_bytes_fma
    (kernels/triton/online.py: the state is the integer k of the reference point (k + beta) / 8, the
    byte one FFMA). CLIP_HI=False drops the clip at byte 120, which cannot bind while |8 s| < 2^23
    (it does from about 2^24, where k's rounding of the row max lets a byte pass 120:
    tests/kernels/test_gluon_sm90.py); the caller proves |8 s| < 2^21 first (_no_clip_flags).
    e, dd, carried: _scores' fold of the int32 -> fp32 conversion (kernels/triton/online.py::
    expcast_fold; 0 where nothing is folded): the addend takes off e, alpha follows dd (this tile's
    delta minus the last one's), the row max takes off carried. FLAG_PACK (PV_PERM): P is returned
    in fp32 in operand order (ExpCast's FFMA results, or exp2's values), for _pack_words after the
    caller's wait."""
    if EXPCAST:
        if INT_MAX:
            # Full tiles of the no-clip copy: x - carried = s, the int32 dot, exactly (_scores'
            # FOLD_ALL, |s| < 2^21), so the row max is taken on s, where max.s32 pairs fuse into
            # VIMNMX3 (one op per 2 keys), and converted once. Every row has a finite reference
            # point from tile 0 on (tile 0 has a key; these scales are finite): no -inf case.
            k_new = gl.maximum(m_i, gl.ceil(8.0 * (_row_max(s_int, BLOCK_N, s_layout).to(gl.float32) * (c8 * 0.125))
                                            - BETA))
            k_safe = k_new
        else:
            k_new = gl.maximum(m_i, gl.ceil(8.0 * ((_row_max(x, BLOCK_N, s_layout) - carried) * (c8 * 0.125)) - BETA))
            k_safe = gl.where(k_new == float("-inf"), 0.0, k_new)
        alpha = gl.exp2((m_i - k_safe + dd) * 0.125)
        if FLAG_PACK and PV_PERM:
            # Returned unpacked (fp32 in operand order): _pack_words packs after the caller's wait
            # for P.V. Without the clip at 120 the magic is 2^23 (_flag_pack's zero flag); 2^23 + b
            # rounds to the same integer b as 1.5 * 2^23 + b (ulp 1 in both, same parity).
            if CLIP_HI:
                t = gl.fma(x, c8, gl.expand_dims(((12582912.0 + 120.0) - e) - k_safe, 1))
                t = gl.minimum(gl.maximum(t, 12582912.0), 12582912.0 + 120.0)
            else:
                t = gl.fma(x, c8, gl.expand_dims(((8388608.0 + 120.0) - e) - k_safe, 1))
            p = gl.convert_layout(_operand_order(t, BLOCK_N, PV_PERM), p_layout)
        else:
            t = gl.fma(x, c8, gl.expand_dims(((12582912.0 + 120.0) - e) - k_safe, 1))
            t = gl.maximum(t, 12582912.0)
            if CLIP_HI:
                t = gl.minimum(t, 12582912.0 + 120.0)
            p = (t.to(gl.int32, bitcast=True) & 0xFF).to(gl.uint8).to(gl.float8e4nv, bitcast=True)
            p = gl.convert_layout(_operand_order(p, BLOCK_N, PV_PERM), p_layout)
        return p, k_new, alpha
    else:
        if INT_MAX:
            # Full tiles without a key bias: the row max on the int32 dot (VIMNMX3 tree, _row_max)
            # times the scale (c8 / 8), once: the same value as the max of x = dot * scale (the
            # product rounds monotonically), without a multiply and a chained FMNMX per score.
            m_new = gl.maximum(m_i, _row_max(s_int, BLOCK_N, s_layout).to(gl.float32) * (c8 * 0.125))
        else:
            m_new = gl.maximum(m_i, gl.max(x, axis=1))
        # Rows whose keys so far are all -inf keep m = -inf: subtract 0 there (u = -inf, not NaN).
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(x - gl.expand_dims(m_safe - 8.0, 1))  # P carries 2^8
        if not (FLAG_PACK and PV_PERM):
            p = p.to(gl.float8e4nv)
        # FLAG_PACK: fp32 in operand order, converted and packed by _pack_words (_cvt_words)
        return gl.convert_layout(_operand_order(p, BLOCK_N, PV_PERM), p_layout), m_new, alpha


@gluon.jit
def _issue_load(k_desc, vt_desc, mu_desc, k_bufs, vt_bufs, mu_bufs, ready, tile, bh, N, NBV,
                HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, V_BLK: gl.constexpr, STAGES: gl.constexpr,
                HAS_MEAN: gl.constexpr, pred):
    """TMA the K tile, the V^T tile and (V-Smooth) the mean row of tile `tile` into ring stage
    tile % STAGES (skipped if not pred); with MEAN_MMA (the mean's [D, 8] tf32 tile) the mean of tile
    `tile` - 1, whose wgmma runs a step late (_step)."""
    stage = tile % STAGES
    bar = ready.index(stage)
    if HAS_MEAN:
        mbarrier.expect(bar, k_desc.block_type.nbytes + vt_desc.block_type.nbytes + mu_desc.block_type.nbytes,
                        pred=pred)
        # one mean row [1, D], or (MEAN_MMA) the block's [D, 8] tf32 B tile: rows per block
        MU_ROWS: gl.constexpr = mu_desc.block_type.shape[0]
        if MU_ROWS > 1:
            mu_tile = gl.maximum(tile - 1, 0)  # tile 0's stage: any finite tile (its A operand is 0)
        else:
            mu_tile = tile
        _tma_load(mu_desc, [(bh * NBV + (mu_tile * BLOCK_N) // V_BLK) * MU_ROWS, 0], bar, mu_bufs.index(stage),
                  pred=pred)
    else:
        mbarrier.expect(bar, k_desc.block_type.nbytes + vt_desc.block_type.nbytes, pred=pred)
    _tma_load(k_desc, [bh * N + tile * BLOCK_N, 0], bar, k_bufs.index(stage), pred=pred)
    _tma_load(vt_desc, [bh * HEAD_DIM, tile * BLOCK_N], bar, vt_bufs.index(stage), pred=pred)


@gluon.jit
def _accumulate(o, l_i, pv, rs, alpha, mu_buf, o_layout: gl.constexpr, HAS_MEAN: gl.constexpr):
    """O <- alpha O + P V_residual + r mu ; l <- alpha l + r, with r the row sum of P's bytes (rs =
    P times the ones tile: its 8 columns are all r) and mu V-Smooth's mean of the tile's block."""
    r = gl.convert_layout(gl.max(rs, axis=1), gl.SliceLayout(1, o_layout))
    alpha = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    l_i = l_i * alpha + r
    o = o * gl.expand_dims(alpha, 1) + pv
    if HAS_MEAN:
        mu = mu_buf.load(o_layout)  # [1, D]: this tile's mean row, by TMA with the tile
        o = o + gl.expand_dims(r, 1) * mu
    return o, l_i


@gluon.jit
def _tf32_terms(w, n_even, ROWS: gl.constexpr):
    """[ROWS, 8] row values (rs's layout: every column the row's value) -> [ROWS, 4], column c held
    by lane c: (r_hi, r_hi, r_lo, r_hi), r = r_hi + r_lo in tf32 parts (_mean_operand)."""
    r4, _ = gl.split(gl.reshape(w, [ROWS, 4, 2]))
    hi = (r4.to(gl.int32, bitcast=True) & -8192).to(gl.float32, bitcast=True)  # tf32: 10 mantissa bits
    return gl.where(n_even == 4, r4 - hi, hi)  # A's column 2 (rs's column 4) holds r_lo


@gluon.jit
def _mean_operand(w_old, w_new, n_even, mu_a_layout: gl.constexpr, ROWS: gl.constexpr, PAIR: gl.constexpr):
    """MEAN_MMA: the A operand [ROWS, 8] of the tf32 wgmma r mu^T that adds V-Smooth's mean to O on
    the tensor cores (instead of 64 FFMA and 16 shared loads per thread per tile); w_new (and with
    PAIR w_old, the tile before it) are r already scaled to the reference point of the P.V they ride
    on. r = r_hi + r_lo in tf32 parts and mu = mu_hi + mu_lo (pipeline.mu_tf32_pairs): A's columns 4-7 (r_hi, r_hi,
    r_lo, r_hi) of w_new against B's rows 4-7 (mu_hi, mu_lo, mu_hi, 0) of its tile sum r_hi mu_hi +
    r_hi mu_lo + r_lo mu_hi (3xTF32: error ~2^-21 of r mu where an fp32 FMA has 2^-24); columns 0-3
    against rows 0-3, the tile before's mean, are w_old's terms (PAIR: two tiles in one wgmma) or
    zeros. rs's 8 columns are all r, each thread holding columns 2c, 2c + 1 (c = lane % 4); the tf32
    A fragment wants columns c, c + 4 in that thread: a renaming of registers, no exchange between
    lanes (and zeros in columns 0-3 need no register copies in the loop)."""
    new = _tf32_terms(w_new, n_even, ROWS)
    if PAIR:
        old = _tf32_terms(w_old, n_even, ROWS)
    else:
        old = new * 0.0  # zeros, computed: constant zeros in an A operand make ptxas serialise every wgmma (C7511)
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(old, new), [0, 2, 1]), [ROWS, 8]), mu_a_layout)


@gluon.jit
def _row_sum_update(l4, rs, alpha, rs_layout: gl.constexpr, ROWS: gl.constexpr):
    """MEAN_MMA: l <- alpha l + r kept as [ROWS, 4] (every column l) in rs's even columns, so the row
    sum needs no reduction across lanes either."""
    alpha8, _ = gl.broadcast(gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, rs_layout)), 1), rs)
    alpha4, _ = gl.split(gl.reshape(alpha8, [ROWS, 4, 2]))
    r4, _ = gl.split(gl.reshape(rs, [ROWS, 4, 2]))
    return l4 * alpha4 + r4


@gluon.jit
def _step(j, p8, m_i, d_i, alpha, o, l_i, w_op, w_raw, q_rows, k_bufs, vt_bufs, mu_bufs, ones_smem, ready, empty,
          KS, BIAS, bias_base, bh, NBK, N, qk_scale, s_zero, o_zero, rs_zero,
          s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
          HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, QK_BLK: gl.constexpr,
          STAGES: gl.constexpr, HAS_MEAN: gl.constexpr, HAS_BIAS: gl.constexpr, EXPCAST: gl.constexpr,
          BETA: gl.constexpr, QK_FP8: gl.constexpr, PV_IMPRECISE_ACC: gl.constexpr, MASKED: gl.constexpr,
          CLIP_HI: gl.constexpr, PINGPONG: gl.constexpr, ME: gl.constexpr,
          PV_PERM: gl.constexpr, FLAG_PACK: gl.constexpr, MEAN_MMA: gl.constexpr, n_even,
          rs_layout: gl.constexpr, mu_a_layout: gl.constexpr, ROWS: gl.constexpr, FOLD_ALL: gl.constexpr,
          PAIR_STEP: gl.constexpr):
    """Key tile j of one consumer: issue S_j, P_{j-1} V_{j-1} and P_{j-1} ones asynchronously, turn
    S_j into bytes while the two products run, hand the ring stage of tile j - 1 back, fold tile
    j - 1 into O, l. MEAN_MMA: V-Smooth's mean of tile j - 2 rides on P.V's accumulator as a tf32
    wgmma, from w_op = r_{j-2} alpha_{j-1} formed a step earlier (so nothing waits for it: the row
    sum r_{j-1} only arrives with this step's wait), its B the means that came with tile j - 1
    (_issue_load, pipeline.mu_tf32_pairs); returns the next step's w_op. PAIR_STEP: 0 in the one-tile loop; in the
    pair loop (which runs with MEAN_MMA only), 1 for the first tile of a pair, issues no mean and returns in w_op the A operand of both pending means, r_{j-2}
    alpha_{j-1} alpha_j (from w_raw) and r_{j-1} alpha_j; 2, the second, adds both in one wgmma (K = 8
    holds two tiles' three tf32 terms: one tf32 wgmma, as long on the tensor cores as a k-step of
    P.V, per two tiles instead of per tile) and returns w_raw = r_{j-1} alpha_j unsplit, which the
    next pair's first step scales once more."""
    stage = j % STAGES
    # K's block scale of this tile, loaded before the wgmma issue: loaded after it, its address took
    # registers the in-flight P.V still reads, and ptxas waited for P.V there.
    k_scale = gl.load(KS + bh * NBK + (j * BLOCK_N) // QK_BLK)
    mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
    prev = (j - 1) % STAGES
    if PINGPONG:
        _named_barrier(PP_BAR + ME, 256, True, bh)
    s_tok = warpgroup_mma(q_rows, k_bufs.index(stage).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    p_op = _pv_operand(p8, p_layout, FLAG_PACK)
    pv_tok = warpgroup_mma(p_op, vt_bufs.index(prev).permute((1, 0)), o_zero, use_acc=False,
                           max_num_imprecise_acc=PV_IMPRECISE_ACC, is_async=True)
    if MEAN_MMA and PAIR_STEP != 1:
        # pv += (r_{j-2} alpha_{j-1}) mu_{j-2} (PAIR_STEP 2: + (r_{j-3} alpha_{j-2} alpha_{j-1}) mu_{j-3}):
        # relative to tile j - 1's reference point, as P_{j-1} V_{j-1}
        pv_tok = warpgroup_mma(w_op, mu_bufs.index(prev).permute((1, 0)), _acc_relayout(pv_tok, mu_a_layout.parent),
                               use_acc=True, is_async=True)
    rs_tok = warpgroup_mma(p_op, ones_smem.permute((1, 0)), rs_zero, use_acc=False, is_async=True)
    if PINGPONG:
        _named_barrier(PP_BAR + 1 - ME, 256, False, bh)
    # wgmma groups complete in order: with two groups (P.V, P.ones) left in flight, S_j is ready.
    # The masked last tile waits for P.V too: its new P would be packed into the registers the
    # in-flight P.V reads (the phi of the loop exit), and ptxas then serialises every wgmma of the
    # kernel (C7513). Once per program, and only when N is no multiple of the tile.
    s_acc = warpgroup_mma_wait(num_outstanding=0 if (MASKED and PV_PERM) else (3 if MEAN_MMA and PAIR_STEP != 1 else 2),
                               deps=[s_tok])
    x, c8, e, d_next, carried = _scores(s_acc, k_scale, BIAS, bias_base, j * BLOCK_N, N, qk_scale, s_layout,
                                        BLOCK_N, QK_BLK, QK_FP8, HAS_BIAS, EXPCAST, MASKED, FOLD_ALL)
    # The row max on the int32 dot (_softmax_bytes' INT_MAX), on full tiles in wgmma order: ExpCast's
    # no-clip copy, and the exp2 path with V-Smooth and no key bias (its plain-V build spilled with it).
    INT_MAX: gl.constexpr = ((FOLD_ALL or (not EXPCAST and not HAS_BIAS and HAS_MEAN)) and not MASKED
                             and not QK_FP8 and PV_PERM)
    p8_next, m_next, alpha_next = _softmax_bytes(x, c8, e, d_next - d_i, carried, m_i, EXPCAST, BETA, CLIP_HI,
                                                 BLOCK_N, PV_PERM, FLAG_PACK, p_layout, s_layout, s_acc, INT_MAX)
    # P's registers cannot be listed here (the wait takes no 8-bit values); ptxas keeps registers
    # read by an in-flight wgmma alive itself.
    if FLAG_PACK:
        if PAIR_STEP != 0:
            # Two tiles per loop trip (_consumer_rows): this step's words go to the other register
            # set than the one P.V reads, so they are packed before the wait (16 words live across
            # it instead of 64 unpacked floats) and pass through it.
            p8_next = _pack_words(p8_next, CLIP_HI, EXPCAST)
            pv, rs, p8_next = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok, rs_tok, p8_next])
        else:
            # The words are packed after the wait, in program order too (t passes through it):
            # defined while P.V may still read the previous words (the same registers, through the
            # loop's phi), they make ptxas serialise every wgmma (C7513).
            if EXPCAST and MEAN_MMA:
                # HOLD_PV_WAIT: ptxas moves the wait for P.V up to the wait for S_j (it schedules O's fold,
                # which needs only P.V, first, and then reuses P.V's registers in the row max), so the
                # softmax never overlaps P.V. A CTA-scope fence is a point it does not move the wait
                # across: the row max, the reference point and the bytes' 64 FFMA now run while P.V does
                # (SASS: tests/kernels/test_gluon_sm90.py). fence.acq_rel orders nothing this loop needs
                # (its shared-memory traffic is TMA and wgmma, with their own barriers and waits). On the
                # exp2 path it was slower (BENCHMARKS.md, fourteenth session).
                _fence_cta(bh)
            pv, rs, t = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok, rs_tok, p8_next])
            p8_next = _pack_words(t, CLIP_HI, EXPCAST)
    else:
        pv, rs = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok, rs_tok])
    if MEAN_MMA:
        l_i = _row_sum_update(l_i, rs, alpha, rs_layout, ROWS)
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1) + _acc_relayout(pv, o_layout)
        # the next step's mean: r_{j-1} alpha_j, relative to tile j's reference point
        alpha_rs = gl.expand_dims(gl.convert_layout(alpha_next, gl.SliceLayout(1, rs_layout)), 1)
        if PAIR_STEP == 0:
            w_op = _mean_operand(rs, rs * alpha_rs, n_even, mu_a_layout, ROWS, False)
        elif PAIR_STEP == 1:  # both pending means go with the next step's wgmma
            w_op = _mean_operand(w_raw * alpha_rs, rs * alpha_rs, n_even, mu_a_layout, ROWS, True)
        else:  # kept unsplit: the next pair's first step scales it once more
            w_raw = rs * alpha_rs
    else:
        o, l_i = _accumulate(o, l_i, pv, rs, alpha, mu_bufs.index(prev), o_layout, HAS_MEAN)
    # Done with stage `prev`: K_{j-1} (S wgmma, waited a step ago), V^T_{j-1} (P.V wgmma, waited just
    # now) and the mean (read just now; the arrive releases those reads before any refill).
    if MEAN_MMA:  # NAMED_RING
        _stage_barrier(prev, False)
    else:
        mbarrier.arrive(empty.index(prev), count=1)
    return p8_next, m_next, d_next, alpha_next, o, l_i, w_op, w_raw


@gluon.jit
def _producer(q_desc, k_desc, vt_desc, mu_desc, ones_desc, q_smem, k_bufs, vt_bufs, mu_bufs, ones_smem,
              q_bar, ready, empty, bh, row_q, N, NBV, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              V_BLK: gl.constexpr, STAGES: gl.constexpr, HAS_MEAN: gl.constexpr, NAMED_RING: gl.constexpr):
    """1 warp: Q and the ones tile once, then every K / V^T tile (and mean row) of this (batch, head)
    through the ring, a stage refilled once the consumers released it (the "empty" mbarriers, or
    NAMED_RING: the named barriers of _stage_barrier)."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes + ones_desc.block_type.nbytes)
    _tma_load(q_desc, [row_q, 0], q_bar, q_smem)
    _tma_load(ones_desc, [0, 0], q_bar, ones_smem)
    num_tiles = gl.cdiv(N, BLOCK_N)
    for t in range(num_tiles):
        # Stage t % STAGES last held tile t - STAGES. mbarriers: a fresh one counts as having completed
        # the phase before phase 0, so parity 1 passes for the first STAGES tiles.
        if NAMED_RING:
            if t >= STAGES:
                _stage_barrier(t % STAGES, True)
        else:
            mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
        _issue_load(k_desc, vt_desc, mu_desc, k_bufs, vt_bufs, mu_bufs, ready, t, bh, N, NBV, HEAD_DIM,
                    BLOCK_N, V_BLK, STAGES, HAS_MEAN, True)
    synced = num_tiles - STAGES  # NAMED_RING: the tiles whose release this warp has waited for
    if HAS_MEAN:
        MU_ROWS: gl.constexpr = mu_desc.block_type.shape[0]
        if MU_ROWS > 1:
            # MEAN_MMA: the last tile's mean, alone, into the stage after the last tile's
            t = num_tiles
            if NAMED_RING:
                if t >= STAGES:
                    _stage_barrier(t % STAGES, True)
                synced += 1
            else:
                mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(t % STAGES), mu_desc.block_type.nbytes)
            _tma_load(mu_desc, [(bh * NBV + ((t - 1) * BLOCK_N) // V_BLK) * MU_ROWS, 0], ready.index(t % STAGES),
                      mu_bufs.index(t % STAGES))
    if NAMED_RING:
        # The consumers release tiles 0 .. num_tiles - 2 (the last tile's stage is not handed back): wait
        # for the releases not waited for yet, so that every named-barrier phase completes in the CTA.
        for r in range(gl.maximum(synced, 0), num_tiles - 1):
            _stage_barrier(r % STAGES, True)


@gluon.jit
def _consumer_rows(q_smem, k_bufs, vt_bufs, mu_bufs, ones_smem, q_bar, ready, empty,
              QS, QBAD, KS, KBAD, VS, BIAS, stride_bias_b, stride_bias_h,
              O, stride_ob, stride_oh, stride_om, stride_od, H, M, N, NBQ, NBK, NBV,
              ROW0: gl.constexpr, ROWS: gl.constexpr, CONS_WARPS: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              QK_BLK: gl.constexpr, V_BLK: gl.constexpr,
              HAS_MEAN: gl.constexpr, HAS_BIAS: gl.constexpr, EXPCAST: gl.constexpr, BETA: gl.constexpr,
              QK_FP8: gl.constexpr, PV_IMPRECISE_ACC: gl.constexpr, STAGES: gl.constexpr, CLIP_HI: gl.constexpr,
              PINGPONG: gl.constexpr, PV_PERM: gl.constexpr,
              FLAG_PACK: gl.constexpr, MEAN_MMA: gl.constexpr, PAIR_LOOP: gl.constexpr):
    """Query rows ROW0 .. ROW0 + ROWS of the block on one warpgroup: every key tile, then the store."""
    ME: gl.constexpr = ROW0 // ROWS  # which consumer warpgroup
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H

    # wgmma layouts of S = Q K^T [ROWS, BLOCK_N] and O = P V [ROWS, D]: the same rows per thread,
    # so row statistics move between them without data movement.
    mma_k: gl.constexpr = 32  # 256 bits of 8-bit operands
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONS_WARPS, 1],
                                                        instr_shape=[16, BLOCK_N, mma_k])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONS_WARPS, 1],
                                                        instr_shape=[16, HEAD_DIM, mma_k])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    # P times the [BLOCK_N, 8] ones tile: the row sum of P's bytes in every column, on the tensor cores.
    rs_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONS_WARPS, 1],
                                                         instr_shape=[16, 8, mma_k])
    s_dtype: gl.constexpr = gl.float32 if QK_FP8 else gl.int32
    # MEAN_MMA: the tf32 wgmma r mu^T ([ROWS, 8] x [8, D]) accumulating into P.V's accumulator.
    mu_acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONS_WARPS, 1],
                                                             instr_shape=[16, HEAD_DIM, 8])
    mu_a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mu_acc_layout, k_width=1)
    q_rows = q_smem.slice(ROW0, ROWS)

    num_tiles = gl.cdiv(N, BLOCK_N)
    qk_scale = gl.load(QS + bh * NBQ + (pid_m * BLOCK_M) // QK_BLK)
    bias_base = b * stride_bias_b + h * stride_bias_h
    s_zero = gl.zeros([ROWS, BLOCK_N], s_dtype, s_layout)
    o_zero = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    rs_zero = gl.zeros([ROWS, 8], gl.float32, rs_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    if MEAN_MMA:
        gl.static_assert(HAS_MEAN, "MEAN_MMA is V-Smooth's mean")
        gl.static_assert(V_BLK == BLOCK_N, "MEAN_MMA: one mean per key tile")
        # l as [ROWS, 4] in the layout of rs's even columns (_row_sum_update), and those columns' index
        l_i, _ = gl.split(gl.reshape(rs_zero, [ROWS, 4, 2]))
        cols8, _ = gl.broadcast(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, rs_layout)), 0),
                                gl.zeros([ROWS, 8], gl.int32, rs_layout))
        n_even, _ = gl.split(gl.reshape(cols8, [ROWS, 4, 2]))
    else:
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, o_layout))
        n_even = 0
    o = o_zero
    # MEAN_MMA: the A operand of the pending means (_step; none before tile 0), and in the pair loop
    # r alpha of the tile whose mean is pending, unsplit
    w_op = gl.zeros([ROWS, 8], gl.float32, mu_a_layout)
    w_raw = rs_zero

    # Tile 0 (always masked: it may be the only, partial, tile).
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    s_acc = warpgroup_mma(q_rows, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False)
    FOLD_ALL: gl.constexpr = EXPCAST and not HAS_BIAS and not CLIP_HI  # the no-clip copy: c8 < 1/4
    x, c8, e, d_i, carried = _scores(s_acc, gl.load(KS + bh * NBK), BIAS, bias_base, 0, N, qk_scale, s_layout,
                                     BLOCK_N, QK_BLK, QK_FP8, HAS_BIAS, EXPCAST, True, FOLD_ALL)
    p8, m_i, alpha = _softmax_bytes(x, c8, e, d_i, carried, m_i, EXPCAST, BETA, True, BLOCK_N, PV_PERM,
                                    FLAG_PACK, p_layout, s_layout, s_acc, False)
    if FLAG_PACK:
        p8 = _pack_words(p8, True, EXPCAST)

    # Steady state: the full tiles, then the partial last one (masked) if N is no multiple.
    n_full = N // BLOCK_N
    if PINGPONG and ME == 1 and num_tiles > 1:
        _named_barrier(PP_BAR, 256, False, bh)  # warpgroup 0 issues first
    j_rest = 1
    if PAIR_LOOP:
        # Two tiles per trip (_step's PAIR_STEP): P's words alternate between two register sets, so
        # the next words can be packed while P.V still reads the current ones; an odd tile left
        # over takes the one-tile loop below.
        j_rest = n_full - (n_full - 1) % 2
        for j0 in range(1, j_rest, 2):
            for u in gl.static_range(2):
                p8, m_i, d_i, alpha, o, l_i, w_op, w_raw = _step(
                    j0 + u, p8, m_i, d_i, alpha, o, l_i, w_op, w_raw, q_rows, k_bufs, vt_bufs, mu_bufs, ones_smem, ready,
                    empty, KS, BIAS, bias_base, bh, NBK, N, qk_scale, s_zero, o_zero, rs_zero,
                    s_layout, o_layout, p_layout, HEAD_DIM, BLOCK_N, QK_BLK, STAGES,
                    HAS_MEAN, HAS_BIAS, EXPCAST, BETA, QK_FP8, PV_IMPRECISE_ACC, False, CLIP_HI, PINGPONG, ME,
                    PV_PERM, FLAG_PACK, MEAN_MMA, n_even, rs_layout, mu_a_layout, ROWS, FOLD_ALL, 1 + u)
        if MEAN_MMA:  # the mean left pending by the pair loop, as the one-tile steps take it
            w_op = _mean_operand(w_raw, w_raw, n_even, mu_a_layout, ROWS, False)
    for j in range(j_rest, n_full):
        p8, m_i, d_i, alpha, o, l_i, w_op, w_raw = _step(
            j, p8, m_i, d_i, alpha, o, l_i, w_op, w_raw, q_rows, k_bufs, vt_bufs, mu_bufs, ones_smem, ready, empty,
            KS, BIAS, bias_base, bh, NBK, N, qk_scale, s_zero, o_zero, rs_zero,
            s_layout, o_layout, p_layout, HEAD_DIM, BLOCK_N, QK_BLK, STAGES,
            HAS_MEAN, HAS_BIAS, EXPCAST, BETA, QK_FP8, PV_IMPRECISE_ACC, False, CLIP_HI, PINGPONG, ME,
            PV_PERM, FLAG_PACK, MEAN_MMA, n_even, rs_layout, mu_a_layout, ROWS, FOLD_ALL, 0)
    if num_tiles > n_full and num_tiles > 1:
        p8, m_i, d_i, alpha, o, l_i, w_op, w_raw = _step(
            num_tiles - 1, p8, m_i, d_i, alpha, o, l_i, w_op, w_raw, q_rows, k_bufs, vt_bufs, mu_bufs, ones_smem, ready, empty,
            KS, BIAS, bias_base, bh, NBK, N, qk_scale, s_zero, o_zero, rs_zero,
            s_layout, o_layout, p_layout, HEAD_DIM, BLOCK_N, QK_BLK, STAGES,
            HAS_MEAN, HAS_BIAS, EXPCAST, BETA, QK_FP8, PV_IMPRECISE_ACC, True, True, PINGPONG, ME,
            PV_PERM, FLAG_PACK, MEAN_MMA, n_even, rs_layout, mu_a_layout, ROWS, FOLD_ALL, 0)
    if PINGPONG and ME == 0 and num_tiles > 1:
        _named_barrier(PP_BAR, 256, True, bh)  # warpgroup 1's last arrival

    # The last tile's P.V product (its stage is not handed back: the producer is done).
    last = num_tiles - 1
    p_op = _pv_operand(p8, p_layout, FLAG_PACK)
    pv = warpgroup_mma(p_op, vt_bufs.index(last % STAGES).permute((1, 0)), o_zero, use_acc=False,
                       max_num_imprecise_acc=PV_IMPRECISE_ACC, is_async=MEAN_MMA)
    if MEAN_MMA:  # the mean of the tile before, as in _step
        pv = warpgroup_mma(w_op, mu_bufs.index(last % STAGES).permute((1, 0)), _acc_relayout(pv, mu_a_layout.parent),
                           use_acc=True, is_async=True)
    rs = warpgroup_mma(p_op, ones_smem.permute((1, 0)), rs_zero, use_acc=False, is_async=MEAN_MMA)
    if MEAN_MMA:
        pv, rs = warpgroup_mma_wait(num_outstanding=0, deps=[pv, rs])
        l4 = _row_sum_update(l_i, rs, alpha, rs_layout, ROWS)
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1) + _acc_relayout(pv, o_layout)
        # and the last tile's own mean r_last mu_last, whose B the producer sent alone into the next stage
        mbarrier.wait(ready.index(num_tiles % STAGES), (num_tiles // STAGES) & 1)
        mean = warpgroup_mma(_mean_operand(rs, rs, n_even, mu_a_layout, ROWS, False),
                             mu_bufs.index(num_tiles % STAGES).permute((1, 0)),
                             _acc_relayout(o_zero, mu_a_layout.parent), use_acc=False)
        o = o + _acc_relayout(mean, o_layout)
        l_i = gl.convert_layout(gl.max(l4, axis=1), gl.SliceLayout(1, o_layout))
    else:
        o, l_i = _accumulate(o, l_i, pv, rs, alpha, mu_bufs.index(last % STAGES), o_layout, HAS_MEAN)

    offs_m = pid_m * BLOCK_M + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    m_valid = offs_m < M
    vs = gl.load(VS + bh * HEAD_DIM + offs_d)
    out = o / gl.expand_dims(l_i, 1) * gl.expand_dims(vs, 0)
    bad = (gl.load(QBAD + bh * M + offs_m, mask=m_valid, other=0) != 0) | (gl.load(KBAD + bh) != 0)
    out = gl.where(gl.expand_dims(bad, 1), float("nan"), out)
    p_o = (O + b * stride_ob + h * stride_oh + gl.expand_dims(offs_m, 1) * stride_om
           + gl.expand_dims(offs_d, 0) * stride_od)
    gl.store(p_o, out.to(O.dtype.element_ty), mask=gl.expand_dims(m_valid, 1))


@gluon.jit
def _consumer(q_smem, k_bufs, vt_bufs, mu_bufs, ones_smem, q_bar, ready, empty,
              QS, QBAD, KS, KBAD, VS, NOCLIP, BIAS, stride_bias_b, stride_bias_h,
              O, stride_ob, stride_oh, stride_om, stride_od, H, M, N, NBQ, NBK, NBV,
              ROW0: gl.constexpr, ROWS: gl.constexpr, CONS_WARPS: gl.constexpr,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              QK_BLK: gl.constexpr, V_BLK: gl.constexpr,
              HAS_MEAN: gl.constexpr, HAS_BIAS: gl.constexpr, EXPCAST: gl.constexpr, BETA: gl.constexpr,
              QK_FP8: gl.constexpr, PV_IMPRECISE_ACC: gl.constexpr, STAGES: gl.constexpr,
              PINGPONG: gl.constexpr, PV_PERM: gl.constexpr,
              FLAG_PACK: gl.constexpr, MEAN_MMA: gl.constexpr, PAIR_LOOP: gl.constexpr):
    """Two copies of the consumer: without ExpCast's clip at byte 120 where _no_clip_flags proved it
    idle for this (batch, head) (one instruction per score less: 159 -> 151 ms at Wan2.2 720p in a
    development copy without the clip), else with it. Whole copies, not two loops under one branch:
    a loop inside a branch made the compiler repack P's bytes every tile (+100 instructions)."""
    if EXPCAST and not HAS_BIAS and gl.load(NOCLIP + gl.program_id(1)) != 0:
        _consumer_rows(q_smem, k_bufs, vt_bufs, mu_bufs, ones_smem, q_bar, ready, empty,
                       QS, QBAD, KS, KBAD, VS, BIAS, stride_bias_b, stride_bias_h,
                       O, stride_ob, stride_oh, stride_om, stride_od, H, M, N, NBQ, NBK, NBV,
                       ROW0, ROWS, CONS_WARPS, HEAD_DIM, BLOCK_M, BLOCK_N, QK_BLK, V_BLK,
                       HAS_MEAN, HAS_BIAS, EXPCAST, BETA, QK_FP8, PV_IMPRECISE_ACC, STAGES, False, PINGPONG,
                       PV_PERM, FLAG_PACK, MEAN_MMA, PAIR_LOOP)
    else:
        _consumer_rows(q_smem, k_bufs, vt_bufs, mu_bufs, ones_smem, q_bar, ready, empty,
                       QS, QBAD, KS, KBAD, VS, BIAS, stride_bias_b, stride_bias_h,
                       O, stride_ob, stride_oh, stride_om, stride_od, H, M, N, NBQ, NBK, NBV,
                       ROW0, ROWS, CONS_WARPS, HEAD_DIM, BLOCK_M, BLOCK_N, QK_BLK, V_BLK,
                       HAS_MEAN, HAS_BIAS, EXPCAST, BETA, QK_FP8, PV_IMPRECISE_ACC, STAGES, True, PINGPONG,
                       PV_PERM, FLAG_PACK, MEAN_MMA, PAIR_LOOP)


@gluon.jit
def vc_attention_fwd_sm90_kernel(
    q_desc, k_desc, vt_desc, mu_desc, ones_desc,
    QS, QBAD, KS, KBAD, VS, NOCLIP,
    BIAS, stride_bias_b, stride_bias_h,
    O, stride_ob, stride_oh, stride_om, stride_od,
    H, M, N, NBQ, NBK, NBV,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    QK_BLK: gl.constexpr, V_BLK: gl.constexpr,
    HAS_MEAN: gl.constexpr, HAS_BIAS: gl.constexpr, EXPCAST: gl.constexpr, BETA: gl.constexpr,
    QK_FP8: gl.constexpr, PV_IMPRECISE_ACC: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
    PINGPONG: gl.constexpr = False, PV_PERM: gl.constexpr = False,
    FLAG_PACK: gl.constexpr = False, MEAN_MMA: gl.constexpr = False, PAIR_LOOP: gl.constexpr = False,
):
    gl.static_assert(V_BLK % BLOCK_N == 0, "a key tile lies inside one V-Smooth block")
    gl.static_assert(QK_BLK % BLOCK_M == 0, "one Q scale per program")
    gl.static_assert(num_warps * 16 * 2 == BLOCK_M, "two consumer warpgroups of num_warps warps")
    gl.static_assert(not FLAG_PACK or PV_PERM, "FLAG_PACK carries P's bytes as words in wgmma order")
    gl.static_assert(2 * num_warps * 32 + 32 == STAGE_THREADS, "STAGE_THREADS: two consumer warpgroups and a warp")
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)

    # Shared memory: Q once, a ring of K, V^T (and mean-row) tiles; per stage a "ready" mbarrier
    # (TMA bytes) and an "empty" one (one arrival per consumer partition; NAMED_RING: named barriers).
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    vt_bufs = gl.allocate_shared_memory(vt_desc.dtype, [STAGES] + vt_desc.block_type.shape, vt_desc.layout)
    if HAS_MEAN:  # V-Smooth's mean row of each tile's block, [1, D] fp32 per stage
        mu_bufs = gl.allocate_shared_memory(mu_desc.dtype, [STAGES] + mu_desc.block_type.shape, mu_desc.layout)
    else:
        mu_bufs = k_bufs  # never read
    # [8, BLOCK_N] E4M3 ones for the row sum; by TMA (a tile stored from registers gave wrong sums
    # in Gluon on Triton 3.6: benchmarks/sm90_rowsum_probe.py)
    ones_smem = gl.allocate_shared_memory(ones_desc.dtype, ones_desc.block_type.shape, ones_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()

    ROWS: gl.constexpr = BLOCK_M // 2
    # (The argument tuples are written inline: a tuple bound to a name first would turn its
    # constexprs into tensors in Triton's front end.)
    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, vt_bufs, mu_bufs, ones_smem, q_bar, ready, empty,
                     QS, QBAD, KS, KBAD, VS, NOCLIP, BIAS, stride_bias_b, stride_bias_h,
                     O, stride_ob, stride_oh, stride_om, stride_od, H, M, N, NBQ, NBK, NBV,
                     0, ROWS, num_warps, HEAD_DIM, BLOCK_M, BLOCK_N, QK_BLK, V_BLK,
                     HAS_MEAN, HAS_BIAS, EXPCAST, BETA, QK_FP8, PV_IMPRECISE_ACC, STAGES, PINGPONG, PV_PERM,
                     FLAG_PACK, MEAN_MMA, PAIR_LOOP)),
        (_consumer, (q_smem, k_bufs, vt_bufs, mu_bufs, ones_smem, q_bar, ready, empty,
                     QS, QBAD, KS, KBAD, VS, NOCLIP, BIAS, stride_bias_b, stride_bias_h,
                     O, stride_ob, stride_oh, stride_om, stride_od, H, M, N, NBQ, NBK, NBV,
                     ROWS, ROWS, num_warps, HEAD_DIM, BLOCK_M, BLOCK_N, QK_BLK, V_BLK,
                     HAS_MEAN, HAS_BIAS, EXPCAST, BETA, QK_FP8, PV_IMPRECISE_ACC, STAGES, PINGPONG, PV_PERM,
                     FLAG_PACK, MEAN_MMA, PAIR_LOOP)),
        (_producer, (q_desc, k_desc, vt_desc, mu_desc, ones_desc, q_smem, k_bufs, vt_bufs, mu_bufs, ones_smem,
                     q_bar, ready, empty, bh, bh * M + pid_m * BLOCK_M, N, NBV, HEAD_DIM, BLOCK_N, V_BLK,
                     STAGES, HAS_MEAN, MEAN_MMA)),
    ], [num_warps, 1], [CONSUMER_REGS, PRODUCER_REGS])

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


# --- host side -------------------------------------------------------------------------------

# ptx_pass: what Gluon cannot say. Triton puts a warpgroup barrier (bar.sync <id>, 128) before every
# mbarrier wait of a consumer partition (its shared-memory analysis orders each wait after the one
# before it on the same barrier array). The wait needs none: every thread polls the mbarrier itself,
# and nothing in the consumer writes shared memory. In the NAMED_RING builds (their PTX carries
# RING_MARK, from _stage_barrier) the pass deletes it: the last warpgroup barrier of the key-tile loop.
# 121.5 -> 118.6 ms at Wan2.2 720p on top of NAMED_RING and HOLD_PV_WAIT (BENCHMARKS.md, fourteenth
# session). A release whose PTX differs only loses the speed: the pattern is matched or left alone, and
# tests/kernels/test_gluon_sm90.py checks the hot loop's SASS on the Tritons in use.
# a 128-thread bar.sync, then only comments, .loc lines, "{", a predicate declaration and a label (the
# try_wait loop's inline asm as Triton 3.6-3.9 write it), then the mbarrier.try_wait
_BAR_BEFORE_WAIT = re.compile(r"\tbar\.sync \t\d+, 128;\n((?:[ \t]*(?://[^\n]*|\.loc[^\n]*|\{|\.reg \.pred \w+;|\w+:)?"
                              r"[ \t]*\n)*?[ \t]*mbarrier\.try_wait)")
# The pass's identity in every cache key of a kernel it rewrote: Triton 3.8+ take _PASS_KEY from the
# stage hook; 3.6 hashes the constexpr globals a kernel reads, among them _RING_MARK (_stage_barrier).
_PASS_KEY = "vc-attention-ptx-pass-" + hashlib.sha256(_BAR_BEFORE_WAIT.pattern.encode()).hexdigest()[:16]
RING_MARK = "// vc-attention named ring, " + _PASS_KEY
_RING_MARK = gl.constexpr(RING_MARK)


def ptx_pass(ptx):
    """The kernel's PTX without the warpgroup barriers before its consumers' mbarrier waits (NAMED_RING
    builds only; any other PTX unchanged)."""
    if RING_MARK not in ptx:
        return ptx
    return _BAR_BEFORE_WAIT.sub(r"\1", ptx)


@contextlib.contextmanager
def ptx_pass_installed():
    """Triton's stage hook (knobs.runtime.add_stages_inspection_hook) set to ptx_pass, chained after
    any hook already there, for the compiles inside the block. Triton 3.8+ also call the hook with no
    arguments for a cache key, so kernels built with and without the pass are cached apart; 3.6 does
    not (a kernel of this source compiled without the pass, outside launch / compile_sm90, would be
    reused from the cache without it: slower, the same output)."""
    from triton import knobs

    if not hasattr(knobs.runtime, "add_stages_inspection_hook"):  # a Triton without the hook: no pass
        yield
        return
    prev = knobs.runtime.add_stages_inspection_hook

    def hook(*args):
        if not args:  # Triton 3.8+: the cache key of this pipeline
            key, digest = prev() if prev is not None else ("", "")
            return key + _PASS_KEY, digest + _PASS_KEY
        if prev is not None:
            prev(*args)
        stages = args[1]
        make_ptx = stages["ptx"]
        stages["ptx"] = lambda src, metadata: ptx_pass(make_ptx(src, metadata))

    knobs.runtime.add_stages_inspection_hook = hook
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = prev


def _layouts(qk_dtype, block_m, block_n, head_dim):
    """Shared-memory layouts of the three TMA tiles (Q [block_m, D], K [block_n, D], V^T [D, block_n])."""
    return (gl.NVMMASharedLayout.get_default_for([block_m, head_dim], qk_dtype),
            gl.NVMMASharedLayout.get_default_for([block_n, head_dim], qk_dtype),
            gl.NVMMASharedLayout.get_default_for([head_dim, block_n], gl.float8e4nv))


def _mu_layout(mean_mma=False):
    """The [1, D] fp32 mean row: no swizzle (it is read as one row); MEAN_MMA's [D, 8] tf32 B tile
    (K-major, 32-byte rows)."""
    if mean_mma:
        return gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=32, rank=2)
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _mu_block(head_dim, mean_mma=False):
    """The mean's TMA block: one row [1, D], or (MEAN_MMA) [D, 8], the tf32 terms of a block and of the
    block before (pipeline.mu_tf32_pairs)."""
    return [head_dim, 8] if mean_mma else [1, head_dim]


def block_n_for(has_mean=True, has_bias=False, expcast=True):
    """Keys per tile of a build: 128 where its loop keeps its registers (measured at Wan2.2 720p,
    V-Smooth + ExpCast: 209 ms with 64, 182 ms with 128, before the tensor-core row sum), else 64.
    Spills of the hot loop with 240 registers, Triton 3.6 (tests/kernels/test_gluon_sm90.py):
    plain V at 128 spills 40-190 values per tile, V-Smooth + ExpCast + key bias 96; the rest none."""
    if not has_mean or (expcast and has_bias):
        return 64
    return BLOCK_N


def pv_perm_for(triton_version=None):
    """Whether the pre-pass should write V^T in wgmma column order for this kernel (pipeline.pv_key),
    which makes P's layout change free: decided per Triton release by the hot loop's local-memory
    accesses per 128-key tile of the V-Smooth + ExpCast build, natural order -> wgmma order
    (tests/kernels/test_gluon_sm90.py, LOOP_SPILLS): 3.6 2 -> 2, 3.8 15 -> 10, 3.9 1 -> 51.
    Timed on the H200 (Triton 3.6): 153.9 -> 141.1 ms at Wan2.2 720p, the same output bit for bit
    (benchmarks/results/sm90_pv_perm_h200_2026-11-29.log). 3.9 spills with it, and releases not
    measured keep the natural order."""
    from ..dispatch import triton_version as installed

    major_minor = tuple(int(x) for x in triton_version.split(".")[:2]) if triton_version else installed()
    return major_minor in ((3, 6), (3, 8))


def pair_loop_pays():
    """Whether the dispatched wgmma-order build runs two key tiles per loop trip (pair_loop): no longer
    anywhere. On Triton 3.6 it was faster than the one-tile loop (124.3 against 128.6 ms at Wan2.2
    720p, BENCHMARKS.md, eighth session) until the one-tile loop held its wait for P.V after the bytes
    (HOLD_PV_WAIT, with NAMED_RING and ptx_pass; fourteenth session). With the fence the pair loop
    spills (122 local-memory accesses per two tiles); without it, it measured 1.9-3.5% slower than
    the one-tile loop at the four real shapes. On 3.8 it spilled anyway (42 per tile).
    Kept as a launch option (pair_loop=True) for A/B."""
    return False


def _ones_layout(block_n):
    """The [8, block_n] ones tile (B operand of the row-sum wgmma, K-major like V^T)."""
    return gl.NVMMASharedLayout.get_default_for([8, block_n], gl.float8e4nv)


_ONES = {}


def _ones_desc(device, block_n):
    """TMA descriptor of an [8, block_n] E4M3 tile of ones in global memory (one per device and width)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    key = (str(device), block_n)
    if key not in _ONES:
        ones = torch.ones(8, block_n, device=device).to(torch.float8_e4m3fn)
        _ONES[key] = (ones, TensorDescriptor(ones, [8, block_n], [block_n, 1], [8, block_n], _ones_layout(block_n)))
    return _ONES[key][1]


# Largest |x| of the integer (or E4M3) Q.K accumulator per unit of head dim: |codes| <= 127 (448).
_CODE_MAX = {False: 127.0, True: 448.0}


def _no_clip_flags(q_scales, k_scales, head_dim, qk_fp8, has_bias):
    """Per (batch, head): 1 where ExpCast's clip at byte 120 provably never binds, on the device (no
    host sync). The byte is round(8 s - k + 120) with k = ceil(8 max s - beta) >= 8 s - beta - ulp(8 s),
    so it stays <= 120 while ulp(8 s) < 0.85, i.e. |8 s| < 2^23; and the FFMA's addend M + 120 - k is
    exact while |k| < 2^22. Here |8 s| <= 8 |x| qs ks with |x| <= code_max^2 D: we ask < 2^21.
    With INT8 Q/K the copy also folds the int32 -> fp32 conversion into the byte's FMA for every tile
    (_scores' FOLD_ALL), which needs c8 = 8 qs ks < 1/4 (kernels/triton/online.py::expcast_fold):
    asked too, in fp32 as the kernel forms c8 (the largest product is that of the largest scales).
    A key bias (any value) keeps the clip."""
    import torch

    if has_bias:
        return torch.zeros(q_scales.shape[0], dtype=torch.int8, device=q_scales.device)
    c8_max = 8.0 * (q_scales.amax(dim=1) * k_scales.amax(dim=1))
    ok = c8_max * (_CODE_MAX[qk_fp8] ** 2 * head_dim) < 2.0 ** 21
    if not qk_fp8:
        ok = ok & (c8_max < 0.25)
    return ok.to(torch.int8)  # NaN / inf scales: 0, the clipped loop


def _pv_imprecise_acc(v_smooth, block_n):
    # Hopper's FP8 accumulator: V-Smooth's centred residual keeps the whole tile, plain V promotes
    # to fp32 every 32 keys (the twin's rule and measurements: kernels/triton/attention.py).
    return block_n if v_smooth else 32


def signature_and_constexprs(*, head_dim=128, qk_fp8=False, has_mean=True, has_bias=False, expcast=True,
                             beta=-0.35, out_dtype="bf16", stages=STAGES, num_warps=NUM_WARPS,
                             block_m=BLOCK_M, block_n=None, qk_blk=128, v_blk=128, pingpong=None,
                             pv_perm=False, flag_pack=None, mean_mma=None, pair_loop=None):
    """Kernel signature and constexprs for an ahead-of-time compile (triton.compile, no GPU needed).
    flag_pack, pingpong, mean_mma, pair_loop = None: as dispatched (_flag_pack_for: wgmma order;
    _schedule_for: the same with V-Smooth and no key bias)."""
    if flag_pack is None:
        flag_pack = bool(pv_perm)
    if block_n is None:
        block_n = block_n_for(has_mean, has_bias, expcast)
    pingpong, mean_mma, pair_loop = _schedule_for(pingpong, mean_mma, pair_loop, expcast, pv_perm, has_mean,
                                                  has_bias, block_n == v_blk, flag_pack)
    qk_t = "fp8e4nv" if qk_fp8 else "i8"
    lq, lk, lv = _layouts(gl.float8e4nv if qk_fp8 else gl.int8, block_m, block_n, head_dim)
    sig = {
        "q_desc": f"tensordesc<{qk_t}[{block_m}, {head_dim}],{lq!r}>",
        "k_desc": f"tensordesc<{qk_t}[{block_n}, {head_dim}],{lk!r}>",
        "vt_desc": f"tensordesc<fp8e4nv[{head_dim}, {block_n}],{lv!r}>",
        "QS": "*fp32", "QBAD": "*i8", "KS": "*fp32", "KBAD": "*i8", "VS": "*fp32", "NOCLIP": "*i8",
        "ones_desc": f"tensordesc<fp8e4nv[8, {block_n}],{_ones_layout(block_n)!r}>",
        "mu_desc": (f"tensordesc<fp32[{', '.join(map(str, _mu_block(head_dim, mean_mma)))}],{_mu_layout(mean_mma)!r}>"
                    if has_mean else "constexpr"),
        "BIAS": "*fp32" if has_bias else "constexpr",
        "stride_bias_b": "i32", "stride_bias_h": "i32",
        "O": f"*{out_dtype}", "stride_ob": "i32", "stride_oh": "i32", "stride_om": "i32", "stride_od": "i32",
        "H": "i32", "M": "i32", "N": "i32", "NBQ": "i32", "NBK": "i32", "NBV": "i32",
    }
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, QK_BLK=qk_blk, V_BLK=v_blk,
                      HAS_MEAN=has_mean, HAS_BIAS=has_bias, EXPCAST=expcast, BETA=beta, QK_FP8=qk_fp8,
                      PV_IMPRECISE_ACC=_pv_imprecise_acc(has_mean, block_n), STAGES=stages,
                      CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=num_warps,
                      PINGPONG=pingpong, PV_PERM=pv_perm, FLAG_PACK=flag_pack,
                      MEAN_MMA=mean_mma, PAIR_LOOP=pair_loop)
    if not has_mean:
        constexprs["mu_desc"] = None
    if not has_bias:
        constexprs["BIAS"] = None
    for name in constexprs:
        sig.setdefault(name, "constexpr")
    return sig, constexprs


def vc_attention_fwd_sm90(q_codes, q_scales, q_bad, k_codes, k_scales, k_bad, v_pre, out, H,
                          key_bias_log2=None, expcast=True, beta=-0.35, stages=STAGES,
                          num_warps=NUM_WARPS, block_m=BLOCK_M, block_n=None, pingpong=None,
                          flag_pack=None, mean_mma=None, pair_loop=None):
    """Launch on prepared operands: the arguments of kernels/pipeline.py::vc_attention_fwd
    (q_codes [BH, M, D] int8 or E4M3, k_codes [BH, N, D], v_pre from quantize_v_residual, out a
    [B, H, M, D] view written in place). Needs contiguous codes (the pre-pass makes them so).
    flag_pack, pingpong, mean_mma, pair_loop = None: as dispatched (_flag_pack_for, _schedule_for)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..pipeline import QK_BLOCK, V_BLOCK, bias_strides, cdiv, mu_tf32_pairs

    BH, M, D = q_codes.shape
    N = k_codes.shape[1]
    vt = v_pre["vt"]
    mu = v_pre["mu_scaled"]
    qk_fp8 = q_codes.dtype == torch.float8_e4m3fn
    if block_n is None:
        block_n = block_n_for(mu is not None, key_bias_log2 is not None, expcast)
    lq, lk, lv = _layouts(gl.float8e4nv if qk_fp8 else gl.int8, block_m, block_n, D)
    q2 = q_codes.reshape(BH * M, D)
    k2 = k_codes.reshape(BH * N, D)
    vt2 = vt.reshape(BH * D, vt.shape[-1])
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [block_m, D], lq)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, D], lk)
    vt_desc = TensorDescriptor(vt2, list(vt2.shape), list(vt2.stride()), [D, block_n], lv)
    mu_desc = None
    flag_pack = _flag_pack_for(flag_pack, v_pre, expcast)
    pingpong, mean_mma, pair_loop = _schedule_for(pingpong, mean_mma, pair_loop, expcast, v_pre.get("pv_perm", False),
                                                  mu is not None, key_bias_log2 is not None, block_n == V_BLOCK,
                                                  flag_pack)
    if mean_mma:
        # built once per pre-pass: later launches on the same operands reuse it (under a key of its own
        # layout: earlier kernels, timed beside this one on the same operands, kept 4 columns in "mu_tf32")
        mu2 = v_pre.get("mu_tf32_pairs")
        if mu2 is None:
            mu2 = v_pre["mu_tf32_pairs"] = mu_tf32_pairs(mu)
        mu_desc = TensorDescriptor(mu2, list(mu2.shape), list(mu2.stride()), _mu_block(D, True), _mu_layout(True))
    elif mu is not None:
        mu2 = mu.reshape(-1, D)  # [BH * NB, D] fp32
        mu_desc = TensorDescriptor(mu2, list(mu2.shape), list(mu2.stride()), [1, D], _mu_layout())
    sb = bias_strides(key_bias_log2)
    grid = (cdiv(M, block_m), BH)
    with ptx_pass_installed():
        vc_attention_fwd_sm90_kernel[grid](
            q_desc, k_desc, vt_desc, mu_desc, _ones_desc(q_codes.device, block_n),
            q_scales, q_bad, k_scales, k_bad, v_pre["scale"],
            _no_clip_flags(q_scales, k_scales, D, qk_fp8, key_bias_log2 is not None),
            key_bias_log2, sb[0], sb[1], out, *out.stride(),
            H, M, N, q_scales.shape[1], k_scales.shape[1], 0 if mu is None else mu.shape[1],
            HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, QK_BLK=QK_BLOCK, V_BLK=V_BLOCK,
            HAS_MEAN=mu is not None, HAS_BIAS=key_bias_log2 is not None, EXPCAST=bool(expcast),
            BETA=float(beta), QK_FP8=qk_fp8, PV_IMPRECISE_ACC=_pv_imprecise_acc(mu is not None, block_n),
            STAGES=stages, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=num_warps,
            PINGPONG=bool(pingpong), PV_PERM=bool(v_pre.get("pv_perm", False)),
            FLAG_PACK=flag_pack, MEAN_MMA=mean_mma, PAIR_LOOP=pair_loop)
    return out


def _schedule_applies(expcast, pv_perm, has_mean, has_bias):
    """Where the dispatched build runs V-Smooth's mean as a tf32 wgmma riding on P.V (mean_mma, and
    with it NAMED_RING and HOLD_PV_WAIT): V-Smooth + ExpCast with V^T in wgmma order and no key bias,
    where it was measured faster together with FA3's ping-pong (BENCHMARKS.md, seventh session).
    Elsewhere not measured: off. The ping-pong (pingpong) itself is no longer dispatched: once the
    loop lost its warpgroup barriers and held the P.V wait (fourteenth session) it cost 1.0-1.3% at
    Wan2.2 720p, Wan2.2-5B and HunyuanVideo-1.5 (+1.1% at Wan 480p); a launch option for A/B."""
    return bool(expcast) and bool(pv_perm) and bool(has_mean) and not has_bias


def adds_mean_on_tensor_cores(expcast, pv_perm, has_mean, has_bias, block_n=None, mean_mma=None):
    """Whether a launch with these options takes the means' tf32 B operand (mean_mma, as _schedule_for
    decides it for vc_attention_fwd_sm90), so that the pre-pass writes it
    (pipeline.quantize_v_residual(mu_tf32=True)) instead of the launch building it on the host."""
    from ..pipeline import V_BLOCK

    if block_n is None:
        block_n = block_n_for(has_mean, has_bias, expcast)
    return _schedule_for(None, mean_mma, False, expcast, pv_perm, has_mean, has_bias, block_n == V_BLOCK, False)[1]


def _schedule_for(pingpong, mean_mma, pair_loop, expcast, pv_perm, has_mean, has_bias, tile_is_block, flag_pack):
    """pingpong / mean_mma / pair_loop of a build (None: as dispatched, _schedule_applies; mean_mma
    needs one V-Smooth block per key tile; pair_loop packs P by flag_pack's words and runs only with
    mean_mma: with the fp32 mean (mean_mma=False) its output differed from the twin's at N = 4173 on
    the H200 (tests/gpu, eighth session; not understood, so not allowed))."""
    fast = _schedule_applies(expcast, pv_perm, has_mean, has_bias) and tile_is_block
    pingpong = False if pingpong is None else bool(pingpong)
    mean_mma = (fast if mean_mma is None else bool(mean_mma)) and bool(has_mean)
    pair_loop = (fast and pair_loop_pays() if pair_loop is None else bool(pair_loop)) and bool(flag_pack) and mean_mma
    return pingpong, mean_mma, pair_loop


def _flag_pack_for(flag_pack, v_pre, expcast):
    """flag_pack=None: on wherever it applies (V^T in wgmma order): the same bytes; ExpCast measured
    faster or level at the real shapes (BENCHMARKS.md, sixth session), the exp2 path (_cvt_words)
    in the thirteenth."""
    applies = bool(v_pre.get("pv_perm", False))
    return applies if flag_pack is None else bool(flag_pack) and applies


def compile_sm90(**variant):
    """Compile the kernel for sm_90 with no GPU present (CI, precompiling): a CompiledKernel whose
    .asm holds ptx and cubin. variant: signature_and_constexprs' keywords. Needs a process without
    TRITON_INTERPRET=1 (under it @gluon.jit makes interpreted functions)."""
    import os

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_sm90 needs TRITON_INTERPRET unset (run it in a fresh process)")
    sig, constexprs = signature_and_constexprs(**variant)
    with ptx_pass_installed():
        return triton.compile(GluonASTSource(vc_attention_fwd_sm90_kernel, sig, constexprs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=constexprs["num_warps"]))
