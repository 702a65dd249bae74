"""The tester side of the runner protocol against a misbehaving runner (tests/fake_runner.py)."""

import sys
from pathlib import Path

import pytest

from difftest.process.runner_client import RunnerDied, RunnerProcess
from difftest.results import read_result

FAKE = [sys.executable, str(Path(__file__).with_name("fake_runner.py"))]


def segs(n, text="hello"):
    return [{"id": f"s{i}", "hash": f"{i:064d}", "text": text} for i in range(n)]


def test_jobs_results_and_stdout_pollution(tmp_path):
    with RunnerProcess(FAKE, log_path=tmp_path / "runner.log") as r:
        assert r.hello["label"] == "fake" and r.hello["fingerprint"] == {"engine": "fake"}
        events = list(r.request("generate", segments=segs(3), out_dir=str(tmp_path), concurrency=1))
        assert [e["event"] for e in events] == ["result"] * 3
        assert [read_result(e["path"]).segment_id for e in events] == ["s0", "s1", "s2"]
        events = list(r.request("generate", segments=segs(1, text=" "), out_dir=str(tmp_path)))
        assert events == [{"id": 2, "event": "error", "segment": "s0", "kind": "bad_input", "message": "empty text"}]
        unknown = list(r.request("frobnicate"))
        assert unknown[0]["event"] == "error" and "unknown op 'frobnicate'" in unknown[0]["message"]
    assert not r.alive
    log = (tmp_path / "runner.log").read_text()
    assert "banner: a library printing" in log and "noise in the middle" in log


def test_runner_that_crashes_mid_job_keeps_what_it_wrote(tmp_path):
    r = RunnerProcess(FAKE, env={**__import__("os").environ, "FAKE_RUNNER_CRASH_AFTER": "2"})
    r.start()
    got = []
    with pytest.raises(RunnerDied) as e:
        for ev in r.request("generate", segments=segs(4), out_dir=str(tmp_path)):
            got.append(ev["segment"])
    assert got == ["s0", "s1"]
    assert "exited with status 9" in str(e.value) and "crashing now" in e.value.tail
    assert len(list(tmp_path.glob("*.json"))) == 2
    with pytest.raises(RunnerDied, match="not running"):
        list(r.request("generate", segments=segs(1), out_dir=str(tmp_path)))


def test_silent_runner_is_killed(tmp_path):
    r = RunnerProcess(FAKE, env={**__import__("os").environ, "FAKE_RUNNER_HANG_AFTER": "1"})
    r.start()
    with pytest.raises(RunnerDied, match="silent for 2 s; killed"):
        list(r.request("generate", timeout=2, segments=segs(3), out_dir=str(tmp_path)))
    assert not r.alive


def test_runner_that_cannot_start():
    with pytest.raises(RunnerDied, match="cannot start runner"):
        RunnerProcess(["/nonexistent/python"]).start()
    with pytest.raises(RunnerDied, match=r"exited with status 3"):
        RunnerProcess([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"]).start()
