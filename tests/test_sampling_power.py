"""The sampling test's statistics (issue #31) on synthetic sampler sites whose truth is known.

A site here is N positions of random logits over 64 tokens; the requested sampler is temperature
0.9 with top-k 20. Tokens are drawn in numpy from the requested distribution (a correct sampler) or
from another (a defect), and the score arrays the scorer would write are computed the same way the
scorer defines them (runners/reference/scoring.py; its own agreement with qwen-tts is
tests/test_reference_scoring.py's). Every seed is fixed: each assertion is deterministic.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from difftest import sampler_bank
from difftest.scores import ScoreFile
from difftest.verdicts import sampling

VOCAB, SIGMA = 64, 2.0
SETTINGS = {"do_sample": True, "temperature": 0.9, "top_k": 20, "top_p": 1.0, "repetition_penalty": 1.0,
            "subtalker_dosample": False}


def _log_softmax(x):
    m = np.max(np.where(np.isfinite(x), x, -np.inf), axis=-1, keepdims=True)
    e = np.exp(x - m)
    return x - m - np.log(e.sum(-1, keepdims=True))


def _dist(s, p):
    """(log-probabilities over the support, support mask) for sampler parameters `p`."""
    scaled = s / p["temperature"]
    keep = np.ones_like(s, bool)
    if 0 < p["top_k"] < s.shape[-1]:
        kth = np.partition(scaled, -p["top_k"], -1)[:, -p["top_k"]][:, None]
        keep &= scaled >= kth
    if p["top_p"] < 1.0:
        masked = np.where(keep, scaled, -np.inf)
        order = np.argsort(-masked, -1)
        probs = np.exp(_log_softmax(np.take_along_axis(masked, order, -1)))
        before = np.cumsum(probs, -1) - probs
        ks = before < p["top_p"]
        ks[:, 0] = True
        nucleus = np.zeros_like(keep)
        np.put_along_axis(nucleus, order, ks, -1)
        keep &= nucleus
    return _log_softmax(np.where(keep, scaled, -np.inf)), keep


def site(n: int, seed: int, draw: dict | None = None, sid: str = "syn") -> ScoreFile:
    """A stream of n talker tokens drawn with `draw` (default: as requested), scored as requested."""
    rng = np.random.default_rng(seed)
    s = rng.normal(0.0, SIGMA, (n, VOCAB))
    req = sampler_bank.site_parameters(SETTINGS, "talker")
    lp, keep = _dist(s, req)
    lq_draw, _ = _dist(s, {**req, **(draw or {})})
    x = (np.cumsum(np.exp(lq_draw), -1) > rng.random((n, 1))).argmax(-1)  # inverse CDF, a row at a time
    rows = np.arange(n)
    lp_x = lp[rows, x]
    p = np.exp(lp)
    lp0 = np.where(keep, lp, 0.0)
    expected = (p * lp0).sum(-1)
    names = sampler_bank.ALTERNATIVES
    alt = {f: np.full((n, 16, len(names)), np.nan, np.float32) for f in ("alt_llr", "alt_kl", "alt_var", "alt_outside")}
    applicable = []
    for j, name in enumerate(names):
        a = sampler_bank.alternative(SETTINGS, "talker", name)
        applicable.append(a is not None)
        if a is None:
            continue
        lq, keep_q = _dist(s, a)
        alt["alt_outside"][:, 0, j] = 1.0 - np.where(keep, np.exp(lq), 0.0).sum(-1)
        lqs = _log_softmax(np.where(keep & keep_q, lq, -np.inf))
        q = np.exp(lqs)
        with np.errstate(invalid="ignore"):  # -inf - -inf outside both supports
            diff = np.where(keep & keep_q, lqs - lp, 0.0)
        kl = (q * diff).sum(-1)
        alt["alt_kl"][:, 0, j] = kl
        alt["alt_var"][:, 0, j] = np.maximum((q * diff * diff).sum(-1) - kl * kl, 0.0)
        alt["alt_llr"][:, 0, j] = lqs[rows, x] - lp_x
    grid = sampler_bank.temperature_grid(req["temperature"])
    temp = np.full((n, 16, len(grid)), np.nan, np.float32)
    cols = np.nonzero(keep)[1].reshape(n, -1)  # the support: top-k, the same size on every row
    at = (cols == x[:, None]).argmax(1)
    kept = np.take_along_axis(s, cols, -1)[:, None, :] / np.asarray(grid)[None, :, None]  # (n, G, k)
    temp[:, 0, :] = _log_softmax(kept)[rows, :, at]
    ids = np.arange(VOCAB)[None, :]
    before = (lp > lp_x[:, None]) | ((lp == lp_x[:, None]) & (ids < x[:, None]))
    mass_above = np.full((n, 16), np.nan, np.float32)
    mass_above[:, 0] = (p * before).sum(-1)

    def col(v):
        a = np.zeros((n, 16), np.float32)
        a[:, 0] = v
        return a

    arrays = {"rank": np.zeros((n, 16), np.int64), "in_support": np.ones((n, 16), bool),
              "sample_logprob": col(lp_x), "expected_logprob": col(expected),
              "logprob_var": col(np.maximum((p * lp0 * lp0).sum(-1) - expected ** 2, 0.0)),
              **alt, "temp_loglik": temp, "mass_above": mass_above}
    bank = {"alternatives": list(names), "sites": {"talker": {"applicable": applicable, "temperature_grid": grid}}}
    return ScoreFile(sid, f"h{seed}", arrays, settings=SETTINGS, bank=bank)


def talker(stat):
    return stat["parts"]["talker"]


def flagged(stat) -> bool:
    return bool(sampling._flags(stat, 4.0))


def test_a_correct_sampler_is_not_flagged_and_its_temperature_is_found():
    stats = [sampling.statistic([site(2000, seed)], label="clean") for seed in range(20)]
    assert sum(flagged(s) for s in stats) == 0
    temps = [talker(s)["temperature"] for s in stats]
    assert sum(t["ci95"][0] <= 0.9 <= t["ci95"][1] for t in temps) >= 18  # a 95% interval
    assert abs(np.mean([t["estimate"] for t in temps]) - 0.9) < 0.01
    pits = [talker(s)["pit"]["p"] for s in stats]
    assert 0.2 < np.mean(pits) < 0.8  # uniform p-values under the null average 0.5


def test_a_temperature_off_by_0_1_is_caught_where_the_power_analysis_says_it_will_be():
    hot = {"temperature": 1.0}
    probe = talker(sampling.statistic([site(2000, 100)], label="probe"))
    need = probe["alternatives"]["temperature+0.1"]["tokens_for_95"]
    assert 300 < need < 20000
    n = int(need * 1.1)
    stats = [sampling.statistic([site(n, 200 + seed, hot)], label="hot") for seed in range(20)]
    assert sum(flagged(s) for s in stats) >= 19
    assert [talker(s)["evalue"]["leading"] for s in stats].count("temperature+0.1") >= 15
    assert all(talker(s)["alternatives"]["temperature+0.1"]["power"] > 0.9 for s in stats)
    assert sum(t["ci95"][0] <= 1.0 <= t["ci95"][1] for t in (talker(s)["temperature"] for s in stats)) >= 18
    # and at a tenth of the tokens, the suite says it cannot see it
    small = talker(sampling.statistic([site(n // 10, 300, hot)], label="small"))
    assert small["alternatives"]["temperature+0.1"]["power"] < 0.5


def test_predicted_power_matches_the_rate_at_which_it_is_caught():
    """Where the analysis predicts power near one half, about half the runs flag (40 seeds)."""
    hot = {"temperature": 1.0}
    probe = talker(sampling.statistic([site(3000, 400)], label="probe"))["alternatives"]["temperature+0.1"]
    kl, var = probe["kl_per_token"], None
    # tokens where the alternative's own component crosses the line half the time: n kl = line
    line = talker(sampling.statistic([site(100, 401)]))["evalue"]["line"] + math.log(8)
    n = int(line / kl)
    stats = [sampling.statistic([site(n, 500 + seed, hot)], label="half") for seed in range(40)]
    predicted = np.mean([talker(s)["alternatives"]["temperature+0.1"]["power"] for s in stats])
    observed = np.mean([talker(s)["evalue"]["flagged"] for s in stats])
    print(f"n={n}: predicted {predicted:.3f}, observed {observed:.3f}")
    assert 0.3 < predicted < 0.7 and abs(observed - predicted) < 0.25, (predicted, observed, var)


@pytest.mark.parametrize("draw,leading", [({"top_k": 10}, "top_k_halved"), ({"top_p": 0.8}, "top_p_other"),
                                          ({"temperature": 0.6}, "temperature-0.3")])
def test_each_alternative_drawn_is_caught_and_named(draw, leading):
    stat = sampling.statistic([site(1500, 600, draw)], label="alt")
    assert talker(stat)["evalue"]["flagged"] and talker(stat)["evalue"]["leading"] == leading


def test_a_wider_sampler_is_the_support_checks_and_the_power_says_so():
    """top-k ignored draws outside the support (each such token fails its segment): inside the
    support it is the requested distribution, so the likelihood ratio has nothing to see."""
    stat = talker(sampling.statistic([site(500, 700)], label="wide"))
    wide = stat["alternatives"]["top_k_ignored"]
    assert wide["kl_per_token"] < 1e-6 and wide["outside_per_token"] > 0.05 and wide["power"] > 0.999
    assert stat["alternatives"]["repetition_penalty_ignored"] == {"applicable": False}  # penalty 1.0 asked


def test_an_unfamiliar_defect_is_caught_by_the_pit():
    """A sampler that always takes one of the two most likely tokens is no alternative of the bank's
    shape at these parameters; the ranks of its tokens are not uniform."""
    rng = np.random.default_rng(800)
    sf = site(1500, 800)
    lo = sf.arrays["mass_above"][:, 0]
    # move every token to the top-1 (mass above 0) half the time: a sampler that ignores the tail
    top = rng.random(len(lo)) < 0.5
    sf.arrays["mass_above"][top, 0] = 0.0
    assert talker(sampling.statistic([sf], label="pit"))["pit"]["flagged"]


def test_ks_pvalue_and_tokens_for_power():
    d, p = sampling.ks_pvalue(np.linspace(0.0005, 0.9995, 1000))
    assert d < 0.001 and p == 1.0
    d, p = sampling.ks_pvalue(np.linspace(0, 1, 400) ** 1.3)  # skewed towards 0
    assert d > 0.08 and p < 1e-3
    # the asymptotic distribution at its 5% point: lambda = 1.358
    u = np.sort(np.random.default_rng(0).random(400))
    d, p = sampling.ks_pvalue(u)
    lam = (20 + 0.12 + 0.11 / 20) * d
    assert abs(p - 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 50))) < 1e-9
    n = sampling.tokens_for_power(0.01, 0.02, 9.0)
    assert n * 0.01 - sampling.Z95 * math.sqrt(n * 0.02) >= 9.0 > (n - 2) * 0.01 - sampling.Z95 * math.sqrt((n - 2) * 0.02)
    assert sampling.tokens_for_power(0.0, 0.0, 9.0) is None


def test_judge_calibration_and_verdict():
    clean = {"s1": site(1500, 900, sid="s1")}
    hot = {"s1": site(3000, 901, {"temperature": 0.6}, sid="s1")}
    ok = sampling.judge({"candidate": clean, "control": clean, "reference": clean}, 4.0)
    assert ok["verdict"] == "pass" and ok["calibrated"] and "power" in ok["summary"]
    assert ok["alpha_per_test"] == pytest.approx(0.01 / 8)
    bad = sampling.judge({"candidate": hot, "control": clean, "reference": clean}, 4.0)
    assert bad["verdict"] == "sampling_defect" and "at concurrency N" in bad["summary"]
    assert "temperature-0.3" in bad["summary"]
    # qwen-tts's samples in the candidate's numerics flag: the test is not calibrated, judges nothing
    odd = sampling.judge({"candidate": hot, "control": clean, "reference": clean, "null": hot}, 4.0)
    assert odd["verdict"] == "pass" and not odd["calibrated"] and "not calibrated" in odd["summary"]


def test_report_mlflow_and_dashboard_show_each_sites_statistic_power_and_temperature():
    """What the judge says reaches MLflow's metrics and the run page: per role and site z, log E,
    PIT p and the temperature with its interval; the suite's power against a temperature error of 0.1."""
    from dashboards import pages
    from dashboards.gather import Run
    from difftest.records.mlflow_records import parent_metrics

    hot = {"s1": site(3000, 1001, {"temperature": 0.6}, sid="s1")}
    clean = {"s1": site(3000, 1002, sid="s1")}
    finding = sampling.judge({"candidate": hot, "control": clean, "reference": clean}, 4.0)
    m = parent_metrics({"sampling": finding})
    cand = finding["statistics"]["candidate"]["parts"]["talker"]
    assert m["sampling.pass"] == 0.0 and m["sampling.candidate.talker.z"] == cand["z"] > 4  # too cold
    assert m["sampling.candidate.talker.log_e"] == cand["evalue"]["log_e"] > cand["evalue"]["line"]
    assert m["sampling.candidate.talker.temperature"] == cand["temperature"]["estimate"]
    assert 0.5 < m["sampling.candidate.talker.temperature_lo"] < 0.6 < m["sampling.candidate.talker.temperature_hi"] < 0.7
    assert m["sampling.power.talker.temperature_0.1"] == finding["power"]["talker"]["temperature_0.1"]
    assert "sampling.control.talker.pit_p" in m and "sampling.reference.talker.z" in m
    report = {"verdict": "fail", "segments": [], "failing": [], "warnings": [], "sampling": finding}
    rows = pages.sampling_rows(report)
    assert [(r["role"], r["flagged"]) for r in rows] == [
        ("candidate at N", True), ("candidate at 1", False), ("qwen-tts (calibration)", False)]
    assert rows[0]["leading"] == "temperature-0.3" and rows[0]["power"] == finding["power"]["talker"]["temperature_0.1"]
    run = Run("r1", "1", "difftest/toy", "n", 0, {"verdict": "fail"}, {}, report, "report.json", media={})
    page = pages.run_page(run, pages.Context(ui_url="http://x", uri="u", built="now"))
    assert "The sampling test" in page and "temperature-0.3" in page and "0.9 asked" in page


def test_the_power_variant_and_suite_have_the_talker_tokens_and_distinct_seeds():
    """selfcheck's `power` variant and the sampled-power suite: sampled as production serves it, every
    segment its own seed (shared seeds share random numbers: the e-value's product would not be a
    martingale across them), and at least the 1,700 talker tokens a temperature error of 0.1 needs."""
    from pathlib import Path

    from difftest.commands.selfcheck import POWER_TOKENS, variant
    from difftest.suites.suite import load_suite

    cases = Path(__file__).resolve().parents[1] / "cases" / "suites"
    for suite in (variant(load_suite(cases / "smoke.yaml"), "power"), load_suite(cases / "sampled-power.yaml")):
        d = [s.decode for s in suite.segments]
        assert len({x["seed"] for x in d}) == len(d)
        assert all(x["do_sample"] and x["temperature"] == 0.9 and x["top_k"] == 50 and x["repetition_penalty"] == 1.05
                   for x in d)
        assert sum(x["max_new_tokens"] - 1 for x in d) >= POWER_TOKENS >= 1700


def test_the_temperature_interval_narrower_than_a_grid_step_holds_its_estimate():
    """30,000 tokens (a code predictor's worth): the interval is narrower than the grid's 1.75% step;
    it must still hold the estimate and, at 95%, the truth."""
    t = talker(sampling.statistic([site(30000, 1100)], label="narrow"))["temperature"]
    lo, hi = t["ci95"]
    assert lo < t["estimate"] < hi and hi - lo < 0.9 * 0.0175 * 2
    assert lo <= 0.9 <= hi


def test_sampled_segments_sharing_a_seed_are_warned_of():
    from pathlib import Path

    from difftest.pipeline.scoring import shared_seeds
    from difftest.suites.suite import load_suite

    cases = Path(__file__).resolve().parents[1] / "cases" / "suites"
    (w,) = shared_seeds(load_suite(cases / "sampled.yaml"))
    assert w.startswith("sampled segments sam-01, sam-02,") and "share seed 7" in w and "sam-08" not in w
    assert shared_seeds(load_suite(cases / "sampled-power.yaml")) == []
    assert shared_seeds(load_suite(cases / "smoke.yaml")) == []  # greedy: the seed draws nothing
