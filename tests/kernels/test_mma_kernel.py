"""The 8-bit kernel for mma.sync GPUs (RTX 4090 sm_89, RTX 5090 / PRO 6000 sm_120) without the card.

1. Under Triton's interpreter: the kernel against its readable reference (kernels/reference/
   workstation.py) at small odd shapes, both layouts (through the views), head dims 64 / 128,
   V-Smooth on / off, a key bias, ExpCast, the FP32 version, the INT8 P.V path (with its LSE);
   the FP16 accumulator's worst case.
2. The reference itself: FP16 runs cost no accuracy against the FP32 version; V's codes stop at 1.75.
3. Compiled for sm_89 and sm_120 (no GPU): the PTX and SASS hold the tensor instructions the design
   needs (IMMA s8 -> s32 for Q.K, QMMA e4m3 with an FP16 accumulator for P.V; the INT8 P.V path:
   IMMA only), no local memory in the main loop, shared memory within the ~99 KB of one block;
   per-key-tile counts recorded.
On a GPU the first part runs the JIT-compiled kernel (tests/gpu/test_mma_gpu.py runs the sm_89 PTX).
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")

from vc_attention.kernels.reference import exact_attention  # noqa: E402
from vc_attention.kernels.reference.workstation import V_MAX, workstation_vc_attention  # noqa: E402
from vc_attention.kernels.triton.attention_mma import mma_vc_attention  # noqa: E402

from kernel_helpers import rel_l2, video_like_qkv  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # N, D, layout, v_smooth, bias, expcast, pv_acc16
    (77, 64, "HND", True, False, False, True),
    (77, 128, "NHD", True, False, False, True),
    (200, 128, "HND", False, False, False, True),
    (200, 64, "NHD", False, True, False, True),
    (333, 128, "HND", True, True, False, True),
    (200, 128, "NHD", True, False, True, True),
    (200, 128, "HND", True, False, False, False),
]


def _views(t, layout):
    """[B, H, N, D] views of a tensor stored in `layout` (NHD: [B, N, H, D] in memory)."""
    return t.transpose(1, 2) if layout == "NHD" else t


def _case_inputs(N, D, layout, v_smooth, bias):
    """(q, k, v, key bias or None, perm or None) of one case: 2 heads, bf16, `layout` in memory; the
    bias sends the last quarter of the keys to -inf and lifts the first 20."""
    q, k, v = (_views(t.to(DEVICE), layout) for t in video_like_qkv(1, 2, N, D, seed=N + D, dtype=torch.bfloat16,
                                                                      layout=layout))
    kb = None
    if bias:
        kb = torch.zeros(1, 1, 1, N, device=DEVICE)
        kb[..., N * 3 // 4:] = -math.inf
        kb[..., :20] = 0.7
    g = torch.Generator().manual_seed(N)
    perm = torch.stack([torch.randperm(N, generator=g) for _ in range(2)])[None].to(DEVICE) if v_smooth else None
    return q, k, v, kb, perm


@pytest.mark.parametrize("case", CASES, ids=[f"N{c[0]}-D{c[1]}-{c[2]}-vs{int(c[3])}-bias{int(c[4])}"
                                             f"-ec{int(c[5])}-{'fp16' if c[6] else 'fp32'}" for c in CASES])
def test_kernel_matches_its_reference(case):
    """Same quantisers, same P bytes, same run recurrence: kernel = reference to rounding (rel. L2 <
    1e-3; the 8-bit error itself is ~1e-2). The output buffer starts as NaN: every element written."""
    N, D, layout, v_smooth, bias, expcast, acc16 = case
    q, k, v, kb, perm = _case_inputs(N, D, layout, v_smooth, bias)
    out = _views(torch.full((1, N, 2, D) if layout == "NHD" else (1, 2, N, D), math.nan, dtype=torch.bfloat16,
                            device=DEVICE), layout)
    mma_vc_attention(q, k, v, out, v_smooth=v_smooth, expcast=expcast, perm=perm, key_bias=kb, pv_acc16=acc16)
    ref = workstation_vc_attention(q, k, v, v_smooth=v_smooth, expcast=expcast, perm=perm, key_bias=kb,
                                   pv_accumulation="fp16_run" if acc16 else "fp32",
                                   fp16_round_keys=32 if DEVICE == "cuda" else None)
    assert not torch.isnan(out).any()
    assert rel_l2(out.float(), ref.to(out.dtype).float()) < 1e-3
    exact = exact_attention(q, k, v, key_bias=kb).float()
    assert rel_l2(out.float(), exact) < 0.03  # and it is attention: the 8-bit error, no more


def test_launch_variants_compute_the_same():
    """Tile size and run length change where the running max is taken and where FP16 is added to
    FP32; the reference with the same tiles follows them."""
    q, k, v = (t.to(DEVICE) for t in video_like_qkv(1, 2, 300, 64, seed=5, dtype=torch.bfloat16))
    for opts in (dict(block_n=32, run_tiles=4), dict(block_n=128, run_tiles=1), dict(block_m=64, num_warps=4)):
        out = torch.empty_like(q)
        mma_vc_attention(q, k, v, out, **opts)
        bn = opts.get("block_n", 64)
        ref = workstation_vc_attention(q, k, v, block_n=bn, run_keys=bn * opts.get("run_tiles", 128 // bn),
                                       fp16_round_keys=32 if DEVICE == "cuda" else None)
        assert rel_l2(out.float(), ref.to(out.dtype).float()) < 1e-3, opts


@pytest.mark.parametrize("N,D,exp2_fma", [(77, 64, True), (200, 128, True), (200, 128, False)])
def test_exp2_fma_computes_the_reference(N, D, exp2_fma):
    """The exp2 argument as one FFMA with the scale folded (the row max taken on the unscaled scores)
    changes only the rounding of that argument: the same reference, both settings of the option (the
    kernel's default is one of them), a partial last tile (N = 77, 200) and no bias (with a bias the
    option is ignored: the bias is added to the scaled scores)."""
    q, k, v = (t.to(DEVICE) for t in video_like_qkv(1, 2, N, D, seed=3 * N + D, dtype=torch.bfloat16))
    out = torch.full_like(q, math.nan)
    mma_vc_attention(q, k, v, out, exp2_fma=exp2_fma)
    ref = workstation_vc_attention(q, k, v, fp16_round_keys=32 if DEVICE == "cuda" else None)
    assert not torch.isnan(out).any()
    assert rel_l2(out.float(), ref.to(out.dtype).float()) < 1e-3


INT8_CASES = [  # N, D, layout, v_smooth, bias
    (77, 64, "HND", True, False),
    (200, 128, "NHD", False, True),
    (333, 128, "HND", True, True),
    (333, 128, "NHD", True, False),  # full tiles without a bias: the folded scores
]


@pytest.mark.parametrize("case", INT8_CASES, ids=[f"N{c[0]}-D{c[1]}-{c[2]}-vs{int(c[3])}-bias{int(c[4])}"
                                                  for c in INT8_CASES])
def test_int8_pv_matches_its_reference(case):
    """The INT8 P.V path (pv_int8=True): INT8 V per (128-row block, channel), P as unsigned INT8
    against each tile's row max, P.V exact in INT32 per tile. Kernel = reference (pv_accumulation="int8") to rounding, a
    partial last tile and -inf keys included; closer to exact attention than the E4M3 path on the
    same inputs (V's 127 uniform steps against E4M3's 3 mantissa bits); the LSE output as well."""
    N, D, layout, v_smooth, bias = case
    q, k, v, kb, perm = _case_inputs(N, D, layout, v_smooth, bias)
    out = torch.full_like(q, math.nan)
    lse = torch.full((1, 2, N), math.nan, device=DEVICE)
    mma_vc_attention(q, k, v, out, v_smooth=v_smooth, perm=perm, key_bias=kb, pv_int8=True, lse=lse)
    ref = workstation_vc_attention(q, k, v, v_smooth=v_smooth, perm=perm, key_bias=kb, pv_accumulation="int8")
    assert not torch.isnan(out).any()
    assert rel_l2(out.float(), ref.to(out.dtype).float()) < 1e-3
    exact = exact_attention(q, k, v, key_bias=kb).float()
    fp8 = workstation_vc_attention(q, k, v, v_smooth=v_smooth, perm=perm, key_bias=kb)
    assert rel_l2(out.float(), exact) < 0.8 * rel_l2(fp8, exact)
    s = (q.float() @ k.float().transpose(-1, -2)) * D ** -0.5 + (0 if kb is None else kb)
    assert (lse - torch.logsumexp(s, dim=-1)).abs().max().item() < 0.02


@pytest.mark.parametrize("gain", [1.0, 12.0, 40.0])
def test_int8_pv_folded_scores_keep_every_byte(gain):
    """Full tiles fold 1.5 * 2^23 into the exp2's FFMA against the row max rounded up (eps < 0): at
    large score scales (Q and K times 12 and 40: one INT8 step of the dot is ~0.01-0.15 in log2
    units), where a row max rounded down would push the tile's largest byte past 255 (it wraps to 0
    as a signed byte), the kernel still follows its reference."""
    q, k, v = (t.to(DEVICE) for t in video_like_qkv(1, 2, 384, 128, seed=5, dtype=torch.bfloat16))
    q, k = q * gain, k * gain
    out = torch.full(q.shape, math.nan, device=DEVICE)
    mma_vc_attention(q, k, v, out, pv_int8=True)
    ref = workstation_vc_attention(q, k, v, pv_accumulation="int8")
    assert rel_l2(out, ref) < 1e-3


def test_int8_pv_refuses_expcast_and_runs_other_than_its_v_blocks():
    q, k, v = video_like_qkv(1, 1, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="INT8 P.V"):
        mma_vc_attention(q, k, v, torch.empty_like(q), pv_int8=True, expcast=True)
    with pytest.raises(ValueError, match="V blocks"):
        mma_vc_attention(q, k, v, torch.empty_like(q), pv_int8=True, block_n=64, run_tiles=1)


def test_int8_pv_tilings_compute_their_reference():
    """128-key tiles (one per V block: P against the 128-key row max) and 32-key tiles (runs of 4):
    the reference with the same tiles follows them; V's per-block scales change at every run."""
    q, k, v = (t.to(DEVICE) for t in video_like_qkv(1, 2, 333, 128, seed=3, dtype=torch.bfloat16))
    for bn, tiles in ((128, 1), (32, 4)):
        out = torch.full(q.shape, math.nan, device=DEVICE)
        mma_vc_attention(q, k, v, out, pv_int8=True, block_n=bn, run_tiles=tiles)
        ref = workstation_vc_attention(q, k, v, pv_accumulation="int8", block_n=bn, run_keys=bn * tiles)
        assert rel_l2(out, ref) < 1e-3, bn  # CPU: about 1e-5


def test_bad_tiles_are_refused():
    q, k, v = video_like_qkv(1, 1, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="run"):
        mma_vc_attention(q, k, v, torch.empty_like(q), block_n=64, run_tiles=3)


def test_fp16_accumulator_worst_case_stays_finite():
    """Every key equally likely (P = 256 everywhere: Q = 0) and every value at its channel's largest
    residual code (+1.75 after scaling) in one run of 128 keys: the FP16 run reaches 128 x 256 x
    1.75 = 57,344 < 65,504. The output must be the exact mean of V, not inf (with 448-scaled codes
    this sum would be 256 times larger)."""
    N, D = 256, 64
    q = torch.zeros(1, 1, N, D)
    k = torch.randn(1, 1, N, D)
    v = torch.zeros(1, 1, N, D)
    v[..., : N // 2, :] = 3.0  # block 0 all +3, block 1 all -3: residuals 0 without V-Smooth's mean
    v[..., N // 2:, :] = -3.0
    v[..., 0] = 100.0  # channel 0: constant, its scale makes the code 1.75 everywhere
    for v_smooth in (False, True):
        o = torch.empty(1, 1, N, D, device=DEVICE)
        mma_vc_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), o, v_smooth=v_smooth)
        assert torch.isfinite(o).all()
        assert torch.allclose(o.cpu(), v.mean(dim=2, keepdim=True).expand_as(v), atol=0.1)


def test_v_codes_stop_at_v_max():
    """The kernel's pre-pass writes V's residual codes within +-1.75 (the reference's V_MAX)."""
    from vc_attention.kernels.triton.attention_mma import mma_launch, quantize_v_residual_mma

    _, _, v = video_like_qkv(1, 2, 300, 64, seed=1)
    pre = quantize_v_residual_mma(mma_launch, v.to(DEVICE))
    codes = pre["vt"].float()
    assert codes.abs().max().item() == V_MAX == 1.75


@pytest.mark.parametrize("seed", [0, 1])
def test_fp16_runs_cost_no_accuracy(seed):
    """The design's claim at reference level: P.V in FP16 over runs of 128 keys (rounded every
    32-key mma.sync step) is as close to exact attention as the FP32 version (within 2%)."""
    q, k, v = video_like_qkv(1, 2, 1000, 128, seed=seed)
    exact = exact_attention(q, k, v).float()
    e32 = rel_l2(workstation_vc_attention(q, k, v, pv_accumulation="fp32"), exact)
    e16 = rel_l2(workstation_vc_attention(q, k, v, fp16_round_keys=32), exact)
    assert e16 < 1.02 * e32


# --- compiled for the cards (no GPU) --------------------------------------------------------------

COMPILE = textwrap.dedent("""
    import importlib.util, json, pathlib, subprocess, sys, tempfile
    root = pathlib.Path(sys.argv[1])
    spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
    import triton
    from vc_attention.kernels.triton.attention_mma import compile_mma_attention, sass_profile
    bindir = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ck = compile_mma_attention(int(sys.argv[2]), **json.loads(sys.argv[3]))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"]); f.flush()
        sass = subprocess.run([str(bindir / "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([str(bindir / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    p = sass_profile(sass)
    ptx = ck.asm["ptx"]
    print(json.dumps({"ptx_mma": sorted({l.strip().split(" ")[0] for l in ptx.splitlines() if l.strip().startswith("mma.")}),
                      "target": [l.split()[1] for l in ptx.splitlines() if l.startswith(".target")][0],
                      "shared": ck.metadata.shared, "res": res, "tensor_kinds": p["tensor_kinds"],
                      "loop": p["loop"], "all": p["all"], "loop_instructions": p["loop_instructions"],
                      "loop_tensor": p["loop_tensor"]}))
""")

BUILDS = {  # name: (arch, options)
    "sm89": (89, {}), "sm120": (120, {}), "sm89-fp32pv": (89, {"pv_acc16": False}),
    "sm120-d64-bias": (120, {"head_dim": 64, "has_bias": True}),
    "sm89-int8pv": (89, {"pv_int8": True}), "sm120-int8pv": (120, {"pv_int8": True}),
}


@pytest.fixture(scope="module")
def builds():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    got = {}
    for name, (arch, opts) in BUILDS.items():  # one at a time: CI machines have few cores
        p = subprocess.run([sys.executable, "-c", COMPILE, str(ROOT), str(arch), json.dumps(opts)], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        got[name] = json.loads(p.stdout.strip().splitlines()[-1])
    return got


INT8_QK = "mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32"
FP8_PV_F16 = "mma.sync.aligned.m16n8k32.row.col.f16.e4m3.e4m3.f16"
FP8_ROWSUM_F32 = "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"


@pytest.mark.parametrize("name", ["sm89", "sm120", "sm120-d64-bias"])
def test_builds_use_int8_qk_and_fp16_accumulated_fp8_pv(builds, name):
    """PTX: INT8 -> INT32 for Q.K, E4M3 with an FP16 accumulator for P.V, and E4M3 -> FP32 only for
    the row sum (P times a 64 x 16 tile of ones: exact). SASS: IMMA and QMMA of those kinds only
    (no HMMA, nothing else on the tensor cores)."""
    b = builds[name]
    assert b["target"] == ("sm_89" if name.startswith("sm89") else "sm_120a")
    assert b["ptx_mma"] == sorted([INT8_QK, FP8_PV_F16, FP8_ROWSUM_F32])
    assert b["tensor_kinds"] == ["IMMA.16832.S8.S8.SAT", "QMMA.16832.F16.E4M3.E4M3", "QMMA.16832.F32.E4M3.E4M3"]


def test_fp32_version_is_what_the_check_would_catch(builds):
    """The FP32 version's P.V is an FP32-accumulating QMMA, as many as the FP16 one's: the SASS
    check above tells them apart."""
    fp16, fp32 = builds["sm89"]["loop_tensor"], builds["sm89-fp32pv"]["loop_tensor"]
    assert "QMMA.16832.F16.E4M3.E4M3" not in fp32
    assert fp32["QMMA.16832.F32.E4M3.E4M3"] == fp16["QMMA.16832.F16.E4M3.E4M3"] + fp16["QMMA.16832.F32.E4M3.E4M3"]


@pytest.mark.parametrize("name", ["sm89", "sm120", "sm120-d64-bias"])
def test_builds_fit_the_card(builds, name):
    """Shared memory within one block's ~99 KB; no local memory traffic in the main loop (sm_89: none
    at all). sm_120's ptxas keeps a few values live across the main loop in local memory (one store
    before and one load after it, per program): recorded, bounded."""
    b = builds[name]
    assert b["shared"] <= 99 * 1024
    assert b["loop"].get("LDL", 0) == 0 and b["loop"].get("STL", 0) == 0
    if name == "sm89":
        assert b["all"].get("LDL", 0) == 0 and b["all"].get("STL", 0) == 0
    else:
        assert b["all"].get("LDL", 0) + b["all"].get("STL", 0) <= 32


@pytest.mark.parametrize("name", ["sm89", "sm120"])
def test_instructions_per_key_tile(builds, name):
    """The main loop is one run of 2 tiles of 128 queries x 64 keys (head dim 128), per warp (16
    query rows): Q.K = 2 x (64 / 8) x (128 / 32) = 64 IMMA; P.V = 2 x (128 / 8) x (64 / 32) = 64
    QMMA with FP16 accumulation; the row sum 2 x (16 / 8) x (64 / 32) = 8 QMMA with FP32; one MUFU
    ex2 per score (2 x 32 per thread) plus the rescale, and no other MUFU (no int -> float
    conversion: the scores are converted with a magic-number add). The counts beside the design
    (kernels/triton/attention_mma.py) come from here."""
    b = builds[name]
    # (sm_120's ptxas drops the second half of the ones dot: both 8-column halves are the same sum)
    assert b["loop_tensor"] == {"IMMA.16832.S8.S8.SAT": 64, "QMMA.16832.F16.E4M3.E4M3": 64,
                                "QMMA.16832.F32.E4M3.E4M3": 8 if name == "sm89" else 4}
    assert b["loop"]["MUFU"] <= 2 * (32 + 2)
    assert "I2F" not in b["loop"] and "F2I" not in b["loop"]
    assert b["loop_instructions"] < 1300


def test_int8_pv_builds_run_every_matmul_in_int8(builds):
    """The INT8 P.V path's builds (its defaults: 128-key tiles, Q per token): Q.K, P.V and the row
    sum all IMMA s8 -> s32 (the full tensor rate on GeForce cards, no FP32-accumulator halving), 64 +
    64 + the row sum's per 128 keys and warp; no conversion instruction on the XU pipe; shared memory
    within the card's block. Its cost in the CUDA cores, recorded beside the design
    (kernels/triton/attention_mma.py): 1,071 / 1,150 instructions per 128 keys on sm_120 / sm_89
    (Triton 3.8; the E4M3 build: 958 / 1,055), and a few values spilled in the loop (18 / 10
    local-memory instructions), bounded here."""
    for name in ("sm89-int8pv", "sm120-int8pv"):
        b = builds[name]
        assert b["ptx_mma"] == [INT8_QK], name
        assert b["tensor_kinds"] == ["IMMA.16832.S8.S8.SAT"], name
        assert b["loop_tensor"] == {"IMMA.16832.S8.S8.SAT": 64 + 64 + (8 if name.startswith("sm89") else 4)}, name
        assert "I2F" not in b["loop"] and "F2I" not in b["loop"], name
        assert b["shared"] <= 99 * 1024
        assert b["loop"].get("LDL", 0) + b["loop"].get("STL", 0) <= 32, name
        assert b["loop_instructions"] < 1600, name


def test_nan_policy_as_sdpa():
    """A NaN in a query row makes that row NaN; a NaN in a value makes its channel NaN; a NaN key
    makes the whole head NaN (as SDPA); everything else stays finite and correct."""
    N, D = 150, 64
    q, k, v = (t.to(DEVICE) for t in video_like_qkv(1, 2, N, D, seed=9, dtype=torch.bfloat16))
    q[0, 0, 5, 3] = math.nan
    v[0, 0, 40, 7] = math.nan
    k[0, 1, 0, 0] = math.nan
    out = torch.empty_like(q)
    mma_vc_attention(q, k, v, out)
    assert torch.isnan(out[0, 0, 5]).all() and torch.isnan(out[0, 0, :, 7]).all() and torch.isnan(out[0, 1]).all()
    keep = [c for c in range(D) if c != 7]
    rest = torch.cat([out[0, 0, :5], out[0, 0, 6:]])[:, keep]
    assert torch.isfinite(rest).all()
    q[0, 0, 5, 3] = 0.0
    v[0, 0, 40, 7] = 0.0
    ref = exact_attention(q[:, :1], k[:, :1], v[:, :1]).float()
    assert rel_l2(rest.float(), torch.cat([ref[0, 0, :5], ref[0, 0, 6:]])[:, keep]) < 0.03


LAUNCHER = textwrap.dedent("""
    import importlib.util, json, pathlib, sys
    root = pathlib.Path(sys.argv[1])
    spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
    from vc_attention.kernels.precompiled.build import ptx_params
    from vc_attention.kernels.precompiled.ptx import SM89Launcher
    from vc_attention.kernels.triton import attention_mma as am
    out = {}
    for name, opts in (("default", {}), ("exp2_fma_off", {"exp2_fma": False})):
        c = am.mma_constexprs(128, block_m=am.MMA_BLOCK_M, block_n=am.MMA_BLOCK_N, run_tiles=am.MMA_RUN_TILES,
                              v_smooth=True, has_bias=False, expcast=False, beta=-0.35, software_rounding=False,
                              pv_acc16=True, rowsum_cuda=False, **opts)
        ck, names = SM89Launcher().build(c, "bf16", am.MMA_NUM_WARPS, am.MMA_NUM_STAGES)
        out[name] = {"names": names, "ptx_params": len(ptx_params(ck.asm["ptx"], ck.metadata.name))}
    print(json.dumps(out))
""")


def test_sm89_ptx_launcher_passes_every_runtime_parameter_and_no_constexpr():
    """The H200's proxy route (kernels/precompiled/ptx.py) binds the kernel's run-time parameters by
    name: a constexpr with a default (EXP2_FMA) must not be taken for one, in either setting."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", LAUNCHER, str(ROOT)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for name, g in got.items():
        assert "EXP2_FMA" not in g["names"] and "HEAD_DIM" not in g["names"], name
        # Triton 3.8 / 3.9 append two pointers (global and profile scratch) after the kernel's own
        assert g["ptx_params"] == len(g["names"]) + 2, (name, g)
