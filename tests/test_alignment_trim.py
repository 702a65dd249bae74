"""qwen-tts's proportional trim on the frame grid.

qwen-tts cuts the reference part of an in-context decode at `int(R / (R + T) * len(wav))`, which for
some (R, T) is one sample short of R * 1920: its audio then starts one sample *before* frame 0
(`lead_samples` = 1). vLLM-Omni trims exactly R * 1920. Measured on the real vLLM-Omni 0.30.0
(smoke-03): the reference vocoder's cross-decode had 23041 samples against the candidate's 23040;
compared from sample 0 the SNR was -3 dB (a false `vocoder_defect`), shifted by the one lead sample
83.6 dB. The comparison must align both on the frame grid.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from toy import toy_codes, toy_decode, toy_result

from difftest.compare import align
from difftest.verdicts.classify import Evidence, classify
from difftest.verdicts.policy import load_policy

SPF = align.SAMPLES_PER_FRAME
POLICY = load_policy()


def qwen_tts_style(codes, ref):
    """What qwen-tts returns for these codes: the whole decode, cut with its float expression."""
    full = toy_decode(np.concatenate([ref, codes]), np.zeros((0, 16), np.int64))
    total = len(ref) + len(codes)
    cut = int(len(ref) / max(total, 1) * full.shape[0])
    return full[cut:], len(ref) * SPF - cut


def vllm_omni_style(codes, ref):
    full = toy_decode(np.concatenate([ref, codes]), np.zeros((0, 16), np.int64))
    return full[len(ref) * SPF:]


def test_the_lead_sample_follows_qwen_tts_float_cut():
    assert align.lead_samples(1, 48) == 1  # int(1/49 * 94080) = 1919
    assert align.lead_samples(0, 48) == 0 and align.lead_samples(4, 6) == 0
    assert align.lead_samples(17, 12) == 1  # smoke-03's shape: 12 generated frames, 23041 samples
    wav, lead = qwen_tts_style(toy_codes(12, 1), toy_codes(17, 2))
    assert (len(wav), lead) == (23041, 1)


def test_smoke_03_one_lead_sample_is_not_a_vocoder_defect(policy):
    """The exact case: 17 reference frames, 12 generated, the cross-decode one sample longer at the front."""
    codes, ref = toy_codes(12, 1), toy_codes(17, 2)
    cross_wav, lead = qwen_tts_style(codes, ref)
    cand_wav = vllm_omni_style(codes, ref)
    assert (len(cross_wav), len(cand_wav), lead) == (23041, 23040, 1)
    # Unaligned, the two are far apart (the false flag); aligned they are the same samples.
    assert np.abs(cross_wav[:23040] - cand_wav).max() > 0.01
    assert np.array_equal(cross_wav[1:], cand_wav)

    reference = toy_result("s", codes, ref, wav=cross_wav, meta={"lead_samples": lead})
    cross = toy_result("s", codes, ref, wav=cross_wav, meta={"lead_samples": lead})
    cand = toy_result("s", codes, ref, wav=cand_wav)
    v = classify(Evidence(segment_id="s", reference=reference, candidate=cand, control=cand, cross_own=cross), policy)
    assert v.verdict == "identical", v.summary
    assert v.comparisons["vocoder"]["worst_tier"] == "identical"
    assert v.comparisons["vocoder"]["samples"] == [23040, 23040]


def test_without_the_record_the_shift_is_seen(policy):
    """The same audio, its lead not recorded: the comparison has no licence to shift, and says so."""
    codes, ref = toy_codes(12, 1), toy_codes(17, 2)
    cross_wav, _ = qwen_tts_style(codes, ref)
    cand = toy_result("s", codes, ref, wav=vllm_omni_style(codes, ref))
    cross = toy_result("s", codes, ref, wav=cross_wav)
    v = classify(Evidence(segment_id="s", reference=toy_result("s", codes, ref), candidate=cand, control=cand,
                          cross_own=cross), policy)
    assert v.verdict in ("vocoder_defect", "length_mismatch")


@settings(max_examples=60, deadline=None)
@given(ref_frames=st.integers(0, 140), gen_frames=st.integers(1, 40), seed=st.integers(0, 1000))
def test_a_decode_against_itself_shifted_by_the_trim_is_identical(ref_frames, gen_frames, seed):
    codes, ref = toy_codes(gen_frames, seed), toy_codes(ref_frames, seed + 1)
    q_wav, lead = qwen_tts_style(codes, ref)
    assert lead == align.lead_samples(ref_frames, gen_frames)
    v_wav = vllm_omni_style(codes, ref)
    q = toy_result("s", codes, ref, wav=q_wav, meta={"lead_samples": lead})
    v = toy_result("s", codes, ref, wav=v_wav)
    for reference, candidate in ((q, v), (v, q), (q, q)):
        verdict = classify(Evidence(segment_id="s", reference=reference, candidate=candidate, control=candidate,
                                    cross_own=reference), POLICY)
        assert verdict.verdict == "identical", (ref_frames, gen_frames, lead, verdict.summary)
