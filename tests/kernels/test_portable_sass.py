"""SASS facts of the portable kernel (kernels/triton/attention.py) as B200 / H100 / H200 run it
without a dedicated kernel, compiled here without a GPU for sm_90 and sm_100 (default build: head
dim 128, V-Smooth, no key bias, ExpCast; tiles, warps and stages as kernels/pipeline.py's PORTABLE_*):

- the row sum's ones operand comes through the pipelined copies like V^T: the main loop stores
  nothing into shared memory from registers (the constant tile used to be stored anew every tile,
  between two extra barriers);
- on the folded INT8 path (c8 < 1/4, no key bias: every real call) a thread's 64 scores per tile take
  no float subtract and one clip (at 0) each, not two: counted along the loop's path that the
  branch `c8 < 0.25` takes.
The interpreter correctness of the same code is in test_triton_kernels.py.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[2]
from vc_attention.kernels import pipeline  # noqa: E402
from vc_attention.kernels.triton.attention_mma import branch_target, longest_loop, sass_rows  # noqa: E402

# A thread's scores per key tile of 128: the program's rows x 128 over its threads.
SCORES_PER_THREAD = pipeline.PORTABLE_BLOCK_M * 128 // (32 * pipeline.PORTABLE_NUM_WARPS)

COMPILE = textwrap.dedent("""
    import importlib.util, json, pathlib, subprocess, sys, tempfile
    root = pathlib.Path(sys.argv[1])
    spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
    import triton
    from vc_attention.kernels.precompiled import build, specs
    from vc_attention.kernels.triton.attention import vc_attention_fwd_kernel
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = {}
    for arch in json.loads(sys.argv[2]):
        # the build the cubins ship: the variant specs.py names, compiled as the cubin build does
        v = next(v for v in specs.variants(arch) if v["kernel"] == "vc_attention_fwd_kernel"
                 and v["constexprs"]["HEAD_DIM"] == 128 and v["constexprs"]["HAS_MEAN"]
                 and not v["constexprs"]["HAS_BIAS"] and v["constexprs"]["EXPCAST"] and v["pointers"]["O"] == "bf16")
        cubin, entry, _ = build.compile_variant(vc_attention_fwd_kernel, v, arch)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin); f.flush()
            sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        out[arch] = {"sass": sass, "shared": entry["shared"]}
    print(json.dumps(out))
""")


def main_loop(sass):
    """The main loop's rows (attention_mma.sass_rows within longest_loop)."""
    rows = sass_rows(sass)
    lo, hi = longest_loop(rows)
    return [r for r in rows if lo <= r[0] <= hi]


def fall_through_path(sass):
    """Opcode counts of one loop iteration that falls through every conditional branch inside the
    loop (and follows the unconditional ones): the path the folded tiles take."""
    loop = main_loop(sass)
    index = {a: i for i, (a, *_) in enumerate(loop)}
    i, seen = 0, Counter()
    while i < len(loop):
        a, cond, op, rest = loop[i]
        seen[op.split(".")[0]] += 1
        if op.startswith("BRA") and not cond and i != len(loop) - 1:
            i = index[branch_target(op, rest)]
            continue
        i += 1
    return seen


@pytest.fixture(scope="module")
def builds():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, "-c", COMPILE, str(ROOT), json.dumps([90, 100])], env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("arch", [90, 100])
def test_the_ones_operand_is_not_stored_from_registers_every_tile(builds, arch):
    rows = main_loop(builds[arch]["sass"])
    loop = Counter(op.split(".")[0] for _, _, op, _ in rows)
    assert loop.get("LDL", 0) == 0 and loop.get("STL", 0) == 0
    assert builds[arch]["shared"] <= 227 * 1024
    if arch == 90:  # sm_100 moves P through shared memory on its way to tcgen05: STS stays there
        # bytes a thread stores into shared memory per tile: one 32-bit word at most (a scalar of the
        # tile's bookkeeping), where the ones tile took 16 x 16 bytes
        width = {"STS.U8": 1, "STS.S8": 1, "STS.U16": 2, "STS.S16": 2, "STS": 4, "STS.64": 8, "STS.128": 16}
        stored = sum(width.get(op, 16) for _, _, op, _ in rows if op.startswith("STS"))
        assert stored <= 4, loop


def test_folded_scores_take_no_subtract_and_one_clip(builds):
    """sm_90, per thread and tile (SCORES_PER_THREAD = 64 scores): the row max (one FMNMX per score) and the clip at 0
    (one more); before, also a float subtract and the clip at 120 per score."""
    path = fall_through_path(builds[90]["sass"])
    print(f"portable kernel, sm_90, folded tile: {sum(path.values())} instructions per thread "
          f"(FADD {path['FADD']}, FMNMX {path['FMNMX']}, FFMA {path['FFMA']})")
    assert path["FMNMX"] < 2 * SCORES_PER_THREAD + 16, path
    assert path["FADD"] < SCORES_PER_THREAD // 2, path
    assert path["HGMMA"] + path["IGMMA"] + path["QGMMA"] == 12  # Q.K, P.ones and P.V: 4 k-steps each
