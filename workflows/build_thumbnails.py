"""The template browser's thumbnails: workflows/<name>.jpg beside each workflow (ComfyUI serves a
pack's workflows/ folder and shows <name>.jpg as the thumbnail).

    python workflows/build_thumbnails.py                      # the three template-derived workflows
    python workflows/build_thumbnails.py --screenshots DIR    # also the A/B and LongCat-Video ones

Each is a picture of something real:

- a workflow derived from one of ComfyUI's templates: the middle frame of that template's own result
  clip (``<template>-1.webp`` of the installed comfyui-workflow-templates-media-video package);
- vc_ab_wan2_2_5B_compare: the A/B viewer on the Compare node after a tiny render, as the browser test
  screenshots it (``viewer_node.png`` in $VC_TEST_ARTIFACTS, see tests/web/test_viewer.py);
- vc_longcat_video_t2v: the workflow's VC-Attention node as ComfyUI draws it after the template is
  opened (``template_vc_longcat_video_t2v.png``, same test).

Square, SIZE pixels (a clip frame's centre, a screenshot whole on a dark ground), JPEG: well under
100 KB each.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from importlib import resources

from PIL import Image, ImageOps, ImageSequence

HERE = pathlib.Path(__file__).resolve().parent
MEDIA_PACKAGE = "comfyui_workflow_templates_media_video"
SIZE = 320
QUALITY = 82
SCREENSHOTS = {"vc_ab_wan2_2_5B_compare": "viewer_node.png",
               "vc_longcat_video_t2v": "template_vc_longcat_video_t2v.png"}


def square(img: Image.Image) -> Image.Image:
    """The centre square, scaled to SIZE."""
    w, h = img.size
    side = min(w, h)
    box = ((w - side) // 2, (h - side) // 2, (w - side) // 2 + side, (h - side) // 2 + side)
    return img.convert("RGB").crop(box).resize((SIZE, SIZE), Image.LANCZOS)


def template_frame(template: str) -> Image.Image:
    """The middle frame of a ComfyUI template's result clip."""
    try:
        path = resources.files(MEDIA_PACKAGE) / "templates" / f"{template}-1.webp"
    except ModuleNotFoundError:
        sys.exit(f"{MEDIA_PACKAGE} is not installed: pip install {MEDIA_PACKAGE.replace('_', '-')}")
    with Image.open(path) as clip:
        frames = [f.convert("RGB") for f in ImageSequence.Iterator(clip)]
    return frames[len(frames) // 2]


def source_template(workflow: pathlib.Path) -> str | None:
    """The ComfyUI template a workflow was derived from (build_workflows.py records it), or None."""
    derived = json.loads(workflow.read_text(encoding="utf-8"))["extra"]["vc_attention"]["derived_from"]
    if not derived.startswith("comfyui-workflow-templates"):
        return None
    return derived.rsplit(": ", 1)[1].removesuffix(".json")


def letterbox(img: Image.Image) -> Image.Image:
    """The whole picture, scaled into a SIZE square on ComfyUI's dark background."""
    return ImageOps.pad(img.convert("RGB"), (SIZE, SIZE), Image.LANCZOS, color=(24, 24, 24))


def save(img: Image.Image, name: str) -> None:
    out = HERE / f"{name}.jpg"
    img.save(out, "JPEG", quality=QUALITY, optimize=True, progressive=True)
    print(f"wrote {out} ({out.stat().st_size // 1024} KB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--screenshots", type=pathlib.Path,
                        help="the browser test's artefacts folder (for the A/B and LongCat-Video thumbnails)")
    args = parser.parse_args()
    for workflow in sorted(HERE.glob("*.json")):
        name = workflow.stem
        template = source_template(workflow)
        if template and name not in SCREENSHOTS:
            save(square(template_frame(template)), name)
        elif args.screenshots:
            shot = args.screenshots / SCREENSHOTS[name]
            if not shot.exists():
                print(f"{name}: {shot} not found (run tests/web/test_viewer.py with "
                      f"VC_TEST_ARTIFACTS={args.screenshots}); left as it is")
                continue
            with Image.open(shot) as img:
                save(letterbox(img), name)


if __name__ == "__main__":
    main()
