"""When to group (k-means + new permutation), from sigmas; the per-run plan cache.

Definitions (the node's tooltips and the README say the same):

- **Step** of a call: its position in the running sampler's schedule ``sample_sigmas``; a call at
  sigma belongs to step i when ``sample_sigmas[i+1] < sigma <= sample_sigmas[i]``. A Heun-type
  sampler's second evaluation of step i happens at ``sample_sigmas[i+1]`` and so counts as step
  i+1 (same noise level); several calls in one step share the step's plan.
- **Grouping window**: the calls whose sigma is above ``model_sampling.percent_to_sigma(window)``,
  i.e. the first ``window`` of the denoising schedule in the model's own timestep parametrisation.
  It does not depend on how a sampler slices the schedule (two ``KSamplerAdvanced`` over one
  schedule see the same window). With ComfyUI's "simple" scheduler and 40 steps, window 0.25 is
  steps 0-9.
- **Grouping**: a layer (key: layer, cond/uncond batch, shape) with no plan groups on its first call
  (cold k-means). Inside the window it re-groups (warm-started from its previous centroids) on the
  first call at least ``refresh_every`` steps after its last grouping: steps 0, 4, 8 for 40 steps.
  After the window the last permutation is reused. A caching node that skips step 4 moves the
  refresh to the next call; a model first called after the window (the second Wan 2.2 expert)
  groups once on its first call.
- WanVideoWrapper's sampler reports ``step / steps`` instead of a sigma: :class:`FractionSchedule`
  applies the same window to that fraction (step 0 always inside a non-zero window).
- All of this is per sampling run: the plan cache is emptied at the start of every run (the
  OUTER_SAMPLE wrapper), so nothing leaks between queued prompts.

This module has no ComfyUI import: its logic is unit-tested alone.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from ..kernels.plan import (  # noqa: F401
    FRACTION_EPS,
    WINDOW_RTOL,
    PlanAction,
    above,
    in_fraction_window,
    plan_action,
)

# Relative slack when comparing a sigma with schedule entries: the sigma handed to the model and the
# schedule's entry can differ by float32 rounding.
SIGMA_RTOL = 1e-5
# A call whose sigma sits on the window boundary (within float rounding) is outside the window:
# "the first 25% of 40 steps" is steps 0-9, and step 10's sigma equals percent_to_sigma(0.25).
# That rule (``above``, WINDOW_RTOL), the one for a step fraction (FRACTION_EPS, in_fraction_window),
# PlanAction and plan_action live in kernels/plan.py: the sequence-parallel processor shares them.


@dataclass(frozen=True)
class ScheduleConfig:
    grouping_window: float = 0.25  # fraction of the schedule
    refresh_every: int = 4  # steps between groupings inside the window
    bf16_until: float = 0.0  # fraction of the schedule kept on ComfyUI's attention

    def __post_init__(self):
        if not 0.0 <= self.grouping_window <= 1.0:
            raise ValueError(f"grouping_window must be in [0, 1], got {self.grouping_window}")
        if self.refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {self.refresh_every}")
        if not 0.0 <= self.bf16_until <= 1.0:
            raise ValueError(f"bf16_until must be in [0, 1], got {self.bf16_until}")


def step_index(sigma: float, sample_sigmas: Sequence[float]) -> int:
    """Index i with sample_sigmas[i+1] < sigma <= sample_sigmas[i] (descending schedule).

    Sigmas above the first entry (a restart sampler going back up) count as step 0.
    """
    if len(sample_sigmas) == 0:
        return 0
    # Count entries >= sigma (with slack); bisect on the ascending negated list.
    neg = [-float(s) for s in sample_sigmas]
    count = bisect.bisect_right(neg, -float(sigma) * (1.0 - SIGMA_RTOL) + 0.0)
    return max(count - 1, 0)


def threshold_sigma(model_sampling, fraction: float) -> float:
    """The model's own sigma at ``fraction`` of the schedule (0 -> above any sigma, 1 -> 0)."""
    return float(model_sampling.percent_to_sigma(float(fraction)))


@dataclass
class RunSchedule:
    """The schedule of one sampling run."""

    config: ScheduleConfig
    sample_sigmas: list[float]
    window_sigma: float  # calls with sigma above this are inside the grouping window
    bf16_sigma: float  # calls with sigma above this keep ComfyUI's attention

    @classmethod
    def for_run(cls, config: ScheduleConfig, sample_sigmas, model_sampling) -> "RunSchedule":
        sigmas = [float(s) for s in sample_sigmas] if sample_sigmas is not None else []
        bf16 = threshold_sigma(model_sampling, config.bf16_until) if config.bf16_until > 0 else float("inf")
        return cls(config, sigmas, threshold_sigma(model_sampling, config.grouping_window), bf16)

    def step(self, sigma: float) -> int:
        return step_index(sigma, self.sample_sigmas)

    def in_window(self, sigma: float) -> bool:
        return self.config.grouping_window > 0 and above(sigma, self.window_sigma)

    def keep_default(self, sigma: float) -> bool:
        return self.config.bf16_until > 0 and above(sigma, self.bf16_sigma)


@dataclass(frozen=True)
class FractionSchedule:
    """The same window rule for a sampler that reports its progress as a fraction of its steps
    (WanVideoWrapper: ``current_step_percentage`` = step / steps) instead of a sigma."""

    config: ScheduleConfig

    def in_window(self, step: int, fraction: float) -> bool:
        return in_fraction_window(step, fraction, self.config.grouping_window)

    def keep_default(self, fraction: float) -> bool:
        u = self.config.bf16_until
        return u > 0 and fraction < u - FRACTION_EPS


@dataclass
class PlanEntry:
    """A plan kept between steps, compactly: one is kept per layer and CFG batch for the whole run
    (Wan2.2-14B 720p: 80 of them), so the permutation is kept as int32 (N < 2**31) and the labels,
    which nothing reads after the grouping, not at all: a quarter of the plan's memory."""

    perm: Any  # [B, H, N] int32
    centroids: Any  # [B, H, C, D] fp32: the next refresh's warm start
    counts: Any  # [B, H, C]
    step: int  # step of the grouping that made it

    @classmethod
    def keep(cls, plan, step: int) -> "PlanEntry":
        return cls(plan.perm.to(torch.int32), plan.centroids, plan.counts, step)

    @property
    def plan(self):
        """The plan for a call (kernels.VSmoothPlan with the int32 permutation, no labels): the
        kernels' pre-pass reads int32 gathers as they are, so nothing is widened per call."""
        from ..kernels.plan import VSmoothPlan

        return VSmoothPlan(perm=self.perm, labels=None, centroids=self.centroids, counts=self.counts)


@dataclass
class PlanCache:
    """Plans of one sampling run, keyed by (layer, cond/uncond batch, shape)."""

    entries: dict[Hashable, PlanEntry] = field(default_factory=dict)

    def get(self, key) -> PlanEntry | None:
        return self.entries.get(key)

    def put(self, key, plan, step: int) -> None:
        self.entries[key] = PlanEntry.keep(plan, step)

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)
