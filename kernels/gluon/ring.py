"""The shared-memory ring between the producer warp and the two consumer warpgroups.

The producer (1 warp, 24 registers) loads Q and the ones tile once, then streams K, V^T (with V's
second term: v_terms=2) and (V-Smooth) the mean of every key tile of its (batch, head) by TMA into
STAGES ring stages; a stage's "ready" mbarrier counts the TMA bytes. A stage goes back to the producer in one of two ways:

- "empty" mbarriers (count 2): each consumer partition arrives once per tile. Gluon's
  mbarrier.arrive is partition-level (a warpgroup barrier, then one arrival), so the two
  warpgroups never wait for each other, but each waits for its own four warps once per tile;
- named barriers (Schedule.named_ring, the builds with the mean on the tensor cores): every
  consumer warp arrives (bar.arrive, no wait) on barrier STAGE_BAR + stage once its own wait for the
  tile's wgmma batch has returned (its wgmma reads of the stage are then complete), and the
  producer's bar.sync completes with all STAGE_THREADS. No warpgroup barrier is left in the loop
  (with ptx_pass.py's rewrite of the consumers' mbarrier waits).

With mean_mma the mean's tile [D, 8] of tf32 terms (pipeline.mu_tf32_pairs) travels one tile late,
as its wgmma runs a step late (attention_sm90.py), and the last tile's mean goes alone into the
stage after the last tile's. The named barriers are inline PTX (stage_barrier): Gluon has no op
for them.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .config import NUM_WARPS
from .ptx_pass import RING_MARK

# Gluon's API moves between Triton releases: the TMA load is tma.async_copy_global_to_shared in 3.6
# and tma.async_load later.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

STAGE_BAR = gl.constexpr(10)  # named-barrier ids 10 .. 10 + STAGES - 1 (Triton uses the low ids)
STAGE_THREADS = gl.constexpr(2 * NUM_WARPS * 32 + 32)  # both consumer warpgroups and the producer warp
_RING_MARK = gl.constexpr(RING_MARK)


@gluon.jit
def stage_barrier(stage, SYNC: gl.constexpr):
    """Named ring: bar.arrive (a consumer warp: stage `stage` is read, no wait) or bar.sync (the
    producer: wait until every consumer warp has released it) on named barrier STAGE_BAR + stage, a
    runtime id (PTX takes a register). The arrive's PTX carries RING_MARK, which tells ptx_pass
    which kernels to rewrite."""
    bid = stage + STAGE_BAR
    if SYNC:
        gl.inline_asm_elementwise(f"bar.sync $1, {STAGE_THREADS};\n mov.b32 $0, $1;", "=r,r", [bid], gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise(f"{_RING_MARK}\n bar.arrive $1, {STAGE_THREADS};\n mov.b32 $0, $1;",
                                  "=r,r", [bid], gl.int32, is_pure=False, pack=1)


@gluon.jit
def issue_load(k_desc, vt_desc, vlo_desc, mu_desc, k_bufs, vt_bufs, vlo_bufs, mu_bufs, ready, tile, bh, N, NBV,
               cfg: gl.constexpr, pred):
    """TMA the K tile, the V^T tile and (V-Smooth) the mean of tile `tile` into ring stage
    tile % STAGES (skipped if not pred): one mean row [1, D], or with mean_mma the [D, 8] tf32 tile
    of tile `tile` - 1, whose wgmma runs a step late; with V's second term (v_terms=2) its tile too."""
    HEAD_DIM: gl.constexpr = cfg.tiles.head_dim
    BLOCK_N: gl.constexpr = cfg.tiles.block_n
    V_BLK: gl.constexpr = cfg.tiles.v_blk
    STAGES: gl.constexpr = cfg.tiles.stages
    stage = tile % STAGES
    bar = ready.index(stage)
    V_NBYTES: gl.constexpr = vt_desc.block_type.nbytes * cfg.numerics.v_terms
    if cfg.numerics.has_mean:
        mbarrier.expect(bar, k_desc.block_type.nbytes + V_NBYTES + mu_desc.block_type.nbytes, pred=pred)
        MU_ROWS: gl.constexpr = mu_desc.block_type.shape[0]  # rows per block: 1, or (mean_mma) D
        if MU_ROWS > 1:
            mu_tile = gl.maximum(tile - 1, 0)  # tile 0's stage: any finite tile (its A operand is 0)
        else:
            mu_tile = tile
        tma_load(mu_desc, [(bh * NBV + (mu_tile * BLOCK_N) // V_BLK) * MU_ROWS, 0], bar, mu_bufs.index(stage),
                 pred=pred)
    else:
        mbarrier.expect(bar, k_desc.block_type.nbytes + V_NBYTES, pred=pred)
    tma_load(k_desc, [bh * N + tile * BLOCK_N, 0], bar, k_bufs.index(stage), pred=pred)
    tma_load(vt_desc, [bh * HEAD_DIM, tile * BLOCK_N], bar, vt_bufs.index(stage), pred=pred)
    if cfg.numerics.v_terms == 2:
        tma_load(vlo_desc, [bh * HEAD_DIM, tile * BLOCK_N], bar, vlo_bufs.index(stage), pred=pred)


@gluon.jit
def producer(q_desc, k_desc, vt_desc, vlo_desc, mu_desc, ones_desc, q_smem, k_bufs, vt_bufs, vlo_bufs, mu_bufs,
             ones_smem, q_bar, ready, empty, bh, row_q, N, NBV, cfg: gl.constexpr):
    """1 warp: Q and the ones tile once, then every K / V^T tile (and mean) of this (batch, head)
    through the ring, a stage refilled once the consumers released it."""
    BLOCK_N: gl.constexpr = cfg.tiles.block_n
    V_BLK: gl.constexpr = cfg.tiles.v_blk
    STAGES: gl.constexpr = cfg.tiles.stages
    NAMED_RING: gl.constexpr = cfg.schedule.named_ring
    mbarrier.expect(q_bar, q_desc.block_type.nbytes + ones_desc.block_type.nbytes)
    tma_load(q_desc, [row_q, 0], q_bar, q_smem)
    tma_load(ones_desc, [0, 0], q_bar, ones_smem)
    num_tiles = gl.cdiv(N, BLOCK_N)
    for t in range(num_tiles):
        # Stage t % STAGES last held tile t - STAGES. mbarriers: a fresh one counts as having completed
        # the phase before phase 0, so parity 1 passes for the first STAGES tiles.
        if NAMED_RING:
            if t >= STAGES:
                stage_barrier(t % STAGES, True)
        else:
            mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
        issue_load(k_desc, vt_desc, vlo_desc, mu_desc, k_bufs, vt_bufs, vlo_bufs, mu_bufs, ready, t, bh, N, NBV,
                   cfg, True)
    synced = num_tiles - STAGES  # named ring: the tiles whose release this warp has waited for
    if cfg.numerics.has_mean:
        MU_ROWS: gl.constexpr = mu_desc.block_type.shape[0]
        if MU_ROWS > 1:
            # mean_mma: the last tile's mean, alone, into the stage after the last tile's
            t = num_tiles
            if NAMED_RING:
                if t >= STAGES:
                    stage_barrier(t % STAGES, True)
                synced += 1
            else:
                mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(t % STAGES), mu_desc.block_type.nbytes)
            tma_load(mu_desc, [(bh * NBV + ((t - 1) * BLOCK_N) // V_BLK) * MU_ROWS, 0], ready.index(t % STAGES),
                     mu_bufs.index(t % STAGES))
    if NAMED_RING:
        # The consumers release tiles 0 .. num_tiles - 2 (the last tile's stage is not handed back): wait
        # for the releases not waited for yet, so that every named-barrier phase completes in the CTA.
        for r in range(gl.maximum(synced, 0), num_tiles - 1):
            stage_barrier(r % STAGES, True)
