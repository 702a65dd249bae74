"""Stage-boundary judgement: the capture's talker side (schema v2) against what the hand-off
delivered. Each case is a hand-off bug from vLLM-Omni's history, in the toy engine's terms."""

import numpy as np
from toy import toy_codes, toy_evidence, toy_result

from difftest.verdicts.classify import Evidence, classify

CODES = toy_codes(40, 1)
OWN = toy_codes(20, 2)  # what a's talker was prompted with
OTHER = toy_codes(25, 3)  # b's reference codes (a longer voice)
EOS = 2150


def talker(ref, codes=CODES, prompt=(60, 60), tokens=None):
    tokens = np.append(codes[:, 0], EOS) if tokens is None else tokens
    return {"talker_ref_codes": ref, "talker_prompt": np.array([*prompt, len(ref)]), "talker_tokens": tokens}


def ev(handed_ref, handed_codes=CODES, stage=None, control=None, peers=None, history=None, peer_tokens=None,
       encoder=OWN):
    """Segment a at concurrency N: its talker saw `stage` (default: prompted with OWN); the vocoder
    got `handed_ref` + `handed_codes` and made audio of it. qwen-tts's encoder gave `encoder`."""
    cand = toy_result("a", handed_codes, handed_ref, extra=talker(OWN) if stage is None else stage)
    # the cross-decode: the reference vocoder with the talker's own reference
    return toy_evidence(cand, codes=CODES, own=OWN, reference=toy_result("a", CODES, encoder), control=control,
                        peer_ref_codes=peers if peers is not None else {"b": OTHER}, history_ref_codes=history or {},
                        peer_tokens=peer_tokens or {})


def test_a_clean_handoff_passes_the_stage_checks(policy):
    v = classify(ev(OWN), policy)
    assert v.verdict == "identical", v.summary
    assert v.comparisons["talker_stage"] == {"talker_frames": 40, "handed_frames": 40, "prompt_reserved": 60,
                                             "prompt_built": 60, "ref_code_len": 20, "talker_ref_frames": 20}


def test_seed_bug_in_release_0_30_a_longer_donor_cut_to_the_own_length(policy):
    # #4370 reverted into 0.30.0: b's reference codes broadcast, trimmed to a's ref_code_len (20).
    v = classify(ev(OTHER[:20]), policy)
    assert (v.verdict, v.stage, v.donor, v.donor_kind, v.first_divergent_chunk) == (
        "contamination", "handoff", "b", "codes", 0)
    assert "the candidate used b's reference codes (20 frames, cut to 20) instead of its own (20 frames)" in v.summary
    assert v.comparisons["ref_codes"]["own_from"] == "talker"


def test_a_donor_served_earlier_is_named_as_such(policy):
    # Not co-batched: a cache keyed too loosely hands out an earlier request's reference.
    v = classify(ev(OTHER, peers={}, history={"z": OTHER}), policy)
    assert (v.verdict, v.donor) == ("contamination", "z")
    assert "z (served earlier, not in its batch)'s reference codes" in v.summary
    assert v.comparisons["ref_codes"]["peer_co_batched"] is False


def test_a_dropped_reference_prefix_is_a_handoff_defect_not_an_encoder_difference(policy):
    # The blind spot this closes: with only the vocoder's input, a dropped prefix read as
    # "the candidate's encoder made no reference codes" (code_divergence, passing).
    v = classify(ev(np.zeros((0, 16), np.int64)), policy)
    assert (v.verdict, v.stage) == ("handoff_defect", "handoff")
    assert v.summary.startswith("the vocoder got none of the talker's reference codes")
    assert v.comparisons["codes"]["ref_codes_equal"] is True  # the encoder is judged on the talker's input
    assert policy.fails(v.verdict)


def test_a_mis_trimmed_prefix_without_a_length_donor_is_a_handoff_defect(policy):
    v = classify(ev(OWN[:17], peers={}), policy)
    assert (v.verdict, v.stage) == ("handoff_defect", "handoff")
    assert "17 reference frames that are not the 20 the talker was prompted with (first differing frame 17)" in v.summary


def test_a_lost_frame_is_found_between_talker_and_vocoder(policy):
    lost = np.delete(CODES, 12, axis=0)
    v = classify(ev(OWN, handed_codes=lost), policy)
    assert (v.verdict, v.stage, v.first_divergent_frame) == ("handoff_defect", "handoff", 12)
    assert v.summary.startswith("the vocoder got 39 frames where the talker generated 40: they part at frame 12")


def preempted(handed_codes, at, tokens=None, control_tokens=None):
    """Segment a preempted after `at` generated tokens (the scheduler's record), handed `handed_codes`."""
    cand = toy_result("a", handed_codes, OWN, extra=talker(OWN, tokens=tokens), meta={"preempted_at": [at]})
    control = (toy_result("a", CODES, OWN, extra=talker(OWN, tokens=control_tokens))
               if control_tokens is not None else None)
    return toy_evidence(cand, codes=CODES, own=OWN, control=control, peer_ref_codes={"b": OTHER})


def test_the_frame_lost_at_a_resume_is_the_talkers_not_the_handoffs(policy):
    # vLLM-Omni 0.30.0 under a full talker KV cache: a request preempted after 13 tokens resumes by
    # replaying them; frame 12's codebooks 1-15 are never made and that frame never reaches the vocoder.
    tokens = np.append(CODES[:, 0], EOS)
    v = classify(ev_pre := preempted(np.delete(CODES, 12, axis=0), 13, tokens, control_tokens=tokens), policy)
    assert (v.verdict, v.stage, v.first_divergent_frame) == ("talker_defect", "talker", 12)
    assert v.summary.startswith("the talker was preempted after 13 generated tokens and resumed; at the frame of the "
                                "last token before the preemption, frame 12 of 40 never reached the vocoder")
    assert any("preempted this request after 13" in n for n in v.notes)
    # a frame lost anywhere else is not explained by the preemption: the hand-off's, as before
    ev_pre.candidate.meta["preempted_at"] = [20]
    assert classify(ev_pre, policy).verdict == "handoff_defect"
    # or the frame arrives with codes the talker did not make (ab-04 in 0.30.0, a replay in five spans)
    altered = CODES.copy()
    altered[12, 0] = (altered[12, 0] + 5) % 2048
    v = classify(preempted(altered, 13, tokens, control_tokens=tokens), policy)
    assert (v.verdict, v.stage, v.first_divergent_frame) == ("talker_defect", "talker", 12)
    assert "frame 12 reached it with codes the talker did not make" in v.summary


def test_tokens_that_leave_their_own_from_the_resume_on_name_the_resumed_history(policy):
    # #6179's family: the resumed KV rebuilt from codebook-0 embeddings; the talker's tokens part from
    # its own at concurrency 1 at the first token sampled after the resume, and not before.
    own = np.append(CODES[:, 0], EOS)
    after = own.copy()
    after[13:40] = (after[13:40] + 7) % 2048
    codes = CODES.copy()
    codes[13:, 0] = after[13:40]
    v = classify(preempted(codes, 13, after, control_tokens=own), policy)
    assert (v.verdict, v.stage, v.first_divergent_frame) == ("talker_defect", "talker", 13)
    assert "from token 13, the first it sampled after resuming, its tokens leave its own at concurrency 1 (27 of the 28" \
        in v.summary
    # parting before the preemption is not the resume's doing
    early = own.copy()
    early[5] = (early[5] + 1) % 2048
    codes_early = CODES.copy()
    codes_early[5, 0] = early[5]
    v = classify(preempted(codes_early, 13, early, control_tokens=own), policy)
    assert "resum" not in v.summary


def test_the_last_frame_cut_at_a_length_stop(policy):
    v = classify(ev(OWN, handed_codes=CODES[:-1]), policy)
    assert (v.verdict, v.first_divergent_frame) == ("handoff_defect", 39)


def test_another_requests_generated_codes_name_it(policy):
    # #1411 / #4316: request 0's codes decoded for every request of the batch.
    b_codes = toy_codes(33, 9)
    v = classify(ev(OWN, handed_codes=b_codes, peer_tokens={"b": np.append(b_codes[:, 0], EOS)}), policy)
    assert (v.verdict, v.donor, v.donor_kind, v.stage) == ("contamination", "b", "generated", "handoff")
    assert "the vocoder got b's generated codes (33 frames) instead of the 40" in v.summary


def test_a_run_of_another_requests_frames_at_another_offset_names_it(policy):
    # Qwen3-Omni's planted seed (cases/bugs/omni-first-codes-planted): the batch's first request's rows
    # handed on for the others; the wave's requests entered the talker steps apart, so b's frames arrive
    # shifted, mixed with a's own and another peer's.
    b_codes, c_codes = toy_codes(40, 9), toy_codes(40, 10)
    handed = CODES.copy()
    handed[5] = c_codes[7]  # one frame of c: too short a run to name anyone
    handed[6:30] = b_codes[2:26]  # b's frames 2-25 at a's frames 6-29
    peers = {"b": np.append(b_codes[:, 0], EOS), "c": np.append(c_codes[:, 0], EOS)}
    v = classify(ev(OWN, handed_codes=handed, peer_tokens=peers), policy)
    assert (v.verdict, v.donor, v.donor_kind, v.stage, v.first_divergent_frame) == (
        "contamination", "b", "generated", "handoff", 5)
    assert "frames 6-29 are its frames 2-25" in v.summary
    # two frames of a peer in a row are no donor: the hand-off's defect, unnamed
    handed = CODES.copy()
    handed[10:12] = b_codes[20:22]
    v = classify(ev(OWN, handed_codes=handed, peer_tokens=peers), policy)
    assert (v.verdict, v.donor, v.first_divergent_frame) == ("handoff_defect", None, 10)


def test_a_prompt_that_does_not_fill_its_reservation_is_a_talker_defect(policy):
    # #1553 / PR #1554: the prompt-length estimate fell back to 2048 positions.
    v = classify(ev(OWN, stage=talker(OWN, prompt=(2048, 60))), policy)
    assert (v.verdict, v.stage) == ("talker_defect", "talker")
    assert "reserved 2048 prompt positions for a prompt of 60 rows: 1988 positions filled with padding" in v.summary
    assert policy.fails(v.verdict)


def test_the_talkers_reference_at_n_against_at_1_names_a_donor(policy):
    control = toy_result("a", CODES, OWN, extra=talker(OWN))
    v = classify(ev(OTHER, stage=talker(OTHER), control=control), policy)
    hits = [v.verdict, v.stage, v.donor]
    assert hits == ["contamination", "reference_encoder", "b"], v.summary
    assert "the talker was prompted with b's reference codes at concurrency N" in v.summary


def test_without_the_talker_stage_the_old_judgement_says_so(policy):
    cand = toy_result("a", CODES, OWN)
    v = classify(Evidence(segment_id="a", reference=toy_result("a", CODES, OWN), candidate=cand, control=None,
                          cross_own=toy_result("a", CODES, OWN)), policy)
    assert v.verdict == "identical"
    assert any("no talker stage in the capture" in n for n in v.notes)


def test_the_reference_left_in_the_generated_frames_is_a_handoff_defect(policy):
    # #4421: the vocoder got no trim length, so the reference prefix arrived as generated frames
    # (more frames than the talker made; the comparison must not assume the shorter side is the vocoder's).
    v = classify(ev(np.zeros((0, 16), np.int64), handed_codes=np.concatenate([OWN, CODES])), policy)
    assert (v.verdict, v.stage, v.first_divergent_frame) == ("handoff_defect", "handoff", 0)
    assert v.summary.startswith("the vocoder got 20 of the talker's 20 reference frames as generated frames")
    assert v.comparisons["talker_stage"] == {"talker_frames": 40, "handed_frames": 60, "prompt_reserved": 60,
                                             "prompt_built": 60, "ref_code_len": 20, "talker_ref_frames": 20}


def test_a_segment_of_the_same_voice_is_not_blamed_for_a_cut(policy):
    # voice-clone-concurrency at 4 on 0.30.0: vcc-19 (fabio's voice) got its own reference cut to 32 frames;
    # vcc-07, served earlier with the same voice, has the same codes and must not be named as the donor
    v = classify(ev(OWN[:17], peers={}, history={"c": OWN}), policy)
    assert (v.verdict, v.donor) == ("handoff_defect", None)
    v = classify(ev(OWN[:17], peers={"c": OWN, "d": OTHER[:17]}), policy)  # nor a co-batched one
    assert v.donor != "c"


def test_a_shorter_donors_reference_repeated_to_the_own_length_names_it(policy):
    # the seed's bug in 0.30.0 (handoff-mix, hm-08-zh): hm-07's 35 frames arrived, repeated from their
    # start to hm-08's own 37 (the accumulated reference trimmed to its own ref_code_len)
    short = OTHER[:15]
    v = classify(ev(np.concatenate([short, short[:5]]), peers={"b": short}), policy)
    assert (v.verdict, v.stage, v.donor, v.donor_kind) == ("contamination", "handoff", "b", "codes")
    assert "the candidate used b's reference codes (20 frames, 15 repeated to 20)" in v.summary


def test_a_shorter_donors_whole_reference_then_padding_names_it(policy):
    # the seed's bug at c=16 (audiobook-278, #4373 reverted into 0.30.0): ab004 (42 frames of its own)
    # got ab002's 39 frames whole, then 3 frames of the batched encoder's padding, no one's reference
    short, pad = OTHER[:15], toy_codes(5, 9)
    v = classify(ev(np.concatenate([short, pad]), peers={"b": short}), policy)
    assert (v.verdict, v.stage, v.donor, v.donor_kind) == ("contamination", "handoff", "b", "codes")
    assert "b's reference codes (20 frames, all 15 of theirs, then 5 that are no one's)" in v.summary
    # its own whole reference followed by padding is not another's: no donor, a hand-off defect
    v = classify(ev(np.concatenate([OWN, pad[:3]]), peers={"b": short}), policy)
    assert (v.verdict, v.donor) == ("handoff_defect", None)
    # a whole reference too short to tell from a silent onset by chance is not a donor either
    v = classify(ev(np.concatenate([OTHER[:3], OWN[3:]]), peers={"b": OTHER[:3]}), policy)
    assert v.donor is None


def test_exact_codes_with_a_cut_reference_at_the_vocoder_are_the_handoffs_not_the_talkers(policy):
    # issue 57: no talker stage captured, the talker's codes qwen-tts's exactly, the vocoder handed the
    # reference one frame short (at every concurrency, so the control agrees): before, teacher forcing in
    # that cut reference blamed the talker.
    from difftest.verdicts.rules import talker_cleared
    from difftest.verdicts.evidence import Finding

    cut = OWN[:19]
    cand = toy_result("a", CODES, cut)
    control = toy_result("a", CODES, cut)
    e = Evidence(segment_id="a", reference=toy_result("a", CODES, OWN), candidate=cand, control=control,
                 cross_own=toy_result("a", CODES, cut), cross_donors={}, peer_ref_codes={}, history_ref_codes={},
                 peer_tokens={})
    v = classify(e, policy)
    assert (v.verdict, v.stage) == ("handoff_defect", "handoff")
    assert v.summary == ("the candidate's codes are qwen-tts's exactly, but the reference the vocoder got is qwen-tts's "
                         "1 frames short at its end (19 frames for 20): the hand-off's, not the talker's")
    forced = Finding("talker_defect", "teacher-forced ...", frame=0, chunk=0, stage="talker")
    notes = []
    kept = talker_cleared(e, [forced], notes)
    assert [f.kind for f in kept] == ["handoff_defect"] and "not the talker's context" in notes[0]
    # with the talker's side captured, or codes that are not qwen-tts's, the talker finding stands
    other = CODES.copy()
    other[5, 0] = (other[5, 0] + 1) % 2048
    e2 = Evidence(segment_id="a", reference=toy_result("a", CODES, OWN), candidate=toy_result("a", other, cut),
                  control=None, cross_own=None, cross_donors={}, peer_ref_codes={}, history_ref_codes={},
                  peer_tokens={})
    assert talker_cleared(e2, [forced], []) == [forced]


def test_teacher_forcing_forces_the_talkers_own_frames_where_the_handoff_carried_them_whole():
    # Qwen3-Omni 0.30.0's full payload: an all-zero frame before the talker's 40. Teacher forcing takes
    # the talker's frames (pipeline/scoring.py); where they are not there whole, its finding on what the
    # vocoder got is not the talker's
    from difftest.verdicts.evidence import Finding, talker_frames
    from difftest.verdicts.rules import handoff_places_codes

    zero_first = np.concatenate([np.zeros((1, 16), np.int64), CODES])
    frames, found = talker_frames(toy_result("a", zero_first, OWN, extra=talker(OWN)))
    assert found and np.array_equal(frames, CODES)
    frames, found = talker_frames(toy_result("a", CODES, OWN, extra=talker(OWN)))
    assert found and frames is not None and np.array_equal(frames, CODES)
    lost = np.delete(CODES, 12, axis=0)  # a frame lost inside: not there whole
    e_lost = ev(OWN, handed_codes=lost)
    assert talker_frames(e_lost.candidate) == (e_lost.candidate.codes, False)
    assert talker_frames(toy_result("a", CODES, OWN))[1] is False  # no talker side captured

    handoff = Finding("handoff_defect", "the vocoder got 39 frames where the talker generated 40", frame=12,
                      chunk=1, stage="handoff")
    forced = Finding("talker_defect", "teacher-forced ...", frame=12, chunk=1, stage="talker")
    notes = []
    found = handoff_places_codes(e_lost, {"stages": [handoff], "forced": [forced]}, notes)
    assert found == {"stages": [handoff], "forced": []} and "not the talker's own" in notes[0]
    # the talker's frames forced whole (the zero frame before them): the forcing's finding is the talker's
    e_zero = ev(OWN, handed_codes=zero_first)
    kept = {"stages": [handoff], "forced": [forced]}
    assert handoff_places_codes(e_zero, kept, []) == kept
