"""No PASS from what the run could not see (issue 56, items 1, 2, 3 and 5): `difftest run` against an
audio-only URL candidate (the real CPU test engine, no capture) behind a hostile proxy
(tests/hostile_proxy.py), runs whose requests were never in flight together, and a leaking build
redeployed behind the same URL.

Each hostile answer passed before: every segment `audio_divergence`, which fails nothing, exit 0.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hostile_proxy import HostileProxy
from reference_support import REPO, all_models, reference_python, tiny  # noqa: F401

from difftest.process.launcher import ServerProcess, free_port
from difftest.verdicts import exercised

SMOKE = REPO / "cases" / "suites" / "smoke.yaml"


def _suite(tmp: Path, ids: list[str]) -> Path:
    raw = yaml.safe_load(SMOKE.read_text())
    raw["segments"] = [s for s in raw["segments"] if s["id"] in ids]
    for v in raw["voices"]:
        v["wav"] = str((SMOKE.parent / v["wav"]).resolve())
        if "transcript_file" in v:
            v["transcript_file"] = str((SMOKE.parent / v["transcript_file"]).resolve())
    path = tmp / f"smoke-{len(ids)}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def world(tiny, tmp_path_factory):  # noqa: F811
    """The clean CPU test engine serving the tiny checkpoints, with no capture: audio only."""
    d = tmp_path_factory.mktemp("blind")
    port = free_port()
    models = [a for m in all_models(tiny) for a in ("--model", m)]
    env = {k: v for k, v in os.environ.items() if k != "DIFFTEST_CAPTURE_DIR"} | {"HF_HUB_OFFLINE": "1"}
    engine = ServerProcess([str(reference_python()), "-m", "runners.cpu_engine", "--port", str(port), *models],
                           f"http://127.0.0.1:{port}", d / "engine.log", env=env, cwd=REPO, health_timeout=300,
                           name="the clean CPU engine (audio only)")
    leak_port = free_port(exclude={port})
    leak = ServerProcess([str(reference_python()), "-m", "runners.cpu_engine", "--port", str(leak_port), *models,
                          "--defect", "ref-leak"], f"http://127.0.0.1:{leak_port}", d / "leak.log", env=env, cwd=REPO,
                         health_timeout=300, name="the CPU engine with the seed's leak (audio only)")
    engine.start()
    try:
        leak.start()
        yield {"url": engine.url, "leak": leak.url, "tiny": tiny, "store": d / "store",
               "two": _suite(d, ["smoke-01", "smoke-02"]), "one": _suite(d, ["smoke-01"])}
    finally:
        leak.stop()
        engine.stop()


def run_refused(world, url: str, out: Path, suite: str = "two", *extra) -> tuple[int, str]:
    """`difftest run` of the suite against `url` at 2: (exit code, what it said)."""
    argv = [sys.executable, "-m", "difftest", "run", str(world[suite]), "--candidate", url, "-n", "2",
            "--no-repeat", "--reference-model", str(world["tiny"] / "base"), "--store", str(world["store"]),
            "--out", str(out), "--no-mlflow", *extra]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=out.parent)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return p.returncode, p.stdout + p.stderr


def run(world, url: str, out: Path, suite: str = "two", *extra) -> tuple[int, dict, str]:
    """The same, and the report it wrote."""
    code, said = run_refused(world, url, out, suite, *extra)
    return code, json.loads((out / "report.json").read_text()), said


def test_the_clean_engine_heard_alone_passes_and_says_codes_were_not_judged(world, tmp_path):
    code, rep, said = run(world, world["url"], tmp_path / "clean")
    assert code == 0, said
    assert {s["verdict"] for s in rep["segments"]} <= {"identical", "numeric_drift"}, said
    checks = rep["configuration_exercised"]["checks"]
    assert checks["codes"]["verdict"] == "pass" and "judged on audio alone" in checks["codes"]["summary"]
    assert checks["concurrency"]["verdict"] == "pass" and checks["concurrency"]["most_in_flight"] == 2
    assert checks["concurrency"]["engine_most_batched"] == 2  # the CPU engine's batch-size header


@pytest.mark.parametrize("mode", ["silence", "same", "late"])
def test_audio_that_is_not_the_reference_s_without_codes_is_no_pass(world, tmp_path, mode):
    proxy = HostileProxy(world["url"], mode)
    try:
        code, rep, said = run(world, proxy.url, tmp_path / mode)
    finally:
        proxy.close()
    assert code == 3 and rep["verdict"] == "error", said
    codes = rep["configuration_exercised"]["checks"]["codes"]
    assert codes["verdict"] == "error" and "nothing judged on codes" in codes["summary"], codes
    blind = [s["id"] for s in rep["segments"] if s["verdict"] == "audio_divergence"]
    assert codes["segments"] == blind and blind, rep["segments"]  # each one named
    assert "nothing judged on codes" in said  # the console says why there is no verdict


def test_an_8_bit_answer_is_the_segment_s_error_naming_it(world, tmp_path):
    proxy = HostileProxy(world["url"], "pcm8")
    try:
        code, rep, said = run(world, proxy.url, tmp_path / "pcm8")
    finally:
        proxy.close()
    assert code == 1 and rep["verdict"] == "fail", said
    for s in rep["segments"]:
        assert s["verdict"] == "error" and "audio is 8-bit pcm" in s["summary"], s["summary"]


def test_requests_the_engine_ran_one_at_a_time_are_said_to_be(world, tmp_path):
    """In flight together at the client, but a server in front of the engine let one through at a
    time: the CPU engine says it batched none together, and the run warns that batching went untested."""
    proxy = HostileProxy(world["url"], "serial")  # the right audio, one request at a time
    try:
        code, rep, said = run(world, proxy.url, tmp_path / "serial")
    finally:
        proxy.close()
    assert code == 0, said
    c = rep["configuration_exercised"]["checks"]["concurrency"]
    assert c["verdict"] == "pass" and c["most_in_flight"] == 2 and c["engine_most_batched"] == 1, c
    assert any("the engine says it ran each in a batch of its own" in w for w in rep["warnings"]), rep["warnings"]


def test_requests_never_in_flight_together_are_counted_as_such():
    """The spans of requests answered one before the next is sent: never two in flight (and an answer
    at the instant the next is sent is not together)."""
    from types import SimpleNamespace

    def r(a, b):
        return SimpleNamespace(meta={"in_flight": [a, b]})

    assert exercised.most_in_flight({"a": r(0, 1), "b": r(1, 2), "c": r(2.5, 3)}) == (1, [])
    assert exercised.most_in_flight({"a": r(0, 2), "b": r(1, 3), "c": r(1.5, 4)}) == (3, [])
    c = exercised.concurrency(4, {"a": r(0, 1), "b": r(1, 2)}, 2)
    assert c["verdict"] == "error" and "each request was answered before the next was sent" in c["summary"]
    assert exercised.concurrency(1, {"a": r(0, 1)}, 1) is None


def test_a_one_segment_suite_at_n_is_no_test_of_concurrency_and_n_1_says_so(world, tmp_path):
    code, rep, said = run(world, world["url"], tmp_path / "one", "one")
    assert code == 3, said
    assert "the suite has one segment" in rep["configuration_exercised"]["checks"]["concurrency"]["summary"]
    code, rep, said = run(world, world["url"], tmp_path / "at1", "two", "-n", "1")
    assert code == 0, said
    assert "concurrency" not in rep["configuration_exercised"]["checks"]
    assert any("concurrency 1: every request was served alone" in w for w in rep["warnings"]), rep["warnings"]


def test_a_leaking_build_redeployed_behind_the_same_url_is_not_judged_on_the_old_results(world, tmp_path):
    """The clean build, then the seed's leak behind the same URL saying the same version: the kept
    results are reused only after one wave of them, served again at N, comes back the same."""
    proxy = HostileProxy(world["url"], "pass")
    proxy.version = {"version": "0.30.0"}  # both builds say the same
    out = tmp_path / "redeployed"
    try:
        code, _, said = run(world, proxy.url, out)
        assert code == 0, said
        code, rep, said = run(world, proxy.url, out)  # the same server again: a wave re-served, then reused
        assert code == 0 and "candidate c=2: 2/2 segments, 2 cached" in said, said
        proxy.upstream = world["leak"]
        code, said = run_refused(world, proxy.url, out)
        assert code == 2, said
        assert "is not the one whose results are kept there" in said and "smoke-01, smoke-02" in said, said
        assert "--replace" in said
    finally:
        proxy.close()


def test_an_unidentified_url_candidate_s_results_are_reused_only_when_asked(world, tmp_path):
    out = tmp_path / "unidentified"  # the CPU engine has no GET /version
    code, _, said = run(world, world["url"], out)
    assert code == 0, said
    code, said = run_refused(world, world["url"], out)
    assert code == 2 and "says nothing of itself (no GET /version)" in said, said
    code, rep, said = run(world, world["url"], out, "two", "--reuse-unidentified")
    assert code == 0 and "candidate c=2: 2/2 segments, 2 cached" in said, said
