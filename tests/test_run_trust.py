"""A verdict is only as good as the results behind it: `difftest run` on CPU (real qwen-tts on the
tiny checkpoint, the CPU test engine) never judges one candidate on another's results, keeps what
the verdicts need when it resumes, and stops every process it started when it is told to stop.

Reproduced against the first landing: a clean run then a ref-leak run into the same --out printed
"PASS: 4 segments (4 numeric_drift)"; a resumed run lost its batches, so `contamination (donor
smoke-02)` became `vocoder_defect` with no donor; SIGTERM left the engine running, re-parented to 1.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reference_support import reference_python

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "cases" / "suites" / "smoke.yaml"


def difftest(*args, cwd):
    p = subprocess.run([sys.executable, "-m", "difftest", *map(str, args)], capture_output=True, text=True,
                       cwd=cwd, timeout=1200)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stdout, p.stderr


def report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def leaks(rep: dict) -> dict:
    return {s["id"]: (s["verdict"], s["stage"], s["first_divergent_chunk"], s["donor"]) for s in rep["segments"]
            if s["verdict"] not in ("identical", "numeric_drift")}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    reference_python()
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def sequence(store, tmp_path_factory):
    """The stale-PASS sequence: a clean run, then the planted leak into the same --out (refused),
    then the same with --replace, then that run again (resumed from its own results)."""
    out = tmp_path_factory.mktemp("run")
    run = ("run", SMOKE, "-n", "4", "--out", out, "--store", store, "--no-mlflow")
    steps = {"clean": difftest(*run, "--candidate", "cpu-engine", cwd=out)}
    steps["clean_report"] = report(out)
    def files():  # what a refusal must leave as it was (the logs say it ran)
        return {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and "logs" not in p.parts}

    before = files()
    steps["leak_refused"] = difftest(*run, "--candidate", "cpu-engine:ref-leak", cwd=out)
    steps["untouched"] = [str(p) for p, t in files().items() if before.get(p) != t]
    steps["leak"] = difftest(*run, "--candidate", "cpu-engine:ref-leak", "--replace", cwd=out)
    steps["leak_report"] = report(out)
    results = {p: p.stat().st_mtime_ns for p in (out / "results").rglob("*.npz")}
    steps["resumed"] = difftest(*run, "--candidate", "cpu-engine:ref-leak", cwd=out)
    steps["resumed_report"] = report(out)
    steps["recomputed"] = [p for p, t in results.items() if p.stat().st_mtime_ns != t]
    return steps


@pytest.mark.heavy
def test_the_clean_engine_passes_and_records_what_it_is(sequence):
    code, out, err = sequence["clean"]
    assert code == 0, out + err[-2000:]
    rep = sequence["clean_report"]
    assert rep["candidate"]["identity"]["kind"] == "cpu-engine" and rep["candidate"]["identity"]["defect"] is None
    assert "candidate: difftest CPU test engine (not vLLM-Omni)" in err  # the console says what it is


@pytest.mark.heavy
def test_another_candidate_is_refused_on_the_same_folder(sequence):
    code, out, err = sequence["leak_refused"]
    assert code == 2, out + err[-2000:]
    assert "holds results of another candidate or configuration" in err
    assert 'engine.defect: null -> "ref-leak"' in err and "--replace" in err
    assert sequence["untouched"] == []  # a refusal changes nothing in the folder but its logs
    assert "reference [" not in err  # and comes before any model work


@pytest.mark.heavy
def test_with_replace_the_leak_is_judged_on_its_own_results(sequence):
    code, out, err = sequence["leak"]
    assert code == 1, out + err[-2000:]
    found = leaks(sequence["leak_report"])
    assert found and all(v[:3] == ("contamination", "handoff", 0) and v[3] for v in found.values()), found
    assert sequence["leak_report"]["candidate"]["batches"] == [["smoke-01", "smoke-02", "smoke-03", "smoke-04"]]


@pytest.mark.heavy
def test_a_resumed_run_keeps_its_batches_and_donors(sequence):
    code, out, err = sequence["resumed"]
    assert code == 1, out + err[-2000:]
    assert sequence["recomputed"] == []  # everything reused
    assert leaks(sequence["resumed_report"]) == leaks(sequence["leak_report"])
    assert sequence["resumed_report"]["candidate"]["batches"] == sequence["leak_report"]["candidate"]["batches"]


def _descendants(pid: int) -> set[int]:
    children = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, set()).add(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _run_until_the_candidate_is_up(store, tmp_path, out):
    """`difftest run` on smoke with the CPU engine, started and read until it announces its candidate
    (no clock: the command itself says when the engine is up); its processes by then."""
    proc = subprocess.Popen([sys.executable, "-m", "difftest", "run", SMOKE, "--candidate", "cpu-engine",
                             "-n", "4", "--out", out, "--store", store, "--no-mlflow"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("candidate: "):
            break
    return proc, lines, _descendants(proc.pid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_every_process_it_started(store, tmp_path, sig, plain_processes):
    """Signalled once the candidate is up (its announcement on stderr), `difftest run` stops the CPU
    engine and the reference runner, keeps its finished results, and exits 3."""
    out = tmp_path / "run"
    proc, lines, children = _run_until_the_candidate_is_up(store, tmp_path, out)
    assert len(children) >= 2, "".join(lines)  # the reference runner and the CPU engine
    proc.send_signal(sig)  # to difftest alone, as `timeout` or a CI runner would
    rest = proc.stderr.read()
    code = proc.wait(timeout=300)
    assert code == 3, "".join(lines) + rest
    assert "interrupted" in rest and "Traceback" not in rest
    deadline = time.monotonic() + 120  # a grace the engines' own shutdown may take; checked, not slept
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in children if _alive(p)], "processes left running after the signal"
    assert json.loads((out / "results" / "candidate-c1" / "identity.json").read_text())["engine"]["kind"] == "cpu-engine"


def test_a_kill_9_of_difftest_takes_its_engines_with_it_and_strays_are_reported(store, tmp_path, plain_processes):
    """#34 item 5. Reproduced before: after `kill -9` of `difftest run`, the CPU engine (680 MB)
    and the reference runner ran on under PID 1. Now each child's watchdog ends its process group
    once difftest is gone; and a process an earlier difftest started that outlived it is named
    when the next run starts."""
    out = tmp_path / "run"
    proc, lines, children = _run_until_the_candidate_is_up(store, tmp_path, out)
    assert len(children) >= 2, "".join(lines)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 120  # the watchdogs' SIGTERM grace (10 s) and the engines' exit; checked, not slept
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in children if _alive(p)], "processes left running after kill -9 of difftest"

    from difftest.process.lifeline import OWNER_ENV, owner_tag

    gone = subprocess.Popen(["true"])
    gone.wait()
    stray = subprocess.Popen(["sleep", "600"], env={**os.environ, OWNER_ENV: owner_tag(gone.pid)})
    try:
        code, _, err = difftest("run", SMOKE, "--candidate", "cpu-engine:typo", "--out", tmp_path / "o2",
                                "--store", store, "--no-mlflow", cwd=tmp_path)
        assert code == 2
        assert "an earlier difftest started outlived it" in err and f"{stray.pid}: sleep 600" in err, err
    finally:
        stray.kill()
        stray.wait()


@pytest.fixture
def full_disk(tmp_path):
    """A 3 MiB tmpfs: room for a run's first files, not for its candidate's results."""
    d = tmp_path / "full"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"this test mounts a 3 MiB tmpfs to fill a disk, which needs root (CAP_SYS_ADMIN): {r.stderr}",
                    pytrace=False)
    yield d
    subprocess.run(["umount", "-l", str(d)], check=True)


def test_a_full_disk_under_out_is_an_infrastructure_error_naming_the_folder(store, tmp_path, full_disk):
    """#34 item 6. Reproduced before: exit 1, FAIL, the engine's ENOSPC (its capture writes)
    reported as four candidate errors, as if the candidate had failed."""
    out = full_disk / "run"
    code, so, err = difftest("run", SMOKE, "--candidate", "cpu-engine", "-n", "4", "--out", out, "--store", store,
                             "--no-mlflow", "--no-repeat", cwd=tmp_path)
    assert code == 3, so + err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"difftest: error: {out}/results/candidate-c") and "no space left on device" in last, last
    assert "run the same command again" in last and not (out / "report.json").exists()
