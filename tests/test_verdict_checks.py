"""The verdict checks behind one interface (difftest/verdicts/check.py): the registry classify
walks, the verdicts each check declares, and a new verdict added without touching difftest."""

import numpy as np
import pytest
from toy import toy_codes, toy_evidence, toy_result

from difftest.verdicts.catalogue import RANK, Verdict
from difftest.verdicts.check import Check, Registry
from difftest.verdicts.checks import REGISTRY
from difftest.verdicts.classify import classify
from difftest.verdicts.evidence import Finding
from difftest.verdicts.headline import HEADLINE
from difftest.verdicts.usable import USABLE

CODES, OWN = toy_codes(40, 1), toy_codes(20, 2)


def test_every_finding_kind_has_a_check_that_gives_it():
    given = {k for c in (*REGISTRY.checks, *REGISTRY.rules) for k in c.gives}
    assert given == set(RANK)
    assert [c.name for c in REGISTRY.checks][:2] == ["usable", "served"] and REGISTRY.checks[-1] is HEADLINE


# The example the issue asks for: a verdict that is not in difftest, its row and its check, registered
# and judged. A candidate whose audio clips where qwen-tts's does not: placed above the vocoder's own
# finding (rank 6), whose departure the clipping explains.
CLIPPING = Verdict("clipping", 5.5, True, False, "#ff0000", "the candidate's audio clips where qwen-tts's does not")


def _clipping(ev, ctx):
    clipped = np.flatnonzero(np.abs(ev.candidate.wav) >= 0.999)
    if not len(clipped) or (np.abs(ev.reference.wav) >= 0.999).any():
        return []
    ctx.comps["clipping"] = {"samples": len(clipped)}
    return [Finding("clipping", f"{len(clipped)} samples clipped, from sample {clipped[0]}", frame=int(clipped[0]) // 1920,
                    stage="vocoder")]


EXAMPLE = REGISTRY.extended(Check("clipping", gives=("clipping",), judge=_clipping), before="headline",
                            verdicts=(CLIPPING,))


def test_a_new_verdict_is_its_row_and_its_check(policy):
    wav = toy_result("a", CODES, OWN).wav.copy()
    wav[30 * 1920 + 5: 30 * 1920 + 9] = 1.0
    v = classify(toy_evidence(toy_result("a", CODES, OWN, wav=wav), codes=CODES, own=OWN), policy, EXAMPLE)
    assert (v.verdict, v.first_divergent_frame, v.first_divergent_chunk, v.stage) == ("clipping", 30, 2, "vocoder")
    assert v.comparisons["clipping"] == {"samples": 4} and "also: vocoder_defect" in v.notes
    under = next(f for f in v.also if f["verdict"] == "vocoder_defect")  # the findings under it, whole
    assert under["stage"] == "vocoder" and under["summary"] and set(under) == {
        "verdict", "summary", "first_divergent_frame", "first_divergent_chunk", "stage", "donor", "donor_kind"}
    assert v.to_json()["also"] == v.also
    # the built-in registry never heard of it; a clean segment is still clean with it
    assert classify(toy_evidence(toy_result("a", CODES, OWN, wav=wav), codes=CODES, own=OWN), policy).verdict \
        == "vocoder_defect"
    assert classify(toy_evidence(toy_result("a", CODES, OWN), codes=CODES, own=OWN), policy, EXAMPLE).verdict \
        == "identical"
    assert "clipping" not in {c.name for c in REGISTRY.checks}


def test_a_check_cannot_give_what_it_does_not_declare(policy):
    liar = Check("liar", gives=("talker_defect",), judge=lambda ev, ctx: [Finding("contamination", "x")])
    with pytest.raises(ValueError, match="check 'liar' found \\['contamination'\\], which it does not declare"):
        classify(toy_evidence(toy_result("a", CODES, OWN), codes=CODES, own=OWN), policy,
                 REGISTRY.extended(liar, before="headline"))


def test_the_registry_refuses_a_verdict_without_a_place():
    with pytest.raises(ValueError, match="gives \\['clipping'\\]: not ranked"):
        REGISTRY.extended(Check("clipping", gives=("clipping",), judge=_clipping), before="headline")
    with pytest.raises(ValueError, match="share a rank"):
        REGISTRY.extended(Check("clipping", gives=("clipping",), judge=_clipping), before="headline",
                          verdicts=(Verdict("clipping", 6, True, False, "#f00", ""),))
    with pytest.raises(ValueError, match="named twice"):
        REGISTRY.extended(HEADLINE, before="headline")


def test_a_check_reading_another_is_judged_after_it_and_listed_before(policy):
    """Judged in the order of what reads what, listed in the registry's: the order decides which of
    two findings of one kind is the segment's summary."""
    calls = []

    def first(ev, ctx):
        read = ctx.of("second")
        calls.append("first")
        return [Finding("contamination", f"first, having read {len(read)} of second's")]

    def second(ev, ctx):
        calls.append("second")
        return [Finding("contamination", "second")]

    reg = Registry(checks=(USABLE, Check("first", ("contamination",), first), Check("second", ("contamination",), second),
                           HEADLINE), rules=())
    v = classify(toy_evidence(toy_result("a", CODES, OWN), codes=CODES, own=OWN), policy, reg)
    assert calls == ["second", "first"]  # each once
    assert (v.verdict, v.summary) == ("contamination", "first, having read 1 of second's")


def test_an_unusable_segment_stops_the_walk(policy):
    v = classify(toy_evidence(toy_result("a", CODES, OWN, wav=np.full(40 * 1920, np.nan, np.float32)), codes=CODES,
                              own=OWN), policy)
    assert (v.verdict, v.error_kind, v.notes, v.comparisons) == ("error", "candidate", [], {})


def test_a_check_that_does_not_apply_says_so(policy):
    v = classify(toy_evidence(toy_result("a", CODES, OWN), codes=CODES, own=OWN, cross=False), policy)
    assert v.verdict == "identical"
    assert "no cross-decode: vocoder stage not checked" in v.notes
    assert "no concurrency-1 control: concurrency invariance not checked" in v.notes
