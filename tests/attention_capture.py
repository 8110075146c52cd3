"""Capture the self-attention inputs of a tiny random Wan 2.1 model sampled by real ComfyUI.

Used by tests/nodes/test_capture_schedule.py and by ``benchmarks/fidelity/capture_tiny_wan.py`` (the
command line that writes a capture for ``benchmarks/fidelity/schedule_effect.py``).

Real ComfyUI (found as tests/comfy_harness.py finds it) runs in process on the CPU, as in tests/nodes:
a tiny Wan 2.1 T2V model built from ComfyUI's own ``WanModel`` class (dim 256, 2 heads of 128, random
weights, tests/comfy_harness.build_wan) is loaded with UNETLoader, patched with the VCAttentionPatch
node with ``bits="off"`` (the node installs its role tags and its attention override, and every call
keeps ComfyUI's attention, so the trajectory is the unpatched model's), and sampled with
``common_ksampler`` (KSampler: euler, "simple" scheduler, Wan's shift-8 flow sampling, CFG batched).

The capture hangs under the node's override as its ``inner`` override: every call the node passes
through reaches it, and it records the tagged self-attention calls only (role ``blocks.i.self_attn``)
with q, k, v as [B, H, N, D] fp32 (B = cond/uncond batch), ``cond_or_uncond``, the call's sigma,
its step in ``sample_sigmas`` (the node's own step definition, nodes/schedule.py) and the block index.

``capture`` writes ``<out>/capture.pt``: {"calls": [dict(step, sigma, layer, block_index, cond_or_uncond, q, k, v)],
"sample_sigmas", "window_sigma" (model_sampling.percent_to_sigma(0.25), the node's default grouping
window), "config"}. Not committed (a few hundred MB at the defaults are not for git).
"""

from __future__ import annotations

import datetime
import pathlib
import platform
import time

import torch

import comfy_harness as H


class Recorder:
    """An attention override placed under VCAttentionOverride (its ``inner``): records the tagged
    self-attention calls, then runs ComfyUI's own attention ``func`` unchanged."""

    def __init__(self):
        from vc_attention.nodes.override import _Call
        from vc_attention.nodes.roles import ROLE_KEY
        from vc_attention.nodes.schedule import step_index

        self._bind, self._role_key, self._step_index = _Call.bind, ROLE_KEY, step_index
        self.calls = []
        self.sample_sigmas = None  # the running sampler's schedule, as the calls carry it

    def __call__(self, func, *args, **kwargs):
        options = kwargs.get("transformer_options") or {}
        role = options.get(self._role_key)
        if role is not None:
            call = self._bind(args, kwargs)
            q, k, v, layout = call.tensors()
            if layout == "NHD":
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            sample_sigmas = [float(s) for s in options["sample_sigmas"]]
            self.sample_sigmas = self.sample_sigmas or sample_sigmas
            sigma = float(options["sigmas"].reshape(-1)[0])
            self.calls.append(dict(
                step=self._step_index(sigma, sample_sigmas), sigma=sigma, layer=role.layer,
                block_index=role.index, cond_or_uncond=tuple(options.get("cond_or_uncond") or ()),
                q=q.detach().float().contiguous().clone(), k=k.detach().float().contiguous().clone(),
                v=v.detach().float().contiguous().clone()))
        return func(*args, **kwargs)


def capture(out: pathlib.Path, *, layers=4, frames=4, height=32, width=32, steps=20, cfg=5.0, seed=0,
            model_seed=1) -> dict:
    """Build, load, patch (bits off), sample with the recorder; return the capture dict (and save it)."""
    H.start_comfyui()
    import folder_paths
    import nodes

    from vc_attention.nodes.patch import OVERRIDE_KEY

    models = out / "diffusion_models"
    models.mkdir(parents=True, exist_ok=True)
    name = f"tiny_wan21_L{layers}_s{model_seed}.safetensors"
    H.build_wan(models / name, channels=16, layers=layers, seed=model_seed)
    folder_paths.add_model_folder_path("diffusion_models", str(models), is_default=True)
    model = H.load(nodes, name)
    patched = H.patch(nodes, model, bits="off").args[0]
    override = patched.model_options["transformer_options"][OVERRIDE_KEY]
    recorder = Recorder()
    override.inner = recorder  # every call the node passes through (all of them: bits off) reaches it

    lat = H.latent(16, frames=frames, h=height, w=width)
    t0 = time.time()
    H.sample(nodes, patched, H.wan_conditioning(1), H.wan_conditioning(2), lat, steps=steps, cfg=cfg,
             sampler="euler", scheduler="simple", seed=seed)
    wall = time.time() - t0
    model_sampling = patched.get_model_object("model_sampling")
    sample_sigmas = recorder.sample_sigmas
    data = dict(
        calls=recorder.calls,
        sample_sigmas=sample_sigmas,
        window_sigma=float(model_sampling.percent_to_sigma(0.25)),
        config=dict(layers=layers, dim=256, heads=2, head_dim=128, latent=(16, frames, height, width),
                    tokens=frames * (height // 2) * (width // 2), steps=steps, cfg=cfg, sampler="euler",
                    scheduler="simple", seed=seed, model_seed=model_seed, sample_wall_s=wall,
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
                    torch=torch.__version__, threads=torch.get_num_threads()))
    torch.save(data, out / "capture.pt")
    return data
