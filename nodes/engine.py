"""The engine behind both VC-Attention patch nodes: decision, plans, kernel call, fallback, report.

The two adapters only translate calls: ``override.py`` (ComfyUI's core models, through
``optimized_attention_override``) and ``wanvideo.py`` (models of the WanVideoWrapper nodes, through
that pack's dispatcher). Each turns a call into a site name, q/k/v in a library layout, the step
and whether it is inside the grouping window, and hands it to :meth:`AttentionEngine.attention`.
From there on everything is decided here, once:

- **backend and bits** (:meth:`AttentionEngine.decide`): ``kernels.explain_backend`` for the
  call's signature, cached; where 4-bit cannot run, 8-bit, and where INT8 P.V cannot run, FP8
  P.V (:func:`runnable_bits`, also used by :func:`precheck` when the node executes);
- **plans** (:meth:`AttentionEngine.plan`): per site, batch and shape, cold / warm / reuse by
  ``schedule.plan_action``; k-means by ``kernels.plan_v_smooth``;
- **the kernel call**: ``kernels.vc_attention`` (the library's custom op);
- **error fallback**: any exception on this path returns the reason "error"; the adapter runs its
  default attention for that call, the message is recorded and logged once;
- **the report** (:class:`RunReport`): what ran, where it passed through and why, grouping steps.

Public interface: :class:`AttentionEngine` (``start_run``, ``finish_run``, ``reason_to_pass``,
``attention``, ``passed``, ``report``, ``last_report``, ``runs``, ``plans``, ``bits``, ``config``),
:class:`RunReport`, :func:`precheck`, :func:`node_terms`.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from ..kernels import COLD_ITERS, WARM_ITERS, explain_backend, plan_v_smooth, vc_attention
from .config import EXACT_BITS, PatchConfig
from .schedule import PlanAction, PlanCache, plan_action

log = logging.getLogger("vc_attention")

NO_BACKEND = "no low-bit backend"
ERROR = "error"


def node_terms(text) -> str:
    """A library message in the node's words: the library's ``bits=16`` is the node's backend
    "exact", its ``bits=8`` / ``bits=4`` are the node's bits "8" / "4"."""
    text = str(text).replace(f"bits={EXACT_BITS}", "backend 'exact'")
    return re.sub(r"\bbits=(\d+)", r"bits '\1'", text)


@dataclass(frozen=True)
class Refusal:
    """explain_backend's answer when the requested backend cannot run at all (it raised)."""

    message: str
    low_bit: bool = False
    backend: str = "none"
    reasons: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


def safe_explain(q, k, v, **options):
    """explain_backend, with "cannot run" (an explicit backend that refuses, an unbuilt bit width)
    turned into a Refusal instead of an exception."""
    try:
        return explain_backend(q, k, v, **options)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        return Refusal(str(e))


def runnable_bits(ask: Callable, bits: int, pv_format: str = "auto"):
    """The bit width and P.V format that run: ``bits`` with ``pv_format`` ("auto": the library's
    choice, "int8" or "fp8"); else FP8 P.V where INT8 P.V was asked (8-bit) and only FP8 runs; else 8
    where 4 was asked and 8 runs; else None.

    ``ask(bits, pv_format)`` returns explain_backend's decision for them. Returns (bits or None, the
    P.V format, the decision for them, a note for the user or None). The only place these rules are
    written."""
    if bits == 8 and pv_format == "auto":
        decision = ask(8, "auto")
        return (8 if decision.low_bit else None), ("int8" if decision.pv_int8 else "fp8"), decision, None
    if bits == 8 and pv_format == "int8":
        decision = ask(8, "int8")
        if decision.low_bit:
            return 8, "int8", decision, None
        got, fmt, fp8, note = runnable_bits(ask, 8, "fp8")
        if got is None:
            return None, "fp8", decision, None
        return got, fmt, fp8, f"INT8 P.V unavailable ({node_terms(decision)}); using FP8 P.V on {fp8.backend}"
    decision = ask(bits, "fp8")
    if decision.low_bit or bits != 4:
        return (bits if decision.low_bit else None), "fp8", decision, None
    eight = ask(8, "fp8" if pv_format == "fp8" else "auto")
    if not eight.low_bit:
        return None, "fp8", decision, None
    fmt = "int8" if eight.pv_int8 else "fp8"
    return 8, fmt, eight, f"4-bit unavailable ({node_terms(decision)}); using 8-bit on {eight.backend}"


@dataclass(frozen=True)
class Decision:
    bits: int
    backend: str
    pv_format: str = "fp8"


@dataclass
class RunReport:
    """What happened in one sampling run (tests read it; the node shows ``text()``, the run's
    history carries ``as_dict()``)."""

    backends: Counter = field(default_factory=Counter)  # backend name -> calls it ran
    bits: Counter = field(default_factory=Counter)  # bit width -> calls it ran
    patched: int = 0  # calls that ran VC-Attention
    passed: Counter = field(default_factory=Counter)  # reason -> calls left to the default attention
    grouping: dict = field(default_factory=dict)  # step -> number of layer plans made at that step
    grouping_sigmas: dict = field(default_factory=dict)  # step -> sigma of the first grouping call
    events: list = field(default_factory=list)  # (step, layer, action) for every grouping
    clustering_s: float = 0.0  # time inside plan_v_smooth (on CUDA: GPU time between events, summed at the run's end)
    errors: list = field(default_factory=list)  # distinct error messages (fell back to default)
    notes: list = field(default_factory=list)  # one-off messages (fallback reasons)
    compiled: bool = False  # the model ran under torch.compile (calls outside self-attention uncounted)

    @property
    def grouping_steps(self) -> list[int]:
        return sorted(self.grouping)

    @property
    def passed_total(self) -> int:
        return sum(self.passed.values())

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)
            log.info("VC-Attention: %s", message)

    def text(self) -> str:
        backend = ", ".join(f"{b} ({n} calls)" for b, n in self.backends.most_common()) or "none"
        lines = [f"VC-Attention: {self.patched} calls patched, {self.passed_total} passed through",
                 f"backend: {backend}"]
        if self.passed:
            lines.append("passed through: " + ", ".join(f"{r}: {n}" for r, n in self.passed.most_common()))
        if self.compiled:
            lines.append("torch.compile: calls outside self-attention not counted")
        if self.grouping:
            steps = ", ".join(str(s) for s in self.grouping_steps)
            lines.append(f"grouping at steps {steps} ({len(self.events)} layer plans, "
                         f"{self.clustering_s * 1000:.1f} ms clustering)")
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"error (fell back to default attention): {e}" for e in self.errors]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """The report as JSON-ready data (the patch node's entry in ``/history/<prompt_id>``)."""
        bits = {("exact" if b == EXACT_BITS else str(b)): n for b, n in self.bits.most_common()}
        return {
            "patched": self.patched,
            "passed_through": self.passed_total,
            "backends": dict(self.backends.most_common()),
            "bits": bits,
            "passed": dict(self.passed.most_common()),
            "grouping_steps": self.grouping_steps,
            "layer_plans": len(self.events),
            "clustering_ms": round(self.clustering_s * 1000, 3),
            "notes": list(self.notes),
            "errors": list(self.errors),
            "compiled": self.compiled,
            "text": self.text(),
        }


class AttentionEngine:
    """Per-node state and decisions; one per patch node execution (shared by the model's clones),
    so per-run state lives between ``start_run`` and ``finish_run``."""

    def __init__(self, config: PatchConfig):
        self.config = config
        self.bits = config.bits  # the width asked for; 4 becomes 8 where no 4-bit kernel runs
        self.plans = PlanCache()
        self.report = RunReport()
        self.last_report: RunReport | None = None
        self.runs = 0
        self._decisions: dict = {}
        self._clustering_events: list = []  # (start, end) CUDA events of this run's grouping calls

    # -- per run -----------------------------------------------------------------------------------

    def start_run(self) -> None:
        """Fresh plans and counters (before a sampling run)."""
        self.plans.clear()
        self.report = RunReport()
        self._clustering_events = []
        self.runs += 1

    def finish_run(self) -> RunReport:
        self._settle_clustering_time()
        self.last_report = self.report
        self.plans.clear()  # centroids and permutations are large: do not keep them past the run
        return self.report

    # -- per call ----------------------------------------------------------------------------------

    def reason_to_pass(self, index: int, total: int) -> str | None:
        """The node's own reasons to leave a layer on default attention (None: it may run VC)."""
        cfg = self.config
        if self.bits is None:
            return "bits off"
        if index < cfg.bf16_first_blocks or index >= total - cfg.bf16_last_blocks:
            return "block kept on default attention"
        return None

    def passed(self, reason: str) -> None:
        self.report.passed[reason] += 1

    def attention(self, layer: str, batch: Hashable, q, k, v, *, layout: str, step: int, in_window: bool,
                  key_bias=None, scale=None, sigma=None):
        """VC-Attention for one call, or a string saying why it passes through (then the adapter
        calls its default attention and :meth:`passed`). Never raises: an exception is the reason
        "error", recorded and logged once."""
        try:
            decision = self.decide(q, k, v, layout, key_bias, scale)
            if decision is None:
                return NO_BACKEND
            plan = self.plan(layer, batch, v, layout, step, in_window, sigma)
            out = self._kernel(q, k, v, layout, decision, plan, key_bias, scale)
        except Exception as e:  # never leave a render broken: default attention for this call
            message = f"{type(e).__name__}: {e}"
            if message not in self.report.errors:
                self.report.errors.append(message)
                log.warning("VC-Attention fell back to default attention in %s: %s", layer, message,
                            exc_info=len(self.report.errors) == 1)
            return ERROR
        self.report.patched += 1
        self.report.backends[decision.backend] += 1
        self.report.bits[decision.bits] += 1
        return out

    # -- the parts ---------------------------------------------------------------------------------

    def _options(self, bits, layout, key_bias, scale, pv_format="auto") -> dict:
        return dict(bits=bits, v_smooth=True, expcast=self.config.expcast, sm_scale=scale, layout=layout,
                    backend=self.config.backend, key_bias=key_bias, pv_format=pv_format)

    def decide(self, q, k, v, layout, key_bias=None, scale=None) -> Decision | None:
        """The backend and bit width that run these tensors (None: no low-bit backend), cached per
        signature; a 4 -> 8-bit fallback or a refusal is noted once."""
        sig = (q.device, q.dtype, tuple(q.shape), layout, None if key_bias is None else tuple(key_bias.shape),
               scale, self.bits)
        if sig not in self._decisions:
            bits, pv_format, decision, note = runnable_bits(
                lambda b, f: safe_explain(q, k, v, **self._options(b, layout, key_bias, scale, f)), self.bits,
                self.config.pv_format)
            if note:
                self.report.note(note)
            if bits is None:
                self.report.note(f"{NO_BACKEND} for {tuple(q.shape)} {q.dtype} on {q.device}: "
                                 f"{node_terms(decision)}; default attention")
            self._decisions[sig] = None if bits is None else Decision(bits, decision.backend, pv_format)
        return self._decisions[sig]

    def plan(self, layer: str, batch: Hashable, v, layout: str, step: int, in_window: bool, sigma=None):
        """The V-Smooth plan of this site at this step: made (cold), refreshed (warm) or reused."""
        key = (layer, batch, tuple(v.shape), str(v.device))
        entry = self.plans.get(key)
        action = PlanAction.COLD if entry is None else plan_action(
            entry.step, step, in_window, self.config.schedule.refresh_every)
        if action is PlanAction.REUSE:
            return entry.plan
        plan = self._group(v, layout, None if action is PlanAction.COLD else entry)  # its centroids
        self.plans.put(key, plan, step)
        # This call runs on the kept form (int32 permutation) too: grouping and reuse steps then
        # launch the same pre-pass variant, and the first reuse step compiles nothing.
        plan = self.plans.get(key).plan
        r = self.report
        r.grouping[step] = r.grouping.get(step, 0) + 1
        if sigma is not None:
            r.grouping_sigmas.setdefault(step, sigma)
        r.events.append((step, layer, action.value))
        return plan

    def _group(self, v, layout, previous):
        # Timed with CUDA events, read once at the run's end: a synchronize here would stall the host
        # at every grouping call and empty the launch queue in front of the next layer.
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if v.is_cuda else None
        if events:
            events[0].record()
        t0 = time.perf_counter()
        if previous is None:
            plan = plan_v_smooth(v, num_clusters=self.config.clusters, iters=COLD_ITERS, layout=layout)
        else:
            plan = plan_v_smooth(v, num_clusters=self.config.clusters, iters=WARM_ITERS,
                                 init=previous.centroids, layout=layout)
        if events:
            events[1].record()
            self._clustering_events.append(events)
        else:
            self.report.clustering_s += time.perf_counter() - t0
        return plan

    def _settle_clustering_time(self) -> None:
        pending, self._clustering_events = self._clustering_events, []
        if pending:
            pending[-1][1].synchronize()
            self.report.clustering_s += sum(start.elapsed_time(end) for start, end in pending) / 1000.0

    def _kernel(self, q, k, v, layout, decision: Decision, plan, key_bias, scale):
        try:
            return vc_attention(q, k, v, plan=plan, **self._options(decision.bits, layout, key_bias, scale,
                                                                   decision.pv_format))
        except NotImplementedError as e:
            if decision.bits != 4:
                raise
            # A 4-bit backend that was chosen but cannot launch: 8-bit from now on, said once.
            self.report.note(f"4-bit not implemented ({node_terms(e)}); using 8-bit")
            self.bits = 8
            self._decisions.clear()
            eight = self.decide(q, k, v, layout, key_bias, scale)
            if eight is None:
                raise
            return self._kernel(q, k, v, layout, eight, plan, key_bias, scale)


def precheck(config: PatchConfig, device, dtype, head_dim: int) -> tuple[PatchConfig, str]:
    """Ask the library, on a small tensor shaped like the model's heads, whether a VC backend runs.

    Returns the config (4 -> 8 bits where only 8 runs) and a line for the node, in the node's words.
    """
    from dataclasses import replace

    if config.bits is None:
        return config, "bits off: every call keeps the default attention (hooks installed, nothing quantised)"
    x = torch.zeros(1, 1, 256, head_dim, device=device, dtype=dtype)

    def ask(bits, pv_format):
        return safe_explain(x, x, x, bits=bits, v_smooth=True, expcast=config.expcast, layout="HND",
                            backend=config.backend, pv_format=pv_format)

    bits, pv_format, decision, note = runnable_bits(ask, config.bits, config.pv_format)
    if bits is None:
        return config, (f"{NO_BACKEND} on {device} for {dtype}: {node_terms(decision)}. "
                        "The default attention is used for every call")
    if bits != config.bits or pv_format != config.pv_format:
        config = replace(config, bits=bits, pv_format=pv_format)
    refused = "".join(f"; {name} refused: {node_terms(why)}" for name, why in decision.reasons.items())
    line = f"{config.mode} on {decision.backend} ({device}, {dtype}){refused}"
    return config, (f"{note}\n{line}" if note else line)
