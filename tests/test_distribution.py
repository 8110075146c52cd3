"""How the kernels reach users: the cubin build (reproducible, with source hashes), the claim that
every kernel has a cubin for every architecture it claims (precompiled/verify.py), the loader's
refusal of cubins built from other source, the Triton-free import path, Windows path handling, and
the Comfy Registry archive carrying the cubins.

A small build here (two architectures, a few variants, each built twice); the full build, the wheel
and its install into a venv without Triton: .ci/wheel_check.
"""

import hashlib
import inspect
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

from vc_attention.kernels import dispatch, precompiled
from vc_attention.kernels.precompiled import loader, specs, verify

ROOT = pathlib.Path(__file__).resolve().parents[1]
try:
    import triton
except ImportError:
    triton = None

# Per architecture: its attention kernel (mma.sync on sm_89, portable on sm_90; its E4M3 P.V build) and
# a k-means kernel.
ONLY = (r"^kmeans_update_kernel .*HEAD_DIM=64 .*X=bf16|^vc_attention_(mma_)?fwd_kernel (?!.*PV_INT8=True).*EXPCAST=False "
        r"HAS_BIAS=False HAS_MEAN=True HEAD_DIM=64 .*O=bf16")
ARCHS = ("89", "90")
EPOCH = "1764547200"
# A kernel whose sm_100 cubin Blackwell's ptxas made two ways run to run before build._pin_ptxas.
SM100 = r"^vc_attention_fwd_kernel .*EXPCAST=True HAS_BIAS=True HAS_MEAN=True HEAD_DIM=128 .*O=bf16"

REGISTER = """
import importlib.util, sys, pathlib
root = pathlib.Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py", submodule_search_locations=[str(root)])
mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
"""


def run_python(code, *args, env=None, timeout=300):
    env = dict(os.environ if env is None else env)
    env["TRITON_INTERPRET"] = "0"
    done = subprocess.run([sys.executable, "-c", REGISTER + code, str(ROOT), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


def build(out, cache, archs=ARCHS, only=ONLY):
    """The build command in a fresh process with its own empty Triton cache (so it really compiles)."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), SOURCE_DATE_EPOCH=EPOCH)
    code = "from vc_attention.kernels.precompiled.build import main; main(sys.argv[2:])"
    return run_python(code, "--arch", *archs, "--out", out, "--only", only, "--jobs", "2", env=env)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    if triton is None:
        pytest.skip("Triton is not installed: the build needs it (the loader does not)")
    tmp = tmp_path_factory.mktemp("dist")
    logs = [build(tmp / name, tmp / f"cache_{name}") for name in ("a", "b")]
    for name in ("a", "b"):  # elsewhere: a longer folder name, another cache
        build(tmp / f"sm100_{name}" / ("x" * 7 if name == "b" else ""), tmp / f"cache100_{name}", ("100",), SM100)
    return tmp / "a", tmp / "b", logs


def files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------ the claim


def test_the_claim_is_data_the_registry_agrees_with():
    """specs.RECORD_ARCHS: which record's attention kernel ships as cubins for which architecture;
    each claimed architecture is one that record runs on, each default architecture has one attention
    kernel, and the JIT-only records are named with the reason."""
    for record, archs in specs.RECORD_ARCHS.items():
        gpus = dispatch.REGISTRY[record].kernel(8).gpus
        assert all(gpus.admits((a // 10, a % 10)) for a in archs), (record, archs)
        assert all(dispatch.REGISTRY["precompiled"].kernel(8).gpus.admits((a // 10, a % 10)) for a in archs)
    assert sorted(a for archs in specs.RECORD_ARCHS.values() for a in archs) == sorted(specs.DEFAULT_ARCHS)
    assert {specs.attention_kernel(a) for a in (89, 120)} == {"vc_attention_mma_fwd_kernel"}
    assert {specs.attention_kernel(a) for a in (90, 100)} == {"vc_attention_fwd_kernel"}
    assert "gluon" in specs.JIT_ONLY and "gluon" not in specs.RECORD_ARCHS and "TMA" in specs.JIT_ONLY["gluon"]
    assert set(specs.PTX_ARCHS) <= set(specs.DEFAULT_ARCHS)
    for arch in specs.DEFAULT_ARCHS:
        kernels = {v["kernel"] for v in specs.variants(arch)}
        assert {k for k in kernels if specs.KERNELS[k].get("record")} == {specs.attention_kernel(arch)}
        assert kernels == {k for k in specs.KERNELS if arch in specs.kernel_archs(k)}
        # what the dispatcher needs for every head dim and dtype is in the claim
        manifest = {"arch": arch, "kernels": [{"key": v["key"]} for v in specs.variants(arch)]}
        assert precompiled.complete_configs(manifest, ("attention", "prepass", "kmeans")) == {
            (d, io) for d in specs.HEAD_DIMS for io in specs.IO_DTYPES}


def test_verify_checks_a_build_against_the_claim(builds, tmp_path):
    a, _, _ = builds
    summaries, problems = verify.verify(a, archs=(89, 90), only=ONLY)
    assert problems == [] and [s["arch"] for s in summaries] == [89, 90]
    by = {s["arch"]: s for s in summaries}
    assert by[89]["attention"] == ["vc_attention_mma_fwd_kernel"] and by[89]["ptx"] == by[89]["cubins"] == 2
    assert by[90]["attention"] == ["vc_attention_fwd_kernel"] and by[90]["ptx"] == 0
    # Against the whole claim this small build falls short, and says where.
    _, problems = verify.verify(a)
    assert "sm_100: no cubin folder" in " ".join(problems) and "sm_120: no cubin folder" in " ".join(problems)
    assert any(p.startswith("sm_89: no cubin for vc_attention_mma_fwd_kernel") and "HEAD_DIM=128" in p for p in problems)
    # A damaged cubin, a missing PTX, a cubin in the wrong folder: each is a problem.
    bad = tmp_path / "bad"
    shutil.copytree(a, bad)
    manifest = json.loads((bad / "sm_90" / "manifest.json").read_text())
    cubin = bad / "sm_90" / manifest["kernels"][0]["file"]
    data = cubin.read_bytes()
    cubin.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    m89 = json.loads((bad / "sm_89" / "manifest.json").read_text())
    (bad / "sm_89" / m89["kernels"][0]["ptx"]).unlink()
    _, problems = verify.verify(bad, archs=(89, 90), only=ONLY)
    assert any("does not match its sha256" in p and p.startswith("sm_90") for p in problems), problems
    assert any("is missing or does not match" in p and p.startswith("sm_89") for p in problems), problems
    assert verify.main([str(bad), "--arch", "89", "90", "--only", ONLY]) == 1
    assert verify.main([str(a), "--arch", "89", "90", "--only", ONLY]) == 0


# ------------------------------------------------------------------------------------------ the build


def test_build_is_reproducible(builds):
    """Same source, Triton and architectures: the same bytes, built in another folder with another
    (empty) Triton cache; no source path inside a cubin or PTX."""
    a, b, logs = builds
    fa, fb = files(a), files(b)
    assert sorted(fa) == sorted(fb) and len(fa) == 2 + 2 + 2 + 2  # 2 manifests, 2+2 cubins, 2 PTX
    assert {n: hashlib.sha256(d).hexdigest() for n, d in fa.items()} == {
        n: hashlib.sha256(d).hexdigest() for n, d in fb.items()}
    for name, data in fa.items():
        assert str(ROOT).encode() not in data, name
    assert all("sm_89: 2 cubins" in log and "sm_90: 2 cubins" in log for log in logs)
    c100 = [files(p) for p in (a.parent / "sm100_a", a.parent / "sm100_b" / ("x" * 7))]
    assert len(c100[0]) == 2 and c100[0] == c100[1]


def test_manifest_records_arch_triton_and_source_hashes(builds):
    a, _, _ = builds
    for arch in (89, 90):
        manifest = json.loads((a / f"sm_{arch}" / "manifest.json").read_text())
        assert manifest["format"] == specs.MANIFEST_FORMAT and manifest["arch"] == arch
        assert manifest["triton_version"] == triton.__version__
        assert manifest["built_at"] == "2025-12-01T00:00:00Z"  # SOURCE_DATE_EPOCH
        kernels = {e["kernel"] for e in manifest["kernels"]}
        assert set(manifest["sources"]) == kernels
        for k, src in manifest["sources"].items():
            assert src["sha256"] == specs.source_hash(k) and src["files"] == specs.source_files(k)
            assert specs.KERNELS[k]["module"].split(".")[-1] + ".py" in " ".join(src["files"])
        for e in manifest["kernels"]:
            assert "/" not in e["file"] and "\\" not in e["file"]  # bare names: any OS's separator works
            if arch in specs.PTX_ARCHS:
                assert e["ptx_target"] == "sm_89" and "/" not in e["ptx"]


def test_source_files_cover_every_jit_function_a_kernel_calls():
    """The hashed files hold every @triton.jit function reachable from each kernel (what Triton's own
    cache key covers): an edit to any of them changes the hash."""
    if triton is None:
        pytest.skip("Triton is not installed")
    import importlib

    def is_jit(obj):
        return hasattr(obj, "fn") and hasattr(obj, "arg_names") and inspect.isfunction(getattr(obj, "fn", None))

    for name, k in specs.KERNELS.items():
        fn = getattr(importlib.import_module(k["module"]), name)
        todo, seen = [fn], set()
        while todo:
            f = todo.pop()
            path = pathlib.Path(inspect.getsourcefile(f.fn)).resolve()
            if path in seen and f is not fn:
                continue
            seen.add(path)
            for ref in f.fn.__code__.co_names:
                g = f.fn.__globals__.get(ref)
                if is_jit(g) and g is not f:
                    todo.append(g)
        rel = {p.relative_to(ROOT).as_posix() for p in seen}
        assert rel <= set(specs.source_files(name)), (name, rel - set(specs.source_files(name)))


def copy_sources(dest):
    shutil.copytree(ROOT / "kernels" / "triton", dest / "kernels" / "triton",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_source_hash_follows_the_source_not_its_line_endings(tmp_path):
    kernel = "vc_attention_mma_fwd_kernel"
    root = copy_sources(tmp_path / "pkg")
    assert specs.source_hash(kernel, root) == specs.source_hash(kernel)
    crlf = copy_sources(tmp_path / "crlf")
    for rel in specs.source_files(kernel, crlf):  # a Windows checkout with core.autocrlf
        p = crlf / rel
        p.write_bytes(p.read_bytes().replace(b"\n", b"\r\n"))
    assert specs.source_hash(kernel, crlf) == specs.source_hash(kernel)
    edited = copy_sources(tmp_path / "edited")
    online = edited / "kernels" / "triton" / "online.py"  # a file the kernel imports, not its own
    online.write_text(online.read_text() + "\n# an edit\n")
    assert specs.source_hash(kernel, edited) != specs.source_hash(kernel)
    assert specs.source_hash("kmeans_update_kernel", edited) == specs.source_hash("kmeans_update_kernel")


def test_cubins_of_other_source_are_refused_before_any_launch(builds, tmp_path, monkeypatch):
    a, _, _ = builds
    # The installed source edited after the build: the loader refuses, naming kernel, hashes, remedy.
    edited = copy_sources(tmp_path / "edited")
    attention = edited / "kernels" / "triton" / "attention.py"
    attention.write_text(attention.read_text() + "\n# an edit\n")
    manifest = loader.read_manifest(a / "sm_90")
    with pytest.raises(loader.SourceMismatchError) as e:
        loader.check_sources(manifest, a / "sm_90", root=edited)
    msg = str(e.value)
    assert "vc_attention_fwd_kernel" in msg and manifest["sources"]["vc_attention_fwd_kernel"]["sha256"] in msg
    assert specs.source_hash("vc_attention_fwd_kernel", edited) in msg
    assert "Rebuild" in msg and "--arch 90" in msg and "reinstall the vc-attention wheel" in msg
    # Cubins whose manifest names other source: refused by the loader and by the dispatcher's check.
    stale = tmp_path / "stale"
    shutil.copytree(a, stale)
    m = json.loads((stale / "sm_90" / "manifest.json").read_text())
    m["sources"]["vc_attention_fwd_kernel"]["sha256"] = "0" * 64
    (stale / "sm_90" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(loader.SourceMismatchError, match="built from kernel source sha256 0{64}"):
        loader.CubinKernels(stale / "sm_90", device_index=0, device_arch=90)
    monkeypatch.setenv("VC_ATTENTION_CUBINS", str(stale))
    precompiled.status.cache_clear()
    try:
        ok, why, _ = precompiled.status(90)
    finally:
        precompiled.status.cache_clear()
    assert not ok and "vc_attention_fwd_kernel" in why and "0" * 64 in why
    # A manifest of the format before source hashes: refused, with the remedy.
    m["format"] = 1
    (stale / "sm_90" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(loader.PrecompiledError, match="manifest format 1, this loader reads format 2: rebuild"):
        loader.read_manifest(stale / "sm_90")


# ------------------------------------------------------------------------------------------ the PTX fallback


def test_ptx_fallback_is_taken_only_without_an_own_cubin(builds, monkeypatch):
    a, _, _ = builds
    archs = {89: a / "sm_89", 90: a / "sm_90"}
    assert precompiled.select(90, archs) == (a / "sm_90", False)  # its own cubins win
    assert precompiled.select(89, archs) == (a / "sm_89", False)
    assert precompiled.select(103, archs) == (a / "sm_89", True)  # a newer GPU: the sm_89 PTX
    assert precompiled.select(121, {89: a / "sm_89"}) == (a / "sm_89", True)
    note = precompiled.fallback_note(103, archs)
    assert "no cubins for sm_103" in note and "sm_89 PTX" in note and "JIT-compiled by the CUDA driver" in note
    assert precompiled.fallback_note(90, archs) == ""
    # Older than the PTX's target (or no PTX folder): refused, with the reason.
    with pytest.raises(loader.PrecompiledError, match=r"no cubins for sm_86 .*sm_89 PTX only on sm_89 and newer"):
        precompiled.select(86, archs)
    with pytest.raises(loader.PrecompiledError, match="no cubins for sm_103"):
        precompiled.select(103, {90: a / "sm_90"})
    # The loader: PTX mode reads the PTX (NUL-terminated, target checked), never for an older GPU.
    k = loader.CubinKernels(a / "sm_89", device_index=0, device_arch=103, ptx=True)
    entry = k.manifest["kernels"][0]
    code = k.read_code(entry)
    assert code.endswith(b"\0") and b".target sm_89" in code and k.attention_kernel == "vc_attention_mma_fwd_kernel"
    with pytest.raises(loader.WrongArchError, match="targets sm_89: it runs on sm_89 and newer GPUs, this GPU is sm_86"):
        loader.CubinKernels(a / "sm_89", device_index=0, device_arch=86, ptx=True)
    with pytest.raises(loader.WrongArchError, match="sm_90a"):  # arch-specific PTX is never JIT'd elsewhere
        k90 = loader.CubinKernels(a / "sm_90", device_index=0, device_arch=100, ptx=True)
        k90.read_ptx(dict(k90.manifest["kernels"][0], ptx=k.manifest["kernels"][0]["ptx"], ptx_target="sm_90a"))
    # The dispatcher's check takes the fallback's completeness from the PTX it has.
    monkeypatch.setenv("VC_ATTENTION_CUBINS", str(a))
    assert precompiled.jit_twin(103) == "mma" and precompiled.jit_twin(90) == "triton"


# ------------------------------------------------------------------------------------------ no Triton, Windows


NO_TRITON = """
sys.modules["triton"] = None  # `import triton` fails (and find_spec finds none), as where it is missing
import torch
from vc_attention.kernels import dispatch, doctor, explain_backend, precompiled
from vc_attention.kernels import pipeline_mma
from vc_attention.kernels.precompiled import loader, specs, verify
print("TRITON_STATUS", dispatch.triton_status())
print("STATUS90", precompiled.status(90))
print("VERIFY", verify.main([sys.argv[2], "--arch", "89", "90", "--only", sys.argv[3]]))
doctor.main(["--no-self-test"])
q = torch.zeros(1, 1, 256, 64)
print(explain_backend(q, q, q))
print("TRITON_LOADED", sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] == "triton"))
"""


def test_precompiled_path_imports_no_triton(builds):
    """The loader, the dispatcher, the checks and the doctor in a process where `import triton` fails."""
    a, _, _ = builds
    env = dict(os.environ, VC_ATTENTION_CUBINS=str(a), CUDA_VISIBLE_DEVICES="")
    log = run_python(NO_TRITON, a, ONLY, env=env)
    assert "TRITON_LOADED []" in log, log
    assert "TRITON_STATUS (False, 'Triton kernels cannot be imported: " in log, log
    assert "VERIFY 0" in log and "2 architectures checked, 0 problems" in log, log
    assert "sm_89   2 cubins + 2 PTX (the fallback for newer GPUs), mma.sync kernel, Triton" in log, log
    assert "sm_90   2 cubins, portable kernel, Triton" in log, log
    assert "VC-Attention backend: sdpa" in log


def test_windows_driver_name_and_cubin_search_path(monkeypatch, tmp_path):
    """What runs the same on Windows: the ctypes driver asks for nvcuda.dll there (on Linux that load
    fails, with the name in the reason), VC_ATTENTION_CUBINS splits on os.pathsep (';' on Windows)."""
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(loader.PrecompiledError, match="nvcuda.dll"):
        loader._CtypesDriver()
    monkeypatch.setenv("VC_ATTENTION_CUBINS", os.pathsep.join([str(tmp_path / "x"), str(tmp_path / "y")]))
    assert precompiled.cubin_roots() == [tmp_path / "x", tmp_path / "y", precompiled.PACKAGE_CUBINS]


# ------------------------------------------------------------------------------------------ packaging


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_wheel_and_registry_archive_carry_the_cubins(tmp_path):
    """The wheel's package data and the Comfy Registry archive ([tool.comfy] includes: the archive is
    `git ls-files` minus .comfyignore plus includes) both take the build's folder, which git ignores."""
    cubins = precompiled.PACKAGE_CUBINS.relative_to(ROOT).as_posix()
    data = PYPROJECT["tool"]["setuptools"]["package-data"]["vc_attention.kernels.precompiled"]
    assert {"cubins/*/*.cubin", "cubins/*/*.ptx", "cubins/*/manifest.json"} <= set(data)
    assert cubins in PYPROJECT["tool"]["comfy"]["includes"]
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    # In a scratch repository with this checkout's ignore files: git ignores the cubins (so only
    # includes brings them into the archive) and .comfyignore does not drop them.
    repo = tmp_path / "repo"
    (repo / cubins / "sm_90").mkdir(parents=True)
    for name in (".gitignore", ".comfyignore"):
        shutil.copy(ROOT / name, repo / name)
    for name in ("x.cubin", "x.ptx", "manifest.json"):
        (repo / cubins / "sm_90" / name).write_text("")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)

    def ignored(path, exclude=None):
        args = ["git", "-C", str(repo)] + (["-c", f"core.excludesFile={exclude}"] if exclude else [])
        return subprocess.run(args + ["check-ignore", "-q", "--no-index", path]).returncode == 0

    assert ignored(f"{cubins}/sm_90/x.cubin")
    (repo / ".gitignore").unlink()
    for name in ("x.cubin", "x.ptx", "manifest.json"):
        assert not ignored(f"{cubins}/sm_90/{name}", exclude=repo / ".comfyignore"), name
