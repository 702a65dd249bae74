"""`difftest bisect` for real on CPU: a git repository (tests/bisect_support.py) whose package tells the
CPU test engine to plant the seed's ref-leak from commit K on, with a commit that does not install
and a flaky commit; real qwen-tts as the reference (one runner, one store for every probe), real
engines per commit, MLflow in a sqlite store. Interrupted at a point the package under test signals
(three commits decided, the fourth's engine serving) and started again, it names K within
ceil(log2 n) + 2 probes; `git bisect run difftest probe` names it too.

Cost on two busy cores: about 10-20 s per probe (the engine start), 2-3 minutes in all.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bisect_support import BROKEN, FLAKY, K, make_fakeomni_repo, write_suite
from mlflow_support import closed_uri
from reference_support import reference_python

ROOT = Path(__file__).resolve().parents[1]
BISECT = [sys.executable, "-m", "difftest.bisect"]


@pytest.fixture(scope="module")
def world(tmp_path_factory, _empty_mlflow_store):
    reference_python()
    root = tmp_path_factory.mktemp("bisect-e2e")
    shas = make_fakeomni_repo(root / "repo")
    suite = write_suite(root / "suite.yaml")
    shutil.copyfile(_empty_mlflow_store, root / "mlflow.db")
    env = {**os.environ, "FAKEOMNI_COUNTER": str(root / "counter")}
    env.pop("MLFLOW_TRACKING_URI", None)
    # The builds go to difftest's cache (docs/caches.md), shared with every other test and run: the
    # commits' ids are the same every time (tests/bisect_support.py fixes their dates and authors).
    common = ["--repo", str(root / "repo"), "--suite", str(suite), "--store", str(root / "store"),
              "--recipe", "cpu-engine", "-n", "2",
              # A wave's two requests batch even when they arrive far apart on a loaded machine: the
              # batch closes as soon as both are in; only a request alone waits the window out.
              "--cpu-engine-arg=--max-batch=2", "--cpu-engine-arg=--batch-window-ms=1000"]
    return {"root": root, "shas": shas, "env": env, "common": common, "uri": f"sqlite:///{root / 'mlflow.db'}"}


def engines_of(root: Path) -> list[str]:
    """Command lines of CPU engines still running for this test's store."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "runners.cpu_engine" in cmd and str(root) in cmd:
            found.append(cmd)
    return found


HOLD_COMMIT, HOLD_CALL = 5, 2  # the first session waits in c5's second run; its first run's engine is up


@pytest.fixture(scope="module")
def bisected(world):
    root, shas = world["root"], world["shas"]
    out = root / "out"
    argv = [*BISECT, "bisect", "--good", shas[0], "--bad", "main", *world["common"], "--out", str(out),
            "--repeats", "3", "--tracking-uri", world["uri"]]
    t0 = time.monotonic()
    # First session: c5's package waits (FAKEOMNI_HOLD) when asked for its defect the second time,
    # and the test interrupts it there (Ctrl-C to its process group): three commits are decided,
    # c5 is not, and c5's engine from its first run is serving.
    hold = root / "hold"
    hold.mkdir()
    env = {**world["env"], "FAKEOMNI_HOLD": f"0.1.{HOLD_COMMIT}:{HOLD_CALL}:{hold}"}
    first = subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    deadline = time.monotonic() + 1800  # a guard against a hang only; the test waits for the marker
    while not (hold / "held").exists():
        if first.poll() is not None or time.monotonic() > deadline:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
            _, f_err = first.communicate()
            pytest.fail(f"the first session never reached the hold point (exit {first.returncode}):\n"
                        f"{f_err[-3000:]}")
        time.sleep(0.2)
    state = out / "bisect.json"
    at_interrupt = {"decisions": json.loads(state.read_text())["order"], "engines": engines_of(root)}
    os.killpg(first.pid, signal.SIGINT)
    f_out, f_err = first.communicate(timeout=300)
    interrupted = {"code": first.returncode, "stdout": f_out, "stderr": f_err, "at_interrupt": at_interrupt,
                   "decisions": json.loads(state.read_text())["order"], "engines_left": engines_of(root)}
    # Second session, same --out, nothing held: picks up where the first stopped.
    second = subprocess.run(argv, cwd=root, env=world["env"], capture_output=True, text=True, timeout=1800)
    seconds = time.monotonic() - t0
    print(f"bisect, interrupted and resumed: {seconds:.0f} s")
    return {"interrupted": interrupted, "code": second.returncode, "stdout": second.stdout,
            "stderr": second.stderr, "state": json.loads(state.read_text()), "out": out, "seconds": seconds}


@pytest.mark.heavy
def test_interrupted_bisect_stops_cleanly(bisected, world):
    shas = world["shas"]
    first = bisected["interrupted"]
    assert first["code"] == 3, first["stderr"][-3000:]
    assert "interrupted" in first["stderr"]
    # good end, bad end, the broken middle; c5 was mid-probe and is not recorded
    assert first["at_interrupt"]["decisions"] == first["decisions"] == [shas[0], shas[-1], shas[BROKEN]]
    assert len(first["at_interrupt"]["engines"]) == 1  # c5's engine was serving when Ctrl-C came
    assert first["engines_left"] == []  # every engine it started is gone


@pytest.mark.heavy
def test_bisect_names_the_first_bad_commit(bisected, world):
    shas = world["shas"]
    assert bisected["code"] == 0, bisected["stdout"] + bisected["stderr"][-4000:]
    out = bisected["stdout"]
    assert f"first bad commit: {shas[K]}  handoff: keep one reference per batch (last writer wins)" in out
    assert "contamination" in out and "condemned by run 1" in out  # the verdicts that condemned it
    assert f"last good: {shas[K - 1]}  build: repair the metadata" in out
    st = bisected["state"]
    dec = {sha: d for sha, d in st["decisions"].items()}
    by_index = {shas.index(s): d for s, d in dec.items()}
    assert sorted(by_index) == [0, 4, 5, 6, 7, 9]
    assert {i: d["decision"] for i, d in by_index.items()} == {0: "good", 9: "bad", BROKEN: "skip", 5: "good",
                                                               FLAKY: "bad", K: "bad"}
    assert "does not build" in by_index[BROKEN]["reason"] and "TOMLDecodeError" in by_index[BROKEN]["reason"]
    assert by_index[FLAKY]["outcomes"] == ["bad", "good", "bad"]  # the majority of a flaky commit
    assert [r["candidate"]["defect"] for r in by_index[FLAKY]["runs"]] == ["ref-leak", None, "ref-leak"]
    for i in (0, 5, 9, K):
        assert by_index[i]["outcomes"] == [by_index[i]["decision"]] * 2  # settled after two alike of three
    n = len(shas) - 1  # commits that can be the first bad one
    assert len(dec) <= math.ceil(math.log2(n)) + 2
    result = st["result"]
    assert result["first_bad"] == shas[K]
    # The two sessions together walk the whole search once: the second reuses exactly what the
    # first decided and probes the rest, none of it twice.
    first = bisected["interrupted"]["decisions"]
    walked = [s["commit"] for s in result["steps"]]
    assert walked == [shas[i] for i in (0, 9, BROKEN, 5, FLAKY, K)] and st["order"] == walked
    reused = [s["commit"] for s in result["steps"] if s["reused"]]
    probed = [s["commit"] for s in result["steps"] if not s["reused"]]
    assert reused == first and not set(probed) & set(first)
    assert result["probes"] == len(probed) == len(dec) - len(first)
    assert f"{len(first)} decided earlier (reused)" in bisected["stderr"]
    for r in by_index[K]["runs"]:
        assert {c["verdict"] for c in r["condemned"]} == {"contamination"}
        assert Path(r["report"]).is_file()


@pytest.mark.heavy
def test_mlflow_shows_every_probe_under_one_parent(bisected, world):
    from mlflow import MlflowClient

    shas = world["shas"]
    client = MlflowClient(world["uri"])
    exp = client.get_experiment_by_name("difftest/bisect/bisect-tiny")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    [parent] = [r for r in runs if r.data.tags["difftest.kind"] == "bisect"]
    children = [r for r in runs if r.data.tags["difftest.kind"] == "bisect-probe"]
    assert parent.info.status == "FINISHED" and parent.data.tags["bisect.first_bad"] == shas[K]
    st = bisected["state"]
    want = sorted((sha, i + 1) for sha, d in st["decisions"].items() for i in range(len(d["runs"])))
    got = sorted((r.data.tags["candidate.commit"], int(r.data.tags["bisect.repeat"])) for r in children)
    assert got == want  # every run of every probe, once, across both sessions
    for r in children:
        t = r.data.tags
        d = st["decisions"][t["candidate.commit"]]
        assert t["mlflow.parentRunId"] == parent.info.run_id
        assert t["bisect.decision"] == d["decision"] and t["bisect.subject"] == d["subject"]
        assert t["difftest.culprit"] == ("true" if t["candidate.commit"] == shas[K] else "false")
    culprit = [r for r in children if r.data.tags["difftest.culprit"] == "true"]
    assert len(culprit) == 2 and {a.path for a in client.list_artifacts(culprit[0].info.run_id)} >= {"report.json"}
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"bisect.json", "bisect-log.txt"}


@pytest.mark.heavy
def test_a_finished_bisect_started_again_probes_nothing(bisected, world):
    shas = world["shas"]
    argv = [*BISECT, "bisect", "--good", shas[0], "--bad", "main", *world["common"], "--out", str(bisected["out"]),
            "--repeats", "3", "--tracking-uri", world["uri"]]
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=world["root"], env=world["env"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and f"first bad commit: {shas[K]}" in p.stdout
    assert "6 decided earlier (reused)" in p.stderr and "\nprobe " not in p.stderr
    assert json.loads((bisected["out"] / "bisect.json").read_text())["result"]["probes"] == 0
    print(f"resumed finished bisect: {time.monotonic() - t0:.1f} s")


@pytest.mark.heavy
def test_git_bisect_run_with_difftest_probe(bisected, world):
    """git walks the graph and calls `difftest probe`, which answers 0 / 1 / 125; MLflow is down here."""
    root, shas = world["root"], world["shas"]
    repo = root / "repo"
    probe = [*BISECT, "probe", *world["common"], "--out", str(root / "gbr"), "--tracking-uri", closed_uri()]
    subprocess.run(["git", "bisect", "start", shas[FLAKY], shas[K - 1]], cwd=repo, check=True, capture_output=True)
    try:
        p = subprocess.run(["git", "bisect", "run", *probe], cwd=repo, env=world["env"], capture_output=True,
                           text=True, timeout=600)
    finally:
        subprocess.run(["git", "bisect", "reset"], cwd=repo, capture_output=True)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    assert f"{shas[K]} is the first bad commit" in text
    assert "MLflow unavailable" in text  # warned, went on
    probes = json.loads((root / "gbr" / "probes.json").read_text())["decisions"]
    assert {s: d["decision"] for s, d in probes.items()} == {shas[K]: "bad"}
    assert probes[shas[K]]["build"]["cached"] is True  # the bisect's build of that commit, reused


def test_probe_exit_codes_without_an_engine(world, tmp_path):
    shas = world["shas"]
    base = [*BISECT, "probe", *world["common"], "--no-mlflow"]
    p = subprocess.run([*base, "--out", str(tmp_path / "p"), "--rev", shas[BROKEN]], cwd=tmp_path,
                       env=world["env"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 125 and p.stdout.startswith(f"skip {shas[BROKEN]}"), p.stderr[-2000:]
    p = subprocess.run([*base, "--out", str(tmp_path / "q"), "--rev", "no-such-commit"], cwd=tmp_path,
                       env=world["env"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 128 and "is not a commit" in p.stderr  # aborts git bisect run, never reads as bad
    p = subprocess.run([*BISECT, "probe", "--suite", "x.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 128 and "required: --out" in p.stderr


@pytest.mark.heavy
def test_side_by_side_bisect_names_the_same_commit_in_fewer_rounds(bisected, world):
    """`--workers 2` from the last good commit before K: each round's probes are `difftest probe`
    processes at once (real engines, the shared store and builds), and it names the commit the serial
    bisect named, in 2 rounds (both ends; then c6 and c8 together) where the serial one took 6."""
    shas, root = world["shas"], world["root"]
    out = root / "out-side-by-side"
    p = subprocess.run([*BISECT, "bisect", "--good", shas[K - 1], "--bad", shas[-1], *world["common"],
                        "--out", str(out), "--workers", "2", "--tracking-uri", world["uri"]],
                       cwd=root, env=world["env"], capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    result = json.loads((out / "bisect.json").read_text())["result"]
    assert result["first_bad"] == bisected["state"]["result"]["first_bad"] == shas[K]
    assert result["rounds"] == 2 < len(bisected["state"]["result"]["steps"])
    assert [(s["round"], shas.index(s["commit"])) for s in result["steps"]] == [(1, K - 1), (1, 9), (2, K), (2, 8)]
    for sha in (shas[K], shas[8]):  # each probe ran in a process and folder of its own
        assert (out / "parallel" / sha[:12] / "probes.json").is_file()
    assert "round 2: 2 probe(s) side by side" in p.stderr and "over 2 rounds of up to 2" in p.stdout
    assert not engines_of(root)  # every probe process stopped its engine
