"""One build of the Hopper kernel, as one object: its tiles, its schedule, its numerics.

Every choice the kernel makes at compile time is a field of `Sm90Build` (a frozen dataclass, passed
to the kernel as one constexpr: Gluon code reads `cfg.tiles.block_n`, `cfg.numerics.expcast`, ...),
and `build_for` is the one place that decides them for a launch: what dispatch runs unless a
launch option overrides it. The wgmma register layouts, which follow from the tiles alone, are
properties of the build, so the kernel's functions take `cfg` instead of a dozen layouts.

The host-side choices (block_n_for, pv_perm_for, mean_on_tensor_cores) are plain Python; Gluon is
needed for the layouts only (read when a kernel is traced).
"""

from dataclasses import dataclass

from triton.experimental.gluon import language as gl

from ..reference.expcast import P_BETA, TAIL_ON, p_format_of
from ..reference.quant import QK_BLOCK  # tokens per Q / K scale
from ..reference.vsmooth import V_BLOCK  # keys per V-Smooth block: one mean each

STAGES = 4  # ring depth: K, V^T (and the mean) of 4 key tiles in flight
BLOCK_M = 128  # query rows per CTA: two consumer warpgroups of 64
BLOCK_N = 128  # keys per tile where the registers allow it (block_n_for); 64 elsewhere
NUM_WARPS = 4  # the launch's num_warps = the default partition = one consumer warpgroup
CONSUMER_REGS = 240  # per thread, after setmaxnreg: 2 x 128 x 240 + 128 x 24 (padded warps) <= 64K
PRODUCER_REGS = 24
MMA_K = 32  # the wgmma instruction's K for 8-bit operands (256 bits)


@dataclass(frozen=True)
class Tiles:
    """Shapes: the CTA's query rows and key tile, the scale blocks, the ring and the warps."""

    head_dim: int = 128
    block_m: int = BLOCK_M
    block_n: int = BLOCK_N
    qk_blk: int = QK_BLOCK
    v_blk: int = V_BLOCK
    stages: int = STAGES
    num_warps: int = NUM_WARPS  # warps per consumer warpgroup

    @property
    def rows(self):
        """Query rows per consumer warpgroup (two per CTA)."""
        return self.block_m // 2


@dataclass(frozen=True)
class Schedule:
    """How the work is laid out, with the same bytes: V^T's column order and where the mean is added.

    pv_perm   V^T's columns in wgmma order (pipeline.pv_key): P's bytes are then the P.V operand in
              the registers the score accumulator left them in, and the loop carries them as 32-bit
              words packed by PRMT / the E4M3 conversion (ptx.py); key order otherwise.
    mean_mma  V-Smooth's mean added by a tf32 wgmma riding on P.V's accumulator a tile late (3xTF32:
              within 2^-18 of the fp32 FMA), with the stages handed back on named barriers
              (named_ring) and, with ExpCast, the wait for P.V held after the bytes (hold_pv_wait);
              the fp32 FMA from shared memory otherwise (the Triton twin's output bit for bit).
    """

    pv_perm: bool = False
    mean_mma: bool = False
    consumer_regs: int = CONSUMER_REGS
    producer_regs: int = PRODUCER_REGS

    @property
    def flag_pack(self):
        """P carried as 32-bit words of its bytes (needs the operand order of pv_perm)."""
        return self.pv_perm

    @property
    def named_ring(self):
        """Ring stages released by every consumer warp on a named barrier (ring.py), not by a
        partition-level mbarrier arrive: the builds with the mean on the tensor cores."""
        return self.mean_mma


@dataclass(frozen=True)
class Numerics:
    """What is computed: V-Smooth's mean or plain V, a key bias, ExpCast or exp2 + cast, beta, ExpCast's
    tail piece (reference/expcast.py::tail_bytes), and the FP8 accumulator's promotion interval
    (Hopper: V-Smooth's centred residual keeps the whole
    tile, plain V promotes to fp32 every 32 keys; kernels/triton/attention.py says why)."""

    has_mean: bool = True
    has_bias: bool = False
    expcast: bool = True
    beta: float = -0.35
    pv_imprecise_acc: int = BLOCK_N
    expcast_tail: bool = TAIL_ON
    p_e5m2: bool = False  # ExpCast's bytes as E5M2 (reference/expcast.py: 4 codes per octave, P carries 2^15)
    v_terms: int = 1  # 2: V's residual in two E4M3 terms, P V_hi + P V_lo chained in one wgmma accumulator

    @property
    def codes(self):
        """ExpCast's codes per octave: its grid (k + beta) / codes, its byte round(codes s - k + 120)."""
        return 4.0 if self.p_e5m2 else 8.0

    @property
    def p_carry(self):
        """log2 of the factor P's values carry (the byte 120 is 2^8 in E4M3, 2^15 in E5M2)."""
        return 15.0 if self.p_e5m2 else 8.0


@dataclass(frozen=True)
class Sm90Build:
    tiles: Tiles
    schedule: Schedule
    numerics: Numerics

    # wgmma layouts of one consumer warpgroup. S = Q K^T [rows, block_n] and O = P V [rows, D] keep the
    # same rows per thread, so row statistics move between them without data movement.
    @property
    def s_layout(self):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[self.tiles.num_warps, 1],
                                         instr_shape=[16, self.tiles.block_n, MMA_K])

    @property
    def o_layout(self):
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[self.tiles.num_warps, 1],
                                         instr_shape=[16, self.tiles.head_dim, MMA_K])

    @property
    def p_layout(self):
        """P as the A operand of the P.V (and P.ones) wgmma."""
        return gl.DotOperandLayout(operand_index=0, parent=self.o_layout, k_width=4)

    @property
    def rs_layout(self):
        """P times the [block_n, 8] ones tile: the row sum of P's bytes in every column."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[self.tiles.num_warps, 1],
                                         instr_shape=[16, 8, MMA_K])

    @property
    def mu_a_layout(self):
        """mean_mma: the A operand of the tf32 wgmma r mu^T ([rows, 8] x [8, D]) into P.V's accumulator."""
        mu_acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[self.tiles.num_warps, 1],
                                           instr_shape=[16, self.tiles.head_dim, 8])
        return gl.DotOperandLayout(operand_index=0, parent=mu_acc, k_width=1)


def block_n_for(has_mean=True, has_bias=False, expcast=True):
    """Keys per tile of a build: 128 where its loop keeps its registers, else 64 (plain V at 128
    spills 40-190 values per tile, V-Smooth + ExpCast + key bias 96, with 240 registers; the counts
    per Triton release are tests/kernels/test_gluon_sm90.py's LOOP_SPILLS)."""
    if not has_mean or (expcast and has_bias):
        return 64
    return BLOCK_N


def triton_version():
    """(major, minor) of the installed Triton."""
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2])


def pv_perm_for(version=None):
    """Whether the pre-pass should write V^T in wgmma column order for this kernel (pipeline.pv_key).
    Decided per Triton release by the hot loop's local-memory accesses per 128-key tile of the
    V-Smooth + ExpCast build, key order -> wgmma order (tests/kernels/test_gluon_sm90.py,
    LOOP_SPILLS): 3.6 and 3.8 keep their registers in wgmma order, 3.9 spills with it (1 -> 51);
    releases not measured keep the key order. version: "3.8.0" etc. (None: the installed one)."""
    if version:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    else:
        major_minor = triton_version()
    return major_minor in ((3, 6), (3, 8))


def mean_on_tensor_cores(expcast, pv_perm, has_mean, has_bias, block_n=None):
    """Where dispatch adds V-Smooth's mean by the tf32 wgmma (Schedule.mean_mma): V-Smooth + ExpCast,
    V^T in wgmma order, no key bias, one V-Smooth block per key tile. Elsewhere the fp32 FMA."""
    if block_n is None:
        block_n = block_n_for(has_mean, has_bias, expcast)
    return bool(expcast) and bool(pv_perm) and bool(has_mean) and not has_bias and block_n == V_BLOCK


def build_for(*, head_dim=128, has_mean=True, has_bias=False, expcast=True, beta=None, pv_perm=False,
              block_n=None, stages=STAGES, mean_mma=None, expcast_tail=None, p_e5m2=None, v_terms=1):
    """The build a launch runs. Launch options: block_n (None: block_n_for), stages, mean_mma (None:
    mean_on_tensor_cores; True needs V-Smooth and one V-Smooth block per key tile), expcast_tail
    (None: TAIL_ON), p_e5m2 (ExpCast's bytes as E5M2; None: reference/expcast.py::p_format_of's
    default), v_terms (2: V's second E4M3 term, a second P.V wgmma per tile and 16 KB more a ring
    stage: 212-226 KB of shared memory with 4 stages, within a CTA's 227 KB); beta None: the byte
    format's."""
    if v_terms not in (1, 2):
        raise ValueError(f"v_terms is 1 or 2 (V's residual in one or two E4M3 terms), got {v_terms!r}")
    p_format = p_format_of(p_e5m2, expcast, TAIL_ON if expcast_tail is None else bool(expcast_tail))
    if p_format == "e5m2" and not expcast:
        raise ValueError("p_e5m2: ExpCast's bytes in E5M2 (exp2 + cast writes E4M3): pass expcast=True")
    if p_format == "e5m2" and expcast_tail:
        raise ValueError("ExpCast's tail piece is for E4M3's subnormal band: p_e5m2 has none to fix")
    beta = P_BETA[p_format] if beta is None else beta
    if block_n is None:
        block_n = block_n_for(has_mean, has_bias, expcast)
    if mean_mma is None:
        mean_mma = mean_on_tensor_cores(expcast, pv_perm, has_mean, has_bias, block_n)
    elif mean_mma and not (has_mean and block_n == V_BLOCK):
        raise ValueError(f"mean_mma needs V-Smooth and {V_BLOCK}-key tiles (has_mean={has_mean}, block_n={block_n})")
    return Sm90Build(
        tiles=Tiles(head_dim=head_dim, block_n=block_n, stages=stages),
        schedule=Schedule(pv_perm=bool(pv_perm), mean_mma=bool(mean_mma)),
        numerics=Numerics(has_mean=bool(has_mean), has_bias=bool(has_bias), expcast=bool(expcast), beta=float(beta),
                          pv_imprecise_acc=block_n if has_mean else 32,
                          expcast_tail=TAIL_ON if expcast_tail is None else bool(expcast_tail),
                          p_e5m2=p_format == "e5m2", v_terms=int(v_terms)))
