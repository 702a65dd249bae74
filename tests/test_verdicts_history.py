"""The history check: a segment served again at concurrency 1, after every other segment, must agree
with its first serving; where it does not, the engine's output depends on what it served before."""

import numpy as np
from toy import toy_codes, toy_evidence, toy_result

from difftest.verdicts.classify import Evidence, classify

CODES = toy_codes(40, 1)
OWN = toy_codes(20, 2)
EARLIER = toy_codes(24, 3)  # the reference codes of a segment served before the repeat


def ev(repeat, history=None):
    first = toy_result("a", CODES, OWN)
    return toy_evidence(first, codes=CODES, own=OWN, control=first, history_ref_codes=history or {}, repeat=repeat)


def test_the_same_output_after_another_history_is_clean(policy):
    v = classify(ev(toy_result("a", CODES, OWN)), policy)
    assert v.verdict == "identical" and v.comparisons["repeat_codes"]["frames_differing"] == 0


def test_other_codes_after_another_history_are_a_history_defect(policy):
    later = CODES.copy()
    later[7:, 0] = (later[7:, 0] + 1) % 2048
    v = classify(ev(toy_result("a", later, OWN)), policy)
    assert (v.verdict, v.stage, v.first_divergent_frame) == ("history_defect", "talker", 7)
    assert v.summary.startswith("codes served again after the other segments differ from its first serving from frame 7")
    assert policy.fails(v.verdict)


def test_other_audio_after_another_history_is_a_history_defect(policy):
    wav = toy_result("a", CODES, OWN).wav.copy()
    wav[1920 * 30:] *= 0.5  # the same codes, the vocoder's output changed late in the segment
    v = classify(ev(toy_result("a", CODES, OWN, wav=wav)), policy)
    assert (v.verdict, v.stage) == ("history_defect", "vocoder")
    assert "served again after the other segments leaves its first serving's from chunk" in v.summary


def test_a_reference_left_behind_by_an_earlier_request_names_it(policy):
    v = classify(ev(toy_result("a", CODES, EARLIER), history={"b": EARLIER}), policy)
    assert (v.verdict, v.stage, v.donor, v.donor_kind) == ("contamination", "handoff", "b", "codes")
    assert "served again after the other segments, its vocoder got b's reference codes (served earlier)" in v.summary
