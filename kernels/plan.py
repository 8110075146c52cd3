"""V-Smooth's plan: which value tokens go together, as plain tensors that can be reused.

plan_v_smooth() clusters the value tokens of every (batch, head) with k-means and returns the stable
argsort of the labels: the permutation applied jointly to K and V (exact for non-causal attention).
A plan is reused across calls and denoising steps; a refresh warm-starts from its centroids.
"""

from dataclasses import dataclass
from enum import Enum
from typing import Optional

import torch

from .dispatch import KMEANS_BACKENDS, choose_kmeans
from .reference.kmeans import initial_centroids

DEFAULT_CLUSTERS = 64
# Lloyd iterations: a cold start, and a warm start from the previous refresh's centroids.
COLD_ITERS = 10
WARM_ITERS = 2


# The grouping schedule's rules, shared by the ComfyUI nodes (nodes/schedule.py), the
# sequence-parallel processor (sequence_parallel.py) and the schedule replay (fidelity/schedule.py).
# A step fraction (step / steps) on the window boundary is outside it: 10 / 40 is outside 0.25.
FRACTION_EPS = 1e-9
# A sigma within this relative distance of the window's threshold sigma counts as on it (outside).
WINDOW_RTOL = 1e-4


class PlanAction(str, Enum):
    COLD = "cold"  # no plan yet: k-means from scratch
    WARM = "warm"  # refresh inside the window: k-means warm-started from the previous centroids
    REUSE = "reuse"  # keep the current permutation


def plan_action(last_step: Optional[int], step: int, in_window: bool, refresh_every: int) -> PlanAction:
    """What a layer does at ``step`` given the step of its last grouping (None: no plan yet)."""
    if last_step is None:
        return PlanAction.COLD
    # abs(): a restart sampler may go back to an earlier (noisier) step.
    if in_window and abs(step - last_step) >= refresh_every:
        return PlanAction.WARM
    return PlanAction.REUSE


def above(sigma: float, threshold: float) -> bool:
    """sigma strictly above threshold, by more than float rounding: inside a sigma window."""
    return float(sigma) > float(threshold) * (1.0 + WINDOW_RTOL)


def in_fraction_window(step: int, fraction: float, window: float) -> bool:
    """Whether a call at ``fraction`` (step / steps) of the schedule is inside the first ``window``
    of it; step 0 always is, for a non-zero window."""
    return window > 0 and (step == 0 or fraction < window - FRACTION_EPS)


@dataclass
class VSmoothPlan:
    """perm [B, H, N] int64 (K'[t] = K[perm[t]]; int32 in a plan kept only to be reused: every
    backend takes either), labels [B, H, N] int64 (cluster of each token; None in a kept plan),
    centroids [B, H, C, D] fp32 (warm start of the next refresh), counts [B, H, C] int64."""

    perm: torch.Tensor
    labels: Optional[torch.Tensor]
    centroids: torch.Tensor
    counts: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.perm.shape[-1]

    def inverse(self) -> torch.Tensor:
        """inv [B, H, N] with inv[perm[t]] = t (to undo a permutation of token-ordered data)."""
        inv = torch.empty_like(self.perm)
        ar = torch.arange(self.perm.shape[-1], device=self.perm.device).expand_as(self.perm)
        return inv.scatter_(-1, self.perm, ar.contiguous())


def plan_v_smooth(v: torch.Tensor, *, num_clusters: int = DEFAULT_CLUSTERS, iters: int = COLD_ITERS,
                  init=None, seed: int = 0, layout: str = "HND", backend: str = "auto",
                  heads=None) -> VSmoothPlan:
    """Cluster the value tokens of each (batch, head) and return the plan.

    v: [B, H, N, D] (layout "HND") or [B, N, H, D] ("NHD"). num_clusters is capped at N.
    init: centroids [B, H, C, D] from an earlier plan (warm start; use iters=2) or a VSmoothPlan.
    seed: chooses the initial tokens when init is None; the same seed gives the same plan.
    backend: "auto" (on CUDA the cubins, else the Triton kernels; elsewhere the reference), or one of
    "precompiled", "triton", "reference" (the backend registry's choose_kmeans decides and says why).
    heads: (first, total) when v holds heads first .. first + H - 1 of a model's total heads (one
    rank's heads under sequence parallelism): the cold start chooses the same tokens as the plan of
    all heads would, so each head's plan is the one a single process makes.
    """
    if v.dim() != 4:
        raise ValueError(f"v must be 4-D [B, H, N, D] or [B, N, H, D], got shape {tuple(v.shape)}")
    if backend not in ("auto",) + KMEANS_BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + KMEANS_BACKENDS}, got {backend!r}")
    if layout not in ("HND", "NHD"):
        raise ValueError(f"layout must be 'HND' or 'NHD', got {layout!r}")
    if num_clusters < 1 or iters < 0:
        raise ValueError(f"need num_clusters >= 1 and iters >= 0, got {num_clusters}, {iters}")
    x = v if layout == "HND" else v.transpose(1, 2)
    B, H, N, D = x.shape
    G = B * H
    if isinstance(init, VSmoothPlan):
        init = init.centroids
    if init is not None:
        if init.dim() != 4 or tuple(init.shape[:2]) != (B, H) or init.shape[-1] != D:
            raise ValueError(f"init centroids must be [B={B}, H={H}, C, D={D}], got {tuple(init.shape)}")
        centroids = init.reshape(G, -1, D).to(device=v.device, dtype=torch.float32)
    else:
        groups = None
        if heads is not None:
            first, total = (int(h) for h in heads)
            if first < 0 or first + H > total:
                raise ValueError(f"heads=(first, total) must hold this tensor's {H} heads, got {heads!r}")
            groups = [b * total + first + h for b in range(B) for h in range(H)]
        centroids = initial_centroids(x.reshape(G, N, D), min(num_clusters, N), seed, groups)
    C = centroids.shape[1]

    _, kmeans, _ = choose_kmeans(x, backend)
    labels, centroids, order = kmeans(x, centroids, iters)
    counts = torch.zeros((G, C), dtype=torch.int64, device=v.device)
    counts.scatter_add_(1, labels, torch.ones_like(labels))
    return VSmoothPlan(perm=order.reshape(B, H, N), labels=labels.reshape(B, H, N),
                       centroids=centroids.reshape(B, H, C, D), counts=counts.reshape(B, H, C))
