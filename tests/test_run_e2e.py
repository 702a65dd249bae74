"""`difftest run` end to end on CPU: real qwen-tts (tiny checkpoint) against the CPU test engine.

The clean engine at concurrency 4 passes; the seed's bug (ref-leak) at 4 fails with contamination on
the right segments, at the onset chunk, with the right donor; at 1 the same engine is clean.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from reference_support import reference_python

from difftest.results import load_result_set

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "cases" / "suites" / "smoke.yaml"


def difftest(*args, cwd):
    p = subprocess.run([sys.executable, "-m", "difftest", *map(str, args)], capture_output=True, text=True,
                       cwd=cwd, timeout=900)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    reference_python()
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def clean(store, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    return (out,) + difftest("run", SMOKE, "--candidate", "cpu-engine", "-n", "4", "--out", out, "--store", store,
                             cwd=out)


@pytest.fixture(scope="module")
def leak(store, clean, tmp_path_factory):
    out = tmp_path_factory.mktemp("leak")
    return (out,) + difftest("run", SMOKE, "--candidate", "cpu-engine:ref-leak", "-n", "4", "--out", out,
                             "--store", store, cwd=out)


def test_clean_engine_passes(clean):
    out, code, stdout, stderr = clean
    assert code == 0, stdout + stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["verdict"] == "pass" and rep["concurrency"] == 4
    assert {s["verdict"] for s in rep["segments"]} <= {"identical", "numeric_drift"}
    assert rep["candidate"]["engine"] == "difftest CPU test engine (not vLLM-Omni)"
    # Real batching happened: the wave of 4 went together, and every segment was captured.
    assert rep["candidate"]["batches"] == [["smoke-01", "smoke-02", "smoke-03", "smoke-04"]]
    for s in rep["segments"]:
        assert s["comparisons"]["codes"]["frames_differing"] == 0
        assert s["comparisons"]["vocoder"]["worst_tier"] in ("identical", "within_quantisation")
    assert rep["at_concurrency_1"]["verdict"] == "pass"
    assert "reference [4/4]" in stderr and "candidate c=4" in stderr  # progress was shown


def test_ref_leak_is_caught_with_chunk_stage_and_donor(leak):
    out, code, stdout, stderr = leak
    assert code == 1, stdout + stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    by_id = {s["id"]: s for s in rep["segments"]}
    # Ground truth from the files, independently of the verdicts: what reference codes did each
    # request's vocoder get at N, and whose are they at 1?
    at_n, _ = load_result_set(next((out / "results").glob("candidate-c4")))
    at_1, _ = load_result_set(next((out / "results").glob("candidate-c1")))
    truth = {}
    for sid, r in at_n.items():
        owners = [o for o, c in at_1.items() if np.array_equal(c.ref_codes, r.ref_codes)]
        truth[sid] = None if sid in owners else owners
    leaked = {sid for sid, owners in truth.items() if owners}
    assert leaked, "the planted leak must change some request's reference codes at concurrency 4"
    for sid, s in by_id.items():
        if sid in leaked:
            assert (s["verdict"], s["stage"], s["first_divergent_chunk"]) == ("contamination", "handoff", 0), s
            assert s["donor"] in truth[sid]
            # The audio route agrees: decoding with the donor's reference explains the audio.
            search = s["comparisons"]["donor_search"]
            best = min(search["peers_logmel"], key=search["peers_logmel"].get)
            assert best in truth[sid] and search["peers_logmel"][best] < 0.5 * search["own_logmel"]
        else:
            assert s["verdict"] in ("identical", "numeric_drift"), s
    assert rep["at_concurrency_1"]["verdict"] == "pass"  # the same engine, one request at a time: clean
    assert "contamination" in stdout and "donor" in stdout


def test_rerun_reuses_everything(leak, store):
    out = leak[0]
    before = {p: p.stat().st_mtime_ns for p in (out / "results").rglob("*.npz")}
    code, stdout, stderr = difftest("run", SMOKE, "--candidate", "cpu-engine:ref-leak", "-n", "4", "--out", out,
                                    "--store", store, cwd=out)
    assert code == 1
    after = {p: p.stat().st_mtime_ns for p in (out / "results").rglob("*.npz")}
    assert after == before  # no result recomputed, no cross-decode redone
    assert "reference [4/4] smoke-04: cached" in stderr


@pytest.mark.heavy
def test_a_new_run_folder_takes_the_cross_decodes_from_the_store(clean, store, tmp_path):
    """The same clean engine into a fresh folder: its codes are the first run's, so every
    cross-decode (and every score) comes from the store, and the reference model is never loaded."""
    code, stdout, stderr = difftest("run", SMOKE, "--candidate", "cpu-engine", "-n", "4", "--out", tmp_path / "again",
                                    "--store", store, cwd=tmp_path)
    assert code == 0, stdout + stderr[-3000:]
    first, again = clean[0] / "results" / "cross", tmp_path / "again" / "results" / "cross"
    names = sorted(p.name for p in first.glob("*.npz") if not p.name.endswith(".in.npz"))
    assert len(names) == 4 and names == sorted(p.name for p in again.glob("*.npz"))
    for name in names:  # the same decode, byte for byte, in the new run's own folder
        assert (first / name).read_bytes() == (again / name).read_bytes()
    rep = json.loads((tmp_path / "again" / "report.json").read_text())
    assert all(s["artifacts"]["cross_own"].startswith(str(again)) for s in rep["segments"])
    log = (tmp_path / "again" / "logs" / "reference-runner.log").read_text()
    assert "loading the base model" not in log and "loading the base model" not in stderr, stderr[-2000:]


def test_bad_inputs_exit_2(store, tmp_path):
    code, _, err = difftest("run", SMOKE, "--candidate", "ftp://nope", "--out", tmp_path, "--store", store,
                            cwd=tmp_path)
    assert code == 2 and "expected a server URL" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsegments: []\n")
    code, _, err = difftest("run", bad, "--candidate", "cpu-engine", "--out", tmp_path, "--store", store,
                            cwd=tmp_path)
    assert code == 2 and "bad.yaml: decode.repetition_penalty: is required" in err


def test_dead_candidate_server_is_infrastructure(store, tmp_path):
    code, _, err = difftest("run", SMOKE, "--candidate", "http://127.0.0.1:9", "--out", tmp_path, "--store", store,
                            cwd=tmp_path)
    assert code == 3 and "not healthy" in err
