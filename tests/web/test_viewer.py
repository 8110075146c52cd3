"""The A/B viewer (web/vc_attention.js) in a real browser against a running ComfyUI.

As a user would: real ComfyUI (found as tests/comfy_harness.py says) runs as a server on the CPU with
the pack in a custom_nodes folder (a symlink to this checkout, named as a git clone would be); the
ComfyUI page, opened in headless Chromium (Debian's /usr/bin/chromium through Playwright's Python
package, no browser download), loads an A/B workflow on a tiny random Wan 2.1 model and a tiny
random Wan VAE (loader -> KSampler and loader -> VC-Attention Patch -> KSampler, both decoded,
-> VC-Attention Compare) and queues it. Checked: the viewer appears on the comparison node after
the run, moving the wipe (slider and drag) changes what is shown (canvas pixels switch between the
reference and the test frame that the server wrote), the PSNR shown per frame equals the node's own
output (its ui payload and its text report), and the patch node's badge shows the run's report.
Also: the same graph with Compare as its only output, run through the HTTP API, leaves Compare's
report and side-by-side frames and the patch node's run report in /history/<prompt_id>; the template
browser shows every shipped workflow with its thumbnail, title and description; and every shipped
workflow, opened, has no overlapping nodes.

Screenshots go to $VC_TEST_ARTIFACTS (default: <tmp>/vc_attention_artifacts). The canvas (LiteGraph)
renderer is the default; VC_TEST_VUE_NODES=1 runs the same checks with the Vue ("Nodes 2.0") one. Skipped, with the
reason printed, without ComfyUI, Chromium (VC_CHROMIUM, default /usr/bin/chromium) or playwright.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import pytest

from comfy_harness import COMFYUI_PATH, REPO, comfyui_missing, unavailable

pytestmark = pytest.mark.comfyui

CHROMIUM = os.environ.get("VC_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = pathlib.Path(os.environ.get("VC_TEST_ARTIFACTS", pathlib.Path(tempfile.gettempdir()) / "vc_attention_artifacts"))
PACK_NAME = "ComfyUI-VC-Attention"


def _missing() -> str | None:
    why = comfyui_missing()
    if why:
        return why
    if not os.access(CHROMIUM, os.X_OK):
        return f"Chromium not found at {CHROMIUM} (apt-get install -y chromium, or set VC_CHROMIUM)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install playwright; no browser download needed)"
    return None


_MISSING = _missing()
if _MISSING:
    unavailable(f"tests/web: {_MISSING}", module_level=True)

from PIL import Image  # noqa: E402  (ComfyUI's requirements)

# Test-only conditioning (the real text encoders are far too big): random Wan text context.
TEST_NODES = '''
import torch

class VCTestConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1})}}
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, seed):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, 64, 4096, generator=g) * 0.1, {}]],)

NODE_CLASS_MAPPINGS = {"VCTestConditioning": VCTestConditioning}
'''

FRAMES = 5  # 2 latent frames (VAE decoding dominates the run on a CPU)
SAMPLER = dict(seed=7, steps=4, cfg=2.0, sampler_name="euler", scheduler="simple", denoise=1.0)
COMPARE_ID, PATCH_ID = "11", "6"
PROMPT = {
    "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan21.safetensors", "weight_dtype": "default"}},
    "2": {"class_type": "VCTestConditioning", "inputs": {"seed": 1}},
    "3": {"class_type": "VCTestConditioning", "inputs": {"seed": 2}},
    "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 80, "height": 64, "length": FRAMES,
                                                              "batch_size": 1}},
    "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0],
                                               "latent_image": ["4", 0], **SAMPLER}},
    PATCH_ID: {"class_type": "VCAttentionPatch", "inputs": {
        "model": ["1", 0], "bits": "8", "grouping_window": 0.25, "refresh_every": 4, "clusters": 8,
        "expcast": "auto", "bf16_first_blocks": 0, "bf16_last_blocks": 0, "bf16_until": 0.0,
        "backend": "reference"}},
    "7": {"class_type": "KSampler", "inputs": {"model": [PATCH_ID, 0], "positive": ["2", 0], "negative": ["3", 0],
                                               "latent_image": ["4", 0], **SAMPLER}},
    "8": {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_wan_vae.safetensors"}},
    "9": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["8", 0]}},
    "10": {"class_type": "VAEDecode", "inputs": {"samples": ["7", 0], "vae": ["8", 0]}},
    COMPARE_ID: {"class_type": "VCAttentionCompare", "inputs": {"reference": ["9", 0], "test": ["10", 0],
                                                                "reference_label": "BF16", "test_label": "VC 8-bit"}},
    "12": {"class_type": "PreviewImage", "inputs": {"images": [COMPARE_ID, 0]}},
}


# Builds the tiny models in a child process (ComfyUI imported on the CPU there, not in pytest's).
BUILD_MODELS = """
import pathlib
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
models = pathlib.Path(sys.argv[3])
sys.argv = ["main.py", "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.ldm.wan.vae as wan_vae
from comfy_harness import _init_weights, _save, build_wan

build_wan(models / "diffusion_models" / "tiny_wan21.safetensors", channels=16, seed=1)
# Tiny random Wan 2.1 VAE: VAELoader reads dim from the weights (num_res_blocks is fixed at 2).
vae = wan_vae.WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                     temperal_downsample=[False, True, True])
_init_weights(vae, 5)
_save(vae, models / "vae" / "tiny_wan_vae.safetensors")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """ComfyUI as a server on the CPU with the pack installed; yields its base URL."""
    root = tmp_path_factory.mktemp("comfy_web")
    custom = root / "custom_nodes"
    custom.mkdir()
    (custom / PACK_NAME).symlink_to(REPO, target_is_directory=True)
    (custom / "vc_test_nodes.py").write_text(TEST_NODES)
    models = root / "models"
    (models / "diffusion_models").mkdir(parents=True)
    (models / "vae").mkdir()
    subprocess.run([sys.executable, "-c", BUILD_MODELS, str(COMFYUI_PATH), str(REPO / "tests"), str(models)],
                   check=True, timeout=300)
    (root / "extra_models.yaml").write_text(
        f"vc_test:\n  base_path: {root}\n  custom_nodes: custom_nodes\n"
        f"  diffusion_models: models/diffusion_models\n  vae: models/vae\n")
    user = root / "user"
    (user / "default").mkdir(parents=True)
    # A fresh user: skip the first-run template browser. VC_TEST_VUE_NODES=1: the "Nodes 2.0" (Vue) renderer.
    settings = {"Comfy.TutorialCompleted": True, "Comfy.VueNodes.Enabled": os.environ.get("VC_TEST_VUE_NODES") == "1"}
    (user / "default" / "comfy.settings.json").write_text(json.dumps(settings))
    port = _free_port()
    log = open(root / "comfyui.log", "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
         "--database-url", "sqlite:///:memory:", "--extra-model-paths-config", str(root / "extra_models.yaml"),
         "--user-directory", str(user), "--temp-directory", str(root / "temp"),
         "--output-directory", str(root / "output"), "--input-directory", str(root / "input")],
        cwd=COMFYUI_PATH, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ComfyUI exited ({proc.returncode}):\n{(root / 'comfyui.log').read_text()[-4000:]}")
            try:
                info = json.loads(_get(f"{url}/object_info/VCAttentionCompare", timeout=2))
                if "VCAttentionCompare" in info:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"ComfyUI did not serve the pack in 90 s:\n{(root / 'comfyui.log').read_text()[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / "comfyui.log", ARTIFACTS / "comfyui.log")


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    # Playwright gives Chromium a fresh temporary profile (its own --user-data-dir) and --headless.
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"])
        try:
            context = browser.new_context(viewport={"width": 1500, "height": 950})
            pg = context.new_page()
            console = []
            pg.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            pg.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            pg.console_log = console
            yield pg
        finally:
            browser.close()


def _shot(target, name: str) -> pathlib.Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    target.screenshot(path=str(path))
    print(f"screenshot: {path}")
    return path


def _canvas_pixel(pg, x: int, y: int) -> list[int]:
    return pg.evaluate("""([x, y]) => Array.from(document.querySelector('.vc-ab-canvas')
                          .getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3))""", [x, y])


def _frame_png(server: str, entry: dict) -> Image.Image:
    q = urllib.parse.urlencode({"filename": entry["filename"], "subfolder": entry["subfolder"], "type": entry["type"]})
    return Image.open(io.BytesIO(_get(f"{server}/view?{q}"))).convert("RGB")


def test_viewer_in_chromium(server, page):
    pg = page
    pg.goto(server, wait_until="domcontentloaded")
    pg.wait_for_function("() => window.app && window.app.graph && window.comfyAPI", timeout=60_000)
    # The extension was served and registered.
    pg.wait_for_function("() => window.app.extensions?.some(e => e.name === 'VCAttention.Viewer')", timeout=30_000)

    # Load the A/B workflow and queue it from the page, as the Queue button does.
    pg.evaluate("async (p) => { await window.app.loadApiJson(p, 'vc_ab_tiny.json'); }", PROMPT)
    pg.wait_for_function(f"() => !!window.app.graph.getNodeById({COMPARE_ID})")
    pg.evaluate("async () => { await window.app.queuePrompt(0, 1); }")

    # Wait for the node's ui output to arrive and the viewer to draw a frame.
    try:
        pg.wait_for_selector(".vc-ab[data-state=ready]", state="attached", timeout=150_000)
        pg.wait_for_function("() => (document.querySelector('.vc-ab')?.dataset.drawn ?? '') !== ''", timeout=30_000)
    except Exception:
        _shot(pg, "viewer_timeout.png")
        print("\n".join(pg.console_log[-40:]))
        raise

    history = json.loads(_get(f"{server}/history"))
    (entry,) = history.values()
    assert entry["status"]["status_str"] == "success", entry["status"]
    out = entry["outputs"][COMPARE_ID]
    psnr, labels = out["vc_psnr"], out["vc_labels"]
    assert len(psnr) == FRAMES and labels == ["BF16", "VC 8-bit"]
    report = out["text"][0]

    # Bring the comparison node to the middle of the canvas at zoom 1 and let the DOM widget settle.
    pg.evaluate(f"""() => {{
        const c = window.app.canvas, n = window.app.graph.getNodeById({COMPARE_ID});
        c.ds.scale = 1;
        c.ds.offset[0] = -n.pos[0] + 450; c.ds.offset[1] = -n.pos[1] + 120;
        c.setDirty(true, true); c.draw?.(true, true);
    }}""")
    viewer = pg.locator(".vc-ab")
    viewer.wait_for(state="visible", timeout=10_000)
    pg.wait_for_timeout(500)
    _shot(pg, "viewer_page.png")

    # -- the wipe: pixels left of the line come from the reference, right of it from the test --
    frame = 0
    ref_img = _frame_png(server, out["vc_reference"][frame])
    test_img = _frame_png(server, out["vc_test"][frame])
    w, h = ref_img.size
    assert pg.evaluate("() => [document.querySelector('.vc-ab-canvas').width, "
                       "document.querySelector('.vc-ab-canvas').height]") == [w, h]
    # A column in the middle half, a row below the labels, where the two renders differ most.
    y0 = h // 3
    diffs = [(sum(abs(a - b) for a, b in zip(ref_img.getpixel((x, y)), test_img.getpixel((x, y)))), x, y)
             for y in range(y0, h) for x in range(w // 4, 3 * w // 4)]
    best, x, y = max(diffs)
    assert best > 0, "reference and test frames are identical: the wipe cannot be seen"

    wipe = pg.locator(".vc-ab-wipe")
    wipe.fill("1000")  # all reference
    assert _canvas_pixel(pg, x, y) == list(ref_img.getpixel((x, y)))
    before = _shot(viewer, "viewer_wipe_right.png").read_bytes()
    wipe.fill("0")  # all test
    assert _canvas_pixel(pg, x, y) == list(test_img.getpixel((x, y)))
    assert _shot(viewer, "viewer_wipe_left.png").read_bytes() != before

    # Drag on the picture, as a user would: the line follows the pointer.
    box = pg.locator(".vc-ab-canvas").bounding_box()
    scale = min(box["width"] / w, box["height"] / h)
    left = box["x"] + (box["width"] - w * scale) / 2
    pg.mouse.move(left + (x - 8) * scale, box["y"] + box["height"] / 2)
    pg.mouse.down()
    pg.mouse.move(left + (x + 8) * scale, box["y"] + box["height"] / 2, steps=4)
    pg.mouse.up()
    assert _canvas_pixel(pg, x, y) == list(ref_img.getpixel((x, y)))  # now left of the line
    assert 0 < int(wipe.input_value()) < 1000
    wipe.fill("500")

    # -- the PSNR shown for every frame equals the node's output --
    printed = report.split("per-frame PSNR: ")[1].split()  # the node's text, 2 decimals, inf
    assert len(printed) == FRAMES
    frame_input = pg.locator(".vc-ab-frame")
    readout = pg.locator(".vc-ab-readout")
    shown = []
    for i in range(FRAMES):
        frame_input.fill(str(i))
        assert readout.get_attribute("data-frame") == str(i)
        value = readout.get_attribute("data-psnr")
        assert f"PSNR {value} dB" in readout.inner_text()
        shown.append(value)
    expected = ["inf" if p is None else f"{p:.2f}" for p in psnr]
    assert shown == expected == printed
    title = pg.locator(".vc-ab-chart").get_attribute("title")
    assert title.split(": ", 1)[1].split() == printed
    # The frame scrubber changed the picture too.
    frame_input.fill(str(FRAMES - 1))
    last_ref = _frame_png(server, out["vc_reference"][FRAMES - 1])
    wipe.fill("1000")
    px = _canvas_pixel(pg, w // 2, h // 2)
    assert px == list(last_ref.getpixel((w // 2, h // 2)))
    wipe.fill("500")
    frame_input.fill(str(FRAMES // 2))
    pg.wait_for_timeout(200)
    path = _shot(viewer, "viewer_node.png")
    assert path.stat().st_size > 0

    # -- the diff toggle --
    pg.locator(".vc-ab-diff").click()
    assert pg.locator(".vc-ab").get_attribute("data-drawn").endswith(":diff")
    _shot(viewer, "viewer_diff.png")
    pg.locator(".vc-ab-diff").click()

    # -- the patch node's badge: the last run's report --
    badge = pg.locator(".vc-badge")
    assert badge.get_attribute("data-kind") == "report", badge.inner_text()
    assert badge.get_attribute("data-backend") == "reference"
    assert int(badge.get_attribute("data-patched")) > 0
    assert badge.get_attribute("data-grouping").startswith("0")
    assert "reference" in badge.inner_text() and "patched" in badge.inner_text()
    # Every line of it shows in full (the badge is not cut off below or at the side), and ComfyUI's
    # own progress-text line does not repeat the report under the node.
    fit = badge.evaluate("""(b) => ({over: b.scrollHeight - b.clientHeight,
                                     cut: [...b.children].filter((d) => d.scrollWidth > d.clientWidth).length})""")
    assert fit == {"over": 0, "cut": 0}, fit
    assert pg.evaluate(f"""() => window.app.graph.getNodeById({PATCH_ID}).widgets
                           .filter((w) => w.name === '$$node-text-preview').length""") == 0
    pg.evaluate(f"""() => {{
        const c = window.app.canvas, n = window.app.graph.getNodeById({PATCH_ID});
        c.ds.offset[0] = -n.pos[0] + 450; c.ds.offset[1] = -n.pos[1] + 200; c.setDirty(true, true);
    }}""")
    pg.wait_for_timeout(500)
    _shot(pg, "patch_badge_page.png")
    errors = [m for m in pg.console_log if "vc_attention" in m.lower() and ("error" in m.lower())]
    assert not errors, errors


# -- the Compare node alone, through the HTTP API ----------------------------------------------------

def _run_prompt(server: str, prompt: dict, timeout: float = 300) -> tuple[str, dict]:
    """POST /prompt as an API client does, poll /history/<prompt_id> until the run is done; returns
    the prompt id and its history entry."""
    body = json.dumps({"prompt": prompt, "client_id": "vc-attention-test"}).encode()
    request = urllib.request.Request(f"{server}/prompt", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        prompt_id = json.loads(r.read())["prompt_id"]
    deadline = time.time() + timeout
    while time.time() < deadline:
        entry = json.loads(_get(f"{server}/history/{prompt_id}")).get(prompt_id)
        if entry and entry.get("status", {}).get("completed") is not None and (
                entry["status"]["completed"] or entry["status"]["status_str"] == "error"):
            return prompt_id, entry
        time.sleep(1)
    pytest.fail(f"prompt {prompt_id} did not finish in {timeout} s")


def test_compare_alone_reports_through_the_http_api(server):
    """Compare as the graph's only output (no Preview or Save after it): the server accepts the graph,
    and /history/<prompt_id> holds Compare's report and its side-by-side image, and the patch node's
    report of the sampling run in this prompt (which backend ran, how many calls were patched)."""
    prompt = json.loads(json.dumps({k: v for k, v in PROMPT.items() if k != "12"}))  # no PreviewImage
    prompt[COMPARE_ID]["inputs"]["test_label"] = "VC (API)"
    # The patch node and its sampler run again in this prompt (not taken from the cache).
    prompt[PATCH_ID]["inputs"]["grouping_window"] = 0.3
    prompt["7"]["inputs"]["seed"] = SAMPLER["seed"] + 1
    prompt_id, entry = _run_prompt(server, prompt)
    assert entry["status"]["status_str"] == "success", entry["status"]
    (record,) = entry["outputs"][PATCH_ID]["vc_attention"]
    (run,) = [r for r in record["runs"] if r["prompt_id"] == prompt_id]
    assert run["sampler_node"] == "7" and run["patched"] > 0 and run["errors"] == []
    assert list(run["backends"]) == ["reference"] and "calls patched" in run["text"]
    out = entry["outputs"][COMPARE_ID]
    report = out["text"][0]
    assert report.startswith(f"frames: {FRAMES}\n") and "PSNR mean" in report and "SSIM mean" in report
    assert out["vc_labels"] == ["BF16", "VC (API)"]
    width, height = 80, 64  # the frame size (EmptyHunyuanLatentVideo above)
    assert len(out["images"]) == FRAMES
    for frame in out["images"]:
        img = _frame_png(server, frame)
        assert img.width == 2 * width + 4 and img.height > height  # reference | test, label strip on top
    # The per-frame PSNR printed in the report is the one the viewer payload carries.
    printed = report.split("per-frame PSNR: ")[1].split()
    assert printed == ["inf" if p is None else f"{p:.2f}" for p in out["vc_psnr"]]


# -- the template browser ------------------------------------------------------------------------------

WORKFLOWS = sorted((REPO / "workflows").glob("*.json"))


def _open_templates(pg) -> dict:
    """Open ComfyUI's template browser on this pack's category; its cards by workflow file."""
    pg.evaluate("() => window.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    try:
        pg.wait_for_selector("[data-testid=template-workflows-content]", timeout=30_000)
        pg.get_by_text(PACK_NAME, exact=True).first.click()
        cards = {}
        for path in WORKFLOWS:
            card = pg.locator(f"[data-testid='template-workflow-{path.stem}']")
            card.wait_for(state="visible", timeout=20_000)
            cards[path] = card
        return cards
    except Exception:
        _shot(pg, "templates_timeout.png")
        print("\n".join(pg.console_log[-40:]))
        raise


def test_templates_show_thumbnails_and_descriptions(server, page):
    """ComfyUI's template browser lists every shipped workflow with its thumbnail (the .jpg beside it,
    loaded and decoded) and the title and one-line description the workflow carries; a template opens
    from it with our node laid out as the file stores it."""
    pg = page
    pg.goto(server, wait_until="domcontentloaded")
    pg.wait_for_function("() => window.app && window.app.graph && window.app.extensionManager", timeout=60_000)

    # Open the LongCat-Video template from the browser, as a user would; its VC-Attention node as drawn
    # is that template's thumbnail (workflows/build_thumbnails.py).
    longcat = REPO / "workflows" / "vc_longcat_video_t2v.json"
    _open_templates(pg)[longcat].click()
    pg.wait_for_function("() => !!window.app.graph.getNodeById(900)", timeout=30_000)
    pg.keyboard.press("Escape")  # a missing-nodes notice, where WanVideoWrapper is not installed
    box = pg.evaluate("""() => {
        const c = window.app.canvas, n = window.app.graph.getNodeById(900);
        c.ds.scale = 1.2;
        c.ds.offset[0] = -n.pos[0] + 60; c.ds.offset[1] = -n.pos[1] + 120;
        c.setDirty(true, true); c.draw?.(true, true);
        return {need: n.computeSize(), size: [...n.size], x: (n.pos[0] + c.ds.offset[0]) * c.ds.scale,
                y: (n.pos[1] - 30 + c.ds.offset[1]) * c.ds.scale, w: n.size[0] * c.ds.scale,
                h: (n.size[1] + 30) * c.ds.scale, rect: c.canvas.getBoundingClientRect().toJSON()};
    }""")
    # The size the workflow stores fits the node as the front end lays it out (it did not have to grow,
    # which could make it overlap its neighbours).
    assert box["need"][1] <= box["size"][1] + 0.5 and box["need"][0] <= box["size"][0] + 0.5, box
    pg.wait_for_timeout(500)
    side = max(box["w"], box["h"]) + 40
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / "template_vc_longcat_video_t2v.png"), clip={
        "x": box["rect"]["x"] + box["x"] - 20 - (side - box["w"] - 40) / 2, "y": box["rect"]["y"] + box["y"] - 20,
        "width": side, "height": side})

    cards = _open_templates(pg)
    pg.wait_for_timeout(1000)  # lazy images
    _shot(pg, "template_browser.png")
    for path, card in cards.items():
        info = json.loads(path.read_text(encoding="utf-8"))["extra"]["vc_attention"]
        assert card.locator("h3").inner_text().strip() == info["title"]
        assert card.locator("p").first.inner_text().strip() == info["description"]
        img = card.locator("img").first
        img.scroll_into_view_if_needed()
        pg.wait_for_function("(el) => el.complete && el.naturalWidth > 0", arg=img.element_handle(), timeout=10_000)
        assert "default-template" not in img.get_attribute("src")  # not the placeholder
        thumb = path.with_suffix(".jpg")
        assert _get(f"{server}/api/workflow_templates/{PACK_NAME}/{thumb.name}") == thumb.read_bytes()
        # The picture shown is that file: its size, and the mean colour of its centre, as decoded by
        # Chromium and by Pillow (JPEG decoders may differ by a few levels).
        shown = pg.evaluate("""(el) => {
            const w = el.naturalWidth, h = el.naturalHeight, c = document.createElement('canvas');
            c.width = w; c.height = h;
            const ctx = c.getContext('2d'); ctx.drawImage(el, 0, 0);
            const d = ctx.getImageData(w / 2 - 16, h / 2 - 16, 32, 32).data, m = [0, 0, 0];
            for (let i = 0; i < d.length; i += 4) for (let k = 0; k < 3; k++) m[k] += d[i + k] / 1024;
            return {size: [w, h], mean: m};
        }""", img.element_handle())
        with Image.open(thumb) as im:
            w, h = im.size
            block = im.convert("RGB").crop((w // 2 - 16, h // 2 - 16, w // 2 + 16, h // 2 + 16))
            mean = [sum(px[k] for px in block.getdata()) / 1024 for k in range(3)]
        assert shown["size"] == [w, h]
        assert max(abs(a - b) for a, b in zip(shown["mean"], mean)) < 4, (shown["mean"], mean)


def test_workflows_open_with_no_overlapping_nodes(server, page):
    """Each shipped workflow as the front end lays it out once opened (LiteGraph's own node bounds,
    after every node's widgets, ours included, are added): no node overlaps another, in the root graph
    and in its subgraphs, and our nodes did not have to grow beyond the size the file stores.
    Nodes of a pack this server lacks (WanVideoWrapper's, in the LongCat-Video graph: it needs
    packages ComfyUI's requirements do not bring) are drawn as placeholders of another size: they
    are left out here (tests/nodes/test_workflows.py checks their stored layout)."""
    pg = page
    pg.goto(server, wait_until="domcontentloaded")
    pg.wait_for_function("() => window.app?.graph && window.app.extensions?.some(e => e.name === 'VCAttention.Viewer')",
                         timeout=60_000)
    pg.wait_for_timeout(1000)  # the page restores the last open workflow first
    for path in WORKFLOWS:
        workflow = json.loads(path.read_text(encoding="utf-8"))
        result = pg.evaluate("""async ([wf, name]) => {
            await window.app.loadGraphData(wf, true, true, name);
            await new Promise((r) => setTimeout(r, 300));
            const graphs = [window.app.graph, ...(window.app.graph.subgraphs?.values?.() ?? [])];
            const types = (window.LiteGraph ?? window.comfyAPI.litegraph.LiteGraph).registered_node_types;
            const known = (n) => !!types[n.type] || !!n.isSubgraphNode?.();
            const overlaps = [], grown = [];
            const ids = window.app.graph.nodes.map((n) => Number(n.id)).sort((a, b) => a - b);
            for (const g of graphs) {
                const nodes = (g.nodes ?? g._nodes ?? []).filter(known);
                const boxes = nodes.map((n) => [n, n.getBounding()]);
                for (let i = 0; i < boxes.length; i++) {
                    const [a, ra] = boxes[i];
                    if (String(a.type).startsWith("VCAttention")) {
                        const need = a.computeSize();
                        if (need[0] > a.size[0] + 0.5 || need[1] > a.size[1] + 0.5)
                            grown.push([a.type, a.id, need, [...a.size]]);
                    }
                    for (const [b, rb] of boxes.slice(i + 1)) {
                        if (ra[0] < rb[0] + rb[2] && rb[0] < ra[0] + ra[2] && ra[1] < rb[1] + rb[3] && rb[1] < ra[1] + ra[3])
                            overlaps.push([a.type, a.id, ra.map(Math.round), b.type, b.id, rb.map(Math.round)]);
                    }
                }
            }
            return {overlaps, grown, graphs: graphs.length, ids};
        }""", [workflow, path.name])
        assert result["ids"] == sorted(n["id"] for n in workflow["nodes"]), f"{path.name} did not open"
        assert result["graphs"] == 1 + len(workflow.get("definitions", {}).get("subgraphs", []))
        pg.keyboard.press("Escape")  # a missing-nodes notice (LongCat-Video, without WanVideoWrapper)
        assert result["overlaps"] == [], f"{path.name}: {result['overlaps']}"
        assert result["grown"] == [], f"{path.name}: {result['grown']}"
        pg.evaluate("""() => {  // our first node in the middle of the view, at zoom 1, for the screenshot
            const c = window.app.canvas, n = window.app.graph.nodes.find((n) => String(n.type).startsWith("VCAttention"));
            if (!n) return;
            c.ds.scale = 1; c.ds.offset[0] = -n.pos[0] + 500; c.ds.offset[1] = -n.pos[1] + 250; c.setDirty(true, true);
        }""")
        pg.wait_for_timeout(300)
        _shot(pg, f"opened_{path.stem}.png")
