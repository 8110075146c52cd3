"""The mma.sync kernel for RTX 4090 / 5090 / PRO 6000 (kernels/triton/attention_mma.py), run on an
H200 as a proxy: built for sm_89 (warp-level mma.sync: IMMA s8 -> s32, QMMA e4m3 with an FP16
accumulator), its PTX loaded through the CUDA driver and JIT-compiled for sm_90 by the driver.
One command, on a CUDA GPU with Triton (3.6 - 3.9) and cuda-bindings (or libcuda via ctypes):

    python benchmarks/workstation_proxy.py [--quick] [--out results.json]
    (SageAttention 1.0.6 is timed when it can be imported)

1. Correctness: the sm_89 PTX kernel against the readable reference (kernels/reference/
   workstation.py, FP16 rounding per mma.sync k-step of 32 keys) at odd shapes (N = 77 .. 4,173, head
   dims 64 / 128, V-Smooth on / off, a key bias), and at the four real shapes on one head and the
   first 256 queries (the quantisers are per head and per 128 tokens, so the slice is exact).
2. Speed (B=1, D=128, bf16, non-causal; median of triton.testing.do_bench): torch SDPA's flash
   backend (BF16, FA2: also mma.sync), SageAttention 1.0.6, the mma.sync kernel (whole call, and the
   kernel alone on prepared operands; its FP32-accumulation version too) at Wan2.2-14B 720p,
   HunyuanVideo-1.5 720p, Wan2.2-5B 720p, Wan 480p.
3. Ceilings of this path on this card: mma.sync loops on register operands (no memory traffic), the
   same PTX route: INT8 -> INT32, FP8 -> FP32, FP8 -> FP16, BF16 -> FP32.
The table comes last; --out writes everything as JSON.
"""

import argparse
import datetime
import json
import pathlib
import platform
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from attention_speed import register_package  # noqa: E402

register_package()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from vc_attention.kernels.precompiled.ptx import PTXModule, SM89Launcher  # noqa: E402,F401
from vc_attention.kernels.reference import exact_attention  # noqa: E402
from vc_attention.kernels.reference.workstation import workstation_vc_attention  # noqa: E402
from vc_attention.kernels.triton import attention_mma as am  # noqa: E402

SHAPES = {"wan14b-720p": (40, 75_600), "hunyuan-720p": (16, 111_700), "wan5b-720p": (24, 27_280),
          "wan-480p": (40, 32_760)}
ODD = [(2, 77, 64, True, False), (2, 200, 128, False, False), (2, 1000, 128, True, True),
       (3, 4173, 128, True, False), (2, 999, 64, False, True)]


def options_launcher(launcher):
    """SM89Launcher for the kernel's constexprs that have a default (EXP2_FMA): they are not runtime
    parameters of the PTX, and a launch that sets one compiles with it (kernels/precompiled/ptx.py
    now passes EXP2_FMA / EXPCAST_TAIL to the compile itself; the two agree where both set one)."""
    defaults = am.kernel_defaults(am.vc_attention_mma_fwd_kernel)
    launcher.names = [n for n in launcher.names if n not in defaults]
    compile_defaults = am.compile_mma_attention
    current = {}

    def compile_with_options(arch, **kw):
        return compile_defaults(arch, **{**kw, **current})  # the launch's option wins where both set it

    def launch(kernel, grid, args, constexprs, num_warps, num_stages=None):
        current.clear()
        if "EXP2_FMA" in constexprs:
            current["exp2_fma"] = constexprs["EXP2_FMA"]
        am.compile_mma_attention = compile_with_options
        try:
            return launcher(kernel, grid, args, constexprs, num_warps, num_stages)
        finally:
            am.compile_mma_attention = compile_defaults

    launch.cache = launcher.cache
    return launch


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())




def make_qkv(B, H, N, D, seed=0, dtype=torch.bfloat16):
    """Video-like inputs (as benchmarks/rtx5090_check.py): K with a per-channel offset, V in 16
    clusters plus noise with a few x8 outlier tokens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, N, D, device="cuda", generator=g)
    k = torch.randn(B, H, N, D, device="cuda", generator=g) + 0.5 * torch.randn(B, H, 1, D, device="cuda", generator=g)
    centers = 2.0 * torch.randn(B, H, 16, D, device="cuda", generator=g)
    assign = torch.randint(0, 16, (B, H, N), device="cuda", generator=g)
    v = torch.gather(centers, 2, assign[..., None].expand(-1, -1, -1, D)) + 0.3 * torch.randn(B, H, N, D, device="cuda", generator=g)
    v[:, :, :: max(7, N // 40)] *= 8.0
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check_odd(launch, results):
    for H, N, D, v_smooth, bias in ODD:
        q, k, v = make_qkv(1, H, N, D, seed=N + D)
        kb = None
        if bias:
            kb = torch.zeros(1, 1, 1, N, device="cuda")
            kb[..., N * 3 // 4:] = float("-inf")
            kb[..., :20] = 0.7
        perm = torch.stack([torch.randperm(N, device="cuda") for _ in range(H)])[None]
        for pv in ("fp16_run", "fp32", "int8"):
            out = torch.full((1, H, N, D), float("nan"), device="cuda", dtype=torch.float32)
            opts = dict(pv_int8=True) if pv == "int8" else dict(pv_acc16=pv == "fp16_run")
            am.mma_vc_attention(q, k, v, out, v_smooth=v_smooth, perm=perm, key_bias=kb, launch=launch, **opts)
            torch.cuda.synchronize()
            ref = workstation_vc_attention(q, k, v, v_smooth=v_smooth, perm=perm, key_bias=kb, pv_accumulation=pv,
                                           fp16_round_keys=32 if pv == "fp16_run" else None)
            exact = exact_attention(q, k, v, key_bias=kb).float()
            row = dict(H=H, N=N, D=D, v_smooth=v_smooth, bias=bias, pv=pv,
                       vs_reference=rel_l2(out, ref), vs_exact=rel_l2(out, exact), reference_vs_exact=rel_l2(ref, exact),
                       nan=bool(torch.isnan(out).any()))
            results["odd"].append(row)
            print("odd", json.dumps(row), flush=True)


def check_real(launch, results, shapes):
    for name, (H, N) in shapes.items():
        q, k, v = make_qkv(1, 1, N, 128, seed=N)
        out = torch.empty_like(q)
        exact = exact_attention(q[:, :, :256], k, v).float()
        for pv in ("fp16_run", "int8"):
            opts = dict(pv_int8=True) if pv == "int8" else {}
            am.mma_vc_attention(q, k, v, out, launch=launch, **opts)
            ref = workstation_vc_attention(q[:, :, :256], k, v, pv_accumulation=pv,
                                           fp16_round_keys=32 if pv == "fp16_run" else None)
            o = out[:, :, :256].float()
            row = dict(shape=name, N=N, pv=pv, vs_reference=rel_l2(o, ref.to(out.dtype).float()),
                       vs_exact=rel_l2(o, exact),
                       reference_vs_exact=rel_l2(ref, exact), bf16_floor=rel_l2(exact.to(out.dtype).float(), exact))
            results["real"].append(row)
            print("real", json.dumps(row), flush=True)


@triton.jit
def mma_loop_kernel(A, B, C, ITERS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr):
    """Tensor-pipe ceiling: one tile of A and B in registers, ITERS dots into one accumulator
    (ACC: 0 int32, 1 fp32, 2 fp16)."""
    pid = tl.program_id(0)
    a = tl.load(A + tl.arange(0, BM)[:, None] * BK + tl.arange(0, BK)[None, :])
    b = tl.load(B + tl.arange(0, BN)[None, :] * BK + tl.arange(0, BK)[:, None])  # K-major
    if ACC == 2:
        acc = tl.zeros([BM, BN], tl.float16)
    elif ACC == 0:
        acc = tl.zeros([BM, BN], tl.int32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    for _ in range(ITERS):
        if ACC == 2:
            acc = tl.dot(a, b, acc, out_dtype=tl.float16)
        elif ACC == 0:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, b, acc)
    tl.store(C + pid * BM * BN + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], acc.to(tl.float32))


def ceilings(results, quick):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    BM, BN, BK, iters = 128, 128, 64, 256 if quick else 1024
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms * 8
    kinds = {"int8->int32": (torch.int8, "i8", 0), "fp8->fp32": (torch.float8_e4m3fn, "fp8e4nv", 1),
             "fp8->fp16": (torch.float8_e4m3fn, "fp8e4nv", 2), "bf16->fp32": (torch.bfloat16, "bf16", 1)}
    c = torch.empty(programs * BM * BN, device="cuda", dtype=torch.float32)
    for name, (dt, ty, acc) in kinds.items():
        a = (torch.randn(BM, BK, device="cuda") * 0.1)
        b = (torch.randn(BN, BK, device="cuda") * 0.1)
        a, b = (a.to(dt), b.to(dt)) if dt != torch.int8 else ((a * 10).to(dt), (b * 10).to(dt))
        sig = {"A": f"*{ty}", "B": f"*{ty}", "C": "*fp32", "ITERS": "i32", "BM": "constexpr", "BN": "constexpr",
               "BK": "constexpr", "ACC": "constexpr"}
        try:
            ck = triton.compile(ASTSource(mma_loop_kernel, sig, {(4,): BM, (5,): BN, (6,): BK, (7,): acc},
                                          {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]],
                                           (2,): [["tt.divisibility", 16]]}),
                                target=GPUTarget("cuda", 89, 32), options={"num_warps": 8, "num_stages": 1})
            mod = PTXModule(ck, ["A", "B", "C", "ITERS"])
            run = lambda: mod((programs, 1), {"A": a, "B": b, "C": c, "ITERS": iters})  # noqa: E731
            ms = triton.testing.do_bench(run, warmup=50, rep=300)
            tflops = 2 * BM * BN * BK * iters * programs / (ms * 1e-3) / 1e12
            row = dict(kind=name, ms=ms, tflops=tflops, mma=mod.mma_kinds)
        except Exception as exc:  # a Triton that cannot build this kind for sm_89: say so
            row = dict(kind=name, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        results["ceilings"].append(row)
        print("ceiling", json.dumps(row), flush=True)


# The kernel's launch variants (label, mma_attention_fwd options); benchmarks/workstation_model.py
# reads the same labels (with _tflops) from the JSON.
VARIANTS = (("mma_kernel_ms", {}), ("mma_fp32pv_kernel_ms", {"pv_acc16": False}),
            ("mma_exp2fma_off_kernel_ms", {"exp2_fma": False}),
            ("mma_rowsum_cuda_kernel_ms", {"rowsum_cuda": True}),
            ("mma_run64_kernel_ms", {"run_tiles": 1}),
            ("mma_bn128_kernel_ms", {"block_n": 128, "run_tiles": 1, "num_stages": 2}),
            ("mma_bn32_kernel_ms", {"block_n": 32, "run_tiles": 4}),
            ("mma_stages2_kernel_ms", {"num_stages": 2}),
            ("mma_warps4_kernel_ms", {"num_warps": 4}),
            ("mma_expcast_kernel_ms", {"expcast": True}),
            # the INT8 P.V path, V's scales per (block, channel) (its own V operands:
            # prepare_mma(pv_int8=True)) and Q per 128 tokens, with P per 64-key tile, and per
            # 128-key tile (the default's tiles); results files of 2026-12-02 hold "mma_int8pv_*" rows
            # of its first build, with one V scale per channel
            ("mma_int8pv_vb_kernel_ms", {"pv_int8": True, "block_n": 64, "run_tiles": 2}),
            ("mma_int8pv_vb_stages2_kernel_ms", {"pv_int8": True, "block_n": 64, "run_tiles": 2, "num_stages": 2}),
            ("mma_int8pv_vb_bn128_kernel_ms", {"pv_int8": True, "block_n": 128, "run_tiles": 1}),
            # the INT8 path's default: 128-key tiles and one Q scale per token (its own Q operands)
            ("mma_int8pv_default_kernel_ms", {"pv_int8": True, "q_token": True}))
# --variants model: the default against what the model ranked next to it (its exp2_fma=False build
# is the kernel the 2026-12-01 files timed as the default), ExpCast and 2 stages.
MODEL_VARIANTS = ("mma_kernel_ms", "mma_fp32pv_kernel_ms", "mma_exp2fma_off_kernel_ms", "mma_stages2_kernel_ms",
                  "mma_expcast_kernel_ms")
# --variants int8: the FP8 default and the INT8 P.V path's tilings
INT8_VARIANTS = ("mma_kernel_ms", "mma_int8pv_vb_kernel_ms", "mma_int8pv_vb_stages2_kernel_ms",
                 "mma_int8pv_vb_bn128_kernel_ms", "mma_int8pv_default_kernel_ms")


def timings(launch, results, shapes, quick, variants):
    try:
        from sageattention import sageattn
    except Exception as exc:
        sageattn = None
        results["notes"].append(f"SageAttention not importable: {exc}")
    bench = lambda f: triton.testing.do_bench(f, warmup=25 if quick else 100, rep=200 if quick else 1000)  # noqa: E731
    for name, (H, N) in shapes.items():
        q, k, v = make_qkv(1, H, N, 128, seed=1)
        flops = 4 * H * N * N * 128
        row = dict(shape=name, H=H, N=N)

        def sdpa():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)

        row["sdpa_flash_ms"] = bench(sdpa)
        if sageattn is not None:
            row["sage106_ms"] = bench(lambda: sageattn(q, k, v, tensor_layout="HND"))
        out = torch.empty_like(q)
        operands, bias = am.prepare_mma(launch, q, k, v)
        operands_int8 = operands_tok = None
        for label, opts in VARIANTS:
            if (quick or variants == "main") and label not in ("mma_kernel_ms", "mma_fp32pv_kernel_ms"):
                continue
            if variants == "model" and label not in MODEL_VARIANTS:
                continue
            if variants == "int8" and label not in INT8_VARIANTS:
                continue
            opts = dict(opts)
            ops = operands
            if opts.pop("pv_int8", False):
                if opts.pop("q_token", False):  # Q per token
                    if operands_tok is None:
                        operands_tok = am.prepare_mma(launch, q, k, v, pv_int8=True)[0]
                    ops = operands_tok
                else:  # Q per 128 tokens (the mma_int8pv_vb_* rows)
                    if operands_int8 is None:
                        operands_int8 = am.prepare_mma(launch, q, k, v, pv_int8=True, q_token=False)[0]
                    ops = operands_int8
            try:
                row[label] = bench(lambda: am.mma_attention_fwd(launch, *ops, out, H, key_bias_log2=bias, **opts))
            except Exception as exc:
                results["notes"].append(f"{name} {label}: {type(exc).__name__}: {str(exc)[:200]}")
        row["mma_call_ms"] = bench(lambda: am.mma_vc_attention(q, k, v, out, launch=launch))
        row["sm90_jit_same_kernel_ms"] = bench(lambda: am.mma_attention_fwd(am.mma_launch, *operands, out, H, key_bias_log2=bias))
        if variants in ("all", "int8"):
            # the INT8 P.V path compiled by Triton for this GPU itself (wgmma on Hopper), and the
            # public call on this GPU (the Hopper kernel on an H200), for what a non-RTX card could run
            if operands_tok is None:
                operands_tok = am.prepare_mma(launch, q, k, v, pv_int8=True)[0]
            ops8 = operands_tok
            row["sm90_jit_int8pv_kernel_ms"] = bench(lambda: am.mma_attention_fwd(am.mma_launch, *ops8, out, H,
                                                                                 key_bias_log2=bias))
            try:
                from vc_attention.kernels import vc_attention

                row["public_call_ms"] = bench(lambda: vc_attention(q, k, v))
            except Exception as exc:
                results["notes"].append(f"{name} public call: {type(exc).__name__}: {str(exc)[:200]}")
        for key in list(row):
            if key.endswith("_ms"):
                row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12
        results["speed"].append(row)
        print("speed", json.dumps(row), flush=True)
        del q, k, v, out, operands, operands_int8, operands_tok
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", default="", help="comma list of: odd,real,speed,ceilings")
    ap.add_argument("--shapes", default="", help="comma list of SHAPES names (default: all four)")
    ap.add_argument("--variants", default="all", choices=["all", "main", "model", "int8"],
                    help="main: the default kernel and its FP32 version only; model: MODEL_VARIANTS; "
                         "int8: INT8_VARIANTS")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    props = torch.cuda.get_device_properties(0)
    results = dict(card=props.name, capability=f"{props.major}.{props.minor}", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   command="python benchmarks/workstation_proxy.py " + " ".join(sys.argv[1:]),
                   torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                   odd=[], real=[], speed=[], ceilings=[], notes=[])
    launch = options_launcher(SM89Launcher())
    print(json.dumps({k: results[k] for k in ("card", "capability", "date", "torch", "triton")}), flush=True)
    shapes = dict(list(SHAPES.items())[:2]) if args.quick else SHAPES
    if args.shapes:
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    if "ceilings" not in skip:
        ceilings(results, args.quick)
    if "odd" not in skip:
        check_odd(launch, results)
    mod = next(iter(launch.cache.values()), None)
    if mod is not None:
        results["ptx"] = dict(target=mod.ptx_target, mma=mod.mma_kinds, shared=mod.shared)
        print("ptx", json.dumps(results["ptx"]), flush=True)
    if "real" not in skip:
        check_real(launch, results, shapes)
    if "speed" not in skip:
        timings(launch, results, shapes, args.quick, args.variants)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    print("\n| check | worst vs reference | worst vs exact (reference vs exact) |\n|---|---|---|")
    for part in ("odd", "real"):
        rows = results[part]
        if rows:
            print(f"| {part} ({len(rows)}) | {max(r['vs_reference'] for r in rows):.2e} | "
                  f"{max(r['vs_exact'] for r in rows):.2e} ({max(r['reference_vs_exact'] for r in rows):.2e}) |")
    print("\n| ceiling (mma.sync, sm_89 PTX on this card) | TFLOP/s |\n|---|---|")
    for r in results["ceilings"]:
        print(f"| {r['kind']} | {r.get('tflops', float('nan')):.0f} |" if "tflops" in r else f"| {r['kind']} | {r['error'][:80]} |")
    print("\n| shape | SDPA flash ms | Sage 1.0.6 ms | mma kernel ms | x flash | mma FP32-PV ms | mma call ms | x flash |\n|---|---|---|---|---|---|---|---|")
    for r in results["speed"]:
        f = r["sdpa_flash_ms"]
        print(f"| {r['shape']} | {f:.2f} | {r.get('sage106_ms', float('nan')):.2f} | {r.get('mma_kernel_ms', float('nan')):.2f} | "
              f"{f / r.get('mma_kernel_ms', float('nan')):.2f} | {r.get('mma_fp32pv_kernel_ms', float('nan')):.2f} | "
              f"{r['mma_call_ms']:.2f} | {f / r['mma_call_ms']:.2f} |")
    if any("mma_int8pv_vb_kernel_ms" in r for r in results["speed"]):
        print("\n| shape | SDPA flash ms | mma kernel ms | INT8 P.V ms | / default | INT8 P.V 2 stages ms | INT8 P.V 128-key tiles ms | INT8 default (+ Q per token) ms |\n|---|---|---|---|---|---|---|---|")
        for r in results["speed"]:
            f = r["sdpa_flash_ms"]
            g = lambda key: r.get(key, float("nan"))  # noqa: E731
            print(f"| {r['shape']} | {f:.2f} | {g('mma_kernel_ms'):.2f} | {g('mma_int8pv_vb_kernel_ms'):.2f} | "
                  f"{g('mma_kernel_ms') / g('mma_int8pv_vb_kernel_ms'):.2f} | {g('mma_int8pv_vb_stages2_kernel_ms'):.2f} | "
                  f"{g('mma_int8pv_vb_bn128_kernel_ms'):.2f} | {g('mma_int8pv_default_kernel_ms'):.2f} |")
        print("\n| shape | INT8 P.V, Triton's own build for this GPU ms | x flash | public call on this GPU ms |\n|---|---|---|---|")
        for r in results["speed"]:
            g = lambda key: r.get(key, float("nan"))  # noqa: E731
            print(f"| {r['shape']} | {g('sm90_jit_int8pv_kernel_ms'):.2f} | "
                  f"{r['sdpa_flash_ms'] / g('sm90_jit_int8pv_kernel_ms'):.2f} | {g('public_call_ms'):.2f} |")
    for n in results["notes"]:
        print("note:", n)


if __name__ == "__main__":
    main()
