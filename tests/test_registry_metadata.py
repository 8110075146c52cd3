"""The pack as the Comfy Registry publishes it: pyproject.toml metadata, the archive's contents, the
registry's lint rules.

What comfy-cli (`comfy node validate`, `comfy node pack` / `publish`) does, and what is checked here:
- metadata: [project] name, version X.Y.Z, description, license, urls.Repository; [tool.comfy]
  PublisherId, DisplayName, Icon (a URL), includes, requires-comfyui. comfy-cli drops, with only a
  warning, a requires-comfyui or a comfyui-frontend-package bound that is not `[op]X.Y.Z`, an
  "Operating System ::" classifier outside Microsoft / POSIX / MacOS / OS Independent, and an
  "Environment ::" classifier outside its five accelerators; here each is an error.
- archive: the git-tracked files minus the gitwildmatch patterns of .comfyignore, plus the untracked
  paths [tool.comfy] includes names. With comfy-cli installed its own zip_files builds the archive;
  otherwise git applies the same patterns (`git ls-files --ignored --exclude-from`).
- lint: `ruff check --select S102,S307,E702` (exec, eval, two statements on one line).
"""

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]
COMFY = PYPROJECT["tool"]["comfy"]

# comfy_cli/registry/config_parser.py: validate_version, and the classifier sets it accepts.
VERSION_BOUND = re.compile(r"^(?:(==|>=|<=|!=|~=|>|<|<>|=)\s*)?(\d+\.\d+\.\d+(?:-[a-zA-Z0-9]+)?)?$")
OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")
ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend",
                "GPU :: Apple Metal"}
REGISTRY_RULES = "S102,S307,E702"


def _valid_bound(spec: str) -> bool:
    return bool(spec) and all(VERSION_BOUND.match(part.strip()) for part in spec.split(","))


# ------------------------------------------------------------------------------------------ metadata


def test_project_fields_the_registry_requires():
    name = PROJECT["name"]
    # docs.comfy.org/registry/specifications: under 100 characters; letters, digits, - _ .; no two
    # special characters in a row; starts with a letter; "ComfyUI" not in the name.
    assert len(name) < 100 and re.fullmatch(r"[A-Za-z](?:[A-Za-z0-9]|[-_.](?![-_.]))*", name), name
    assert "comfyui" not in name.lower()
    assert re.fullmatch(r"\d+\.\d+\.\d+", PROJECT["version"]), PROJECT["version"]
    assert PROJECT["description"].strip()
    lic = PROJECT["license"]
    if isinstance(lic, dict):
        assert lic.get("text") or (ROOT / lic["file"]).is_file(), lic
    else:
        assert isinstance(lic, str) and lic.strip()  # comfy-cli reads a string as {text = ...}
    assert (ROOT / "LICENSE").is_file()
    repo = urlparse(PROJECT["urls"]["Repository"])
    assert repo.scheme == "https" and repo.netloc == "github.com" and len(repo.path.strip("/").split("/")) == 2


def test_tool_comfy_fields():
    assert re.fullmatch(r"[a-z][a-z0-9-]*", COMFY["PublisherId"]), COMFY["PublisherId"]
    assert COMFY["DisplayName"].strip()
    assert isinstance(COMFY["includes"], list) and all(isinstance(p, str) for p in COMFY["includes"])
    assert _valid_bound(COMFY["requires-comfyui"]), COMFY["requires-comfyui"]


def test_frontend_bound_is_one_comfy_cli_keeps():
    # comfy-cli takes the text after "comfyui-frontend-package" as the front-end bound.
    bounds = [d.removeprefix("comfyui-frontend-package") for d in PROJECT["dependencies"]
              if d.startswith("comfyui-frontend-package")]
    assert len(bounds) == 1 and _valid_bound(bounds[0]), bounds


def test_classifiers_name_os_and_accelerator():
    classifiers = PROJECT["classifiers"]
    oses = [c.removeprefix("Operating System :: ") for c in classifiers if c.startswith("Operating System :: ")]
    accels = [c.removeprefix("Environment :: ") for c in classifiers if c.startswith("Environment ::")]
    assert oses and all(o.startswith(OS_PREFIXES) for o in oses), oses
    assert accels and set(accels) <= ACCELERATORS, accels
    assert "GPU :: NVIDIA CUDA" in accels  # the kernels are CUDA kernels
    # Each OS that pulls a Triton build through the dependency markers is a claimed OS.
    for system, classifier in (("Linux", "POSIX :: Linux"), ("Windows", "Microsoft :: Windows")):
        if any(f"platform_system == '{system}'" in d for d in PROJECT["dependencies"]):
            assert classifier in oses, (system, oses)


def test_icon_is_a_url_to_a_square_image_in_this_repository():
    icon = urlparse(COMFY["Icon"])
    assert icon.scheme == "https" and icon.path.endswith((".svg", ".png")), COMFY["Icon"]
    # https://raw.githubusercontent.com/<owner>/<repo>/<branch>/<path> of the project's Repository.
    owner_repo = urlparse(PROJECT["urls"]["Repository"]).path.strip("/")
    assert icon.netloc == "raw.githubusercontent.com" and icon.path.startswith(f"/{owner_repo}/"), COMFY["Icon"]
    rel = icon.path.removeprefix(f"/{owner_repo}/").split("/", 1)[1]
    path = ROOT / rel
    assert path.is_file(), rel
    if _in_git_work_tree():
        ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", rel])
        assert ignored.returncode == 1, f"{rel} is git-ignored, so the raw URL would not serve it"
    if path.suffix == ".svg":
        import xml.etree.ElementTree as ET

        svg = ET.parse(path).getroot()
        _, _, w, h = (float(x) for x in svg.get("viewBox").split())
        assert w == h, "the registry shows the icon square"


# ------------------------------------------------------------------------------------------ archive


def _in_git_work_tree() -> bool:
    if shutil.which("git") is None:
        return False
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    return r.returncode == 0 and Path(r.stdout.strip()).resolve() == ROOT


def _git_lines(*args) -> list[str]:
    out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def _archive_with_comfy_cli(tmp_path, monkeypatch) -> list[str]:
    from comfy_cli.file_utils import zip_files

    monkeypatch.chdir(ROOT)  # zip_files reads ".comfyignore" and lists "." from the working directory
    target = tmp_path / "node.zip"
    zip_files(str(target), includes=COMFY["includes"])
    with zipfile.ZipFile(target) as z:
        return sorted(n for n in z.namelist() if not n.endswith("/"))


def _archive_with_git() -> list[str]:
    """zip_files' rule: each tracked file that exists and that no .comfyignore pattern matches
    (comments and blank lines dropped, gitwildmatch semantics, which git applies natively)."""
    tracked = _git_lines("ls-files")
    ignore = ROOT / ".comfyignore"
    ignored = set(_git_lines("ls-files", "--cached", "--ignored", f"--exclude-from={ignore}")) if ignore.is_file() else set()
    files = {f for f in tracked if f not in ignored and (ROOT / f).exists()}
    for inc in COMFY["includes"]:  # forced in even when ignored
        base = ROOT / inc.lstrip("/")
        files |= {p.relative_to(ROOT).as_posix() for p in ([base] if base.is_file() else base.rglob("*")) if p.is_file()}
    return sorted(files)


@pytest.fixture
def archive(tmp_path, monkeypatch) -> list[str]:
    if not _in_git_work_tree():
        pytest.skip("not a git checkout of the pack: the registry archive is built from git ls-files")
    try:
        import comfy_cli.file_utils  # noqa: F401
    except ImportError:
        return _archive_with_git()
    return _archive_with_comfy_cli(tmp_path, monkeypatch)


def test_archive_holds_the_pack(archive):
    files = set(archive)
    for required in ("__init__.py", "pyproject.toml", "README.md", "LICENSE"):
        assert required in files, required
    for folder in ("nodes/", "kernels/", "kernels/precompiled/", "web/", "workflows/"):
        assert any(f.startswith(folder) for f in files), folder
    # Everything the installed package declares in package-data is in the archive too.
    for f in _git_lines("ls-files", "web/*.js", "workflows/*.json", "workflows/*.jpg", "kernels/*.py"):
        if (ROOT / f).exists():
            assert f in files, f


def test_archive_leaves_out_tests_results_and_ci(archive):
    for prefix in ("tests/", "benchmarks/results/", ".ci/", "docs/_build/"):
        assert not [f for f in archive if f.startswith(prefix)], prefix
    assert not [f for f in archive if "__pycache__/" in f or f.endswith(".pyc")]


def test_git_rule_matches_comfy_cli(tmp_path, monkeypatch):
    """The fallback above is the rule comfy-cli applies (checked where comfy-cli is installed)."""
    if not _in_git_work_tree():
        pytest.skip("not a git checkout of the pack")
    pytest.importorskip("comfy_cli.file_utils", reason="comfy-cli not installed")
    assert _archive_with_git() == _archive_with_comfy_cli(tmp_path, monkeypatch)


# ------------------------------------------------------------------------------------------ lint


def test_registry_lint_rules_pass():
    """`comfy node validate` runs ruff with these rules over the node's folder; over every tracked
    Python file here (a superset of the archive), so that a violation is caught wherever it lands."""
    try:
        import ruff  # noqa: F401

        cmd = [sys.executable, "-m", "ruff"]
    except ImportError:
        if shutil.which("ruff") is None:
            pytest.skip("ruff not installed (the `test` extra installs it)")
        cmd = [shutil.which("ruff")]
    if _in_git_work_tree():
        files = [f for f in _git_lines("ls-files", "*.py") if (ROOT / f).exists()]
    else:
        files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts]
    r = subprocess.run([*cmd, "check", "--no-cache", "--select", REGISTRY_RULES, "--output-format", "concise", *files],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
