"""SASS facts of the workstation builds (RTX 4090 sm_89, RTX 5090 / PRO 6000 sm_120), compiled here
without a GPU, for the launch options the per-tile model (benchmarks/workstation_model.py) chose:

- the 8-bit mma.sync kernel's EXP2_FMA (the exp2 argument as one FFMA with the score scale folded,
  the default): one FMUL per score fewer in the main loop and nothing else changed on the tensor
  cores;
- the NVFP4 kernel for sm_120: block-scaled FP4 mma.sync (OMMA e2m1 x e2m1, E4M3 scales per 16,
  FP32 accumulator) and, for V-Smooth's means per 8 tokens, one FP16 mma per 8 channels and tile
  (FP32 accumulator), no local memory in the main loop, shared memory within one block's ~99 KB;
  P kept in registers from the score accumulator to the P.V
  operand (K_ORDER, the default); its row sum on the tensor cores (ROWSUM_DOT, the default) fewer
  instructions than on the CUDA cores; its E2M1 rounding by one magic add (E2M1_MAGIC, the default)
  without the int -> float conversions (I2F) and the population counts of the seven comparisons.
One fresh process compiles every build (this one runs Triton's interpreter); the interpreter
correctness of the same options is in test_mma_kernel.py and test_nvfp4.py.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[2]

COMPILE = textwrap.dedent("""
    import importlib.util, json, pathlib, re, subprocess, sys, tempfile
    root = pathlib.Path(sys.argv[1])
    spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
    import triton
    from vc_attention.kernels.triton.attention_fp4 import compile_fp4_attention
    from vc_attention.kernels.triton.attention_mma import compile_mma_attention, sass_profile
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = {}
    for name, kind, arch, opts in json.loads(sys.argv[2]):
        ck = (compile_mma_attention if kind == "mma" else compile_fp4_attention)(arch, **opts)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"]); f.flush()
            sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        p = sass_profile(sass)
        out[name] = {"shared": ck.metadata.shared, "loop": p["loop"], "all": p["all"],
                     "loop_instructions": p["loop_instructions"], "loop_tensor": p["loop_tensor"],
                     "tensor_kinds": p["tensor_kinds"]}
    print(json.dumps(out))
""")

BUILDS = [  # name, kernel, arch, options
    ("mma120", "mma", 120, {}),
    ("mma120-noexp2fma", "mma", 120, {"exp2_fma": False}),
    ("mma89", "mma", 89, {}),
    ("mma89-noexp2fma", "mma", 89, {"exp2_fma": False}),
    ("fp4-120", "fp4", 120, {}),
    ("fp4-120-block-mean", "fp4", 120, {"mean_group": 128}),
    ("fp4-120-mean-f16", "fp4", 120, {"mean_f16_acc": True}),
    ("fp4-120-rowsum-cuda", "fp4", 120, {"rowsum_dot": False, "mean_group": 128}),
    ("fp4-120-key-order-off", "fp4", 120, {"k_order": False}),
    ("fp4-120-compare", "fp4", 120, {"e2m1_magic": False, "rowsum_dot": False, "mean_group": 128}),
]


@pytest.fixture(scope="module")
def builds():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, "-c", COMPILE, str(ROOT), json.dumps(BUILDS)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", [120, 89])
def test_exp2_fma_drops_one_multiply_per_score(builds, arch):
    """Per run of 128 keys a thread holds 64 scores: EXP2_FMA folds their 64 FMULs (the scale) and
    64 FADDs (minus the max) into 64 FFMAs; the tensor instructions, the MUFU.EX2 count and the
    shared memory do not change, and neither build spills."""
    on, off = builds[f"mma{arch}"], builds[f"mma{arch}-noexp2fma"]
    assert on["loop_tensor"] == off["loop_tensor"]
    assert on["loop"]["MUFU"] == off["loop"]["MUFU"]
    assert off["loop"]["FMUL"] - on["loop"]["FMUL"] >= 56
    assert off["loop_instructions"] - on["loop_instructions"] >= 40  # Triton 3.9: 60 / 56, 3.8: 49 on sm_89
    assert on["shared"] == off["shared"] <= 99 * 1024
    for b in (on, off):
        assert b["loop"].get("LDL", 0) == 0 and b["loop"].get("STL", 0) == 0


FP4_OMMA = "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"
MEAN_HMMA = "HMMA.16816.F32"


def test_nvfp4_sm120_build_fits_the_card(builds):
    """The NVFP4 kernel for sm_120, per 128-key tile and warp: the block-scaled FP4 mma.sync (OMMA
    m16n8k64, e2m1 x e2m1, ue4m3 scales 4 per 64-element step = one per 16, FP32 accumulator), 32
    for Q.K (16 key columns x 2 steps of the head dim), 32 for P.V (16 channel columns x 2 steps of
    the keys) and the row sum: P times the ones tile, 2 with the block mean (ptxas drops the
    duplicate half of equal columns), 4 for the default's 16 group columns, none on the CUDA cores.
    The default's means: 16 FP16 mma m16n8k16 with an FP32 accumulator (the 16 groups' row sums
    times their means, 8 channels each) and nothing else on the tensor cores. No local memory in the
    main loop; shared memory within the ~99 KB of one block."""
    b, block, cuda_sum = builds["fp4-120"], builds["fp4-120-block-mean"], builds["fp4-120-rowsum-cuda"]
    assert sorted(b["tensor_kinds"]) == sorted([FP4_OMMA, MEAN_HMMA]) and block["tensor_kinds"] == [FP4_OMMA]
    assert b["loop_tensor"] == {FP4_OMMA: 68, MEAN_HMMA: 16}
    assert block["loop_tensor"] == {FP4_OMMA: 66} and cuda_sum["loop_tensor"] == {FP4_OMMA: 64}
    for x in (b, block, cuda_sum):
        assert x["loop"].get("LDL", 0) == 0 and x["loop"].get("STL", 0) == 0
        assert x["shared"] <= 99 * 1024
    assert block["loop_instructions"] < cuda_sum["loop_instructions"]  # 1,395 against 1,586 (Triton 3.8, 3.9)


def test_nvfp4_group_means_cost_little_issue(builds):
    """The means per 8 tokens against the block mean: the row sums per group come from the same
    tensor-core row sum and go to the FP16 mma as they are (in registers: no shared-memory stores
    for them), so the tile issues at most 40 instructions more (1,411 against 1,395 with Triton
    3.9); their cost is tensor time (benchmarks/workstation_model.py --fp4), which GeForce cards
    halve with an FP16 accumulator (mean_f16_acc) for 76 instructions more."""
    b, block, f16 = builds["fp4-120"], builds["fp4-120-block-mean"], builds["fp4-120-mean-f16"]
    assert b["loop_instructions"] - block["loop_instructions"] <= 40
    assert b["loop"].get("STS", 0) == block["loop"].get("STS", 0)
    # GeForce's build: the same mma with an FP16 accumulator (full rate there), its sums widened after
    assert f16["loop_tensor"] == {FP4_OMMA: 68, "HMMA.16816.F16": 16}
    assert f16["loop"].get("LDL", 0) == 0 and f16["loop"].get("STL", 0) == 0
    assert f16["loop_instructions"] - b["loop_instructions"] <= 100  # 1,487 against 1,411


def test_nvfp4_p_stays_in_registers(builds):
    """P handed from the score accumulator to the P.V operand in registers (K's tile loaded in operand
    order: _operand_keys), so no shared-memory round trip and no barrier for it. Instructions per 128
    keys (recorded beside the design in kernels/triton/attention_fp4.py: 1,411 with Triton 3.9, 1,395
    with the block mean) bounded, and the build without the key order spends more (its P goes
    through shared memory: 33 stores a tile)."""
    d, block, off = builds["fp4-120"], builds["fp4-120-block-mean"], builds["fp4-120-key-order-off"]
    assert block["loop"].get("STS", 0) <= 2 and block["loop"].get("BAR", 0) <= 2  # the pipeline's, not P's
    # the means' tile has one shared buffer: one barrier more before it is refilled
    assert d["loop"].get("STS", 0) <= 2 and d["loop"].get("BAR", 0) <= 3
    assert d["loop_instructions"] < 1500
    assert off["loop"].get("STS", 0) > d["loop"].get("STS", 0) + 8
    assert off["loop_instructions"] > d["loop_instructions"]


def test_nvfp4_magic_rounding_drops_the_comparisons(builds):
    """E2M1_MAGIC (the default) against the seven comparisons, both with the row sum on the CUDA
    cores (which needs the rounding's values): no I2F and no POPC left in the main loop, and at least
    a third fewer instructions per tile (measured: 1,586 against 2,830 per 128 keys with Triton 3.9),
    the same tensor instructions."""
    magic, compare = builds["fp4-120-rowsum-cuda"], builds["fp4-120-compare"]
    assert magic["loop_tensor"] == compare["loop_tensor"]
    assert compare["loop"].get("I2F", 0) > 0  # what the check below would catch
    assert magic["loop"].get("I2F", 0) == 0 and magic["loop"].get("POPC", 0) == 0
    assert magic["loop_instructions"] < 0.67 * compare["loop_instructions"]
