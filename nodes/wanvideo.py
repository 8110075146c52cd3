"""VC-Attention for models loaded by the WanVideoWrapper custom nodes (LongCat-Video first).

LongCat-Video is not in ComfyUI core; users run it through kijai/ComfyUI-WanVideoWrapper, whose
attention goes through its own dispatcher (``wanvideo/modules/attention.py``:
``attention(q, k, v, ..., k_lens=..., attention_mode=..., transformer_options=..., heads=...)``,
NHD layout ``[B, N, H, D]``), which core's ``optimized_attention_override`` never reaches. Read from
the pack's source at upstream commit 60a3875 (2026-02-01).

How the patch is applied, and removed (no lasting change anywhere):

- The node clones the WANVIDEOMODEL patcher (the input model is untouched) and puts a
  :class:`WanVideoPatchSpec` into the clone's ``model_options["transformer_options"]``.
- The pack's sampler deep-copies ``transformer_options`` at the start of every run
  (``nodes_sampler.py``: ``copy.deepcopy(patcher.model_options["transformer_options"])``) and hands
  that copy to every model call. The spec's ``__deepcopy__`` is that start-of-run moment: it returns a
  fresh :class:`WanVideoRun` (per-run plans and report), which installs itself on *this* model
  instance only: an instance attribute ``forward`` on each ``blocks[i].self_attn`` (the pack's own
  ``WanSelfAttention.forward`` code, run with a globals dict in which ``attention`` is our per-block
  dispatcher; the pack's module is not modified) and a forward pre-hook on the diffusion model that
  reads the pack's step information (``current_step``, ``current_step_percentage``, ``is_uncond``).
- When the run's copy of ``transformer_options`` is released (end of the sampler node), a
  ``weakref.finalize`` removes both: ``self_attn.forward`` is the class method again, the hook is
  gone. A run still installed when another run (or an unpatched model call) reaches the same model is
  removed then. The installed code refers to the run weakly and only acts on calls whose
  ``transformer_options`` carry that very run; any other call goes to the pack's dispatcher.
- Bypassing the node leaves no spec in the options: nothing is ever installed.

Roles (which calls run VC-Attention):

- Only ``WanSelfAttention.forward`` is routed, and only its calls that carry ``transformer_options``:
  the block's self-attention. Cross-attention (text, CLIP, audio), the Stand-In KV-cache path, the
  radial / block-sparse paths, multitalk and the split path call the dispatcher without
  ``transformer_options`` or through other modules: they always pass through.
- LongCat with condition frames: the block calls self-attention twice (three to five times for video
  continuation): noise queries over *all* keys, and condition (reference) queries over the condition
  keys only. A joint K/V permutation plan is made for the whole sequence's V, so a call is routed
  only when its key set is the whole sequence (``k.shape[1] == k_lens``, the pack's ``seq_lens``):
  the noise-query call (q shorter than k is fine) and the plain T2V call. Calls over a key subset
  (condition / reference tokens, the avatar masked-reference range) and padded sequences pass
  through to the pack's dispatcher with the user's attention mode.
- Modes with their own semantics (``sageattn_ultravico``, ``radial_sage_attention``), causal calls,
  masks, q_lens, dropout, windows, explicit scales: pass through.

Step schedule: the pack's own ``current_step`` and ``current_step_percentage`` (= step /
number of the run's timesteps), with the core node's grouping window and refresh interval: a block
groups on its first call, re-groups inside the window (``step / steps < grouping_window``) on the
first call at least ``refresh_every`` steps after its last grouping, and reuses its plan after the
window (40 steps, window 0.25, refresh 4: steps 0, 4, 8, as for the core node). ``bf16_until``:
steps with ``step / steps < bf16_until`` keep the pack's attention. Plans are per block,
cond/uncond pass and shape.
"""

from __future__ import annotations

import logging
import sys
import types
import weakref
from dataclasses import dataclass, field

import torch
from comfy_api.latest import io

from .config import PatchConfig, resolve_config
from .engine import AttentionEngine, RunReport, precheck
from .history import ReportChannel
from .patch import PatchNode, patch_schema
from .schedule import FractionSchedule

log = logging.getLogger("vc_attention")

PACK = "kijai/ComfyUI-WanVideoWrapper"
MODEL_TYPE = "WANVIDEOMODEL"
SPEC_KEY = "vc_attention_wanvideo"  # transformer_options key of the spec (then of the run's copy)
DISPATCHER_NAME = "attention"  # the global name WanSelfAttention.forward calls
PASS_MODES = ("sageattn_ultravico", "radial_sage_attention")


def pack_loaded() -> str | None:
    """The module name of WanVideoWrapper's model module if the pack is imported, else None."""
    for name, module in list(sys.modules.items()):
        if name.endswith("wanvideo.modules.model") and hasattr(module, "WanSelfAttention"):
            return name
    return None


class WanVideoPatchError(RuntimeError):
    pass


def diffusion_model_of(model):
    """The WanModel inside a WANVIDEOMODEL patcher; a clear error naming what is missing otherwise."""
    inner = getattr(model, "model", None)
    dm = getattr(inner, "diffusion_model", None)
    blocks = getattr(dm, "blocks", None)
    ok = blocks is not None and len(blocks) > 0 and all(
        DISPATCHER_NAME in getattr(getattr(type(getattr(b, "self_attn", None)), "forward", None),
                                   "__globals__", {}) for b in blocks)
    if ok:
        return dm
    if pack_loaded() is None:
        raise WanVideoPatchError(
            f"VC-Attention (WanVideoWrapper) needs the WanVideoWrapper custom nodes ({PACK}), which are "
            "not installed or failed to load: install them into ComfyUI's custom_nodes folder, load the "
            "model with 'WanVideo Model Loader' and connect its WANVIDEOMODEL output here. For models "
            "loaded by ComfyUI's own loaders use 'VC-Attention Patch'.")
    raise WanVideoPatchError(
        f"VC-Attention (WanVideoWrapper): the input is not a WanVideoWrapper model (got "
        f"{type(model).__name__} wrapping {type(dm).__name__}); connect the WANVIDEOMODEL output of "
        "'WanVideo Model Loader' (or of a node after it).")


def describe(dm) -> str:
    kind = "LongCat-Video" if getattr(dm, "is_longcat", False) else f"WanVideoWrapper {type(dm).__name__}"
    blocks = len(dm.blocks)
    return (f"{kind} ({blocks} self-attention layers; noise/plain self-attention over the whole "
            "sequence runs VC-Attention; condition-token, cross-attention, KV-cache and sparse paths "
            "pass through)")


# -- the spec (in the patched clone's options) and the run (in the sampler's deep copy) ------------

class WanVideoPatchSpec:
    """What the node puts into ``transformer_options``; its deep copy is a new :class:`WanVideoRun`."""

    def __init__(self, config: PatchConfig, diffusion_model, node_id=None, channel: ReportChannel | None = None):
        self.config = config
        self.model_ref = weakref.ref(diffusion_model)
        self.node_id = node_id
        self.channel = channel  # where each run's report goes (the node's UI output, the badge)
        self.last_report: RunReport | None = None
        self.runs = 0

    def __deepcopy__(self, memo):
        run = WanVideoRun(self)
        memo[id(self)] = run
        model = self.model_ref()
        if model is not None:
            run.install(model)
        return run


@dataclass
class _Installed:
    """What one run changed on one model instance. Holds no reference to the run (the run's
    finalizer removes it), only what is reported when it goes."""

    model_ref: weakref.ref
    spec_ref: weakref.ref
    report: RunReport
    channel: ReportChannel | None = None
    hook: object = None  # RemovableHandle of the forward pre-hook
    modules: list = field(default_factory=list)  # (self_attn module, the forward we set on it)
    released: bool = False


# One live installation per model instance (id -> installation); a new run replaces an old one.
_INSTALLED: dict[int, _Installed] = {}


def _release(inst: _Installed) -> None:
    """Undo one installation: the hook removed, ``self_attn.forward`` the class method again."""
    if inst.released:
        return
    inst.released = True
    if inst.hook is not None:
        inst.hook.remove()
    for module, fn in inst.modules:
        if module.__dict__.get("forward") is fn:
            del module.__dict__["forward"]
    model = inst.model_ref()
    if model is not None and _INSTALLED.get(id(model)) is inst:
        del _INSTALLED[id(model)]
    spec = inst.spec_ref()
    if spec is not None:
        spec.last_report = inst.report
    if inst.channel is not None and (inst.report.patched or inst.report.passed):
        inst.channel.publish(inst.report)


def installed_runs() -> int:
    """How many runs are installed on a model right now (0 outside a sampler run)."""
    return sum(not inst.released for inst in _INSTALLED.values())


def uninstall_all() -> int:
    """Remove every live installation (tests, scripts); returns how many were removed."""
    live = [inst for inst in _INSTALLED.values() if not inst.released]
    for inst in live:
        _release(inst)
    _INSTALLED.clear()
    return len(live)


def _routed_forward(cls_forward, dispatch):
    """The pack's own ``forward`` code with ``attention`` resolved to ``dispatch`` (module untouched)."""
    g = dict(cls_forward.__globals__)
    g[DISPATCHER_NAME] = dispatch
    fn = types.FunctionType(cls_forward.__code__, g, cls_forward.__name__, cls_forward.__defaults__,
                            cls_forward.__closure__)
    fn.__kwdefaults__ = cls_forward.__kwdefaults__
    fn.__qualname__ = cls_forward.__qualname__
    fn.__wrapped__ = cls_forward
    return fn


class WanVideoRun:
    """Per-run state: the plans, the pack's step info of the current model call, the report."""

    def __init__(self, spec: WanVideoPatchSpec):
        self.spec_ref = weakref.ref(spec)
        self.config = spec.config
        self.channel = spec.channel
        spec.runs += 1
        self.engine = AttentionEngine(spec.config)  # backend and bits, plans, the kernel call, the report
        self.engine.start_run()
        self.report = self.engine.report
        self.schedule = FractionSchedule(spec.config.schedule)
        self.step = 0
        self.fraction = 0.0  # current_step_percentage
        self.uncond = False
        self.steps_seen: set = set()
        self.total_blocks = 0
        self.installed: _Installed | None = None

    def __deepcopy__(self, memo):  # a copy of a copy is the same run
        memo[id(self)] = self
        return self

    # -- install / remove --------------------------------------------------------------------------

    def install(self, model) -> None:
        old = _INSTALLED.get(id(model))
        if old is not None:
            _release(old)  # a previous run still alive (an exception kept it): it is over now
        inst = _Installed(weakref.ref(model), self.spec_ref, self.report, self.channel)
        me = weakref.ref(self)
        self.total_blocks = len(model.blocks)
        for i, block in enumerate(model.blocks):
            module = block.self_attn
            cls_forward = type(module).forward
            if "forward" in module.__dict__ or DISPATCHER_NAME not in cls_forward.__code__.co_names:
                self.report.note(f"block {i}: self_attn.forward already replaced by something else; left alone")
                continue
            original = cls_forward.__globals__[DISPATCHER_NAME]
            fn = types.MethodType(_routed_forward(cls_forward, _make_dispatch(me, i, original)), module)
            module.__dict__["forward"] = fn
            inst.modules.append((module, fn))

        def pre_hook(mod, args, kwargs):
            # Model calls without this run's options (the pack's Lynx reference pass, another model's
            # run) change nothing here: the dispatchers pass them through.
            run = me()
            options = kwargs.get("transformer_options")
            if run is not None and isinstance(options, dict) and options.get(SPEC_KEY) is run:
                run.begin_call(kwargs)

        inst.hook = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        _INSTALLED[id(model)] = inst
        self.installed = inst
        weakref.finalize(self, _release, inst)

    def release(self) -> None:
        if self.installed is not None:
            _release(self.installed)

    # -- the pack's step information ---------------------------------------------------------------

    def begin_call(self, kwargs) -> None:
        step = kwargs.get("current_step", 0)
        self.step = int(step.item() if isinstance(step, torch.Tensor) else step)
        self.fraction = float(kwargs.get("current_step_percentage", 0.0) or 0.0)
        self.uncond = bool(kwargs.get("is_uncond", False))
        self.steps_seen.add(self.step)

    def in_window(self) -> bool:
        return self.schedule.in_window(self.step, self.fraction)

    def keep_default(self) -> bool:
        return self.schedule.keep_default(self.fraction)

    # -- one attention call ------------------------------------------------------------------------

    @staticmethod
    def bind(q, k, v, args, kwargs) -> dict | None:
        """The call's options by name (the pack's self-attention passes everything after q, k, v as
        keywords); None when options come positionally (left to the pack)."""
        if args:
            return None
        return dict(kwargs, q=q, k=k, v=v)

    def reason_to_pass(self, block: int, a: dict) -> str | None:
        reason = self.engine.reason_to_pass(block, self.total_blocks)
        if reason is not None:
            return reason
        if self.keep_default():
            return "step kept on default attention"
        mode = a.get("attention_mode", "sdpa")
        if mode in PASS_MODES:
            return f"attention mode {mode}"
        if a.get("causal") or a.get("attn_mask") is not None or a.get("q_lens") is not None:
            return "causal / masked / varlen call"
        if a.get("dropout_p") or tuple(a.get("window_size") or (-1, -1)) != (-1, -1):
            return "dropout or window"
        if a.get("softmax_scale") is not None or a.get("q_scale") is not None:
            return "explicit scale"
        q, k, v = a["q"], a["k"], a["v"]
        if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
            return "q/k/v shapes not [B, N, H, D] of one attention"
        if not (q.dtype == k.dtype == v.dtype):
            return "q/k/v dtypes differ"
        k_lens = a.get("k_lens")
        if k_lens is None:
            return "no sequence length (role unknown)"
        lens = k_lens.tolist() if isinstance(k_lens, torch.Tensor) else list(k_lens)
        if any(int(n) != k.shape[1] for n in lens):
            return "keys are a subset of the sequence (condition/reference tokens) or padded"
        return None

    def attention(self, block: int, original, q, k, v, args, kwargs):
        a = self.bind(q, k, v, args, kwargs)
        reason = "positional options" if a is None else self.reason_to_pass(block, a)
        if reason is None:
            out = self.engine.attention(f"blocks.{block}.self_attn", self.uncond, q, k, v, layout="NHD",
                                        step=self.step, in_window=self.in_window())
            if not isinstance(out, str):
                return out
            reason = out
        self.engine.passed(reason)
        return original(q, k, v, *args, **kwargs)


def _make_dispatch(run_ref, block: int, original):
    """The ``attention`` a routed ``self_attn.forward`` sees: VC for this run's calls, else the pack's."""

    @torch.compiler.disable
    def dispatch(q, k, v, *args, **kwargs):
        run = run_ref()
        options = kwargs.get("transformer_options")
        if run is None or not isinstance(options, dict) or options.get(SPEC_KEY) is not run:
            return original(q, k, v, *args, **kwargs)
        return run.attention(block, original, q, k, v, args, kwargs)

    dispatch.vc_original = original
    return dispatch


def patch_wanvideo_model(model, config: PatchConfig, node_id=None, channel: ReportChannel | None = None):
    """A clone of the WANVIDEOMODEL patcher ``model`` with VC-Attention applied; (clone, spec, status)."""
    dm = diffusion_model_of(model)
    patched = model.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    spec = WanVideoPatchSpec(config, dm, node_id, channel)
    options[SPEC_KEY] = spec
    return patched, spec


class VCAttentionWanVideoPatch(PatchNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return patch_schema(
            "VCAttentionWanVideoPatch", "VC-Attention (WanVideoWrapper)",
            "VC-Attention for models loaded by the WanVideoWrapper nodes (kijai/ComfyUI-WanVideoWrapper), "
            "made for LongCat-Video: the self-attention over the whole sequence runs low-bit; condition "
            "tokens, cross-attention, KV-cache and sparse paths keep the pack's attention mode. Clones "
            "the model; installed on the model only while a sampler runs it. Needs WanVideoWrapper.",
            io.Custom(MODEL_TYPE).Input("model", tooltip="The WANVIDEOMODEL from 'WanVideo Model Loader'."),
            io.Custom(MODEL_TYPE).Output(display_name="model", tooltip="A patched clone of the input model."),
            fallback="the pack's attention",
            window_basis="the sampler's steps (the pack's current step / steps)",
            steps="steps")

    @classmethod
    def patch(cls, model, config, node_id) -> io.NodeOutput:
        dm = diffusion_model_of(model)
        import comfy.model_management as mm

        head_dim = int(getattr(dm.blocks[0].self_attn, "head_dim", 128))
        dtype = getattr(dm, "base_dtype", None) or torch.bfloat16  # the dtype the pack's attention runs in
        config, status = precheck(config, mm.get_torch_device(), dtype, head_dim)
        text = f"VC-Attention: {describe(dm)}\n{status}"
        channel = ReportChannel(node_id, text)
        patched, _ = patch_wanvideo_model(model, config, node_id, channel)
        log.info("%s", text.replace("\n", "; "))
        return io.NodeOutput(patched, ui=channel.ui(text))


__all__ = ["VCAttentionWanVideoPatch", "WanVideoPatchSpec", "WanVideoRun", "patch_wanvideo_model",
           "resolve_config", "uninstall_all", "pack_loaded", "SPEC_KEY", "installed_runs"]
