"""The talker's input (capture schema v3) against qwen-tts's, field by field: each prompt defect
family of vLLM-Omni's history is named at stage talker_input with its field, a leaked field with
its donor, and a clean input passes. In the toy engine's terms (numpy only)."""

import numpy as np
import pytest
from toy import toy_codes, toy_evidence, toy_result

from difftest.engines import capture
from difftest.verdicts.classify import Evidence, classify

CODES = toy_codes(40, 1)
OWN = toy_codes(20, 2)
EOS = 2150


def inputs(text=(151644, 77091, 198, 9707, 1879, 151645), lang=2050, emb_seed=0, ref=OWN, ref_text=(11, 12),
           dtype="float32", non_streaming=0):
    emb = np.random.default_rng(emb_seed).standard_normal(64).astype(np.float32)
    return {"input_text_ids": np.array(text, np.int64), "input_instruct_ids": np.zeros(0, np.int64),
            "input_ref_text_ids": np.array(ref_text, np.int64), "input_ref_codes": ref,
            "input_codec_prefill": np.array([2154, 2156, lang, 2157], np.int64),
            "input_speaker_id": np.zeros(0, np.int64), "input_speaker_embedding": emb,
            "input_speaker_dtype": np.array(dtype), "input_non_streaming": np.array(non_streaming)}


def talker(ref=OWN):
    return {"talker_ref_codes": ref, "talker_prompt": np.array([0, 0, len(ref)]),
            "talker_tokens": np.append(CODES[:, 0], EOS)}


def ev(mine, control=None, others=None, peers=("b",), theirs=None):
    """Segment a at concurrency N, whose talker got `mine`; qwen-tts built `theirs` (default: the
    clean input). `others`: qwen-tts's inputs of the run's other segments."""
    ref = toy_result("a", CODES, OWN, extra=inputs() if theirs is None else theirs)
    cand = toy_result("a", CODES, OWN, extra={**talker(), **mine})
    ctrl = None if control is None else toy_result("a", CODES, OWN, extra={**talker(), **control})
    return toy_evidence(cand, codes=CODES, own=OWN, reference=ref, control=ctrl,
                        peer_ref_codes={p: OWN for p in peers}, other_inputs=others or {})


def test_the_same_input_passes_and_says_it_was_compared(policy):
    v = classify(ev(inputs(), control=inputs()), policy)
    assert v.verdict == "identical", v.summary
    assert v.comparisons["talker_input"] == {"differ": [], "speaker_max_abs": 0.0}


@pytest.mark.parametrize("field, mine, where", [
    ("codec prefill (language)", inputs(lang=2051), 2),  # another language tag
    ("text ids", inputs(text=(151644, 77091, 198, 9707, 151645)), 4),  # a dropped word
    ("speaker embedding", {**inputs(), "input_speaker_embedding": inputs()["input_speaker_embedding"] * 0.9}, 0),
    ("reference codes", inputs(ref=OWN[:2]), 2),  # a truncated in-context prompt
    ("non-streaming layout", inputs(non_streaming=1), 0),
])
def test_a_wrong_field_is_a_talker_defect_at_talker_input_naming_it(policy, field, mine, where):
    v = classify(ev(mine), policy)
    assert (v.verdict, v.stage, v.first_divergent_chunk, v.donor) == ("talker_defect", "talker_input", 0, None), v.summary
    assert v.summary.startswith(f"the talker's input differs from qwen-tts's in its {field}, at position {where}: ")
    assert policy.fails(v.verdict)


def test_a_voice_both_encoders_got_wrong_is_placed_at_the_reference_encoder(policy):
    """ref-audio-rate's shape: the x-vector and the reference codes both differ from qwen-tts's
    encoders on the same voice, and the prompt holds what the engine's encoder made (consistently)."""
    other = toy_codes(21, 5)
    mine = {**inputs(ref=other), "input_speaker_embedding": inputs(emb_seed=3)["input_speaker_embedding"]}
    cand = toy_result("a", CODES, other, extra={**talker(other), **mine})
    v = classify(Evidence(segment_id="a", reference=toy_result("a", CODES, OWN, extra=inputs()), candidate=cand,
                          control=None, cross_own=toy_result("a", CODES, other),
                          cross_donors={}, peer_ref_codes={"b": OWN}), policy)
    assert (v.verdict, v.stage) == ("reference_encoder_defect", "reference_encoder"), v.summary
    assert v.comparisons["talker_input"]["differ"] == ["input_speaker_embedding"]  # the codes: the encoder's


def test_a_speaker_embedding_from_another_request_names_it_as_the_donor(policy):
    b = inputs(emb_seed=7)
    leaked = {**inputs(), "input_speaker_embedding": b["input_speaker_embedding"]}
    v = classify(ev(leaked, control=inputs(), others={"b": b, "c": inputs(emb_seed=8)}), policy)
    assert (v.verdict, v.stage, v.donor, v.donor_kind) == ("contamination", "talker_input", "b", "speaker embedding")
    assert v.summary == "the talker was prompted with b's speaker embedding at concurrency N (right at 1)"


def test_a_language_like_another_requests_names_a_donor_only_when_co_batched_and_right_at_one(policy):
    other = inputs(lang=2051)
    # right at 1, wrong at N, equal to a co-batched request's: that request's
    v = classify(ev(inputs(lang=2051), control=inputs(), others={"b": other}), policy)
    assert (v.verdict, v.donor, v.donor_kind) == ("contamination", "b", "language")
    # wrong at 1 as well: a defect of its own, however many requests share that language
    v = classify(ev(inputs(lang=2051), control=inputs(lang=2051), others={"b": other}), policy)
    assert (v.verdict, v.donor, v.stage) == ("talker_defect", None, "talker_input")
    assert "at concurrency 1 as well" in v.summary
    # right at 1, but the request with that language was not in its batch
    v = classify(ev(inputs(lang=2051), control=inputs(), others={"z": other}, peers=()), policy)
    assert (v.verdict, v.donor) == ("talker_defect", None)


def test_a_speaker_embedding_in_another_dtype_is_not_judged_and_the_notes_say_so(policy):
    bf16 = {**inputs(), "input_speaker_embedding": inputs()["input_speaker_embedding"] + 0.01,
            "input_speaker_dtype": np.array("bfloat16")}
    v = classify(ev(bf16), policy)
    assert v.verdict == "identical"
    assert any(n.startswith("speaker embedding not judged: the candidate's is bfloat16, qwen-tts's float32")
               for n in v.notes), v.notes


def test_without_a_captured_input_nothing_is_compared_and_the_notes_say_so(policy):
    v = classify(Evidence(segment_id="a", reference=toy_result("a", CODES, OWN, extra=inputs()),
                          candidate=toy_result("a", CODES, OWN, extra=talker()),
                          control=None, cross_own=toy_result("a", CODES, OWN)), policy)
    assert v.verdict == "identical" and "talker_input" not in v.comparisons
    assert any(n.startswith("the talker's input was not captured") for n in v.notes)


def test_a_capture_round_trips_the_input_and_refuses_a_broken_one(tmp_path):
    good = {"codes": CODES, "ref_codes": OWN, "wav": np.zeros(40 * 1920, np.float32), **talker(), **inputs()}
    cap = capture.load(capture.write(tmp_path / "ok.npz", good))
    assert set(cap.inputs) == set(capture.INPUT) and str(cap.inputs["input_speaker_dtype"]) == "float32"
    assert np.array_equal(cap.stage_arrays()["input_ref_codes"], OWN)
    partial = {k: v for k, v in good.items() if k != "input_codec_prefill"}
    with pytest.raises(capture.CaptureError, match="the input_\\* arrays come together; input_codec_prefill missing"):
        capture.load(capture.write(tmp_path / "partial.npz", partial))
    with pytest.raises(capture.CaptureError, match="the talker's input was not captured \\(no builder hook\\)"):
        capture.load(capture.write(tmp_path / "missing.npz", {**good, "input_missing": np.array("no builder hook")}))
    with pytest.raises(capture.CaptureError, match="input_text_ids must be a row of integers >= 0"):
        capture.load(capture.write(tmp_path / "neg.npz", {**good, "input_text_ids": np.array([-1, 3])}))
    with pytest.raises(capture.CaptureError, match="input_speaker_embedding must be a row of finite floats"):
        capture.load(capture.write(tmp_path / "nan.npz", {**good, "input_speaker_embedding": np.array([np.nan])}))


def _bf16(a):
    """float32 values rounded to bf16 (round-to-nearest-even on the top 16 bits), as float32."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def test_a_bf16_speaker_embedding_is_judged_exactly_against_qwen_tts_in_bf16(policy):
    """vLLM-Omni's x-vector is bf16; the reference carries qwen-tts's own in bf16 (its twin): equal
    passes, scaled is named, and another request's twin names that request."""
    theirs = {**inputs(), "speaker_embedding_bf16": _bf16(inputs()["input_speaker_embedding"])}
    own = {**inputs(dtype="bfloat16"), "input_speaker_embedding": theirs["speaker_embedding_bf16"]}
    v = classify(ev(own, control=own, theirs=theirs), policy)
    assert v.verdict == "identical", v.summary
    assert v.comparisons["talker_input"]["speaker_max_abs_bf16"] == 0.0
    assert v.comparisons["talker_input"]["speaker_max_abs"] > 0  # against the float32 one: bf16's rounding
    scaled = {**own, "input_speaker_embedding": _bf16(theirs["input_speaker_embedding"] * 0.9)}
    v = classify(ev(scaled, theirs=theirs), policy)
    assert (v.verdict, v.stage) == ("talker_defect", "talker_input") and "speaker embedding" in v.summary
    b = {**inputs(emb_seed=5), "speaker_embedding_bf16": _bf16(inputs(emb_seed=5)["input_speaker_embedding"])}
    leaked = {**own, "input_speaker_embedding": b["speaker_embedding_bf16"]}
    v = classify(ev(leaked, control=own, others={"b": b}, theirs=theirs), policy)
    assert (v.verdict, v.donor, v.donor_kind) == ("contamination", "b", "speaker embedding"), v.summary
    # without a twin (a reference from before it was recorded) the bf16 embedding is not judged
    v = classify(ev(scaled, control=scaled), policy)
    assert v.verdict == "identical" and any("speaker embedding not judged" in n for n in v.notes), v.notes


def test_a_bf16_speaker_embedding_may_be_as_far_from_the_twin_as_bf16_moves_qwen_tts_and_no_further(policy):
    """The allowance is max |twin - float32| for this voice (here 0.1): a rounding flip inside it
    passes (vLLM-Omni 0.30.0 on smoke: 0.0625 against 0.102), a shift just outside it is named."""
    f32 = inputs()["input_speaker_embedding"]
    twin = f32.copy()
    twin[3] += 0.1
    theirs = {**inputs(), "speaker_embedding_bf16": twin}
    flip = twin.copy()
    flip[7] += 0.0625
    v = classify(ev({**inputs(dtype="bfloat16"), "input_speaker_embedding": flip}, theirs=theirs), policy)
    assert v.verdict == "identical", v.summary
    assert v.comparisons["talker_input"]["speaker_allowed_bf16"] == pytest.approx(0.1, abs=1e-6)
    off = twin.copy()
    off[7] += 0.11
    v = classify(ev({**inputs(dtype="bfloat16"), "input_speaker_embedding": off}, theirs=theirs), policy)
    assert (v.verdict, v.stage) == ("talker_defect", "talker_input"), v.summary
    assert "speaker embedding, at position 7" in v.summary and "(qwen-tts in bf16)" in v.summary


def test_a_scaled_bf16_x_vector_beside_bf16_encoder_codes_is_the_talker_input_not_the_encoder(policy):
    """vLLM-Omni's shape (the planted speaker-scaled-0.9 on the real server): its bf16 encoder's
    reference codes differ from float32 qwen-tts's by numerics, within the encoder check's line,
    so a scaled x-vector is the prompt's defect, not audio that reached both encoders changed."""
    near = OWN.copy()
    near[::10, 3] = (near[::10, 3] + 1) % 2048  # 5% of frames move one entry: ~99.7% agree
    theirs = {**inputs(), "speaker_embedding_bf16": _bf16(inputs()["input_speaker_embedding"])}
    scaled = {**inputs(dtype="bfloat16", ref=near),
              "input_speaker_embedding": _bf16(theirs["input_speaker_embedding"] * 0.9)}
    cand = toy_result("a", CODES, near, extra={**talker(near), **scaled})
    ref = toy_result("a", CODES, OWN, extra=theirs)
    v = classify(Evidence(segment_id="a", reference=ref, candidate=cand, control=None,
                          cross_own=toy_result("a", CODES, near), cross_donors={}, peer_ref_codes={"b": OWN}), policy)
    assert (v.verdict, v.stage) == ("talker_defect", "talker_input"), v.summary
    assert "speaker embedding" in v.summary
