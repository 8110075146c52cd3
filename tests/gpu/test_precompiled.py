"""On the GPU (marked `gpu`; skipped without a CUDA GPU): the precompiled cubins against the Triton JIT.

The cubins are built on the spot by this machine's Triton for this GPU's architecture (about 21
variants: head dim 128, bf16; `--jobs 8`), so cubin and JIT come from the same compiler and must
agree bit for bit: pre-pass codes and scales, attention output, k-means labels and centroids, on
both driver paths (cuda-bindings and ctypes), on a side stream too. VC_ATTENTION_TEST_CUBINS=DIR
uses cubins built ahead of time instead (DIR/sm_<arch>/manifest.json; then, from another Triton
version, only the error bound of the kernel is promised, and the bit-for-bit tests say so).

Also: a cubin for another architecture is refused with a clear message (by the manifest, by the
cubin's ELF header before the driver sees it, and by the dispatcher); "auto" picks the cubins
first; the whole path runs in a process where `import triton` fails; a GPU without cubins of its own
runs the sm_89 PTX; the doctor's GPU report.

    python -m pytest tests/gpu/test_precompiled.py -m gpu -v -s

VC_ATTENTION_TEST_INSTALLED=1: the installed wheel, Triton blocked. vc_attention is imported from
site-packages (never this checkout: run this file from a copy outside it, so that no conftest
registers the checkout), `import triton` fails in this process and in its children, the cubins are
the wheel's own, and where a test would compare with the JIT it compares with the readable reference
at the doctor's self-test bound instead (cubins of one Triton, bits of another are not promised).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

INSTALLED = os.environ.get("VC_ATTENTION_TEST_INSTALLED") == "1"
if INSTALLED:
    sys.modules["triton"] = None  # `import triton` fails, as where it is not installed

import torch  # noqa: E402

from vc_attention.kernels import dispatch, explain_backend, pipeline, precompiled, vc_attention  # noqa: E402
from vc_attention.kernels.precompiled import loader, specs  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK_TRITON = 'sys.modules["triton"] = None\n'
BOUND = 2e-3  # rel. L2 against the reference rounded to bf16 (kernels/doctor.py SELF_TEST_BOUND)
# Every kernel of the 8-bit path for head dim 128, bf16: those with a bf16 tensor, and v_scale_kernel,
# whose operands are the pre-pass's own fp32 / int8 whatever V's dtype (the fixture checks that no
# kernel of specs is missing).
SELECT = r"HEAD_DIM=128 .*(O|V|X)=bf16|^v_scale_kernel .*HEAD_DIM=128 "

REGISTER = """
import importlib.util, sys, pathlib
root = pathlib.Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py", submodule_search_locations=[str(root)])
mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
"""
if INSTALLED:  # the installed package, Triton blocked in the child too
    REGISTER = "import sys\n" + BLOCK_TRITON


def run_python(code, *args, env=None, timeout=600):
    env = dict(os.environ if env is None else env)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", REGISTER + code, str(ROOT), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])
    return done.stdout


def build(out, arch, only, jobs=8):
    code = "from vc_attention.kernels.precompiled.build import main; main(sys.argv[2:])"
    return run_python(code, "--arch", str(arch), "--out", str(out), "--only", only, "--jobs", str(jobs))


def device_arch():
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def test_installed_package_is_the_one_under_test():
    if not INSTALLED:
        pytest.skip("VC_ATTENTION_TEST_INSTALLED is not set: the checkout is under test")
    import vc_attention
    from vc_attention.kernels.precompiled import verify

    where = pathlib.Path(vc_attention.__file__).resolve()
    assert "site-packages" in where.parts or "dist-packages" in where.parts, where
    assert dispatch.triton_status()[0] is False and sys.modules.get("triton") is None
    summaries, problems = verify.verify()  # every architecture the wheel claims, complete
    assert problems == [], problems
    print("\n".join(f"sm_{s['arch']}: {s['cubins']} cubins, Triton {s['triton']}, PTX ISA {s['ptx_isa']}"
                    for s in summaries))


def reference(q, k, v, *, v_smooth=True, expcast, perm=None, key_bias=None):
    """The readable twin of the kernel this GPU's cubins carry, rounded to q's dtype."""
    if specs.attention_kernel(device_arch()) == "vc_attention_mma_fwd_kernel":
        from vc_attention.kernels.reference.workstation import workstation_vc_attention

        return workstation_vc_attention(q, k, v, v_smooth=v_smooth, expcast=expcast, perm=perm, key_bias=key_bias,
                                        fp16_round_keys=32, dtype=torch.float64).to(q.dtype)
    from vc_attention.kernels.reference import reference_vc_attention

    return reference_vc_attention(q, k, v, bits=8, v_smooth=v_smooth, expcast=expcast, perm=perm,
                                  key_bias=key_bias, block_n=128, dtype=torch.float64).to(q.dtype)


def forget_cubin_lookups():
    """Drop the cached answers about which cubins are installed (a test changes the folders)."""
    dispatch.precompiled_status.cache_clear()
    dispatch.cubins_kernel.cache_clear()
    precompiled.status.cache_clear()


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    """(root folder, same_triton): root/sm_<arch>/ for this GPU."""
    if not INSTALLED:
        import triton

    arch = device_arch()
    prebuilt = os.environ.get("VC_ATTENTION_TEST_CUBINS")
    if INSTALLED:  # the wheel's own cubins, no Triton to compare with
        root = precompiled.PACKAGE_CUBINS
        assert (root / f"sm_{arch}" / "manifest.json").is_file(), f"the wheel has no sm_{arch} cubins"
        return root, False
    if prebuilt:
        root = pathlib.Path(prebuilt)
        if not (root / f"sm_{arch}" / "manifest.json").is_file():
            pytest.fail(f"VC_ATTENTION_TEST_CUBINS={prebuilt} has no sm_{arch}/manifest.json")
    else:
        root = tmp_path_factory.mktemp("cubins")
        t0 = time.time()
        print(build(root, arch, SELECT), f"(built in {time.time() - t0:.0f} s)")
    manifest = json.loads((root / f"sm_{arch}" / "manifest.json").read_text())
    built = {e["kernel"] for e in manifest["kernels"]}
    missing = {k for k in specs.KERNELS if arch in specs.kernel_archs(k)} - built
    assert not missing, f"{root}: no cubin for {sorted(missing)} (SELECT above misses them?)"
    return root, manifest["triton_version"] == triton.__version__


@pytest.fixture
def use_cubins(cubins, monkeypatch):
    root, _ = cubins
    monkeypatch.setenv("VC_ATTENTION_CUBINS", str(root))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    forget_cubin_lookups()
    yield root
    forget_cubin_lookups()


def drivers():
    out = ["ctypes"]
    try:
        import cuda.bindings.driver  # noqa: F401

        out.insert(0, "cuda-bindings")
    except ImportError:
        pass
    return out


def launcher(root, driver):
    idx = torch.cuda.current_device()
    return loader.CubinKernels(root / f"sm_{device_arch()}", idx, device_arch(), driver=loader.get_driver(driver))


def inputs(N, H=5, D=128, seed=0, bias=False, perm=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, H, N, D, device="cuda", generator=g).to(torch.bfloat16)
    k = (torch.randn(1, H, N, D, device="cuda", generator=g) + 0.3).to(torch.bfloat16)
    v = torch.randn(1, H, N, D, device="cuda", generator=g) + 0.5
    v[:, :, ::97] *= 8.0
    v = v.to(torch.bfloat16)
    key_bias = None
    if bias:
        key_bias = torch.zeros(1, 1, 1, N, device="cuda")
        key_bias[..., -N // 7:] = float("-inf")  # padded text tokens
    p = torch.stack([torch.randperm(N, device="cuda", generator=g) for _ in range(H)])[None] if perm else None
    return q, k, v, key_bias, p


def run_8bit(L, q, k, v, out, **kw):
    """The 8-bit pipeline on launcher L: the mma.sync host code where L carries that kernel (sm_89 /
    sm_120 cubins, the JIT's mma launcher), the portable one otherwise."""
    if getattr(L, "attention_kernel", None) == "vc_attention_mma_fwd_kernel" or getattr(L, "mma", False):
        from vc_attention.kernels.pipeline_mma import mma_vc_attention

        return mma_vc_attention(L, q, k, v, out, **kw)
    return pipeline.vc_attention_8bit(L, q, k, v, out, **kw)


def jit_launcher():
    """The JIT launcher of the kernel the cubins of this GPU carry."""
    if specs.attention_kernel(device_arch()) == "vc_attention_mma_fwd_kernel":
        from vc_attention.kernels.triton.attention_mma import mma_launch

        def launch(*args, **kwargs):
            return mma_launch(*args, **kwargs)

        launch.mma = True
        return launch
    from vc_attention.kernels.triton.launch import triton_launch

    return triton_launch


def same_bits(a, b):
    if a.dtype.is_floating_point and a.element_size() == 2:
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    if a.dtype == torch.float8_e4m3fn:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("driver", drivers())
@pytest.mark.parametrize("N", [1000, 4096])
@pytest.mark.parametrize("v_smooth,expcast,bias", [(True, True, False), (True, False, True), (False, True, True),
                                                   (False, False, False)])
def test_cubins_match_the_jit_bit_for_bit(cubins, driver, N, v_smooth, expcast, bias):
    root, same_triton = cubins
    cubin = launcher(root, driver)
    q, k, v, key_bias, perm = inputs(N, bias=bias, perm=v_smooth)
    if INSTALLED:  # no JIT here: the readable reference, at the doctor's bound
        out = torch.empty_like(q)
        run_8bit(cubin, q, k, v, out, v_smooth=v_smooth, expcast=expcast, perm=perm, key_bias=key_bias)
        want = reference(q, k, v, v_smooth=v_smooth, expcast=expcast, perm=perm, key_bias=key_bias)
        torch.cuda.synchronize()
        assert torch.isnan(out).equal(torch.isnan(want)), "NaN where the reference has none, or the reverse"
        ok = ~torch.isnan(want)
        err = rel_l2(out[ok], want[ok])
        assert err < BOUND, err
        return
    triton_launch = jit_launcher()
    perm_flat = None if perm is None else perm.reshape(-1, N).contiguous()
    # Pre-pass, stage by stage (the diagnosis when the end result differs).
    for name, run in (("q", lambda L: pipeline.quantize_qk_blocks(L, q)),
                      ("k", lambda L: pipeline.quantize_qk_blocks(
                          L, k, perm_flat, pipeline.smoothing_mean(k).reshape(-1, 128).contiguous())),
                      ("v", lambda L: tuple(x for x in pipeline.quantize_v_residual(L, v, perm_flat, v_smooth).values()
                                            if isinstance(x, torch.Tensor)))):  # (not the flag pv_perm)
        got, want = run(cubin), run(triton_launch)
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(got, want)):
            if same_triton:
                assert same_bits(a, b), f"pre-pass {name}[{i}] differs from the JIT"
    outs = {}
    for name, L in (("cubin", cubin), ("jit", triton_launch)):
        out = torch.empty_like(q)
        run_8bit(L, q, k, v, out, v_smooth=v_smooth, expcast=expcast, perm=perm, key_bias=key_bias)
        outs[name] = out
    torch.cuda.synchronize()
    assert not torch.isnan(outs["cubin"]).any()
    if same_triton:
        assert same_bits(outs["cubin"], outs["jit"]), (
            f"max |diff| {(outs['cubin'].float() - outs['jit'].float()).abs().max().item()}")
    else:  # cubins from another Triton: the kernel's own error bound against the JIT
        err = ((outs["cubin"].double() - outs["jit"].double()).norm() / outs["jit"].double().norm()).item()
        assert err < 2e-3, err


def test_cubins_run_on_the_current_stream(cubins):
    root, same_triton = cubins
    q, k, v, _, perm = inputs(2048, perm=True)
    want = torch.empty_like(q)
    # Installed: the same cubins on the default stream are the reference (bit for bit).
    run_8bit(launcher(root, drivers()[0]) if INSTALLED else jit_launcher(), q, k, v, want, perm=perm)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = torch.empty_like(q)
        run_8bit(launcher(root, drivers()[0]), q, k, v, got, perm=perm)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if same_triton or INSTALLED:
        assert same_bits(got, want)


def test_kmeans_cubins_match_the_jit(cubins):
    root, same_triton = cubins
    _, _, v, _, _ = inputs(3000)
    init = v.reshape(5, 3000, 128)[:, :: 3000 // 16][:, :16].float().contiguous()
    if INSTALLED:  # no JIT: one Lloyd iteration against its definition, in float64
        L = launcher(root, drivers()[0])
        x = v.reshape(5, 3000, 128).double()

        def check_nearest(labels, cents):
            d = torch.cdist(x, cents.double())
            best = d.min(-1)
            got_d = d.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
            assert ((got_d - best.values) <= 1e-3 * best.values.clamp_min(1)).all()  # the nearest, ties aside
            assert (labels == best.indices).float().mean() > 0.99

        first = pipeline.kmeans_assign(L, v, init)
        labels, cents, _ = pipeline.kmeans(L, v, init, iters=1)  # assign, update, assign again
        torch.cuda.synchronize()
        check_nearest(first, init)
        for bh in range(5):  # each centroid the mean of its members
            for c in first[bh].unique():
                torch.testing.assert_close(cents[bh, c].double(), x[bh][first[bh] == c].mean(0), rtol=1e-4, atol=1e-4)
        check_nearest(labels, cents)
        return
    from vc_attention.kernels.triton.kmeans import kmeans_triton

    got = pipeline.kmeans(launcher(root, drivers()[0]), v, init, iters=3)
    want = kmeans_triton(v, init, 3)
    torch.cuda.synchronize()
    if same_triton:
        for a, b in zip(got, want):
            assert same_bits(a, b)


def test_auto_runs_the_cubins_first(use_cubins, monkeypatch):
    # On Hopper the Gluon kernel comes first (test_doctor_on_this_gpu checks that); this test is
    # about the cubins against the JIT, so the Gluon kernel is refused here.
    monkeypatch.setattr(dispatch, "gluon_status", lambda: (False, "refused by the test"))
    q, k, v, key_bias, _ = inputs(1500, bias=True)
    decision = explain_backend(q, k, v, key_bias=key_bias)
    # Before the cubins come the Gluon kernel (refused here) and the mma.sync kernel (not for sm_90).
    assert decision.backend == "precompiled" and list(decision.reasons) == ["gluon", "mma"], str(decision)
    from vc_attention.kernels import plan_v_smooth

    plan = plan_v_smooth(v, num_clusters=16, iters=3)  # k-means on the cubins too
    got = vc_attention(q, k, v, plan=plan, key_bias=key_bias, pv_format="fp8")
    if INSTALLED:  # no JIT: the reference, at the doctor's bound; the wheel has every dtype
        want = vc_attention(q, k, v, plan=plan, key_bias=key_bias, backend="reference")
        torch.cuda.synchronize()
        assert rel_l2(got, want) < BOUND
        assert explain_backend(q.half(), k.half(), v.half()).backend == "precompiled"
        return
    want = vc_attention(q, k, v, plan=plan, key_bias=key_bias, backend="triton")
    torch.cuda.synchronize()
    assert same_bits(got, want)
    # Unsupported here: fp16 was not built in this folder -> the reason, then the JIT.
    d = explain_backend(q.half(), k.half(), v.half())
    assert d.backend == "triton" and "no kernel for head dim 128 with torch.float16" in d.reasons["precompiled"]


def test_cubin_for_another_arch_is_refused(cubins, tmp_path, monkeypatch):
    root, _ = cubins
    arch = device_arch()
    other = 120 if arch != 120 else 90
    if INSTALLED:  # the wheel's folder for the other architecture
        shutil.copytree(precompiled.PACKAGE_CUBINS / f"sm_{other}", tmp_path / "other" / f"sm_{other}")
    else:
        build(tmp_path / "other", other, r"kmeans_update_kernel .*HEAD_DIM=128 .*X=bf16", jobs=1)
    folder = tmp_path / "other" / f"sm_{other}"
    idx = torch.cuda.current_device()
    # 1. The manifest's architecture.
    with pytest.raises(loader.WrongArchError, match=rf"built for sm_{other}, this GPU is sm_{arch}") as e:
        loader.CubinKernels(folder, idx, arch)
    assert f"--arch {arch}" in str(e.value)  # says how to get the right ones
    # 2. The cubin's own ELF header, before the driver sees it (a folder mislabelled as this arch).
    fake = tmp_path / "fake" / f"sm_{arch}"
    shutil.copytree(folder, fake)
    manifest = json.loads((fake / "manifest.json").read_text())
    manifest["arch"] = arch
    (fake / "manifest.json").write_text(json.dumps(manifest))
    kernels = loader.CubinKernels(fake, idx, arch)
    with pytest.raises(loader.WrongArchError, match=rf"was built for sm_{other}, this GPU is sm_{arch}"):
        kernels.function(manifest["kernels"][0])
    # 3. The driver itself refuses it too (what the checks above turn into a clear message).
    data = (folder / manifest["kernels"][0]["file"]).read_bytes()
    drv = loader.get_driver()
    drv.ensure_context(idx)
    with pytest.raises(loader.PrecompiledError):
        drv.load(data, manifest["kernels"][0]["name"])
    # 4. The dispatcher: only other-arch cubins installed -> refused with the reason, JIT runs.
    monkeypatch.setattr(dispatch, "gluon_status", lambda: (False, "refused by the test"))
    monkeypatch.setenv("VC_ATTENTION_CUBINS", str(tmp_path / "other"))
    monkeypatch.setattr(precompiled, "PACKAGE_CUBINS", tmp_path / "none")
    forget_cubin_lookups()
    q = torch.zeros(1, 1, 256, 128, device="cuda", dtype=torch.bfloat16)
    d = explain_backend(q, q, q)
    forget_cubin_lookups()
    assert d.backend == ("sdpa" if INSTALLED else "triton")  # installed: no Triton, so SDPA
    assert f"no cubins for sm_{arch} (found sm_{other}; a cubin runs only on the architecture" in d.reasons["precompiled"]


def test_runs_without_triton(cubins, tmp_path):
    """A process where `import triton` fails: dispatch says why, the cubins run, same bits as the JIT
    (installed: within the bound of the reference)."""
    root, same_triton = cubins
    q, k, v, key_bias, _ = inputs(1200, bias=True)
    expcast = dispatch.expcast_default(dispatch.CallSpec.from_tensors(q, bits=8))
    if INSTALLED:
        want = reference(q, k, v, expcast=expcast, key_bias=key_bias)
    else:
        want = torch.empty_like(q)
        run_8bit(jit_launcher(), q, k, v, want, key_bias=key_bias, expcast=expcast)
    torch.save({"q": q.cpu(), "k": k.cpu(), "v": v.cpu(), "bias": key_bias.cpu()}, tmp_path / "in.pt")
    code = """
sys.modules["triton"] = None  # import triton -> ImportError, as with a missing or broken install
import torch
from vc_attention.kernels import explain_backend, vc_attention
t = {n: x.cuda() for n, x in torch.load(sys.argv[2]).items()}
d = explain_backend(t["q"], t["k"], t["v"], key_bias=t["bias"], pv_format="fp8")
assert d.backend == "precompiled", str(d)
out = vc_attention(t["q"], t["k"], t["v"], key_bias=t["bias"], v_smooth=True, pv_format="fp8")
torch.cuda.synchronize()
torch.save(out.cpu(), sys.argv[3])
print(d)
print("TRITON_LOADED", any(m.startswith("triton.") for m in sys.modules))
"""
    env = dict(os.environ, VC_ATTENTION_CUBINS=str(root))
    log = run_python(code, str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), env=env)
    assert "TRITON_LOADED False" in log, log
    got = torch.load(tmp_path / "out.pt").cuda()
    if INSTALLED:
        assert rel_l2(got, want) < BOUND
    elif same_triton:
        assert same_bits(got, want)


def test_ptx_fallback_on_a_gpu_without_its_own_cubins(cubins, tmp_path, monkeypatch, caplog):
    """Only the sm_89 folder (its PTX) installed: a newer GPU runs it, JIT-compiled by the driver, and
    says so; the result within the reference's bound."""
    arch = device_arch()
    if arch <= 89:
        pytest.skip(f"sm_{arch}: the sm_89 PTX is the fallback for newer GPUs only")
    only89 = tmp_path / "only89"
    if INSTALLED:
        shutil.copytree(precompiled.PACKAGE_CUBINS / "sm_89", only89 / "sm_89")
    else:
        build(only89, 89, SELECT)
    monkeypatch.setattr(dispatch, "gluon_status", lambda: (False, "refused by the test"))
    monkeypatch.setenv("VC_ATTENTION_CUBINS", str(only89))
    monkeypatch.setattr(precompiled, "PACKAGE_CUBINS", tmp_path / "none")
    forget_cubin_lookups()
    try:
        q, k, v, key_bias, _ = inputs(1500, bias=True)
        d = explain_backend(q, k, v, key_bias=key_bias, pv_format="fp8")
        assert d.backend == "precompiled", str(d)
        with caplog.at_level("WARNING", logger="vc_attention"):
            got = vc_attention(q, k, v, key_bias=key_bias, pv_format="fp8")
        d8 = explain_backend(q, k, v, key_bias=key_bias)  # the default: the mma.sync kernel's INT8 P.V path
        assert d8.backend == "precompiled" and d8.pv_int8, str(d8)
        got8 = vc_attention(q, k, v, key_bias=key_bias)  # the INT8 P.V cubins' PTX
        torch.cuda.synchronize()
    finally:
        forget_cubin_lookups()
    note = precompiled.fallback_note(arch)
    assert f"no cubins for sm_{arch}, so the sm_89 PTX runs" in note
    assert note in caplog.text or note in precompiled._noted
    # The mma.sync kernel's twin (V codes to 1.75, FP16 runs) and its bound (tests/gpu/test_mma_gpu.py).
    from vc_attention.kernels.reference.workstation import workstation_vc_attention

    want = workstation_vc_attention(q, k, v, expcast=d.expcast, key_bias=key_bias, fp16_round_keys=32,
                                    dtype=torch.float64).to(q.dtype)
    err = rel_l2(got, want)
    print(f"sm_89 PTX on sm_{arch}: rel. L2 {err:.2e} against the reference")
    assert err < 5e-3, err
    want8 = workstation_vc_attention(q, k, v, key_bias=key_bias, pv_accumulation="int8", dtype=torch.float64)
    err8 = rel_l2(got8, want8.to(q.dtype))
    print(f"sm_89 PTX on sm_{arch}, INT8 P.V: rel. L2 {err8:.2e} against the reference")
    assert err8 < 5e-3, err8


def test_doctor_on_this_gpu(use_cubins):
    from vc_attention.kernels import doctor

    report = doctor.run(budget_s=300)  # every available path, first-call compiles included
    print(doctor.format_report(report))
    assert report["gpu"] and report["arch"] == f"sm_{device_arch()}"
    assert report["backends"]["precompiled"]["available"], report["backends"]["precompiled"]
    hopper_gluon = device_arch() == 90 and dispatch.gluon_status()[0]
    assert report["auto"] == ("gluon" if hopper_gluon else "precompiled")
    st = report["self_test"]
    assert st["passed"], st
    if hopper_gluon:
        assert st["results"]["gluon vs reference"] < st["bound"]
    assert st["results"]["precompiled vs reference"] < st["bound"]
    twin = precompiled.jit_twin(device_arch())
    if not INSTALLED:  # with Triton: the cubins against the JIT of the same kernel
        assert st["results"][f"precompiled == {twin} (bit-for-bit)"] is True
    cubin_line = doctor._cubin_line(f"sm_{device_arch()}", report["cubin_archs"][f"sm_{device_arch()}"])
    assert cubin_line in doctor.format_report(report)
    # The first run's time includes the JIT paths' compiles (the Gluon kernel alone takes ~10 s on
    # a cold Triton cache), so it depends on which tests ran before; a second run is what a user's
    # next doctor call costs.
    again = doctor.run(budget_s=300)["self_test"]
    assert again["passed"] and again["seconds"] < 10, again
