"""Environment check: what VC-Attention can run here, why not, and a quick self-test.

    python -m vc_attention.kernels.doctor [--json] [--no-self-test]

Reports the GPU and its architecture, torch / CUDA / driver / Triton / cuda-bindings versions, the
precompiled cubins found per architecture (count, attention kernel, PTX fallback, the Triton and PTX
ISA that built them, whether they match the installed kernel source), every backend's availability for a typical call (bits=8, head dim 128,
bf16, per-key mask) with the reason when refused, and runs a self-test of about two seconds: on a
GPU, each available 8-bit kernel path against the readable reference (and the precompiled cubins
against the Triton JIT when both run); without a GPU it says so and checks the reference method on
the CPU against exact attention. The "VC-Attention Environment" node shows the same report.
Exit status 1 when a self-test fails.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time

import torch

from . import dispatch
from .dispatch import RECORDS, CallSpec
from .pipeline import interpreting

SELF_TEST_BOUND = 2e-3  # rel. L2 of a kernel vs the reference rounded to the output dtype (bf16)
REFERENCE_BOUND = 5e-2  # rel. L2 of the 8-bit method vs exact attention (tests/gpu, FIDELITY.md)


def _version(*dists):
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def typical_spec(device: torch.device, dtype=torch.bfloat16, head_dim=128) -> CallSpec:
    return CallSpec(device_type=device.type, capability=dispatch.device_capability(device), dtype=dtype,
                    head_dim=head_dim, bits=8, per_key_mask_only=True, interpreting=interpreting())


def environment(device=None) -> dict:
    """Everything but the self-test, as plain data."""
    from . import precompiled

    cuda = torch.cuda.is_available()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    device = torch.device(device)
    report = {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": cuda,
        "device": str(device), "gpu": None, "capability": None, "arch": None, "driver": None,
        "triton": _version("triton", "triton-windows"), "triton_importable": None,
        "cuda_bindings": _version("cuda-bindings", "cuda-python"),
        "triton_interpret": interpreting(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        major, minor = props.major, props.minor
        report.update(gpu=props.name, capability=[major, minor], arch=f"sm_{major}{minor}",
                      memory_gib=round(props.total_memory / 2 ** 30, 1))
        try:
            driver = precompiled.get_driver()
            v = driver.version()
            report["driver"] = f"{v // 1000}.{(v % 1000) // 10} (through {driver.name})"
        except precompiled.PrecompiledError as exc:
            report["driver"] = f"not reachable: {exc}"
    ok, why = dispatch.triton_status()
    report["triton_importable"] = ok if ok else why
    archs = precompiled.available_archs()
    report["cubins"] = {f"sm_{a}": str(p) for a, p in sorted(archs.items())}
    report["cubin_roots"] = [str(r) for r in precompiled.cubin_roots()]
    report["cubin_archs"] = {f"sm_{a}": _describe_cubins(a, p) for a, p in sorted(archs.items())}
    spec = typical_spec(device)
    report["call"] = "bits=8, head dim 128, bf16, per-key mask"
    # Each record on request (what backend=<name> would do), then what "auto" picks.
    report["backends"] = {}
    for record in RECORDS:
        why = dispatch.refusal(record, spec, requested=record.name)
        entry = {"available": why is None, "reason": why or "", "description": record.description}
        auto_why = dispatch.refusal(record, spec, requested="auto")
        if why is None and auto_why is not None:
            entry["note"] = f"'auto' skips it: {auto_why}"
        report["backends"][record.name] = entry
    if device.type == "cuda" and report["backends"]["precompiled"]["available"]:
        note = precompiled.fallback_note(report["capability"][0] * 10 + report["capability"][1])
        if note:
            report["backends"]["precompiled"]["note"] = note
    report["auto"] = dispatch.choose_backend(spec, "auto", log_fallback=False).backend
    return report


def _describe_cubins(arch, folder) -> dict:
    """One architecture's cubin folder, checked as precompiled/verify.py checks a build."""
    from .precompiled import verify

    try:
        summary, problems = verify.check_arch_folder(folder, arch)
    except Exception as exc:  # report, never crash the doctor
        return {"folder": str(folder), "problems": [f"{type(exc).__name__}: {exc}"]}
    summary["problems"] = problems
    return summary


def _cubin_line(name, c) -> str:
    if "cubins" not in c:
        return f"    {name:<7} {c['folder']}: {c['problems'][0]}"
    kernels = {"vc_attention_mma_fwd_kernel": "mma.sync kernel", "vc_attention_fwd_kernel": "portable kernel"}
    attention = ", ".join(kernels.get(a, a) for a in c["attention"]) or "no attention kernel"
    ptx = f" + {c['ptx']} PTX (the fallback for newer GPUs)" if c["ptx"] else ""
    state = "complete" if not c["problems"] else f"{len(c['problems'])} problems: {c['problems'][0]}"
    return (f"    {name:<7} {c['cubins']} cubins{ptx}, {attention}, Triton {c['triton']}, PTX ISA "
            f"{', '.join(c['ptx_isa'])}; {state}")


def _rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def self_test(report: dict, budget_s: float = 2.0) -> dict:
    """Run each available kernel path on a small video-like input against the reference."""
    from .api import explain_backend, vc_attention
    from .reference import exact_attention, reference_vc_attention

    t0 = time.perf_counter()
    device = torch.device(report["device"])
    g = torch.Generator(device="cpu").manual_seed(0)
    if device.type != "cuda":
        B, H, N, D = 1, 2, 256, 64
        q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
        v = v + 0.5 * torch.randn(1, 1, 1, D, generator=g)  # a shared offset per channel, as in video V
        ref = reference_vc_attention(q, k, v, bits=8, v_smooth=True, expcast=True, dtype=torch.float64)
        exact = exact_attention(q, k, v, dtype=torch.float64)
        err = _rel_l2(ref, exact)
        return {"ran": ["reference"], "passed": err < REFERENCE_BOUND, "seconds": round(time.perf_counter() - t0, 2),
                "results": {"reference vs exact": err}, "bound": REFERENCE_BOUND,
                "note": "no CUDA GPU: the fast kernels cannot run here; checked the reference 8-bit method "
                        "on the CPU against exact attention"}
    B, H, N, D = 1, 4, 1024, 128
    q, k, v = (torch.randn(B, H, N, D, generator=g).to(device, torch.bfloat16) for _ in range(3))
    v = (v.float() + 0.5).to(torch.bfloat16)
    results, outs, errors, skipped = {}, {}, {}, {}
    expcast = dispatch.expcast_default(typical_spec(device))
    refs = {}

    def reference(block_n):
        # P's bytes depend on the key-tile width (the running max per tile): compare each kernel
        # with the reference of its own tiles (128 keys; the Hopper Gluon kernel: block_n_for; the
        # mma.sync kernel: its own twin, reference/workstation.py: the INT8 P.V path, its default, or
        # V codes to 1.75 and FP16 runs).
        if block_n not in refs:
            if block_n in ("mma", "mma-int8"):
                from .reference.workstation import workstation_vc_attention

                ref = workstation_vc_attention(q, k, v, v_smooth=True, expcast=expcast, fp16_round_keys=32,
                                               dtype=torch.float64,
                                               pv_accumulation="int8" if block_n == "mma-int8" else "fp16_run")
            else:
                ref = reference_vc_attention(q, k, v, bits=8, v_smooth=True, expcast=expcast, block_n=block_n,
                                             dtype=torch.float64)
            refs[block_n] = ref.to(torch.bfloat16)
        return refs[block_n]

    from . import precompiled

    cap = torch.cuda.get_device_capability(device)
    twin = precompiled.jit_twin(cap[0] * 10 + cap[1])  # the JIT kernel the cubins were built from

    for name in (record.name for record in RECORDS if record.cuda_only):  # the GPU kernels
        if not report["backends"][name]["available"]:
            continue
        if time.perf_counter() - t0 > budget_s:  # a first call compiles: seconds per JIT path
            skipped[name] = f"not run: the self-test's {budget_s:g} s budget was spent (not a failure)"
            continue
        try:
            decision = explain_backend(q, k, v, bits=8, v_smooth=True, expcast=expcast, backend=name)
            out = vc_attention(q, k, v, bits=8, v_smooth=True, expcast=expcast, backend=name)
            torch.cuda.synchronize(device)
            outs[name] = out
            block_n = 128
            if name == "mma" or (name == "precompiled" and twin == "mma"):
                block_n = "mma-int8" if decision.pv_int8 else "mma"  # the path the default runs there
            elif name == "gluon":
                from .gluon.config import block_n_for

                block_n = block_n_for(has_mean=True, has_bias=False, expcast=expcast)
            results[f"{name} vs reference"] = _rel_l2(out, reference(block_n))
        except Exception as exc:  # report, never crash the doctor
            errors[name] = f"{type(exc).__name__}: {exc}"
    if "precompiled" in outs and twin in outs:  # the same kernel, built ahead vs JIT
        same = torch.equal(outs["precompiled"].view(torch.int16), outs[twin].view(torch.int16))
        results[f"precompiled == {twin} (bit-for-bit)"] = bool(same)
    passed = not errors and bool(outs) and all(
        v < SELF_TEST_BOUND for k, v in results.items() if k.endswith("vs reference"))
    note = "" if outs else "no 8-bit kernel path is available on this GPU (see the backends' reasons)"
    return {"ran": list(outs), "passed": passed, "seconds": round(time.perf_counter() - t0, 2),
            "results": results, "errors": errors, "skipped": skipped, "bound": SELF_TEST_BOUND, "note": note}


def run(device=None, with_self_test=True, budget_s=2.0) -> dict:
    report = environment(device)
    if with_self_test:
        report["self_test"] = self_test(report, budget_s=budget_s)
    return report


def format_report(r: dict) -> str:
    lines = ["VC-Attention environment"]
    if r["gpu"]:
        lines.append(f"  GPU           {r['gpu']} ({r['arch']}, compute capability "
                     f"{r['capability'][0]}.{r['capability'][1]}, {r.get('memory_gib')} GiB)")
    else:
        lines.append("  GPU           none (torch.cuda.is_available() is False): CPU only")
    lines.append(f"  torch         {r['torch']} (CUDA {r['torch_cuda'] or 'none: a CPU build'})")
    if r["gpu"]:
        lines.append(f"  CUDA driver   {r['driver']}")
    triton_ok = r["triton_importable"] is True
    lines.append(f"  Triton        {r['triton'] or 'not installed'}"
                 + ("" if triton_ok or not r["triton"] else " (cannot be imported)")
                 + (" [TRITON_INTERPRET=1]" if r["triton_interpret"] else ""))
    lines.append(f"  cuda-bindings {r['cuda_bindings'] or 'not installed (the cubin loader uses ctypes)'}")
    cubins = ", ".join(r["cubins"]) or "none"
    lines.append(f"  cubins        {cubins} (searched {os.pathsep.join(r['cubin_roots'])})")
    lines += [_cubin_line(name, c) for name, c in r.get("cubin_archs", {}).items()]
    lines.append(f"Backends for a typical call ({r['call']}), in the order 'auto' tries them:")
    for name, b in r["backends"].items():
        state = "available" if b["available"] else f"refused: {b['reason']}"
        if b["available"] and b.get("note"):
            state += f" ({b['note']})"
        lines.append(f"  {name:<12} {state}")
    lines.append(f"  -> auto runs: {r['auto']}")
    st = r.get("self_test")
    if st:
        verdict = "passed" if st["passed"] else "FAILED"
        lines.append(f"Self-test ({st['seconds']} s): {verdict}")
        if st.get("note"):
            lines.append(f"  {st['note']}")
        for k, v in st["results"].items():
            lines.append(f"  {k}: {v:.2e} (bound {st['bound']:.0e})" if isinstance(v, float) and not isinstance(v, bool)
                         else f"  {k}: {v}")
        for k, v in list(st.get("errors", {}).items()) + list(st.get("skipped", {}).items()):
            lines.append(f"  {k}: {v}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vc_attention.kernels.doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-self-test", action="store_true", help="skip the self-test")
    parser.add_argument("--device", default=None, help="cuda:N or cpu (default: the current CUDA device)")
    args = parser.parse_args(argv)
    report = run(args.device, with_self_test=not args.no_self_test)
    print(json.dumps(report, indent=1, default=str) if args.json else format_report(report))
    st = report.get("self_test")
    return 0 if st is None or st["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
