// VC-Attention front-end extension (plain ES module, no build step; ComfyUI serves web/*.js).
//
// VCAttentionCompare: after a run, an A/B viewer on the node: a wipe between the reference (BF16)
// and the test (VC-Attention) frame (drag on the picture or use the slider; "diff" shows |A-B|,
// amplified so that the largest difference is bright),
// a frame scrubber, and the per-frame PSNR as a small line chart. Data: the node's ui output
// (nodes/compare.py viewer_payload): vc_reference / vc_test (temp PNGs served by /view),
// vc_psnr (null = identical frame), vc_ssim, vc_labels.
//
// VCAttentionPatch: a compact badge with the last run's report (backend, calls patched, grouping
// steps; the full report as its tooltip). Each sampling run's report arrives as the websocket event
// REPORT_EVENT (nodes/history.py), and is kept in the node's ui output ("vc_attention": runs), which
// the badge shows when a cached or earlier run is displayed; the node's own ui text (detected model,
// backend check) is shown until a run has reported.
//
// Template browser: ComfyUI lists a pack's workflows/*.json by file name only (title and description
// both the file name, thumbnail <name>.jpg beside it). Each shipped workflow carries its title and a
// one-line description in extra.vc_attention; the pack's templates are offered as one category with
// them (see installTemplateInfo).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const COMPARE = "VCAttentionCompare";
// This file is served as /extensions/<pack folder>/vc_attention.js; its templates as
// /api/workflow_templates/<pack folder>/<name>.json.
const PACK_MODULE = decodeURIComponent(new URL(import.meta.url).pathname.split("/").at(-2));
const REPORT_EVENT = "vc_attention.report"; // nodes/history.py EVENT
const PATCHES = new Set(["VCAttentionPatch", "VCAttentionWanVideoPatch"]); // both report the same way
const DIFF_MAX_GAIN = 64; // |A-B| is scaled so its maximum is bright, by at most this factor

const CSS = `
.vc-ab { display: flex; flex-direction: column; gap: 4px; width: 100%; height: 100%; box-sizing: border-box;
  font: 11px/1.3 system-ui, sans-serif; color: var(--input-text, #ddd); overflow: hidden; }
.vc-ab-stage { position: relative; flex: 1 1 auto; min-height: 80px; background: #111; border-radius: 4px;
  overflow: hidden; cursor: ew-resize; touch-action: none; }
.vc-ab-stage canvas { position: absolute; inset: 0; width: 100%; height: 100%; object-fit: contain;
  image-rendering: pixelated; }
.vc-ab-empty { position: absolute; inset: 0; display: flex; align-items: center; justify-content: center;
  color: #888; text-align: center; padding: 8px; }
.vc-ab-row { display: flex; align-items: center; gap: 6px; flex: 0 0 auto; }
.vc-ab-row label { flex: 0 0 38px; color: #aaa; }
.vc-ab-row input[type=range] { flex: 1 1 auto; min-width: 40px; margin: 0; }
.vc-ab-row button { flex: 0 0 auto; font: inherit; padding: 1px 6px; border-radius: 3px; cursor: pointer;
  background: var(--comfy-input-bg, #222); color: inherit; border: 1px solid var(--border-color, #555); }
.vc-ab-row button[aria-pressed=true] { background: #2a5d8f; border-color: #4a8fd0; }
.vc-ab-readout { flex: 0 0 auto; font-variant-numeric: tabular-nums; white-space: nowrap; }
.vc-ab-chart { flex: 0 0 64px; width: 100%; height: 64px; background: #1a1a1a; border-radius: 4px; cursor: pointer; }
.vc-badge { width: 100%; height: 100%; box-sizing: border-box; overflow: hidden; padding: 3px 6px;
  font: 11px/15px system-ui, sans-serif; color: #cfe3ff; background: #1d2a3a; border: 1px solid #2f4a6a;
  border-radius: 4px; white-space: pre-wrap; }
.vc-badge div { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.vc-badge b { color: #fff; }
.vc-badge.vc-warn { background: #3a2a1d; border-color: #6a4a2f; color: #ffe1c2; }
`;

function injectStyle() {
  if (document.getElementById("vc-attention-style")) return;
  const style = document.createElement("style");
  style.id = "vc-attention-style";
  style.textContent = CSS;
  document.head.appendChild(style);
}

function el(tag, props = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") e.className = v;
    else if (k === "dataset") Object.assign(e.dataset, v);
    else if (k in e) e[k] = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function viewURL(entry) {
  const params = new URLSearchParams({ filename: entry.filename, subfolder: entry.subfolder ?? "",
                                       type: entry.type ?? "temp" });
  const rand = typeof app.getRandParam === "function" ? app.getRandParam() : "";
  return api.apiURL(`/view?${params}${rand}`);
}

// The two figures the node prints (nodes/compare.py _db): 2 decimals, "inf" for identical frames.
export function formatPSNR(p) {
  return p === null || p === undefined || !Number.isFinite(p) ? "inf" : p.toFixed(2);
}

function stopGraphEvents(elem) {
  // Keep drags on the viewer from moving the node or panning the canvas.
  for (const type of ["pointerdown", "pointermove", "wheel", "mousedown"]) {
    elem.addEventListener(type, (e) => e.stopPropagation());
  }
}

// -- the A/B viewer ------------------------------------------------------------------------------

class ABViewer {
  constructor() {
    this.frames = 0;
    this.frame = 0;
    this.wipe = 0.5;
    this.diff = false;
    this.ref = [];
    this.test = [];
    this.psnr = [];
    this.ssim = [];
    this.labels = ["BF16", "VC-Attention"];
    this.diffCache = new Map();

    this.canvas = el("canvas", { class: "vc-ab-canvas", width: 16, height: 9 });
    this.empty = el("div", { class: "vc-ab-empty" }, "Run the workflow: the A/B viewer appears here.");
    this.stage = el("div", { class: "vc-ab-stage" }, this.canvas, this.empty);
    this.wipeInput = el("input", { type: "range", min: 0, max: 1000, value: 500, class: "vc-ab-wipe",
                                   title: "Wipe: left of the line the reference, right of it the test" });
    this.diffButton = el("button", { class: "vc-ab-diff", type: "button", textContent: "diff",
                                     title: "Show |reference - test|, amplified" });
    this.diffButton.setAttribute("aria-pressed", "false");
    this.frameInput = el("input", { type: "range", min: 0, max: 0, value: 0, step: 1, class: "vc-ab-frame",
                                    title: "Frame" });
    this.readout = el("span", { class: "vc-ab-readout" }, "");
    this.chart = el("canvas", { class: "vc-ab-chart", title: "PSNR per frame (click to jump)" });
    this.root = el("div", { class: "vc-ab" },
      this.stage,
      el("div", { class: "vc-ab-row" }, el("label", {}, "wipe"), this.wipeInput, this.diffButton),
      el("div", { class: "vc-ab-row" }, el("label", {}, "frame"), this.frameInput, this.readout),
      this.chart);
    this.root.dataset.state = "empty";
    stopGraphEvents(this.root);

    this.wipeInput.addEventListener("input", () => { this.wipe = this.wipeInput.value / 1000; this.draw(); });
    this.frameInput.addEventListener("input", () => this.setFrame(Number(this.frameInput.value)));
    this.diffButton.addEventListener("click", () => {
      this.diff = !this.diff;
      this.diffButton.setAttribute("aria-pressed", String(this.diff));
      this.draw();
    });
    const dragWipe = (e) => {
      const x = this.imageX(e.clientX);
      if (x === null) return;
      this.wipe = x;
      this.wipeInput.value = Math.round(x * 1000);
      this.draw();
    };
    this.stage.addEventListener("pointerdown", (e) => {
      if (!this.frames) return;
      this.stage.setPointerCapture?.(e.pointerId);
      dragWipe(e);
    });
    this.stage.addEventListener("pointermove", (e) => { if (e.buttons & 1) dragWipe(e); });
    this.chart.addEventListener("click", (e) => {
      if (this.frames < 1) return;
      const r = this.chart.getBoundingClientRect();
      const { left, width } = this.plotBox(r.width);
      const f = this.frames === 1 ? 0 : Math.round(((e.clientX - r.left - left) / width) * (this.frames - 1));
      this.setFrame(Math.max(0, Math.min(this.frames - 1, f)));
    });
    new ResizeObserver(() => this.drawChart()).observe(this.chart);
  }

  // Horizontal position (0..1) in the picture under clientX, allowing for object-fit: contain.
  imageX(clientX) {
    const r = this.canvas.getBoundingClientRect();
    if (!r.width || !this.canvas.width) return null;
    const scale = Math.min(r.width / this.canvas.width, r.height / this.canvas.height);
    const shown = this.canvas.width * scale;
    const left = r.left + (r.width - shown) / 2;
    return Math.max(0, Math.min(1, (clientX - left) / shown));
  }

  show(output) {
    const psnr = output.vc_psnr ?? [];
    this.psnr = psnr.map((p) => (p === null ? null : Number(p)));
    this.ssim = (output.vc_ssim ?? []).map(Number);
    this.labels = output.vc_labels?.length === 2 ? output.vc_labels : this.labels;
    this.ref = (output.vc_reference ?? []).map((e) => this.load(e));
    this.test = (output.vc_test ?? []).map((e) => this.load(e));
    this.diffCache.clear();
    this.frames = this.psnr.length;
    this.frameInput.max = Math.max(0, this.frames - 1);
    this.frame = Math.min(this.frame, Math.max(0, this.frames - 1));
    this.frameInput.value = this.frame;
    this.empty.style.display = this.ref.length ? "none" : "flex";
    if (!this.ref.length && this.frames) this.empty.textContent = "Frames not available (see the server log).";
    this.root.dataset.state = this.frames ? "ready" : "empty";
    this.root.dataset.frames = String(this.frames);
    this.chart.title = "PSNR per frame (dB): " + this.psnr.map(formatPSNR).join(" ");
    this.setFrame(this.frame);
  }

  load(entry) {
    const img = new Image();
    img.decoding = "async";
    img.onload = () => { this.draw(); };
    img.src = viewURL(entry);
    return img;
  }

  setFrame(f) {
    this.frame = f;
    this.frameInput.value = f;
    if (this.frames) {
      const s = this.ssim[f];
      this.readout.textContent = `${f + 1}/${this.frames}  PSNR ${formatPSNR(this.psnr[f])} dB  ` +
        (s === undefined ? "" : `SSIM ${s.toFixed(4)}`);
      this.readout.dataset.frame = String(f);
      this.readout.dataset.psnr = formatPSNR(this.psnr[f]);
    }
    this.draw();
    this.drawChart();
  }

  diffImage(a, b) {
    const key = this.frame;
    if (this.diffCache.has(key)) return this.diffCache.get(key);
    const w = a.naturalWidth, h = a.naturalHeight;
    const off = document.createElement("canvas");
    off.width = w; off.height = h;
    const ctx = off.getContext("2d", { willReadFrequently: true });
    ctx.drawImage(a, 0, 0);
    const da = ctx.getImageData(0, 0, w, h);
    ctx.drawImage(b, 0, 0);
    const db = ctx.getImageData(0, 0, w, h);
    let max = 0;
    for (let i = 0; i < da.data.length; i += 4) {
      for (let c = 0; c < 3; c++) {
        const d = Math.abs(da.data[i + c] - db.data[i + c]);
        da.data[i + c] = d;
        if (d > max) max = d;
      }
    }
    const gain = max ? Math.max(1, Math.min(DIFF_MAX_GAIN, Math.floor(255 / max))) : 1;
    for (let i = 0; i < da.data.length; i += 4) {
      for (let c = 0; c < 3; c++) da.data[i + c] = Math.min(255, da.data[i + c] * gain);
    }
    ctx.putImageData(da, 0, 0);
    const result = { canvas: off, gain, max };
    this.diffCache.set(key, result);
    return result;
  }

  draw() {
    const a = this.ref[this.frame], b = this.test[this.frame];
    this.root.dataset.wipe = this.wipe.toFixed(3);
    if (!a || !b || !a.complete || !b.complete || !a.naturalWidth || !b.naturalWidth) {
      this.root.dataset.drawn = "";
      return;
    }
    const w = a.naturalWidth, h = a.naturalHeight;
    if (this.canvas.width !== w || this.canvas.height !== h) { this.canvas.width = w; this.canvas.height = h; }
    const ctx = this.canvas.getContext("2d", { willReadFrequently: true });
    ctx.imageSmoothingEnabled = false;
    if (this.diff) {
      const d = this.diffImage(a, b);
      ctx.drawImage(d.canvas, 0, 0);
      this.label(ctx, d.max ? `|A-B| x${d.gain}` : "identical", 4, "left");
    } else {
      const split = Math.round(this.wipe * w);
      ctx.drawImage(a, 0, 0);
      if (split < w) ctx.drawImage(b, split, 0, w - split, h, split, 0, w - split, h);
      const lw = Math.max(1, Math.round(w / 400));
      ctx.fillStyle = "rgba(255,255,255,0.85)";
      ctx.fillRect(Math.min(w - lw, Math.max(0, split - Math.floor(lw / 2))), 0, lw, h);
      this.label(ctx, this.labels[0], 4, "left");
      this.label(ctx, this.labels[1], w - 4, "right");
    }
    this.root.dataset.drawn = `${this.frame}:${this.diff ? "diff" : this.wipe.toFixed(3)}`;
  }

  label(ctx, text, x, align) {
    const size = Math.max(9, Math.round(this.canvas.height / 22));
    ctx.font = `${size}px system-ui, sans-serif`;
    ctx.textAlign = align;
    ctx.textBaseline = "top";
    const tw = ctx.measureText(text).width;
    const bx = align === "left" ? x - 2 : x - tw - 2;
    ctx.fillStyle = "rgba(0,0,0,0.55)";
    ctx.fillRect(bx, 2, tw + 4, size + 4);
    ctx.fillStyle = "#fff";
    ctx.fillText(text, x, 4);
  }

  plotBox(width) {
    return { left: 34, width: Math.max(1, width - 42), top: 8, height: 64 - 22 };
  }

  drawChart() {
    const c = this.chart;
    const r = c.getBoundingClientRect();
    if (!r.width) return;
    const dpr = window.devicePixelRatio || 1;
    c.width = Math.round(r.width * dpr);
    c.height = Math.round(r.height * dpr);
    const ctx = c.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, r.width, r.height);
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = "#888";
    if (!this.frames) {
      ctx.textBaseline = "middle";
      ctx.fillText("PSNR per frame", 6, r.height / 2);
      return;
    }
    const box = this.plotBox(r.width);
    box.height = r.height - 22;
    const finite = this.psnr.filter((p) => p !== null && Number.isFinite(p));
    let lo = finite.length ? Math.min(...finite) : 0, hi = finite.length ? Math.max(...finite) : 1;
    if (hi - lo < 0.5) { lo -= 0.25; hi += 0.25; }
    const pad = (hi - lo) * 0.08;
    lo -= pad; hi += pad;
    const X = (i) => box.left + (this.frames === 1 ? box.width / 2 : (i / (this.frames - 1)) * box.width);
    const Y = (p) => (p === null || !Number.isFinite(p)) ? box.top - 2 : box.top + (1 - (p - lo) / (hi - lo)) * box.height;
    // axes and range labels
    ctx.strokeStyle = "#444";
    ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(box.left, box.top); ctx.lineTo(box.left, box.top + box.height); ctx.lineTo(box.left + box.width, box.top + box.height);
    ctx.stroke();
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    ctx.fillText((hi - pad).toFixed(1), box.left - 3, Y(hi - pad));
    ctx.fillText((lo + pad).toFixed(1), box.left - 3, Y(lo + pad));
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    ctx.fillText(`PSNR dB · ${this.frames} frames`, box.left + 2, box.top + box.height + 3);
    // current frame
    ctx.strokeStyle = "#4a8fd0";
    ctx.beginPath();
    ctx.moveTo(X(this.frame), box.top - 4); ctx.lineTo(X(this.frame), box.top + box.height);
    ctx.stroke();
    // the line
    ctx.strokeStyle = "#7fd07f";
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    this.psnr.forEach((p, i) => (i ? ctx.lineTo(X(i), Y(p)) : ctx.moveTo(X(i), Y(p))));
    ctx.stroke();
    this.psnr.forEach((p, i) => {
      ctx.beginPath();
      ctx.arc(X(i), Y(p), i === this.frame ? 3.5 : 2, 0, Math.PI * 2);
      if (p === null) { ctx.strokeStyle = "#fff"; ctx.stroke(); } // identical frame: hollow, on top
      else { ctx.fillStyle = i === this.frame ? "#fff" : "#7fd07f"; ctx.fill(); }
    });
    ctx.textAlign = "right";
    ctx.fillStyle = "#ddd";
    ctx.fillText(`${formatPSNR(this.psnr[this.frame])} dB`, box.left + box.width, box.top + box.height + 3);
  }
}

// -- the patch node's badge ------------------------------------------------------------------------

// "VC-Attention: 96 calls patched, 0 passed through / backend: reference (96 calls) / grouping at
// steps 0, 1 (...)" -> one compact line plus the full text as a tooltip.
export function summariseReport(text) {
  const m = /(\d+) calls patched, (\d+) passed through/.exec(text);
  if (!m) return null;
  const backend = (/^backend: (.*)$/m.exec(text)?.[1] ?? "none").replace(/ \(\d+ calls\)/g, "");
  const grouping = /^grouping at steps ([\d, ]+)/m.exec(text)?.[1] ?? "none";
  const errors = /^error /m.test(text);
  return { backend, patched: Number(m[1]), passed: Number(m[2]), grouping: grouping.trim(), errors };
}

// "0, 1, 5, 9" -> "4 steps (0-9)": the list itself is in the tooltip.
export function groupingLine(grouping) {
  if (grouping === "none") return "no grouping";
  const steps = grouping.split(",").map((x) => x.trim()).filter(Boolean);
  if (steps.length === 1) return `grouping at step ${steps[0]}`;
  return `grouping: ${steps.length} steps (${steps[0]}-${steps.at(-1)})`;
}

const BADGE_LINES = 3; // the report badge's height in lines (15 px each, plus padding)

function setBadge(node, text) {
  const badge = node.vcBadge;
  if (!badge) return;
  const s = summariseReport(text);
  badge.title = text;
  badge.replaceChildren();
  if (s) {
    // One fact a line, each cut with an ellipsis rather than wrapped: the badge never grows.
    badge.append(el("div", {}, el("b", {}, "last run: "), s.backend),
                 el("div", {}, `${s.patched} calls patched, ${s.passed} passed through`),
                 el("div", {}, groupingLine(s.grouping)));
    badge.classList.toggle("vc-warn", s.errors || s.patched === 0);
    badge.dataset.kind = "report";
    Object.assign(badge.dataset, { backend: s.backend, patched: String(s.patched), grouping: s.grouping });
  } else {
    badge.append(text.replace(/^VC-Attention: /, ""));
    badge.classList.toggle("vc-warn", /no low-bit|unavailable|not supported|unsupported/i.test(text));
    badge.dataset.kind = "status";
  }
  fitNode(node);
}

// Grow the node (never shrink it) so that every widget, ours included, gets its minimum height.
function fitNode(node) {
  const need = node.computeSize?.();
  if (need && (node.size[0] < need[0] || node.size[1] < need[1])) {
    node.setSize([Math.max(node.size[0], need[0]), Math.max(node.size[1], need[1])]);
  }
  node.setDirtyCanvas?.(true, true);
}

function isPatch(node) {
  return PATCHES.has(node?.comfyClass) || PATCHES.has(node?.constructor?.comfyClass);
}

// A node by its execution id: "12" in the root graph, "128:161" inside subgraph node 128.
function findNode(id) {
  if (id === undefined || id === null) return null;
  let graph = app.graph, node = null;
  for (const part of String(id).split(":")) {
    node = graph?.getNodeById?.(part) ?? graph?.getNodeById?.(Number(part));
    graph = node?.subgraph;
  }
  return node ?? null;
}

// -- the template browser --------------------------------------------------------------------------

let templateCategory = null; // this pack's templates, as a category of ComfyUI's template index

async function describeTemplates(names) {
  const base = api.apiURL(`/workflow_templates/${PACK_MODULE}`);
  const templates = await Promise.all([...names].sort().map(async (name) => {
    const response = await fetch(`${base}/${encodeURIComponent(name)}.json`);
    if (!response.ok) throw new Error(`${name}.json: HTTP ${response.status}`);
    const info = (await response.json())?.extra?.vc_attention ?? {};
    return { name, title: info.title ?? name, description: info.description ?? name,
             mediaType: "image", mediaSubtype: "jpg" };
  }));
  return { moduleName: PACK_MODULE, title: "VC-Attention", type: "video", templates };
}

// ComfyUI's template store reads the custom-node list (api.getWorkflowTemplates) and then the core
// index (api.getCoreWorkflowTemplates). Our workflows move from the first (names only) to the
// second (with titles and descriptions); their files, thumbnails included, are served as before.
// If the descriptions cannot be read, the templates stay listed as ComfyUI lists them.
function installTemplateInfo() {
  const listCustom = api.getWorkflowTemplates?.bind(api);
  const listCore = api.getCoreWorkflowTemplates?.bind(api);
  if (!listCustom || !listCore) return;
  api.getWorkflowTemplates = async function () {
    const all = await listCustom();
    const names = all?.[PACK_MODULE];
    if (names?.length) {
      try {
        templateCategory = await describeTemplates(names);
        delete all[PACK_MODULE];
      } catch (e) {
        console.warn("VC-Attention: template descriptions not read, listed by file name:", e);
      }
    }
    return all;
  };
  api.getCoreWorkflowTemplates = async function (...args) {
    const core = await listCore(...args);
    return templateCategory && Array.isArray(core) ? [...core, templateCategory] : core;
  };
}

installTemplateInfo();

function addWidget(node, name, element, minHeight) {
  const widget = node.addDOMWidget(name, name, element, {
    serialize: false,
    hideOnZoom: false,
    getMinHeight: () => minHeight,
  });
  widget.serialize = false;
  return widget;
}

app.registerExtension({
  name: "VCAttention.Viewer",

  async setup() {
    injectStyle();
    // A sampling run's report, sent as it ends (the patch node itself ran before the sampler).
    api.addEventListener(REPORT_EVENT, ({ detail }) => {
      const node = findNode(detail?.node);
      if (detail?.text && isPatch(node)) setBadge(node, detail.text);
    });
  },

  async nodeCreated(node) {
    const cls = node.constructor?.comfyClass ?? node.comfyClass;
    if (cls === COMPARE) {
      injectStyle();
      const viewer = new ABViewer();
      node.vcViewer = viewer;
      addWidget(node, "vc_ab_viewer", viewer.root, 260);
      const [w, h] = node.size;
      node.setSize([Math.max(w, 420), Math.max(h, 420)]);
      const onExecuted = node.onExecuted;
      node.onExecuted = function (output) {
        onExecuted?.apply(this, arguments);
        if (output?.vc_psnr) {
          viewer.show(output);
          fitNode(node); // a node saved small (older workflow) grows to fit the viewer
        }
      };
    } else if (PATCHES.has(cls)) {
      injectStyle();
      node.vcBadge = el("div", { class: "vc-badge", textContent: "VC-Attention: not run yet" });
      node.vcBadge.dataset.kind = "none";
      addWidget(node, "vc_report", node.vcBadge, BADGE_LINES * 15 + 28); // + padding, border, widget margins
      fitNode(node);
      const onExecuted = node.onExecuted;
      node.onExecuted = function (output) {
        onExecuted?.apply(this, arguments);
        // The latest run recorded with this output (a cached or reloaded result), else the node's
        // status (model, backend check) until a run reports.
        const last = output?.vc_attention?.[0]?.runs?.at(-1)?.text;
        const text = last ?? output?.text?.[0];
        if (text && (last || node.vcBadge.dataset.kind !== "report")) setBadge(node, text);
      };
    }
  },
});
