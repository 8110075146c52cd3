"""VC-Attention as the local attention of yunchang's USP (the sequence parallelism of xDiT).

yunchang's ``LongContextAttention`` (and xDiT's subclass ``xFuserLongContextAttention``) takes an
``attn_processor``: a function it calls on each rank's local q, k, v when its ``attn_type`` names
none of yunchang's own kernels. :func:`vc_long_context_attention` builds that module with
:class:`VCLocalAttention` as the processor; nothing of yunchang is changed or copied.

**Ulysses** (``ulysses_degree`` = P, ``ring_degree`` = 1). yunchang's all-to-all gives rank r the
whole sequence of heads r H/P .. (r + 1) H/P - 1 (layout [B, N, H/P, D]). V-Smooth's plan is per
(batch, head) over all of a head's value tokens, so it is local, and the permutation stays exact:
rank r's plan for its heads is the plan one process makes for those heads (``plan_v_smooth``'s
``heads=`` seeds the cold start as for all heads; warm refreshes start from the rank's own
centroids), and each rank's output is the single-process output of its heads.

**Ring** (``ring_degree`` = R > 1) splits the keys across ranks: yunchang sends the K, V chunks
around the ring and calls the processor once per chunk (ring step s brings the chunk of ring rank
r - s), then merges the chunks' outputs by their log-sum-exp. The rule that keeps V-Smooth exact
there: the permutation and the 128-token mean blocks stay inside a chunk (keys can only be
reordered among the keys of one call), so each chunk has its own plan, made from that chunk's
values and seeded as one process seeds a tensor of those heads (every rank that sees a chunk makes
the same plan), and the LSE merge is exact arithmetic on the chunks' outputs. The chunk's LSE comes
from the kernel's own row sums (``vc_attention_lse``: the Hopper, mma.sync and portable kernels,
or the reference). Ulysses and ring combine (USP's hybrid): each ring rank then holds H / P heads of its
sequence chunk.

Under Ulysses alone yunchang's one-rank ring step passes the LSE through and drops it
(``update_out_and_lse`` on its first block, then ``LongContextAttention.forward`` keeps only the
output): the processor then calls ``vc_attention`` (any kernel, the mma.sync one included) and
returns an LSE of NaNs, so that any use of it would show.

Steps: a :class:`StepClock` shared by the processors says which denoising step runs (the caller's
loop calls ``clock.begin(step, steps)``). Grouping follows the pack's schedule: the first call of a
layer groups cold, calls inside the first ``grouping_window`` of the steps re-group (warm) every
``refresh_every`` steps, later calls reuse. Without a clock a layer groups on its first call and
reuses that plan.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .api import vc_attention, vc_attention_lse
from .plan import (COLD_ITERS, DEFAULT_CLUSTERS, WARM_ITERS, PlanAction, VSmoothPlan, in_fraction_window,
                   plan_action, plan_v_smooth)

# The attn_type handed to yunchang: a name none of its AttnType members has, so its kernel choice
# (yunchang.kernels.select_flash_attn_impl) falls through to the attn_processor.
ATTN_TYPE = "vc_attention"


def ulysses_heads(num_heads: int, world_size: int, rank: int) -> tuple[int, int]:
    """(first head, heads per rank) that rank ``rank`` holds after Ulysses' all-to-all; a clear
    error when the heads do not divide among the ranks (yunchang would fail in a reshape)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    if num_heads % world_size:
        raise ValueError(f"Ulysses splits the {num_heads} attention heads over {world_size} ranks: "
                         f"{num_heads} is not divisible by {world_size}; choose an ulysses_degree that "
                         f"divides the head count (ring parallelism splits the sequence instead)")
    per_rank = num_heads // world_size
    return rank * per_rank, per_rank


@dataclass
class StepClock:
    """The denoising step now running, shared by every layer's processor."""

    step: Optional[int] = None
    steps: Optional[int] = None

    def begin(self, step: int, steps: int) -> None:
        if steps < 1 or not 0 <= step < steps:
            raise ValueError(f"step must be in [0, steps) with steps >= 1, got step={step}, steps={steps}")
        self.step, self.steps = int(step), int(steps)

    def in_window(self, window: float) -> bool:
        """Inside the first ``window`` of the steps (the nodes' rule for a step fraction)."""
        return in_fraction_window(self.step, self.step / self.steps, window)


@dataclass(frozen=True)
class Settings:
    """What every rank of a group must agree on (checked on the first call)."""

    bits: int = 8
    expcast: Optional[bool] = None
    backend: str = "auto"
    num_clusters: int = DEFAULT_CLUSTERS
    grouping_window: float = 0.25
    refresh_every: int = 4
    seed: int = 0
    pv_format: str = "auto"


@dataclass
class _Entry:
    plan: VSmoothPlan
    step: Optional[int]


class VCLocalAttention:
    """yunchang's ``attn_processor``: VC-Attention on one rank's q, k, v ([B, N, H_local, D]).

    One instance per attention layer (its plans are that layer's); ``num_heads`` is the layer's
    head count before the split. Returns (out [B, N, H_local, D] in q's dtype, lse [B, H_local, N]
    fp32), the pair yunchang's ring step expects (NaN LSE under Ulysses alone: see the module's
    docstring). Under ring attention the calls of one forward are the ring's steps in order, which
    is how a call knows its key chunk.
    """

    def __init__(self, num_heads: int, *, bits: int = 8, expcast: Optional[bool] = None,
                 backend: str = "auto", num_clusters: int = DEFAULT_CLUSTERS, grouping_window: float = 0.25,
                 refresh_every: int = 4, seed: int = 0, clock: Optional[StepClock] = None,
                 ulysses_group=None, ring_group=None, pv_format: str = "auto"):
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        if not 0.0 <= grouping_window <= 1.0 or refresh_every < 1:
            raise ValueError(f"need 0 <= grouping_window <= 1 and refresh_every >= 1, got "
                             f"{grouping_window}, {refresh_every}")
        self.num_heads = int(num_heads)
        self.settings = Settings(bits, expcast, backend, num_clusters, grouping_window, refresh_every, seed,
                                 pv_format)
        self.clock = clock
        self._groups = (ulysses_group, ring_group)
        self._plans: dict = {}
        self._layout = None  # (first head, ring size, heads per rank), checked on the first call
        self._ring_calls = 0
        self.groupings = 0  # k-means runs of this layer (cold and warm)

    # -- yunchang's call -----------------------------------------------------------------------

    def __call__(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, return_softmax=False, **unused):
        if causal:
            raise ValueError("VC-Attention is non-causal self-attention (its permutation of the keys is "
                             "exact only without a causal mask): causal=True is not supported")
        if dropout_p:
            raise ValueError(f"VC-Attention is for inference: dropout_p must be 0, got {dropout_p}")
        if tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None:
            raise ValueError("VC-Attention supports neither sliding windows, softcap nor ALiBi slopes "
                             f"(got window_size={window_size}, softcap={softcap}, alibi_slopes given: "
                             f"{alibi_slopes is not None})")
        if self._layout is None:
            self._layout = self._check_groups(q)
        elif q.shape[2] != self._layout[2]:
            raise ValueError(f"this rank holds {q.shape[2]} heads, it held {self._layout[2]} on the first call")
        first, ring, _ = self._layout
        s = self.settings
        if ring > 1:
            chunk = self._ring_calls % ring  # the ring step: which rank's keys these are
            self._ring_calls += 1
            plan = self._plan(v, first, chunk)
            return vc_attention_lse(q, k, v, bits=s.bits, expcast=s.expcast, plan=plan, sm_scale=softmax_scale,
                                    layout="NHD", backend=s.backend, pv_format=s.pv_format)
        plan = self._plan(v, first, 0)
        out = vc_attention(q, k, v, bits=s.bits, expcast=s.expcast, plan=plan, sm_scale=softmax_scale,
                           layout="NHD", backend=s.backend, pv_format=s.pv_format)
        B, M, H, _ = q.shape
        lse = torch.full((B, H, M), math.nan, dtype=torch.float32, device=q.device)
        return out, lse

    # -- the parts -----------------------------------------------------------------------------

    def _process_groups(self):
        ulysses, ring = self._groups
        if ulysses is None and ring is None:
            try:  # the groups yunchang.set_seq_parallel_pg() made
                from yunchang.globals import PROCESS_GROUP
            except ImportError:  # no yunchang: one process
                return None, None
            ulysses, ring = PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG
        return ulysses, ring

    def _check_groups(self, q) -> tuple[int, int, int]:
        """This rank's first head, the ring's size and the heads per rank; the bad set-ups as clear
        errors (once: the groups and the layer's head split do not change between calls)."""
        ulysses, ring = self._process_groups()
        ring_world = 1 if ring is None else dist.get_world_size(ring)
        world = 1 if ulysses is None else dist.get_world_size(ulysses)
        rank = 0 if ulysses is None else dist.get_rank(ulysses)
        first, per_rank = ulysses_heads(self.num_heads, world, rank)
        if q.shape[2] != per_rank:
            raise ValueError(f"this rank holds {q.shape[2]} heads, but {self.num_heads} heads over "
                             f"{world} Ulysses ranks give {per_rank}: is num_heads the layer's head count?")
        # Ranks that group differently would give heads (or key chunks) of one layer different
        # treatments.
        mine = (asdict(self.settings), self.num_heads, tuple(q.shape[:2]), tuple(q.shape[3:]))
        for name, group, size in (("Ulysses", ulysses, world), ("ring", ring, ring_world)):
            if size < 2:
                continue
            every = [None] * size
            dist.all_gather_object(every, mine, group=group)
            for r, theirs in enumerate(every):
                if theirs != mine:
                    raise ValueError(f"the {name} ranks disagree on VC-Attention's settings or shapes: "
                                     f"rank {dist.get_rank(group)} has {mine}, rank {r} has {theirs}")
        return first, ring_world, per_rank

    def _plan(self, v, first: int, chunk: int) -> VSmoothPlan:
        s = self.settings
        key = (tuple(v.shape), str(v.device), first, chunk)
        entry = self._plans.get(key)
        step = None if self.clock is None else self.clock.step
        if entry is None:
            action = PlanAction.COLD
        elif step is None or entry.step is None:  # no clock (or none yet): the first plan stays
            action = PlanAction.REUSE
        else:
            action = plan_action(entry.step, step, self.clock.in_window(s.grouping_window), s.refresh_every)
        if action is PlanAction.REUSE:
            return entry.plan
        if action is PlanAction.COLD:
            plan = plan_v_smooth(v, num_clusters=s.num_clusters, iters=COLD_ITERS, seed=s.seed,
                                 layout="NHD", backend=_kmeans_backend(s.backend),
                                 heads=(first, self.num_heads))
        else:
            plan = plan_v_smooth(v, num_clusters=s.num_clusters, iters=WARM_ITERS, init=entry.plan,
                                 layout="NHD", backend=_kmeans_backend(s.backend))
        self._plans[key] = _Entry(plan, step)
        self.groupings += 1
        return plan


def _kmeans_backend(backend: str) -> str:
    """The k-means backend that goes with an attention backend ("reference" pins both)."""
    return "reference" if backend == "reference" else "auto"


def vc_long_context_attention(num_heads: int, *, use_sync: bool = False, **options):
    """yunchang's ``LongContextAttention`` with VC-Attention as each rank's local attention.

    Call after ``yunchang.set_seq_parallel_pg``; ``options`` go to :class:`VCLocalAttention`
    (bits, expcast, backend, clock, ...). The module's forward takes yunchang's layout: q, k, v of
    [B, N / P, H, D] per rank, the rank's part of the sequence. For xDiT, pass
    ``attn_type=ATTN_TYPE, attn_processor=VCLocalAttention(...)`` to ``xFuserLongContextAttention``
    the same way."""
    from yunchang import LongContextAttention
    from yunchang.globals import PROCESS_GROUP

    if PROCESS_GROUP.ULYSSES_PG is None and PROCESS_GROUP.RING_PG is None:
        raise RuntimeError("call yunchang.set_seq_parallel_pg(ulysses_degree, ring_degree, rank, world_size) "
                           "before building the attention")
    processor = VCLocalAttention(num_heads, **options)
    ulysses, _ = processor._process_groups()
    ulysses_heads(num_heads, 1 if ulysses is None else dist.get_world_size(ulysses),
                  0 if ulysses is None else dist.get_rank(ulysses))
    return LongContextAttention(attn_type=ATTN_TYPE, attn_processor=processor, use_sync=use_sync)
