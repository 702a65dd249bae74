"""A request field the engine did not apply is a defect judged where the request is mapped to the
talker, not an `error`: #3217 reverted (max_new_tokens ignored) read as "the tester could not
judge" for a defect it had fully diagnosed (issue 57, item 6)."""

from pathlib import Path

import numpy as np
import pytest
from toy import toy_codes, toy_result

from difftest.engines import capture
from difftest.verdicts.classify import Evidence, classify


def over_length_error() -> dict:
    arrays = {"codes": np.zeros((40, 16), np.int64)}
    with pytest.raises(capture.OverLength) as e:
        capture.validate(arrays, Path("a.npz"), max_frames=8)
    return {"source": "candidate", "kind": "candidate", "message": str(e.value), **capture.defect_of(e.value)}


def test_generation_past_max_new_tokens_is_a_talker_input_defect_that_fails(policy):
    err = over_length_error()
    assert (err["defect"], err["stage"]) == ("talker_defect", "talker_input")
    v = classify(Evidence(segment_id="a", reference=toy_result("a", toy_codes(8, 1), toy_codes(4, 2)), candidate=None,
                          errors=[err]), policy)
    assert (v.verdict, v.stage, v.first_divergent_chunk) == ("talker_defect", "talker_input", 0)
    assert "40 frames, more than the request's max_new_tokens (8) allows: the engine did not apply the request's " \
           "max_new_tokens" in v.summary
    assert policy.fails(v.verdict) and v.error_kind is None


def test_other_unusable_captures_stay_errors(policy):
    with pytest.raises(capture.CaptureError) as e:
        capture.validate({"codes": np.full((3, 16), 5000, np.int64)}, Path("a.npz"))
    assert capture.defect_of(e.value) == {}
    err = {"source": "candidate", "kind": "candidate", "message": str(e.value)}
    v = classify(Evidence(segment_id="a", reference=toy_result("a", toy_codes(8, 1), toy_codes(4, 2)), candidate=None,
                          errors=[err]), policy)
    assert (v.verdict, v.error_kind) == ("error", "candidate")


def test_a_runner_may_report_only_that_defect():
    from difftest.engines.runner_candidate import error_of

    err = over_length_error()
    ev = {"kind": "engine", "message": err["message"], "defect": "talker_defect", "stage": "talker_input"}
    assert error_of(ev) == {"source": "candidate", "kind": "candidate", "message": err["message"],
                            "defect": "talker_defect", "stage": "talker_input"}
    for hostile in ({"defect": "identical", "stage": "talker_input"}, {"defect": "talker_defect", "stage": "vocoder"},
                    {"defect": ["x"], "stage": None}):
        assert "defect" not in error_of({"kind": "engine", "message": "m", **hostile})
    assert error_of({"kind": "capture"})["kind"] == "infrastructure"
