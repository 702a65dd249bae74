"""Every verdict on a hand-built case. The vocoder is tests/toy.py's test double."""

import numpy as np
import pytest
from toy import toy_codes, toy_decode, toy_evidence, toy_result

from difftest.records.report import build_report, overall
from difftest.verdicts.classify import Evidence, classify
from difftest.verdicts.policy import load_policy

CODES = toy_codes(40, 1)
REF_A = toy_codes(20, 2)  # this segment's reference codes
REF_B = toy_codes(15, 3)  # a co-batched request's
REF_C = toy_codes(12, 4)


def ev(cand, control=None, cross=True, donors=True, reference=None, **kw):
    cross_donors = {"b": toy_result("a", cand.codes, REF_B), "c": toy_result("a", cand.codes, REF_C)} if donors else {}
    return toy_evidence(cand, codes=CODES, own=REF_A, reference=reference, cross=cross, control=control,
                        cross_donors=cross_donors, peer_ref_codes={"b": REF_B, "c": REF_C}, **kw)


def test_identical(policy):
    v = classify(ev(toy_result("a", CODES, REF_A), toy_result("a", CODES, REF_A)), policy)
    assert (v.verdict, v.first_divergent_frame, v.first_divergent_chunk, v.stage, v.donor) == (
        "identical", None, None, None, None)
    assert v.comparisons["audio"]["worst_tier"] == "identical"


def test_numeric_drift(policy):
    wav = toy_decode(CODES, REF_A) + np.float32(3e-5)
    v = classify(ev(toy_result("a", CODES, REF_A, wav=wav), toy_result("a", CODES, REF_A, wav=wav)), policy)
    assert v.verdict == "numeric_drift"
    assert v.comparisons["audio"]["worst_tier"] == "close"


def test_quantised_audio_reaches_within_quantisation(policy):
    wav = np.rint(toy_decode(CODES, REF_A).astype(np.float64) * 32767) / 32768
    cand = toy_result("a", CODES, REF_A, wav=wav.astype(np.float32), quantised=True)
    v = classify(ev(cand), policy)
    assert v.verdict == "numeric_drift"
    assert v.comparisons["audio"]["worst_tier"] == "within_quantisation"
    # The same difference between two float signals is only "close".
    v = classify(ev(toy_result("a", CODES, REF_A, wav=wav.astype(np.float32))), policy)
    assert v.comparisons["audio"]["worst_tier"] == "close"


def test_the_log_mel_is_computed_only_where_it_can_decide_a_tier(policy, monkeypatch):
    """A chunk's log-mel matters only above close_max_abs (chunk_tiers): identical and close audio
    skip it (the common case, bench_compare), and say so; a divergence computes it."""
    import difftest.compare.chunks as chunks_module

    calls = []
    real = chunks_module.log_mel
    monkeypatch.setattr(chunks_module, "log_mel", lambda *a, **k: calls.append(1) or real(*a, **k))
    wav = toy_decode(CODES, REF_A) + np.float32(3e-5)
    v = classify(ev(toy_result("a", CODES, REF_A, wav=wav), toy_result("a", CODES, REF_A, wav=wav)), policy)
    assert v.verdict == "numeric_drift" and calls == []
    assert v.comparisons["audio"]["logmel_computed"] is False and set(v.comparisons["audio"]["chunks"]["logmel"]) == {0.0}
    garbled = toy_decode(CODES, REF_A)
    garbled[28 * 1920:] = np.flip(garbled[28 * 1920:])
    v = classify(ev(toy_result("a", CODES, REF_A, wav=garbled), toy_result("a", CODES, REF_A)), policy)
    assert v.verdict == "vocoder_defect" and calls
    assert v.comparisons["vocoder"]["logmel_computed"] is True and max(v.comparisons["vocoder"]["chunks"]["logmel"]) > 0


def test_code_divergence_not_caused_by_concurrency(policy):
    c = CODES.copy()
    c[30, 2] += 1
    cand = toy_result("a", c, REF_A)
    v = classify(ev(cand, toy_result("a", c, REF_A)), policy)
    assert (v.verdict, v.first_divergent_frame, v.first_divergent_chunk, v.stage) == ("code_divergence", 30, 2, "talker")
    assert v.comparisons["codes"]["codes_at_divergence"] == [CODES[30].tolist(), c[30].tolist()]


def test_reference_encoder_divergence(policy):
    other_ref = REF_A.copy()
    other_ref[-1, 0] += 1
    cand = toy_result("a", CODES, other_ref)
    v = classify(Evidence(segment_id="a", reference=toy_result("a", CODES, REF_A), candidate=cand,
                          control=toy_result("a", CODES, other_ref)), policy)
    assert (v.verdict, v.stage) == ("code_divergence", "reference_encoder")


def test_length_mismatch_same_codes_shorter(policy):
    cand = toy_result("a", CODES[:35], REF_A)
    v = classify(ev(cand, toy_result("a", CODES[:35], REF_A)), policy)
    assert (v.verdict, v.first_divergent_frame, v.stage) == ("length_mismatch", 35, "talker")


def test_concurrency_defect_in_codes(policy):
    c = CODES.copy()
    c[5:, 0] = (c[5:, 0] + 7) % 2048
    v = classify(ev(toy_result("a", c, REF_A), toy_result("a", CODES, REF_A)), policy)
    assert (v.verdict, v.first_divergent_frame, v.first_divergent_chunk, v.stage) == (
        "concurrency_defect", 5, 1, "talker")
    assert "code_divergence" in v.notes[-1]


def test_concurrency_defect_audio_only(policy):
    wav = toy_decode(CODES, REF_A)
    bad = wav.copy()
    bad[30 * 1920:31 * 1920] *= 0.5
    cand = toy_result("a", CODES, REF_A, wav=bad, has_codes=False)
    ctrl = toy_result("a", CODES, REF_A, wav=wav, has_codes=False)
    v = classify(Evidence(segment_id="a", reference=toy_result("a", CODES, REF_A), candidate=cand,
                          control=ctrl), policy)
    assert (v.verdict, v.first_divergent_frame, v.first_divergent_chunk, v.stage) == ("concurrency_defect", 30, 2, None)
    assert any("no codes" in n for n in v.notes)


def test_vocoder_defect(policy):
    wav = toy_decode(CODES, REF_A)
    wav[28 * 1920:] = np.flip(wav[28 * 1920:])  # the vocoder garbles chunk 2 on, same codes
    cand = toy_result("a", CODES, REF_A, wav=wav)
    v = classify(ev(cand, toy_result("a", CODES, REF_A)), policy)
    assert (v.verdict, v.first_divergent_chunk, v.stage, v.donor) == ("vocoder_defect", 2, "vocoder", None)
    assert v.first_divergent_frame == 28


def test_contamination_found_by_audio_names_the_donor(policy):
    # The seed's bug: the vocoder got request b's reference codes as left context.
    cand = toy_result("a", CODES, REF_A, wav=toy_decode(CODES, REF_B))
    v = classify(ev(cand, toy_result("a", CODES, REF_A)), policy)
    assert (v.verdict, v.first_divergent_frame, v.first_divergent_chunk, v.stage, v.donor) == (
        "contamination", 0, 0, "handoff", "b")
    assert v.comparisons["donor_search"]["chunks"] == [0, 1]  # onset only: frames 0-1 see the context


def test_contamination_found_by_captured_ref_codes(policy):
    cand = toy_result("a", CODES, REF_C, wav=toy_decode(CODES, REF_C))
    v = classify(ev(cand, toy_result("a", CODES, REF_A), cross=False), policy)
    assert (v.verdict, v.donor, v.stage, v.first_divergent_chunk) == ("contamination", "c", "handoff", 0)


def test_no_donor_when_nothing_explains_it(policy):
    cand = toy_result("a", CODES, REF_A, wav=toy_decode(CODES, toy_codes(9, 99)))
    v = classify(ev(cand, toy_result("a", CODES, REF_A)), policy)
    assert v.verdict == "vocoder_defect" and v.donor is None


def test_reference_left_in_output(policy):
    wav = np.concatenate([np.zeros(len(REF_A) * 1920, np.float32), toy_decode(CODES, REF_A)])
    v = classify(ev(toy_result("a", CODES, REF_A, wav=wav)), policy)
    assert (v.verdict, v.stage) == ("length_mismatch", "vocoder")
    assert "reference audio left in the output" in v.summary


def test_trailing_sample_is_not_a_mismatch(policy):
    wav = np.append(toy_decode(CODES, REF_A), np.float32(0.01))
    v = classify(Evidence(segment_id="a", reference=toy_result("a", CODES, REF_A, wav=wav),
                          candidate=toy_result("a", CODES, REF_A)), policy)
    assert v.verdict == "identical"
    assert any("trailing sample" in n for n in v.notes)


@pytest.mark.parametrize("make, kind, text", [
    (lambda: ev(toy_result("a", CODES, REF_A, wav=np.full(40 * 1920, np.nan, np.float32))), "candidate",
     "candidate audio holds NaN or infinity at sample 0"),
    (lambda: Evidence(segment_id="a", reference=toy_result("a", CODES, REF_A),
                      candidate=None), "infrastructure", "no candidate result"),
    (lambda: Evidence(segment_id="a", reference=toy_result("a", CODES, REF_A),
                      candidate=toy_result("a", CODES, REF_A),
                      errors=[{"source": "candidate", "kind": "candidate", "message": "HTTP 500"}]),
     "candidate", "candidate: HTTP 500"),
])
def test_errors(policy, make, kind, text):
    v = classify(make(), policy)
    assert (v.verdict, v.error_kind) == ("error", kind)
    assert text in v.summary


def test_overall_and_policy(policy, tmp_path):
    ok = classify(ev(toy_result("a", CODES, REF_A)), policy)
    c = CODES.copy()
    c[3, 3] += 1
    div = classify(ev(toy_result("a", c, REF_A), toy_result("a", c, REF_A)), policy)
    leak = classify(ev(toy_result("a", CODES, REF_A, wav=toy_decode(CODES, REF_B))), policy)
    infra = classify(Evidence(segment_id="a", reference=toy_result("a", CODES, REF_A), candidate=None), policy)
    assert overall([ok], policy) == ("pass", 0)
    assert overall([ok, div], policy) == ("pass", 0)  # code divergence alone is reported, not failed
    assert overall([ok, div, leak], policy) == ("fail", 1)
    assert overall([leak, infra], policy) == ("error", 3)
    strict = tmp_path / "p.yaml"
    strict.write_text(open(policy.source).read().replace("fail_on:\n", "fail_on:\n  - code_divergence\n"))
    assert overall([ok, div], load_policy(strict)) == ("fail", 1)
    rep = build_report([ok, div, leak], policy, concurrency=4)
    assert rep["verdict"] == "fail" and rep["exit_code"] == 1 and rep["failing"] == ["a"]
    assert rep["counts"] == {"identical": 1, "code_divergence": 1, "contamination": 1}
    for s in rep["segments"]:
        assert {"id", "verdict", "first_divergent_frame", "first_divergent_chunk", "stage", "donor"} <= set(s)


def test_bad_policy_is_named(tmp_path):
    from difftest.errors import BadInput
    p = tmp_path / "p.yaml"
    p.write_text("tiers: {quantisation_max_abs: 1e-4, close_max_abs: x, close_snr_db: 30, close_logmel: 0.1}\n")
    with pytest.raises(BadInput, match="tiers.close_max_abs: expected a number"):
        load_policy(p)
