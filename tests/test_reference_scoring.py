"""The reference runner's `score` job (teacher forcing), with the real qwen-tts on the tiny checkpoints.

The scorer's own check: qwen-tts's greedy output, forced back through its talker
and code predictor, must be its top-1 at every frame and codebook; a sampled
output must lie inside the sampling support everywhere. Anything else would
mean the teacher-forced pass is not the generation's computation.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference_support import (
    DECODE,
    all_models,
    generate,
    load_npz,
    segment,
    start_runner,
    tiny,  # noqa: F401
    voice,
    write_voice,
)

from difftest.compare import forced
from difftest.scores import read_scores
from difftest.verdicts.policy import load_policy

SAMPLED = {**DECODE, "do_sample": True, "temperature": 0.9, "top_k": 20, "top_p": 0.8,
           "subtalker_dosample": True, "subtalker_top_k": 10, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0}


@pytest.fixture(scope="module")
def world(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("scoring")
    good = voice(write_voice(d / "good.wav", 1.3, 220.0, seed=0))
    other = voice(write_voice(d / "other.wav", 1.0, 330.0, seed=1), "Another reference.", vid="o")
    segs = {
        "icl": segment("icl", "Hello world, how are you?", voice=good,
                       decode={**DECODE, "repetition_penalty": 1.3, "max_new_tokens": 20}),
        "custom": segment("custom", "Custom voice here.", task="custom_voice", speaker="alice"),
        "design": segment("design", "Designed voice.", task="voice_design", instructions="A calm, low voice."),
        "sampled": segment("sampled", "A sampled sentence, seeded.", voice=other, decode=SAMPLED),
        "xvec": segment("xvec", "Only the speaker embedding.", voice=voice(good.wav, mode="xvector", vid="vx")),
    }
    runner = start_runner(all_models(tiny), log_path=d / "runner.log")
    try:
        generate(runner, list(segs.values()), d)
        arrays = {sid: load_npz(d / f"{sid}.{s.hash[:16]}.npz") for sid, s in segs.items()}
        yield {"dir": d, "runner": runner, "segs": segs, "arrays": arrays}
    finally:
        runner.close()


def _score(world, name, sid, codes, *, ref_codes=None, condition="voice", eos=False, segment_job=None):
    d = world["dir"]
    src = d / f"{name}.in.npz"
    np.savez(src, codes=codes, ref_codes=np.zeros((0, 16), np.int64) if ref_codes is None else ref_codes)
    events = list(world["runner"].request("score", timeout=300, items=[{
        "name": name, "segment": segment_job or world["segs"][sid].to_job(), "input": str(src),
        "out": str(d / "scores" / name), "condition": condition, "ended_by_eos": eos}]))
    ev = next(e for e in events if e.get("item") == name)
    return ev if ev["event"] == "error" else read_scores(ev["path"])


@pytest.mark.parametrize("sid", ["icl", "custom", "design", "xvec"])
def test_greedy_output_forced_back_is_the_top1_everywhere(world, sid):
    a = world["arrays"][sid]
    sf = _score(world, f"self-{sid}", sid, a["codes"])
    assert sf.frames == len(a["codes"]) > 0
    assert (sf.arrays["rank"] == 0).all(), np.argwhere(sf.arrays["rank"] > 0)[:5]
    assert np.array_equal(sf.arrays["top1"], a["codes"])
    assert np.allclose(sf.arrays["logprob"], sf.arrays["top1_logprob"])
    assert (sf.arrays["margin"] >= 0).all() and sf.arrays["in_support"].all()
    assert forced.implausible(sf, load_policy().forced) is None


def test_sampled_output_lies_inside_the_support_and_ranks_below_top1(world):
    a = world["arrays"]["sampled"]
    sf = _score(world, "self-sampled", "sampled", a["codes"])
    assert sf.arrays["in_support"].all()
    assert (sf.arrays["rank"][:, 0] > 0).mean() > 0.3  # it did sample: not the greedy path
    assert sf.arrays["rank"][:, 0].max() < 20 and sf.arrays["rank"][:, 1:].max() < 10  # top-k 20 / 10
    assert forced.implausible(sf, load_policy().forced) is None
    assert sf.settings["top_k"] == 20 and sf.settings["do_sample"] is True


def test_sampled_scores_carry_the_sampler_bank_consistently(world):
    """The bank's arrays (issue #31) agree with the scores they extend: at the grid point of the
    requested temperature the likelihood is the drawn token's own; an alternative's llr is the
    difference of its and the requested log-probabilities; KLs are >= 0; a wider top-k adds mass only
    outside the support; an alternative equal to the request (no penalty to drop: 1.0 here) is NaN."""
    from difftest import sampler_bank

    a = world["arrays"]["sampled"]
    sf = _score(world, "bank-sampled", "sampled", a["codes"])
    names = list(sampler_bank.ALTERNATIVES)
    assert sf.bank["alternatives"] == names and set(sf.bank["sites"]) == {"talker", "code_predictor"}
    talker = dict(zip(names, sf.bank["sites"]["talker"]["applicable"]))
    assert talker["temperature+0.1"] and talker["top_k_ignored"] and not talker["repetition_penalty_ignored"]
    grid = sf.bank["sites"]["talker"]["temperature_grid"]
    mid = int(np.argmin(np.abs(np.asarray(grid) - 0.9)))
    assert abs(grid[mid] - 0.9) < 1e-9
    # the support here is top-k then top-p 0.8 at 0.9, held fixed over the grid: equal at the asked point
    assert np.allclose(sf.arrays["temp_loglik"][:, :, mid], sf.arrays["sample_logprob"], atol=1e-4)
    kl = sf.arrays["alt_kl"]
    assert np.nanmin(kl) > -1e-5 and np.isnan(kl[:, 0, names.index("repetition_penalty_ignored")]).all()
    wide = names.index("top_k_ignored")
    assert (sf.arrays["alt_outside"][:, :, wide] > 0).mean() > 0.5 and np.allclose(kl[:, :, wide], 0.0, atol=1e-5)
    hot = names.index("temperature+0.1")
    assert (kl[:, :, hot] >= 0).all() and (kl[:, :, hot] > 0).mean() > 0.9
    # top-p 1.0 (the code predictor's): a temperature keeps the top-k support; top-p 0.8 (the talker's) widens
    assert (sf.arrays["alt_outside"][:, 1:, hot] < 1e-6).all() and (sf.arrays["alt_outside"][:, 0, hot] > 0).any()
    p_x = np.exp(sf.arrays["sample_logprob"])
    assert ((sf.arrays["mass_above"] >= 0) & (sf.arrays["mass_above"] + p_x <= 1 + 1e-5)).all()
    assert (sf.arrays["mass_above"][sf.arrays["rank"] == 0] == 0).all()  # the top-1 has nothing ranked before it


def test_another_prompt_makes_the_stream_implausible(world):
    """The same codes judged as another segment's (another text and voice): far from the top-1."""
    a = world["arrays"]["icl"]
    wrong = world["segs"]["sampled"].to_job()
    wrong["decode"] = world["segs"]["icl"].decode
    sf = _score(world, "wrong-prompt", "icl", a["codes"], segment_job={**wrong, "id": "icl"})
    bad = forced.implausible(sf, load_policy().forced)
    assert bad is not None and sf.arrays["rank"].max() > 5


def test_conditioning_on_given_reference_codes_changes_the_scores(world):
    """The candidate's own reference codes replace the voice's: cut to 3 frames, qwen-tts's codes are
    no longer its top-1 everywhere; the voice's own codes given explicitly score exactly as the voice."""
    a = world["arrays"]["icl"]
    own = _score(world, "given-own", "icl", a["codes"], ref_codes=a["ref_codes"], condition="given")
    assert (own.arrays["rank"] == 0).all() and own.conditioning == {"ref_codes": "given", "frames": len(a["ref_codes"])}
    cut = _score(world, "given-cut", "icl", a["codes"], ref_codes=a["ref_codes"][:3], condition="given")
    assert (cut.arrays["rank"] > 0).any()


def test_eos_row_scores_the_stop(world):
    a = world["arrays"]["icl"]
    sf = _score(world, "eos", "icl", a["codes"][:10], eos=True)
    assert sf.eos is not None and set(sf.eos) >= {"rank", "logprob", "top1", "in_support"}
    # the tiny model never stops by itself: a stop after 10 frames is far from its choice
    assert sf.eos["rank"] > 0


@pytest.mark.parametrize("codes, what", [
    (np.full((5, 16), 2048, np.int64), "outside [0, 2048)"),
    (np.zeros((5, 8), np.int64), "shape (T, 16)"),
    (np.zeros((0, 16), np.int64), "codes are empty"),
    (np.zeros((5, 16), np.float32), "must be integers"),
])
def test_bad_streams_are_named_errors_and_the_runner_goes_on(world, codes, what):
    ev = _score(world, f"bad-{what[:6]}", "icl", codes)
    assert ev["event"] == "error" and ev["kind"] == "bad_input"
    assert what in ev["message"] and "(segment icl)" in ev["message"], ev["message"]
    again = _score(world, "after-bad", "icl", world["arrays"]["icl"]["codes"])
    assert (again.arrays["rank"] == 0).all()


def test_given_reference_codes_for_an_xvector_voice_are_refused(world):
    a = world["arrays"]["xvec"]
    ev = _score(world, "xvec-given", "xvec", a["codes"], ref_codes=world["arrays"]["icl"]["ref_codes"],
                condition="given")
    assert ev["event"] == "error" and ev["kind"] == "bad_input" and "no in-context reference" in ev["message"]


def test_a_segment_without_its_checkpoint_is_refused(world, tiny):
    runner = start_runner([str(tiny / "base")], log_path=world["dir"] / "base-only.log")
    try:
        src = world["dir"] / "custom-only.in.npz"
        np.savez(src, codes=world["arrays"]["custom"]["codes"], ref_codes=np.zeros((0, 16), np.int64))
        events = list(runner.request("score", timeout=120, items=[{
            "name": "c", "segment": world["segs"]["custom"].to_job(), "input": str(src),
            "out": str(world["dir"] / "scores" / "c")}]))
    finally:
        runner.close()
    ev = next(e for e in events if e.get("item") == "c")
    assert ev["event"] == "error" and ev["kind"] == "bad_input"
    assert "custom_voice checkpoint" in ev["message"] and "(segment custom)" in ev["message"], ev["message"]


def test_a_second_request_is_answered_from_the_file(world):
    a = world["arrays"]["icl"]
    first = _score(world, "twice", "icl", a["codes"])
    events = list(world["runner"].request("score", timeout=60, items=[{
        "name": "twice", "segment": world["segs"]["icl"].to_job(), "input": str(world["dir"] / "twice.in.npz"),
        "out": str(world["dir"] / "scores" / "twice")}]))
    ev = next(e for e in events if e.get("item") == "twice")
    assert ev["cached"] is True and read_scores(ev["path"]).arrays["rank"].tolist() == first.arrays["rank"].tolist()
