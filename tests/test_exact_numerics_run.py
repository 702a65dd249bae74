"""Issue 57, item 1, end to end: a candidate in qwen-tts's own numerics gets no allowance. The CPU
test engine (float32: qwen-tts itself, so its measured null is the reference) with a clone's speaker
embedding scaled by 0.9 and its capture holding no talker input (`--talker-capture no-input`: the
ingredient comparison cannot see the embedding), at concurrency 1, on smoke: every segment whose codes
leave qwen-tts's by more than a float32 tie is a talker_defect at the talker, where they first leave;
one that leaves it only on a tie is named a suspect; the clean engine, captured the same way, passes. Real qwen-tts; a file of its own (a test worker each)."""

import numpy as np
import pytest

from reference_support import REPO, reference_python

from difftest.engines.start import CPU_ENGINE, CandidateSpec
from difftest.results import read_result
from difftest.run import RunOptions, run
from difftest.suites.suite import load_suite
from difftest.verdicts.policy import load_policy

# The full tier (docs/ci.md, `bash scripts/test.sh --all`): one run end to end; its parts are
# unit-tested in test_verdicts_forced.py.
pytestmark = pytest.mark.heavy

BLIND = ("--talker-capture", "no-input")


def _run(tmp_path, defect, name):
    spec = CandidateSpec(CPU_ENGINE, defect=defect, engine_args=BLIND)
    return run(load_suite(REPO / "cases" / "suites" / "smoke.yaml"), spec, tmp_path / name, load_policy(),
               RunOptions(concurrency=1, repeat=False, store=tmp_path / "store"))


def test_a_scaled_speaker_embedding_fails_every_affected_segment_without_the_talker_input(tmp_path):
    reference_python()
    clean = _run(tmp_path, None, "clean")
    assert clean["verdict"] == "pass", [(s["id"], s["verdict"], s["summary"]) for s in clean["segments"]]
    for s in clean["segments"]:  # the ingredient comparison did not run: the capture held no input
        assert "talker_input" not in s["comparisons"], s["comparisons"].keys()
        assert s["comparisons"]["forced"]["exact_tie_gap"] == 5e-5 and s["comparisons"]["forced"]["worst_rank"] == 0

    rep = _run(tmp_path, "speaker-scaled", "scaled")
    assert rep["verdict"] == "fail"
    by_id = {s["id"]: s for s in rep["segments"]}
    affected, failed, ties = [], [], []
    for s in rep["segments"]:
        ref = read_result(s["artifacts"]["reference"]).codes
        cand = read_result(s["artifacts"]["candidate"]).codes
        n = min(len(ref), len(cand))
        if ref.shape == cand.shape and (ref == cand).all():
            assert s["verdict"] in ("identical", "numeric_drift"), (s["id"], s["verdict"])
            continue
        affected.append(s["id"])
        first = int(np.argwhere(ref[:n] != cand[:n])[0][0])
        tie = s["comparisons"]["forced"].get("float32_ties")
        if tie is None:  # a token off qwen-tts's top-1 past the line: failed alone, where its codes first leave
            failed.append(s["id"])
            assert (s["verdict"], s["stage"]) == ("talker_defect", "talker"), (s["id"], s["verdict"], s["summary"])
            assert "off qwen-tts's top-1 by more than a float32 tie" in s["summary"], s["summary"]
            assert "qwen-tts's own numerics (float32" in s["summary"], s["summary"]
            assert s["first_divergent_frame"] >= first and s["first_divergent_chunk"] is not None, s
        else:  # its only departure lies on a float32 tie: named as a suspect, not failed (a tolerance is a measurement)
            ties.append(s["id"])
            assert tie["gap"] <= 5e-5 and tie["first"][0] == first, tie
            assert any(x.startswith("suspect: its codes leave qwen-tts's top-1 only on float32 ties") for x in s["notes"])
    # smoke on this checkpoint: smoke-02's codes unmoved; smoke-03 and -04 leave the top-1 by 1.2e-4 and 5.5e-4
    # nats; smoke-01 by 2.1e-5 at one token, inside float32's own 2.5e-5 (benchmarks/bench_f32_tie.py)
    assert len(failed) >= 2 and len(affected) >= 3, (failed, ties, affected)
    assert set(rep["failing"]) == set(failed), (rep["failing"], failed)
    assert rep["at_concurrency_1"]["verdict"] == "fail"
