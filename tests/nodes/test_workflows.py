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
    for name, make in build.WORKFLOWS.items():
        committed = (FOLDER / name).read_text(encoding="utf-8")
        recorded = json.loads(committed)["extra"]["vc_attention"]["derived_from"]
        if f" {version}:" not in recorded:
            pytest.skip(f"installed templates {version}, files built from {recorded}")
        assert build.render(make()) == committed, f"{name} differs from build_workflows.py's output"


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
