"""Numerics against the last release (difftest/verdicts/numerics.py), on report.json findings built
by the measured null's own judge from score files made here: what is paired, the tests made, and
the decisions."""

import pytest
from test_verdicts_null import NUMERICS, _sf

from difftest.verdicts import null
from difftest.verdicts.null import NullPolicy
from difftest.verdicts.numerics import NumericsPolicy, compare


def _report(sub: list[int], talker: list[int] | None = None, flips: int | None = None, n_segments: int = 6,
            at_n: bool = False) -> dict:
    """A report whose run at 1 has, per segment, `talker[i]` codebook-0 and `sub[i]` codebook-1-15
    tokens off qwen-tts's top-1 (600 scored of the latter per segment, 40 of the former); with
    `flips`, a run at N whose codes part from those at 1 in that many of `n_segments` segments (with
    `at_n`, its token counts at N are those at 1)."""
    talker = talker or [0] * len(sub)
    scores = {f"s{i}": _sf(t, k, sid=f"s{i}") for i, (t, k) in enumerate(zip(talker, sub))}
    rep = {"measured_null": null.judge(scores, scores, NullPolicy(), NUMERICS), "measured_null_at_n": None}
    if flips is not None:
        rep["measured_null_at_n"] = {"segments": rep["measured_null"]["segments"] if at_n else {},
                                     "flips": {"candidate": flips, "segments": n_segments, "null": 0}}
    return rep


def test_the_same_counts_pass_and_the_finding_shows_both_runs():
    base = _report([20, 18, 22, 19])
    got = compare(_report([20, 18, 22, 19]), base, NumericsPolicy(), "0.30.0")
    assert got["verdict"] == "pass" and got["stage"] is None
    cp = next(t for t in got["tests"] if t["site"] == "code_predictor")
    assert cp["run"] == cp["baseline"] == [79, 2400] and cp["ratio"] == 1.0 and cp["segments"] == 4
    assert got["alpha"] == pytest.approx(0.005)  # 1% over two sites at concurrency 1
    assert "0.30.0" in got["summary"]


def test_a_code_predictor_off_its_top1_more_often_is_a_numerics_regression_at_the_code_predictor():
    got = compare(_report([40, 36, 44, 38]), _report([20, 18, 22, 19]), NumericsPolicy(), "0.30.0")
    assert (got["verdict"], got["stage"], got["site"], got["concurrency"]) == (
        "numerics_regression", "talker", "code_predictor", "at concurrency 1")
    assert got["effect"] == pytest.approx(158 / 79, abs=1e-3)
    assert "158/2400" in got["summary"] and "79/2400" in got["summary"]


def test_a_run_closer_to_qwen_tts_than_the_baseline_is_no_regression():
    assert compare(_report([5, 4, 6, 5]), _report([20, 18, 22, 19]), NumericsPolicy())["verdict"] == "pass"


def test_the_margin_excuses_what_it_says():
    run, base = _report([24, 22, 26, 23]), _report([20, 18, 22, 19])  # 95 against 79: 1.2x
    p_exact = next(t["p_value"] for t in compare(run, base, NumericsPolicy())["tests"] if t["site"] == "code_predictor")
    p_margin = next(t["p_value"] for t in compare(run, base, NumericsPolicy(rate_margin=1.2))["tests"]
                    if t["site"] == "code_predictor")
    assert p_margin > p_exact and p_margin > 0.4


def test_only_segments_scored_in_both_runs_are_paired():
    run = _report([40, 36, 44, 38, 500])
    got = compare(run, _report([20, 18, 22, 19]), NumericsPolicy())
    cp = next(t for t in got["tests"] if t["site"] == "code_predictor")
    assert cp["segments"] == 4 and cp["run"] == [158, 2400]


def test_batch_variance_grown_at_n_is_tested_as_segments_that_part():
    base = _report([20, 18, 22, 19], flips=1, n_segments=20)
    got = compare(_report([20, 18, 22, 19], flips=12, n_segments=20), base, NumericsPolicy())
    assert (got["verdict"], got["site"], got["concurrency"]) == ("numerics_regression", "batch", "at concurrency N")
    assert got["alpha"] == pytest.approx(0.01 / 3)
    assert compare(_report([20, 18, 22, 19], flips=2, n_segments=20), base, NumericsPolicy())["verdict"] == "pass"


def test_reports_without_counts_are_not_compared_and_say_why():
    got = compare({"measured_null": None}, _report([1, 2]), NumericsPolicy())
    assert got["verdict"] == "not_compared" and "this run has no teacher-forced counts" in got["summary"]


def test_tokens_at_n_that_are_the_tokens_at_1_in_both_runs_are_tested_once():
    """Where no stream at N parts from its stream at 1 in either run, the counts at N are the counts at
    1: testing them again would only halve the false-flag rate each test gets."""
    base = _report([20, 18, 22, 19], flips=0, n_segments=4, at_n=True)
    got = compare(_report([30, 27, 33, 29], flips=0, n_segments=4, at_n=True), base, NumericsPolicy())
    assert {(t["concurrency"], t["site"]) for t in got["tests"]} == {
        ("at concurrency 1", "talker"), ("at concurrency 1", "code_predictor"), ("at concurrency N", "batch")}
    assert "the codes are those at concurrency 1 in both runs" in got["notes"][0]
    moved = compare(_report([30, 27, 33, 29], flips=1, n_segments=4, at_n=True), base, NumericsPolicy())
    assert len(moved["tests"]) == 5  # a stream at N moved: its tokens at N are other tokens, tested too
