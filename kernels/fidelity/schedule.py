"""Plan schedules replayed on captured self-attention inputs (FIDELITY.md "Schedule effect").

``Planner`` is one schedule's plan cache, keyed like the node's (layer, cond/uncond batch) and driven
by the node's own rules (``kernels/plan.py``: ``plan_action``, ``above``); ``SCHEDULES`` names the
schedules compared (a fresh plan every step, every 4th step, the node's default 25% window, one plan
at the first step). ``energy_share`` is the share of block energy the 128-row mean removes in a given
token order. ``benchmarks/fidelity/schedule_effect.py`` runs them over a capture and writes the table;
``tests/nodes/test_capture_schedule.py`` pins its stale-plan claim.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from ..plan import COLD_ITERS, WARM_ITERS, PlanAction, above, plan_action, plan_v_smooth
from ..reference.vsmooth import V_BLOCK, permute_tokens

CLUSTERS = 64
# name -> (in_window(sigma, window_sigma), refresh_every); None: no permutation
SCHEDULES = {
    "fresh": (lambda s, w: True, 1),
    "refresh4": (lambda s, w: True, 4),
    "window25": (lambda s, w: above(s, w), 4),
    "once": (lambda s, w: False, 4),
}


def energy_share(v: torch.Tensor, perm: torch.Tensor | None, block: int = V_BLOCK) -> torch.Tensor:
    """v [B, H, N, D], perm [B, H, N] or None -> pooled share of energy removed per (B, H)."""
    x = (permute_tokens(v, perm) if perm is not None else v).double()
    B, H, N, D = x.shape
    nb = -(-N // block)
    xp = torch.nn.functional.pad(x, (0, 0, 0, nb * block - N)).view(B, H, nb, block, D)
    counts = torch.full((nb,), float(block), dtype=torch.float64)
    counts[-1] = N - (nb - 1) * block
    mu = xp.sum(3) / counts[:, None]
    removed = (counts * mu.pow(2).sum(-1)).sum(-1)
    return removed / x.pow(2).sum((2, 3))


def errors(o_ref: torch.Tensor, o: torch.Tensor) -> tuple[float, float]:
    err = (o.double() - o_ref).pow(2).sum().item()
    ref = o_ref.pow(2).sum().item()
    return math.sqrt(err / ref), 10 * math.log10(ref / err)


class Planner:
    """One schedule's plan cache, keyed like the node's: (layer, cond/uncond batch)."""

    def __init__(self, in_window, refresh_every, window_sigma):
        self.in_window, self.refresh, self.window_sigma = in_window, refresh_every, window_sigma
        self.entries = {}  # key -> (plan, step of its grouping)
        self.groupings = defaultdict(list)  # key -> steps that grouped

    def plan(self, key, step, sigma, v):
        entry = self.entries.get(key)
        action = plan_action(None if entry is None else entry[1], step,
                             self.in_window(sigma, self.window_sigma), self.refresh)
        if action is PlanAction.REUSE:
            return entry[0], entry[1]
        if action is PlanAction.COLD:
            plan = plan_v_smooth(v, num_clusters=CLUSTERS, iters=COLD_ITERS, backend="reference")
        else:
            plan = plan_v_smooth(v, num_clusters=CLUSTERS, iters=WARM_ITERS, init=entry[0].centroids,
                                 backend="reference")
        self.entries[key] = (plan, step)
        self.groupings[key].append(step)
        return plan, step


def query_rows(n: int, blocks: int, seed: int = 0) -> torch.Tensor:
    """Row indices of ``blocks`` distinct 128-row query blocks (Q's INT8 blocks stay real), fixed by seed."""
    nb = -(-n // V_BLOCK)
    if blocks <= 0 or blocks >= nb:
        return torch.arange(n)
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(nb, generator=g)[:blocks].sort().values
    return torch.cat([torch.arange(b * V_BLOCK, min((b + 1) * V_BLOCK, n)) for b in chosen.tolist()])
