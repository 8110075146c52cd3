"""End to end in real ComfyUI: the sampler on the real transformers, patched against unpatched.

Inside a real ComfyUI (``--comfyui`` or ``COMFYUI_PATH``) this script builds Wan2.2-14B (one expert),
Wan2.2-TI2V-5B and HunyuanVideo-1.5 at their released configuration from ComfyUI's own classes,
with random weights, and samples each with ComfyUI's own sampler at 720p and 480p, with CFG, the
sampler and the shift of the official templates:

- ``default``: ComfyUI's attention (what a user gets without this pack);
- ``vc8``: the VCAttentionPatch node (bits 8), executed as ComfyUI executes a V3 node;
- ``fa4``: FlashAttention-4 installed as the attention override (when ``flash_attn.cute`` imports),
  an override object like the node's that calls ``flash_attn.cute.interface.flash_attn_func`` for
  every call whose q, k and v share one shape and carry no mask (the self-attention calls of these
  models; cross-attention keeps ComfyUI's attention, as it does under ``vc8``).

The graph is the templates' graph called node by node (``nodes.common_ksampler`` behind KSampler):
model -> [VCAttentionPatch] -> ModelSamplingSD3(shift) -> KSampler(latent from the family's empty
latent node, stand-in conditioning). Transformer, sampler, CFG and the latent nodes are ComfyUI's;
the conditioning is random (no text encoder) and no VAE runs.

How the model is built, and how that differs from UNETLoader: UNETLoader reads a checkpoint, lets
``comfy.model_detection`` turn its key shapes into a model config, has ``model_config.get_model``
build the ``model_base`` object and loads the weights into it, then wraps it in a ``ModelPatcher``.
Here the checkpoint's keys and shapes come from the same ComfyUI class instantiated on the "meta"
device (no memory); ComfyUI's detection turns them into the model config (the script checks that
it picks the supported-model class the real checkpoint gets); ``get_model`` builds the model
directly on the GPU in bf16; the weights are filled in place with random values instead of being
read from a file (nothing is written to disk); the ModelPatcher gets the GPU as its offload device
too, so that dropping a 28 GB model between configurations does not copy it to host memory. The
sampler then loads it through ComfyUI's model management as it would a loaded checkpoint.

Per configuration it reports seconds per step (grouping and reuse steps apart, the step kind read
from the patch node's run report), the whole KSampler call, peak GPU memory, the attention share of
a step (CUDA events around every attention call), and the final latent's relative L2 difference
against the default run: with random weights this measures the perturbation the low-bit attention
causes, not image quality. It writes a CSV and a JSON (card, date, command, commit) and prints a
table last. ``--trace`` profiles one more patched run with torch.profiler and prints, per step, what
the pack adds around the kernel (time in the override outside the kernel, copies, dtype casts,
host syncs), attributed to the pack's functions.

CPU check (tiny models, the readable reference backend; the times mean nothing):

    COMFYUI_PATH=... python benchmarks/comfyui_e2e.py --tiny --device cpu --trace

The H200 commands are in run_on_h200.md.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime as dt
import gc
import importlib
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

REPO = pathlib.Path(__file__).resolve().parents[1]
OVERRIDE_KEY = "optimized_attention_override"
WRAPPER_KEY = "vc_e2e"
PERTURBATION_NOTE = ("rel_l2_vs_default: random weights, so this is the perturbation of the final latent "
                     "caused by the attention change, not a quality measure")
DERIVED_NOTE = ("grouping_extra_share_20/40_derived: predicted from this run's measured cold / warm / reuse step "
                "times for the node's default schedule (window 0.25, refresh 4: 20 steps group at 0 and 4, 40 steps "
                "at 0, 4, 8); speedup_step_*: mean reuse step of this variant against the mean plain step of the other")


# -- the models: released configurations, as ComfyUI's classes take them -------------------------

@dataclass(frozen=True)
class Size:
    width: int
    height: int
    frames: int


@dataclass(frozen=True)
class ModelSpec:
    """One architecture: its ComfyUI class and arguments, the supported-model class ComfyUI's
    detection must pick for it, the template's sampling settings and the sizes to run."""

    name: str
    family: str  # "wan" | "hunyuan_video"
    kwargs: dict
    detected_as: str
    latent_node: str
    sampler: str
    scheduler: str
    cfg: float
    shift: float
    text_tokens: int
    sizes: dict
    template: str

    @property
    def heads(self) -> int:
        return self.kwargs["num_heads"]


WAN = dict(model_type="t2v", patch_size=(1, 2, 2), freq_dim=256, text_dim=4096, window_size=(-1, -1),
           qk_norm=True, cross_attn_norm=True, eps=1e-6)
HUNYUAN15 = dict(image_model="hunyuan_video", in_channels=65, out_channels=32, vec_in_dim=None,
                 context_in_dim=3584, mlp_ratio=4.0, axes_dim=[16, 56, 56], theta=256, patch_size=[1, 1, 1],
                 qkv_bias=True, guidance_embed=False, byt5=True, meanflow=False, use_cond_type_embedding=True,
                 vision_in_dim=1152, meanflow_sum=True)

MODELS = {
    # Wan2.2 T2V A14B, one expert (high and low noise share this architecture); loads as WAN21_T2V.
    # Template video_wan2_2_14B_t2v (no LoRA branch): euler / simple, CFG 3.5, shift 5.
    "wan22-14b": ModelSpec(
        "wan22-14b", "wan", dict(WAN, in_dim=16, dim=5120, ffn_dim=13824, out_dim=16, num_heads=40, num_layers=40),
        "WAN21_T2V", "EmptyHunyuanLatentVideo", "euler", "simple", 3.5, 5.0, 512,
        {"720p": Size(1280, 720, 81), "480p": Size(832, 480, 81)}, "video_wan2_2_14B_t2v"),
    # Wan2.2-TI2V-5B (48-channel latent, 16x spatial compression). Template video_wan2_2_5B_ti2v:
    # uni_pc / simple, CFG 5, shift 8.
    "wan22-5b": ModelSpec(
        "wan22-5b", "wan", dict(WAN, in_dim=48, dim=3072, ffn_dim=14336, out_dim=48, num_heads=24, num_layers=30),
        "WAN22_T2V", "Wan22ImageToVideoLatent", "uni_pc", "simple", 5.0, 8.0, 512,
        {"720p": Size(1280, 704, 121), "480p": Size(832, 480, 121)}, "video_wan2_2_5B_ti2v"),
    # HunyuanVideo-1.5 (8.3B: 54 double-stream blocks, no single-stream blocks, hidden 2048, 16
    # heads; byT5 and vision inputs). Template video_hunyuan_video_1.5_720p_t2v: euler / simple,
    # CFG 6, shift 7 (its first pass; EasyCache off here so that every step runs the model).
    "hunyuan15": ModelSpec(
        "hunyuan15", "hunyuan_video", dict(HUNYUAN15, hidden_size=2048, num_heads=16, depth=54, depth_single_blocks=0),
        "HunyuanVideo15", "EmptyHunyuanVideo15Latent", "euler", "simple", 6.0, 7.0, 100,
        {"720p": Size(1280, 720, 121), "480p": Size(848, 480, 121)}, "video_hunyuan_video_1.5_720p_t2v"),
}


def tiny(spec: ModelSpec) -> ModelSpec:
    """The same family and graph at dim 256, 2 heads, 2 layers and a few tokens (CPU check)."""
    if spec.family == "wan":
        kwargs = dict(spec.kwargs, dim=256, ffn_dim=512, num_heads=2, num_layers=2)
        size = Size(128, 128, 9) if spec.kwargs["in_dim"] == 16 else Size(256, 256, 9)
    else:
        kwargs = dict(spec.kwargs, hidden_size=256, num_heads=2, depth=2, depth_single_blocks=1)
        size = Size(128, 128, 9)
    return ModelSpec(spec.name, spec.family, kwargs, spec.detected_as, spec.latent_node, spec.sampler,
                     spec.scheduler, spec.cfg, spec.shift, 24, {"tiny": size}, spec.template)


def tokens(spec: ModelSpec, size: Size) -> int:
    """Self-attention sequence length N (HunyuanVideo: text tokens included, joint attention)."""
    t = (size.frames - 1) // 4 + 1
    if spec.family == "wan":
        down = 8 if spec.latent_node == "EmptyHunyuanLatentVideo" else 16
        return t * (size.height // down // 2) * (size.width // down // 2)
    return t * (size.height // 16) * (size.width // 16) + spec.text_tokens


# -- ComfyUI ------------------------------------------------------------------------------------

def find_comfyui(arg: str | None) -> pathlib.Path:
    """--comfyui, else COMFYUI_PATH, else the ComfyUI whose custom_nodes/ holds this checkout."""
    for candidate in (arg, os.environ.get("COMFYUI_PATH")):
        if candidate:
            return pathlib.Path(candidate)
    here = pathlib.Path(os.path.abspath(__file__)).parents[1]
    if here.parent.name == "custom_nodes":
        return here.parent.parent
    raise SystemExit("ComfyUI not found: pass --comfyui PATH or set COMFYUI_PATH (a ComfyUI v0.29 folder)")


def start_comfyui(path: pathlib.Path, device: str):
    """Import ComfyUI as main.py does (its own argument parsing), register its nodes, then load this
    checkout as ComfyUI loads a custom node pack. Returns (nodes module, pack module name)."""
    if not (path / "comfy" / "model_patcher.py").is_file():
        raise SystemExit(f"{path} is not a ComfyUI folder (no comfy/model_patcher.py)")
    sys.path.insert(0, str(path))
    saved = sys.argv
    sys.argv = ["main.py", "--disable-all-custom-nodes"] + (["--cpu"] if device == "cpu" else [])
    try:
        import comfy.options

        comfy.options.enable_args_parsing()
        import nodes
    finally:
        sys.argv = saved
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    if "VCAttentionPatch" not in nodes.NODE_CLASS_MAPPINGS:
        if not asyncio.run(nodes.load_custom_node(str(REPO))):
            raise SystemExit(f"ComfyUI could not load the node pack at {REPO}")
    patch_cls = nodes.NODE_CLASS_MAPPINGS["VCAttentionPatch"]
    return nodes, patch_cls.__module__.rsplit(".nodes", 1)[0]


def run_node(nodes, node_id: str, **inputs):
    """Execute a node as ComfyUI's executor does (V3: a class clone with hidden inputs; V1: FUNCTION)."""
    cls = nodes.NODE_CLASS_MAPPINGS[node_id]
    if hasattr(cls, "PREPARE_CLASS_CLONE"):
        clone = cls.PREPARE_CLASS_CLONE({"hidden_inputs": {"UNIQUE_ID": "e2e"}})
        return cls.execute.__func__(clone, **inputs).args
    obj = cls()
    return getattr(obj, cls.FUNCTION)(**inputs)


def skeleton_state_dict(spec: ModelSpec):
    """The checkpoint's keys and shapes: the ComfyUI class built on the meta device (no memory)."""
    import torch
    import comfy.ops

    if spec.family == "wan":
        from comfy.ldm.wan.model import WanModel as cls
    else:
        from comfy.ldm.hunyuan_video.model import HunyuanVideo as cls
    with torch.device("meta"):
        skeleton = cls(**spec.kwargs, operations=comfy.ops.disable_weight_init)
    return skeleton.state_dict()


def fill_random(module, seed: int) -> None:
    """Random weights in place, on the weights' device: N(0, 1/fan_in) for matrices, 1 for norm
    weights, N(0, 0.02) otherwise (ComfyUI's ops leave weights uninitialised)."""
    import torch

    gens = {}  # one generator per device: a model can hold a few parameters on another device
    for name, p in module.named_parameters():
        g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        with torch.no_grad():
            if p.ndim >= 2:
                p.normal_(0.0, math.prod(p.shape[1:]) ** -0.5, generator=g)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


def build_model(spec: ModelSpec, dtype, seed: int):
    """ComfyUI's detection -> model config -> model_base on the load device -> ModelPatcher."""
    import comfy.model_detection
    import comfy.model_management as mm
    import comfy.model_patcher

    sd = skeleton_state_dict(spec)
    params = sum(t.numel() for t in sd.values())
    config = comfy.model_detection.model_config_from_unet(sd, "")
    detected = type(config).__name__ if config is not None else None
    if detected != spec.detected_as:
        raise RuntimeError(f"{spec.name}: ComfyUI detects {detected}, the real checkpoint loads as {spec.detected_as}")
    load_device = mm.get_torch_device()
    config.set_inference_dtype(dtype, mm.unet_manual_cast(dtype, load_device, config.supported_inference_dtypes),
                               device=load_device)
    model = config.get_model(sd, "", device=load_device)
    fill_random(model.diffusion_model, seed)
    offload = load_device if load_device.type == "cuda" else mm.unet_offload_device()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=load_device, offload_device=offload)
    return patcher, params, detected


def conditioning(spec: ModelSpec, seed: int):
    """Stand-ins for the text encoder's output: random contexts of the real width and length."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if spec.family == "wan":
        return [[torch.randn(1, spec.text_tokens, 4096, generator=g) * 0.1, {}]]
    return [[torch.randn(1, spec.text_tokens, 3584, generator=g) * 0.1, {"pooled_output": torch.zeros(1, 768)}]]


def empty_latent(nodes, spec: ModelSpec, size: Size):
    inputs = dict(width=size.width, height=size.height, length=size.frames, batch_size=1)
    if spec.latent_node == "Wan22ImageToVideoLatent":
        inputs["vae"] = None  # only used to encode a start image
    return run_node(nodes, spec.latent_node, **inputs)[0]


# -- attention overrides and timing -------------------------------------------------------------

_ARGS = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")


def _bind(args, kwargs) -> dict:
    bound = dict(zip(_ARGS, args))
    bound.update({k: kwargs[k] for k in _ARGS if k in kwargs})
    return bound


class FA4Override:
    """FlashAttention-4 as ComfyUI's attention override: self-attention calls (q, k, v of one shape,
    no mask, half precision, CUDA) go to flash_attn_func in its [B, N, H, D] layout; the rest to func."""

    def __init__(self, flash_attn_func):
        self.fn = flash_attn_func
        self.calls = Counter()
        self.copy_hnd = False

    def __call__(self, func, *args, **kwargs):
        import torch

        a = _bind(args, kwargs)
        q, k, v = a["q"], a["k"], a["v"]
        if (a.get("mask") is not None or not (q.shape == k.shape == v.shape) or not q.is_cuda
                or q.dtype not in (torch.bfloat16, torch.float16)):
            self.calls["default"] += 1
            return func(*args, **kwargs)
        heads = int(a["heads"])
        if a.get("skip_reshape"):  # [B, H, N, D]: a strided view; copied if FA4 refuses it (once, then always)
            qn, kn, vn = (t.transpose(1, 2) for t in (q, k, v))
            if self.copy_hnd:
                qn, kn, vn = (t.contiguous() for t in (qn, kn, vn))
        else:  # [B, N, H*D]
            b, n, hd = q.shape
            qn, kn, vn = (t.view(b, n, heads, hd // heads) for t in (q, k, v))
        try:
            out = self.fn(qn, kn, vn, softmax_scale=kwargs.get("scale"))
        except Exception:
            if not a.get("skip_reshape") or self.copy_hnd:
                raise
            self.copy_hnd = True
            out = self.fn(*(t.contiguous() for t in (qn, kn, vn)), softmax_scale=kwargs.get("scale"))
        out = out[0] if isinstance(out, tuple) else out  # [B, N, H, D]
        self.calls["fa4 (HND copied)" if a.get("skip_reshape") and self.copy_hnd else "fa4"] += 1
        if a.get("skip_output_reshape"):
            return out.transpose(1, 2)
        b, n, h, d = out.shape
        return out.reshape(b, n, h * d)


class StepClock:
    """Per-run timing shared by the wrappers below: the schedule, the current step, the model
    evaluations (PREDICT_NOISE: one per sampler step for first-order samplers, CFG included) and
    every attention call (CUDA events, or wall time on the CPU)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.sigmas: list[float] = []
        self.step = -1
        self.evals: list[tuple[int, float]] = []  # (step, seconds)
        self.attn: list = []  # (step, self_attention, start, end)

    def step_of(self, sigma: float) -> int:
        if not self.sigmas:
            return 0
        return min(range(len(self.sigmas) - 1), key=lambda i: abs(self.sigmas[i] - sigma))

    def sync(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def attention_seconds(self) -> dict:
        """step -> (all attention seconds, self-attention seconds)."""
        out = defaultdict(lambda: [0.0, 0.0])
        for step, is_self, start, end in self.attn:
            s = start.elapsed_time(end) / 1000.0 if self.cuda else end - start
            out[step][0] += s
            if is_self:
                out[step][1] += s
        return dict(out)


class OuterSample:
    def __init__(self, clock: StepClock):
        self.clock = clock

    def __call__(self, executor, *args, **kwargs):
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        self.clock.sigmas = [float(s) for s in sigmas]
        return executor(*args, **kwargs)


class PredictNoise:
    def __init__(self, clock: StepClock):
        self.clock = clock

    def __call__(self, executor, x, timestep, model_options, seed=None):
        from torch.profiler import record_function

        clock = self.clock
        clock.step = clock.step_of(float(timestep.reshape(-1)[0]))
        clock.sync()
        t0 = time.perf_counter()
        with record_function(f"e2e.step.{clock.step}"):
            out = executor(x, timestep, model_options, seed)
        clock.sync()
        clock.evals.append((clock.step, time.perf_counter() - t0))
        return out


class TimedAttention:
    """The outermost attention override: times every call, then hands it to the override that was
    installed (VC-Attention, FA4) or to ComfyUI's attention."""

    def __init__(self, clock: StepClock, inner):
        self.clock = clock
        self.inner = inner

    def __call__(self, func, *args, **kwargs):
        import torch
        from torch.profiler import record_function

        a = _bind(args, kwargs)
        is_self = a["q"].shape == a["k"].shape
        if self.clock.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        with record_function("e2e.attention.self" if is_self else "e2e.attention.other"):
            out = self.inner(func, *args, **kwargs) if self.inner is not None else func(*args, **kwargs)
        if self.clock.cuda:
            end.record()
        else:
            end = time.perf_counter()
        self.clock.attn.append((self.clock.step, is_self, start, end))
        return out


def timed(model, clock: StepClock):
    """A clone of ``model`` with the timing wrappers (the same in every variant)."""
    import comfy.patcher_extension as pe

    m = model.clone()
    options = m.model_options.setdefault("transformer_options", {})
    options[OVERRIDE_KEY] = TimedAttention(clock, options.get(OVERRIDE_KEY))
    m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, OuterSample(clock))
    m.add_wrapper_with_key(pe.WrappersMP.PREDICT_NOISE, WRAPPER_KEY, PredictNoise(clock))
    return m


def import_fa4():
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as e:  # absent, or present without its CUDA libraries
        return None, f"{type(e).__name__}: {e}"
    return flash_attn_func, None


# -- one run ------------------------------------------------------------------------------------

@dataclass
class Run:
    variant: str
    latent: object
    run_s: float
    peak_gb: float | None
    steps: list  # [{"step", "kind", "s", "attn_s", "self_attn_s"}]
    backend: dict = field(default_factory=dict)
    report: str = ""
    extra: dict = field(default_factory=dict)


def vc_step_kinds(report) -> dict:
    """step -> "cold" / "warm" from the run report's grouping events (other steps reuse plans)."""
    kinds = {}
    for step, _layer, action in getattr(report, "events", []):
        kinds.setdefault(step, set()).add(str(action))
    return {s: ("cold" if "cold" in a else "warm") for s, a in kinds.items()}


def variant_model(nodes, base, variant: str, args, fa4):
    """The model the sampler gets for one variant (before ModelSamplingSD3), and the override."""
    if variant == "default":
        return base, None
    if variant == "vc8":
        # The node's other inputs (ExpCast auto, no layers or steps kept on default) at their defaults.
        m = run_node(nodes, "VCAttentionPatch", model=base, bits="8", grouping_window=args.grouping_window,
                     refresh_every=args.refresh_every, clusters=args.clusters, backend=args.backend)[0]
        override = m.model_options.get("transformer_options", {}).get(OVERRIDE_KEY)
        if override is None:
            raise RuntimeError("VCAttentionPatch installed no attention override (unsupported model?)")
        return m, override
    if variant == "fa4":
        m = base.clone()
        override = FA4Override(fa4)
        m.model_options.setdefault("transformer_options", {})[OVERRIDE_KEY] = override
        return m, override
    raise ValueError(variant)


def sample(nodes, spec: ModelSpec, model, latent, positive, negative, steps: int, seed: int):
    shifted = run_node(nodes, "ModelSamplingSD3", model=model, shift=spec.shift)[0]
    return nodes.common_ksampler(shifted, seed, steps, spec.cfg, spec.sampler, spec.scheduler, positive, negative,
                                 latent)[0]["samples"]


def run_variant(nodes, spec, base, variant, latent, positive, negative, args, fa4, profiler=None) -> Run:
    import torch

    cuda = args.device == "cuda"
    m, override = variant_model(nodes, base, variant, args, fa4)
    clock = StepClock(cuda)
    m = timed(m, clock)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if profiler is not None:
        with profiler:
            out = sample(nodes, spec, m, latent, positive, negative, args.steps, args.seed)
    else:
        out = sample(nodes, spec, m, latent, positive, negative, args.steps, args.seed)
    clock.sync()
    run_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None

    report = getattr(override, "last_report", None) if variant == "vc8" else None
    kinds = vc_step_kinds(report) if report is not None else {}
    attn = clock.attention_seconds()
    per_step = defaultdict(float)
    for step, s in clock.evals:
        per_step[step] += s
    steps = [{"step": s, "kind": kinds.get(s, "reuse" if variant == "vc8" else "plain"), "s": per_step[s],
              "attn_s": attn.get(s, [0.0, 0.0])[0], "self_attn_s": attn.get(s, [0.0, 0.0])[1]}
             for s in sorted(per_step)]
    run = Run(variant, out.float(), run_s, peak, steps)
    if report is not None:
        run.backend = dict(report.backends)
        run.report = report.text()
        run.extra = {"patched_calls": report.patched, "passed_calls": dict(report.passed),
                     "errors": list(report.errors), "clustering_s": report.clustering_s,
                     "grouping_steps": sorted(report.grouping)}
    elif variant == "fa4":
        run.backend = dict(override.calls)
    else:
        run.backend = {"comfyui": len(clock.attn)}
    return run


def warm_attention(pack: str, spec: ModelSpec, n: int, args, fa4, variants) -> None:
    """Compile / pick the kernels at the real self-attention shape outside the timed runs (CFG
    batch of 2 and of 1): FA4 and Triton compile per shape, SDPA picks its backend on first use.
    On the CPU the same calls run once at the tiny shape (a check of this path, nothing to warm)."""
    import torch
    import torch.nn.functional as F

    kernels = importlib.import_module(f"{pack}.kernels")  # the pack as ComfyUI loaded it
    cuda = args.device == "cuda"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    heads, d = spec.heads, 128
    layout = "NHD" if spec.family == "wan" else "HND"
    for b in (2, 1) if cuda else (1,):
        shape = (b, n, heads, d) if layout == "NHD" else (b, heads, n, d)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
        hnd = [t.transpose(1, 2) if layout == "NHD" else t for t in (q, k, v)]
        F.scaled_dot_product_attention(*hnd)
        if "vc8" in variants:
            plan = kernels.plan_v_smooth(v, num_clusters=args.clusters, iters=2, layout=layout)
            kernels.vc_attention(q, k, v, bits=8, plan=plan, layout=layout, backend=args.backend)
        if "fa4" in variants and fa4 is not None and b == 2:  # FA4 compiles per shape: the CFG batch only
            nhd = [t if layout == "NHD" else t.transpose(1, 2) for t in (q, k, v)]  # as FA4Override passes them
            try:
                fa4(*nhd)
            except Exception:
                fa4(*(t.contiguous() for t in nhd))
        del q, k, v, hnd
    if cuda:
        torch.cuda.synchronize()


def warm_comfyui(nodes, spec, base, positive, negative, args) -> None:
    """One step at a small latent through the whole graph: ComfyUI loads the model, cuBLAS and the
    sampler's one-time set-up run before anything is timed."""
    small = empty_latent(nodes, spec, Size(256, 256, 5))
    sample(nodes, spec, base, small, positive, negative, 1, args.seed)


# -- results ------------------------------------------------------------------------------------

def summarise(spec, size_name, size, n, run: Run, default: Run | None, fa4_run: Run | None, args) -> dict:
    import torch

    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    grouping = [s for s in run.steps if s["kind"] in ("cold", "warm")]
    reuse = [s for s in run.steps if s["kind"] in ("reuse", "plain")]
    step_s = mean([s["s"] for s in run.steps])
    reuse_s = mean([s["s"] for s in reuse])
    row = dict(model=spec.name, size=size_name, width=size.width, height=size.height, frames=size.frames,
               tokens=n, heads=spec.heads, steps=args.steps, sampler=spec.sampler, scheduler=spec.scheduler,
               cfg=spec.cfg, shift=spec.shift, variant=run.variant,
               backend=";".join(f"{k}:{v}" for k, v in sorted(run.backend.items())),
               grouping_steps=",".join(f"{s['step']}{s['kind'][0]}" for s in grouping),
               s_per_step=step_s, s_per_grouping_step=mean([s["s"] for s in grouping]), s_per_reuse_step=reuse_s,
               run_s=run.run_s, peak_gb=run.peak_gb,
               attn_share=mean([s["attn_s"] / s["s"] for s in run.steps if s["s"] > 0]),
               attn_share_reuse=mean([s["attn_s"] / s["s"] for s in reuse if s["s"] > 0]),
               self_attn_s_per_step=mean([s["self_attn_s"] for s in run.steps]))
    if grouping and reuse_s:
        extra = sum(s["s"] - reuse_s for s in grouping)
        row["grouping_extra_share"] = extra / sum(s["s"] for s in run.steps)
        # Derived, not measured: the same extra costs over the node's default schedule (window 0.25,
        # refresh 4) at 20 and 40 steps: one cold grouping and 1 or 2 warm ones.
        cold = mean([s["s"] - reuse_s for s in grouping if s["kind"] == "cold"])
        warm = mean([s["s"] - reuse_s for s in grouping if s["kind"] == "warm"])
        if cold is not None and warm is not None:
            for total, warms in ((20, 1), (40, 2)):
                added = cold + warms * warm
                row[f"grouping_extra_share_{total}_derived"] = added / (total * reuse_s + added)
    if default is not None and run is not default:
        a, b = run.latent.double(), default.latent.double()
        row["rel_l2_vs_default"] = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))
        row["speedup_step_vs_default"] = _ratio(_step(default), reuse_s)
        row["speedup_run_vs_default"] = _ratio(default.run_s, run.run_s)
        if run.peak_gb is not None and default.peak_gb:
            row["peak_vs_default"] = run.peak_gb / default.peak_gb
    if fa4_run is not None and run is not fa4_run:
        row["speedup_step_vs_fa4"] = _ratio(_step(fa4_run), reuse_s)
        row["speedup_run_vs_fa4"] = _ratio(fa4_run.run_s, run.run_s)
    row["finite"] = bool(torch.isfinite(run.latent).all())
    return row


def _step(run: Run):
    xs = [s["s"] for s in run.steps if s["kind"] in ("reuse", "plain")]
    return sum(xs) / len(xs) if xs else None


def _ratio(a, b):
    return a / b if a and b else None


COLUMNS = ["model", "size", "width", "height", "frames", "tokens", "heads", "steps", "sampler", "scheduler", "cfg",
           "shift", "variant", "backend", "grouping_steps", "s_per_step", "s_per_grouping_step", "s_per_reuse_step",
           "run_s", "peak_gb", "peak_vs_default", "attn_share", "attn_share_reuse", "self_attn_s_per_step",
           "grouping_extra_share", "grouping_extra_share_20_derived", "grouping_extra_share_40_derived",
           "speedup_step_vs_default", "speedup_run_vs_default", "speedup_step_vs_fa4",
           "speedup_run_vs_fa4", "rel_l2_vs_default", "finite", "card", "date", "commit"]


def git_commit() -> str:
    if os.environ.get("VC_GIT_COMMIT"):
        return os.environ["VC_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def environment(args, comfyui: pathlib.Path) -> dict:
    import torch

    card = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({platform.processor() or 'x86_64'})"
    version = "unknown"
    try:
        text = (comfyui / "comfyui_version.py").read_text()
        version = text.split("__version__ =", 1)[1].strip().strip('"\'')
    except Exception:
        pass
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    return dict(card=card, date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                command=" ".join([os.path.basename(sys.executable)] + sys.argv), commit=git_commit(),
                torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda, comfyui=version,
                python=platform.python_version())


def write(out_dir: pathlib.Path, stem: str, env: dict, rows: list, configs: list, traces: list, notes: list):
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "card": env["card"], "date": env["date"], "commit": env["commit"]})
    data = dict(env, note=PERTURBATION_NOTE, notes=notes, rows=rows, configs=configs, traces=traces)
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1, default=str))


def fmt(x, spec="{:.3f}"):
    return "-" if x is None else spec.format(x)


def table(rows: list) -> str:
    head = (f"{'model':10} {'size':5} {'N':>7} {'variant':7} {'s/step grp':>10} {'s/step reuse':>12} {'run s':>8} "
            f"{'peak GB':>8} {'attn %':>6} {'x default':>9} {'x FA4':>6} {'rel L2':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:10} {r['size']:5} {r['tokens']:>7} {r['variant']:7} "
                     f"{fmt(r.get('s_per_grouping_step')):>10} {fmt(r.get('s_per_reuse_step')):>12} "
                     f"{fmt(r['run_s'], '{:.2f}'):>8} {fmt(r.get('peak_gb'), '{:.1f}'):>8} "
                     f"{fmt(r.get('attn_share_reuse') and 100 * r['attn_share_reuse'], '{:.0f}'):>6} "
                     f"{fmt(r.get('speedup_step_vs_default'), '{:.2f}'):>9} "
                     f"{fmt(r.get('speedup_step_vs_fa4'), '{:.2f}'):>6} "
                     f"{fmt(r.get('rel_l2_vs_default'), '{:.3g}'):>8}")
    return "\n".join(lines)


# -- --trace: what the pack adds around the kernel ----------------------------------------------

VIEW_OPS = {"aten::view", "aten::transpose", "aten::reshape", "aten::unsqueeze", "aten::squeeze", "aten::select",
            "aten::slice", "aten::permute", "aten::expand", "aten::as_strided", "aten::_reshape_alias",
            "aten::alias", "aten::t", "aten::flatten", "aten::unflatten", "aten::detach", "aten::lift_fresh"}


def _kind(name: str) -> str:
    if name in ("aten::copy_", "aten::clone", "aten::contiguous"):
        return "copy"
    if name in ("aten::to", "aten::_to_copy", "aten::type_as"):
        return "cast"
    if name in ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero") or "Synchronize" in name:
        return "sync"
    if name in VIEW_OPS:
        return "view"
    if name in ("aten::empty", "aten::empty_like", "aten::empty_strided", "aten::zeros", "aten::new_empty"):
        return "alloc"
    return "other"


def _has_descendant(e, name: str) -> bool:
    stack = list(e.cpu_children)
    while stack:
        c = stack.pop()
        if c.name == name:
            return True
        stack.extend(c.cpu_children)
    return False


def trace_summary(prof, pack_dir: str) -> dict:
    """Per step, from torch.profiler's events (Python frames included), inside every patched
    self-attention call: time in the kernel op (``vc_attention::attention``: quantisation and the
    kernel, the library's work), time making plans (``plan_v_smooth``: k-means, grouping steps), and
    what is left: the aten ops issued around them (copies, dtype casts, host syncs, views,
    allocations, other), each attributed to the pack's function that issued it, and Python. Calls
    of one q/k/v shape that the override left to ComfyUI's attention are only counted."""
    events = prof.events()

    def ancestors(e):
        p = e.cpu_parent
        while p is not None:
            yield p
            p = p.cpu_parent

    def pack_frame(e):
        for p in ancestors(e):
            name = p.name
            if ".py(" in name and ("nodes/" in name or "kernels/" in name) and "comfyui_e2e" not in name:
                return name.split(pack_dir)[-1] if pack_dir in name else name
        return None

    def ms(e):
        return (e.time_range.end - e.time_range.start) / 1000.0

    steps = defaultdict(lambda: dict(calls=0, override_ms=0.0, kernel_ms=0.0, plan_ms=0.0, aten_ms=0.0,
                                     counts=Counter(), where=Counter()))
    for e in events:
        if e.name != "e2e.attention.self":
            continue
        step = next((int(p.name.rsplit(".", 1)[1]) for p in ancestors(e) if p.name.startswith("e2e.step.")), None)
        st = steps[step]
        if not _has_descendant(e, "vc_attention::attention"):
            st["passed"] = st.get("passed", 0) + 1  # left to ComfyUI's attention (e.g. a text-only refiner)
            continue
        st["calls"] += 1
        st["override_ms"] += ms(e)
        stack = list(e.cpu_children)
        while stack:  # walk down; stop at the kernel op, a plan, or the outermost aten op
            c = stack.pop()
            if c.name == "vc_attention::attention":
                st["kernel_ms"] += ms(c)
            elif c.name.endswith(": plan_v_smooth"):
                st["plan_ms"] += ms(c)
            elif c.name.startswith("aten::") or "Synchronize" in c.name:
                k = _kind(c.name)
                if k in ("view", "cast"):  # a reshape that had to copy is a copy; a .to() that did nothing a view
                    copied = _has_descendant(c, "aten::copy_") or _has_descendant(c, "aten::clone")
                    k = ("copy" if copied else "view") if k == "view" else ("cast" if copied else "view")
                st["counts"][k] += 1
                st["aten_ms"] += ms(c)
                st["where"][f"{k}: {c.name} <- {pack_frame(c) or '?'}"] += 1
            else:
                stack.extend(c.cpu_children)
    out = {}
    for step, st in sorted(steps.items(), key=lambda kv: (kv[0] is None, kv[0])):
        st["python_ms"] = st["override_ms"] - st["kernel_ms"] - st["plan_ms"] - st["aten_ms"]
        st["counts"] = dict(st["counts"])
        st["where"] = dict(st["where"].most_common())
        out[str(step)] = st
    return out


def print_trace(model: str, size: str, trace: dict, kinds: dict) -> None:
    print(f"\n--trace {model} {size}: per step, inside the patched self-attention calls (torch.profiler "
          "with Python frames: the profiler inflates Python time, so read the shares and counts)")
    print(f"{'step':>4} {'kind':5} {'calls':>5} {'override ms':>11} {'kernel op':>9} {'plan':>8} {'aten ops':>8} "
          f"{'python':>8}  copies casts syncs views allocs other  passed")
    for step, st in trace.items():
        c = st["counts"]
        print(f"{step:>4} {kinds.get(step, '?'):5} {st['calls']:>5} {st['override_ms']:>11.2f} {st['kernel_ms']:>9.2f} "
              f"{st['plan_ms']:>8.2f} {st['aten_ms']:>8.2f} {st['python_ms']:>8.2f}  {c.get('copy', 0):>6} "
              f"{c.get('cast', 0):>5} {c.get('sync', 0):>5} {c.get('view', 0):>5} {c.get('alloc', 0):>6} "
              f"{c.get('other', 0):>5}  {st.get('passed', 0):>6}")
    where = Counter()
    for st in trace.values():
        where.update(st["where"])
    print("aten ops around the kernel op and the plans, by the pack function that issued them (whole run):")
    for k, v in where.most_common(16):
        print(f"  {v:6}  {k}")


# -- --pack-device: what the GPU machine lacks, in two carries ------------------------------------

# ComfyUI v0.29.0's imports on the path this script takes (comfy.sd, comfy_api, comfy.samplers, the
# built-in nodes it calls), found by importing it with nothing but torch: cp312 wheels, pinned to
# versions that ran here, torchvision / torchaudio to the builds made for torch 2.11 (CUDA 13).
DEVICE_WHEELS_A = ["av==18.1.0", "scipy==1.17.1"]  # the two large ones: carry A
DEVICE_WHEELS_B = ["numpy==2.4.6", "pillow==13.0.0", "safetensors==0.8.0", "psutil==7.2.2", "comfy-aimdo==0.4.10",
                   "tqdm==4.70.1", "einops==0.8.2", "PyYAML==6.0.4", "comfy-kitchen==0.2.24", "transformers==5.24.0",
                   "regex==2026.11.19", "huggingface_hub==2.4.0", "httpx2==2.16.2", "idna==3.20", "httpcore2==2.16.2",
                   "truststore==0.10.5", "h11==0.16.0", "packaging==26.4", "tokenizers==0.23.3", "torchsde==0.2.6",
                   "trampoline==0.1.2", "torchvision==0.26.0", "torchaudio==2.11.0"]
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
            "--platform", "manylinux_2_24_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64", "--platform", "any"]


def pack_device(prefix: pathlib.Path, tarball: str | None) -> None:
    """Make ``<prefix>_a/`` and ``<prefix>_b/`` (git-ignored through .git/info/exclude), each under
    64 MiB: ``site.tar.xz`` of unpacked wheels (comfy-kitchen without its 143 MB CUDA extension,
    which is optional and only serves quantised weights; no tests/ folders), and in ``_b`` the
    ComfyUI source tarball. On the device: unpack both into one folder and pass it as --site."""
    import shutil
    import tempfile
    import zipfile

    exclude = REPO / ".git" / "info" / "exclude"
    for part in ("a", "b"):
        line = f"/{prefix.name}_{part}/"
        if exclude.parent.is_dir() and line not in (exclude.read_text().split("\n") if exclude.exists() else []):
            with open(exclude, "a") as f:
                f.write(line + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        for part, wheels in (("a", DEVICE_WHEELS_A), ("b", DEVICE_WHEELS_B)):
            wdir, site = pathlib.Path(tmp) / f"w{part}", pathlib.Path(tmp) / f"site{part}"
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(wdir),
                            *wheels], check=True)
            for whl in sorted(wdir.glob("*.whl")):
                with zipfile.ZipFile(whl) as z:
                    z.extractall(site)
            for so in site.glob("comfy_kitchen/backends/cuda/_C*.so"):
                so.unlink()
            for d in [p for p in site.rglob("*") if p.is_dir() and p.name in ("tests", "__pycache__")]:
                shutil.rmtree(d, ignore_errors=True)
            out = pathlib.Path(f"{prefix}_{part}")
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            subprocess.run(["tar", "-cJf", str(out / "site.tar.xz"), "-C", str(site), "."], check=True,
                           env={**os.environ, "XZ_OPT": "-6 -T0"})
            if part == "b" and tarball:
                shutil.copy(tarball, out / pathlib.Path(tarball).name)
            size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
            print(f"{out}: {size:.1f} MiB ({', '.join(sorted(f.name for f in out.iterdir()))})")


# -- main ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comfyui", help="ComfyUI folder (default: COMFYUI_PATH)")
    p.add_argument("--models", default="wan22-14b,wan22-5b,hunyuan15", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--sizes", default="720p,480p", help="comma list of 720p, 480p")
    p.add_argument("--variants", default="default,vc8,fa4", help="comma list of default, vc8, fa4")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--frames", type=int, help="override the frame count of every size")
    p.add_argument("--size", help="override width x height of every size, e.g. 640x384")
    p.add_argument("--grouping-window", type=float, default=0.75,
                   help="the patch node's grouping_window (default 0.75 with 4 steps and refresh 2: cold grouping "
                        "at step 0, warm at 2, plans reused at 1 and 3; the node's own default is 0.25 / 4)")
    p.add_argument("--refresh-every", type=int, default=2, help="the patch node's refresh_every")
    p.add_argument("--clusters", type=int, default=64)
    p.add_argument("--backend", default="auto", help="the patch node's backend")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true",
                   help="dim 256, 2 heads, 2 layers, a few frames (CPU check); implies --backend reference "
                        "and --clusters 8 unless given")
    p.add_argument("--deadline-s", type=float, default=None, help="start no new configuration after this")
    p.add_argument("--trace", nargs="?", const="all", default=None, metavar="MODELS",
                   help="profile one more patched run per configuration (of the comma list MODELS, default all) "
                        "and print what the pack adds around the kernel, step by step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--stem", help="output file name without extension (default comfyui_e2e_<card>_<date>)")
    p.add_argument("--site", action="append", default=[],
                   help="folder of extra Python packages, appended to sys.path (the machine's own win)")
    p.add_argument("--pack-device", metavar="PREFIX",
                   help="make PREFIX_a/ and PREFIX_b/ (ComfyUI's dependencies for a Python 3.12 / torch 2.11 GPU "
                        "machine without network, and the --comfyui-tarball) and exit")
    p.add_argument("--comfyui-tarball", help="with --pack-device: the ComfyUI source tarball to carry")
    args = p.parse_args(argv)
    given = " ".join(sys.argv if argv is None else argv)
    if args.tiny:
        if "--backend" not in given:
            args.backend = "reference"
        if "--clusters" not in given:
            args.clusters = 8
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.pack_device:
        pack_device(pathlib.Path(args.pack_device).resolve(), args.comfyui_tarball)
        return 0
    sys.path.extend(args.site)
    t_start = time.perf_counter()
    comfyui = find_comfyui(args.comfyui)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU (use --device cpu for the CPU check)")
    nodes, pack = start_comfyui(comfyui, args.device)
    env = environment(args, comfyui)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    variants = [v for v in args.variants.split(",") if v]
    notes = [PERTURBATION_NOTE, DERIVED_NOTE]
    fa4, why = (None, "not requested")
    if "fa4" in variants:
        fa4, why = import_fa4()
        if fa4 is None or args.device != "cuda":
            notes.append(f"fa4 skipped: {why if fa4 is None else 'needs CUDA'}")
            variants.remove("fa4")
            fa4 = None
    if "default" not in variants:
        variants.insert(0, "default")  # the reference for rel L2 and the speedups
    print(f"VC-Attention end to end in ComfyUI {env['comfyui']} on {env['card']} (torch {env['torch']}); "
          f"variants {', '.join(variants)}; commit {env['commit']}", flush=True)
    for n in notes[2:]:
        print("note:", n)

    slug = "".join(ch if ch.isalnum() else "-" for ch in env["card"].lower()).strip("-")[:24]
    stem = args.stem or f"comfyui_e2e_{'tiny_' if args.tiny else ''}{slug}_{env['date'][:10]}"
    out_dir = pathlib.Path(args.out_dir)
    rows, configs, traces = [], [], []
    with torch.inference_mode():  # as ComfyUI's executor runs a prompt
        run_models(nodes, pack, args, env, dtype, variants, fa4, notes, out_dir, stem, rows, configs, traces, t_start)
    write(out_dir, stem, env, rows, configs, traces, notes)
    print("\n" + PERTURBATION_NOTE)
    shown = out_dir / stem
    try:
        shown = shown.resolve().relative_to(pathlib.Path.cwd().resolve())
    except ValueError:
        pass
    print(f"written: {shown}.csv, .json ({time.perf_counter() - t_start:.1f} s in all)\n")
    print(table(rows))
    return 0


def run_models(nodes, pack, args, env, dtype, variants, fa4, notes, out_dir, stem, rows, configs, traces, t_start):
    for name in [m for m in args.models.split(",") if m]:
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; one of {', '.join(MODELS)}")
        spec = tiny(MODELS[name]) if args.tiny else MODELS[name]
        sizes = list(spec.sizes) if args.tiny else [s for s in args.sizes.split(",") if s]
        if args.deadline_s is not None and time.perf_counter() - t_start > args.deadline_s:
            notes.append(f"deadline: {name} not started")
            print(f"deadline reached: {name} not started", flush=True)
            continue
        t0 = time.perf_counter()
        base, params, detected = build_model(spec, dtype, args.seed)
        print(f"\n{name}: {params / 1e9:.2f} B parameters, detected by ComfyUI as {detected}, built on "
              f"{base.load_device} in {dtype} in {time.perf_counter() - t0:.1f} s", flush=True)
        positive, negative = conditioning(spec, args.seed + 1), conditioning(spec, args.seed + 2)
        warm_comfyui(nodes, spec, base, positive, negative, args)
        for size_name in sizes:
            if args.deadline_s is not None and time.perf_counter() - t_start > args.deadline_s:
                notes.append(f"deadline: {name} {size_name} not started")
                print(f"deadline reached: {name} {size_name} not started", flush=True)
                continue
            size = spec.sizes[size_name]
            if args.frames:
                size = Size(size.width, size.height, args.frames)
            if args.size:
                w, h = (int(x) for x in args.size.lower().split("x"))
                size = Size(w, h, size.frames)
            n = tokens(spec, size)
            latent = empty_latent(nodes, spec, size)
            warm_attention(pack, spec, n, args, fa4, variants)
            runs = {}
            for variant in variants:
                t1 = time.perf_counter()
                try:
                    runs[variant] = run_variant(nodes, spec, base, variant, latent, positive, negative, args, fa4)
                except Exception as e:  # one failing variant must not cost the rest of a device run
                    message = f"{name} {size_name} {variant} failed: {type(e).__name__}: {e}"
                    notes.append(message)
                    print(message, flush=True)
                    if variant == "default":
                        break
                    continue
                r = runs[variant]
                print(f"  {name} {size_name} N={n} {variant}: {r.run_s:.2f} s run, steps "
                      + ", ".join(f"{s['step']}{s['kind'][0]}={s['s']:.3f}" for s in r.steps)
                      + (f", peak {r.peak_gb:.1f} GB" if r.peak_gb is not None else "")
                      + f", backend {r.backend} ({time.perf_counter() - t1:.1f} s)", flush=True)
                if r.report:
                    print("    " + r.report.replace("\n", "\n    "), flush=True)
            for variant, r in runs.items():
                rows.append(summarise(spec, size_name, size, n, r, runs.get("default"), runs.get("fa4"), args))
            configs.append(dict(model=name, size=size_name, tokens=n, parameters=params, detected_as=detected,
                                template=spec.template, steps_detail={v: r.steps for v, r in runs.items()},
                                reports={v: r.report for v, r in runs.items() if r.report},
                                extra={v: r.extra for v, r in runs.items() if r.extra}))
            if args.trace and (args.trace == "all" or name in args.trace.split(",")) and "vc8" in runs:
                from torch.profiler import ProfilerActivity, profile

                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
                prof = profile(activities=activities, with_stack=True)
                r = run_variant(nodes, spec, base, "vc8", latent, positive, negative, args, fa4, profiler=prof)
                trace = trace_summary(prof, str(REPO) + os.sep)
                kinds = {str(s["step"]): s["kind"] for s in r.steps}
                print_trace(name, size_name, trace, kinds)
                traces.append(dict(model=name, size=size_name, kinds=kinds, steps=trace))
            del runs, latent
            write(out_dir, stem, env, rows, configs, traces, notes)
        del base
        import comfy.model_management as mm

        mm.unload_all_models()
        gc.collect()
        mm.soft_empty_cache()


if __name__ == "__main__":
    sys.exit(main())
