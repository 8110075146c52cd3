"""One command for an RTX 5090 (or RTX PRO 6000 / RTX 4090 / B200) owner: are the workstation builds
correct on your card (the 4-bit NVFP4 kernel; the 8-bit kernel for mma.sync GPUs), and how fast are
they against torch SDPA, SageAttention (if installed) and our portable 8-bit kernel? Prints a
summary to paste back and writes it as JSON.

    python benchmarks/rtx5090_check.py            # about 2-5 minutes on an RTX 5090
    python benchmarks/rtx5090_check.py --quick    # smaller shapes, fewer repeats
    TRITON_INTERPRET=1 python benchmarks/rtx5090_check.py --smoke   # CPU: checks the script runs

No Blackwell GPU was available to the developers: the 4-bit kernel was compiled for sm_100 / sm_120
and its math checked on an H200 (emulated dot_scaled) and on the CPU, never timed natively. This
script is how we get those numbers. Send the printed block (or the JSON file) back.

1. Environment: GPU, compute capability, driver/CUDA, torch, triton; what the dispatcher runs for
   bits=4 and bits=8 on this GPU, and why.
2. Correctness (B=1, H=8, N=4,173, D=128, bf16, outlier value tokens, a padding bias, a k-means plan):
   4-bit native kernel (tl.dot_scaled, FP4 tensor cores) vs the readable reference
   (reference_vc_attention(bits=4)), vs the kernel's decoded twin (same math without dot_scaled),
   and vs exact attention; 8-bit kernel vs its reference. PASS bounds: native vs reference and
   twin vs reference < 2e-3, native vs twin < 1e-4 (relative L2, fp32 outputs).
   The 8-bit kernel for mma.sync GPUs (INT8 Q.K, FP8 P.V accumulated in FP16 over runs of 128
   keys; kernels/triton/attention_mma.py), its FP32 version and its INT8 P.V path, vs its reference
   (kernels/reference/workstation.py) and exact attention: PASS needs < 1e-2 against the reference
   and an error against exact within 10% of the reference's own.
3. Speed (B=1, D=128, bf16, non-causal; median of triton.testing.do_bench): Wan 480p (H=40,
   N=32,760), Wan2.2-14B 720p (H=40, N=75,600), odd N (H=8, N=10,007). Rows: torch SDPA (default
   and flash backends), VC 8-bit (public call with a frozen plan), VC 4-bit public call (+prep:
   quantisers and V pre-pass included) and kernel alone (operands prepared outside the timer) in a
   few tilings (the default, 128 queries x 64 keys, was chosen from ptxas spill counts, not timings);
   the mma.sync 8-bit kernel (public-style call and kernel alone, FP16 and FP32 P.V, INT8 P.V) and
   SageAttention when it is installed.
   TFLOP/s at 4 B H N^2 D; speedup against the fastest SDPA row of the same shape.
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from attention_speed import register_package  # noqa: E402  (imports this checkout as vc_attention)

SHAPES = {"wan-480p": (40, 32_760), "wan14b-720p": (40, 75_600), "odd": (8, 10_007)}
QUICK_SHAPES = {"wan-480p": (40, 32_760), "odd": (8, 10_007)}
SMOKE_SHAPES = {"tiny": (2, 200)}
# 4-bit kernel tilings timed alone (block_m x block_n, warps, stages); the first is the default.
KERNEL_CONFIGS = [(128, 128, 8, 2), (128, 64, 8, 2), (128, 128, 8, 3), (64, 64, 4, 2)]
# 4-bit settings timed at the default tiling: (pre-pass keywords, launch options). The paper's block
# mean (and the CUDA-core row sum and comparison rounding, which need it), then the default's alternatives.
FP4_OPTIONS = [({"mean_group": 128}, {}), ({"mean_group": 128}, {"e2m1_magic": False, "rowsum_dot": False}),
               ({"mean_group": 128}, {"rowsum_dot": False}), ({}, {"mean_f16_acc": True}),
               ({}, {"mean_f16_acc": False}), ({}, {"k_order": False}), ({}, {"e2m1_cvt": True})]
# 4-bit settings checked on the card against the native build they change (name, keywords, the
# keywords of that build, bound on the relative L2 difference): the same values in another order or
# through other instructions; the means' FP16 accumulator rounds their sums (2^-11 of the mean term).
FP4_CHECKED = [("e2m1_cvt", {"e2m1_cvt": True}, {}, 1e-4), ("k_order", {"k_order": False}, {}, 1e-4),
               ("rowsum_dot", {"rowsum_dot": False, "mean_group": 128}, {"mean_group": 128}, 1e-4),
               ("mean_f16_acc", {"mean_f16_acc": True}, {"mean_f16_acc": False}, 1e-3)]


class _Lib:
    """The library's public kernels module as `lib.kernels` (the package root is the node pack)."""

    def __init__(self):
        register_package()
        import vc_attention.kernels as kernels

        self.kernels = kernels


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def make_inputs(torch, B, H, N, D, device, seed=0):
    """bf16 q, k, v: k with a per-channel offset; v in 16 clusters per head (as video tokens are:
    without structure the softmax average of V is small and every method's relative error looks
    large) plus noise, and a few outlier tokens (x8)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, N, D, device=device, generator=g).to(torch.bfloat16)
    k = (torch.randn(B, H, N, D, device=device, generator=g)
         + 0.5 * torch.randn(B, H, 1, D, device=device, generator=g)).to(torch.bfloat16)
    centers = 2.0 * torch.randn(B, H, 16, D, device=device, generator=g)
    assign = torch.randint(0, 16, (B, H, N), device=device, generator=g)
    v = torch.gather(centers, 2, assign[..., None].expand(-1, -1, -1, D))
    v += 0.3 * torch.randn(B, H, N, D, device=device, generator=g)
    v[:, :, :: max(7, N // 40)] *= 8.0
    return q, k, v.to(torch.bfloat16)


def timer(torch, smoke, quick):
    def bench(fn):
        fn()
        if smoke:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import triton.testing

        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=50, rep=200 if quick else 500,
                                             return_mode="median"))
    return bench


def environment(torch, lib, device):
    import triton

    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": str(torch.version.cuda), "platform": platform.platform()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, capability=f"sm_{p.major}{p.minor}", sms=p.multi_processor_count,
                    memory_gb=round(p.total_memory / 2**30, 1))
        try:
            info["driver"] = torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None
        except Exception:
            pass
    else:
        info.update(gpu=f"cpu ({platform.machine()})", capability=None)
    x = torch.zeros(1, 1, 256, 128, device=device, dtype=torch.bfloat16)
    for bits in (4, 8):
        try:
            info[f"dispatch_bits{bits}"] = str(lib.kernels.explain_backend(x, x, x, bits=bits))
        except Exception as exc:
            info[f"dispatch_bits{bits}"] = f"error: {exc}"
    return info


def correctness(torch, lib, device, smoke):
    from vc_attention.kernels.reference import exact_attention, reference_vc_attention
    from vc_attention.kernels.triton.attention_fp4 import triton_vc_attention_fp4

    H, N = (2, 200) if smoke else (8, 4173)
    q, k, v = make_inputs(torch, 1, H, N, 128, device, seed=1)
    bias = torch.zeros(1, 1, 1, N, device=device)
    bias[..., -61:] = float("-inf")
    plan = lib.kernels.plan_v_smooth(v, num_clusters=16 if smoke else 64, iters=10,
                                     backend="reference" if smoke else "auto")
    rows = slice(0, min(N, 512))
    exact = exact_attention(q[:, :, rows], k, v, key_bias=bias, dtype=torch.float32)
    res = {}

    def fp4(native, **opts):
        out = torch.empty(q.shape, dtype=torch.float32, device=device)
        return triton_vc_attention_fp4(q, k, v, out, perm=plan.perm, key_bias=bias, native=native, **opts)

    ref4 = reference_vc_attention(q, k, v, bits=4, perm=plan.perm, key_bias=bias)
    ref4_block = reference_vc_attention(q, k, v, bits=4, perm=plan.perm, key_bias=bias, v_mean_group=128)
    ref4_plain = reference_vc_attention(q, k, v, bits=4, v_smooth=False, key_bias=bias)
    res["ref4_vs_exact"] = rel_l2(ref4[:, :, rows], exact)
    res["ref4_block_mean_vs_exact"] = rel_l2(ref4_block[:, :, rows], exact)
    res["ref4_plain_vs_exact"] = rel_l2(ref4_plain[:, :, rows], exact)
    twin = fp4(False)
    res["twin4_vs_ref"] = rel_l2(twin, ref4)
    native_ok = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (10, 12)
    if native_ok:
        try:
            nat = fp4(True)
            torch.cuda.synchronize()
            res["native4_vs_ref"] = rel_l2(nat, ref4)
            res["native4_vs_twin"] = rel_l2(nat, twin)
            res["native4_vs_exact"] = rel_l2(nat[:, :, rows], exact)
            res["native4_nan"] = bool(nat.isnan().any())
            nat_block = fp4(True, mean_group=128)
            torch.cuda.synchronize()
            res["native4_block_mean_vs_ref"] = rel_l2(nat_block, ref4_block)
        except Exception as exc:
            res["native4_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        # Settings checked only on such a card: the hardware E2M1 conversion (the same codes as the
        # default's rounding), P through shared memory (K in key order: the same values), with the
        # block mean the row sum on the CUDA cores (the same values, summed there), and the means'
        # mma with an FP16 accumulator against an FP32 one
        for opt, kw, base_kw, _ in FP4_CHECKED:
            try:
                got, base = fp4(True, **kw), fp4(True, **base_kw)
                torch.cuda.synchronize()
                res[f"native4_{opt}_vs_native"] = rel_l2(got, base)
            except Exception as exc:
                res[f"native4_{opt}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    else:
        res["native4"] = "not run: needs sm_100 / sm_120 (FP4 tensor cores)"
    try:
        out8 = lib.kernels.vc_attention(q, k, v, bits=8, plan=plan, key_bias=bias, backend="triton")
        ref8 = reference_vc_attention(q, k, v, bits=8, perm=plan.perm, key_bias=bias,
                                      expcast=lib.kernels.explain_backend(q, k, v, bits=8).expcast)
        res["triton8_vs_ref"] = rel_l2(out8, ref8.to(out8.dtype))
        res["triton8_vs_exact"] = rel_l2(out8[:, :, rows], exact)
    except Exception as exc:
        res["triton8_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    mma8(torch, q, k, v, plan, bias, rows, exact, res)
    checks = [res.get("twin4_vs_ref", 1) < 2e-3]
    for acc in ("fp16", "fp32", "int8"):  # the mma.sync 8-bit kernel: its reference, and no worse than it
        if f"mma8_{acc}_vs_ref" in res:
            checks += [res[f"mma8_{acc}_vs_ref"] < 1e-2,
                       res[f"mma8_{acc}_vs_exact"] <= 1.1 * res[f"mma8_{acc}_ref_vs_exact"] + 1e-3]
        elif device.type == "cuda":
            checks.append(False)
    if "native4_vs_ref" in res:
        checks += [res["native4_vs_ref"] < 2e-3, res["native4_vs_twin"] < 1e-4, not res["native4_nan"],
                   res.get("native4_block_mean_vs_ref", 1) < 2e-3]
        checks += [res.get(f"native4_{opt}_vs_native", 1) < tol for opt, _, _, tol in FP4_CHECKED]
    elif native_ok:
        checks.append(False)
    res["verdict"] = "PASS" if all(checks) else "FAIL"
    return res


def mma8(torch, q, k, v, plan, bias, rows, exact, res):
    """The 8-bit kernel for mma.sync GPUs (kernels/triton/attention_mma.py: INT8 Q.K, FP8 P.V with
    FP16 accumulation over 128-key runs), its FP32 version and its INT8 P.V path, against their
    readable reference (kernels/reference/workstation.py) and exact attention."""
    from vc_attention.kernels.reference.workstation import workstation_vc_attention
    from vc_attention.kernels.triton.attention_mma import mma_vc_attention

    for acc, pv in (("fp16", "fp16_run"), ("fp32", "fp32"), ("int8", "int8")):
        try:
            out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            opts = dict(pv_int8=True) if pv == "int8" else dict(pv_acc16=pv == "fp16_run")
            mma_vc_attention(q, k, v, out, perm=plan.perm, key_bias=bias, **opts)
            ref = workstation_vc_attention(q, k, v, perm=plan.perm, key_bias=bias, pv_accumulation=pv,
                                           fp16_round_keys=32 if pv == "fp16_run" and q.is_cuda else None)
            res[f"mma8_{acc}_vs_ref"] = rel_l2(out, ref)
            res[f"mma8_{acc}_vs_exact"] = rel_l2(out[:, :, rows], exact)
            res[f"mma8_{acc}_ref_vs_exact"] = rel_l2(ref[:, :, rows], exact)
        except Exception as exc:
            res[f"mma8_{acc}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"


def speed(torch, lib, device, shapes, smoke, quick):
    import torch.nn.functional as F

    from vc_attention.kernels.triton.attention_fp4 import launch_fp4, prepare_fp4

    bench = timer(torch, smoke, quick)
    native = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in (10, 12)
    rows = []
    for name, (H, N) in shapes.items():
        D = 128
        flops = 4.0 * H * N * N * D
        q, k, v = make_inputs(torch, 1, H, N, D, device)
        plan = lib.kernels.plan_v_smooth(v, num_clusters=16 if smoke else 64, iters=10,
                                         backend="reference" if smoke else "auto")
        providers = {"sdpa default": lambda: F.scaled_dot_product_attention(q, k, v)}
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def flash():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v)
            providers["sdpa flash"] = flash
        providers["vc 8-bit +prep"] = lambda: lib.kernels.vc_attention(q, k, v, bits=8, plan=plan,
                                                                       backend="triton")
        # what the patch node runs by default on this GPU (on an RTX card: the INT8 P.V path)
        providers["vc 8-bit public call (defaults)"] = lambda: lib.kernels.vc_attention(q, k, v, bits=8, plan=plan)
        from vc_attention.kernels.triton import attention_mma as am

        providers["vc 8-bit mma.sync +prep"] = lambda: am.mma_vc_attention(q, k, v, torch.empty_like(q),
                                                                           perm=plan.perm)
        mma_ops, mma_bias = am.prepare_mma(am.mma_launch, q, k, v, perm=plan.perm)
        mma_out = torch.empty_like(q)
        providers["vc 8-bit mma.sync kernel"] = lambda: am.mma_attention_fwd(am.mma_launch, *mma_ops, mma_out, H)
        providers["vc 8-bit mma.sync kernel, FP32 P.V"] = lambda: am.mma_attention_fwd(
            am.mma_launch, *mma_ops, mma_out, H, pv_acc16=False)
        # the INT8 P.V path (INT8 V per (block, channel), unsigned INT8 P per tile; FIDELITY.md): its
        # own 128-key tiles (the default on these cards), and 64-key tiles (3 and 2 stages)
        mma_ops8 = am.prepare_mma(am.mma_launch, q, k, v, perm=plan.perm, pv_int8=True)[0]
        for label, opt in (("", {}), (", 64-key tiles", {"block_n": 64, "run_tiles": 2}),
                           (", 64-key tiles, 2 stages", {"block_n": 64, "run_tiles": 2, "num_stages": 2})):
            providers[f"vc 8-bit mma.sync kernel, INT8 P.V{label}"] = lambda opt=opt: am.mma_attention_fwd(
                am.mma_launch, *mma_ops8, mma_out, H, **opt)
        # its launch options (benchmarks/workstation_model.py's PREDICTED variants)
        for label, opt in ([] if smoke else [("exp2 + FMUL (exp2_fma off)", {"exp2_fma": False}),
                                             ("ExpCast", {"expcast": True}), ("2 stages", {"num_stages": 2})]):
            providers[f"vc 8-bit mma.sync kernel, {label}"] = lambda opt=opt: am.mma_attention_fwd(
                am.mma_launch, *mma_ops, mma_out, H, **opt)
        try:
            from sageattention import sageattn

            providers["sageattention (installed)"] = lambda: sageattn(q, k, v, tensor_layout="HND")
        except Exception:
            pass
        prep = prepare_fp4(q, k, v, perm=plan.perm)
        out = torch.empty_like(q)
        tag = "native" if native else "twin (no FP4 tensor cores)"
        providers[f"vc 4-bit +prep {tag}"] = lambda: launch_fp4(
            prepare_fp4(q, k, v, perm=plan.perm), out, native=native)
        for bm, bn, w, st in (KERNEL_CONFIGS[:1] if smoke else KERNEL_CONFIGS):
            providers[f"vc 4-bit kernel {tag} {bm}x{bn} w{w} s{st}"] = (
                lambda bm=bm, bn=bn, w=w, st=st: launch_fp4(prep, out, native=native, block_m=bm,
                                                            block_n=bn, num_warps=w, num_stages=st))
        # the settings of the default tiling (benchmarks/workstation_model.py predicts them)
        preps = {128: prepare_fp4(q, k, v, perm=plan.perm, mean_group=128)}
        for prep_kw, opt in [o for o in FP4_OPTIONS if native or "e2m1_cvt" not in o[1]]:
            p = preps[prep_kw["mean_group"]] if prep_kw else prep
            label = ",".join(f"{k}={v}" for k, v in {**prep_kw, **opt}.items())
            providers[f"vc 4-bit kernel {tag} {label}"] = lambda p=p, opt=opt: launch_fp4(p, out, native=native, **opt)
        shape_rows = []
        for pname, fn in providers.items():
            row = {"shape": name, "H": H, "N": N, "D": D, "provider": pname}
            try:
                ms = bench(fn)
                row.update(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            shape_rows.append(row)
            print(f"  {name:12s} {pname:40s} " + (f"{row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s"
                                                  if "ms" in row else row["error"]), flush=True)
        base = min((r["ms"] for r in shape_rows if r["provider"].startswith("sdpa") and "ms" in r),
                   default=None)
        for r in shape_rows:
            if base and "ms" in r:
                r["speedup_vs_sdpa"] = round(base / r["ms"], 2)
        rows += shape_rows
        del q, k, v, plan, prep, out, mma_ops, mma_ops8, mma_out
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="Wan 480p and odd N only, fewer repeats")
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny shapes")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/rtx5090_check_<gpu>_<date>.json)")
    args = ap.parse_args(argv)

    lib = _Lib()
    import torch

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA GPU found (use --smoke for a CPU check of the script)")
        device = torch.device("cuda")

    report = {"env": environment(torch, lib, device)}
    print("== environment")
    for key, val in report["env"].items():
        print(f"  {key}: {val}")
    print("== correctness (relative L2)")
    try:
        report["correctness"] = correctness(torch, lib, device, args.smoke)
    except Exception:
        report["correctness"] = {"verdict": "ERROR", "traceback": traceback.format_exc()[-3000:]}
    for key, val in report["correctness"].items():
        print(f"  {key}: {val:.3g}" if isinstance(val, float) else f"  {key}: {val}")
    if not args.skip_speed:
        print("== speed (ms, median)")
        shapes = SMOKE_SHAPES if args.smoke else QUICK_SHAPES if args.quick else SHAPES
        report["speed"] = speed(torch, lib, device, shapes, args.smoke, args.quick)

    gpu = report["env"].get("gpu", "gpu").replace(" ", "_").replace("/", "_")
    out = pathlib.Path(args.out) if args.out else (
        ROOT / "benchmarks" / "results" / f"rtx5090_check_{gpu}_{datetime.date.today()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"== verdict: {report['correctness'].get('verdict')}   (saved {out}; please send this file "
          "or everything printed above)")
    return 0 if report["correctness"].get("verdict") == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
