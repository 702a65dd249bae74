"""Verdicts from teacher-forced scores (difftest/compare/forced.py): a talker defect at any
concurrency, a near-tie flip between concurrency 1 and N, sampled decoding's support.
Score files are built by hand here; tests/test_reference_scoring.py checks the real scorer."""

from dataclasses import replace

import numpy as np
import pytest
import yaml
from toy import toy_codes, toy_evidence, toy_result

from difftest.compare import forced
from difftest.errors import BadInput
from difftest.results import CorruptResult
from difftest.scores import ScoreFile, read_scores, write_scores
from difftest.verdicts.classify import Evidence, classify
from difftest.verdicts.policy import DEFAULT_POLICY, load_policy

T = 30
CODES = toy_codes(T, 1)
REF = toy_codes(12, 2)
GREEDY = {"do_sample": False, "subtalker_dosample": False}


def scores(ranks=None, gaps=None, settings=GREEDY, support=None, eos=None, codes=CODES):
    """A score file: rank 0 and gap 0 everywhere unless given (arrays or {(frame, codebook): value})."""
    rank = np.zeros((len(codes), 16), np.int64)
    gap = np.zeros((len(codes), 16), np.float32)
    for arr, vals in ((rank, ranks), (gap, gaps)):
        for pos, v in (vals or {}).items():
            arr[pos] = v
    top = np.full(rank.shape, -2.0, np.float32)
    arrays = {"logprob": top - gap, "rank": rank, "top1": codes.copy(), "top1_logprob": top,
              "margin": np.full(rank.shape, 0.01, np.float32),
              "in_support": np.ones(rank.shape, bool) if support is None else support,
              "sample_logprob": np.zeros(rank.shape, np.float32), "expected_logprob": np.zeros(rank.shape, np.float32),
              "logprob_var": np.zeros(rank.shape, np.float32),
              "support_gap": np.where(np.ones(rank.shape, bool) if support is None else support, 0.0, 1.0).astype(np.float32)}
    return ScoreFile("a", "h" * 16, arrays, eos, dict(settings), {"ref_codes": "given", "frames": 12})


def evidence(cand_codes=CODES, ctrl_codes=None, cand_scores=None, ctrl_scores=None, ref_codes=CODES):
    ctrl = toy_result("a", ctrl_codes, REF) if ctrl_codes is not None else None
    s = {k: v for k, v in (("candidate", cand_scores), ("control", ctrl_scores)) if v is not None}
    return toy_evidence(toy_result("a", cand_codes, REF), codes=ref_codes, own=REF, control=ctrl, scores=s)


def test_a_plausible_stream_keeps_its_code_divergence_and_says_why(policy):
    other = CODES.copy()
    other[5:, 0] += 1  # parts from the reference at frame 5 (a bf16 near-tie, say)
    v = classify(evidence(other, cand_scores=scores({(5, 0): 1}, {(5, 0): 0.01})), policy)
    assert v.verdict == "code_divergence" and not policy.fails(v.verdict)
    assert v.comparisons["forced"]["worst_rank"] == 1 and v.comparisons["forced"]["top1_share"] == round(29 / 30, 4)
    assert any("plausible" in n for n in v.notes)


def test_a_token_far_down_qwen_tts_list_is_a_talker_defect_at_its_frame(policy):
    other = CODES.copy()
    other[7:, 0] += 1
    v = classify(evidence(other, cand_scores=scores({(7, 0): 400}, {(7, 0): 2.5})), policy)
    assert (v.verdict, v.stage, v.first_divergent_frame) == ("talker_defect", "talker", 7)
    assert "frame 7 codebook 0: the token is qwen-tts's rank 400" in v.summary
    assert policy.fails(v.verdict)


def test_many_small_misses_are_a_talker_defect_by_share(policy):
    # every other frame rank 1 within the gap: each alone a near-tie, together not the talker asked for
    ranks = {(f, 0): 1 for f in range(0, T, 2)}
    v = classify(evidence(cand_scores=scores(ranks, {k: 0.01 for k in ranks})), policy)
    assert v.verdict == "talker_defect" and "only 50% of frames take qwen-tts's top-1" in v.summary


def test_the_same_codes_with_another_prompt_behind_them_still_fail(policy):
    # codes equal to the reference's do not excuse a stream the forced pass finds implausible
    v = classify(evidence(cand_scores=scores({(0, 3): 50}, {(0, 3): 1.0})), policy)
    assert v.verdict == "talker_defect"


def test_sampled_decoding_fails_only_outside_the_support(policy):
    sampled = {"do_sample": True, "subtalker_dosample": False, "top_k": 50}
    inside = scores({(f, 0): 30 for f in range(T)}, {(f, 0): 1.5 for f in range(T)}, settings=sampled)
    assert classify(evidence(cand_scores=inside), policy).verdict == "identical"
    support = np.ones((T, 16), bool)
    support[9, 0] = False
    v = classify(evidence(cand_scores=scores({(9, 0): 60}, settings=sampled, support=support)), policy)
    assert (v.verdict, v.first_divergent_frame) == ("talker_defect", 9)
    assert "1 tokens outside qwen-tts's sampling support, the first at frame 9 codebook 0" in v.summary
    # just outside, by a boundary near-tie (a bf16 engine's k-th token): not a defect
    near = scores({(9, 0): 50}, settings=sampled, support=support)
    near.arrays["support_gap"][9, 0] = 0.05
    assert classify(evidence(cand_scores=near), policy).verdict == "identical"
    # the greedy code predictor inside a sampled run is still judged greedily
    v = classify(evidence(cand_scores=scores({(4, 2): 90}, {(4, 2): 3.0}, settings=sampled)), policy)
    assert (v.verdict, v.first_divergent_frame) == ("talker_defect", 4)


def test_the_support_allowance_is_the_measured_nulls(policy):
    """How far outside the support a sampled token may lie alone: the policy's 0.15 nats where no null
    covered the sampled sites; none where qwen-tts in the candidate's numerics never leaves the support
    (an exact engine); up to the gross 1.0 where it does (the null's count test judges how often)."""
    sampled = {"do_sample": True, "subtalker_dosample": False, "top_k": 50}
    support = np.ones((T, 16), bool)
    support[9, 0] = False

    def outside(by):
        sf = scores({(9, 0): 60}, settings=sampled, support=support)
        sf.arrays["support_gap"][9, 0] = by
        return evidence(cand_scores=sf)

    assert classify(outside(0.05), policy).verdict == "identical"
    assert classify(outside(0.3), policy).verdict == "talker_defect"
    exact = {"dtype": "float32", "outside": 0, "tokens": 600}
    v = classify(replace(outside(0.05), support_noise=exact), policy)
    assert v.verdict == "talker_defect" and "policy: 0.0" in v.summary
    assert v.comparisons["forced"]["support_noise"] == {**exact, "allowed_gap": 0.0}
    bf16 = {"dtype": "bfloat16", "exact": False, "outside": 3, "tokens": 600}
    assert classify(replace(outside(0.58), support_noise=bf16), policy).verdict == "identical"
    inside = {**bf16, "outside": 0}  # this run's bf16 null stayed inside: chance, not an exact engine
    assert classify(replace(outside(0.58), support_noise=inside), policy).verdict == "identical"
    assert classify(replace(outside(1.6), support_noise=bf16), policy).verdict == "talker_defect"


def test_a_concurrency_flip_on_a_near_tie_does_not_fail(policy):
    at_n = CODES.copy()
    at_n[10:, 0] += 1
    ctrl_s = scores()  # the control's token is the top-1 at frame 10
    cand_s = scores({(10, 0): 1}, {(10, 0): 0.004})  # the candidate at N took the runner-up, 0.004 nats below
    v = classify(evidence(at_n, CODES, cand_s, ctrl_s), policy)
    assert v.verdict == "code_divergence", v.summary
    assert v.comparisons["near_tie"] == {"frame": 10, "codebook": 0, "ranks": [0, 1], "gaps": [0.0, 0.004],
                                         "margin": 0.01, "near_tie": True, "candidate_own": "not captured"}


def test_a_near_tie_is_excused_only_where_the_null_at_n_parts_too(policy):
    """The per-token line calls the flip a tie; the null at N (qwen-tts in the candidate's numerics,
    batched as its waves) says whether batching flips at all there: float32 never does."""
    at_n = CODES.copy()
    at_n[10:, 0] += 1
    ev = evidence(at_n, CODES, scores({(10, 0): 1}, {(10, 0): 0.004}), scores())
    exact = {"dtype": "float32", "segments": 20, "flips": 0, "max_gap": None, "flipped": {}}
    v = classify(replace(ev, batch_noise=exact), policy)
    assert v.verdict == "concurrency_defect" and v.first_divergent_frame == 10, v.summary
    assert "never parts from itself alone (20 segments): no flip at N is numerics" in v.summary
    assert v.comparisons["near_tie"]["null_n"] == {"dtype": "float32", "exact": True, "segments": 20, "flips": 0,
                                                   "max_gap": None}
    # a bf16 null that happened not to part in a small suite is a sample, not a structure: excused
    lucky = {**exact, "dtype": "bfloat16", "exact": False}
    assert classify(replace(ev, batch_noise=lucky), policy).verdict == "code_divergence"
    wide_lucky = evidence(at_n, CODES, scores({(10, 0): 1}, {(10, 0): 0.2}), scores())  # up to the gross line too
    assert classify(replace(wide_lucky, batch_noise=lucky), policy).verdict == "code_divergence"
    # bf16 parts: the flip may be numerics, however narrow the null's own were (the run's width test
    # compares the two sets of flips; one flip against the null's widest would flag half of correct runs)
    noisy = {**exact, "dtype": "bfloat16", "flips": 3, "max_gap": 0.002}
    v = classify(replace(ev, batch_noise=noisy), policy)
    assert v.verdict == "code_divergence" and v.comparisons["near_tie"]["near_tie"] is True, v.summary
    # where the null parts, the per-flip line is the gross one (0.5): 0.2 nats is the run's tests' to judge
    wide = evidence(at_n, CODES, scores({(10, 0): 1}, {(10, 0): 0.2}), scores())
    assert classify(replace(wide, batch_noise=noisy), policy).verdict == "code_divergence"
    assert classify(wide, policy).verdict == "concurrency_defect"  # no null measured: the 0.05 line
    gross = evidence(at_n, CODES, scores({(10, 0): 1}, {(10, 0): 0.8}), scores())
    v = classify(replace(gross, batch_noise=noisy), policy)
    assert v.verdict == "concurrency_defect" and "gap <= 0.5" in v.summary, v.summary


def test_a_near_tie_at_n_and_a_repeat_that_differs_is_a_history_defect_without_the_near_tie_note(policy):
    """The concurrency check's near-tie answer (no "why": it was one) is not the history check's:
    found by the planted speaker-scaled-0.9 on the real server, where it crashed the run."""
    at_n = CODES.copy()
    at_n[10:, 0] += 1
    again = CODES.copy()
    again[20:, 1] += 1  # served again after the others: other codes from frame 20
    ev = evidence(at_n, CODES, scores({(10, 0): 1}, {(10, 0): 0.004}), scores())
    v = classify(replace(ev, repeat=toy_result("a", again, REF)), policy)
    assert (v.verdict, v.first_divergent_frame) == ("history_defect", 20), v.summary
    assert "not a near-tie" not in v.summary and v.comparisons["near_tie"]["near_tie"] is True


def own_topk(codes, runner_up_gap=0.01, other=None):
    """A capture's own top-k for a greedy stream: each frame's codebook-0 code the top-1 at -1.0,
    then `other` (default: code + 1) `runner_up_gap` nats below, then three far-off tokens; the
    final token (EOS) closes it."""
    tokens = np.append(codes[:, 0], 2150)
    ids = np.stack([tokens, tokens + 1 if other is None else other, tokens + 2, tokens + 3, tokens + 4], axis=1)
    lp = np.tile(np.array([-1.0, -1.0 - runner_up_gap, -4.0, -5.0, -6.0], np.float32), (len(tokens), 1))
    return {"talker_tokens": tokens, "talker_topk_ids": ids.astype(np.int64), "talker_topk_logprobs": lp,
            "talker_ref_codes": REF, "talker_prompt": np.array([0, 0, len(REF)], np.int64)}


def with_own(ev, ctrl_extra, cand_extra):
    ev.control.extra.update(ctrl_extra)
    ev.candidate.extra.update(cand_extra)
    return ev


def test_a_near_tie_for_qwen_tts_and_for_the_candidate_own_logits_does_not_fail(policy):
    """The candidate's own top-k at the flip (both runs) hold both tokens within epsilon: benign."""
    at_n = CODES.copy()
    at_n[10:, 0] += 1
    ctrl_own = own_topk(CODES, 0.01)  # at 1: its token the top-1, the token N took 0.01 below
    cand_own = own_topk(at_n, 0.02, other=np.append(at_n[:, 0] - 1, 2151))  # at N: the token 1 took 0.02 below
    ev = with_own(evidence(at_n, CODES, scores({(10, 0): 1}, {(10, 0): 0.004}), scores()), ctrl_own, cand_own)
    v = classify(ev, policy)
    assert v.verdict == "code_divergence", v.summary
    own = v.comparisons["near_tie"]["candidate_own"]
    assert own["at_1"]["token_at_n"] == {"token": int(at_n[10, 0]), "rank": 1, "gap": 0.01}
    assert own["at_n"]["token_at_1"] == {"token": int(CODES[10, 0]), "rank": 1, "gap": 0.02}


def test_a_near_tie_for_qwen_tts_that_the_candidate_own_logits_do_not_share_is_a_concurrency_defect(policy):
    """qwen-tts calls the flip a near-tie, but the candidate's own logits at 1 put N's token 0.4
    nats down (its batch changed its numbers by more than a tie): a concurrency defect, saying why."""
    at_n = CODES.copy()
    at_n[10:, 0] += 1
    ev = with_own(evidence(at_n, CODES, scores({(10, 0): 1}, {(10, 0): 0.004}), scores()),
                  own_topk(CODES, 0.4), own_topk(at_n, 0.01, other=np.append(at_n[:, 0] - 1, 2151)))
    v = classify(ev, policy)
    assert (v.verdict, v.first_divergent_frame) == ("concurrency_defect", 10), v.summary
    assert "not under the candidate's own logits" in v.summary
    assert v.comparisons["near_tie"]["candidate_own"]["at_1"]["token_at_n"]["gap"] == 0.4


def test_own_margins_that_do_not_match_the_codes_are_set_aside_with_a_reason(policy):
    """Top-k rows whose top-1 is not the greedy token (a misaligned capture) are not used against
    the candidate; the report says why."""
    at_n = CODES.copy()
    at_n[10:, 0] += 1
    bad = own_topk(CODES, 0.4)
    bad["talker_topk_ids"][5, 0] += 7
    ev = with_own(evidence(at_n, CODES, scores({(10, 0): 1}, {(10, 0): 0.004}), scores()),
                  bad, own_topk(at_n, 0.01, other=np.append(at_n[:, 0] - 1, 2151)))
    v = classify(ev, policy)
    assert v.verdict == "code_divergence"
    assert v.comparisons["near_tie"]["candidate_own"] == ("unusable at 1: greedy, yet the talker's token at "
                                                          "step 5 is not its own top-1")


def test_the_candidate_own_logprobs_are_set_against_qwen_tts_forced_ones(policy):
    """comparisons.forced.own_logprob_gap: the worst |own - qwen-tts| log-probability of the
    candidate's token over its frames (here -1.0 against qwen-tts's -2.0)."""
    v = classify(with_own(evidence(CODES, CODES, scores(), scores()), own_topk(CODES), own_topk(CODES)), policy)
    assert v.comparisons["forced"]["own_logprob_gap"] == pytest.approx(1.0)
    # and its own top-1/top-2 margin per frame rides in the trace (MLflow: step = frame)
    assert v.comparisons["forced"]["trace"]["own_margin_codebook0"] == [0.01] * T


def test_a_concurrency_flip_that_is_no_near_tie_is_a_concurrency_defect(policy):
    at_n = CODES.copy()
    at_n[10:, 0] += 1
    v = classify(evidence(at_n, CODES, scores({(10, 0): 2}, {(10, 0): 0.2}), scores()), policy)
    assert (v.verdict, v.first_divergent_frame) == ("concurrency_defect", 10)
    assert "not a near-tie" in v.summary and v.comparisons["near_tie"]["near_tie"] is False


def test_a_near_tie_followed_by_an_implausible_stream_is_not_excused(policy):
    at_n = CODES.copy()
    at_n[10:, 0] += 1
    cand_s = scores({(10, 0): 1, (20, 0): 300}, {(10, 0): 0.004, (20, 0): 3.0})
    v = classify(evidence(at_n, CODES, cand_s, scores()), policy)
    assert v.verdict == "talker_defect"
    assert v.comparisons["near_tie"]["near_tie"] is False
    assert "implausible after it" in v.comparisons["near_tie"]["why"]


def test_without_scores_a_flip_stays_a_concurrency_defect_and_the_report_says_so(policy):
    at_n = CODES.copy()
    at_n[10:, 0] += 1
    v = classify(evidence(at_n, CODES), policy)
    assert v.verdict == "concurrency_defect"
    assert "no teacher-forced scores: the talker stage not judged" in v.notes


def test_a_stop_qwen_tts_would_not_make_fails(policy):
    eos = {"rank": 40, "logprob": -6.0, "top1": 7, "top1_logprob": -2.0, "margin": 0.1, "in_support": False}
    v = classify(evidence(cand_scores=scores(eos=eos)), policy)
    assert v.verdict == "talker_defect" and f"stops after {T} frames where qwen-tts ranks the stop 40" in v.summary


def test_policy_forced_section_is_validated(tmp_path):
    base = yaml.safe_load(DEFAULT_POLICY.read_text())
    assert load_policy().forced == forced.ForcedPolicy(**base["forced"])
    for key, value, problem in (("max_rankk", 3, "unknown key"), ("max_rank", 2.5, "expected an integer"),
                                ("min_top1_share", 1.5, "out of range"), ("max_gap", "big", "expected a number"),
                                ("near_tie_top_k", 0, "out of range")):
        p = tmp_path / f"{key}.yaml"
        p.write_text(yaml.safe_dump({**base, "forced": {**base["forced"], key: value}}))
        with pytest.raises(BadInput, match=f"forced.{key}: {problem}" if problem != "unknown key" else problem):
            load_policy(p)
    lax = tmp_path / "lax.yaml"
    lax.write_text(yaml.safe_dump({**base, "forced": {"max_rank": 50}}))
    assert load_policy(lax).forced.max_rank == 50 and load_policy(lax).forced.max_gap == base["forced"]["max_gap"]


def test_score_files_round_trip_and_damage_is_refused(tmp_path):
    sf = scores({(3, 4): 2}, {(3, 4): 0.1})
    side = write_scores(tmp_path / "a.x", sf)
    back = read_scores(side)
    assert back.arrays["rank"][3, 4] == 2 and back.gap[3, 4] == pytest.approx(0.1)
    npz = tmp_path / "a.x.npz"
    npz.write_bytes(npz.read_bytes()[:-10])
    with pytest.raises(CorruptResult, match="does not match its sidecar"):
        read_scores(side)


def _drawn(rng, logits, temperature, frames=40, settings=None):
    """A score file for tokens drawn from softmax(logits / temperature), judged under temperature 1:
    what the scorer writes for a candidate that samples at `temperature` where 1 was asked."""
    V = len(logits)
    p_true = np.exp(logits - logits.max())
    p_true /= p_true.sum()
    q = np.exp(logits / temperature - (logits / temperature).max())
    q /= q.sum()
    lp = np.log(p_true)
    shape = (frames, 16)
    tok = rng.choice(V, size=shape, p=q)
    expected = float((p_true * lp).sum())
    var = float((p_true * lp * lp).sum() - expected ** 2)
    sf = scores(settings=settings or {"do_sample": True, "subtalker_dosample": True}, codes=np.zeros(shape, np.int64))
    sf.arrays.update(sample_logprob=lp[tok].astype(np.float32),
                     expected_logprob=np.full(shape, expected, np.float32), logprob_var=np.full(shape, var, np.float32))
    return sf


def test_the_sampling_test_is_calibrated_and_sees_too_hot_and_too_cold():
    from difftest.verdicts import sampling

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.0, 64)
    stats = [sampling.statistic([_drawn(rng, logits, 1.0)]) for _ in range(200)]
    for part in ("talker", "code_predictor"):
        zs = [s["parts"][part]["z"] for s in stats]
        assert abs(np.mean(zs)) < 0.25 and 0.8 < np.std(zs) < 1.2, part  # standard normal under the null
    assert sum(abs(s["z"]) > 4 for s in stats) == 0  # the worse of the two parts
    hot = sampling.statistic([_drawn(rng, logits, 1.6)])
    cold = sampling.statistic([_drawn(rng, logits, 0.6)])
    assert hot["z"] < -4 < 4 < cold["z"]
    ref = {"a": _drawn(rng, logits, 1.0)}
    verdict = sampling.judge({"candidate": {"a": _drawn(rng, logits, 1.6)}, "reference": ref}, 4.0)
    assert verdict["verdict"] == "sampling_defect" and "less likely than qwen-tts's own sampling" in verdict["summary"]
    assert sampling.judge({"candidate": {"a": _drawn(rng, logits, 1.0)}, "reference": ref}, 4.0)["verdict"] == "pass"


def test_an_uncalibrated_sampling_test_fails_nothing_and_says_so():
    from difftest.verdicts import sampling

    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1.0, 64)
    v = sampling.judge({"candidate": {"a": _drawn(rng, logits, 1.6)}, "reference": {"a": _drawn(rng, logits, 1.6)}}, 4.0)
    assert v["verdict"] == "pass" and v["calibrated"] is False and "not calibrated" in v["summary"]


def test_greedy_streams_give_no_sampling_test():
    from difftest.verdicts import sampling

    assert sampling.judge({"candidate": {"a": scores()}}, 4.0) is None


def test_a_run_level_sampling_defect_fails_the_run(policy):
    from difftest.records.report import build_report

    v = classify(evidence(), policy)
    ok = build_report([v], policy, sampling=None)
    assert ok["verdict"] == "pass" and ok["sampling"] is None
    bad = build_report([v], policy, sampling={"verdict": "sampling_defect", "summary": "z = -9"})
    assert (bad["verdict"], bad["exit_code"]) == ("fail", 1)


def test_the_trace_reaches_the_report_and_mlflow_by_frame(policy):
    from difftest.records.mlflow_records import segment_metrics

    long_codes = toy_codes(200, 1)
    sf = scores({(150, 0): 400}, {(150, 0): 2.5}, codes=long_codes)
    v = classify(evidence(long_codes, cand_scores=sf, ref_codes=long_codes), policy)
    tr = v.comparisons["forced"]["trace"]
    assert (tr["start"], tr["end"]) == (130, 190)  # 20 frames before the first implausible one, 40 after
    assert tr["rank_codebook0"][150 - 130] == 400 and tr["gap_codebook0"][20] == 2.5
    metrics = {(n, step): x for n, x, step in segment_metrics(v.to_json())}
    assert metrics[("forced.rank_codebook0", 150)] == 400 and metrics[("forced.gap_codebook0", 149)] == 0
    assert ("forced.rank_codebook0", 129) not in metrics


def test_reference_codes_far_from_qwen_tts_encoder_are_a_reference_encoder_defect(policy):
    mine = REF.copy()
    mine[:, 8:] += 1  # half the codebooks of every frame moved: 50% agree, the policy's floor
    rng = np.random.default_rng(0)

    def judged(ref_codes):
        e = evidence()
        e.candidate = toy_result("a", CODES, ref_codes)
        e.cross_own = toy_result("a", CODES, ref_codes)
        return classify(e, policy)

    v = judged(mine)
    assert v.verdict == "code_divergence" and v.comparisons["codes"]["ref_codes_agreement"] == 0.5
    other_voice = rng.integers(0, 2048, REF.shape)
    v = judged(other_voice)
    assert (v.verdict, v.stage) == ("reference_encoder_defect", "reference_encoder") and policy.fails(v.verdict)
    assert "of their entries agree with qwen-tts's (policy: 50%)" in v.summary
    assert "the reference codes the vocoder got (no talker stage captured" in v.summary
    longer = np.concatenate([REF, REF[:3]])
    v = judged(longer)  # the codes are qwen-tts's exactly: the talker had qwen-tts's reference (issue 57)
    assert (v.verdict, v.stage) == ("handoff_defect", "handoff")
    assert "the reference the vocoder got is qwen-tts's 3 frames too many at its end (15 frames for 12)" in v.summary
    e = evidence()  # codes of its own: nothing says what the talker had; the encoder or the hand-off
    other = CODES.copy()
    other[:, 3] = (other[:, 3] + 1) % 2048
    e.candidate, e.cross_own = toy_result("a", other, longer), toy_result("a", other, longer)
    v = classify(e, policy)
    assert v.verdict == "reference_encoder_defect" and "15 frames where qwen-tts's encoder makes 12" in v.summary


def test_the_bf16_encoding_of_the_voice_also_counts_and_nothing_else_does(policy):
    """A bf16 encoder (vLLM-Omni's) on a CPU with AMX agrees with qwen-tts's float32 encoder on 10-13%
    of entries: its codes are judged against qwen-tts's own encoder in bf16 too, and the closer wins.
    A bf16 encoding of another length, or another voice's codes, still fails."""
    rng = np.random.default_rng(1)
    bf16 = REF.copy()
    bf16[:, 1:] = rng.integers(0, 2048, (len(REF), 15))  # qwen-tts's bf16 encoding: codebook 0 alone kept
    mine = bf16.copy()
    mine[:, 14:] += 1  # the candidate's: 14 of 16 codebooks as qwen-tts's bf16 encoder, ~6% as its float32

    def judged(ref_codes, ref_bf16):
        e = evidence()
        if ref_bf16 is not None:
            e.reference.extra["ref_codes_bf16"] = ref_bf16
        e.candidate = toy_result("a", CODES, ref_codes)
        e.cross_own = toy_result("a", CODES, ref_codes)
        return classify(e, policy)

    v = judged(mine, None)
    assert v.verdict == "reference_encoder_defect" and "float32 or bf16" not in v.summary
    v = judged(mine, bf16)
    c = v.comparisons["codes"]
    assert v.verdict == "code_divergence" and v.stage == "reference_encoder", v.summary
    assert c["ref_codes_agreement"] < 0.1 and c["ref_codes_agreement_bf16"] == 0.875
    assert "88% of entries agree" in v.summary
    v = judged(rng.integers(0, 2048, REF.shape), bf16)
    assert v.verdict == "reference_encoder_defect" and "(float32 or bf16)" in v.summary
    v = judged(mine, np.concatenate([bf16, bf16[:2]]))  # a bf16 encoding of another length is not used
    assert v.verdict == "reference_encoder_defect" and "ref_codes_agreement_bf16" not in v.comparisons["codes"]


def test_policy_reference_encoder_section_is_validated(tmp_path):
    base = yaml.safe_load(DEFAULT_POLICY.read_text())
    assert load_policy().encoder_min_agreement == base["reference_encoder"]["min_agreement"] == 0.5
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump({**base, "reference_encoder": {"min_agreement": 2}}))
    with pytest.raises(BadInput, match=r"reference_encoder.min_agreement: out of range: 2, allowed \[0.05, 1\]"):
        load_policy(p)


class _DyingRunner:
    """A test double for the reference runner: answers the first score item, then dies."""

    hello = {"fingerprint": {"engine": "double"}, "score_version": 99}

    def __init__(self, answer_path):
        self.answer_path = answer_path

    def request(self, op, timeout, items):
        from difftest.process.runner_client import RunnerDied

        yield {"event": "result", "item": items[0]["name"], "path": str(self.answer_path)}
        raise RunnerDied("runner exited with status 9", tail="killed")


def test_a_runner_dying_while_scoring_costs_the_unanswered_items_only(tmp_path):
    from types import SimpleNamespace

    from difftest.engines.scorer import ScoreItem, Scorer

    answer = write_scores(tmp_path / "answer", scores())
    scorer = Scorer(_DyingRunner(answer), tmp_path / "store", timeout=10)
    seg = SimpleNamespace(id="a", hash="h" * 16, to_job=lambda: {"id": "a"})
    got = scorer.score({n: ScoreItem(seg, toy_codes(5 + i, i), None, False) for i, n in enumerate(("x", "y", "z"))})
    assert got["x"].frames == T
    assert got["y"] == got["z"] == "reference runner died while scoring: runner exited with status 9"
    # the store names inputs by content: a second scorer finds nothing cached for y and z
    assert not list((tmp_path / "store").glob("scores-*/a.*.json"))


def test_an_older_runner_without_the_score_job_is_an_infrastructure_error(tmp_path):
    from difftest.engines.scorer import Scorer
    from difftest.errors import InfraError

    runner = _DyingRunner(None)
    runner.hello = {"fingerprint": {}}
    with pytest.raises(InfraError, match="no score job"):
        Scorer(runner, tmp_path / "store", timeout=10)


EXACT = {"dtype": "float32", "from": "the engine's identity", "exact": True}
BF16 = {"dtype": "bfloat16", "from": "declared (--candidate-dtype)", "exact": False}


def test_in_qwen_tts_own_numerics_one_token_off_its_top1_fails_its_segment(policy):
    """Issue 57, item 1: a float32 candidate's null is qwen-tts itself, which never leaves its own top-1:
    one token off it by more than a float32 tie is a defect at concurrency 1, no count over the run."""
    other = CODES.copy()
    other[22:, 0] += 1  # a scaled speaker embedding: plausible, one flip at frame 22
    sf = scores({(22, 0): 1}, {(22, 0): 0.02})
    ev = replace(evidence(other, cand_scores=sf), control=None, numerics=EXACT)
    v = classify(ev, policy)
    assert (v.verdict, v.stage, v.first_divergent_frame) == ("talker_defect", "talker", 22), v.summary
    assert "1 greedy tokens off qwen-tts's top-1 by more than a float32 tie (5e-05 nats)" in v.summary
    assert "frame 22 codebook 0 (rank 1, 0.02 nats below its top-1)" in v.summary
    assert "qwen-tts's own numerics (float32: the engine's identity)" in v.summary
    assert v.comparisons["forced"]["exact_tie_gap"] == 5e-5
    # the same stream in bf16 numerics is the measured null's to judge (run level): plausible here
    assert classify(replace(ev, numerics=BF16), policy).verdict == "code_divergence"
    # a code predictor token counts the same way
    sf = scores({(7, 9): 1}, {(7, 9): 0.3})
    assert classify(replace(ev, scores={"candidate": sf}), policy).stage == "talker"


def test_a_float32_tie_is_excused_and_only_that(policy):
    """The line is the measured tie width (2.5e-5 nats of float32 reordering, twice that allowed): a
    token on a tie passes, one just past the line fails; sampled sites are the support's to judge."""
    other = CODES.copy()
    other[3:, 0] += 1
    ev = replace(evidence(other), control=None, numerics=EXACT)
    tie = classify(replace(ev, scores={"candidate": scores({(3, 0): 1}, {(3, 0): 2e-5})}), policy)
    assert tie.verdict == "code_divergence", tie.summary
    past = classify(replace(ev, scores={"candidate": scores({(3, 0): 1}, {(3, 0): 1e-4})}), policy)
    assert past.verdict == "talker_defect", past.summary
    sampled = {"do_sample": True, "subtalker_dosample": False}
    s = classify(replace(ev, scores={"candidate": scores({(3, 0): 1}, {(3, 0): 0.3}, settings=sampled)}), policy)
    assert s.verdict != "talker_defect", s.summary


def test_in_exact_numerics_a_departure_only_at_n_stays_the_concurrency_checks(policy):
    """At N the rule holds only where the stream at 1 leaves qwen-tts's top-1 too: a flip at N alone is a
    concurrency defect (cobatch-blend's class), not the talker's."""
    other = CODES.copy()
    other[9:, 0] += 1
    clean, off = scores(), scores({(9, 0): 1}, {(9, 0): 0.05})
    ev = replace(evidence(other, ctrl_codes=CODES, cand_scores=off, ctrl_scores=clean), numerics=EXACT)
    v = classify(ev, policy)
    assert v.verdict == "concurrency_defect" and "talker_defect" not in " ".join(v.notes), (v.summary, v.notes)
    both = classify(replace(ev, control=toy_result("a", other, REF), scores={"candidate": off, "control": off}), policy)
    assert (both.verdict, both.stage) == ("talker_defect", "talker"), both.summary


def test_in_exact_numerics_a_stop_off_the_top1_fails(policy):
    eos = {"rank": 1, "logprob": -2.5, "top1_logprob": -2.0, "in_support": True}
    ev = replace(evidence(CODES[:-1], cand_scores=scores(eos=eos, codes=CODES[:-1])), control=None, numerics=EXACT)
    v = classify(ev, policy)
    assert v.verdict in ("talker_defect",) and "stops after 29 frames" in v.summary, v.summary
