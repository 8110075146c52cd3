"""Precompiled cubins on a CPU-only machine: the AOT build (sm_90 cubins + manifest, wgmma in the
ExpCast kernel, no float->int conversion in its byte path), the loader's architecture checks, the
dispatcher's refusal reasons, host code and build specs agreeing, and the doctor's CPU report.
Launching a cubin needs a GPU: tests/gpu/test_precompiled.py."""

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from vc_attention.kernels import dispatch, doctor, pipeline, precompiled
from vc_attention.kernels.dispatch import CallSpec, choose_backend
from vc_attention.kernels.precompiled import loader, specs

ROOT = pathlib.Path(__file__).resolve().parents[2]
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # conftest: no CUDA
CUOBJDUMP = None
try:
    import triton

    _bin = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    CUOBJDUMP = _bin if _bin.exists() else shutil.which("cuobjdump")
    # Decorate the kernels now, under conftest's TRITON_INTERPRET=1 (tests below unset it, and
    # dispatch's Triton check imports them; the glue test runs them through the interpreter).
    import vc_attention.kernels.triton.attention  # noqa: F401
    import vc_attention.kernels.triton.kmeans  # noqa: F401
except ImportError:
    triton = None

# The two attention variants compared below (ExpCast on / off), the case the H200 runs by default.
ATTENTION = r"vc_attention_fwd_kernel .*EXPCAST=(True|False) HAS_BIAS=False HAS_MEAN=True HEAD_DIM=128 .*O=bf16"
SMALL = r"kmeans_update_kernel .*HEAD_DIM=64 .*X=bf16"
ASSIGN = r"kmeans_assign_kernel .*HEAD_DIM=128 .*X=bf16"
QUANT = r"quantize_qk_block_kernel .*FP8=False HAS_MEAN=True HAS_PERM=True HEAD_DIM=128 .*X=bf16"

BUILD = """
import importlib.util, sys, pathlib
root = pathlib.Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py", submodule_search_locations=[str(root)])
mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
from vc_attention.kernels.precompiled.build import main
main(sys.argv[2:])
"""


def run_build(*args):
    """The build command in a fresh process (this one runs Triton's interpreter: TRITON_INTERPRET=1)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", BUILD, str(ROOT), *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if triton is None:
        pytest.skip("Triton is not installed: the build needs it (the loader does not)")
    out = tmp_path_factory.mktemp("cubins")
    log = run_build("--arch", "90", "--out", str(out), "--only", ATTENTION, "--keep-ptx")
    log += run_build("--arch", "120", "--out", str(out), "--only", SMALL)
    log += run_build("--arch", "90", "--out", str(out / "prepass_kmeans"), "--only", f"{ASSIGN}|{QUANT}", "--keep-ptx")
    return out, log


def entries(folder, kernel=None):
    manifest = json.loads((folder / "manifest.json").read_text())
    return manifest, [e for e in manifest["kernels"] if kernel is None or e["kernel"] == kernel]


def test_build_writes_cubins_and_manifest(built):
    out, log = built
    assert "sm_90: 2 cubins" in log and "sm_120: 1 cubins" in log
    manifest, kernels = entries(out / "sm_90")
    assert manifest["arch"] == 90 and manifest["triton_version"] == triton.__version__
    assert {e["constexprs"]["EXPCAST"] for e in kernels} == {True, False}
    wanted = {v["key"] for v in specs.variants() if re.search(ATTENTION, v["label"])}
    assert {e["key"] for e in kernels} == wanted
    for e in kernels:
        data = (out / "sm_90" / e["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == e["sha256"]
        assert loader.cubin_arch(data) == 90
        assert e["num_warps"] == pipeline.PORTABLE_NUM_WARPS and e["shared"] > 0 and e["num_ctas"] == 1
        # The ABI: run-time parameters (constexprs and absent pointers removed), then what Triton
        # appended (global + profile scratch pointers in Triton >= 3.5), as read from the PTX entry.
        assert len(e["params"]) + e["extra_params"] == len(e["ptx_params"])
        assert e["extra_params"] >= 0 and all(t == "u64" for t in e["ptx_params"][len(e["params"]):])
        names = [n for n, _ in e["params"]]
        assert "BIAS" not in names and "stride_od" not in names and names[0] == "Q"
        assert e["assume"]["one"] == ["stride_od"]
    _, small = entries(out / "sm_120")
    assert loader.cubin_arch((out / "sm_120" / small[0]["file"]).read_bytes()) == 120


def test_expcast_kernel_uses_wgmma_and_no_float_to_int_conversion(built):
    out, _ = built
    _, kernels = entries(out / "sm_90")
    by = {e["constexprs"]["EXPCAST"]: e for e in kernels}
    ptx = {k: (out / "sm_90" / e["file"].replace(".cubin", ".ptx")).read_text() for k, e in by.items()}
    assert "wgmma.mma_async" in ptx[True]
    # ExpCast makes the P byte by magic-constant rounding: no cvt.rni (float->int) in the kernel.
    assert "cvt.rni" not in ptx[True] and "cvt.rzi.s32.f32" not in ptx[True]
    # exp2 + cast needs one ex2 per score; ExpCast only per row (alpha).
    assert ptx[True].count("ex2.approx") < ptx[False].count("ex2.approx")
    if CUOBJDUMP is None:
        pytest.skip("cuobjdump not found: SASS not checked (PTX checked)")
    sass = subprocess.run([str(CUOBJDUMP), "-sass", str(out / "sm_90" / by[True]["file"])],
                          capture_output=True, text=True, timeout=60).stdout
    assert "QGMMA" in sass and "IGMMA" in sass  # FP8 P V and INT8 Q K^T on Hopper's wgmma
    # The only F2I left is the integer-division idiom of bh // H (F2I.U32.TRUNC), never F2I.S32.
    f2i = re.findall(r"\bF2I[.A-Z0-9]*", sass)
    assert all("U32.TRUNC" in op for op in f2i), f2i


def test_kmeans_assignment_runs_on_the_tensor_cores(built):
    """The assignment's distance dot is 3xTF32 on Hopper's wgmma (pipeline.KMEANS_DOT_PRECISION: 5.7x the
    CUDA-core fp32 dot on the H200), not an fp32 FMA loop."""
    out, _ = built
    _, kernels = entries(out / "prepass_kmeans" / "sm_90", "kmeans_assign_kernel")
    assert len(kernels) == 1
    ptx = (out / "prepass_kmeans" / "sm_90" / kernels[0]["file"].replace(".cubin", ".ptx")).read_text()
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.tf32\.tf32", ptx)
    # three tf32 products (big x big, big x small, small x big) per step of centroids
    assert len(mmas) >= 3, sorted(set(re.findall(r"wgmma\.mma_async[.\w]*", ptx)))


def test_int8_quantiser_converts_no_float_to_int(built):
    """The Q/K quantiser's INT8 codes are the low byte of the rounding FMA's bits (rounding.py::
    int8_codes): no F2I per element (sm_90 SASS; the scale's own division may use one)."""
    out, _ = built
    _, kernels = entries(out / "prepass_kmeans" / "sm_90", "quantize_qk_block_kernel")
    assert len(kernels) == 1
    if CUOBJDUMP is None:
        pytest.skip("cuobjdump not found: SASS not checked")
    sass = subprocess.run([str(CUOBJDUMP), "-sass", str(out / "prepass_kmeans" / "sm_90" / kernels[0]["file"])],
                          capture_output=True, text=True, timeout=60).stdout
    f2i = re.findall(r"\bF2I[.A-Z0-9]*", sass)
    assert len(f2i) <= 2, f2i  # before: 33 (one per element, 32 per thread at 16 warps)


def test_loader_refuses_a_cubin_for_another_arch(built, tmp_path):
    out, _ = built
    # A folder for sm_90 on an sm_100 / sm_120 GPU: refused from the manifest, before any driver call.
    for device_arch in (100, 120, 89):
        with pytest.raises(loader.WrongArchError, match=rf"built for sm_90, this GPU is sm_{device_arch}"):
            loader.CubinKernels(out / "sm_90", device_index=0, device_arch=device_arch)
    # A mislabelled folder (manifest says sm_90, the cubin is sm_120): refused from the ELF header.
    fake = tmp_path / "sm_90"
    shutil.copytree(out / "sm_120", fake)
    manifest = json.loads((fake / "manifest.json").read_text())
    manifest["arch"] = 90
    (fake / "manifest.json").write_text(json.dumps(manifest))
    kernels = loader.CubinKernels(fake, device_index=0, device_arch=90)
    with pytest.raises(loader.WrongArchError, match=r"cubin kmeans_update_kernel-\w+\.cubin was built for sm_120"):
        kernels.read_cubin(manifest["kernels"][0])
    with pytest.raises(loader.PrecompiledError, match="not a cubin"):
        loader.cubin_arch(b"not an ELF file at all, long enough to have a header.....")


@pytest.fixture
def cubin_env(built, monkeypatch):
    out, _ = built
    monkeypatch.setenv("VC_ATTENTION_CUBINS", str(out))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(dispatch, "triton_status", lambda: (True, ""))
    # These tests are about the cubins: on sm_90 the Gluon kernel would come first.
    monkeypatch.setattr(dispatch, "gluon_status", lambda: (False, "no Gluon Hopper kernel (test)"))
    monkeypatch.setattr(precompiled, "_probe", lambda arch, folder, manifest, ptx=False: None)  # loads a cubin: GPU test
    dispatch.precompiled_status.cache_clear()
    precompiled.status.cache_clear()
    yield out
    dispatch.precompiled_status.cache_clear()
    precompiled.status.cache_clear()


def spec_for(capability, **kw):
    fields = dict(device_type="cuda", capability=capability, dtype=torch.bfloat16, head_dim=128, bits=8)
    fields.update(kw)
    return CallSpec(**fields)


def test_dispatch_refuses_precompiled_with_reasons(cubin_env, monkeypatch):
    # No cubin for this arch: the others are named and refused.
    d = choose_backend(spec_for((10, 0)))
    assert d.backend == "triton"
    assert "no cubins for sm_100 (found sm_90, sm_120" in d.reasons["precompiled"]
    assert "precompiled refused: no cubins for sm_100" in str(d)
    # Cubins for this arch but no CUDA driver here (a CPU machine): that is the reason.
    monkeypatch.setattr(loader, "get_driver", lambda which=None: (_ for _ in ()).throw(
        loader.PrecompiledError("the CUDA driver library cannot be loaded (libcuda.so.1: not found)")))
    monkeypatch.setattr(precompiled, "get_driver", loader.get_driver)
    assert "CUDA driver library cannot be loaded" in choose_backend(spec_for((9, 0))).reasons["precompiled"]
    # With a driver: the folder holds only two attention kernels, no pre-pass: refused as incomplete.
    monkeypatch.setattr(precompiled, "get_driver", lambda which=None: object())
    dispatch.precompiled_status.cache_clear()
    precompiled.status.cache_clear()
    d = choose_backend(spec_for((9, 0)))
    assert d.backend == "triton"
    assert "no kernel for head dim 128 with torch.bfloat16" in d.reasons["precompiled"]
    # Constraints the cubins share with the kernel, before any file is read.
    assert "sm_80" in choose_backend(spec_for((8, 0))).reasons["precompiled"]
    assert "head dim 96" in choose_backend(spec_for((9, 0), head_dim=96)).reasons["precompiled"]
    assert "bits=4" in choose_backend(spec_for((9, 0), bits=4)).reasons["precompiled"]
    assert "not a CUDA GPU" in choose_backend(spec_for(None, device_type="cpu")).reasons["precompiled"]


def test_dispatch_takes_precompiled_first_when_complete(cubin_env, monkeypatch):
    """With no Gluon kernel (cubin_env refuses it), complete cubins come before the JIT path."""
    monkeypatch.setattr(precompiled, "get_driver", lambda which=None: object())
    monkeypatch.setattr(precompiled, "complete_configs", lambda manifest, roles, ptx=False: frozenset({(128, "bf16")}))
    d = choose_backend(spec_for((9, 0)))
    assert d.backend == "precompiled" and d.low_bit and d.expcast and list(d.reasons) == ["gluon", "mma"]
    assert str(d).startswith("VC-Attention backend: precompiled (8-bit, P by ExpCast)")
    assert choose_backend(spec_for((9, 0), dtype=torch.float16)).backend == "triton"


class Recorder:
    """A launcher that records what the host code launches (buffers stay uninitialised)."""

    def __init__(self):
        self.calls = []

    def __call__(self, kernel, grid, args, constexprs, num_warps, num_stages=None):
        self.calls.append((kernel, grid, args, constexprs, num_warps, num_stages))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v_smooth,bias,expcast,layout", [(True, False, True, "HND"), (False, True, False, "NHD")])
def test_host_code_launches_only_built_variants(dtype, v_smooth, bias, expcast, layout, monkeypatch):
    """Every launch of the pipeline maps to a variant build.py compiles, with its assumptions met."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as on a GPU: no software rounding
    B, H, N, D = 1, 2, 200, 64
    shape = (B, H, N, D) if layout == "HND" else (B, N, H, D)
    q, k, v = (torch.randn(shape, dtype=dtype) for _ in range(3))
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.empty(B, H, N, D, dtype=dtype)
    perm = torch.stack([torch.randperm(N) for _ in range(B * H)]).reshape(B, H, N) if v_smooth else None
    key_bias = torch.zeros(B, 1, 1, N) if bias else None
    rec = Recorder()
    pipeline.vc_attention_8bit(rec, q, k, v, out, v_smooth=v_smooth, expcast=expcast, perm=perm, key_bias=key_bias)
    pipeline.kmeans(rec, v, torch.randn(B * H, 4, D), iters=1)
    known = {v["key"] for v in specs.variants()}
    assert [c[0] for c in rec.calls][:5] == ["quantize_qk_block_kernel", "quantize_qk_block_kernel",
                                            "v_block_stats_kernel", "v_scale_kernel", "v_quantize_kernel"]
    _assert_built(rec.calls, known)


def _assert_built(calls, known, arch=None):
    """Every recorded launch is a variant of `known` (variant keys), with the cubins' assumptions on its
    arguments met (unit and 16-divisible strides)."""
    for kernel, grid, args, constexprs, num_warps, num_stages in calls:
        pointers = {n: (None if a is None else specs.TORCH_TO_TRITON[str(a.dtype)[6:]])
                    for n, a in args.items() if a is None or isinstance(a, torch.Tensor)}
        assert set(pointers) == set(specs.KERNELS[kernel]["pointers"])
        assert specs.variant_key(kernel, pointers, constexprs, num_warps, num_stages) in known, (arch, kernel,
                                                                                               constexprs)
        rules = specs.KERNELS[kernel]
        assert all(args[n] == 1 for n in rules["one"]) and all(args[n] % 16 == 0 for n in rules["div16"])


def _launches(host, dtype, v_smooth, bias, expcast, layout, pv_int8=False):
    """What a host code launches for one call, tensors described by dtype / shape / strides."""
    B, H, N, D = 1, 2, 200, 64
    g = torch.Generator().manual_seed(0)
    shape = (B, H, N, D) if layout == "HND" else (B, N, H, D)
    q, k, v = (torch.randn(shape, dtype=dtype, generator=g) for _ in range(3))
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.empty(B, H, N, D, dtype=dtype)
    perm = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).reshape(B, H, N) if v_smooth else None
    key_bias = torch.zeros(B, 1, 1, N) if bias else None
    rec = Recorder()
    host(rec, q, k, v, out, v_smooth=v_smooth, expcast=expcast, perm=perm, key_bias=key_bias,
         **({"pv_int8": True} if pv_int8 else {}))

    def describe(a):
        return ("tensor", a.dtype, tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a

    return rec.calls, [(kernel, tuple(grid), {n: describe(a) for n, a in args.items()}, constexprs, w, st)
                       for kernel, grid, args, constexprs, w, st in rec.calls]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v_smooth,bias,expcast,layout,pv_int8", [(True, False, False, "HND", False),
                                                                   (False, True, True, "NHD", False),
                                                                   (True, True, False, "NHD", True)])
def test_mma_host_code_mirrors_the_mma_record(dtype, v_smooth, bias, expcast, layout, pv_int8, monkeypatch):
    """The precompiled path's entry (pipeline_mma.py, Triton-free) launches what the mma record's launches: the
    same kernels, grids, arguments, constexprs, warps and stages; each a variant built for sm_89 /
    sm_120, with the cubins' assumptions met; its INT8 P.V path (pv_int8) as well."""
    if triton is None:
        pytest.skip("Triton is not installed: the mma record's host code imports it")
    from vc_attention.kernels import pipeline_mma as mma_host
    from vc_attention.kernels.triton import attention_mma as am

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as on a GPU: no software rounding
    assert (mma_host.MMA_BLOCK_M, mma_host.MMA_BLOCK_N, mma_host.MMA_RUN_TILES, mma_host.MMA_NUM_WARPS,
            mma_host.MMA_NUM_STAGES) == (am.MMA_BLOCK_M, am.MMA_BLOCK_N, am.MMA_RUN_TILES, am.MMA_NUM_WARPS,
                                         am.MMA_NUM_STAGES)

    def jit_host(rec, q, k, v, out, **kw):
        am.mma_vc_attention(q, k, v, out, launch=rec, **kw)

    calls, want = _launches(jit_host, dtype, v_smooth, bias, expcast, layout, pv_int8)
    _, got = _launches(mma_host.mma_vc_attention, dtype, v_smooth, bias, expcast, layout, pv_int8)
    assert got == want
    assert calls[-1][0] == "vc_attention_mma_fwd_kernel"
    for arch in specs.RECORD_ARCHS["mma"]:
        known = {v["key"] for v in specs.variants(arch)}
        _assert_built(calls, known, arch)


SAME_SPECIALISATION = """
import importlib.util, sys, pathlib
root = pathlib.Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py", submodule_search_locations=[str(root)])
mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
import triton
from vc_attention.kernels.precompiled import build, specs
from vc_attention.kernels.triton import attention_mma as am
seen = []
def fake_compile(src, target, options):
    seen.append((src.signature, src.constants, src.attrs, options["num_warps"], options["num_stages"], target.arch))
    raise StopIteration  # only what would be compiled is compared
triton.compile = fake_compile
for v in specs.variants(89):
    if v["kernel"] != "vc_attention_mma_fwd_kernel":
        continue
    c = v["constexprs"]
    for call in (lambda: build.compile_variant(am.vc_attention_mma_fwd_kernel, v, 89),
                 lambda: am.compile_mma_attention(89, head_dim=c["HEAD_DIM"], v_smooth=c["HAS_MEAN"],
                                                  has_bias=c["HAS_BIAS"], expcast=c["EXPCAST"],
                                                  out_dtype=v["pointers"]["O"], pv_int8=c.get("PV_INT8", False))):
        try:
            call()
        except StopIteration:
            pass
    a, b = seen[-2:]
    assert a == b, (v["label"], a, b)
print("COMPARED", len(seen) // 2)
"""


def test_mma_variants_build_as_compile_mma_attention_does():
    """The build specialises the mma.sync kernel as compile_mma_attention does (the sm_89 PTX that the
    H200 checks run): the same signature, constexprs, divisibility hints, warps and stages, for every
    variant (in a fresh process: this one runs Triton's interpreter)."""
    if triton is None:
        pytest.skip("Triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", SAME_SPECIALISATION, str(ROOT)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "COMPARED 72" in done.stdout, done.stdout  # 48 E4M3 P.V builds, 24 INT8 P.V ones


def test_doctor_on_a_cpu_only_machine(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = doctor.run()
    assert report["gpu"] is None and report["arch"] is None and not report["cuda_available"]
    assert report["torch"] == torch.__version__
    b = report["backends"]
    assert list(b) == ["gluon", "mma", "precompiled", "triton", "reference", "sdpa"]
    assert not b["gluon"]["available"] and "not a CUDA GPU" in b["gluon"]["reason"]
    assert not b["mma"]["available"] and "not a CUDA GPU" in b["mma"]["reason"]
    assert not b["precompiled"]["available"] and "not a CUDA GPU" in b["precompiled"]["reason"]
    assert not b["triton"]["available"] and "not a CUDA GPU" in b["triton"]["reason"]
    assert b["reference"]["available"] and b["sdpa"]["available"]
    assert report["auto"] == "sdpa"
    st = report["self_test"]
    assert st["passed"] and st["ran"] == ["reference"] and "no CUDA GPU" in st["note"]
    assert st["seconds"] < 10
    text = doctor.format_report(report)
    assert "GPU           none" in text and "CPU only" in text and "-> auto runs: sdpa" in text
    assert "precompiled  refused: tensors are on cpu" in text and "Self-test" in text
    assert "reference    available ('auto' skips it: the readable reference is slow" in text
    # Under Triton's interpreter the Triton path is available on the CPU, and "auto" takes it.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    report = doctor.run(with_self_test=False)
    assert report["backends"]["triton"]["available"] and report["auto"] == "triton"
    assert "TRITON_INTERPRET=1" in doctor.format_report(report)


def test_doctor_command_line(monkeypatch):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    code = ("import importlib.util, sys, pathlib; root = pathlib.Path(sys.argv[1]); "
            "spec = importlib.util.spec_from_file_location('vc_attention', root / '__init__.py', "
            "submodule_search_locations=[str(root)]); m = importlib.util.module_from_spec(spec); "
            "sys.modules['vc_attention'] = m; spec.loader.exec_module(m); "
            "from vc_attention.kernels.doctor import main; sys.exit(main(['--json', '--no-self-test']))")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["auto"] == "sdpa" and report["gpu"] is None


def test_precompiled_host_glue_matches_the_triton_path(monkeypatch):
    """precompiled_vc_attention / precompiled_kmeans = the shared host code on another launcher:
    with Triton's interpreter as that launcher, the results equal the Triton path's exactly, for
    inputs that need the contiguous copy (NHD views, a sliced head dim) too."""
    if triton is None or not INTERPRETED:
        pytest.skip("needs Triton's interpreter (set by conftest where there is no GPU)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from vc_attention.kernels.triton.attention import triton_vc_attention
    from vc_attention.kernels.triton.kmeans import kmeans_triton
    from vc_attention.kernels.triton.launch import triton_launch

    monkeypatch.setattr(precompiled, "kernels_for_device", lambda device: AsCubins(triton_launch, "vc_attention_fwd_kernel"))
    g = torch.Generator().manual_seed(0)
    B, N, H, D = 1, 130, 2, 64
    q, k, v = (torch.randn(B, N, H, D + 8, generator=g)[..., :D].transpose(1, 2) for _ in range(3))
    assert precompiled._ready(q) is not q and precompiled._ready(q).is_contiguous()
    perm = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).reshape(B, H, N)
    bias = torch.zeros(B, 1, 1, N)
    bias[..., -9:] = float("-inf")
    got, want = torch.empty(B, H, N, D), torch.empty(B, H, N, D)
    precompiled.precompiled_vc_attention(q, k, v, got, perm=perm, key_bias=bias)
    triton_vc_attention(q, k, v, want, perm=perm, key_bias=bias)
    assert torch.equal(got, want) and not torch.isnan(got).any()
    init = torch.randn(B * H, 4, D, generator=g)
    for a, b in zip(precompiled.precompiled_kmeans(v, init, 1), kmeans_triton(v, init, 1)):
        assert torch.equal(a, b)
    # sm_89 / sm_120 cubins carry the mma.sync kernel: its host code (pipeline_mma.py), the mma record's bits.
    from vc_attention.kernels.triton.attention_mma import mma_launch, mma_vc_attention

    monkeypatch.setattr(precompiled, "kernels_for_device", lambda device: AsCubins(mma_launch, "vc_attention_mma_fwd_kernel"))
    got, want = torch.empty(B, H, N, D), torch.empty(B, H, N, D)
    precompiled.precompiled_vc_attention(q, k, v, got, perm=perm, key_bias=bias, expcast=False)
    mma_vc_attention(q, k, v, want, perm=perm, key_bias=bias, expcast=False)
    assert torch.equal(got, want) and not torch.isnan(got).any()


class AsCubins:
    """A JIT launcher standing in for CubinKernels: it says which attention kernel it carries."""

    def __init__(self, launch, attention_kernel):
        self.launch, self.attention_kernel = launch, attention_kernel

    def __call__(self, *args, **kwargs):
        return self.launch(*args, **kwargs)
