"""How a commit becomes a candidate (difftest/bisect/builds.py), with real git and real pip, no engine:
the commit range, worktrees, the overlay environment and its cache, an install that fails, a base
environment that already holds the package, and the CPU recipe's declared (and flaky) defect."""

import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from bisect_support import BROKEN, FLAKY, K, commit, git, make_fakeomni_repo

from difftest.bisect.builds import (
    STAMP,
    BuildFailed,
    CpuEngineRecipe,
    LaunchContext,
    Worktrees,
    commit_info,
    first_parent_range,
    make_overlay,
    prepare,
    resolve,
)
from difftest.cache import Cache
from difftest.engines.speech_client import SpeechClient
from difftest.errors import BadInput
from difftest.run import RunOptions

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_PYTHON = ROOT / ".venv-reference" / "bin" / "python"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    path = tmp_path_factory.mktemp("builds") / "repo"
    return path, make_fakeomni_repo(path)


@pytest.fixture(scope="module")
def recipe():
    if not REFERENCE_PYTHON.exists():
        pytest.fail(f"{REFERENCE_PYTHON} is missing: run runners/reference/make_env.sh first", pytrace=False)
    return CpuEngineRecipe(REFERENCE_PYTHON)


def test_range_resolve_and_commit_info(repo):
    path, shas = repo
    assert first_parent_range(path, shas[0], shas[-1]) == shas
    assert first_parent_range(path, shas[3], shas[5]) == shas[3:6]
    assert resolve(path, "main~3") == shas[6] and resolve(path, shas[2][:8]) == shas[2]
    info = commit_info(path, shas[K])
    assert info["subject"].startswith("handoff: keep one reference") and info["date"].startswith("2024-01-07")
    with pytest.raises(BadInput, match="not an ancestor"):
        first_parent_range(path, shas[5], shas[2])
    with pytest.raises(BadInput, match="same commit"):
        first_parent_range(path, shas[2], shas[2])
    with pytest.raises(BadInput, match="is not a commit"):
        resolve(path, "no-such-rev")


def test_a_merge_stands_for_its_side_branch(tmp_path):
    r = tmp_path / "r"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    a = commit(r, 1, "a", {"f": "a"})
    git(r, "checkout", "-q", "-b", "side")
    s1 = commit(r, 2, "side 1", {"g": "1"})
    git(r, "checkout", "-q", "main")
    b = commit(r, 3, "b", {"f": "b"})
    git(r, "merge", "-q", "--no-ff", "-m", "merge side", "side")
    m = git(r, "rev-parse", "HEAD")
    line = first_parent_range(r, a, m)
    assert line == [a, b, m] and s1 not in line


def test_install_is_cached_per_commit_and_imports_from_the_worktree(repo, recipe, tmp_path):
    path, shas = repo
    trees = Worktrees(path, tmp_path / "builds")
    t0 = time.perf_counter()
    build = prepare(recipe, trees, shas[0])
    first = time.perf_counter() - t0
    home = tmp_path / "builds" / "bisect-build" / shas[0]
    assert not build.cached and build.src == home / "src" and build.python == home / "env" / "bin" / "python"
    assert Path(build.module_file).is_relative_to(build.src)
    assert git(build.src, "rev-parse", "HEAD") == shas[0]
    log_and_stamp = (build.log, home / "env" / STAMP)
    made = [p.stat().st_mtime_ns for p in log_and_stamp]
    t0 = time.perf_counter()
    again = prepare(recipe, trees, shas[0])
    assert again.cached and again.python == build.python and again.module_file == build.module_file
    assert [p.stat().st_mtime_ns for p in log_and_stamp] == made  # reused, not redone (however slow the machine)
    print(f"install {first:.2f} s, cached {time.perf_counter() - t0:.3f} s")
    # Another recipe identity (other pip arguments) does not take the cached build.
    other = CpuEngineRecipe(REFERENCE_PYTHON, pip_args=("--no-deps", "--no-build-isolation"))
    assert not prepare(other, trees, shas[0]).cached


def test_a_build_is_held_while_in_use_and_its_removal_prunes_the_worktree(repo, recipe, tmp_path):
    path, shas = repo
    trees = Worktrees(path, tmp_path / "builds")
    cache = Cache(tmp_path / "builds")
    with ExitStack() as hold:
        build = prepare(recipe, trees, shas[2], hold)
        [entry] = cache.entries("bisect-build")
        assert (entry.key, entry.complete, entry.in_use) == (shas[2], True, True)
        assert cache.clean(everything=True)["kept_in_use"][0]["key"] == shas[2]  # a probe is using it
        assert build.src.is_dir()
    assert str(build.src) in git(path, "worktree", "list")
    result = cache.clean(everything=True)
    assert [e["key"] for e in result["removed"]] == [shas[2]] and not build.src.parent.exists()
    assert str(build.src) not in git(path, "worktree", "list")  # the repository forgot the worktree too


def test_a_commit_that_does_not_install_fails_the_build(repo, recipe, tmp_path):
    path, shas = repo
    with pytest.raises(BuildFailed, match=r"pip install -e .* failed .*TOMLDecodeError"):
        prepare(recipe, Worktrees(path, tmp_path / "b"), shas[BROKEN])


def _declared(recipe, build, out):
    ctx = LaunchContext(out, [], None, RunOptions())
    with recipe.launcher(build, ctx) as launcher:
        return launcher.declared_defect()


def test_the_worktree_wins_over_a_copy_in_the_base_environment(repo, tmp_path, monkeypatch):
    """On a GPU host the base environment holds a released vllm-omni: each commit's editable install must
    shadow it. Here the base holds fakeomni from the clean commit; commit K must still plant its leak."""
    path, shas = repo
    if not REFERENCE_PYTHON.exists():
        pytest.fail(f"{REFERENCE_PYTHON} is missing", pytrace=False)
    base_src = Worktrees(path, tmp_path / "base-src").checkout(shas[0])
    with open(tmp_path / "base.log", "w") as log:
        base = make_overlay(REFERENCE_PYTHON, tmp_path / "base", log)
    subprocess.run([str(base), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(base_src)],
                   check=True, capture_output=True)
    recipe = CpuEngineRecipe(base)
    build = prepare(recipe, Worktrees(path, tmp_path / "builds"), shas[K])
    assert Path(build.module_file).is_relative_to(build.src)
    assert _declared(recipe, build, tmp_path) == "ref-leak"
    clean = prepare(recipe, Worktrees(path, tmp_path / "builds"), shas[0])
    assert _declared(recipe, clean, tmp_path) is None


def test_the_flaky_commit_declares_its_defect_on_odd_calls(repo, recipe, tmp_path, monkeypatch):
    path, shas = repo
    monkeypatch.setenv("FAKEOMNI_COUNTER", str(tmp_path / "counter"))
    build = prepare(recipe, Worktrees(path, tmp_path / "builds"), shas[FLAKY])
    assert [_declared(recipe, build, tmp_path) for _ in range(3)] == ["ref-leak", None, "ref-leak"]
    monkeypatch.delenv("FAKEOMNI_COUNTER")
    with pytest.raises(BuildFailed, match="planted_defect"):
        _declared(recipe, build, tmp_path)


def test_vllm_omni_launcher_serves_the_commit_with_run_s_settings(tmp_path, monkeypatch):
    """The vllm-omni recipe's launcher, with start_vllm_omni stood in for (a real server is minutes on CPU;
    docs/bisect.md has the measured real probe): one server per probe, the commit's interpreter, and
    the settings `difftest run` applies (they drifted apart once: bisect judged every commit with a
    float32 vocoder whatever --dtype said, and without the request timeout); one checkpoint type only."""
    vo = pytest.importorskip("difftest.engines.vllm_omni")
    from bisect_support import write_suite

    from difftest.bisect.builds import Build, VllmOmniRecipe
    from difftest.engines.reference import ReferenceOptions
    from difftest.suites.suite import load_suite

    calls = []

    def start(out, models, opts, stack, tasks=None):
        calls.append({"out": out, "models": models, "opts": opts, "tasks": tasks})
        servers = [{"url": f"http://127.0.0.1:{9000 + i}"} for i in range(n_servers)]
        return SpeechClient(servers[0]["url"]), out / "capture", {"servers": servers, "label": "vllm-omni x",
                                                                   "start_seconds": 1.0}

    monkeypatch.setattr(vo, "start_vllm_omni", start)
    suite = load_suite(write_suite(tmp_path / "suite.yaml"))
    recipe = VllmOmniRecipe(REFERENCE_PYTHON, device="cpu", options={"max_tokens": 64})
    build = Build("c" * 40, tmp_path / "src", tmp_path / "env" / "bin" / "python", tmp_path / "build.log")
    opts = RunOptions(concurrency=3, request_timeout=123.0, reference=ReferenceOptions(dtype="bfloat16"))
    ckpt = tmp_path / "ckpt" / "base"  # a tiny build that never stops: length-capped answers accepted
    ckpt.mkdir(parents=True)
    (ckpt / "difftest-checkpoint.json").write_text('{"format": "difftest.checkpoint/1", "type": "base", "eos_bias": 0.0}')
    ctx = LaunchContext(tmp_path, [str(ckpt)], suite, opts)
    n_servers = 1
    with recipe.launcher(build, ctx) as launcher:
        spec, engine = launcher.candidate(0)
        assert launcher.candidate(1) == (spec, engine) and len(calls) == 1  # one server for every run of the probe
    assert spec.kind == "vllm-omni" and spec.declared["commit"] == "c" * 40
    assert (engine.client.base_url, engine.capture_dir) == ("http://127.0.0.1:9000", tmp_path / "capture")
    got = calls[0]["opts"]
    assert got.python == str(build.python) and got.device == "cpu" and got.max_num_seqs == 3
    assert got.accept_length_finish is True and got.max_tokens == 64 and got.repetition_penalty == 1.0
    assert got.vocoder_dtype == "bfloat16" and got.request_timeout == 123.0  # as `difftest run --dtype bfloat16`
    assert calls[0]["tasks"] == {"voice_clone"} and calls[0]["models"] == [str(ckpt)]
    n_servers = 2
    with pytest.raises(BadInput, match="one vLLM-Omni server per commit"):
        with recipe.launcher(build, ctx) as launcher:
            launcher.candidate(0)
