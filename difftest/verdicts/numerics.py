"""Numerics against the last release: is this run's talker further from qwen-tts than the baseline's?

A release can be numerically worse than the one before while every token stays plausible
(vLLM-Omni #2274: the code predictor on fused bf16 layers). The measured null (null.py) asks
whether a run is as close to qwen-tts as a correct implementation in its numerics; this asks
whether it is as close as the baseline release was, on the same suite, device and checkpoint.

Both reports carry, per segment and sampler site, how many of the candidate's tokens left float32
qwen-tts's top-1 (greedy) or its sampling support (sampled), teacher-forced (report.json's
`measured_null` at concurrency 1 and `measured_null_at_n` at N). Over the segments both runs
scored, per site and concurrency, the counts are tested as null.py tests a run against its null:

    this run k_c of n_c tokens, the baseline k_b of n_b;
    H0: this run's rate is at most `rate_margin` times the baseline's.

At N the number of segments whose codes part from their codes at 1 is tested the same way (batch
variance grown); the tokens at N are tested again only where some stream at N is not the stream
at 1 (otherwise they are the same tokens). The run's false-flag rate is split over the tests made
(Bonferroni). A
significant worsening is `numerics_regression` at the talker, naming the site (the talker's
codebook 0 or the code predictor's codebooks 1-15), the two rates and their ratio.

What it cannot see: a worsening smaller than the margin, or that the suite's tokens are too few to
show (the summary states the counts); the vocoder's numerics (its input is the codes; its output is
judged per segment against qwen-tts's decode of the same codes).
"""

from __future__ import annotations

from dataclasses import dataclass

from .null import SAMPLED, SITE_ORDER, p_value

ROLES = (("measured_null", "at concurrency 1"), ("measured_null_at_n", "at concurrency N"))
SITE_WORDS = {"talker": "the talker's codebook 0", "code_predictor": "the code predictor's codebooks 1-15"}


@dataclass(frozen=True)
class NumericsPolicy:
    false_flag_rate: float = 0.01  # per comparison of two runs, over the tests made
    rate_margin: float = 1.0  # H0: this run's rate <= this x the baseline's
    fail: bool = True  # a numerics_regression fails the gate


def _site_words(site: str) -> str:
    base = site.removesuffix(SAMPLED)
    return SITE_WORDS.get(base, base) + (" (sampled: outside the support)" if site.endswith(SAMPLED) else "")


def _tests(report: dict, baseline: dict) -> tuple[list[dict], list[str]]:
    """The counts to test: one entry per (concurrency, site) both runs scored, plus the flips at N."""
    tests, notes = [], []
    for key, where in ROLES:
        mine, theirs = report.get(key) or {}, baseline.get(key) or {}
        if not mine or not theirs:
            if mine or theirs:
                notes.append(f"{where}: {'the baseline' if mine else 'this run'} has no teacher-forced counts")
            continue
        a, b = mine.get("segments") or {}, theirs.get("segments") or {}
        fa, fb = mine.get("flips"), theirs.get("flips")
        if key == "measured_null_at_n" and fa and fb and fa.get("candidate") == 0 and fb.get("candidate") == 0:
            # every stream at N is the stream at 1 in both runs: the same tokens, tested once, at 1
            notes.append(f"{where}: the codes are those at concurrency 1 in both runs (tested there)")
            a, b = {}, {}
        sites = sorted({s for c in a.values() for s in c} | {s for c in b.values() for s in c}, key=SITE_ORDER.index)
        for site in sites:
            both = sorted(s for s in a if site in a[s] and site in b.get(s, {}))
            if not both:
                notes.append(f"{where}, {_site_words(site)}: no segment scored in both runs")
                continue
            kc, nc = sum(a[s][site][0] for s in both), sum(a[s][site][2] for s in both)
            kb, nb = sum(b[s][site][0] for s in both), sum(b[s][site][2] for s in both)
            if nc and nb:
                tests.append({"concurrency": where, "site": site, "segments": len(both), "what": "tokens",
                              "run": [kc, nc], "baseline": [kb, nb]})
        if fa and fb and fa.get("segments") and fb.get("segments"):
            tests.append({"concurrency": where, "site": "batch", "segments": fa["segments"], "what": "segments",
                          "run": [fa["candidate"], fa["segments"]], "baseline": [fb["candidate"], fb["segments"]]})
    return tests, notes


def compare(report: dict, baseline: dict, policy: NumericsPolicy, label: str = "the baseline") -> dict:
    """The run-level finding of `report` against `baseline` (two report.json dicts of the same suite):
    {"verdict": "pass" | "numerics_regression" | "not_compared", "stage", "site", "summary", "tests", ...}."""
    tests, notes = _tests(report, baseline)
    base = {"false_flag_rate": policy.false_flag_rate, "rate_margin": policy.rate_margin, "baseline": label,
            "tests": tests, "notes": notes}
    if not tests:
        return {**base, "verdict": "not_compared", "stage": None, "site": None,
                "summary": f"no teacher-forced counts to compare with {label}" + (f" ({'; '.join(notes)})" if notes else "")}
    alpha = policy.false_flag_rate / len(tests)
    for t in tests:
        (kc, nc), (kb, nb) = t["run"], t["baseline"]
        t["p_value"] = float(f"{p_value(kc, nc, kb, nb, policy.rate_margin):.4g}")
        t["rate"], t["baseline_rate"] = round(kc / nc, 5), round(kb / nb, 5)
        t["ratio"] = round((kc / nc) / (kb / nb), 3) if kb else (None if kc else 1.0)
    flagged = sorted((t for t in tests if t["p_value"] < alpha), key=lambda t: t["p_value"])
    base["alpha"] = alpha
    if not flagged:
        return {**base, "verdict": "pass", "stage": None, "site": None,
                "summary": f"as close to qwen-tts as {label}: " + "; ".join(_line(t) for t in tests)}
    t = flagged[0]
    return {**base, "verdict": "numerics_regression", "stage": "talker", "site": t["site"],
            "concurrency": t["concurrency"], "effect": t["ratio"],
            "summary": f"further from qwen-tts than {label}: {_line(t)} (alpha {alpha:.3g}, a rate up to "
                       f"{policy.rate_margin}x {label}'s allowed); every token may stay plausible, the run is worse"}


def _line(t: dict) -> str:
    (kc, nc), (kb, nb) = t["run"], t["baseline"]
    if t["site"] == "batch":
        what = f"{t['concurrency']}, segments whose codes part from their codes at 1"
    else:
        verb = "outside the support" if t["site"].endswith(SAMPLED) else "off qwen-tts's top-1"
        what = f"{t['concurrency']}, {_site_words(t['site'])} {verb}"
    ratio = f", {t['ratio']}x" if t.get("ratio") is not None else ""
    return f"{what} {kc}/{nc} ({kc / nc:.2%}) against {kb}/{nb} ({kb / nb:.2%}){ratio}, p = {t['p_value']:.3g}"
