"""The comparison node: two renders -> labelled side-by-side frames, per-frame PSNR and SSIM."""

from __future__ import annotations

import importlib.util
import logging
import math
import os

import torch
from comfy_api.latest import io, ui

# Frames per SSIM batch: bounds memory for long 720p clips (SSIM keeps several maps per frame).
SSIM_CHUNK = 8
SSIM_WINDOW = 11
SEPARATOR = 4  # pixels between the two panels
LPIPS_WEIGHTS = "alexnet-owt-7be5be79.pth"  # torchvision's AlexNet, which lpips(net="alex") loads

log = logging.getLogger("vc_attention")


def check_pair(reference: torch.Tensor, test: torch.Tensor) -> None:
    """Clear errors for inputs that cannot be compared frame by frame (IMAGE is [F, H, W, C])."""
    for name, x in (("reference", reference), ("test", test)):
        if x.ndim != 4:
            raise ValueError(f"VC-Attention Compare: {name} must be an IMAGE batch [frames, H, W, C], "
                             f"got shape {tuple(x.shape)}")
    if reference.shape[0] != test.shape[0]:
        raise ValueError(f"VC-Attention Compare: frame counts differ ({reference.shape[0]} vs "
                         f"{test.shape[0]}); render both with the same length and frame rate")
    if reference.shape[1:3] != test.shape[1:3]:
        raise ValueError(f"VC-Attention Compare: frame sizes differ ({reference.shape[2]}x{reference.shape[1]} "
                         f"vs {test.shape[2]}x{test.shape[1]}); render both at the same resolution")
    if reference.shape[3] != test.shape[3]:
        raise ValueError(f"VC-Attention Compare: channel counts differ ({reference.shape[3]} vs {test.shape[3]})")


def frame_psnr(reference: torch.Tensor, test: torch.Tensor) -> list[float]:
    """PSNR in dB per frame (peak 1.0), through kornia; inf for identical frames."""
    import kornia

    ref = reference.movedim(-1, 1).double()
    tst = test.movedim(-1, 1).double()
    return [float(kornia.metrics.psnr(tst[i:i + 1], ref[i:i + 1], max_val=1.0)) for i in range(ref.shape[0])]


def frame_ssim(reference: torch.Tensor, test: torch.Tensor) -> list[float]:
    """Mean SSIM per frame (11x11 Gaussian window, peak 1.0), through kornia."""
    import kornia

    out = []
    for i in range(0, reference.shape[0], SSIM_CHUNK):
        ref = reference[i:i + SSIM_CHUNK].movedim(-1, 1).float()
        tst = test[i:i + SSIM_CHUNK].movedim(-1, 1).float()
        out += kornia.metrics.ssim(tst, ref, SSIM_WINDOW, max_val=1.0).mean(dim=(1, 2, 3)).tolist()
    return out


def lpips_offline() -> tuple[bool, str]:
    """Whether LPIPS can run without a download, and why not."""
    if importlib.util.find_spec("lpips") is None:
        return False, "LPIPS not computed: the lpips package is not installed"
    weights = os.path.join(torch.hub.get_dir(), "checkpoints", LPIPS_WEIGHTS)
    if not os.path.exists(weights):
        return False, f"LPIPS not computed: AlexNet weights are not cached ({weights}); nothing is downloaded"
    return True, ""


def frame_lpips(reference: torch.Tensor, test: torch.Tensor) -> list[float]:
    import lpips

    net = lpips.LPIPS(net="alex", verbose=False)
    out = []
    with torch.no_grad():
        for i in range(0, reference.shape[0], SSIM_CHUNK):
            ref = reference[i:i + SSIM_CHUNK].movedim(-1, 1).float() * 2 - 1
            tst = test[i:i + SSIM_CHUNK].movedim(-1, 1).float() * 2 - 1
            out += net(tst, ref).flatten().tolist()
    return out


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: fixed-size bitmap font
        return ImageFont.load_default()


def label_strip(text: str, width: int, height: int) -> torch.Tensor:
    """A dark strip [height, width, 3] with ``text`` in white."""
    import numpy as np
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), (24, 24, 24))
    ImageDraw.Draw(img).text((6, height // 2), text, fill=(255, 255, 255), font=_font(max(10, int(height * 0.6))),
                             anchor="lm")
    return torch.from_numpy(np.asarray(img).copy()).float() / 255.0


def side_by_side(reference, test, ref_label: str, test_label: str, psnr: list[float], ssim: list[float]):
    """[F, strip + H, 2W + SEPARATOR, 3]: reference left, test right, labels and metrics on top."""
    f, h, w, _ = reference.shape
    strip = max(18, min(48, h // 12))
    ref = reference[..., :3].float()
    tst = test[..., :3].float()
    if ref.shape[-1] == 1:
        ref, tst = ref.expand(-1, -1, -1, 3), tst.expand(-1, -1, -1, 3)
    out = torch.zeros(f, strip + h, 2 * w + SEPARATOR, 3)
    out[:, strip:, :w] = ref
    out[:, strip:, w + SEPARATOR:] = tst
    left = label_strip(ref_label, w, strip)
    for i in range(f):
        out[i, :strip, :w] = left
        out[i, :strip, w + SEPARATOR:] = label_strip(
            f"{test_label}   PSNR {_db(psnr[i])}   SSIM {ssim[i]:.4f}", w, strip)
    return out


def _db(x: float) -> str:
    return "inf dB" if math.isinf(x) else f"{x:.2f} dB"


def summary(psnr: list[float], ssim: list[float], lpips_values: list[float] | None, lpips_note: str) -> str:
    worst = min(range(len(psnr)), key=lambda i: psnr[i])
    worst_s = min(range(len(ssim)), key=lambda i: ssim[i])
    finite = [p for p in psnr if not math.isinf(p)]
    # Mean PSNR over frames (the paper's convention); identical frames (inf) are left out of it.
    mean_psnr = sum(finite) / len(finite) if finite else math.inf
    lines = [f"frames: {len(psnr)}",
             f"PSNR mean {_db(mean_psnr)}, worst {_db(psnr[worst])} (frame {worst})"
             + (f", {len(psnr) - len(finite)} identical frames" if len(finite) < len(psnr) else ""),
             f"SSIM mean {sum(ssim) / len(ssim):.4f}, worst {ssim[worst_s]:.4f} (frame {worst_s})"]
    if lpips_values is not None:
        lines.append(f"LPIPS (alex) mean {sum(lpips_values) / len(lpips_values):.4f}, worst {max(lpips_values):.4f}")
    else:
        lines.append(lpips_note)
    lines.append("per-frame PSNR: " + " ".join(_db(p).replace(" dB", "") for p in psnr))
    return "\n".join(lines)


def _rgb(frames: torch.Tensor) -> torch.Tensor:
    x = frames[..., :3].float()
    return x.expand(-1, -1, -1, 3) if x.shape[-1] == 1 else x


def viewer_payload(reference, test, ref_label: str, test_label: str, psnr: list[float],
                   ssim: list[float]) -> dict:
    """What the A/B viewer (web/vc_attention.js) needs, as extra keys of the node's ui output.

    Both frame sets are written as temp PNGs (ComfyUI's temp folder, like PreviewImage; level 1
    compression, no metadata), served by ComfyUI's /view. PSNR of identical frames (inf, which JSON
    cannot carry) is sent as null. Every value is a list (ComfyUI concatenates ui outputs key by key).
    If the frames cannot be written, the viewer still gets the metrics.
    """
    out = {"vc_psnr": [None if math.isinf(p) else p for p in psnr], "vc_ssim": list(ssim),
           "vc_labels": [ref_label, test_label]}
    try:
        tag = os.urandom(3).hex()
        for key, frames in (("vc_reference", reference), ("vc_test", test)):
            out[key] = ui.ImageSaveHelper.save_images(_rgb(frames), filename_prefix=f"VCAttention_{key[3:]}_{tag}",
                                                      folder_type=io.FolderType.temp, cls=None, compress_level=1)
    except Exception as e:  # a full disk must not fail the comparison
        log.warning("VC-Attention Compare: frames for the viewer not written (%s)", e)
        out.pop("vc_reference", None)
    return out


def preview_images(image: torch.Tensor) -> dict:
    """The side-by-side frames as PreviewImage writes them (temp PNGs under "images"): shown on the node
    and kept in the run's history, where an API client reads them. A failed write (a full disk) is
    logged and leaves them out; the comparison and its report still stand."""
    try:
        return ui.PreviewImage(image).as_dict()
    except Exception as e:
        log.warning("VC-Attention Compare: side-by-side preview not written (%s)", e)
        return {}


class CompareUI(ui.PreviewText):
    """The node's ui output: the report text (as PreviewText shows it), the side-by-side preview
    and the viewer's payload; all of it lands in /history/<prompt_id>."""

    def __init__(self, text: str, preview: dict, viewer: dict):
        super().__init__(text)
        self.preview = preview
        self.viewer = viewer

    def as_dict(self):
        return {**super().as_dict(), **self.preview, **self.viewer}


class VCAttentionCompare(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="VCAttentionCompare",
            display_name="VC-Attention Compare",
            category="VC-Attention",
            description="Two renders of the same seed and prompt side by side, with per-frame PSNR and SSIM.",
            # An output node: a graph that ends in Compare runs, and shows the side-by-side and the report.
            is_output_node=True,
            inputs=[
                io.Image.Input("reference", tooltip="The reference render (e.g. BF16 attention), frames [F, H, W, C]."),
                io.Image.Input("test", tooltip="The render to judge (e.g. VC-Attention), same frame count and size."),
                io.String.Input("reference_label", default="BF16", tooltip="Label drawn over the reference frames."),
                io.String.Input("test_label", default="VC-Attention", tooltip="Label drawn over the test frames."),
            ],
            outputs=[
                io.Image.Output("comparison", tooltip="Reference left, test right, labelled, per-frame metrics on top."),
                io.Float.Output("mean_psnr", tooltip="Mean PSNR over frames in dB (identical frames excluded)."),
                io.Float.Output("mean_ssim", tooltip="Mean SSIM over frames."),
                io.String.Output("report", tooltip="The text shown on the node."),
            ],
        )

    @classmethod
    def execute(cls, reference, test, reference_label="BF16", test_label="VC-Attention") -> io.NodeOutput:
        check_pair(reference, test)
        psnr = frame_psnr(reference, test)
        ssim = frame_ssim(reference, test)
        ok, note = lpips_offline()
        lpips_values = frame_lpips(reference, test) if ok else None
        text = summary(psnr, ssim, lpips_values, note)
        finite = [p for p in psnr if not math.isinf(p)]
        mean_psnr = sum(finite) / len(finite) if finite else math.inf
        image = side_by_side(reference, test, reference_label, test_label, psnr, ssim)
        viewer = viewer_payload(reference, test, reference_label, test_label, psnr, ssim)
        return io.NodeOutput(image, mean_psnr, sum(ssim) / len(ssim), text,
                             ui=CompareUI(text, preview_images(image), viewer))
