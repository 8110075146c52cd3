"""A per-tile throughput model of the mma.sync 8-bit kernel (kernels/triton/attention_mma.py) for the
cards we do not have: RTX 5090, RTX PRO 6000 Blackwell (sm_120), RTX 4090 (sm_89). Every card
figure it prints is PREDICTED; the H200 row is the measured proxy it is calibrated on.

    python benchmarks/workstation_model.py [--proxy benchmarks/results/workstation_proxy_h200_*.json]

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


def sass_counts(arch):
    """The main loop's counts for one arch: compiled now (Triton present) or the recorded ones."""
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location("vc_attention", ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules.setdefault("vc_attention", mod)
        spec.loader.exec_module(mod)
        import triton
        from vc_attention.kernels.triton.attention_mma import compile_mma_attention, sass_profile

        ck = compile_mma_attention(arch)
        tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            p = sass_profile(subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True,
                                            check=True).stdout)
        return {"loop_instructions": p["loop_instructions"], "MUFU": p["loop"].get("MUFU", 0),
                "ldsm_bytes": p["loop_ldsm_bytes"],
                "tensor": p["loop_tensor"], "source": f"compiled now, Triton {triton.__version__}"}
    except Exception as exc:  # no Triton / no compiler here: the recorded counts
        got = dict(RECORDED[89])
        got["source"] = f"recorded (sm_89, Triton 3.9); compiling failed: {type(exc).__name__}"
        return got


def per_score(counts, rates, clock_issue=4.0, mufu_per_clk=16.0, smem_bytes_per_clk=128.0):
    """(T, I, S, U) in SM clocks per score. rates: tensor ops per SM and clock by SASS kind. S: the
    loop's LDSM bytes (every warp reads the whole K and V tiles: mma.sync has no shared operand)."""
    t = sum(n * OPS[kind] / rates[kind] for kind, n in counts["tensor"].items())
    return (t / SCORES_PER_LOOP, counts["loop_instructions"] / clock_issue / SCORES_PER_LOOP,
            counts["ldsm_bytes"] / smem_bytes_per_clk / SCORES_PER_LOOP,
            counts["MUFU"] * 32 / mufu_per_clk / SCORES_PER_LOOP)


def fitted(T, I, S, U, phi):
    """The slowest pipe, plus phi times the other two of tensor / issue / shared memory."""
    parts = sorted((T, I, S))
    return max(parts[-1], U) + phi * (parts[0] + parts[1])


def card_rates(rate8, f32_factor):
    return {"IMMA.16832.S8.S8.SAT": rate8, "QMMA.16832.F16.E4M3.E4M3": rate8,
            "QMMA.16832.F32.E4M3.E4M3": rate8 * f32_factor}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proxy", default=None, help="workstation_proxy.py's JSON (default: the newest in results/)")
    args = ap.parse_args()
    path = args.proxy or sorted(glob.glob(str(ROOT / "benchmarks/results/workstation_proxy_h200_*.json")))[-1]
    proxy = json.loads(pathlib.Path(path).read_text())
    ceil = {r["kind"]: r["tflops"] for r in proxy["ceilings"] if "tflops" in r}
    speed = proxy["speed"]
    counts89 = sass_counts(89)
    counts120 = sass_counts(120)
    # H200 (measured ceilings of the same mma.sync path, per SM and clock at the assumed 1.98 GHz)
    sms, ghz = 132, 1.98
    per_clk = lambda tflops: tflops * 1e12 / (sms * ghz * 1e9)  # noqa: E731
    rates = {"IMMA.16832.S8.S8.SAT": per_clk(ceil.get("int8->int32", ceil["fp8->fp16"])),
             "QMMA.16832.F16.E4M3.E4M3": per_clk(ceil["fp8->fp16"]),
             "QMMA.16832.F32.E4M3.E4M3": per_clk(ceil["fp8->fp32"])}
    T, I, S, U = per_score(counts89, rates)
    measured = sum(r["mma_kernel_tflops"] for r in speed) / len(speed)
    t_meas = 4 * 128 / (measured * 1e12 / (sms * ghz * 1e9))  # clocks per score (512 ops per score at D=128)
    parts = sorted((T, I, S))
    phi = (t_meas - max(parts[-1], U)) / (parts[0] + parts[1])
    print(f"proxy: {pathlib.Path(path).name}\nSASS sm_89: {counts89.get('source')}; sm_120: {counts120.get('source')}")
    print(f"H200 proxy: T {T:.3f}, I {I:.3f}, S {S:.3f}, U {U:.3f} clk/score; measured {t_meas:.3f} "
          f"({measured:.0f} TFLOP/s, mean of {len(speed)} shapes) -> phi = {phi:.2f}")
    rows = []
    for name, (arch, n_sm, clk, r8, f32_factor, fa2) in CARDS.items():
        T, I, S, U = per_score(counts120 if arch == 120 else counts89, card_rates(r8, f32_factor))
        to_tflops = lambda t: 512 / t * n_sm * clk * 1e9 / 1e12  # noqa: E731
        rows.append((name, T, I, S, U, to_tflops(T + I + S), to_tflops(fitted(T, I, S, U, phi)),
                     to_tflops(max(T, I, S, U)), fa2))
    print("\nPREDICTED (model), head dim 128, non-causal, 8-bit kernel:\n")
    print("| card | T / I / S / U clk per score | predicted TFLOP/s: no overlap / H200-fitted / perfect | FA2-class BF16 |")
    print("|---|---|---|---|")
    for name, T, I, S, U, lo, fit, hi, fa2 in rows:
        print(f"| {name} | {T:.3f} / {I:.3f} / {S:.3f} / {U:.3f} | {lo:.0f} / **{fit:.0f}** / {hi:.0f} | {fa2} |")
    print("\nPeers' published RTX 5090 figures (TOPS, head dim 128): " +
          "; ".join(f"{k} {v}" for k, v in PEERS_5090.items()))
    print("ExpCast: U is the exp time; it is below T on every card, so removing the exponentials "
          "(ExpCast) cannot shorten the tile: off by default.")


if __name__ == "__main__":
    main()
