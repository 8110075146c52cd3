"""The per-call attention override that the patch node installs on a cloned model.

ComfyUI's ``wrap_attn`` calls ``override(func, *args, **kwargs)`` for every attention call made with
``transformer_options`` (the diffusion model only: not text encoders, not the VAE); ``func`` is the
backend ComfyUI would have used. For each call this object decides:

1. role: tagged non-causal self-attention (``roles.py``)? else ``func``.
2. options: bits "off", blocks or steps kept on default attention, masks that depend on the query,
   GQA, ``low_precision_attention=False`` -> ``func``.
3. backend: ``kernels.explain_backend`` says whether a low-bit (VC) backend runs for these tensors;
   if not, ``func`` (ComfyUI's default), and the reason is recorded once.
4. plan: group / refresh / reuse by the sigma schedule (``schedule.py``), then
   ``kernels.vc_attention(..., plan=plan)``.

Any exception on the VC path falls back to ``func`` for that call and is recorded and logged: a
render never fails because of this override.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..kernels import explain_backend, plan_v_smooth, vc_attention
from .roles import ROLE_KEY, AttentionRole
from .schedule import PlanAction, PlanCache, RunSchedule, ScheduleConfig, plan_action

log = logging.getLogger("vc_attention")

# Lloyd iterations: cold start vs warm start from the previous refresh's centroids (METHOD.md 1.1).
COLD_ITERS = 10
WARM_ITERS = 2

_ARG_NAMES = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")


@dataclass(frozen=True)
class Refusal:
    """explain_backend's answer when the requested backend cannot run at all (it raised)."""

    message: str
    low_bit: bool = False
    backend: str = "none"

    def __str__(self) -> str:
        return self.message


def safe_explain(q, k, v, **options):
    """explain_backend, with "cannot run" (an explicit backend that refuses, an unbuilt bit width)
    turned into a Refusal instead of an exception."""
    try:
        return explain_backend(q, k, v, **options)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        return Refusal(str(e))


@dataclass(frozen=True)
class PatchConfig:
    """Everything the patch node's inputs decide, resolved (environment variable applied)."""

    bits: int | None  # 8, 4, 16 (exact: no quantisation) or None ("off": every call passes through)
    backend: str  # "auto" | "triton" | "reference"
    expcast: bool | None  # None = the library's auto choice
    clusters: int
    schedule: ScheduleConfig
    bf16_first_blocks: int = 0
    bf16_last_blocks: int = 0


@dataclass
class RunReport:
    """What happened in one sampling run (tests read it; the node shows ``text()``)."""

    backends: Counter = field(default_factory=Counter)  # backend name -> calls it ran
    patched: int = 0  # calls that ran VC-Attention
    passed: Counter = field(default_factory=Counter)  # reason -> calls left to ComfyUI's attention
    grouping: dict = field(default_factory=dict)  # step -> number of layer plans made at that step
    grouping_sigmas: dict = field(default_factory=dict)  # step -> sigma of the first grouping call
    events: list = field(default_factory=list)  # (step, layer, action) for every grouping
    clustering_s: float = 0.0  # wall time inside plan_v_smooth (synchronised on CUDA)
    errors: list = field(default_factory=list)  # distinct error messages (fell back to default)
    notes: list = field(default_factory=list)  # one-off messages (fallback reasons)

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
        if self.grouping:
            steps = ", ".join(str(s) for s in self.grouping_steps)
            lines.append(f"grouping at steps {steps} ({len(self.events)} layer plans, "
                         f"{self.clustering_s * 1000:.1f} ms clustering)")
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"error (fell back to default attention): {e}" for e in self.errors]
        return "\n".join(lines)


@dataclass
class _Call:
    """One attention call, bound to the backend signature of comfy/ldm/modules/attention.py."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    heads: int
    mask: torch.Tensor | None
    skip_reshape: bool
    skip_output_reshape: bool
    extra: dict

    @classmethod
    def bind(cls, args, kwargs) -> "_Call":
        bound = dict(zip(_ARG_NAMES, args))
        for name in _ARG_NAMES:
            if name in kwargs:
                bound[name] = kwargs[name]
        extra = {k: v for k, v in kwargs.items() if k not in _ARG_NAMES}
        return cls(bound["q"], bound["k"], bound["v"], int(bound["heads"]), bound.get("mask"),
                   bool(bound.get("skip_reshape", False)), bool(bound.get("skip_output_reshape", False)), extra)

    def unsupported(self) -> str | None:
        """Why this call cannot take the VC path (None: it can)."""
        if self.extra.get("low_precision_attention", True) is False:
            return "low_precision_attention=False"
        if self.extra.get("enable_gqa", False):
            return "grouped-query attention"
        if not (self.q.shape == self.k.shape == self.v.shape):
            return "q/k/v shapes differ (not one token set)"
        if not (self.q.dtype == self.k.dtype == self.v.dtype):
            return "q/k/v dtypes differ"
        if self.mask is not None and self.key_bias() is None:
            return "query-dependent mask"
        return None

    def tensors(self):
        """q, k, v in a layout the library takes without a copy, and that layout's name."""
        if self.skip_reshape:  # [B, H, N, D]
            return self.q, self.k, self.v, "HND"
        b, n, hd = self.q.shape
        d = hd // self.heads
        return (self.q.view(b, n, self.heads, d), self.k.view(b, n, self.heads, d),
                self.v.view(b, n, self.heads, d), "NHD")

    def key_bias(self) -> torch.Tensor | None:
        """The mask as an additive per-key bias [B|1, H|1, 1, N], or None if it depends on the query.

        Mirrors attention_pytorch: a 2-D mask gains a batch dim, a 3-D one a head dim.
        """
        mask = self.mask
        if mask is None:
            return None
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
        n = self.k.shape[2] if self.skip_reshape else self.k.shape[1]
        if mask.ndim != 4 or mask.shape[-2] != 1 or mask.shape[-1] != n:
            return None
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, float("-inf"))
        return mask.float()

    def output(self, out: torch.Tensor, layout: str) -> torch.Tensor:
        """The library's output (same layout as its input) in the shape the caller asked for."""
        if layout == "NHD":  # [B, N, H, D]
            b, n, h, d = out.shape
            return out.transpose(1, 2) if self.skip_output_reshape else out.reshape(b, n, h * d)
        b, h, n, d = out.shape  # HND
        return out if self.skip_output_reshape else out.transpose(1, 2).reshape(b, n, h * d)


class VCAttentionOverride:
    """Installed as ``transformer_options["optimized_attention_override"]`` on a patched clone.

    Shared by every clone of the patched model (ComfyUI copies the options dict, not this object),
    so per-run state lives in ``begin_run``/``end_run``, called by the OUTER_SAMPLE wrapper.
    """

    def __init__(self, config: PatchConfig, model_sampling=None, node_id=None, inner=None):
        self.config = config
        self.inner = inner  # an override that was installed before ours: pass-through calls go to it
        self.model_sampling = model_sampling  # fallback if a run starts without the wrapper
        self.node_id = node_id
        self.bits = config.bits
        self.plans = PlanCache()
        self.run: RunSchedule | None = None
        self.report = RunReport()
        self.last_report: RunReport | None = None
        self.runs = 0
        self._decisions: dict = {}

    # -- per-run state -------------------------------------------------------------------------

    def begin_run(self, sample_sigmas, model_sampling=None) -> None:
        """Reset plans and counters; fix this run's schedule (called before sampling)."""
        model_sampling = model_sampling if model_sampling is not None else self.model_sampling
        self.plans.clear()
        self.report = RunReport()
        self.run = RunSchedule.for_run(self.config.schedule, sample_sigmas, model_sampling)
        self.runs += 1

    def end_run(self) -> RunReport:
        self.last_report = self.report
        self.run = None
        self.plans.clear()  # centroids and permutations are large: do not keep them past the run
        return self.report

    # -- the override --------------------------------------------------------------------------

    def __call__(self, func, *args, **kwargs):
        options = kwargs.get("transformer_options") or {}
        role = options.get(ROLE_KEY)
        if role is None:
            return self._pass(func, args, kwargs, "not self-attention")
        if self.bits is None:
            return self._pass(func, args, kwargs, "bits off")
        try:
            out = self._vc(role, options, args, kwargs)
        except Exception as e:  # never leave a render broken: default attention for this call
            message = f"{type(e).__name__}: {e}"
            if message not in self.report.errors:
                self.report.errors.append(message)
                log.warning("VC-Attention fell back to default attention in %s: %s", role.layer, message,
                            exc_info=len(self.report.errors) == 1)
            return self._pass(func, args, kwargs, "error")
        if isinstance(out, str):
            return self._pass(func, args, kwargs, out)
        return out

    def _pass(self, func, args, kwargs, reason: str):
        self.report.passed[reason] += 1
        if self.inner is not None:
            return self.inner(func, *args, **kwargs)
        return func(*args, **kwargs)

    def _vc(self, role: AttentionRole, options: dict, args, kwargs):
        """The VC path; returns the output, or a string saying why the call passes through."""
        cfg = self.config
        if role.index < cfg.bf16_first_blocks or role.index >= role.total - cfg.bf16_last_blocks:
            return "block kept on default attention"
        call = _Call.bind(args, kwargs)
        reason = call.unsupported()
        if reason is not None:
            return reason
        sigmas = options.get("sigmas")
        if sigmas is None:
            return "no sigma (not called by a sampler)"
        sigma = float(sigmas.reshape(-1)[0])
        if self.run is None:  # sampled without our OUTER_SAMPLE wrapper: use what the call carries
            self.begin_run(options.get("sample_sigmas", [sigma]))
        if self.run.keep_default(sigma):
            return "step kept on default attention"

        q, k, v, layout = call.tensors()
        key_bias = call.key_bias()
        bits, backend = self._bits_for(q, k, v, layout, key_bias, call.extra.get("scale"))
        if bits is None:
            return "no low-bit backend"

        step = self.run.step(sigma)
        key = (role.layer, tuple(options.get("cond_or_uncond") or ()), tuple(v.shape), str(v.device))
        entry = self.plans.get(key)
        action = PlanAction.COLD if entry is None else self._action(entry.step, step, sigma)
        if action is PlanAction.REUSE:
            plan = entry.plan
        else:
            plan = self._group(v, layout, None if action is PlanAction.COLD else entry.plan)
            self.plans.put(key, plan, step)
            r = self.report
            r.grouping[step] = r.grouping.get(step, 0) + 1
            r.grouping_sigmas.setdefault(step, sigma)
            r.events.append((step, role.layer, action.value))

        out = self._attention(q, k, v, layout, bits, plan, key_bias, call.extra.get("scale"))
        self.report.patched += 1
        self.report.backends[backend] += 1
        return call.output(out, layout)

    def _action(self, last_step: int, step: int, sigma: float) -> PlanAction:
        return plan_action(last_step, step, self.run.in_window(sigma), self.config.schedule.refresh_every)

    def _group(self, v, layout, previous):
        sync = v.is_cuda  # time the clustering itself, not the queue in front of it
        if sync:
            torch.cuda.synchronize(v.device)
        t0 = time.perf_counter()
        if previous is None:
            plan = plan_v_smooth(v, num_clusters=self.config.clusters, iters=COLD_ITERS, layout=layout)
        else:
            plan = plan_v_smooth(v, num_clusters=self.config.clusters, iters=WARM_ITERS,
                                 init=previous.centroids, layout=layout)
        if sync:
            torch.cuda.synchronize(v.device)
        self.report.clustering_s += time.perf_counter() - t0
        return plan

    def _options(self, bits, layout, key_bias, scale):
        return dict(bits=bits, v_smooth=True, expcast=self.config.expcast, sm_scale=scale,
                    layout=layout, backend=self.config.backend, key_bias=key_bias)

    def _bits_for(self, q, k, v, layout, key_bias, scale) -> tuple[int | None, str]:
        """Bit width a VC backend runs for these tensors (4 may degrade to 8; None: none) and its name."""
        sig = (q.device, q.dtype, tuple(q.shape), layout, None if key_bias is None else tuple(key_bias.shape),
               scale, self.bits)
        if sig not in self._decisions:
            decision = safe_explain(q, k, v, **self._options(self.bits, layout, key_bias, scale))
            bits = self.bits
            if not decision.low_bit and self.bits == 4:
                fallback = safe_explain(q, k, v, **self._options(8, layout, key_bias, scale))
                if fallback.low_bit:
                    self.report.note(f"4-bit unavailable here ({decision}); using 8-bit")
                    decision, bits = fallback, 8
            if not decision.low_bit:
                self.report.note(f"no low-bit backend for {tuple(q.shape)} {q.dtype} on {q.device}: "
                                 f"{decision}; default attention")
                bits = None
            self._decisions[sig] = (bits, decision.backend)
        return self._decisions[sig]

    def _attention(self, q, k, v, layout, bits, plan, key_bias, scale):
        try:
            return vc_attention(q, k, v, plan=plan, **self._options(bits, layout, key_bias, scale))
        except NotImplementedError as e:
            if bits != 4:
                raise
            # The 4-bit kernel is not there yet: use 8-bit from now on and say so once.
            self.report.note(f"4-bit not implemented ({e}); using 8-bit")
            self.bits = 8
            self._decisions.clear()
            return vc_attention(q, k, v, plan=plan, **self._options(8, layout, key_bias, scale))
