"""Attention probes built from real video: Q, K, V with the spatiotemporal structure of a video DiT.

Running a 14B video model is not needed to study the method's fidelity: the harness feeds the
library attention inputs that are *built from real generated clips* (the Wan 2.2 / HunyuanVideo 1.5
previews of ComfyUI's workflow templates, found by ``find_video_dir``). The point is to keep what matters for V-Smooth and ExpCast:
token order = spatiotemporal raster order of a latent video, values whose similarity follows image
content (so that grouping by k-means has something real to find), scores with RoPE locality, and the
value outliers the paper describes. Everything is deterministic for a given ``ProbeConfig``.

How one probe is built (``build_probe``), step by step:

1. **Decode** the animated WebP with Pillow, RGB in [0, 1], and centre-crop each frame to a multiple
   of the patch size.
2. **Temporal stride 4, like the video VAE**: latent frame ``i`` is video frames ``4i .. 4i+3``
   (Wan's and HunyuanVideo's VAEs compress time by 4; we group 4 frames non-causally and ignore the
   causal lone first frame). ``latent_frames`` of them are taken from the start of the clip.
3. **Patchify**: one token per ``patch x patch`` pixel square of a latent frame; its raw vector is the
   4 frames x patch x patch x 3 pixels (768 numbers for 8 px). Why 8 px: the previews are 300-350 px
   renders of 720p videos (scale ~2.1-2.4), and a Wan/HunyuanVideo token is 16 px of the 720p frame
   (VAE x8, patch 2x2), i.e. ~7-8 preview pixels. So 8 px patches give the *spatial token density* of
   the real model; a full 720p frame has 3600 tokens, our crops 1369-1849. **Sequence length**: it is
   reached by this real density times ``latent_frames`` (N = T x Hp x Wp): the default 6 latent frames
   give N = 6 x 43 x 43 = 11,094 tokens (Wan clips), 6 x 37 x 37 = 8,214 (HunyuanVideo clip),
   about 1/7 to 1/9 of Wan2.2's 75.6K; no upsampling, no tiling. Smaller probes (tests) use 16 px
   patches and fewer frames.
4. **Diffusion noise** (optional): the flow-matching latent ``z_s = (1 - s) z + s * eps`` of the
   standardised patch vectors; ``sigma = 0`` (default) is the clean content, the most structured case.
   ``hidden_noise = t`` instead mixes the hidden state of step 5, ``a_t = LN((1 - t) a + t eps)``
   (eps from its own seeded generator, so the other draws do not move); 0 (default) is off.
5. **Hidden state**: a fixed random two-layer feature map stands in for the DiT trunk:
   ``h = GELU(LN(z) W1 / sqrt(d_in))`` (W1: d_in x 512, Gaussian, seeded) and the attention input
   ``a = LN(h)`` (the pre-attention norm of a DiT block). Non-linear, so V is not a linear image of the
   pixels, but similar content still gives similar tokens.
6. **Per-head projections to D = 128** (seeded, Gaussian / sqrt(512)): ``V_h = a Wv_h``;
   ``Q_h = g_h RMSNorm(a Wq_h)``, ``K_h = g_h RMSNorm(a Wk_h)`` (QK-norm, as Wan), with
   ``Wk_h = c_h Wq_h + sqrt(1 - c_h^2) W'_h`` so that a query prefers keys of similar content
   (c_h ~ U[0.5, 0.9]); the gain g_h, g_h^2 ~ U[1, 2.5], sets the sharpness of the softmax (score
   std about 2.6-6.5 nats; effective number of keys exp(entropy) from ~100 to a few thousand;
   ``gain_scale`` multiplies g for broader or more peaked heads, 1 by default). Then **3-D RoPE**
   on Q and K with Wan's split of the head dim (44 dims for t, 42 for h, 42 for w; theta 10000), which
   gives the spatiotemporal locality of video attention maps.
7. **Value outliers**, as the paper describes them (METHOD.md section 0): per head, a few *tokens*
   carry large values (``outlier_frac`` = 0.5% of tokens, chosen by a per-head random direction in
   ``a``, so they are content-coherent and differ per head) in a few *spiking channels* that differ per
   head (``outlier_channels`` = 4 of 128, random per head, random fixed sign), with amplitude
   ``outlier_gain`` = 16 x the head's RMS value. No other outlier is added.

Nothing here is fitted to the paper's numbers: the constants above were set once from the
reasoning given and are printed with every result (``ProbeConfig`` is written to the CSVs).
"""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

CLIPS = {
    "wan22_14b": "video_wan2_2_14B_t2v-1.webp",
    "hunyuan15": "video_hunyuan_video_1.5_720p_t2v-1.webp",
    "wan22_5b": "video_wan2_2_5B_ti2v-1.webp",
}

VIDEO_ENV = "VC_FIDELITY_VIDEOS"
VIDEO_PACKAGE = "comfyui_workflow_templates_media_video"  # MIT; installed with ComfyUI's requirements


def find_video_dir() -> pathlib.Path | None:
    """Where the three preview clips are: the folder in ``$VC_FIDELITY_VIDEOS``; else the
    ``templates/`` folder of the installed ``comfyui-workflow-templates-media-video`` package (every
    ComfyUI install has it). The first folder that holds every clip wins; None when no folder does
    (callers skip, or raise ``VIDEO_MISSING``)."""
    candidates = []
    if os.environ.get(VIDEO_ENV):
        candidates.append(pathlib.Path(os.environ[VIDEO_ENV]))
    spec = importlib.util.find_spec(VIDEO_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        candidates += [pathlib.Path(p) / "templates" for p in spec.submodule_search_locations]
    for folder in candidates:
        if all((folder / name).is_file() for name in CLIPS.values()):
            return folder
    return None


VIDEO_DIR = find_video_dir()
VIDEO_MISSING = (f"the preview clips ({', '.join(CLIPS.values())}) were not found: install "
                 f"comfyui-workflow-templates-media-video or set {VIDEO_ENV} to a folder that holds them")


@dataclass
class ProbeConfig:
    clip: str = "wan22_14b"
    patch: int = 8  # px per token side on the preview (~16 px of the 720p render = one latent token)
    t_stride: int = 4  # video frames per latent frame (VAE temporal compression)
    latent_frames: int = 6  # N = latent_frames x (crop / patch)^2
    heads: int = 8
    head_dim: int = 128
    hidden: int = 512
    sigma: float = 0.0  # flow-matching noise level of the latent (0 = clean content)
    hidden_noise: float = 0.0  # t of x_t = (1 - t) x0 + t eps on the hidden state (0 = clean; own generator)
    gain_scale: float = 1.0  # multiplies every head's QK gain g: > 1 peaked heads, < 1 broad ones
    outlier_frac: float = 0.005
    outlier_channels: int = 4
    outlier_gain: float = 16.0
    rope_theta: float = 10000.0
    seed: int = 0


@dataclass
class Probe:
    config: ProbeConfig
    q: torch.Tensor  # [1, H, N, D] fp32
    k: torch.Tensor
    v: torch.Tensor
    grid: tuple  # (T, Hp, Wp): token t = (it * Hp + ih) * Wp + iw
    outlier_tokens: torch.Tensor  # [H, N] bool
    spike_channels: torch.Tensor  # [H, outlier_channels] int64
    meta: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.q.shape[2]


def load_frames(clip: str, max_frames: int | None = None) -> np.ndarray:
    """Decode a clip -> float32 [F, H, W, 3] in [0, 1]."""
    from PIL import Image, ImageSequence

    if VIDEO_DIR is None:
        raise FileNotFoundError(VIDEO_MISSING)
    path = VIDEO_DIR / CLIPS.get(clip, clip)
    frames = []
    with Image.open(path) as im:
        for i, fr in enumerate(ImageSequence.Iterator(im)):
            if max_frames is not None and i >= max_frames:
                break
            frames.append(np.asarray(fr.convert("RGB"), dtype=np.float32) / 255.0)
    return np.stack(frames)


def patchify(frames: np.ndarray, patch: int, t_stride: int, latent_frames: int):
    """[F, H, W, 3] -> (tokens [N, t_stride*patch*patch*3] float32, grid (T, Hp, Wp)).

    Centre crop to a multiple of the patch; latent frame i = video frames t_stride*i .. +t_stride-1;
    tokens in raster order (t, h, w) — the order a video DiT flattens its latent.
    """
    F, H, W, _ = frames.shape
    T = min(latent_frames, F // t_stride)
    Hp, Wp = H // patch, W // patch
    y0, x0 = (H - Hp * patch) // 2, (W - Wp * patch) // 2
    x = frames[: T * t_stride, y0 : y0 + Hp * patch, x0 : x0 + Wp * patch]
    x = x.reshape(T, t_stride, Hp, patch, Wp, patch, 3)
    x = x.transpose(0, 2, 4, 1, 3, 5, 6).reshape(T * Hp * Wp, t_stride * patch * patch * 3)
    return np.ascontiguousarray(x), (T, Hp, Wp)


def _layernorm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return (x - x.mean(-1, keepdim=True)) / (x.var(-1, keepdim=True, unbiased=False) + eps).sqrt()


def _rmsnorm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_3d(x: torch.Tensor, grid: tuple, theta: float = 10000.0) -> torch.Tensor:
    """Wan-style 3-D RoPE on [..., N, D]: head dim split t : h : w = D - 4(D//6) : 2(D//6) : 2(D//6)."""
    D = x.shape[-1]
    dh = 2 * (D // 6)
    dims = [D - 2 * dh, dh, dh]
    T, Hp, Wp = grid
    pos = torch.stack(torch.meshgrid(torch.arange(T), torch.arange(Hp), torch.arange(Wp), indexing="ij"), -1)
    pos = pos.reshape(-1, 3).double()
    angles = []
    for axis, d in enumerate(dims):
        freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles.append(pos[:, axis, None] * freqs[None, :])
    ang = torch.cat(angles, -1)  # [N, D/2]
    cos, sin = ang.cos().float(), ang.sin().float()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


def build_probe(cfg: ProbeConfig | None = None, **overrides) -> Probe:
    """Build Q, K, V [1, H, N, D] for one clip (see the module docstring)."""
    cfg = ProbeConfig(**{**asdict(cfg or ProbeConfig()), **overrides})
    frames = load_frames(cfg.clip, max_frames=cfg.latent_frames * cfg.t_stride)
    x, grid = patchify(frames, cfg.patch, cfg.t_stride, cfg.latent_frames)
    gen = torch.Generator().manual_seed(cfg.seed)
    z = torch.from_numpy(x)
    z = (z - z.mean(0)) / z.std()  # standardised pixels (one global scale keeps colour contrasts)
    if cfg.sigma > 0:
        z = (1 - cfg.sigma) * z + cfg.sigma * torch.randn(z.shape, generator=gen)
    N, d_in = z.shape
    w1 = torch.randn(d_in, cfg.hidden, generator=gen)
    h = torch.nn.functional.gelu(_layernorm(z) @ w1 / math.sqrt(d_in))
    a = _layernorm(h)  # [N, hidden]
    if cfg.hidden_noise > 0:  # a diffusion-noise level seen by the attention: mixed, then the pre-attention norm
        eps = torch.randn(a.shape, generator=torch.Generator().manual_seed(cfg.seed + 7919))
        a = _layernorm((1 - cfg.hidden_noise) * a + cfg.hidden_noise * eps)

    H, D = cfg.heads, cfg.head_dim
    qs, ks, vs, outl, spikes = [], [], [], [], []
    meta = {"c": [], "gain": []}
    for _ in range(H):
        wq = torch.randn(cfg.hidden, D, generator=gen) / math.sqrt(cfg.hidden)
        wk2 = torch.randn(cfg.hidden, D, generator=gen) / math.sqrt(cfg.hidden)
        wv = torch.randn(cfg.hidden, D, generator=gen) / math.sqrt(cfg.hidden)
        c = 0.5 + 0.4 * torch.rand((), generator=gen).item()
        g = math.sqrt(1.0 + 1.5 * torch.rand((), generator=gen).item()) * cfg.gain_scale
        wk = c * wq + math.sqrt(1 - c * c) * wk2
        q = g * _rmsnorm(a @ wq)
        k = g * _rmsnorm(a @ wk)
        v = a @ wv
        # value outliers: a few content-coherent tokens, spiking in a few head-specific channels
        direction = torch.randn(cfg.hidden, generator=gen)
        score = a @ direction
        n_out = max(1, int(round(cfg.outlier_frac * N)))
        tok = torch.zeros(N, dtype=torch.bool)
        tok[score.topk(n_out).indices] = True
        ch = torch.randperm(D, generator=gen)[: cfg.outlier_channels]
        sign = torch.where(torch.rand(cfg.outlier_channels, generator=gen) < 0.5, -1.0, 1.0)
        rms = v.pow(2).mean().sqrt()
        v[tok.nonzero()[:, 0][:, None], ch[None, :]] += cfg.outlier_gain * rms * sign[None, :]
        qs.append(rope_3d(q, grid, cfg.rope_theta))
        ks.append(rope_3d(k, grid, cfg.rope_theta))
        vs.append(v)
        outl.append(tok)
        spikes.append(ch)
        meta["c"].append(c)
        meta["gain"].append(g)
    stack = lambda xs: torch.stack(xs)[None].contiguous()  # noqa: E731
    return Probe(cfg, stack(qs), stack(ks), stack(vs), grid, torch.stack(outl), torch.stack(spikes), meta)


def cube_order(grid: tuple, cube=(2, 8, 8)) -> torch.Tensor:
    """Fixed spatiotemporal cube order (DeltaQuant-like): tokens sorted by (cube index, position in
    cube), cubes of 2 x 8 x 8 = 128 tokens in (t, h, w); edge cubes are partial. Returns perm [N]."""
    T, Hp, Wp = grid
    ct, ch, cw = cube
    t, y, x = torch.meshgrid(torch.arange(T), torch.arange(Hp), torch.arange(Wp), indexing="ij")
    nby, nbx = -(-Hp // ch), -(-Wp // cw)
    cube_id = ((t // ct) * nby + y // ch) * nbx + x // cw
    inner = ((t % ct) * ch + y % ch) * cw + x % cw
    key = cube_id.reshape(-1) * (ct * ch * cw) + inner.reshape(-1)
    return torch.argsort(key, stable=True)


if __name__ == "__main__":  # quick look: python -m vc_attention.kernels.fidelity.probes
    import time

    for clip in CLIPS:
        t0 = time.time()
        p = build_probe(clip=clip)
        print(clip, "grid", p.grid, "N", p.n, "q", tuple(p.q.shape), f"{time.time() - t0:.1f}s")
