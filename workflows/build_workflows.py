"""Derive the shared VC-Attention workflows from ComfyUI's official templates.

    pip install comfyui-workflow-templates-json   # ComfyUI's requirements already include it
    python workflows/build_workflows.py   # rewrites workflows/vc_*.json

The templates are read from the installed package (never copied into this repository); the output
is the template with our nodes inserted on the model links (active, placed where they overlap no
node), a note, the template browser's title and description, and nothing else changed but the
size of the template nodes the front end draws larger than stored (``settle``):

- vc_wan2_2_14B_t2v.json: both experts patched (inside the template's subgraph), each between its
  model switch and ModelSamplingSD3.
- vc_wan2_2_5B_ti2v.json: UNETLoader -> VC-Attention Patch -> ModelSamplingSD3.
- vc_hunyuan_video_1.5_720p_t2v.json: UNETLoader -> VC-Attention Patch -> EasyCache (both the
  720p model and the optional, bypassed 1080p super-resolution model).
- vc_ab_wan2_2_5B_compare.json: the 5B template rendered twice with one fixed seed, BF16 and
  VC-Attention, decoded frames into VC-Attention Compare, the labelled side-by-side saved.

tests/nodes/test_workflows.py checks that these files equal this script's output and load and
validate in real ComfyUI.
"""

from __future__ import annotations

import copy
import json
import pathlib
import sys
from importlib import resources

HERE = pathlib.Path(__file__).resolve().parent
TEMPLATE_PACKAGE = "comfyui_workflow_templates_json"

# The patch node's widget values in input order: bits, grouping_window, refresh_every, clusters,
# expcast, bf16_first_blocks, bf16_last_blocks, bf16_until, backend, pv_format (the node's defaults).
PATCH_WIDGETS = ["8", 0.25, 4, 64, "auto", 0, 0, 0.0, "auto", "auto"]
PATCH_SIZE = [320, 390]  # fits the widgets and the report badge, as the front end lays them out
COMPARE_SIZE = [440, 560]  # the A/B viewer's minimum (web/vc_attention.js)
TITLE_HEIGHT = 30  # LiteGraph.NODE_TITLE_HEIGHT: the title bar is drawn above a node's pos
MARGIN = 20  # free space kept around the nodes this script places
NOTE = ("## VC-Attention\n\nThe **VC-Attention Patch** node sits between the model loader and the "
        "sampler: INT8 Q/K, FP8 V residual (V-Smooth) and FP8 P (ExpCast) on the self-attention of "
        "every block. It clones the model. After a run it shows the backend used, the calls patched "
        "and the grouping steps. Bypass it (Ctrl+B) to render with ComfyUI's attention.")


def load_template(name: str) -> dict:
    try:
        path = resources.files(TEMPLATE_PACKAGE) / "templates" / name
        return json.loads(path.read_text(encoding="utf-8"))
    except ModuleNotFoundError:
        sys.exit(f"{TEMPLATE_PACKAGE} is not installed: pip install {TEMPLATE_PACKAGE.replace('_', '-')}")


# -- graph editing (root graphs store links as lists, subgraphs as dicts) -----------------------

class Graph:
    """One node graph of a workflow: the root, or a subgraph definition."""

    def __init__(self, data: dict, counters: "Counters"):
        self.data = data
        self.counters = counters
        self.dict_links = bool(data["links"]) and isinstance(data["links"][0], dict)

    def node(self, node_id):
        return next(n for n in self.data["nodes"] if n["id"] == node_id)

    def links(self):
        """(id, origin, origin_slot, target, target_slot, type) for every link."""
        for link in self.data["links"]:
            if isinstance(link, dict):
                yield (link["id"], link["origin_id"], link["origin_slot"], link["target_id"],
                       link["target_slot"], link["type"])
            else:
                yield tuple(link[:6])

    def _set_link(self, link_id, **fields):
        keys = ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type")
        for i, link in enumerate(self.data["links"]):
            if (link["id"] if isinstance(link, dict) else link[0]) == link_id:
                if isinstance(link, dict):
                    link.update(fields)
                else:
                    for k, v in fields.items():
                        link[keys.index(k)] = v
                return
        raise KeyError(link_id)

    def _add_link(self, link_id, origin, origin_slot, target, target_slot, type_):
        if self.dict_links:
            self.data["links"].append({"id": link_id, "origin_id": origin, "origin_slot": origin_slot,
                                       "target_id": target, "target_slot": target_slot, "type": type_})
        else:
            self.data["links"].append([link_id, origin, origin_slot, target, target_slot, type_])

    def links_max(self) -> int:
        return max((link[0] for link in self.links()), default=0)

    def add_node(self, node: dict) -> dict:
        self.data["nodes"].append(node)
        return node

    def insert_on_link(self, link_id, node_type, widgets, size, title=None, pos=None) -> dict:
        """origin -> target becomes origin -> new node -> target (MODEL in, MODEL out).

        The new node is active (mode 0) whatever its consumer's mode: a bypassed consumer (the
        HunyuanVideo template's EasyCache) must not make the patch bypassed. It is placed above the
        consumer (or at ``pos``), moved up until it overlaps no node.
        """
        _, origin, oslot, target, tslot, type_ = next(x for x in self.links() if x[0] == link_id)
        src, dst = self.node(origin), self.node(target)
        new_id, out_link = self.counters.node(), self.counters.link()
        pos = self.free_pos(pos or [dst["pos"][0], dst["pos"][1] - size[1] - 60], size)
        node = {
            "id": new_id, "type": node_type, "pos": pos, "size": size, "flags": {},
            "order": dst.get("order", 0), "mode": 0,
            "inputs": [{"name": "model", "type": type_, "link": link_id}],
            "outputs": [{"name": "MODEL", "type": type_, "slot_index": 0, "links": [out_link]}],
            "properties": {"Node name for S&R": node_type, "cnr_id": "vc-attention", "ver": "0.1.0"},
            "widgets_values": list(widgets),
        }
        if title:
            node["title"] = title
        self.add_node(node)
        self._set_link(link_id, target_id=new_id, target_slot=0)
        self._add_link(out_link, new_id, 0, target, tslot, type_)
        dst["inputs"][tslot]["link"] = out_link
        assert link_id in src["outputs"][oslot]["links"]
        return node

    def free_pos(self, pos, size) -> list:
        return free_pos(self.data["nodes"], pos, size)

    def model_links(self, origin_type=None, target_type=None):
        for lid, origin, _, target, _, type_ in list(self.links()):
            if type_ != "MODEL" or origin < 0 or target < 0:
                continue
            if origin_type and self.node(origin)["type"] != origin_type:
                continue
            if target_type and self.node(target)["type"] != target_type:
                continue
            yield lid


def node_rect(node: dict) -> tuple:
    """(left, top, right, bottom) of a node on the canvas, title bar included; a collapsed node is
    its title bar only (its width estimated from the title: 8 px a character plus two title heights)."""
    (x, y), (w, h) = node["pos"], node["size"]
    if node.get("flags", {}).get("collapsed"):
        title = node.get("title") or node["type"]
        return x, y - TITLE_HEIGHT, x + min(w, max(80, 8 * len(title) + 2 * TITLE_HEIGHT)), y
    return x, y - TITLE_HEIGHT, x + w, y + h


def overlaps(a, b, margin=0.0) -> bool:
    return a[0] < b[2] + margin and b[0] < a[2] + margin and a[1] < b[3] + margin and b[1] < a[3] + margin


def free_pos(nodes, pos, size) -> list:
    """``pos``, or the nearest position above it where a node of ``size`` overlaps none of ``nodes``
    (title bars and a margin included)."""
    x, y = pos
    while True:
        hit = next((r for r in map(node_rect, nodes)
                    if overlaps(r, (x, y - TITLE_HEIGHT, x + size[0], y + size[1]), MARGIN)), None)
        if hit is None:
            return [x, y]
        y = hit[1] - MARGIN - size[1]


class Counters:
    """Node and link ids are unique across a workflow and its subgraphs: one counter for all."""

    def __init__(self, workflow: dict):
        self.workflow = workflow
        self.states = [workflow] + [s["state"] for s in workflow.get("definitions", {}).get("subgraphs", [])]
        graphs = [workflow] + workflow.get("definitions", {}).get("subgraphs", [])
        self.last_node = max([workflow["last_node_id"]] + [n["id"] for g in graphs for n in g["nodes"]])
        self.last_link = max([workflow["last_link_id"]] + [Graph(g, self).links_max() for g in graphs])

    def node(self) -> int:
        self.last_node += 1
        self._sync()
        return self.last_node

    def link(self) -> int:
        self.last_link += 1
        self._sync()
        return self.last_link

    def _sync(self):
        self.workflow["last_node_id"] = self.last_node
        self.workflow["last_link_id"] = self.last_link
        for s in self.states[1:]:
            s["lastNodeId"] = self.last_node
            s["lastLinkId"] = self.last_link


def note(graph: Graph, pos, text=NOTE) -> None:
    size = [420, 200]
    graph.add_node({"id": graph.counters.node(), "type": "MarkdownNote", "pos": graph.free_pos(pos, size), "size": size,
                    "flags": {}, "order": 0, "mode": 0, "inputs": [], "outputs": [],
                    "properties": {}, "widgets_values": [text], "color": "#432", "bgcolor": "#653"})


def templates_version() -> str:
    from importlib.metadata import version

    return version(TEMPLATE_PACKAGE.replace("_", "-"))


def title(workflow: dict, name: str) -> dict:
    workflow = copy.deepcopy(workflow)
    workflow.pop("id", None)  # a new workflow, not the template
    workflow.setdefault("extra", {})["vc_attention"] = {
        "derived_from": f"{TEMPLATE_PACKAGE.replace('_', '-')} {templates_version()}: {name}",
        "generator": "workflows/build_workflows.py"}
    return workflow


# What the template browser shows for each workflow (web/vc_attention.js reads extra.vc_attention):
# a title that fits a card (about 28 characters) and one line. ComfyUI shows descriptions with "-" and "_" as spaces, so they have neither.
TEMPLATE_INFO = {
    "vc_wan2_2_14B_t2v.json": (
        "VC-Attention · Wan 2.2 14B T2V",
        "ComfyUI's Wan 2.2 14B text to video template, both experts on VC Attention (inside the subgraph)."),
    "vc_wan2_2_5B_ti2v.json": (
        "VC-Attention · Wan 2.2 5B TI2V",
        "ComfyUI's Wan 2.2 5B text/image to video template, the model on VC Attention."),
    "vc_hunyuan_video_1.5_720p_t2v.json": (
        "VC-Attention · HunyuanVideo 1.5",
        "ComfyUI's HunyuanVideo 1.5 720p text to video template, VC Attention on the 720p model "
        "and on the optional 1080p upscaler."),
    "vc_ab_wan2_2_5B_compare.json": (
        "VC-Attention A/B · Wan 2.2 5B",
        "One seed rendered with ComfyUI's attention and with VC Attention, side by side with per frame "
        "PSNR and SSIM."),
}


def describe(workflow: dict, name: str) -> dict:
    """The template browser's title and description, into the workflow's extra.vc_attention."""
    display, line = TEMPLATE_INFO[name]
    workflow["extra"]["vc_attention"].update(title=display, description=line)
    return workflow


# -- the workflows ------------------------------------------------------------------------------

def wan22_14b_t2v() -> dict:
    wf = title(load_template("video_wan2_2_14B_t2v.json"), "video_wan2_2_14B_t2v.json")
    counters = Counters(wf)
    patched = 0
    for sub in wf["definitions"]["subgraphs"]:
        g = Graph(sub, counters)
        for lid in list(g.model_links(target_type="ModelSamplingSD3")):
            # The expert a link feeds: KSamplerAdvanced with noise added first is the high-noise one.
            g.insert_on_link(lid, "VCAttentionPatch", PATCH_WIDGETS, PATCH_SIZE,
                             title=f"VC-Attention Patch (expert {patched + 1})")
            patched += 1
    assert patched == 2, f"expected two experts in the 14B template, patched {patched}"
    root = Graph(wf, counters)
    note(root, [-200, -600], NOTE + "\n\nBoth experts are patched inside the **Text to Video (Wan2.2)** "
                                    "subgraph (open it to change the settings).")
    return wf


def wan22_5b_ti2v() -> dict:
    wf = title(load_template("video_wan2_2_5B_ti2v.json"), "video_wan2_2_5B_ti2v.json")
    g = Graph(wf, Counters(wf))
    (lid,) = g.model_links("UNETLoader", "ModelSamplingSD3")
    g.insert_on_link(lid, "VCAttentionPatch", PATCH_WIDGETS, PATCH_SIZE)
    note(g, [-30, -330])
    return wf


def hunyuan15_720p_t2v() -> dict:
    wf = title(load_template("video_hunyuan_video_1.5_720p_t2v.json"), "video_hunyuan_video_1.5_720p_t2v.json")
    g = Graph(wf, Counters(wf))
    links = list(g.model_links("UNETLoader", "EasyCache"))
    assert len(links) == 2, links  # the 720p model and the 1080p super-resolution model
    for lid in links:
        loader = g.node(next(x[1] for x in g.links() if x[0] == lid))
        pos = None
        if loader.get("mode", 0) != 0:
            # The 1080p model sits in the template's bypassed "Video Upscale 1080P (Ctrl-B to
            # enable)" group. Our node is placed left of that group, active: Ctrl+B on the group
            # (bypassed -> active) must leave it active, not bypass it.
            group = next(gr["bounding"] for gr in wf["groups"] if "1080" in gr["title"])
            pos = [group[0] - PATCH_SIZE[0] - 2 * MARGIN, loader["pos"][1]]
        g.insert_on_link(lid, "VCAttentionPatch", PATCH_WIDGETS, PATCH_SIZE, pos=pos)
    note(g, [-400, -400])
    return wf


def ab_wan22_5b() -> dict:
    """BF16 and VC-Attention renders of one seed, compared."""
    wf = title(load_template("video_wan2_2_5B_ti2v.json"), "video_wan2_2_5B_ti2v.json")
    counters = Counters(wf)
    g = Graph(wf, counters)
    by_type = {}
    for n in wf["nodes"]:
        by_type.setdefault(n["type"], []).append(n)
    (loader,), (sampling,), (ksampler,), (decode,), (save_video,) = (
        by_type[t] for t in ("UNETLoader", "ModelSamplingSD3", "KSampler", "VAEDecode", "SaveVideo"))
    ksampler["widgets_values"][1] = "fixed"  # one seed for both renders
    ksampler["title"] = "KSampler (BF16 attention)"

    # Copies of the model-sampling -> sampler -> decode chain, fed by a patched model.
    def clone_node(node, dy):
        new = copy.deepcopy(node)
        new["id"] = counters.node()
        new["pos"] = [node["pos"][0], node["pos"][1] + dy]
        for i in new.get("inputs", []):
            i["link"] = None
        for o in new.get("outputs", []):
            o["links"] = []
        return g.add_node(new)

    dy = 700
    sampling2, ksampler2, decode2 = clone_node(sampling, dy), clone_node(ksampler, dy), clone_node(decode, dy)
    ksampler2["title"] = "KSampler (VC-Attention)"
    patch_id = counters.node()
    patch = g.add_node({
        "id": patch_id, "type": "VCAttentionPatch",
        "pos": g.free_pos([sampling["pos"][0] - 380, sampling["pos"][1] + dy + 40], PATCH_SIZE),
        "size": PATCH_SIZE, "flags": {}, "order": 0, "mode": 0,
        "inputs": [{"name": "model", "type": "MODEL", "link": None}],
        "outputs": [{"name": "MODEL", "type": "MODEL", "slot_index": 0, "links": []}],
        "properties": {"Node name for S&R": "VCAttentionPatch", "cnr_id": "vc-attention", "ver": "0.1.0"},
        "widgets_values": list(PATCH_WIDGETS)})

    def connect(src, sslot, dst, dslot):
        lid = counters.link()
        type_ = src["outputs"][sslot]["type"]
        g._add_link(lid, src["id"], sslot, dst["id"], dslot, type_)
        src["outputs"][sslot]["links"].append(lid)
        dst["inputs"][dslot]["link"] = lid
        return lid

    def source_of(node, slot):
        lid = node["inputs"][slot]["link"]
        _, origin, oslot, *_ = next(x for x in g.links() if x[0] == lid)
        return g.node(origin), oslot

    connect(loader, 0, patch, 0)
    connect(patch, 0, sampling2, 0)
    connect(sampling2, 0, ksampler2, 0)
    for slot in (1, 2, 3):  # positive, negative, latent: the same inputs as the BF16 sampler
        connect(*source_of(ksampler, slot), ksampler2, slot)
    connect(ksampler2, 0, decode2, 0)
    connect(*source_of(decode, 1), decode2, 1)  # the VAE

    compare = g.add_node({
        # Right of the template's Save Video, at its height.
        "id": counters.node(), "type": "VCAttentionCompare", "pos": g.free_pos(
            [max(n["pos"][0] + n["size"][0] for n in wf["nodes"]) + 2 * MARGIN, save_video["pos"][1]], COMPARE_SIZE),
        "size": COMPARE_SIZE, "flags": {}, "order": 0, "mode": 0,
        "inputs": [{"name": "reference", "type": "IMAGE", "link": None},
                   {"name": "test", "type": "IMAGE", "link": None}],
        "outputs": [{"name": "comparison", "type": "IMAGE", "slot_index": 0, "links": []},
                    {"name": "mean_psnr", "type": "FLOAT", "slot_index": 1, "links": []},
                    {"name": "mean_ssim", "type": "FLOAT", "slot_index": 2, "links": []},
                    {"name": "report", "type": "STRING", "slot_index": 3, "links": []}],
        "properties": {"Node name for S&R": "VCAttentionCompare", "cnr_id": "vc-attention", "ver": "0.1.0"},
        "widgets_values": ["BF16", "VC-Attention"]})
    save = g.add_node({
        "id": counters.node(), "type": "SaveImage", "pos": [compare["pos"][0] + COMPARE_SIZE[0] + 2 * MARGIN,
                                                            compare["pos"][1]],
        "size": [400, 300], "flags": {}, "order": 0, "mode": 0,
        "inputs": [{"name": "images", "type": "IMAGE", "link": None}], "outputs": [],
        "properties": {"Node name for S&R": "SaveImage", "cnr_id": "comfy-core", "ver": "0.3.45"},
        "widgets_values": ["vc_attention/compare"]})
    connect(decode, 0, compare, 0)
    connect(decode2, 0, compare, 1)
    connect(compare, 0, save, 0)
    note(g, [-30, -330], NOTE + "\n\nA/B: the same seed rendered with ComfyUI's attention (top) and "
                                "VC-Attention (bottom); **VC-Attention Compare** shows both side by side "
                                "with per-frame PSNR and SSIM.")
    return wf


WORKFLOWS = {
    "vc_wan2_2_14B_t2v.json": wan22_14b_t2v,
    "vc_wan2_2_5B_ti2v.json": wan22_5b_ti2v,
    "vc_hunyuan_video_1.5_720p_t2v.json": hunyuan15_720p_t2v,
    "vc_ab_wan2_2_5B_compare.json": ab_wan22_5b,
}


def render(workflow: dict) -> str:
    return json.dumps(workflow, indent=2, ensure_ascii=False) + "\n"


# Template nodes the front end (comfyui-frontend-package 1.47) draws larger than the templates store
# them, measured there (tests/web: LiteGraph's bounds once opened): CreateVideo's stored 78 px height
# overlaps the node under it by 2 px in the Wan 2.2 5B and HunyuanVideo templates.
FRONTEND_MIN_SIZE = {"CreateVideo": [270, 102]}


def settle(workflow: dict) -> dict:
    """Template nodes at their front-end size; one that then overlaps a neighbour moves up just
    enough (the generator fails, rather than guess, if there is no room)."""
    for graph in [workflow] + workflow.get("definitions", {}).get("subgraphs", []):
        for node in graph["nodes"]:
            need = FRONTEND_MIN_SIZE.get(node["type"])
            if need is None or (node["size"][0] >= need[0] and node["size"][1] >= need[1]):
                continue
            node["size"] = [max(node["size"][0], need[0]), max(node["size"][1], need[1])]
            others = [n for n in graph["nodes"] if n is not node]
            hit = [node_rect(n) for n in others if overlaps(node_rect(node), node_rect(n))]
            if hit:
                shift = max(node_rect(node)[3] - r[1] for r in hit) + 2  # clear the top of what it hits
                node["pos"] = [node["pos"][0], node["pos"][1] - shift]
                assert not any(overlaps(node_rect(node), node_rect(n)) for n in others), \
                    f"no room for {node['type']} {node['id']} at its front-end size"
    return workflow


def build_workflow(name: str) -> dict:
    return describe(settle(WORKFLOWS[name]()), name)


def main() -> None:
    for name in WORKFLOWS:
        (HERE / name).write_text(render(build_workflow(name)), encoding="utf-8")
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
