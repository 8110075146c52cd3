"""Derive workflows/vc_longcat_video_t2v.json from WanVideoWrapper's own LongCat example.

    WANVIDEOWRAPPER_PATH=/path/to/ComfyUI-WanVideoWrapper python workflows/build_longcat_workflow.py

Source: ``example_workflows/LongCat_TI2V_example_01.json`` of kijai/ComfyUI-WanVideoWrapper (read
from the checkout at WANVIDEOWRAPPER_PATH, never copied into this repository). Kept: its first
segment's nodes as they are (model loader with its compile settings, distill LoRA, block swap, VAE,
cached text encoder, empty embeds, sampler settings + sampler, decode, the model-links note), wired
directly: the example's Set/Get/constant nodes (KJNodes), its scheduler preview, the I2V start image
and the continuation segments are left out (T2V: the example's own note says "For T2V disconnect the
extra_latents"), and its VideoHelperSuite output is replaced by core CreateVideo + SaveVideo. Added:
**VC-Attention (WanVideoWrapper)** between the model (after LoRA and block swap) and the sampler
settings, and a note. Widget values of kept nodes are the example's.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
# Layout helpers (node rectangles, free positions) shared with build_workflows.py.
_spec = importlib.util.spec_from_file_location("build_workflows", HERE / "build_workflows.py")
layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout)
OUT = HERE / "vc_longcat_video_t2v.json"
SOURCE = "example_workflows/LongCat_TI2V_example_01.json"
# Upstream commit of the checkout this file was built from (recorded in the JSON's extra info).
UPSTREAM = "kijai/ComfyUI-WanVideoWrapper@60a387579e2e1c96591598e4caf3465a7aaaf443"

KEEP = [112, 71, 169, 123, 104, 103, 108, 287, 282, 288, 284, 283, 187]
PATCH, CREATE, SAVE, NOTE_ID = 900, 901, 902, 903
# The node's widget values in input order: bits, grouping_window, refresh_every, clusters, expcast,
# bf16_first_blocks, bf16_last_blocks, bf16_until, backend, pv_format (the node's defaults).
PATCH_WIDGETS = ["8", 0.25, 4, 64, "auto", 0, 0, 0.0, "auto", "auto"]
# (origin id, origin slot, target id, target input name, type)
LINKS = [
    (112, 0, 71, "compile_args", "WANCOMPILEARGS"),
    (169, 0, 123, "lora", "WANVIDLORA"),
    (71, 0, 123, "model", "WANVIDEOMODEL"),
    (123, 0, 103, "model", "WANVIDEOMODEL"),
    (104, 0, 103, "block_swap_args", "BLOCKSWAPARGS"),
    (103, 0, PATCH, "model", "WANVIDEOMODEL"),
    (PATCH, 0, 288, "model", "WANVIDEOMODEL"),
    (282, 0, 288, "image_embeds", "WANVIDIMAGE_EMBEDS"),
    (287, 0, 288, "text_embeds", "WANVIDEOTEXTEMBEDS"),
    (288, 0, 284, "sampler_inputs", "SAMPLER_ARGS"),
    (284, 0, 283, "samples", "LATENT"),
    (108, 0, 283, "vae", "WANVAE"),
    (283, 0, CREATE, "images", "IMAGE"),
    (CREATE, 0, SAVE, "video", "VIDEO"),
]
NOTE = ("## VC-Attention for LongCat-Video\n\n**VC-Attention (WanVideoWrapper)** sits between the "
        "model (after LoRA and block swap) and the sampler: the self-attention over the whole sequence "
        "runs low-bit (INT8 Q/K, FP8 V residual with V-Smooth, FP8 P); condition tokens, cross-attention "
        "and sparse paths keep the loader's attention mode. It clones the model and is active only while "
        "the sampler runs. Bypass it (Ctrl+B) to render with the pack's attention.\n\nBased on "
        f"WanVideoWrapper's `{SOURCE}` (first segment, T2V).")


def our_nodes(kept: list[dict], y: float) -> list[dict]:
    """Our nodes, placed where they overlap none of ``kept``: the patch and its note above the sampler
    column, CreateVideo and SaveVideo right of the example's nodes at the sampler's height."""
    right = max(layout.node_rect(n)[2] for n in kept) + 2 * layout.MARGIN
    patch_pos = layout.free_pos(kept, [1232, y - layout.PATCH_SIZE[1] - 60], layout.PATCH_SIZE)
    note_pos = layout.free_pos(kept, [1232, patch_pos[1] - 290 - 2 * layout.MARGIN], [420, 260])
    patch = {"id": PATCH, "type": "VCAttentionWanVideoPatch", "pos": patch_pos, "size": layout.PATCH_SIZE,
             "flags": {}, "order": 0, "mode": 0,
             "inputs": [{"name": "model", "type": "WANVIDEOMODEL", "link": None}],
             "outputs": [{"name": "model", "type": "WANVIDEOMODEL", "slot_index": 0, "links": []}],
             "properties": {"Node name for S&R": "VCAttentionWanVideoPatch", "cnr_id": "vc-attention",
                            "ver": "0.1.0"},
             "widgets_values": list(PATCH_WIDGETS)}
    create = {"id": CREATE, "type": "CreateVideo", "pos": [right, y], "size": [270, 80], "flags": {},
              "order": 0, "mode": 0,
              "inputs": [{"name": "images", "type": "IMAGE", "link": None},
                         {"name": "audio", "shape": 7, "type": "AUDIO", "link": None}],
              "outputs": [{"name": "VIDEO", "type": "VIDEO", "links": []}],
              "properties": {"Node name for S&R": "CreateVideo"}, "widgets_values": [15.0, 8]}
    save = {"id": SAVE, "type": "SaveVideo", "pos": [right + 270 + 2 * layout.MARGIN, y], "size": [400, 400], "flags": {}, "order": 0,
            "mode": 0, "inputs": [{"name": "video", "type": "VIDEO", "link": None}], "outputs": [],
            "properties": {"Node name for S&R": "SaveVideo"},
            "widgets_values": ["video/LongCatVideo_vc", "auto", "auto"]}
    note = {"id": NOTE_ID, "type": "MarkdownNote", "pos": note_pos, "size": [420, 260], "flags": {},
            "order": 0, "mode": 0, "inputs": [], "outputs": [], "properties": {}, "widgets_values": [NOTE],
            "color": "#432", "bgcolor": "#653"}
    return [patch, create, save, note]


def build(example: dict, example_sha256: str = "") -> dict:
    by_id = {n["id"]: n for n in example["nodes"]}
    nodes = [copy.deepcopy(by_id[i]) for i in KEEP]
    y = by_id[288]["pos"][1]
    nodes += our_nodes(nodes, y)
    for node in nodes:  # unwire everything, then wire LINKS
        for i in node.get("inputs", []):
            i["link"] = None
        for o in node.get("outputs", []):
            o["links"] = []
    by_id = {n["id"]: n for n in nodes}
    links = []
    for lid, (origin, slot, target, name, type_) in enumerate(LINKS, start=1):
        by_id[origin]["outputs"][slot]["links"].append(lid)
        inputs = by_id[target]["inputs"]
        tslot = next(k for k, i in enumerate(inputs) if i["name"] == name)
        inputs[tslot]["link"] = lid
        links.append([lid, origin, slot, target, tslot, type_])
    for order, node in enumerate(nodes):
        node["order"] = order
    return {
        "id": "vc-longcat-video-t2v",
        "revision": 0,
        "last_node_id": max(by_id),
        "last_link_id": len(links),
        "nodes": nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {
            "ds": {"scale": 0.6, "offset": [700, 1900]},
            "vc_attention": {
                # The template browser's title and line (web/vc_attention.js); no "-" or "_" in the
                # line, which ComfyUI shows as spaces.
                "title": "VC-Attention · LongCat-Video",
                "description": "WanVideoWrapper's LongCat example (first segment, text to video) on VC "
                               "Attention; needs ComfyUI WanVideoWrapper.",
                "derived_from": f"{UPSTREAM}: {SOURCE} (first segment, as T2V)",
                "source_sha256": example_sha256,
                "generator": "workflows/build_longcat_workflow.py",
                "requires": ["ComfyUI-WanVideoWrapper (kijai)"],
                "external_nodes": sorted({n["type"] for n in nodes if n["type"].startswith("WanVideo")}),
            },
        },
        "version": 0.4,
    }


def build_from(source: pathlib.Path) -> dict:
    data = source.read_bytes()
    return build(json.loads(data.decode("utf-8")), hashlib.sha256(data).hexdigest())


def render(workflow: dict) -> str:
    return json.dumps(workflow, indent=1, ensure_ascii=False) + "\n"


def main() -> None:
    if not os.environ.get("WANVIDEOWRAPPER_PATH"):
        sys.exit("set WANVIDEOWRAPPER_PATH to a checkout of kijai/ComfyUI-WanVideoWrapper")
    source = pathlib.Path(os.environ["WANVIDEOWRAPPER_PATH"]) / SOURCE
    if not source.exists():
        sys.exit(f"{source} not found: set WANVIDEOWRAPPER_PATH to a checkout of kijai/ComfyUI-WanVideoWrapper")
    OUT.write_text(render(build_from(source)), encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
