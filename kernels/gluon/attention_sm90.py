"""The fused 8-bit VC-Attention forward for Hopper (sm_90), in Gluon: TMA ring, asynchronous wgmma.

The arithmetic is that of the portable Triton kernel (kernels/triton/attention.py, its "twin") on
the same prepared operands (kernels/pipeline.py): INT8 Q / K with one scale per 128 tokens, P as
FP8 bytes (ExpCast: one FFMA per score against a reference point on the grid (k + beta) / 4, E5M2
bytes, the default, or / 8, E4M3 ones; or exp2 + E4M3 cast), a fresh fp32 P.V tile per key tile added in fp32, the row sum as P times a tile of
ones on the tensor cores, V-Smooth's mean added from that row sum. With V's residual in two E4M3
terms (Numerics.v_terms = 2, the pre-pass's vt_lo) the P.V tile is two FP8 wgmma, the second
chained onto the first's accumulator: a second V tile in each ring stage, nothing more on the CUDA
cores. With the same key-tile width (config.block_n_for) the output is the twin's bit for bit, except where the mean goes through the
tensor cores in 3xTF32 (Schedule.mean_mma: within 2^-18 of the twin's fp32 output,
tests/gpu/test_gluon_sm90_gpu.py).

What differs is the schedule, which plain Triton does not express on Hopper:
- warp specialisation: a producer warp streams K, V^T and the mean through the ring (ring.py); two
  consumer warpgroups, each its own partition with 64 of the block's 128 query rows, never wait for
  each other (no CTA-wide barrier per tile);
- each step issues the score matmul of tile j and the P.V and P.ones matmuls of tile j - 1
  asynchronously before the softmax of tile j (softmax.py), so the tensor cores run while the CUDA
  cores turn scores into bytes (FlashAttention-3's intra-warpgroup overlap);
- two copies of the consumer: without ExpCast's clip at byte 120 where the scales prove it idle
  for the (batch, head) (launch_sm90.no_clip_flags; there the int32 -> fp32 conversion is folded
  into the byte's FFMA for every tile), and with it. Whole copies, not two loops under one branch:
  a loop inside a branch made the compiler repack P's bytes every tile;
- with V^T in wgmma order (Schedule.pv_perm) P's bytes are the P.V operand in the registers the
  score accumulator left them in, carried as 32-bit words;
- with the mean on the tensor cores (Schedule.mean_mma, accumulate.py) and ExpCast, the wait for
  P.V is held after the bytes by a CTA fence (ptxas otherwise moves it up to the wait for S_j, and
  the softmax never overlaps P.V), and the ring's stages go back on named barriers.

Gluon does not run under TRITON_INTERPRET=1: CI compiles this kernel for sm_90 and checks its SASS
(tests/kernels/test_gluon_sm90.py); tests/gpu checks it against the twin and the reference. The host
side (descriptors, the build's choice, compiling) is launch_sm90.py.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .accumulate import acc_relayout, accumulate, mean_operand, row_sum_update
from .ptx import fence_cta, pack_words
from .ring import STAGE_THREADS, producer, stage_barrier
from .softmax import pv_operand, scores, softmax_bytes


@gluon.jit
def _step(j, p8, m_i, d_i, alpha, o, l_i, w_op, q_rows, k_bufs, vt_bufs, vlo_bufs, mu_bufs, ones_smem, ready, empty,
          KS, BIAS, bias_base, bh, NBK, N, qk_scale, s_zero, o_zero, rs_zero, n_even,
          cfg: gl.constexpr, MASKED: gl.constexpr, CLIP_HI: gl.constexpr, FOLD_ALL: gl.constexpr):
    """Key tile j of one consumer: issue S_j, P_{j-1} V_{j-1} and P_{j-1} ones asynchronously, turn
    S_j into bytes while the two products run, fold tile j - 1 into O, l, hand its ring stage back.
    mean_mma: V-Smooth's mean of tile j - 2 rides on P.V's accumulator as a tf32 wgmma, from
    w_op = r_{j-2} alpha_{j-1} formed a step earlier (so nothing waits for it: the row sum r_{j-1}
    only arrives with this step's wait), its B the means that came with tile j - 1; returns the next
    step's w_op. MASKED: the partial last tile."""
    BLOCK_N: gl.constexpr = cfg.tiles.block_n
    STAGES: gl.constexpr = cfg.tiles.stages
    EXPCAST: gl.constexpr = cfg.numerics.expcast
    PV_PERM: gl.constexpr = cfg.schedule.pv_perm
    MEAN_MMA: gl.constexpr = cfg.schedule.mean_mma
    V_TERMS: gl.constexpr = cfg.numerics.v_terms
    stage = j % STAGES
    # K's block scale of this tile, loaded before the wgmma issue: loaded after it, its address took
    # registers the in-flight P.V still reads, and ptxas waited for P.V there.
    k_scale = gl.load(KS + bh * NBK + (j * BLOCK_N) // cfg.tiles.qk_blk)
    mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
    prev = (j - 1) % STAGES
    s_tok = warpgroup_mma(q_rows, k_bufs.index(stage).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    p_op = pv_operand(p8, cfg)
    pv_tok = warpgroup_mma(p_op, vt_bufs.index(prev).permute((1, 0)), o_zero, use_acc=False,
                           max_num_imprecise_acc=cfg.numerics.pv_imprecise_acc, is_async=True)
    if V_TERMS == 2:
        # V's second E4M3 term into the same accumulator, accumulated on the tensor cores: a bound on
        # the imprecise sums (<= K) would make Triton add a fresh partial accumulator into this one on
        # the CUDA cores, and ptxas then serialises every wgmma (C7511 / C7514)
        pv_tok = warpgroup_mma(p_op, vlo_bufs.index(prev).permute((1, 0)), pv_tok, use_acc=True, is_async=True)
    if MEAN_MMA:
        # pv += (r_{j-2} alpha_{j-1}) mu_{j-2}: relative to tile j - 1's reference point, as P_{j-1} V_{j-1}
        pv_tok = warpgroup_mma(w_op, mu_bufs.index(prev).permute((1, 0)), acc_relayout(pv_tok, cfg.mu_a_layout.parent),
                               use_acc=True, is_async=True)
    rs_tok = warpgroup_mma(p_op, ones_smem.permute((1, 0)), rs_zero, use_acc=False, is_async=True)
    # wgmma groups complete in order: with two groups (P.V, P.ones; and the mean) left in flight, S_j
    # is ready. The masked last tile waits for P.V too: its new P would be packed into the registers
    # the in-flight P.V reads (the phi of the loop exit), and ptxas then serialises every wgmma of the
    # kernel (C7513). Once per program, and only when N is no multiple of the tile.
    s_acc = warpgroup_mma_wait(num_outstanding=0 if (MASKED and PV_PERM) else (
                               (3 if MEAN_MMA else 2) + (V_TERMS - 1)), deps=[s_tok])
    x, c8, e, d_next, carried = scores(s_acc, k_scale, BIAS, bias_base, j * BLOCK_N, N, qk_scale, cfg, MASKED,
                                       FOLD_ALL)
    # The row max on the int32 dot (softmax_bytes' INT_MAX), on full tiles in wgmma order: ExpCast's
    # no-clip copy, and the exp2 path with V-Smooth and no key bias (its plain-V build spilled with it).
    INT_MAX: gl.constexpr = ((FOLD_ALL or (not EXPCAST and not cfg.numerics.has_bias and cfg.numerics.has_mean))
                             and not MASKED and PV_PERM)
    p8_next, m_next, alpha_next = softmax_bytes(x, c8, e, d_next - d_i, carried, m_i, s_acc, cfg, CLIP_HI, INT_MAX)
    # P's registers cannot be listed here (the wait takes no 8-bit values); ptxas keeps registers
    # read by an in-flight wgmma alive itself.
    if cfg.schedule.flag_pack:
        # The words are packed after the wait, in program order too (t passes through it): defined
        # while P.V may still read the previous words (the same registers, through the loop's phi),
        # they make ptxas serialise every wgmma (C7513).
        if EXPCAST and MEAN_MMA:
            # hold_pv_wait: ptxas moves the wait for P.V up to the wait for S_j (it schedules O's fold,
            # which needs only P.V, first, and then reuses P.V's registers in the row max), so the
            # softmax never overlaps P.V. A CTA-scope fence is a point it does not move the wait
            # across: the row max, the reference point and the bytes' FFMA now run while P.V does
            # (SASS: tests/kernels/test_gluon_sm90.py). fence.acq_rel orders nothing this loop needs
            # (its shared-memory traffic is TMA and wgmma, with their own barriers and waits).
            fence_cta(bh)
        pv, rs, t = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok, rs_tok, p8_next])
        p8_next = pack_words(t, CLIP_HI or cfg.numerics.expcast_tail, EXPCAST)
    else:
        pv, rs = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok, rs_tok])
    if MEAN_MMA:
        l_i = row_sum_update(l_i, rs, alpha, cfg)
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, cfg.o_layout)), 1) + acc_relayout(
            pv, cfg.o_layout)
        # the next step's mean: r_{j-1} alpha_j, relative to tile j's reference point
        alpha_rs = gl.expand_dims(gl.convert_layout(alpha_next, gl.SliceLayout(1, cfg.rs_layout)), 1)
        w_op = mean_operand(rs * alpha_rs, n_even, cfg)
    else:
        o, l_i = accumulate(o, l_i, pv, rs, alpha, mu_bufs.index(prev), cfg)
    # Done with stage `prev`: K_{j-1} (S wgmma, waited a step ago), V^T_{j-1} (P.V wgmma, waited just
    # now) and the mean (read just now; the release orders those reads before any refill).
    if cfg.schedule.named_ring:
        stage_barrier(prev, False)
    else:
        mbarrier.arrive(empty.index(prev), count=1)
    return p8_next, m_next, d_next, alpha_next, o, l_i, w_op


@gluon.jit
def _consumer_rows(q_smem, k_bufs, vt_bufs, vlo_bufs, mu_bufs, ones_smem, q_bar, ready, empty,
                   QS, QBAD, KS, KBAD, VS, BIAS, stride_bias_b, stride_bias_h,
                   O, stride_ob, stride_oh, stride_om, stride_od, LSE, H, M, N, NBQ, NBK, NBV,
                   ROW0: gl.constexpr, cfg: gl.constexpr, CLIP_HI: gl.constexpr):
    """Query rows ROW0 .. ROW0 + ROWS of the block on one warpgroup: every key tile, then the store."""
    ROWS: gl.constexpr = cfg.tiles.rows
    HEAD_DIM: gl.constexpr = cfg.tiles.head_dim
    BLOCK_M: gl.constexpr = cfg.tiles.block_m
    BLOCK_N: gl.constexpr = cfg.tiles.block_n
    STAGES: gl.constexpr = cfg.tiles.stages
    MEAN_MMA: gl.constexpr = cfg.schedule.mean_mma
    EXPCAST: gl.constexpr = cfg.numerics.expcast
    s_layout: gl.constexpr = cfg.s_layout
    o_layout: gl.constexpr = cfg.o_layout
    rs_layout: gl.constexpr = cfg.rs_layout
    mu_a_layout: gl.constexpr = cfg.mu_a_layout
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    q_rows = q_smem.slice(ROW0, ROWS)

    num_tiles = gl.cdiv(N, BLOCK_N)
    qk_scale = gl.load(QS + bh * NBQ + (pid_m * BLOCK_M) // cfg.tiles.qk_blk)
    bias_base = b * stride_bias_b + h * stride_bias_h
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.int32, s_layout)
    o_zero = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    rs_zero = gl.zeros([ROWS, 8], gl.float32, rs_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    if MEAN_MMA:
        gl.static_assert(cfg.numerics.has_mean, "mean_mma is V-Smooth's mean")
        gl.static_assert(cfg.tiles.v_blk == BLOCK_N, "mean_mma: one mean per key tile")
        # l as [ROWS, 4] in the layout of rs's even columns (row_sum_update), and those columns' index
        l_i, _ = gl.split(gl.reshape(rs_zero, [ROWS, 4, 2]))
        cols8, _ = gl.broadcast(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, rs_layout)), 0),
                                gl.zeros([ROWS, 8], gl.int32, rs_layout))
        n_even, _ = gl.split(gl.reshape(cols8, [ROWS, 4, 2]))
    else:
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, o_layout))
        n_even = 0
    o = o_zero
    w_op = gl.zeros([ROWS, 8], gl.float32, mu_a_layout)  # mean_mma: the A operand of the pending mean

    # Tile 0 (always masked: it may be the only, partial, tile).
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    s_acc = warpgroup_mma(q_rows, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False)
    FOLD_ALL: gl.constexpr = EXPCAST and not cfg.numerics.has_bias and not CLIP_HI  # the no-clip copy: c8 < 1/4
    x, c8, e, d_i, carried = scores(s_acc, gl.load(KS + bh * NBK), BIAS, bias_base, 0, N, qk_scale, cfg, True,
                                    FOLD_ALL)
    p8, m_i, alpha = softmax_bytes(x, c8, e, d_i, carried, m_i, s_acc, cfg, True, False)
    if cfg.schedule.flag_pack:
        p8 = pack_words(p8, True, EXPCAST)

    # Steady state: the full tiles, then the partial last one (masked) if N is no multiple.
    n_full = N // BLOCK_N
    for j in range(1, n_full):
        p8, m_i, d_i, alpha, o, l_i, w_op = _step(
            j, p8, m_i, d_i, alpha, o, l_i, w_op, q_rows, k_bufs, vt_bufs, vlo_bufs, mu_bufs, ones_smem, ready, empty,
            KS, BIAS, bias_base, bh, NBK, N, qk_scale, s_zero, o_zero, rs_zero, n_even, cfg, False, CLIP_HI, FOLD_ALL)
    if num_tiles > n_full and num_tiles > 1:
        p8, m_i, d_i, alpha, o, l_i, w_op = _step(
            num_tiles - 1, p8, m_i, d_i, alpha, o, l_i, w_op, q_rows, k_bufs, vt_bufs, vlo_bufs, mu_bufs, ones_smem, ready,
            empty, KS, BIAS, bias_base, bh, NBK, N, qk_scale, s_zero, o_zero, rs_zero, n_even, cfg, True, True,
            FOLD_ALL)

    # The last tile's P.V product (its stage is not handed back: the producer is done).
    last = num_tiles - 1
    p_op = pv_operand(p8, cfg)
    pv = warpgroup_mma(p_op, vt_bufs.index(last % STAGES).permute((1, 0)), o_zero, use_acc=False,
                       max_num_imprecise_acc=cfg.numerics.pv_imprecise_acc, is_async=MEAN_MMA)
    if cfg.numerics.v_terms == 2:
        pv = warpgroup_mma(p_op, vlo_bufs.index(last % STAGES).permute((1, 0)), pv, use_acc=True, is_async=MEAN_MMA)
    if MEAN_MMA:  # the mean of the tile before, as in _step
        pv = warpgroup_mma(w_op, mu_bufs.index(last % STAGES).permute((1, 0)), acc_relayout(pv, mu_a_layout.parent),
                           use_acc=True, is_async=True)
    rs = warpgroup_mma(p_op, ones_smem.permute((1, 0)), rs_zero, use_acc=False, is_async=MEAN_MMA)
    if MEAN_MMA:
        pv, rs = warpgroup_mma_wait(num_outstanding=0, deps=[pv, rs])
        l4 = row_sum_update(l_i, rs, alpha, cfg)
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1) + acc_relayout(pv, o_layout)
        # and the last tile's own mean r_last mu_last, whose B the producer sent alone into the next stage
        mbarrier.wait(ready.index(num_tiles % STAGES), (num_tiles // STAGES) & 1)
        mean = warpgroup_mma(mean_operand(rs, n_even, cfg),
                             mu_bufs.index(num_tiles % STAGES).permute((1, 0)),
                             acc_relayout(o_zero, mu_a_layout.parent), use_acc=False)
        o = o + acc_relayout(mean, o_layout)
        l_i = gl.convert_layout(gl.max(l4, axis=1), gl.SliceLayout(1, o_layout))
    else:
        o, l_i = accumulate(o, l_i, pv, rs, alpha, mu_bufs.index(last % STAGES), cfg)

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
    if LSE is not None:  # log2 of the row's sum of P at its last reference point, as the twin writes it
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
        point = (m_o + cfg.numerics.beta - d_i) * (1.0 / cfg.numerics.codes) if EXPCAST else m_o
        gl.store(LSE + bh * M + offs_m, point - cfg.numerics.p_carry + gl.log2(l_i), mask=m_valid)


@gluon.jit
def _consumer(q_smem, k_bufs, vt_bufs, vlo_bufs, mu_bufs, ones_smem, q_bar, ready, empty,
              QS, QBAD, KS, KBAD, VS, NOCLIP, BIAS, stride_bias_b, stride_bias_h,
              O, stride_ob, stride_oh, stride_om, stride_od, LSE, H, M, N, NBQ, NBK, NBV,
              ROW0: gl.constexpr, cfg: gl.constexpr):
    """The consumer without ExpCast's clip at byte 120 where NOCLIP says the (batch, head)'s scales
    prove it idle (one instruction per score less), else with it."""
    EXPCAST: gl.constexpr = cfg.numerics.expcast
    HAS_BIAS: gl.constexpr = cfg.numerics.has_bias
    if EXPCAST and not HAS_BIAS and gl.load(NOCLIP + gl.program_id(1)) != 0:
        _consumer_rows(q_smem, k_bufs, vt_bufs, vlo_bufs, mu_bufs, ones_smem, q_bar, ready, empty,
                       QS, QBAD, KS, KBAD, VS, BIAS, stride_bias_b, stride_bias_h,
                       O, stride_ob, stride_oh, stride_om, stride_od, LSE, H, M, N, NBQ, NBK, NBV, ROW0, cfg, False)
    else:
        _consumer_rows(q_smem, k_bufs, vt_bufs, vlo_bufs, mu_bufs, ones_smem, q_bar, ready, empty,
                       QS, QBAD, KS, KBAD, VS, BIAS, stride_bias_b, stride_bias_h,
                       O, stride_ob, stride_oh, stride_om, stride_od, LSE, H, M, N, NBQ, NBK, NBV, ROW0, cfg, True)


@gluon.jit
def vc_attention_fwd_sm90_kernel(
    q_desc, k_desc, vt_desc, vlo_desc, mu_desc, ones_desc,
    QS, QBAD, KS, KBAD, VS, NOCLIP,
    BIAS, stride_bias_b, stride_bias_h,
    O, stride_ob, stride_oh, stride_om, stride_od,
    H, M, N, NBQ, NBK, NBV,
    cfg: gl.constexpr, num_warps: gl.constexpr, LSE=None,
):
    """One CTA: 128 query rows of one (batch, head) against all its keys. cfg: config.Sm90Build.
    LSE: [BH, M] fp32 for each row's log2 LSE (ring attention; launch_sm90's lse), or None."""
    BLOCK_M: gl.constexpr = cfg.tiles.block_m
    STAGES: gl.constexpr = cfg.tiles.stages
    gl.static_assert(cfg.tiles.v_blk % cfg.tiles.block_n == 0, "a key tile lies inside one V-Smooth block")
    gl.static_assert(cfg.tiles.qk_blk % BLOCK_M == 0, "one Q scale per program")
    gl.static_assert(num_warps == cfg.tiles.num_warps, "the launch's num_warps is one consumer warpgroup")
    gl.static_assert(num_warps * 16 * 2 == BLOCK_M, "two consumer warpgroups of num_warps warps")
    gl.static_assert(2 * num_warps * 32 + 32 == STAGE_THREADS, "STAGE_THREADS: two consumer warpgroups and a warp")
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)

    # Shared memory: Q once, a ring of K, V^T (and mean) tiles; per stage a "ready" mbarrier (TMA
    # bytes) and an "empty" one (one arrival per consumer partition; unused with the named ring).
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    vt_bufs = gl.allocate_shared_memory(vt_desc.dtype, [STAGES] + vt_desc.block_type.shape, vt_desc.layout)
    if cfg.numerics.v_terms == 2:  # V's second E4M3 term, a tile like V^T's
        vlo_bufs = gl.allocate_shared_memory(vlo_desc.dtype, [STAGES] + vlo_desc.block_type.shape, vlo_desc.layout)
    else:
        vlo_bufs = vt_bufs  # never read
    if cfg.numerics.has_mean:  # V-Smooth's mean of each tile's block: a [1, D] row, or mean_mma's [D, 8] tile
        mu_bufs = gl.allocate_shared_memory(mu_desc.dtype, [STAGES] + mu_desc.block_type.shape, mu_desc.layout)
    else:
        mu_bufs = k_bufs  # never read
    # [8, BLOCK_N] E4M3 ones for the row sum, by TMA (a tile stored from registers gave wrong sums in
    # Gluon on Triton 3.6)
    ones_smem = gl.allocate_shared_memory(ones_desc.dtype, ones_desc.block_type.shape, ones_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()

    ROWS: gl.constexpr = cfg.tiles.rows
    # (The argument tuples are written inline: a tuple bound to a name first would turn its
    # constexprs into tensors in Triton's front end.)
    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, vt_bufs, vlo_bufs, mu_bufs, ones_smem, q_bar, ready, empty,
                     QS, QBAD, KS, KBAD, VS, NOCLIP, BIAS, stride_bias_b, stride_bias_h,
                     O, stride_ob, stride_oh, stride_om, stride_od, LSE, H, M, N, NBQ, NBK, NBV, 0, cfg)),
        (_consumer, (q_smem, k_bufs, vt_bufs, vlo_bufs, mu_bufs, ones_smem, q_bar, ready, empty,
                     QS, QBAD, KS, KBAD, VS, NOCLIP, BIAS, stride_bias_b, stride_bias_h,
                     O, stride_ob, stride_oh, stride_om, stride_od, LSE, H, M, N, NBQ, NBK, NBV, ROWS, cfg)),
        (producer, (q_desc, k_desc, vt_desc, vlo_desc, mu_desc, ones_desc, q_smem, k_bufs, vt_bufs, vlo_bufs, mu_bufs,
                    ones_smem,
                    q_bar, ready, empty, bh, bh * M + pid_m * BLOCK_M, N, NBV, cfg)),
    ], [num_warps, 1], [cfg.schedule.consumer_regs, cfg.schedule.producer_regs])

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
