"""The measured null's run-level test (difftest/verdicts/null.py), on score files built here: the
counts it reads, its p-value against known binomial tails, and its decisions."""

import numpy as np
import pytest
from scipy.stats import binom

from difftest.records.report import overall
from difftest.scores import ScoreFile
from difftest.verdicts import null
from difftest.verdicts.null import NullPolicy
from difftest.verdicts.policy import load_policy


def _sf(off0: int, off_sub: int, frames: int = 40, settings=None, sid="s") -> ScoreFile:
    """A stream of `frames` frames whose first `off0` codebook-0 and `off_sub` codebook-1-15 tokens are
    qwen-tts's rank 1, 0.02 nats below its top-1; every other token its top-1."""
    rank = np.zeros((frames, 16), np.int64)
    rank[:off0, 0] = 1
    rank.reshape(-1)[[i for i in range(frames * 16) if i % 16][:off_sub]] = 1
    top1 = np.zeros((frames, 16), np.float32)
    logprob = np.where(rank > 0, -0.02, 0.0).astype(np.float32)
    arrays = {"rank": rank, "top1_logprob": top1, "logprob": logprob, "in_support": rank < 1,
              "support_gap": np.where(rank > 0, 0.02, 0.0).astype(np.float32)}
    return ScoreFile(sid, "h", arrays, settings=settings or {})


NUMERICS = {"dtype": "bfloat16", "from": "test", "exact": False}


def test_counts_off_the_top1_where_greedy_and_outside_the_support_where_sampled():
    assert null.counts(_sf(3, 7)) == {"talker": (3, 40, pytest.approx(0.06)), "code_predictor": (7, 600, pytest.approx(0.14))}
    # the score file's rank-1 tokens are outside its support here, 0.02 nats below its last token
    assert null.counts(_sf(3, 7, settings={"do_sample": True})) == {
        "code_predictor": (7, 600, pytest.approx(0.14)), "talker_sampled": (3, 40, pytest.approx(0.06))}
    assert set(null.counts(_sf(3, 7, settings={"do_sample": True, "subtalker_dosample": True}))) == {
        "talker_sampled", "code_predictor_sampled"}
    assert not null.needed({"a": _sf(0, 0)}) and null.needed({"a": _sf(0, 1)})
    assert null.needed({"a": _sf(1, 0, settings={"do_sample": True})})  # a sampled token outside the support


def test_p_value_is_the_binomial_tail_at_the_margin():
    # k_c = 30 of n_c = 1000, k_0 = 10 of n_0 = 1000, margin 1.5: pi = 1500 / 2500
    assert null.p_value(30, 1000, 10, 1000, 1.5) == pytest.approx(binom.sf(29, 40, 0.6))
    assert null.p_value(0, 1000, 10, 1000, 1.5) == 1.0
    # a null that never leaves its top-1 (float32 against itself): p = pi ** k_c
    assert null.p_value(11, 1860, 0, 1860, 1.5) == pytest.approx(0.6 ** 11)
    assert null.p_value(11, 1860, 0, 1860, 1.5) < 0.005 < null.p_value(10, 1860, 0, 1860, 1.5)


def test_a_candidate_as_noisy_as_the_null_passes_and_a_noisier_one_is_a_talker_defect():
    policy = NullPolicy()
    null_scores = {f"s{i}": _sf(1, 10, sid=f"s{i}") for i in range(4)}
    same = null.judge({f"s{i}": _sf(1, 12, sid=f"s{i}") for i in range(4)}, null_scores, policy, NUMERICS)
    assert same["verdict"] == "pass" and same["null_decoded"]
    assert same["sites"]["code_predictor"]["candidate"]["off_top1"] == 48
    assert same["sites"]["code_predictor"]["null"]["off_top1"] == 40
    assert same["sites"]["talker"]["alpha"] == pytest.approx(0.005)  # 1% over two sites
    worse = null.judge({f"s{i}": _sf(1, 30, sid=f"s{i}") for i in range(4)}, null_scores, policy, NUMERICS)
    assert worse["verdict"] == "talker_defect" and worse["site"] == "code_predictor"
    assert "120 times in 2400" in worse["summary"] and "40 times in 2400" in worse["summary"]
    assert worse["segments"]["s0"]["code_predictor"] == [30, 10, 600]
    # the margin is what lets a 1.3x rate pass on a long run and a 2x rate fail
    assert null.judge({f"s{i}": _sf(1, 13, sid=f"s{i}") for i in range(4)},
                      {f"s{i}": _sf(1, 10, sid=f"s{i}") for i in range(4)}, policy, NUMERICS)["verdict"] == "pass"


def test_without_a_null_only_a_candidate_that_never_leaves_the_top1_passes():
    ok = null.judge({"a": _sf(0, 0)}, None, NullPolicy(), NUMERICS)
    assert ok["verdict"] == "pass" and not ok["null_decoded"] and "no null needed" in ok["summary"]
    with pytest.raises(ValueError, match="a null is needed"):
        null.judge({"a": _sf(0, 1)}, None, NullPolicy(), NUMERICS)
    # a null that could not be decoded for a segment: never a pass, an infrastructure error (exit 3)
    for got in ({}, {"b": _sf(1, 5, sid="b")}):
        nothing = null.judge({"a": _sf(2, 5), "b": _sf(1, 5, sid="b")}, got, NullPolicy(), NUMERICS)
        assert nothing["verdict"] == "error" and "a" in nothing["null_missing"] and "a" in nothing["summary"]
        assert overall([], load_policy(), [nothing]) == ("error", 3)
    inside = null.judge({"a": _sf(0, 0, settings={"do_sample": True, "subtalker_dosample": True})}, None,
                        NullPolicy(), NUMERICS)
    assert inside["verdict"] == "pass" and set(inside["sites"]) == {"talker_sampled", "code_predictor_sampled"}
    assert inside["sites"]["talker_sampled"]["candidate"]["outside_support"] == 0


def test_sampled_tokens_outside_the_support_are_counted_against_the_nulls():
    """A bf16 sampler draws past float32's support boundary now and then: the candidate's count of
    such tokens against qwen-tts's own in its numerics, with the same seeds; its per-token allowance."""
    hot = {"do_sample": True, "subtalker_dosample": True}
    null_scores = {f"s{i}": _sf(1, 10, settings=hot, sid=f"s{i}") for i in range(4)}
    same = null.judge({f"s{i}": _sf(1, 12, settings=hot, sid=f"s{i}") for i in range(4)}, null_scores, NullPolicy(),
                      NUMERICS)
    assert same["verdict"] == "pass" and same["sites"]["code_predictor_sampled"]["null"]["outside_support"] == 40
    assert null.support_noise(same) == {"dtype": "bfloat16", "exact": False, "outside": 44, "tokens": 2560}
    worse = null.judge({f"s{i}": _sf(1, 40, settings=hot, sid=f"s{i}") for i in range(4)}, null_scores, NullPolicy(),
                       NUMERICS)
    assert worse["verdict"] == "talker_defect" and worse["site"] == "code_predictor_sampled"
    assert "fall outside qwen-tts's sampling support 160 times in 2400" in worse["summary"]
    greedy_only = null.judge({"a": _sf(1, 1)}, {"a": _sf(0, 1)}, NullPolicy(), NUMERICS)
    assert null.support_noise(greedy_only) is None and null.support_noise(None) is None


def test_the_candidates_numerics():
    overlay = {"overlay": {"stages": [{"stage_id": 1, "dtype": "float32"}, {"stage_id": 0, "dtype": "bfloat16"}]}}
    assert null.talker_dtype(overlay) == ("bfloat16", "the deploy overlay's stage 0")
    assert null.talker_dtype({"kind": "cpu-engine", "dtype": "float32"})[0] == "float32"
    assert null.talker_dtype({"kind": "url"}) == ("float32", "not declared: judged as exact")
    assert null.talker_dtype(overlay, "float32") == ("float32", "declared (--candidate-dtype)")

    class R:  # a URL candidate's results, their capture's speaker embedding dtype
        def __init__(self, dt):
            self.extra = {"input_speaker_dtype": np.array(dt)} if dt is not None else {}

    got = {"a": R("bfloat16"), "b": R(""), "c": R(None)}
    assert null.talker_dtype({"kind": "url"}, None, got) == ("bfloat16", "the capture's speaker embedding")
    assert null.talker_dtype({"kind": "url"}, None, {**got, "d": R("float32")})[0] == "float32"  # two: not read


def test_the_policy_holds_the_rate_and_the_margin(tmp_path):
    p = load_policy()
    assert (p.null.false_flag_rate, p.null.rate_margin) == (0.01, 1.5)
    assert p.as_dict()["measured_null"] == {"false_flag_rate": 0.01, "rate_margin": 1.5,
                                            "segment_false_flag_rate": 0.01, "noise_scale": 1.5}
    text = (load_policy.__globals__["DEFAULT_POLICY"]).read_text()
    for bad, msg in (("rate_margin: 0.5", r"measured_null.rate_margin: out of range: 0.5, allowed \[1, 10\]"),
                     ("false_flag_rate: 0", r"measured_null.false_flag_rate: out of range: 0, allowed \[1e-6, 0.5\]"),
                     ("false_flag_rate: x", "measured_null.false_flag_rate: expected a number")):
        key = bad.split(":")[0]
        f = tmp_path / "p.yaml"
        f.write_text("\n".join(f"  {bad}" if line.strip().startswith(key + ":") else line for line in text.splitlines()))
        with pytest.raises(Exception, match=msg.replace("(", r"\(").replace(")", r"\)")):
            load_policy(f)


# -- the null at concurrency N ------------------------------------------------------------------

class _Seg:
    def __init__(self, sid, task="voice_clone", **decode):
        self.id, self.task = sid, task
        self.decode = {"seed": hash(sid) % 7, "max_new_tokens": 40, "do_sample": False, "subtalker_dosample": False,
                       **decode}


class _Res:
    def __init__(self, codes):
        self.codes = codes


def test_batch_groups_split_each_wave_into_what_qwen_tts_can_batch():
    segs = [_Seg("a"), _Seg("b", task="custom_voice"), _Seg("c"), _Seg("d", do_sample=True),
            _Seg("e", max_new_tokens=20), _Seg("f")]
    groups = null.batch_groups(segs, [["a", "b", "c", "d"], ["e", "f"]])
    assert [[s.id for s in g] for g in groups] == [["a", "c"], ["b"], ["e"], ["f"]]  # seeds differ: one batch


def test_flip_at_and_the_batch_noise_it_gives():
    a = np.zeros((10, 16), np.int64)
    b = a.copy()
    b[4, 3] = 1
    assert null.flip_at(a, a) is None and null.flip_at(a, b) == (4, 3) and null.flip_at(a, a[:8]) == (8, 0)
    alone = {"x": _Res(a), "y": _Res(a), "z": _Res(a)}
    batched = {"x": _Res(b), "y": _Res(a), "z": _Res(a[:8])}
    gaps = np.zeros((10, 16), np.float32)
    gaps[4, 3] = 0.02
    sf = lambda g: ScoreFile("s", "h", {"rank": (g > 0).astype(np.int64), "top1_logprob": np.zeros((10, 16), np.float32),
                                        "logprob": -g})
    noise = null.batch_noise(alone, batched, {"x": sf(np.zeros((10, 16), np.float32))}, {"x": sf(gaps)},
                             ["x", "y", "z"], NUMERICS)
    assert noise["flips"] == 2 and noise["segments"] == 3 and noise["max_gap"] == pytest.approx(0.02)
    assert noise["flipped"]["x"] == {"frame": 4, "codebook": 3, "gap": pytest.approx(0.02)}
    assert noise["flipped"]["z"] == {"frame": 8, "codebook": 0, "gap": None}  # unscored: no gap is guessed
    assert null.unexplained(noise) is None and null.unexplained(None) is None  # parts; or not measured
    exact = {**noise, "flips": 0, "flipped": {}, "exact": True}  # float32: its zero is structure
    assert "never parts from itself alone (3 segments)" in null.unexplained(exact)
    assert null.unexplained({**exact, "exact": False}) is None  # bf16: its zero may be chance


def test_wider_is_a_one_sided_rank_test_of_the_flips_widths():
    assert null.wider([], [0.1]) == 1.0 and null.wider([0.1], []) == 1.0
    assert null.wider([0.04, 0.05, 0.045], [0.01, 0.02, 0.015]) == pytest.approx(0.05)  # 1 / C(6, 3)
    assert null.wider([0.01, 0.02], [0.04, 0.05]) > 0.5
    rng = np.random.default_rng(0)  # the same width distribution on both sides: p is uniform, not small
    ps = [null.wider(list(rng.exponential(0.02, 8)), list(rng.exponential(0.02, 8))) for _ in range(400)]
    assert 0.03 < np.mean(np.array(ps) < 0.1) < 0.17


def test_judge_at_n_counts_flips_against_the_nulls_own():
    policy = NullPolicy()
    clean = {f"s{i}": _sf(1, 10, sid=f"s{i}") for i in range(4)}
    flipped = {f"n{i}": {"frame": 2, "codebook": 3, "gap": 0.01 * (i + 1)} for i in range(9)}
    noise = {"dtype": "bfloat16", "segments": 20, "flips": 9, "max_gap": 0.09, "flipped": flipped}
    one = {"s0": {"frame": 3, "codebook": 1, "gap": 0.03}}
    ok = null.judge_at_n(clean, clean, noise, one, policy, NUMERICS)
    assert ok["verdict"] == "pass" and ok["flips"]["candidate"] == 1 and ok["flips"]["null"] == 9
    assert ok["role"] == "candidate" and ok["sites"]["talker"]["alpha"] == pytest.approx(0.01 / 8)
    assert ok["flips"]["alpha"] == pytest.approx(0.01 / 8)  # half the run's rate, over four tests
    assert ok["flips"]["width_p_value"] > 0.5
    many = {f"s{i}": {"frame": 1, "codebook": 0, "gap": 0.01} for i in range(20)}
    few = {**noise, "flips": 1, "flipped": {"n0": flipped["n0"]}}
    bad = null.judge_at_n(clean, clean, few, many, policy, NUMERICS)
    assert bad["verdict"] == "concurrency_defect" and "20 of 20 greedy segments" in bad["summary"]
    assert null.judge_at_n(clean, clean, few, many, policy, NUMERICS, at_one="talker_defect")["verdict"] == "talker_defect"
    # as many flips as the null's, every one wider than any of the null's: the width test
    wide = {f"s{i}": {"frame": 1, "codebook": 0, "gap": 0.2 + 0.01 * i} for i in range(9)}
    w = null.judge_at_n(clean, clean, noise, wide, policy, NUMERICS)
    assert w["verdict"] == "concurrency_defect" and "wider ties" in w["summary"], w["flips"]
    assert w["flips"]["width_p_value"] < w["flips"]["alpha"] < w["flips"]["p_value"]
    worse = {f"s{i}": _sf(1, 30, sid=f"s{i}") for i in range(4)}
    assert null.judge_at_n(worse, clean, noise, {}, policy, NUMERICS)["verdict"] == "concurrency_defect"
    # nothing to explain: no null decoded, a pass that says so
    top1 = {f"s{i}": _sf(0, 0, sid=f"s{i}") for i in range(4)}
    none = null.judge_at_n(top1, None, None, {}, policy, NUMERICS)
    assert none["verdict"] == "pass" and not none["null_decoded"] and "flips" not in none


def test_a_run_level_failure_names_the_segments_that_carry_it():
    """Issue 57: the measured null failed the run, and the segments read 'plausible'; a maintainer was
    told something was wrong, not where to listen. The segments whose own count exceeds the null's on
    the same segment are the suspects, most excess first, in the finding and as segment notes."""
    policy = NullPolicy()
    null_scores = {f"s{i}": _sf(1, 10, sid=f"s{i}") for i in range(4)}
    cand = {"s0": _sf(1, 10, sid="s0"), "s1": _sf(1, 60, sid="s1"), "s2": _sf(1, 9, sid="s2"), "s3": _sf(1, 25, sid="s3")}
    f = null.judge(cand, null_scores, policy, NUMERICS)
    assert f["verdict"] == "talker_defect" and f["site"] == "code_predictor"
    assert f["suspects"] == [{"segment": "s1", "count": 60, "null": 10, "tokens": 600},
                             {"segment": "s3", "count": 25, "null": 10, "tokens": 600}]
    assert f["summary"].endswith("; carried by s1 (60 against 10), s3 (25 against 10)")
    notes = null.suspect_notes([f, None])
    assert set(notes) == {"s1", "s3"}
    assert notes["s1"] == ["suspect: carries the run's talker_defect at concurrency 1 (code predictor: 60 of 600 tokens "
                           "off qwen-tts's top-1 where qwen-tts in bfloat16 has 10)"]
    passing = null.judge({f"s{i}": _sf(1, 11, sid=f"s{i}") for i in range(4)}, null_scores, policy, NUMERICS)
    assert passing["verdict"] == "pass" and "suspects" not in passing and null.suspect_notes([passing]) == {}
    at_n = {"verdict": "concurrency_defect", "role": "candidate", "flips": {
        "candidate_flipped": {"s2": {"frame": 7, "codebook": 0, "gap": 0.5}}}}
    assert null.suspect_notes([at_n]) == {"s2": ["suspect: carries the run's concurrency_defect (its codes at "
                                                 "concurrency N part from its codes at 1 at frame 7, codebook 0, "
                                                 "0.5 nats from qwen-tts's top-1)"]}


# -- the noise model per token (issue 57, item 2) --


def _scored(margin: np.ndarray, flips: dict | None = None, sid="s") -> ScoreFile:
    """A greedy stream with these top-1/top-2 margins; `flips` {(frame, codebook): gap} to qwen-tts's
    rank 1 (whose gap is the margin there)."""
    rank = np.zeros(margin.shape, np.int64)
    logprob = np.zeros(margin.shape, np.float32)
    margin = margin.copy()
    for (f, c), g in (flips or {}).items():
        rank[f, c], logprob[f, c], margin[f, c] = 1, -g, g
    arrays = {"rank": rank, "top1_logprob": np.zeros(margin.shape, np.float32), "logprob": logprob,
              "margin": margin.astype(np.float32), "in_support": rank < 1,
              "support_gap": np.zeros(margin.shape, np.float32)}
    return ScoreFile(sid, "h", arrays, settings={})


def _model(scale=1.0, alpha=1e-3):
    """The null moves every margin by 0-0.1 nats (uniform over 40 x 16 positions), float32 against bf16."""
    rng = np.random.default_rng(0)
    base = rng.uniform(0.5, 3, (40, 16))
    moved = base + rng.uniform(-0.1, 0.1, (40, 16))
    return null.noise_model({"s": _scored(base)}, {"s": _scored(moved)}, "bfloat16", scale, alpha * 4, 4)


def test_the_noise_model_is_how_far_the_null_numerics_move_each_margin():
    m = _model()
    assert set(m.moved) == {"talker", "code_predictor"}
    assert len(m.moved["talker"]) == 40 and len(m.moved["code_predictor"]) == 600
    assert 0.09 < m.moved["code_predictor"][-1] <= 0.1 and m.alpha == pytest.approx(1e-3)
    assert m.survival("code_predictor", 0.0) == 1.0 and m.survival("code_predictor", 0.2) < 1e-5
    assert 0.4 < m.survival("code_predictor", 0.05) < 0.6  # half the uniform |delta| lies past 0.05
    # the candidate's kernels may move a margin 2x as far: 0.15 is then inside what the null did
    assert _model(scale=2.0).survival("code_predictor", 0.15) > 0.2
    # past the null's widest |delta| the fitted power tail keeps mass (S(x) = S(u) (x/u)^-k above the
    # 90th percentile u), never the empirical zero: a few hundred tokens do not show a tail's end
    u, s_u, k = m.tail("code_predictor")
    assert s_u == pytest.approx(0.1, abs=0.01) and k > 1
    assert 0 < m.survival("code_predictor", 0.12) == pytest.approx(s_u * (0.12 / u) ** -k)
    assert m.to_json()["sites"]["talker"]["tokens"] == 40


def test_a_flip_wider_than_the_numerics_move_fails_its_segment_and_one_inside_them_does_not(policy):
    """A segment's widest flip: expected flips that wide in a correct bf16 stream, lambda = sum_t S(max(g,
    m_t)); p = 1 - exp(-lambda). Inside the null's movement on a stream of near-ties it is likely; past
    every |delta| the null showed it has probability 0 and fails alone (talker_defect at the talker)."""
    from dataclasses import replace

    from difftest.verdicts.classify import classify
    from test_verdicts_forced import CODES, evidence

    m = _model()
    near = np.full((30, 16), 0.03)  # a stream of near-ties: a correct bf16 engine flips some of them
    inside = null.widest_flip(_scored(near, {(5, 0): 0.03}), m)
    assert inside["site"] == "talker" and inside["frame"] == 5 and inside["p"] > 0.5, inside
    far = null.widest_flip(_scored(np.full((30, 16), 2.0), {(7, 3): 0.4, (9, 0): 0.02}), m)
    assert (far["frame"], far["codebook"], far["site"]) == (7, 3, "code_predictor") and far["p"] < 1e-6, far
    assert far["gap"] == 0.4  # the talker's 0.02 flip there is one a correct bf16 engine makes (p > 0.5)
    assert null.widest_flip(_scored(near), m) is None

    other = CODES.copy()
    other[7:, 3] += 1
    ev = replace(evidence(other, cand_scores=_scored(np.full((30, 16), 2.0), {(7, 3): 0.4})), control=None,
                 numerics=NUMERICS, noise_model=m)
    v = classify(ev, policy)
    assert (v.verdict, v.stage, v.first_divergent_frame) == ("talker_defect", "talker", 7), v.summary
    assert "0.4 nats off qwen-tts's top-1, wider than qwen-tts in bfloat16 moves a code predictor token" in v.summary
    assert v.comparisons["forced"]["noise"]["p"] < 1e-6
    ok = classify(replace(ev, scores={"candidate": _scored(near, {(7, 3): 0.03})}), policy)
    assert ok.verdict == "code_divergence" and ok.comparisons["forced"]["noise"]["p"] > 0.5, ok.summary
    # without a model (no null decoded), the per-token lines alone: 0.4 nats is plausible
    assert classify(replace(ev, noise_model=None), policy).verdict == "code_divergence"


def test_the_per_token_line_widens_to_what_the_numerics_are_measured_to_move(policy):
    """forced.max_gap (1.5 nats) is this checkpoint's measured bf16 reach; where qwen-tts in the
    candidate's numerics moves a site's margins further (a noisier checkpoint, issue 58), the line
    at that site is noise_scale x the widest move, and the noise model judges the flip under it."""
    from dataclasses import replace

    from difftest.verdicts.classify import classify
    from test_verdicts_forced import CODES, evidence

    rng = np.random.default_rng(1)
    base = rng.uniform(0.5, 3, (40, 16))
    moved = base.copy()
    moved[:, 1:] += rng.uniform(-4.0, 4.0, (40, 15))  # codebooks 1-15 move up to 4 nats, codebook 0 0.1
    moved[:, 0] += rng.uniform(-0.1, 0.1, 40)
    m = null.noise_model({"s": _scored(base)}, {"s": _scored(moved)}, "bfloat16", 1.5, 4e-3, 4)
    assert 3.9 < m.widest("code_predictor") / 1.5 <= 4.0 and m.widest("talker") < 0.16
    other = CODES.copy()
    other[7:, 3] += 1
    flip = _scored(np.full((30, 16), 2.0), {(7, 3): 3.0})  # 3 nats: past the policy's 1.5
    ev = replace(evidence(other, cand_scores=flip), control=None, numerics=NUMERICS, noise_model=m)
    v = classify(ev, policy)
    assert v.verdict == "code_divergence", v.summary  # inside what bf16 moves on such weights
    lines = v.comparisons["forced"]["measured_lines"]
    assert lines["codebook0"] == 1.5 and 5.8 < lines["codebooks_1_15"] <= 6.0 and lines["policy"] == 1.5
    # the talker's site keeps the policy's line: its numerics move little
    cb0 = _scored(np.full((30, 16), 2.0), {(7, 0): 3.0})
    other0 = CODES.copy()
    other0[7:, 0] += 1
    v0 = classify(replace(ev, candidate=evidence(other0).candidate, scores={"candidate": cb0}), policy)
    assert v0.verdict == "talker_defect" and "gap <= 1.5" in v0.summary, v0.summary
    # past the widened line the token fails at it; with no model, at the policy's
    far = classify(replace(ev, scores={"candidate": _scored(np.full((30, 16), 2.0), {(7, 3): 7.0})}), policy)
    assert far.verdict == "talker_defect" and "gap <= 6" in far.summary, far.summary
    assert classify(replace(ev, noise_model=None), policy).verdict == "talker_defect"
