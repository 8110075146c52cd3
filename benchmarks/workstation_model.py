"""A per-tile throughput model of the mma.sync 8-bit kernel (kernels/triton/attention_mma.py) for the
cards we do not have: RTX 5090, RTX PRO 6000 Blackwell (sm_120), RTX 4090 (sm_89). Every card
figure it prints is PREDICTED; the H200 row is the measured proxy it is calibrated on.

    python benchmarks/workstation_model.py [--proxy benchmarks/results/workstation_proxy_h200_*.json]
        [--variants default,exp2_fma,...|all] [--out table.md]

Inputs:
- the SASS of the main loop, per warp, for one run (2 tiles of 16 query rows x 64 keys: 2,048
  scores): tensor instructions by kind and all instructions (issue slots); compiled here for sm_89
  and sm_120 when Triton is importable (else the counts recorded below, Triton 3.9);
- each card's published dense tensor rates (NVIDIA's Ada and Blackwell architecture papers): per SM and clock,
  8-bit with an FP16 accumulator (INT8 -> INT32 runs at the same rate), and the halving of the
  FP32 accumulator on GeForce (not on the RTX PRO 6000);
- 4 schedulers per SM issuing one warp instruction per clock; 16 MUFU ex2 per SM and clock.

Per score: tensor time T (Q.K INT8, P.V FP8 with FP16 accumulation, the row sum's 64 x 16 ones
dot with FP32), issue time I (all SASS instructions of the loop), shared-memory time S (the LDSM
bytes of the loop at 128 bytes per SM and clock), exp time U. Two bounds and a fit: perfect
overlap max(T, I, S, U); none T + I + S; and the H200 proxy's measured time t = slowest + phi x
(the other two of T, I, S), with phi fitted there (the same SASS, the same mma.sync path: 8 warps of 255 registers, two per
scheduler, whose softmax sits between their two matmuls). Only phi comes from the proxy; the
rates come from the data sheets. What the model leaves out: per-pipe limits inside the issue
slots (the CUDA-core row-sum variant measured 275 TFLOP/s on the H200 where this model, fitted on
the default kernel, says about 357: its byte conversions cost more than one slot each), memory (the K / V tiles are reused by 128 queries: far
from the DRAM bound at these sizes) and clocks under load (boost clocks assumed).

Per launch variant (VARIANTS: the kernel's launch options, each compiled for sm_89 and sm_120) it
also prints the other pipes per score, none of which is the slowest for any variant built: X, the
XU pipe (MUFU plus the conversions F2F / F2I / I2F / F2FP, 16 per SM and clock: the CUDA guide's
"all other type conversions" rate on cc 8.9 / 12.0), A the ALU pipe (integer, compare, select,
min / max, PRMT / LOP3: 64 lanes), F the FMA pipe (FFMA / FMUL / FADD and the FP16 pairs HADD2 /
HMUL2 / HFMA2: 128 lanes); registers, local memory in the loop (spills) and shared memory per block.
The validation table checks the fit against the other variants the proxy timed (their sm_89 SASS,
the H200's measured rates, the same phi).
"""

import argparse
import glob
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = {"IMMA.16832.S8.S8.SAT": 16 * 8 * 32 * 2, "QMMA.16832.F16.E4M3.E4M3": 16 * 8 * 32 * 2,
       "QMMA.16832.F32.E4M3.E4M3": 16 * 8 * 32 * 2}
SCORES_PER_LOOP = 16 * 128  # one warp, one run of 128 keys
# Main-loop counts per warp (Triton 3.9, D=128, 128 x 64 tiles, runs of 2): tests/kernels/test_mma_kernel.py
RECORDED = {
    89: {"loop_instructions": 1074, "MUFU": 68, "ldsm_bytes": 68 * 512,
         "tensor": {"IMMA.16832.S8.S8.SAT": 64, "QMMA.16832.F16.E4M3.E4M3": 64, "QMMA.16832.F32.E4M3.E4M3": 8}},
}
# name: (arch, SMs, boost GHz, 8-bit dense ops per SM-clock with FP16 acc, FP32-acc factor, BF16 FA2-class TFLOP/s)
CARDS = {
    "RTX 5090": (120, 170, 2.407, 838e12 / (170 * 2.407e9), 0.5, "173-215 (FA2, SageAttention README)"),
    "RTX PRO 6000 Blackwell": (120, 188, 2.617, 838e12 / (170 * 2.407e9), 1.0, "not published"),
    "RTX 4090": (89, 128, 2.52, 660e12 / (128 * 2.52e9), 0.5, "about 165 peak at FP32 accumulate"),
}
PEERS_5090 = {"SageAttention2 (INT8 QK, FP8 PV)": "489-554", "SageAttention2++ (FP8 PV, FP16 acc)": "583-643",
              "SageAttention3 (FP4)": "964-1038"}


# Launch variants of today's kernel: name -> (options of attention_mma.compile_mma_attention /
# mma_attention_fwd, the key benchmarks/workstation_proxy.py writes for its time).
VARIANTS = {
    "default": ({}, "mma_kernel_tflops"),
    "exp2_fma_off": ({"exp2_fma": False}, "mma_exp2fma_off_kernel_tflops"),
    "expcast": ({"expcast": True}, "mma_expcast_kernel_tflops"),
    "rowsum_cuda": ({"rowsum_cuda": True}, "mma_rowsum_cuda_kernel_tflops"),
    "fp32pv": ({"pv_acc16": False}, "mma_fp32pv_kernel_tflops"),
    "run64": ({"run_tiles": 1}, "mma_run64_kernel_tflops"),
    "bn128_stages2": ({"block_n": 128, "run_tiles": 1, "num_stages": 2}, "mma_bn128_kernel_tflops"),
    "bn32_run4": ({"block_n": 32, "run_tiles": 4}, "mma_bn32_kernel_tflops"),
    "stages2": ({"num_stages": 2}, "mma_stages2_kernel_tflops"),
    "warps4": ({"num_warps": 4}, "mma_warps4_kernel_tflops"),
    # the INT8 P.V path (FIDELITY.md): every matmul IMMA s8 -> s32, V's scales per (block, channel)
    # (Q per 128 tokens, as the proxy timed them), and its default: 128-key tiles, one Q scale per token
    "int8pv": ({"pv_int8": True, "block_n": 64, "run_tiles": 2, "q_token": False}, "mma_int8pv_vb_kernel_tflops"),
    "int8pv_stages2": ({"pv_int8": True, "block_n": 64, "run_tiles": 2, "num_stages": 2, "q_token": False},
                       "mma_int8pv_vb_stages2_kernel_tflops"),
    "int8pv_bn128": ({"pv_int8": True, "block_n": 128, "run_tiles": 1, "q_token": False},
                     "mma_int8pv_vb_bn128_kernel_tflops"),
    "int8pv_default": ({"pv_int8": True}, "mma_int8pv_default_kernel_tflops"),
}
# The proxy files of 2026-12-01 timed the kernel before EXP2_FMA existed (its code path is today's
# exp2_fma=False, the same SASS: benchmarks/triton_sass_identity.py): phi is fitted on that build,
# and the validation compares those files' variants with these options.
PROXY_BEFORE_EXP2_FMA = "2026-12-02"  # files dated before this hold the kernel without EXP2_FMA
FITTED_BUILD = {"exp2_fma": False}
XU_OPS = ("MUFU", "F2F", "F2I", "I2F", "F2FP", "I2FP", "FRND")
ALU_OPS = ("FMNMX", "IMNMX", "SEL", "FSEL", "PRMT", "LOP3", "IADD3", "IADD", "ISETP", "FSETP", "SHF", "LEA",
           "PLOP3", "IMAD", "MOV", "SGXT")
FMA_OPS = ("FFMA", "FMUL", "FADD", "HADD2", "HMUL2", "HFMA2")


def _load_package():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vc_attention", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("vc_attention", mod)
    spec.loader.exec_module(mod)


def _cuobjdump(ck):
    """(SASS, resource usage) of a compiled kernel's cubin, by the cuobjdump in Triton's wheel."""
    import triton

    bindir = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        return tuple(subprocess.run([str(bindir / "cuobjdump"), flag, f.name], capture_output=True, text=True,
                                    check=True).stdout for flag in ("-sass", "-res-usage"))


def sass_counts(arch, options=None):
    """The main loop's counts for one arch and launch variant: compiled now (Triton present) or the
    recorded ones (default variant only)."""
    options = options or {}
    try:
        _load_package()
        import triton
        from vc_attention.kernels.triton.attention_mma import compile_mma_attention, sass_profile

        ck = compile_mma_attention(arch, **options)
        sass, res = _cuobjdump(ck)
        p = sass_profile(sass)
        import re

        regs = int(re.search(r"REG:(\d+)", res).group(1))
        stack = int(re.search(r"STACK:(\d+)", res).group(1))
        return {"loop_instructions": p["loop_instructions"], "MUFU": p["loop"].get("MUFU", 0),
                "ldsm_bytes": p["loop_ldsm_bytes"], "tensor": p["loop_tensor"], "loop": dict(p["loop"]),
                "registers": regs, "stack": stack, "shared": ck.metadata.shared,
                "source": f"compiled now, Triton {triton.__version__}"}
    except Exception as exc:  # no Triton / no compiler here: the recorded counts
        if options:
            return {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
        got = dict(RECORDED[89])
        got["source"] = f"recorded (sm_89, Triton 3.9); compiling failed: {type(exc).__name__}"
        return got


def loop_scores(counts, head_dim=128):
    """Scores per warp covered by the loop, from its tensor instructions: an IMMA m16n8k32 is 16 x 8
    scores over 32 of the head dim, a P.V QMMA 16 rows x 32 keys over 8 channels; the two agree when
    the loop is a whole number of runs, else None (the pipeliner moved work across iterations)."""
    t = counts["tensor"]
    if not any(kind.startswith("QMMA") for kind in t):  # the INT8 P.V path: Q.K, P.V and the row sum all IMMA
        n = t.get("IMMA.16832.S8.S8.SAT", 0)  # as many P.V as Q.K, the row sum at most 1/8 of them
        qk_imma = -(-(n * 8 // 17) // 8) * 8
        return qk_imma * 16 * 8 * 32 // head_dim or None
    qk = t.get("IMMA.16832.S8.S8.SAT", 0) * 16 * 8 * 32 // head_dim
    pv_kind = "QMMA.16832.F16.E4M3.E4M3" if "QMMA.16832.F16.E4M3.E4M3" in t else "QMMA.16832.F32.E4M3.E4M3"
    pv = t.get(pv_kind, 0)
    if pv_kind == "QMMA.16832.F32.E4M3.E4M3":  # the FP32 version: P.V and the row sum share the kind
        pv = pv - pv // 17  # 16 P.V for every row-sum QMMA (sm_89: 64 + 4 per tile per warp)
    pv = pv * 16 * 32 * 8 // head_dim
    return qk if qk and abs(pv - qk) <= qk // 16 else None


def per_score(counts, rates, clock_issue=4.0, mufu_per_clk=16.0, smem_bytes_per_clk=128.0, scores=None):
    """(T, I, S, U) in SM clocks per score. rates: tensor ops per SM and clock by SASS kind. S: the
    loop's LDSM bytes (every warp reads the whole K and V tiles: mma.sync has no shared operand)."""
    n = scores or SCORES_PER_LOOP
    t = sum(c * OPS[kind] / rates[kind] for kind, c in counts["tensor"].items())
    return (t / n, counts["loop_instructions"] / clock_issue / n, counts["ldsm_bytes"] / smem_bytes_per_clk / n,
            counts["MUFU"] * 32 / mufu_per_clk / n)


def other_pipes(counts, scores):
    """(X, A, F) clocks per score: XU (16 lanes per SM and clock), ALU (64), FMA (128)."""
    loop = counts.get("loop", {})
    c = lambda ops: sum(loop.get(o, 0) for o in ops)  # noqa: E731
    return c(XU_OPS) * 32 / 16 / scores, c(ALU_OPS) * 32 / 64 / scores, c(FMA_OPS) * 32 / 128 / scores


def fitted(T, I, S, U, phi):
    """The slowest pipe, plus phi times the other two of tensor / issue / shared memory."""
    parts = sorted((T, I, S))
    return max(parts[-1], U) + phi * (parts[0] + parts[1])


def card_rates(rate8, f32_factor):
    return {"IMMA.16832.S8.S8.SAT": rate8, "QMMA.16832.F16.E4M3.E4M3": rate8,
            "QMMA.16832.F32.E4M3.E4M3": rate8 * f32_factor}


def h200_rates(ceil, sms, ghz):
    per_clk = lambda tflops: tflops * 1e12 / (sms * ghz * 1e9)  # noqa: E731
    return {"IMMA.16832.S8.S8.SAT": per_clk(ceil.get("int8->int32", ceil["fp8->fp16"])),
            "QMMA.16832.F16.E4M3.E4M3": per_clk(ceil["fp8->fp16"]),
            "QMMA.16832.F32.E4M3.E4M3": per_clk(ceil["fp8->fp32"])}


def fit_phi(counts89, proxy, sms=132, ghz=1.98):
    """phi from the proxy's default kernel (mean of its shapes), at an assumed H200 clock."""
    ceil = {r["kind"]: r["tflops"] for r in proxy["ceilings"] if "tflops" in r}
    speed = proxy["speed"]
    T, I, S, U = per_score(counts89, h200_rates(ceil, sms, ghz))
    measured = sum(r["mma_kernel_tflops"] for r in speed) / len(speed)
    t_meas = 4 * 128 / (measured * 1e12 / (sms * ghz * 1e9))  # clocks per score (512 ops per score at D=128)
    parts = sorted((T, I, S))
    return (t_meas - max(parts[-1], U)) / (parts[0] + parts[1]), (T, I, S, U, t_meas, measured, len(speed))


def predict(counts, arch, phi):
    """{card: (T, I, S, U, no overlap, fitted, perfect)} TFLOP/s for the cards of this arch."""
    out = {}
    n = loop_scores(counts) if "loop" in counts else SCORES_PER_LOOP
    if not n:
        return out
    for name, (card_arch, n_sm, clk, r8, f32_factor, _) in CARDS.items():
        if card_arch != arch:
            continue
        T, I, S, U = per_score(counts, card_rates(r8, f32_factor), scores=n)
        to_tflops = lambda t: 512 / t * n_sm * clk * 1e9 / 1e12  # noqa: E731
        out[name] = (T, I, S, U, to_tflops(T + I + S), to_tflops(fitted(T, I, S, U, phi)), to_tflops(max(T, I, S, U)))
    return out


# The 4-bit NVFP4 kernel (kernels/triton/attention_fp4.py) on sm_120: block-scaled FP4 mma.sync
# (OMMA m16n8k64, FP32 accumulator, the only kind it has) at the published dense FP4 peak, 1,676
# TFLOP/s on the RTX 5090 (4,096 ops per SM and clock; assumed at full rate with its FP32
# accumulator, the PRO 6000 at the same rate per SM and clock).
FP4_OMMA = "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"
FP4_RATE = 1676e12 / (170 * 2.407e9)
# The group means' FP16 mma (m16n8k16) against the FP4 rate, per card: FP16 inputs run at a quarter of
# FP4's dense rate with an FP16 accumulator; GeForce halves it again with an FP32 one (NVIDIA's
# Blackwell architecture paper), the RTX PRO 6000 does not.
FP4_CARDS = (("RTX 5090", 170, 2.407, {"HMMA.16816.F32": 1 / 8, "HMMA.16816.F16": 1 / 4}),
             ("RTX PRO 6000", 188, 2.617, {"HMMA.16816.F32": 1 / 4, "HMMA.16816.F16": 1 / 4}))
HMMA_OPS = 16 * 8 * 16 * 2
FP4_VARIANTS = {  # "default" is the RTX PRO 6000's build; GeForce cards run "mean_f16_acc" (launch_fp4)
    "default": {}, "mean_f16_acc": {"mean_f16_acc": True}, "block_mean": {"mean_group": 128},
    "rowsum_cuda": {"rowsum_dot": False, "mean_group": 128}, "key_order_off": {"k_order": False},
    "e2m1_compare": {"e2m1_magic": False, "rowsum_dot": False, "mean_group": 128}, "e2m1_cvt": {"e2m1_cvt": True},
    "e2m1_cvt_f16_acc": {"e2m1_cvt": True, "mean_f16_acc": True},
    "stages3": {"num_stages": 3}, "bn64": {"block_n": 64}, "warps4": {"num_warps": 4},
}


def fp4_tensor_clocks(tensor, hmma_rates):
    """SM clocks of one loop's tensor instructions on a card: the FP4 OMMA at FP4_RATE, the FP16 HMMA
    at the card's fraction of it."""
    t = tensor.get(FP4_OMMA, 0) * 16 * 8 * 64 * 2 / FP4_RATE
    for kind, n in tensor.items():
        if kind.startswith("HMMA"):
            t += n * HMMA_OPS / (FP4_RATE * hmma_rates[kind])
    return t


PEER_FP4 = "SageAttention3 964-1038"


def _smem_bytes(loop_ops):
    """Bytes a warp moves through shared memory: LDSM (x1 / x2 / x4 of 128 B) and LDS / STS by width
    (32 B per byte of width per lane ... 4 B lanes by default)."""
    total = 0
    for op, n in loop_ops.items():
        if op.startswith("LDSM"):
            total += n * 128 * (4 if op.endswith(".4") else 2 if ".2" in op else 1)
        elif op.startswith(("LDS", "STS")):
            width = next((int(w) for w in ("128", "64", "32", "16", "8") if f".{w}" in op or f".U{w}" in op or f".S{w}" in op), 32)
            total += n * 32 * width // 8
    return total


def fp4_counts(options):
    """The NVFP4 kernel's main loop on sm_120 (full opcodes for the shared-memory widths)."""
    _load_package()
    import re
    from collections import Counter

    from vc_attention.kernels.triton.attention_fp4 import compile_fp4_attention
    from vc_attention.kernels.triton.attention_mma import sass_profile

    ck = compile_fp4_attention(120, **options)
    sass, res = _cuobjdump(ck)
    p = sass_profile(sass)
    # the loop's full opcodes, for the widths of its shared-memory accesses
    pat = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
    rows = [(int(m.group(1), 16), m.group(3)) for m in map(pat.search, sass.splitlines()) if m]
    loop_addrs = [a for a, op in rows if op.startswith("BRA")]
    full = Counter()
    if p["loop_instructions"]:
        # sass_profile's loop is the longest backward branch: recover its bounds the same way
        spans = []
        for line in sass.splitlines():
            m = pat.search(line)
            if m and m.group(3).startswith("BRA"):
                t = re.search(r"0x([0-9a-f]+)", line[m.end():])
                if t and int(t.group(1), 16) < int(m.group(1), 16):
                    spans.append((int(m.group(1), 16) - int(t.group(1), 16), int(t.group(1), 16), int(m.group(1), 16)))
        lo, hi = max(spans)[1:]
        full = Counter(op for a, op in rows if lo <= a <= hi)
    del loop_addrs
    return {"loop": dict(p["loop"]), "loop_instructions": p["loop_instructions"], "tensor": p["loop_tensor"],
            "smem_bytes": _smem_bytes(full), "registers": int(re.search(r"REG:(\d+)", res).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", res).group(1)), "shared": ck.metadata.shared,
            "block_n": options.get("block_n", 64)}


def fp4_table(phi):
    """Markdown: the NVFP4 kernel's loop per 64-key tile and warp, its pipes and PREDICTED TFLOP/s."""
    lines = ["NVFP4 kernel, sm_120 (Triton %s), one warp's main loop per 64-key tile (16 x 64 = 1,024 scores), "
             "head dim 128; PREDICTED TFLOP/s on the RTX 5090 and RTX PRO 6000 (fitted with phi = %.2f; no overlap / "
             "perfect in brackets):\n" % (__import__("triton").__version__, phi),
             "| variant | regs / stack B / shared B | loop LDL+STL | OMMA (FP4, f32 acc) / HMMA (FP16) | "
             "FFMA / FMUL / FADD | FSETP / SEL / FSEL | PRMT / LOP3 | MUFU | I2F+I2FP+F2FP+POPC | LDG | smem B | all | "
             "T (5090 / PRO) / I / S / U clk per score | RTX 5090 | RTX PRO 6000 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, opts in FP4_VARIANTS.items():
        try:
            c = fp4_counts(opts)
        except Exception as exc:  # a variant this Triton cannot build
            lines.append(f"| {name} | {type(exc).__name__}: {str(exc)[:60]} |" + " |" * 13)
            continue
        bn = c["block_n"]
        per_tile = (bn // 8) * 2 + 16 * (bn // 64)  # Q.K + P.V OMMAs per tile and warp at D=128
        tiles = c["tensor"].get(FP4_OMMA, 0) // per_tile
        if not tiles:
            lines.append(f"| {name} | no loop found |" + " |" * 13)
            continue
        scores = 16 * bn * tiles
        f = 1024 / scores
        L = c["loop"]
        g = lambda *ops: f"{sum(L.get(o, 0) for o in ops) * f:.0f}"  # noqa: E731
        Ts = [fp4_tensor_clocks(c["tensor"], rates) / scores for _, _, _, rates in FP4_CARDS]
        I = c["loop_instructions"] / 4 / scores
        S = c["smem_bytes"] / 128 / scores
        U = L.get("MUFU", 0) * 32 / 16 / scores
        cells = []
        for (_, n_sm, clk, _), T in zip(FP4_CARDS, Ts):
            tf = lambda t: 512 / t * n_sm * clk * 1e9 / 1e12  # noqa: E731
            cells.append(f"**{tf(fitted(T, I, S, U, phi)):.0f}** ({tf(T + I + S):.0f} / {tf(max(T, I, S, U)):.0f})")
        hmma = sum(n for kind, n in c["tensor"].items() if kind.startswith("HMMA"))
        lines.append(f"| {name} | {c['registers']} / {c['stack']} / {c['shared']:,} | {g('LDL', 'STL')} | "
                     f"{c['tensor'][FP4_OMMA] * f:.0f} / {hmma * f:.0f} | {g('FFMA')} / {g('FMUL')} / {g('FADD')} | "
                     f"{g('FSETP')} / {g('SEL')} / {g('FSEL')} | {g('PRMT')} / {g('LOP3')} | {g('MUFU')} | "
                     f"{g('I2F', 'I2FP', 'F2FP', 'POPC')} | {g('LDG')} | {c['smem_bytes'] * f:.0f} | "
                     f"{c['loop_instructions'] * f:.0f} | {Ts[0]:.3f} / {Ts[1]:.3f} / {I:.3f} / {S:.3f} / {U:.3f} | "
                     f"{cells[0]} | {cells[1]} |")
    lines.append(f"\nPeer's published RTX 5090 figure: {PEER_FP4} TOPS.")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proxy", default=None, help="workstation_proxy.py's JSON (default: the newest in results/)")
    ap.add_argument("--variants", default="default", help="comma list of VARIANTS names, or all")
    ap.add_argument("--out", default=None, help="also write the variant tables (markdown) here")
    ap.add_argument("--fp4", action="store_true", help="also model the NVFP4 kernel on sm_120")
    args = ap.parse_args()
    path = args.proxy or sorted(glob.glob(str(ROOT / "benchmarks/results/workstation_proxy_h200_*.json")))[-1]
    proxy = json.loads(pathlib.Path(path).read_text())
    if not any("tflops" in r for r in proxy.get("ceilings", [])):
        # a run with --skip ceilings: the newest file of the same card that measured them
        for other in sorted(glob.glob(str(ROOT / "benchmarks/results/workstation_proxy_h200_*.json")), reverse=True):
            measured = json.loads(pathlib.Path(other).read_text())
            if measured.get("card") == proxy.get("card") and any("tflops" in r for r in measured.get("ceilings", [])):
                proxy["ceilings"] = measured["ceilings"]
                print(f"ceilings: {pathlib.Path(other).name} (the proxy file has none)")
                break
        else:
            raise SystemExit(f"{pathlib.Path(path).name} has no ceilings and no other proxy file of its card does")
    counts89 = sass_counts(89)
    counts120 = sass_counts(120)
    fit89 = sass_counts(89, FITTED_BUILD) if proxy.get("date", "") < PROXY_BEFORE_EXP2_FMA else counts89
    if "error" in fit89:
        fit89 = counts89
    phi, (T, I, S, U, t_meas, measured, n_shapes) = fit_phi(fit89, proxy)
    phi_low_clock, _ = fit_phi(fit89, proxy, ghz=1.755)
    print(f"proxy: {pathlib.Path(path).name}\nSASS sm_89: {counts89.get('source')}; sm_120: {counts120.get('source')}")
    print(f"H200 proxy: T {T:.3f}, I {I:.3f}, S {S:.3f}, U {U:.3f} clk/score; measured {t_meas:.3f} "
          f"({measured:.0f} TFLOP/s, mean of {n_shapes} shapes) -> phi = {phi:.2f} "
          f"(at 1.755 GHz instead of the 1.98 GHz boost: phi = {phi_low_clock:.2f})")
    rows = [(name, *v) for arch, c in ((120, counts120), (89, counts89)) for name, v in predict(c, arch, phi).items()]
    rows.sort(key=lambda r: list(CARDS).index(r[0]))
    print("\nPREDICTED (model), head dim 128, non-causal, 8-bit kernel:\n")
    print("| card | T / I / S / U clk per score | predicted TFLOP/s: no overlap / H200-fitted / perfect | FA2-class BF16 |")
    print("|---|---|---|---|")
    for name, T, I, S, U, lo, fit, hi in rows:
        print(f"| {name} | {T:.3f} / {I:.3f} / {S:.3f} / {U:.3f} | {lo:.0f} / **{fit:.0f}** / {hi:.0f} | {CARDS[name][5]} |")
    print("\nPeers' published RTX 5090 figures (TOPS, head dim 128): " +
          "; ".join(f"{k} {v}" for k, v in PEERS_5090.items()))
    names = list(VARIANTS) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    text = variant_tables(names, proxy, phi) if names != ["default"] else ""
    if args.fp4:
        text += "\n\n" + fp4_table(phi)
    print(text)
    if args.out and text:
        pathlib.Path(args.out).write_text(text + "\n")


def variant_tables(names, proxy, phi, _cache={}):
    """Markdown: per variant and arch the loop's counts per key tile, the pipes per score, fit checks,
    and the PREDICTED TFLOP/s per card; then the proxy-measured variants against the fit."""
    lines = []
    lines.append("Per variant, one warp's main loop normalised to one key tile of 64 keys (16 query rows x 64 "
                 "keys = 1,024 scores), head dim 128, bf16 output, V-Smooth on, no bias:\n")
    lines.append("| variant | arch | regs / stack B / shared B | loop LDL+STL | IMMA s8 | QMMA f16-acc | QMMA f32-acc | "
                 "HMMA | FFMA / FMUL / FADD | HADD2+HMUL2 | MUFU.EX2 | F2F+F2I+I2F+F2FP | FMNMX / PRMT / SEL | "
                 "LDSM (bytes) / LDS | BAR | all |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    preds, pipes = {}, {}
    for name in names:
        opts, _ = VARIANTS[name]
        for arch in (120, 89):
            key = (name, arch)
            c = _cache.get(key) or _cache.setdefault(key, sass_counts(arch, opts))
            if "error" in c:
                lines.append(f"| {name} | sm_{arch} | {c['error']} |" + " |" * 13)
                continue
            n = loop_scores(c)
            L, t = c["loop"], c["tensor"]
            f = (1024 / n) if n else None
            g = lambda x: "n/a" if f is None else (f"{x * f:.0f}" if x * f >= 10 or x == 0 else f"{x * f:.1f}")  # noqa: E731
            spill = L.get("LDL", 0) + L.get("STL", 0)
            lines.append(
                f"| {name} | sm_{arch} | {c['registers']} / {c['stack']} / {c['shared']:,} | {spill} | "
                f"{g(t.get('IMMA.16832.S8.S8.SAT', 0))} | {g(t.get('QMMA.16832.F16.E4M3.E4M3', 0))} | "
                f"{g(t.get('QMMA.16832.F32.E4M3.E4M3', 0))} | {g(sum(v for k, v in t.items() if k.startswith('HMMA')))} | "
                f"{g(L.get('FFMA', 0))} / {g(L.get('FMUL', 0))} / {g(L.get('FADD', 0))} | "
                f"{g(L.get('HADD2', 0) + L.get('HMUL2', 0))} | {g(L.get('MUFU', 0))} | "
                f"{g(sum(L.get(o, 0) for o in ('F2F', 'F2I', 'I2F', 'F2FP')))} | "
                f"{g(L.get('FMNMX', 0))} / {g(L.get('PRMT', 0))} / {g(L.get('SEL', 0) + L.get('FSEL', 0))} | "
                f"{g(c['ldsm_bytes'])} / {g(L.get('LDS', 0))} | {g(L.get('BAR', 0))} | {g(c['loop_instructions'])} |")
            if n:
                preds.update({(name, card): v for card, v in predict(c, arch, phi).items()})
                pipes[key] = other_pipes(c, n)
    lines.append("\n`n/a`: the loop is not a whole number of runs (its IMMA and P.V QMMA counts disagree), so "
                 "the per-tile model does not apply; local memory in the loop (LDL+STL > 0) is a spill.\n")
    lines.append("PREDICTED TFLOP/s (H200-fitted model, phi = %.2f; no overlap / perfect overlap in brackets), "
                 "clocks per score T / I / S / U / X (XU) / A (ALU) / F (FMA pipe) on the RTX 5090:\n" % phi)
    lines.append("| variant | RTX 5090 | RTX PRO 6000 Blackwell | RTX 4090 | 5090 T / I / S / U / X / A / F |")
    lines.append("|---|---|---|---|---|")
    for name in names:
        cells = []
        for card in CARDS:
            v = preds.get((name, card))
            cells.append("n/a" if v is None else f"**{v[5]:.0f}** ({v[4]:.0f} / {v[6]:.0f})")
        v = preds.get((name, "RTX 5090"))
        x = pipes.get((name, 120))
        p5 = "n/a" if v is None else f"{v[0]:.3f} / {v[1]:.3f} / {v[2]:.3f} / {v[3]:.3f} / {x[0]:.3f} / {x[1]:.3f} / {x[2]:.3f}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {p5} |")
    # Validation: the proxy's other timed variants against the same fit (sm_89 SASS, H200 rates).
    ceil = {r["kind"]: r["tflops"] for r in proxy["ceilings"] if "tflops" in r}
    files = [json.loads(pathlib.Path(p).read_text())
             for p in sorted(glob.glob(str(ROOT / "benchmarks/results/workstation_proxy_h200_*.json")))]
    lines.append("\nThe fit against what the H200 proxy measured (sm_89 SASS, the H200's measured mma.sync rates, "
                 "phi as above; measured: mean over the proxy files' shapes; files before %s timed the kernel "
                 "without EXP2_FMA, compared here with exp2_fma=False builds):\n" % PROXY_BEFORE_EXP2_FMA)
    lines.append("| variant | proxy measured TFLOP/s | model for the proxy | model / measured |")
    lines.append("|---|---|---|---|")
    rows = [(name + " (exp2_fma off)", dict(VARIANTS[name][0], **FITTED_BUILD), VARIANTS[name][1], True)
            for name in names if name not in ("default", "exp2_fma_off")]
    rows = [("default before EXP2_FMA", FITTED_BUILD, "mma_kernel_tflops", True)] + rows
    rows += [(name, VARIANTS[name][0], VARIANTS[name][1], False) for name in names]
    for name, opts, key, old in rows:
        got = [r[key] for f in files if (f.get("date", "") < PROXY_BEFORE_EXP2_FMA) == old
               for r in f["speed"] if key in r]
        c = _cache.get((name, 89))
        if c is None and old:
            c = _cache[(name, 89)] = sass_counts(89, opts)
        elif c is None:
            c = _cache.get((name.split(" ")[0], 89))
        n = c and "loop" in c and loop_scores(c)
        if not got and not n:
            continue
        model = None
        if n:
            T, I, S, U = per_score(c, h200_rates(ceil, 132, 1.98), scores=n)
            model = 512 / fitted(T, I, S, U, phi) * 132 * 1.98e9 / 1e12
        meas = sum(got) / len(got) if got else None
        lines.append(f"| {name} | {'not timed yet' if meas is None else f'{meas:.0f}'} | "
                     f"{'n/a' if model is None else f'{model:.0f}'} | "
                     f"{'' if meas is None or model is None else f'{model / meas:.2f}'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
