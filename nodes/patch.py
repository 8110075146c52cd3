"""The VC-Attention patch node: MODEL -> MODEL with the attention override installed on a clone."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch
from comfy_api.latest import io, ui

from .override import PatchConfig, VCAttentionOverride, safe_explain
from .roles import detect_roles, install_roles
from .schedule import ScheduleConfig

log = logging.getLogger("vc_attention")

ENV_BACKEND = "VC_ATTENTION_BACKEND"
BACKENDS = ("auto", "gluon", "precompiled", "triton", "reference", "exact")
WRAPPER_KEY = "vc_attention"
OVERRIDE_KEY = "optimized_attention_override"


def resolve_config(bits, grouping_window, refresh_every, clusters, expcast, bf16_first_blocks,
                   bf16_last_blocks, bf16_until, backend) -> PatchConfig:
    """The node's inputs as a PatchConfig; ``VC_ATTENTION_BACKEND`` overrides ``backend``.

    Backend "exact" is a validation mode: the reference backend with no quantisation (bits 16:
    permutation and demeaning only), which must reproduce default attention to float tolerance.
    """
    env = os.environ.get(ENV_BACKEND, "").strip().lower()
    if env:
        if env not in BACKENDS:
            raise ValueError(f"{ENV_BACKEND}={env!r} is not one of {', '.join(BACKENDS)}")
        backend = env
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if bits not in ("8", "4", "off"):
        raise ValueError(f"bits must be '8', '4' or 'off', got {bits!r}")
    nbits = None if bits == "off" else int(bits)
    if backend == "exact" and nbits is not None:
        nbits, backend = 16, "reference"
    return PatchConfig(
        bits=nbits,
        backend=backend,
        expcast={"auto": None, "on": True, "off": False}[expcast],
        clusters=int(clusters),
        schedule=ScheduleConfig(float(grouping_window), int(refresh_every), float(bf16_until)),
        bf16_first_blocks=int(bf16_first_blocks),
        bf16_last_blocks=int(bf16_last_blocks),
    )


class RunWrapper:
    """OUTER_SAMPLE wrapper: fresh plans for every sampling run, report shown after it."""

    def __init__(self, override: VCAttentionOverride):
        self.override = override

    def __call__(self, executor, *args, **kwargs):
        guider = executor.class_obj  # CFGGuider; outer_sample(noise, latent, sampler, sigmas, ...)
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        # The model that samples may be a later clone (e.g. ModelSamplingSD3 after this node): its
        # model_sampling defines the schedule.
        model_sampling = guider.model_patcher.get_model_object("model_sampling")
        self.override.begin_run(sigmas, model_sampling)
        try:
            return executor(*args, **kwargs)
        finally:
            report = self.override.end_run()
            show_text(report.text(), self.override.node_id)


def show_text(text: str, node_id) -> None:
    """Progress text on the node in the front end (a no-op without a server, e.g. in scripts)."""
    log.info("%s", text)
    if node_id is None:
        return
    try:
        from server import PromptServer
    except ImportError:
        return
    server = getattr(PromptServer, "instance", None)
    if server is not None:
        server.send_progress_text(text, str(node_id))


def _attention_dtype(model) -> torch.dtype:
    base = model.model
    return getattr(base, "manual_cast_dtype", None) or model.model_dtype() or torch.bfloat16


def precheck(model, roles, config: PatchConfig) -> tuple[PatchConfig, str]:
    """Ask the library, on a small tensor shaped like this model's heads, whether a VC backend runs.

    Returns the (possibly adjusted: 4 -> 8 bits) config and a line for the node.
    """
    if config.bits is None:
        return config, "bits off: every call keeps ComfyUI's attention (hooks installed, nothing quantised)"
    import comfy.model_management as mm

    device = mm.get_torch_device()
    dtype = _attention_dtype(model)
    x = torch.zeros(1, 1, 256, roles.head_dim, device=device, dtype=dtype)

    def ask(bits):
        return safe_explain(x, x, x, bits=bits, v_smooth=True, expcast=config.expcast, layout="HND",
                            backend=config.backend)

    decision = ask(config.bits)
    if config.bits == 4 and not decision.low_bit:
        eight = ask(8)
        if eight.low_bit:
            config = replace(config, bits=8)
            return config, f"4-bit unavailable ({decision}); using 8-bit on {eight.backend}"
    mode = "exact (no quantisation)" if config.bits == 16 else f"{config.bits}-bit"
    if not decision.low_bit:
        return config, (f"no low-bit backend on {device} for {dtype}: {decision}. "
                        "ComfyUI's attention is used for every call")
    refused = "".join(f"; {name} refused: {why}" for name, why in decision.reasons.items())
    return config, f"{mode} on {decision.backend} ({device}, {dtype}){refused}"


def method_inputs(fallback: str = "ComfyUI's attention",
                  window_basis: str = "the denoising schedule (from sigmas, the model's percent_to_sigma)",
                  steps: str = "sampler steps") -> list:
    """The method's inputs, shared by every VC-Attention patch node (core models, WanVideoWrapper):
    bits, schedule, clusters, ExpCast, the layers and steps kept on default attention, backend."""
    return [
        io.Combo.Input("bits", options=["8", "4", "off"], default="8",
                       tooltip="8: INT8 Q/K, FP8 V residual and P. 4: NVFP4 (falls back to 8 where "
                               f"no 4-bit kernel runs). off: {fallback} everywhere."),
        io.Float.Input("grouping_window", default=0.25, min=0.0, max=1.0, step=0.05,
                       tooltip=f"Fraction of {window_basis} in which V tokens are re-grouped by "
                               "k-means. After it the last permutation is reused."),
        io.Int.Input("refresh_every", default=4, min=1, max=1000,
                     tooltip=f"Inside the grouping window, re-group every this many {steps} "
                             "(40 steps, window 0.25, refresh 4: steps 0, 4, 8)."),
        io.Int.Input("clusters", default=64, min=2, max=1024, advanced=True,
                     tooltip="k-means clusters per head for V-Smooth's token grouping."),
        io.Combo.Input("expcast", options=["auto", "on", "off"], default="auto", advanced=True,
                       tooltip="ExpCast-FP8 (write P's FP8 byte straight from the log score). "
                               "auto: on for Hopper/Blackwell, off elsewhere."),
        io.Int.Input("bf16_first_blocks", default=0, min=0, max=200, advanced=True,
                     tooltip=f"Keep this many first self-attention blocks on {fallback}."),
        io.Int.Input("bf16_last_blocks", default=0, min=0, max=200, advanced=True,
                     tooltip=f"Keep this many last self-attention blocks on {fallback}."),
        io.Float.Input("bf16_until", default=0.0, min=0.0, max=1.0, step=0.05, advanced=True,
                       tooltip=f"Keep {fallback} for this first fraction of the schedule (measured like "
                               "the grouping window). 0: never."),
        io.Combo.Input("backend", options=list(BACKENDS), default="auto", advanced=True,
                       tooltip="auto: fastest kernel that fits this GPU (the Hopper Gluon kernel on "
                               "H100/H200, then precompiled cubins, then Triton). gluon / precompiled / "
                               "triton / reference: force one (reference is slow, "
                               "readable PyTorch). exact: reference without quantisation, for "
                               f"validation. The environment variable {ENV_BACKEND} overrides this."),
    ]


class VCAttentionPatch(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="VCAttentionPatch",
            display_name="VC-Attention Patch",
            category="VC-Attention",
            description=(
                "Low-bit attention for video diffusion transformers (V-Smooth + ExpCast-FP8) on the "
                "self-attention of Wan 2.1/2.2 and HunyuanVideo 1.0/1.5. Clones the model; the input "
                "model is unchanged. Put it between the model loader and the sampler."),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to patch (Wan 2.1/2.2, HunyuanVideo 1.5)."),
                *method_inputs(),
            ],
            outputs=[io.Model.Output(tooltip="A patched clone of the input model.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        # The environment variable changes what the node does: re-run it when it changes.
        return os.environ.get(ENV_BACKEND, "")

    @classmethod
    def execute(cls, model, bits="8", grouping_window=0.25, refresh_every=4, clusters=64, expcast="auto",
                bf16_first_blocks=0, bf16_last_blocks=0, bf16_until=0.0, backend="auto") -> io.NodeOutput:
        config = resolve_config(bits, grouping_window, refresh_every, clusters, expcast, bf16_first_blocks,
                                bf16_last_blocks, bf16_until, backend)
        patched = model.clone()
        roles = detect_roles(patched)
        if not roles.supported:
            log.warning("VC-Attention: %s", roles.note)
            return io.NodeOutput(patched, ui=ui.PreviewText(f"VC-Attention: {roles.note}"))

        config, status = precheck(patched, roles, config)
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        options = patched.model_options.setdefault("transformer_options", {})
        previous = options.get(OVERRIDE_KEY)
        if isinstance(previous, VCAttentionOverride):
            previous = previous.inner  # re-patching: replace ours, keep what was under it
        override = VCAttentionOverride(config, patched.get_model_object("model_sampling"), node_id, inner=previous)
        install_roles(patched, roles)
        options[OVERRIDE_KEY] = override
        patched.remove_wrappers_with_key("outer_sample", WRAPPER_KEY)
        import comfy.patcher_extension as pe

        patched.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, RunWrapper(override))
        text = f"VC-Attention: {roles.note}\n{status}"
        log.info("%s", text.replace("\n", "; "))
        return io.NodeOutput(patched, ui=ui.PreviewText(text))
