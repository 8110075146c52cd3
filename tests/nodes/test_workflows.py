"""The shared workflows load in real ComfyUI: every node type known, every link valid, our nodes'
widget values valid for their schema, and the files are what build_workflows.py derives."""

import importlib.util
import json
import pathlib

import pytest

from comfy_harness import REPO

FOLDER = REPO / "workflows"
FILES = sorted(FOLDER.glob("*.json"))
# Nodes that live only in the front end (no Python class).
FRONTEND_ONLY = {"MarkdownNote", "Note", "Reroute", "PrimitiveNode"}
SUBGRAPH_IO = (-10, -20)  # a subgraph's input and output nodes
EXPECTED = {"vc_wan2_2_14B_t2v.json": 2, "vc_wan2_2_5B_ti2v.json": 1,
            "vc_hunyuan_video_1.5_720p_t2v.json": 2, "vc_ab_wan2_2_5B_compare.json": 1,
            "vc_longcat_video_t2v.json": 1}  # LongCat: VC-Attention (WanVideoWrapper)
PATCH_TYPES = ("VCAttentionPatch", "VCAttentionWanVideoPatch")


def graphs(workflow):
    yield "root", workflow
    for sub in workflow.get("definitions", {}).get("subgraphs", []):
        yield sub["id"], sub


def links(graph):
    for link in graph["links"]:
        if isinstance(link, dict):
            yield (link["id"], link["origin_id"], link["origin_slot"], link["target_id"], link["target_slot"],
                   link["type"])
        else:
            yield tuple(link[:6])


def test_the_shared_workflows_exist():
    assert sorted(p.name for p in FILES) == sorted(EXPECTED)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_workflow_loads_and_validates(comfy_nodes, path):
    workflow = json.loads(path.read_text(encoding="utf-8"))
    subgraph_ids = {sub["id"] for _, sub in graphs(workflow) if sub is not workflow}
    # Nodes of another pack the workflow declares it needs (WanVideoWrapper's, for LongCat-Video);
    # their links are still checked against the types recorded in the file.
    external = set(workflow["extra"].get("vc_attention", {}).get("external_nodes", []))
    known = set(comfy_nodes.NODE_CLASS_MAPPINGS) | FRONTEND_ONLY | subgraph_ids | external
    patch_nodes = 0
    all_ids = []
    for name, graph in graphs(workflow):
        nodes = {n["id"]: n for n in graph["nodes"]}
        all_ids += list(nodes)
        for node in nodes.values():
            assert node["type"] in known, f"{path.name}/{name}: unknown node type {node['type']}"
            if node["type"] in (*PATCH_TYPES, "VCAttentionCompare"):
                check_widgets(comfy_nodes.NODE_CLASS_MAPPINGS[node["type"]], node)
                patch_nodes += node["type"] in PATCH_TYPES
        link_ids = set()
        for lid, origin, oslot, target, tslot, type_ in links(graph):
            assert lid not in link_ids, f"{path.name}/{name}: duplicate link {lid}"
            link_ids.add(lid)
            if origin not in SUBGRAPH_IO:
                src = nodes[origin]
                assert lid in (src["outputs"][oslot].get("links") or []), f"link {lid} not on its origin"
                assert src["outputs"][oslot]["type"] in (type_, "*"), f"link {lid}: type {type_}"
            if target not in SUBGRAPH_IO:
                dst = nodes[target]
                assert dst["inputs"][tslot]["link"] == lid, f"link {lid} not on its target"
                accepted = dst["inputs"][tslot]["type"].split(",")  # "FLOAT,INT": a union
                assert type_ in accepted or "*" in accepted + [type_] or "COMBO" in accepted, f"link {lid}"
        for node in nodes.values():  # every connected input and output refers to an existing link
            for i in node.get("inputs", []):
                assert i.get("link") is None or i["link"] in link_ids, f"{node['id']}: dangling input link"
            for o in node.get("outputs", []):
                assert set(o.get("links") or []) <= link_ids, f"{node['id']}: dangling output link"
    assert len(all_ids) == len(set(all_ids)), "node ids must be unique across the workflow"
    assert max(all_ids) <= workflow["last_node_id"]
    assert patch_nodes == EXPECTED[path.name]


# -- what a user sees when the workflow opens ----------------------------------------------------

# The LongCat-Video graph runs on WanVideoWrapper's nodes; these, by name, are the only node types of
# another pack that a shipped workflow may use.
WANVIDEOWRAPPER_NODES = {
    "WanVideoTorchCompileSettings", "WanVideoModelLoader", "WanVideoLoraSelect", "WanVideoSetLoRAs",
    "WanVideoBlockSwap", "WanVideoSetBlockSwap", "WanVideoVAELoader", "WanVideoTextEncodeCached",
    "WanVideoEmptyEmbeds", "WanVideoSamplerSettings", "WanVideoSamplerFromSettings", "WanVideoDecode"}
OTHER_PACKS = {"vc_longcat_video_t2v.json": WANVIDEOWRAPPER_NODES}
# The output a workflow is about: the A/B graph's is the comparison (its BF16 Save Video is the
# unpatched reference), the others' the rendered video.
MAIN_OUTPUT = {"vc_ab_wan2_2_5B_compare.json": "VCAttentionCompare"}
MODEL_TYPES = {"MODEL", "WANVIDEOMODEL", "*"}  # "*": the 14B template's model switches
ACTIVE, MUTED = 0, 2  # LiteGraph node modes (4: bypassed, passes its inputs through)
TITLE_HEIGHT = 30  # LiteGraph.NODE_TITLE_HEIGHT in ComfyUI's front end: drawn above a node's pos
COLLAPSED_WIDTH = 80  # LiteGraph.NODE_COLLAPSED_WIDTH


def flat_graph(workflow):
    """Every node of the workflow and its subgraphs as (graph id, node id) -> node, and the links
    between them, (origin, target, type): a subgraph node is joined to its definition's input and
    output nodes (type None: any), so that paths run through subgraphs."""
    nodes, edges = {}, []
    subgraph_ids = {sub["id"] for _, sub in graphs(workflow) if sub is not workflow}
    for gid, graph in graphs(workflow):
        for node in graph["nodes"]:
            nodes[gid, node["id"]] = node
            if node["type"] in subgraph_ids:
                edges += [((gid, node["id"]), (node["type"], -10), None), ((node["type"], -20), (gid, node["id"]), None)]
        edges += [((gid, o), (gid, t), type_) for _, o, _, t, _, type_ in links(graph)]
    return nodes, edges


def reach(start, edges, nodes, forward=True, types=None):
    """Vertices reachable from ``start`` along edges (of ``types``, if given), never through a muted node."""
    seen, todo = {start}, [start]
    while todo:
        v = todo.pop()
        for a, b, type_ in edges:
            src, dst = (a, b) if forward else (b, a)
            if src != v or dst in seen or (types and type_ is not None and type_ not in types):
                continue
            if nodes.get(dst, {}).get("mode", ACTIVE) == MUTED:
                continue
            seen.add(dst)
            todo.append(dst)
    return seen


def is_output(comfy_nodes, node_type):
    cls = comfy_nodes.NODE_CLASS_MAPPINGS.get(node_type)
    if cls is None:
        return False
    if hasattr(cls, "GET_SCHEMA"):
        return bool(cls.GET_SCHEMA().is_output_node)
    return bool(getattr(cls, "OUTPUT_NODE", False))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_vc_nodes_are_active_and_between_the_loader_and_the_main_output(comfy_nodes, path):
    """Every VC-Attention node is active and lies on a model path: a model loader upstream (along
    MODEL links, through subgraphs), the workflow's main output downstream; and every active main
    output is reached from a VC-Attention node (opening the workflow renders with it)."""
    workflow = json.loads(path.read_text(encoding="utf-8"))
    nodes, edges = flat_graph(workflow)
    main_type = MAIN_OUTPUT.get(path.name, "SaveVideo")
    mains = {v for v, n in nodes.items() if n["type"] == main_type}
    assert mains and all(is_output(comfy_nodes, main_type) for _ in mains), f"no {main_type} output"
    ours = {v: n for v, n in nodes.items() if n["type"].startswith("VCAttention") and n["type"] != "VCAttentionCompare"}
    assert len(ours) == EXPECTED[path.name]
    for v, node in ours.items():
        name = f"{path.name}: {node.get('title', node['type'])} ({v[1]})"
        assert node.get("mode", ACTIVE) == ACTIVE, f"{name} is not active (mode {node['mode']})"
        upstream = reach(v, edges, nodes, forward=False, types=MODEL_TYPES)
        assert any("Loader" in nodes[u]["type"] for u in upstream if u in nodes), f"{name}: no model loader upstream"
        assert mains & reach(v, edges, nodes), f"{name} does not feed the workflow's {main_type}"
    for m in mains:
        if nodes[m].get("mode", ACTIVE) == ACTIVE:
            assert any(m in reach(v, edges, nodes) for v in ours), f"{path.name}: {main_type} {m[1]} is unpatched"


def node_rect(node):
    """(left, top, right, bottom) on the canvas as LiteGraph draws the node: the title bar above pos;
    a collapsed node is its title bar, its width estimated from the title (8 px a character + 60)."""
    (x, y), (w, h) = node["pos"], node["size"]
    if node.get("flags", {}).get("collapsed"):
        title = node.get("title") or node["type"]
        return x, y - TITLE_HEIGHT, x + min(w, max(COLLAPSED_WIDTH, 8 * len(title) + 2 * TITLE_HEIGHT)), y
    return x, y - TITLE_HEIGHT, x + w, y + h


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_node_overlaps_another(path):
    workflow = json.loads(path.read_text(encoding="utf-8"))
    for name, graph in graphs(workflow):
        rects = [(n, node_rect(n)) for n in graph["nodes"]]
        for i, (a, ra) in enumerate(rects):
            for b, rb in rects[i + 1:]:
                overlap = ra[0] < rb[2] and rb[0] < ra[2] and ra[1] < rb[3] and rb[1] < ra[3]
                assert not overlap, (f"{path.name}/{name}: {a['type']} {a['id']} at {a['pos']} and "
                                     f"{b['type']} {b['id']} at {b['pos']} overlap")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_node_is_cores_or_this_packs(comfy_nodes, path):
    """ComfyUI here runs with --disable-all-custom-nodes: its mappings are core's and this pack's.
    The only exception is named above (WanVideoWrapper's nodes, in the LongCat graph)."""
    workflow = json.loads(path.read_text(encoding="utf-8"))
    subgraph_ids = {sub["id"] for _, sub in graphs(workflow) if sub is not workflow}
    allowed = set(comfy_nodes.NODE_CLASS_MAPPINGS) | FRONTEND_ONLY | subgraph_ids | OTHER_PACKS.get(path.name, set())
    types = {n["type"] for _, graph in graphs(workflow) for n in graph["nodes"]}
    assert types <= allowed, f"{path.name}: node types of other packs: {sorted(types - allowed)}"


def test_every_expert_is_patched_before_model_sampling():
    workflow = json.loads((FOLDER / "vc_wan2_2_14B_t2v.json").read_text(encoding="utf-8"))
    (sub,) = workflow["definitions"]["subgraphs"]
    nodes = {n["id"]: n for n in sub["nodes"]}
    feeds = [nodes[t]["type"] for _, o, _, t, _, _ in links(sub) if o in nodes and nodes[o]["type"] == "VCAttentionPatch"]
    assert feeds == ["ModelSamplingSD3", "ModelSamplingSD3"]


def check_widgets(node_cls, node):
    """widgets_values against the node's schema: one per widget input, in order, each valid."""
    from comfy_api.latest import io

    schema = node_cls.GET_SCHEMA()
    widgets = [i for i in schema.inputs if isinstance(i, (io.Combo.Input, io.Int.Input, io.Float.Input,
                                                           io.String.Input, io.Boolean.Input))]
    values = node["widgets_values"]
    assert len(values) == len(widgets), f"{node['type']}: {len(values)} widget values for {len(widgets)} widgets"
    for spec, value in zip(widgets, values):
        if isinstance(spec, io.Combo.Input):
            assert value in spec.options, f"{spec.id}={value!r} not in {spec.options}"
        elif isinstance(spec, (io.Int.Input, io.Float.Input)):
            assert isinstance(value, (int, float)) and spec.min <= value <= spec.max, f"{spec.id}={value!r}"
            if isinstance(spec, io.Int.Input):
                assert isinstance(value, int), f"{spec.id}={value!r} is not an int"
        elif isinstance(spec, io.String.Input):
            assert isinstance(value, str)
    assert [i["name"] for i in node["inputs"]] == [i.id for i in schema.inputs if i not in widgets]


def test_files_are_what_the_generator_derives(comfy_nodes):
    spec = importlib.util.spec_from_file_location("build_workflows", FOLDER / "build_workflows.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    try:
        version = build.templates_version()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"comfyui-workflow-templates-json not installed ({e}); cannot rebuild")
    for name in build.WORKFLOWS:
        committed = (FOLDER / name).read_text(encoding="utf-8")
        recorded = json.loads(committed)["extra"]["vc_attention"]["derived_from"]
        if f" {version}:" not in recorded:
            pytest.skip(f"installed templates {version}, files built from {recorded}")
        assert build.render(build.build_workflow(name)) == committed, f"{name} differs from build_workflows.py's output"


def test_pack_is_loadable_by_comfyui_under_its_folder_name(tmp_path):
    """nodes.load_custom_node on a folder with another name (as ComfyUI loads custom_nodes/*):
    a fresh process, so the pack's kernels are not imported twice in this one."""
    import subprocess
    import sys

    from comfy_harness import COMFYUI_PATH

    link = tmp_path / "ComfyUI-VC-Attention"
    link.symlink_to(REPO, target_is_directory=True)
    script = f"""
import asyncio, sys
sys.path.insert(0, {str(COMFYUI_PATH)!r})
sys.argv = ["main.py", "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import nodes
ok = asyncio.run(nodes.load_custom_node({str(link)!r}))
cls = nodes.NODE_CLASS_MAPPINGS.get("VCAttentionPatch")
print("RESULT", ok, sorted(k for k in nodes.NODE_CLASS_MAPPINGS if k.startswith("VCAttention")),
      nodes.NODE_DISPLAY_NAME_MAPPINGS.get("VCAttentionPatch"), cls.__module__ if cls else None)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=str(COMFYUI_PATH))
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, out.stderr[-3000:]
    assert ("RESULT True ['VCAttentionCompare', 'VCAttentionEnvironment', 'VCAttentionPatch', "
            "'VCAttentionWanVideoPatch'] VC-Attention Patch") in line, line
    assert "ComfyUI-VC-Attention" in line  # imported under the folder's name, relative imports work


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_workflow_has_a_thumbnail_and_a_one_line_description(path):
    """What the template browser shows (tests/web checks it shows): <name>.jpg beside the workflow,
    small, and a title and a single line in extra.vc_attention (no "-" or "_": shown as spaces)."""
    from PIL import Image

    thumb = path.with_suffix(".jpg")
    assert thumb.exists() and thumb.stat().st_size < 100_000, thumb
    with Image.open(thumb) as im:
        assert im.format == "JPEG" and im.size[0] == im.size[1] >= 256
    info = json.loads(path.read_text(encoding="utf-8"))["extra"]["vc_attention"]
    assert 0 < len(info["title"]) <= 32 and "\n" not in info["title"]
    assert 20 < len(info["description"]) <= 160 and not set("\n-_") & set(info["description"])
