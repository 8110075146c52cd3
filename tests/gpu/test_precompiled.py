"""On the GPU (marked `gpu`; skipped without a CUDA GPU): the precompiled cubins against the Triton JIT.

The cubins are built on the spot by this machine's Triton for this GPU's architecture (about 21
variants: head dim 128, bf16; `--jobs 8`), so cubin and JIT come from the same compiler and must
agree bit for bit: pre-pass codes and scales, attention output, k-means labels and centroids, on
both driver paths (cuda-bindings and ctypes), on a side stream too. VC_ATTENTION_TEST_CUBINS=DIR
uses cubins built ahead of time instead (DIR/sm_<arch>/manifest.json; then, from another Triton
version, only the error bound of the kernel is promised, and the bit-for-bit tests say so).

Also: a cubin for another architecture is refused with a clear message (by the manifest, by the
cubin's ELF header before the driver sees it, and by the dispatcher); "auto" picks the cubins
first; the whole path runs in a process where `import triton` fails; the doctor's GPU report.

    python -m pytest tests/gpu/test_precompiled.py -m gpu -v -s
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
import torch

from vc_attention.kernels import dispatch, explain_backend, pipeline, precompiled, vc_attention
from vc_attention.kernels.precompiled import loader, specs

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]
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


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    """(root folder, same_triton): root/sm_<arch>/ for this GPU."""
    import triton

    arch = device_arch()
    prebuilt = os.environ.get("VC_ATTENTION_TEST_CUBINS")
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
    missing = set(specs.KERNELS) - built
    assert not missing, f"{root}: no cubin for {sorted(missing)} (SELECT above misses them?)"
    return root, manifest["triton_version"] == triton.__version__


@pytest.fixture
def use_cubins(cubins, monkeypatch):
    root, _ = cubins
    monkeypatch.setenv("VC_ATTENTION_CUBINS", str(root))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dispatch.precompiled_status.cache_clear()
    precompiled.status.cache_clear()
    yield root
    dispatch.precompiled_status.cache_clear()
    precompiled.status.cache_clear()


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
    from vc_attention.kernels.triton.launch import triton_launch

    root, same_triton = cubins
    cubin = launcher(root, driver)
    q, k, v, key_bias, perm = inputs(N, bias=bias, perm=v_smooth)
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
        pipeline.vc_attention_8bit(L, q, k, v, out, v_smooth=v_smooth, expcast=expcast, perm=perm, key_bias=key_bias)
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
    from vc_attention.kernels.triton.launch import triton_launch

    root, same_triton = cubins
    q, k, v, _, perm = inputs(2048, perm=True)
    want = torch.empty_like(q)
    pipeline.vc_attention_8bit(triton_launch, q, k, v, want, perm=perm)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = torch.empty_like(q)
        pipeline.vc_attention_8bit(launcher(root, drivers()[0]), q, k, v, got, perm=perm)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if same_triton:
        assert same_bits(got, want)


def test_kmeans_cubins_match_the_jit(cubins):
    from vc_attention.kernels.triton.kmeans import kmeans_triton

    root, same_triton = cubins
    _, _, v, _, _ = inputs(3000)
    init = v.reshape(5, 3000, 128)[:, :: 3000 // 16][:, :16].float().contiguous()
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
    got = vc_attention(q, k, v, plan=plan, key_bias=key_bias)
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
    dispatch.precompiled_status.cache_clear()
    precompiled.status.cache_clear()
    q = torch.zeros(1, 1, 256, 128, device="cuda", dtype=torch.bfloat16)
    d = explain_backend(q, q, q)
    dispatch.precompiled_status.cache_clear()
    precompiled.status.cache_clear()
    assert d.backend == "triton"
    assert f"no cubins for sm_{arch} (found sm_{other}; a cubin runs only on the architecture" in d.reasons["precompiled"]


def test_runs_without_triton(cubins, tmp_path):
    """A process where `import triton` fails: dispatch says why, the cubins run, same bits as the JIT."""
    from vc_attention.kernels.triton.launch import triton_launch

    root, same_triton = cubins
    q, k, v, key_bias, _ = inputs(1200, bias=True)
    want = torch.empty_like(q)
    pipeline.vc_attention_8bit(triton_launch, q, k, v, want, key_bias=key_bias, expcast=dispatch.expcast_default(
        dispatch.CallSpec.from_tensors(q, bits=8)))
    torch.save({"q": q.cpu(), "k": k.cpu(), "v": v.cpu(), "bias": key_bias.cpu()}, tmp_path / "in.pt")
    code = """
sys.modules["triton"] = None  # import triton -> ImportError, as with a missing or broken install
import torch
from vc_attention.kernels import explain_backend, vc_attention
t = {n: x.cuda() for n, x in torch.load(sys.argv[2]).items()}
d = explain_backend(t["q"], t["k"], t["v"], key_bias=t["bias"])
assert d.backend == "precompiled", str(d)
out = vc_attention(t["q"], t["k"], t["v"], key_bias=t["bias"], v_smooth=True)
torch.cuda.synchronize()
torch.save(out.cpu(), sys.argv[3])
print(d)
print("TRITON_LOADED", any(m.startswith("triton.") for m in sys.modules))
"""
    env = dict(os.environ, VC_ATTENTION_CUBINS=str(root))
    log = run_python(code, str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), env=env)
    assert "TRITON_LOADED False" in log, log
    got = torch.load(tmp_path / "out.pt").cuda()
    if same_triton:
        assert same_bits(got, want)


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
    assert st["results"]["precompiled == triton (bit-for-bit)"] is True
    # The first run's time includes the JIT paths' compiles (the Gluon kernel alone takes ~10 s on
    # a cold Triton cache), so it depends on which tests ran before; a second run is what a user's
    # next doctor call costs.
    again = doctor.run(budget_s=300)["self_test"]
    assert again["passed"] and again["seconds"] < 10, again
