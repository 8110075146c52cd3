"""The core-model adapter: the per-call attention override that the patch node installs on a clone.

ComfyUI's ``wrap_attn`` calls ``override(func, *args, **kwargs)`` for every attention call made with
``transformer_options`` (the diffusion model only: not text encoders, not the VAE); ``func`` is the
backend ComfyUI would have used. This file only translates such a call for the engine
(``engine.py``, which holds the decisions):

1. role: tagged non-causal self-attention (``roles.py``)? else ``func``.
2. the node's options (bits "off", blocks kept on default attention: ``engine.reason_to_pass``),
   masks that depend on the query, GQA, ``low_precision_attention=False`` -> ``func``.
3. step: the call's sigma on this run's schedule (``schedule.RunSchedule``): steps kept on default
   attention -> ``func``; the step and "inside the grouping window" go to the engine.
4. ``engine.attention(...)``: backend/bits, plan, kernel; a string back means "pass through".

Under ``torch.compile`` (ComfyUI's ``TorchCompileModel`` before or after the patch node) the traced
part is only step 1 and one call of the custom op ``vc_attention_nodes::override_call``, whose fake
gives the output's shape: every decision above (schedule, plan cache, grouping, fallback, the
report) runs inside that op at run time, eagerly, so the graph has no break and no guard on a sigma
or a layer name. The op finds this override through ``token``, a tensor graph input read from
``transformer_options`` at each call, and ComfyUI's ``func`` through ``_FUNCS``.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from .config import PatchConfig
from .engine import AttentionEngine, RunReport
from .roles import ROLE_KEY, AttentionRole
from .schedule import RunSchedule

_ARG_NAMES = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")
# Extra keywords a compiled call can carry into the op (others: that call takes a graph break).
_OP_EXTRAS = ("transformer_options", "_inside_attn_wrapper", "low_precision_attention", "enable_gqa", "scale")


class AttentionCall:
    """One attention call, bound to the backend signature of comfy/ldm/modules/attention.py."""

    def __init__(self, q, k, v, heads, mask, skip_reshape, skip_output_reshape, extra, attn_precision=None):
        self.q, self.k, self.v = q, k, v
        self.attn_precision = attn_precision
        self.heads = heads
        self.mask = mask
        self.skip_reshape = skip_reshape
        self.skip_output_reshape = skip_output_reshape
        self.extra = extra

    @classmethod
    def bind(cls, args, kwargs) -> "AttentionCall":
        bound = dict(zip(_ARG_NAMES, args))
        for name in _ARG_NAMES:
            if name in kwargs:
                bound[name] = kwargs[name]
        extra = {k: v for k, v in kwargs.items() if k not in _ARG_NAMES}
        return cls(bound["q"], bound["k"], bound["v"], int(bound["heads"]), bound.get("mask"),
                   bool(bound.get("skip_reshape", False)), bool(bound.get("skip_output_reshape", False)), extra,
                   bound.get("attn_precision"))

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

    def output_shape(self) -> tuple:
        """The shape of the caller's output (what the compiled op's fake returns)."""
        if self.skip_reshape:
            b, h, n, d = self.q.shape
        else:
            b, n, hd = self.q.shape
            h, d = self.heads, hd // self.heads
        return (b, h, n, d) if self.skip_output_reshape else (b, n, h * d)


_Call = AttentionCall  # the name tests/attention_capture.py binds calls with


class VCAttentionOverride:
    """Installed as ``transformer_options["optimized_attention_override"]`` on a patched clone.

    Shared by every clone of the patched model (ComfyUI copies the options dict, not this object),
    so per-run state lives in ``begin_run``/``end_run``, called by the OUTER_SAMPLE wrapper.
    """

    def __init__(self, config: PatchConfig, model_sampling=None, node_id=None, inner=None):
        self.engine = AttentionEngine(config)
        self.config = config
        self.inner = inner  # an override that was installed before ours: pass-through calls go to it
        self.model_sampling = model_sampling  # fallback if a run starts without the wrapper
        self.node_id = node_id
        self.run: RunSchedule | None = None
        self._sigma_seen: tuple | None = None  # (sigmas tensor, its version, its value as a float)
        # How a compiled graph finds this override at run time: a graph input, not a constant.
        self.token = torch.tensor(next(_TOKENS), dtype=torch.int64)
        _OVERRIDES[int(self.token)] = self
        _register_comfy_funcs()

    # The engine's state, as tests and the node read it.
    report = property(lambda self: self.engine.report)
    last_report = property(lambda self: self.engine.last_report)
    runs = property(lambda self: self.engine.runs)
    plans = property(lambda self: self.engine.plans)

    # -- per-run state -------------------------------------------------------------------------

    def begin_run(self, sample_sigmas, model_sampling=None) -> None:
        """Reset plans and counters; fix this run's schedule (called before sampling)."""
        model_sampling = model_sampling if model_sampling is not None else self.model_sampling
        self.engine.start_run()
        self._sigma_seen = None
        self.run = RunSchedule.for_run(self.config.schedule, sample_sigmas, model_sampling)

    def end_run(self) -> RunReport:
        self.run = None
        return self.engine.finish_run()

    # -- the override --------------------------------------------------------------------------

    def __call__(self, func, *args, **kwargs):
        options = kwargs.get("transformer_options") or {}
        role = options.get(ROLE_KEY)
        if torch.compiler.is_compiling():
            if role is None:  # traced as ComfyUI's own attention (not counted: no Python state here)
                return self._default(func, args, kwargs)
            return _compiled_call(self, func, role, options, args, kwargs)
        if role is None:
            return self._pass(func, args, kwargs, "not self-attention")
        return self.handle(func, role, options, args, kwargs)

    def handle(self, func, role: AttentionRole, options: dict, args, kwargs):
        """One tagged call, eagerly (directly, or inside the compiled graph's op)."""
        reason = self.engine.reason_to_pass(role.index, role.total)
        if reason is not None:
            return self._pass(func, args, kwargs, reason)
        call = AttentionCall.bind(args, kwargs)
        reason = call.unsupported()
        if reason is not None:
            return self._pass(func, args, kwargs, reason)
        sigmas = options.get("sigmas")
        if sigmas is None:
            return self._pass(func, args, kwargs, "no sigma (not called by a sampler)")
        sigma = self._sigma(sigmas)
        if self.run is None:  # sampled without our OUTER_SAMPLE wrapper: use what the call carries
            self.begin_run(options.get("sample_sigmas", [sigma]))
        if self.run.keep_default(sigma):
            return self._pass(func, args, kwargs, "step kept on default attention")
        q, k, v, layout = call.tensors()
        out = self.engine.attention(role.layer, tuple(options.get("cond_or_uncond") or ()), q, k, v,
                                    layout=layout, step=self.run.step(sigma), in_window=self.run.in_window(sigma),
                                    key_bias=call.key_bias(), scale=call.extra.get("scale"), sigma=sigma)
        if isinstance(out, str):
            return self._pass(func, args, kwargs, out)
        return call.output(out, layout)

    def _sigma(self, sigmas: torch.Tensor) -> float:
        """The step's sigma as a number. ComfyUI hands every layer of one model call the same
        (GPU) tensor; reading it costs a host sync, so it is read once per tensor, not per layer."""
        version = None if sigmas.is_inference() else sigmas._version  # inference tensors keep no counter
        seen = self._sigma_seen
        if seen is not None and seen[0] is sigmas and seen[1] == version:
            return seen[2]
        sigma = float(sigmas.reshape(-1)[0])
        self._sigma_seen = (sigmas, version, sigma)  # holds the tensor: its id is not reused
        return sigma

    def _pass(self, func, args, kwargs, reason: str):
        self.engine.passed(reason)
        return self._default(func, args, kwargs)

    def _default(self, func, args, kwargs):
        if self.inner is not None:
            return self.inner(func, *args, **kwargs)
        return func(*args, **kwargs)


# -- torch.compile: one custom op per tagged call -----------------------------------------------

_TOKENS = itertools.count(1)
_OVERRIDES: "weakref.WeakValueDictionary[int, VCAttentionOverride]" = weakref.WeakValueDictionary()
_FUNCS: tuple = ()  # ComfyUI's attention backends (undecorated), by position: the op's func_id


def _register_comfy_funcs() -> None:
    """Every ``wrap_attn`` backend of comfy.ldm.modules.attention, undecorated (what ``func`` is)."""
    global _FUNCS
    try:
        import comfy.ldm.modules.attention as attention
    except ImportError:  # the library used without ComfyUI: no compiled calls to serve
        return
    found = [getattr(obj, "__wrapped__") for name, obj in vars(attention).items()
             if name.startswith("attention") and callable(getattr(obj, "__wrapped__", None))]
    funcs = _FUNCS + tuple(f for f in dict.fromkeys(found) if f not in _FUNCS)
    if funcs != _FUNCS:
        _FUNCS = funcs


def _func_id(func) -> int:
    for i, f in enumerate(_FUNCS):  # identity tests: constant-folded while tracing
        if f is func:
            return i
    return -1


def _compiled_call(override, func, role, options, args, kwargs):
    call = AttentionCall.bind(args, kwargs)
    func_id = _func_id(func)
    if func_id < 0 or any(key not in _OP_EXTRAS for key in call.extra) or override.inner is not None:
        # Not expressible as the op's arguments (another attention function, unknown keywords, an
        # override under ours that needs the real options): decided eagerly, at a graph break.
        return torch.compiler.disable(override.handle)(func, role, options, args, kwargs)
    sample_sigmas = options.get("sample_sigmas")
    return torch.ops.vc_attention_nodes.override_call(
        call.q, call.k, call.v, call.mask, options.get("sigmas"),
        sample_sigmas if isinstance(sample_sigmas, torch.Tensor) else None, override.token,
        role.family, role.layer, role.index, role.total, role.text_prefix,
        [int(c) for c in (options.get("cond_or_uncond") or ())], call.heads, call.skip_reshape,
        call.skip_output_reshape, call.attn_precision, call.extra.get("low_precision_attention", True) is not False,
        bool(call.extra.get("enable_gqa", False)), call.extra.get("scale"), func_id)


def _override_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   sigmas: torch.Tensor | None, sample_sigmas: torch.Tensor | None, token: torch.Tensor,
                   family: str, layer: str, index: int, total: int, text_prefix: bool,
                   cond_or_uncond: list[int], heads: int, skip_reshape: bool, skip_output_reshape: bool,
                   attn_precision: torch.dtype | None, low_precision_attention: bool, enable_gqa: bool,
                   scale: float | None, func_id: int) -> torch.Tensor:
    """The eager override, called from a compiled graph with the call rebuilt from plain values."""
    override = _OVERRIDES.get(int(token))
    if override is None:
        raise RuntimeError("VC-Attention: the compiled graph refers to a patch that no longer exists")
    role = AttentionRole(family, layer, index, total, text_prefix)
    options = {ROLE_KEY: role, "cond_or_uncond": list(cond_or_uncond)}
    if sigmas is not None:
        options["sigmas"] = sigmas
    if sample_sigmas is not None:
        options["sample_sigmas"] = sample_sigmas
    kwargs = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                  skip_output_reshape=skip_output_reshape, transformer_options=options, _inside_attn_wrapper=True)
    if not low_precision_attention:
        kwargs["low_precision_attention"] = False
    if enable_gqa:
        kwargs["enable_gqa"] = True
    if scale is not None:
        kwargs["scale"] = scale
    override.engine.report.compiled = True
    out = override.handle(_FUNCS[func_id], role, options, (q, k, v, heads), kwargs)
    return out.contiguous().clone() if out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()) else out.contiguous()


def _override_call_fake(q, k, v, mask, sigmas, sample_sigmas, token, family, layer, index, total, text_prefix,
                        cond_or_uncond, heads, skip_reshape, skip_output_reshape, attn_precision,
                        low_precision_attention, enable_gqa, scale, func_id):
    call = AttentionCall(q, k, v, heads, mask, skip_reshape, skip_output_reshape, {})
    return q.new_empty(call.output_shape())


def _register_op() -> None:
    """Registered once per process (a second import of this package reuses the first's op)."""
    if hasattr(torch.ops, "vc_attention_nodes") and hasattr(torch.ops.vc_attention_nodes, "override_call"):
        return
    op = torch.library.custom_op("vc_attention_nodes::override_call", mutates_args=())(_override_call)
    op.register_fake(_override_call_fake)


_register_op()
