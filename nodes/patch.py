"""The VC-Attention patch node: MODEL -> MODEL with the attention override installed on a clone."""

from __future__ import annotations

import logging
import os

import torch
from comfy_api.latest import io

from .config import BACKENDS, ENV_BACKEND, PV_FORMATS, resolve_config
from .engine import precheck
from .history import ReportChannel
from .override import VCAttentionOverride
from .roles import detect_roles, install_roles

log = logging.getLogger("vc_attention")

WRAPPER_KEY = "vc_attention"
OVERRIDE_KEY = "optimized_attention_override"


class RunWrapper:
    """OUTER_SAMPLE wrapper: fresh plans for every sampling run, report published after it."""

    def __init__(self, override: VCAttentionOverride, channel: ReportChannel):
        self.override = override
        self.channel = channel

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
            self.channel.publish(self.override.end_run())


def attention_dtype(model) -> torch.dtype:
    base = model.model
    return getattr(base, "manual_cast_dtype", None) or model.model_dtype() or torch.bfloat16


def method_inputs(fallback: str = "ComfyUI's attention",
                  window_basis: str = "the denoising schedule (from sigmas, the model's percent_to_sigma)",
                  steps: str = "sampler steps") -> list:
    """The method's inputs, shared by every VC-Attention patch node (core models, WanVideoWrapper):
    bits, schedule, clusters, ExpCast, the layers and steps kept on default attention, backend, P.V
    format (last: saved workflows hold the widget values in this order)."""
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
        # optional: API prompts and workflows saved before this input existed stay valid
        io.Combo.Input("pv_format", options=list(PV_FORMATS), default="auto", advanced=True, optional=True,
                       tooltip="8-bit only. auto: int8 where the GPU's kernel has it (RTX 4090 / 5090 / "
                               "PRO 6000), else fp8. fp8: V residual and P in FP8 (every GPU; slightly "
                               "faster). int8: V residual in INT8 per 128-token block and P in INT8 per "
                               "128 keys, much closer to the BF16 render (the RTX kernel; elsewhere fp8, "
                               "said in the report)."),
    ]


def patch_schema(node_id: str, display_name: str, description: str, model_input, model_output,
                 **method_texts) -> io.Schema:
    """The schema of a patch node: its model input and output around the method's inputs."""
    return io.Schema(
        node_id=node_id,
        display_name=display_name,
        category="VC-Attention",
        description=description,
        inputs=[model_input, *method_inputs(**method_texts)],
        outputs=[model_output],
        hidden=[io.Hidden.unique_id],
        # Its UI output (the record that sampling runs append their reports to, history.py) is
        # put into every prompt's history, also when the node itself comes from the cache.
        has_intermediate_output=True,
    )


class PatchNode(io.ComfyNode):
    """What the two patch nodes share: the method inputs resolved to a PatchConfig, then patch()."""

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        # The environment variable changes what the node does: re-run it when it changes.
        return os.environ.get(ENV_BACKEND, "")

    @classmethod
    def execute(cls, model, bits="8", grouping_window=0.25, refresh_every=4, clusters=64, expcast="auto",
                bf16_first_blocks=0, bf16_last_blocks=0, bf16_until=0.0, backend="auto",
                pv_format="auto") -> io.NodeOutput:
        config = resolve_config(bits, grouping_window, refresh_every, clusters, expcast, bf16_first_blocks,
                                bf16_last_blocks, bf16_until, backend, pv_format)
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        return cls.patch(model, config, node_id)

    @classmethod
    def patch(cls, model, config, node_id) -> io.NodeOutput:
        raise NotImplementedError


class VCAttentionPatch(PatchNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return patch_schema(
            "VCAttentionPatch", "VC-Attention Patch",
            "Low-bit attention for video diffusion transformers (V-Smooth + ExpCast-FP8) on the "
            "self-attention of Wan 2.1/2.2 and HunyuanVideo 1.0/1.5. Clones the model; the input "
            "model is unchanged. Put it between the model loader and the sampler.",
            io.Model.Input("model", tooltip="The diffusion model to patch (Wan 2.1/2.2, HunyuanVideo 1.5)."),
            io.Model.Output(tooltip="A patched clone of the input model."))

    @classmethod
    def patch(cls, model, config, node_id) -> io.NodeOutput:
        patched = model.clone()
        roles = detect_roles(patched)
        if not roles.supported:
            log.warning("VC-Attention: %s", roles.note)
            return io.NodeOutput(patched, ui=ReportChannel(None, roles.note).ui(f"VC-Attention: {roles.note}"))

        import comfy.model_management as mm

        config, status = precheck(config, mm.get_torch_device(), attention_dtype(patched), roles.head_dim)
        text = f"VC-Attention: {roles.note}\n{status}"
        channel = ReportChannel(node_id, text)
        options = patched.model_options.setdefault("transformer_options", {})
        previous = options.get(OVERRIDE_KEY)
        if isinstance(previous, VCAttentionOverride):
            previous = previous.inner  # re-patching: replace ours, keep what was under it
        override = VCAttentionOverride(config, patched.get_model_object("model_sampling"), node_id, inner=previous)
        install_roles(patched, roles)
        options[OVERRIDE_KEY] = override
        patched.remove_wrappers_with_key("outer_sample", WRAPPER_KEY)
        import comfy.patcher_extension as pe

        patched.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, RunWrapper(override, channel))
        log.info("%s", text.replace("\n", "; "))
        return io.NodeOutput(patched, ui=channel.ui(text))
