"""Attention speed on the GPU: VC-Attention 8-bit against FA4 BF16, cuDNN / flash SDPA and
SageAttention 1.0.6, at the real video-DiT shapes, in one run (BENCHMARKS.md).

    python3 benchmarks/attention_speed.py [--shapes wan14b-720p,odd] [--quick] [--profile-breakdown]
                                          [--out results.csv]
    TRITON_INTERPRET=1 python3 benchmarks/attention_speed.py --smoke    # CPU check that it runs

Shapes (B=1, D=128, non-causal self-attention, M = N):
    wan14b-720p  H=40 N=75,600   Wan2.2-14B, 1280x720, 81 frames: 21 latent frames x 45 x 80
    wan-480p     H=40 N=32,760   Wan 2.1/2.2, 832x480, 81 frames: 21 x 30 x 52
    hv15-720p    H=16 N=111,700  HunyuanVideo-1.5 720p, 121 frames
    wan5b-720p   H=24 N=27,280   Wan2.2-TI2V-5B, 1280x704, 121 frames: VAE 16x16 spatial, 4x temporal,
                                 patch 1x2x2 -> 31 latent frames x (704/32=22) x (1280/32=40) = 27,280
    odd          H=8  N=10,007   an N that is no multiple of 128 (partial last tiles)

Providers (each in its own try/except: a failure is written into the table, the run goes on):
    FA4 BF16             flash_attn.cute.interface.flash_attn_func on [B,N,H,D] (skipped if absent)
    SDPA cuDNN / flash   torch SDPA with one backend enabled, [B,H,N,D]
    Sage 1.0.6           sageattention.sageattn(tensor_layout="HND") (skipped if absent; it subtracts
                         the K mean in place, so it gets its own copy of K)
    VC <variant> kernel  operands prepared once outside the timer (the paper's protocol): the
                         library's own triton_vc_attention is run once while its call to
                         vc_attention_fwd is captured, then only vc_attention_fwd is timed
    VC <variant> +prep   the public vc_attention(..., backend="triton", plan=plan): quantisers,
                         V pre-pass and kernel, what one ComfyUI call pays on a non-grouping step
    variants: plain 8-bit (v_smooth=False, exp2 + cast), V-Smooth exp2 (frozen plan), V-Smooth +
    ExpCast (frozen plan: the steady state of the reuse schedule)
    VC Hopper <variant>  the same with the Gluon kernel for sm_90 (kernels/gluon/)
                         behind the same pre-pass (skipped with the reason on other GPUs)
    VC grouping step     plan_v_smooth(v, init=plan, iters=2) (warm k-means) + the attention call
    VC plan cold         plan_v_smooth(v, iters=10) alone (first call of a model, no attention)
--profile-breakdown adds rows for quantize Q, K mean + quantize K, V pre-pass, kernel, k-means
warm (2 iterations) and cold (10), for V-Smooth + ExpCast with the frozen plan.

Timing: triton.testing.do_bench, median, after two warm-up calls (the first compiles; FA4 compiles
a new kernel on its first call, tens of seconds), with enough repeats for >= 5 timed calls (3 with
--quick). Each provider is timed once, in the order of the table, so a ratio compares two moments of
the run (on the H200, which runs at its power cap, the same kernel's ratio to FA4 came out 1.40x and
1.45x in two single passes). --rounds R then times the peers and the
kernel rows again, all set up at once, in R alternating rounds (the table's order, then reversed):
rows "<provider> [R alternating]" with the median of the R round times and their speedup against
the alternating FA4 row. Data: random, never zeros, the same per shape for every provider: q ~
N(0,1); k ~ N(0,1) plus a per-channel offset (what K smoothing removes); v ~ N(0,1) plus a
per-channel offset, and a few outlier tokens per head (x4, plus a +24 spike in 3 channels) as
V-Smooth targets. bf16.

Check: every provider's output on a slice (the first 128 and the last 128 query rows of heads 0 and
H-1) against exact softmax attention in fp32 over all keys: relative L2 and cosine. The numbers are
a sanity check (a kernel that returns garbage is flagged "!"), not a fidelity figure.

Table columns: ms (median), TFLOP/s at 4 N^2 D H B flops, speedup = baseline ms / ms against FA4
BF16 of the same run (cuDNN when FA4 is absent), rel-L2 and cosine. CSV rows (one per provider,
written as they come, so a run cut short keeps what it measured) carry GPU, torch/triton/CUDA
versions, date, commit (env VC_GIT_COMMIT, else git, else 'unknown') and a hash of kernels/*.py.
"""

import argparse
import csv
import datetime
import gc
import hashlib
import importlib.util
import math
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]

SHAPES = {  # name: (B, H, N, D, note)
    "wan14b-720p": (1, 40, 75_600, 128, "Wan2.2-14B 720p 81f: 21x45x80"),
    "wan-480p": (1, 40, 32_760, 128, "Wan 480p 81f: 21x30x52"),
    "hv15-720p": (1, 16, 111_700, 128, "HunyuanVideo-1.5 720p 121f"),
    "wan5b-720p": (1, 24, 27_280, 128, "Wan2.2-5B 1280x704 121f: 31x22x40"),
    "odd": (1, 8, 10_007, 128, "odd N (partial tiles)"),
}
SMOKE_SHAPES = {
    "smoke-d64": (1, 2, 300, 64, "tiny, D=64, N not a multiple of 128"),
    "smoke-d128": (1, 1, 257, 128, "tiny, D=128"),
}
CSV_FIELDS = ["gpu", "torch", "triton", "cuda", "date", "commit", "src_hash", "mode", "shape", "B", "H",
              "N", "D", "provider", "kind", "ms", "tflops", "speedup", "speedup_vs", "rel_l2", "cosine",
              "note"]


# --------------------------------------------------------------------------------------------------
# Environment


def register_package():
    """Import this checkout as the package `vc_attention` (the repository root is the package)."""
    loaded = sys.modules.get("vc_attention")
    if loaded is not None and pathlib.Path(loaded.__file__).resolve().parent == ROOT:
        return loaded
    spec = importlib.util.spec_from_file_location("vc_attention", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["vc_attention"] = module
    spec.loader.exec_module(module)
    return module


def git_commit():
    """VC_GIT_COMMIT if set (a copy of the tree without .git), else git, else .git files, else 'unknown'."""
    env = os.environ.get("VC_GIT_COMMIT", "").strip()
    if env:
        return env
    git_dir = ROOT / ".git"
    if not git_dir.exists():
        return "unknown"
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        if sha:
            dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no",
                                    "--", "kernels"], capture_output=True, text=True, timeout=10).stdout.strip()
            return sha + ("+dirty-kernels" if dirty else "")
    except Exception:
        pass
    try:
        head = (git_dir / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head[:12]
        ref = head.split(None, 1)[1]
        if (git_dir / ref).exists():
            return (git_dir / ref).read_text().strip()[:12]
        for line in (git_dir / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0][:12]
    except Exception:
        pass
    return "unknown"


def source_hash():
    """sha1 of kernels/**/*.py: identifies the kernel code that ran, committed or not."""
    h = hashlib.sha1()
    for p in sorted((ROOT / "kernels").rglob("*.py")):
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def env_info(torch, device):
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "commit": git_commit(),
        "src_hash": source_hash(),
    }


def package_version(name):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "?"


def slug(text):
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "unknown"


def short_error(exc):
    msg = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace(",", ";")
    return msg[:160]


def free_memory(torch):
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class CsvSink:
    """Appends rows as they come and flushes, so a run cut short keeps what it measured."""

    def __init__(self, path, common):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.common = common
        self.fh = open(self.path, "w", newline="")
        self.writer = csv.DictWriter(self.fh, fieldnames=CSV_FIELDS)
        self.writer.writeheader()
        self.fh.flush()

    def write(self, row):
        full = {k: "" for k in CSV_FIELDS}
        full.update(self.common)
        full.update({k: v for k, v in row.items() if k in CSV_FIELDS})
        for k in ("ms", "tflops", "speedup"):
            if isinstance(full[k], float):
                full[k] = f"{full[k]:.4g}"
        for k in ("rel_l2", "cosine"):
            if isinstance(full[k], float):
                full[k] = f"{full[k]:.6g}"
        self.writer.writerow(full)
        self.fh.flush()

    def close(self):
        self.fh.close()


# --------------------------------------------------------------------------------------------------
# Timing


class Timer:
    """GPU: two warm-up calls, then do_bench's median with >= min_reps timed calls.
    Smoke (CPU): one warm-up call, then the mean of `cpu_reps` perf_counter calls."""

    def __init__(self, torch, device, rep_ms=300.0, min_reps=5, cpu_reps=1):
        self.torch = torch
        self.gpu = device.type == "cuda"
        self.rep_ms = rep_ms
        self.min_reps = min_reps
        self.cpu_reps = cpu_reps

    def __call__(self, fn):
        """fn has already been called once by the caller (compile + output for the check)."""
        torch = self.torch
        if not self.gpu:
            t0 = time.perf_counter()
            for _ in range(self.cpu_reps):
                fn()
            return (time.perf_counter() - t0) * 1e3 / self.cpu_reps
        import triton.testing

        fn()  # second warm-up
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        est = max(start.elapsed_time(end), 1e-3)
        rep = max(self.rep_ms, (self.min_reps + 0.5) * est)
        return float(triton.testing.do_bench(fn, warmup=max(25.0, est), rep=rep, return_mode="median"))


# --------------------------------------------------------------------------------------------------
# Data and the reference


def make_inputs(torch, B, H, N, D, device, seed=0):
    """q, k, v [B, H, N, D] bf16 contiguous (never zeros); see the module docstring."""
    g = torch.Generator(device=device).manual_seed(seed)
    f32 = dict(device=device, dtype=torch.float32, generator=g)
    q = torch.randn(B, H, N, D, **f32).to(torch.bfloat16)
    k = torch.randn(B, H, N, D, **f32)
    k.add_(0.5 * torch.randn(B, H, 1, D, **f32))
    k = k.to(torch.bfloat16)
    v = torch.randn(B, H, N, D, **f32)
    v.add_(0.3 * torch.randn(B, H, 1, D, **f32))
    n_out = max(4, N // 2000)  # outlier tokens per head, at random places that differ per head
    idx = torch.randint(0, N, (B, H, n_out), device=device, generator=g)
    mask = torch.zeros(B, H, N, device=device, dtype=torch.bool)
    mask.scatter_(2, idx, True)
    spike = torch.zeros(B, H, 1, D, device=device)
    chans = torch.randint(0, D, (B, H, 3), device=device, generator=g)
    spike.scatter_(3, chans.unsqueeze(2), 24.0)
    m = mask.unsqueeze(-1).float()
    v.mul_(1.0 + 3.0 * m).add_(m * spike)
    v = v.to(torch.bfloat16)
    return q, k, v


def check_slice(N, H):
    heads = sorted({0, H - 1})
    if N <= 256:
        rows = list(range(N))
    else:
        rows = list(range(128)) + list(range(N - 128, N))
    return heads, rows


def reference_slice(torch, q, k, v, heads, rows):
    """Exact softmax attention in fp32 over all keys for batch 0, the given heads and query rows:
    [len(heads), len(rows), D] fp32."""
    D = q.shape[-1]
    r = torch.tensor(rows, device=q.device)
    outs = []
    for h in heads:
        qs = q[0, h, r].float()
        s = (qs @ k[0, h].float().T) * (D ** -0.5)
        outs.append(torch.softmax(s, dim=-1) @ v[0, h].float())
    return torch.stack(outs)


def take_slice(torch, out, heads, rows, layout):
    """The checked slice of an output in layout 'HND' [B,H,N,D] or 'NHD' [B,N,H,D] -> fp32."""
    r = torch.tensor(rows, device=out.device)
    if layout == "NHD":
        out = out.transpose(1, 2)
    return torch.stack([out[0, h, r].float() for h in heads])


def errors(torch, got, ref):
    got, ref = got.double(), ref.double()
    rel = ((got - ref).norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    return rel, cos


# --------------------------------------------------------------------------------------------------
# Providers


class Skip(Exception):
    """A provider that cannot run here (not an error of the provider): the message goes in the note."""


def import_fa4():
    from flash_attn.cute.interface import flash_attn_func

    return flash_attn_func


def import_sage():
    from sageattention import sageattn

    return sageattn


def capture_call(lib, module, name, run, q):
    """Run run(out) (a public path of the library) while capturing its call to module.name, the
    fused kernel's host function: returns (that function, args, kwargs, out). The operands were
    prepared by the library's own pre-pass, so the captured call is exactly what the path launches."""
    torch = lib["torch"]
    captured = {}
    orig = getattr(module, name)

    def spy(*args, **kwargs):
        captured["args"], captured["kwargs"] = args, kwargs
        return orig(*args, **kwargs)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    setattr(module, name, spy)
    try:
        run(out)
    finally:
        setattr(module, name, orig)
    if "args" not in captured:
        raise RuntimeError(f"the library no longer calls {module.__name__}.{name}: update the harness")
    return orig, captured["args"], captured["kwargs"], out


def capture_kernel_call(lib, q, k, v, *, v_smooth, expcast, perm, **launch):
    """The portable Triton kernel: its host code lives in kernels/pipeline.py (shared with the cubins).
    launch: its launch options (e.g. expcast_tail)."""
    import importlib

    A = lib["tattn"]
    P = importlib.import_module(A.__name__.rsplit(".", 2)[0] + ".pipeline")
    return capture_call(lib, P, "vc_attention_fwd", lambda out: A.triton_vc_attention(
        q, k, v, out, v_smooth=v_smooth, expcast=expcast, perm=perm, **launch), q)


def capture_gluon_call(lib, q, k, v, *, v_smooth, expcast, perm, **launch):
    """The Hopper Gluon kernel behind the same pre-pass; launch: its launch options."""
    return capture_call(lib, lib["gluon_attention"], "vc_attention_fwd_sm90", lambda out: lib["gluon_vc_attention"](
        q, k, v, out, v_smooth=v_smooth, expcast=expcast, perm=perm, **launch), q)


def build_providers(lib, ctx, smoke):
    """[(name, kind, setup)]; setup() -> (fn, layout, out_getter) or raises Skip.
    fn() runs one call; out_getter(result) gives the output to check ([B,H,N,D] or [B,N,H,D])."""
    torch = lib["torch"]
    F = torch.nn.functional
    vc_attention, plan_v_smooth = lib["vc_attention"], lib["plan_v_smooth"]
    provs = []

    def gpu_only():
        if smoke or ctx["device"].type != "cuda":
            raise Skip("needs CUDA (smoke run)")

    # -- peers
    def fa4():
        gpu_only()
        try:
            fa = import_fa4()
        except Exception as exc:
            raise Skip(f"FA4 not importable ({short_error(exc)})")
        qn, kn, vn = ctx["nhd"]()

        def fn():
            r = fa(qn, kn, vn)
            return r[0] if isinstance(r, tuple) else r

        return fn, "NHD"

    def sdpa(backend_name):
        def setup():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            q, k, v = ctx["qkv"]
            if backend_name == "math":
                be = SDPBackend.MATH
            else:
                gpu_only()
                be = SDPBackend.CUDNN_ATTENTION if backend_name == "cudnn" else SDPBackend.FLASH_ATTENTION

            def fn():
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(q, k, v)

            return fn, "HND"

        return setup

    def sage():
        gpu_only()
        try:
            sa = import_sage()
        except Exception as exc:
            raise Skip(f"SageAttention not importable ({short_error(exc)})")
        q, k, v = ctx["qkv"]
        k_own = k.clone()  # sageattn subtracts the K mean in place

        def fn():
            return sa(q, k_own, v, tensor_layout="HND")

        return fn, "HND"

    # -- ours
    def plan():
        if ctx.get("plan") is None:
            ctx["plan"] = plan_v_smooth(ctx["qkv"][2], iters=ctx["iters_cold"], num_clusters=ctx["clusters"],
                                        backend="triton")
        return ctx["plan"]

    def vc_kernel(v_smooth, expcast, **launch):
        def setup():
            q, k, v = ctx["qkv"]
            perm = plan().perm if v_smooth else None
            kern, args, kwargs, out = capture_kernel_call(lib, q, k, v, v_smooth=v_smooth, expcast=expcast,
                                                          perm=perm, **launch)
            if v_smooth and expcast and not launch:  # kept for the breakdown row
                ctx["captured"][(v_smooth, expcast)] = (kern, args, kwargs)

            def fn():
                kern(*args, **kwargs)
                return out

            return fn, "HND"

        return setup

    def vc_public(v_smooth, expcast, backend="triton"):
        def setup():
            if backend == "gluon":
                gluon_only()
            q, k, v = ctx["qkv"]
            p = plan() if v_smooth else None

            def fn():
                return vc_attention(q, k, v, bits=8, v_smooth=v_smooth, expcast=expcast, plan=p,
                                    backend=backend)

            return fn, "HND"

        return setup

    def gluon_only():
        gpu_only()
        if lib.get("gluon_error"):
            raise Skip(f"Gluon Hopper kernel not importable ({lib['gluon_error']})")
        if tuple(torch.cuda.get_device_capability()) != (9, 0):
            raise Skip("the Gluon kernel is for sm_90 (Hopper)")

    def vc_gluon_kernel(v_smooth, expcast, **launch):
        def setup():
            gluon_only()
            q, k, v = ctx["qkv"]
            perm = plan().perm if v_smooth else None
            kern, args, kwargs, out = capture_gluon_call(lib, q, k, v, v_smooth=v_smooth, expcast=expcast,
                                                         perm=perm, **launch)

            def fn():
                kern(*args, **kwargs)
                return out

            return fn, "HND"

        return setup

    def vc_grouping_on(backend):
        def setup():
            if backend == "gluon":
                gluon_only()
            q, k, v = ctx["qkv"]
            p0 = plan()

            def fn():
                p = plan_v_smooth(v, init=p0, iters=ctx["iters_warm"], backend="triton")
                return vc_attention(q, k, v, bits=8, v_smooth=True, expcast=True, plan=p, backend=backend)

            return fn, "HND"

        return setup

    vc_grouping = vc_grouping_on("triton")

    def vc_plan_cold():
        v = ctx["qkv"][2]

        def fn():
            return plan_v_smooth(v, iters=ctx["iters_cold"], num_clusters=ctx["clusters"], backend="triton")

        return fn, None

    def vc_reference():
        if not smoke:
            raise Skip("readable reference: smoke runs only (slow)")
        q, k, v = ctx["qkv"]
        p = plan()

        def fn():
            return vc_attention(q, k, v, bits=8, v_smooth=True, expcast=True, plan=p, backend="reference")

        return fn, "HND"

    # Priority order: if the shape's time budget runs out, the rows at the end are the ones skipped.
    provs += [
        ("FA4 BF16", "baseline", fa4),
        ("SDPA cuDNN BF16", "baseline", sdpa("cudnn")),
        ("VC Hopper V-Smooth+ExpCast kernel", "kernel", vc_gluon_kernel(True, True)),
        # V's residual in two E4M3 terms (the launch option v_terms=2): a second P.V wgmma per tile
        ("VC Hopper V-Smooth+ExpCast kernel, V in two terms", "kernel", vc_gluon_kernel(True, True, v_terms=2)),
        ("VC Hopper V-Smooth+ExpCast kernel, V in two terms, 3 stages", "kernel",
         vc_gluon_kernel(True, True, v_terms=2, stages=3)),
        ("VC Hopper V-Smooth exp2 kernel, V in two terms", "kernel", vc_gluon_kernel(True, False, v_terms=2)),
        ("VC V-Smooth+ExpCast kernel, V in two terms", "kernel", vc_kernel(True, True, v_terms=2)),
        # ExpCast's bytes as E5M2 / as E4M3 (the launch option p_e5m2): what the byte format costs
        ("VC Hopper V-Smooth+ExpCast kernel, E5M2 P", "kernel", vc_gluon_kernel(True, True, p_e5m2=True)),
        ("VC Hopper V-Smooth+ExpCast kernel, E4M3 P", "kernel", vc_gluon_kernel(True, True, p_e5m2=False)),
        ("VC V-Smooth+ExpCast kernel, E5M2 P", "kernel", vc_kernel(True, True, p_e5m2=True)),
        # ExpCast with its tail piece (the launch option expcast_tail=True): what the piece costs
        ("VC Hopper V-Smooth+ExpCast kernel, tail piece", "kernel", vc_gluon_kernel(True, True, expcast_tail=True)),
        ("VC Hopper V-Smooth+ExpCast +prep", "prep", vc_public(True, True, "gluon")),
        ("VC Hopper V-Smooth exp2 kernel", "kernel", vc_gluon_kernel(True, False)),
        ("VC Hopper plain 8-bit kernel", "kernel", vc_gluon_kernel(False, False)),
        ("VC V-Smooth+ExpCast kernel", "kernel", vc_kernel(True, True)),
        ("VC V-Smooth+ExpCast kernel, tail piece", "kernel", vc_kernel(True, True, expcast_tail=True)),
        # The portable kernel's launch choices against its default (kernels/pipeline.py PORTABLE_*: 64-row
        # programs of one warpgroup, V^T in the P.V operand's key order): V^T in key order (P shuffled
        # between the two matmuls), 128-row programs of two warpgroups, both (the schedule before), 2 stages
        ("VC V-Smooth+ExpCast kernel, key order", "kernel", vc_kernel(True, True, pv_perm=False)),
        ("VC V-Smooth+ExpCast kernel, 128-row blocks", "kernel", vc_kernel(True, True, block_m=128, num_warps=8)),
        ("VC V-Smooth+ExpCast kernel, 128-row blocks, key order", "kernel",
         vc_kernel(True, True, block_m=128, num_warps=8, pv_perm=False)),
        ("VC V-Smooth+ExpCast kernel, 2 stages", "kernel", vc_kernel(True, True, num_stages=2)),
        ("VC V-Smooth+ExpCast +prep", "prep", vc_public(True, True)),
        ("VC V-Smooth exp2 kernel", "kernel", vc_kernel(True, False)),
        ("VC V-Smooth exp2 +prep", "prep", vc_public(True, False)),
        ("VC plain 8-bit kernel", "kernel", vc_kernel(False, False)),
        ("VC plain 8-bit +prep", "prep", vc_public(False, False)),
        ("Sage 1.0.6", "baseline", sage),
        ("VC grouping step (kmeans x2 + attn)", "grouping", vc_grouping),
        ("VC Hopper grouping step (kmeans x2 + attn)", "grouping", vc_grouping_on("gluon")),
        ("VC plan cold (kmeans x10 alone)", "aux", vc_plan_cold),
        ("SDPA flash BF16", "baseline", sdpa("flash")),
    ]
    if smoke:
        provs.insert(1, ("SDPA math (CPU)", "baseline", sdpa("math")))
        provs.append(("VC V-Smooth+ExpCast reference (readable)", "prep", vc_reference))
    return provs


def breakdown_providers(lib, ctx):
    """Where the time of one V-Smooth + ExpCast call goes (frozen plan): each stage timed alone.
    Mirrors triton_vc_attention's pre-pass; if that changes, these rows report the error."""
    P = lib["prepass"]
    plan_v_smooth = lib["plan_v_smooth"]
    fold_score_scale, smoothing_mean = P.pipeline.fold_score_scale, P.pipeline.smoothing_mean

    def setup_common():
        q, k, v = ctx["qkv"]
        B, H, N, D = k.shape
        perm = ctx["plan"].perm.reshape(B * H, N).contiguous()
        return q, k, v, B, H, N, D, perm

    def quant_q():
        q, k, v, B, H, N, D, perm = setup_common()

        def fn():
            codes, scales, bad = P.quantize_qk_blocks(q)
            return codes, fold_score_scale(scales, D ** -0.5)

        return fn, None

    def quant_k():
        q, k, v, B, H, N, D, perm = setup_common()

        def fn():
            k_mean = smoothing_mean(k).reshape(B * H, D).contiguous()
            codes, scales, bad_rows = P.quantize_qk_blocks(k, perm, k_mean)
            return bad_rows.amax(dim=1)

        return fn, None

    def v_prepass():
        q, k, v, B, H, N, D, perm = setup_common()

        def fn():
            return P.quantize_v_residual(v, perm, True)

        return fn, None

    def kernel():
        got = ctx["captured"].get((True, True))
        if got is None:
            raise Skip("the V-Smooth+ExpCast kernel row did not run")
        kern, args, kwargs = got

        def fn():
            return kern(*args, **kwargs)

        return fn, None

    def kmeans(iters, warm):
        def setup():
            v = ctx["qkv"][2]
            p0 = ctx["plan"] if warm else None

            def fn():
                return plan_v_smooth(v, init=p0, iters=iters, num_clusters=ctx["clusters"], backend="triton")

            return fn, None

        return setup

    return [
        ("  breakdown: quantize Q", "breakdown", quant_q),
        ("  breakdown: K mean + quantize K", "breakdown", quant_k),
        ("  breakdown: V pre-pass", "breakdown", v_prepass),
        ("  breakdown: kernel (ExpCast)", "breakdown", kernel),
        ("  breakdown: k-means warm x%d" % ctx["iters_warm"], "breakdown", kmeans(ctx["iters_warm"], True)),
        ("  breakdown: k-means cold x%d" % ctx["iters_cold"], "breakdown", kmeans(ctx["iters_cold"], False)),
    ]


# --------------------------------------------------------------------------------------------------
# The run


def load_library(torch):
    register_package()
    from vc_attention.kernels import plan_v_smooth, vc_attention
    import vc_attention.kernels.triton.attention as tattn
    import vc_attention.kernels.triton.prepass as prepass

    lib = {"torch": torch, "vc_attention": vc_attention, "plan_v_smooth": plan_v_smooth,
           "tattn": tattn, "prepass": prepass}
    try:  # the Hopper kernel needs Gluon's Hopper API; its rows say why when it is missing
        import vc_attention.kernels.gluon as gluon
        import vc_attention.kernels.gluon.launch_sm90 as gluon_attention

        lib.update(gluon_vc_attention=gluon.gluon_vc_attention, gluon_attention=gluon_attention)
    except Exception as exc:
        lib["gluon_error"] = f"{type(exc).__name__}: {exc}"
    return lib


def finish_row(row, base, rows, sink):
    """Speedup against the run's baseline row (not for aux/breakdown rows), a CHECK flag where the
    output's error is large or not finite; then the row is kept and written (shared with block_forward.py)."""
    if base is not None and "ms" in row and row["kind"] not in ("aux", "breakdown"):
        row["speedup"], row["speedup_vs"] = base["ms"] / row["ms"], base["provider"]
    if "rel_l2" in row and not (math.isfinite(row["rel_l2"]) and row["rel_l2"] < 0.1):
        row["note"] = ("CHECK: large error; " + row.get("note", "")).strip("; ")
    rows.append(row)
    sink.write(row)


def run_shape(lib, name, shape, args, timer, sink, device, deadline):
    torch = lib["torch"]
    B, H, N, D, note = shape
    flops = 4.0 * N * N * D * H * B
    t_shape = time.perf_counter()
    budget_end = min(deadline, t_shape + args.shape_budget_s)
    rows = []
    print(f"\n== {name}: B={B} H={H} N={N} D={D} ({note}); {flops / 1e12:.2f} TFLOP per call", flush=True)

    q, k, v = make_inputs(torch, B, H, N, D, device)
    heads, rrows = check_slice(N, H)
    ref = reference_slice(torch, q, k, v, heads, rrows)
    nhd_cache = {}

    def nhd():
        if "t" not in nhd_cache:
            nhd_cache["t"] = tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))
        return nhd_cache["t"]

    ctx = {"qkv": (q, k, v), "nhd": nhd, "device": device, "plan": None, "captured": {},
           # k-means: 64 clusters, 10 iterations cold, 2 warm (the library defaults); fewer in smoke runs,
           # where the interpreter makes every k-means iteration take seconds
           "clusters": 8 if args.smoke else 64, "iters_cold": 1 if args.smoke else 10,
           "iters_warm": 1 if args.smoke else 2}
    provs = build_providers(lib, ctx, args.smoke)
    if args.providers:
        wanted = [w.strip().lower() for w in args.providers.split(",") if w.strip()]
        provs = [p for p in provs if any(w in p[0].lower() for w in wanted)]
    if args.profile_breakdown:
        provs += breakdown_providers(lib, ctx)

    for pname, kind, setup in provs:
        row = {"shape": name, "B": B, "H": H, "N": N, "D": D, "provider": pname, "kind": kind}
        if time.perf_counter() > budget_end:
            row["note"] = "skipped: time budget of the shape/run spent"
            rows.append(row)
            sink.write(row)
            print(f"  {pname:<40s} {'':13s}  [{row['note']}]", flush=True)
            continue
        fn = res = None
        t0 = time.perf_counter()
        try:
            fn, layout = setup()
            res = fn()  # warm-up + compile; its output is checked
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            if layout is not None:
                row["rel_l2"], row["cosine"] = errors(torch, take_slice(torch, res, heads, rrows, layout), ref)
            res = None
            ms = timer(fn)
            row["ms"] = ms
            if kind not in ("aux", "breakdown"):
                row["tflops"] = flops / (ms * 1e-3) / 1e12
            if first_s > 5.0:
                row["note"] = f"first call {first_s:.1f} s (compile)"
        except Skip as exc:
            row["note"] = f"skipped: {exc}"
        except Exception as exc:
            row["note"] = "ERROR " + short_error(exc)
            if args.verbose:
                traceback.print_exc()
        finally:
            fn = res = None
            free_memory(torch)
        finish_row(row, baseline_row(rows), rows, sink)
        line = f"  {pname:<40s} " + (f"{row['ms']:10.3f} ms" if "ms" in row else " " * 13)
        if "rel_l2" in row:
            line += f"  rel-L2 {row['rel_l2']:.3e}"
        if row.get("note"):
            line += f"  [{row['note']}]"
        print(line, flush=True)

    if args.rounds >= 2:
        alternating_rounds(provs, rows, args.rounds, timer, sink, torch, name, shape, budget_end + 60.0)
    base = baseline_row(rows)
    del q, k, v, ref, ctx, nhd_cache
    free_memory(torch)
    return rows, base, time.perf_counter() - t_shape


def baseline_row(rows, suffix=""):
    """FA4 of these rows; cuDNN when FA4 did not run; else the first baseline that did (suffix: the
    alternating rows' name ending)."""
    for pick in (lambda r: r["provider"] == "FA4 BF16" + suffix,
                 lambda r: r["provider"] == "SDPA cuDNN BF16" + suffix,
                 lambda r: r["kind"] == "baseline"):
        got = next((r for r in rows if pick(r) and "ms" in r), None)
        if got is not None:
            return got
    return None


def alternating_rounds(provs, rows, rounds, timer, sink, torch, name, shape, budget_end):
    """The baseline / kernel / +prep providers that ran in this shape's pass, set up together and
    timed in `rounds` rounds, forwards and backwards in turn, so that a drift of the GPU's clock over
    the run weighs on all of them alike; one row each with the median over the rounds."""
    B, H, N, D, _ = shape
    ran = {r["provider"] for r in rows if "ms" in r and r["kind"] in ("baseline", "kernel", "prep")}
    fns = []
    for pname, kind, setup in provs:
        if pname in ran:
            try:
                fn, _ = setup()
                fn()
                fns.append((pname, kind, fn, []))
            except Exception as exc:  # it ran in the pass; a failure now is reported, not fatal
                print(f"  {pname} [alternating]: setup failed: {short_error(exc)}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    done = 0
    for r in range(rounds):
        if time.perf_counter() > budget_end:
            print(f"  alternating rounds stopped after {r} (time budget)", flush=True)
            break
        for pname, kind, fn, times in (fns if r % 2 == 0 else fns[::-1]):
            times.append(timer(fn))
        done += 1
    suffix = f" [{done} alternating]"
    alt_rows = []
    for pname, kind, fn, times in fns:
        if not times:
            continue
        row = {"shape": name, "B": B, "H": H, "N": N, "D": D, "provider": pname + suffix,
               "kind": kind, "ms": statistics.median(times),
               "note": "rounds " + "/".join(f"{t:.2f}" for t in times) + " ms"}
        row["tflops"] = 4.0 * N * N * D * H * B / (row["ms"] * 1e-3) / 1e12
        alt_rows.append(row)
    base = baseline_row(alt_rows, suffix)
    for row in alt_rows:
        finish_row(row, base, rows, sink)
        print(f"  {row['provider']:<40s} {row['ms']:10.3f} ms"
              + (f"  {row['speedup']:.3f}x" if "speedup" in row else "") + f"  [{row['note']}]", flush=True)
    fns.clear()
    free_memory(torch)


def summarise(rows):
    """Derived figures against the issue's targets."""
    by = {r["provider"]: r for r in rows if "ms" in r}
    out = []
    ker, pre = by.get("VC V-Smooth+ExpCast kernel"), by.get("VC V-Smooth+ExpCast +prep")
    grp = by.get("VC grouping step (kmeans x2 + attn)")
    if ker and pre:
        out.append(f"preprocessing share (+prep / kernel - 1): {100 * (pre['ms'] / ker['ms'] - 1):+.1f}%"
                   " (target <= 5%)")
    if grp and pre:
        out.append(f"grouping step vs non-grouping call: {100 * (grp['ms'] / pre['ms'] - 1):+.1f}% (target <= +30%)")
    parts = [by.get(f"  breakdown: {n}") for n in ("quantize Q", "K mean + quantize K", "V pre-pass")]
    if all(parts) and ker:
        s = sum(p["ms"] for p in parts)
        out.append(f"Q+K+V pre-pass alone {s:.2f} ms = {100 * s / ker['ms']:.1f}% of the kernel")
    return out


def print_table(all_rows, bases):
    print("\n" + "=" * 118)
    hdr = f"{'shape':<12s} {'provider':<40s} {'ms':>9s} {'TFLOP/s':>8s} {'speedup':>8s} {'rel-L2':>9s} {'cosine':>8s}  note"
    print(hdr)
    print("-" * 118)
    for name, rows in all_rows:
        base = bases.get(name)
        for r in rows:
            ms = f"{r['ms']:9.3f}" if "ms" in r else f"{'-':>9s}"
            tf = f"{r['tflops']:8.1f}" if "tflops" in r else f"{'':>8s}"
            sp = f"{r['speedup']:7.3f}x" if "speedup" in r else f"{'':>8s}"
            rel = f"{r['rel_l2']:9.2e}" if "rel_l2" in r else f"{'':>9s}"
            cos = f"{r['cosine']:8.5f}" if "cosine" in r else f"{'':>8s}"
            flag = " !" if "CHECK" in r.get("note", "") else ""
            print(f"{name:<12s} {r['provider']:<40s} {ms} {tf} {sp} {rel} {cos}{flag}  {r.get('note', '')}")
        if base is not None:
            print(f"{'':<12s} (speedup = {base['provider']} ms / ms, same run)")
        for line in summarise(rows):
            print(f"{'':<12s} {line}")
        print("-" * 118)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="", help="comma list of shape names (default: all): " + ", ".join(SHAPES))
    ap.add_argument("--providers", default="", help="comma list of substrings of provider names to keep")
    ap.add_argument("--quick", action="store_true", help="fewer repeats (>= 3 timed calls, rep 100 ms)")
    ap.add_argument("--profile-breakdown", action="store_true",
                    help="also time quantize Q, quantize K, V pre-pass, kernel, k-means separately")
    ap.add_argument("--out", default="", help="CSV path (default benchmarks/results/attention_speed_<gpu>_<date>.csv)")
    ap.add_argument("--shape-budget-s", type=float, default=150.0, help="stop starting providers of a shape after this")
    ap.add_argument("--deadline-s", type=float, default=330.0, help="stop starting providers after this (whole run)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1, perf_counter")
    ap.add_argument("--rounds", type=int, default=0,
                    help="also time the baseline / kernel / +prep rows again in R alternating rounds (R >= 2)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing providers")
    args = ap.parse_args(argv)

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's kernels are defined
    import torch

    t_start = time.perf_counter()
    deadline = t_start + args.deadline_s
    if args.smoke:
        device = torch.device("cpu")
        shapes = dict(SMOKE_SHAPES)
        timer = Timer(torch, device, cpu_reps=1)
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA GPU: run on a CUDA GPU, or use --smoke on the CPU")
        device = torch.device("cuda")
        shapes = dict(SHAPES)
        timer = Timer(torch, device, rep_ms=100.0 if args.quick else 300.0, min_reps=3 if args.quick else 5)
    if args.shapes:
        names = [s.strip() for s in args.shapes.split(",") if s.strip()]
        unknown = [s for s in names if s not in shapes]
        if unknown:
            sys.exit(f"unknown shape(s) {unknown}; known: {list(shapes)}")
        shapes = {s: shapes[s] for s in names}

    lib = load_library(torch)
    info = env_info(torch, device)
    info["mode"] = "smoke" if args.smoke else ("quick" if args.quick else "full")
    if args.out:
        out = pathlib.Path(args.out)
    elif args.smoke:
        out = pathlib.Path("/tmp/attention_speed_smoke.csv")
    else:
        out = ROOT / "benchmarks" / "results" / f"attention_speed_{slug(info['gpu'])}_{info['date'][:10]}.csv"
    print(f"gpu {info['gpu']} | torch {info['torch']} | triton {info['triton']} | cuda {info['cuda']} | "
          f"commit {info['commit']} | kernels src {info['src_hash']} | {info['date']}")
    print(f"peers: flash-attn-4 {package_version('flash-attn-4')}, sageattention {package_version('sageattention')};"
          f" mode {info['mode']}; CSV -> {out}", flush=True)
    if args.smoke:
        print("smoke: tiny shapes on the CPU (Triton interpreter), k-means with 8 clusters and 1 iteration; "
              "times mean nothing", flush=True)
    sink = CsvSink(out, info)
    all_rows, bases = [], {}
    try:
        for name, shape in shapes.items():
            try:
                with torch.inference_mode():
                    rows, base, secs = run_shape(lib, name, shape, args, timer, sink, device, deadline)
            except Exception as exc:  # e.g. out of memory making the inputs
                print(f"  shape {name} failed: {short_error(exc)}", flush=True)
                if args.verbose:
                    traceback.print_exc()
                row = {"shape": name, "provider": "(shape)", "note": "ERROR " + short_error(exc)}
                sink.write(row)
                rows, base, secs = [row], None, 0.0
                free_memory(torch)
            all_rows.append((name, rows))
            if base is not None:
                bases[name] = base
            print(f"  ({name}: {secs:.1f} s)", flush=True)
    finally:
        sink.close()
    print_table(all_rows, bases)
    print(f"total {time.perf_counter() - t_start:.1f} s; CSV written to {out}")


if __name__ == "__main__":
    main()
