"""The sampling test: does the candidate draw its codes from qwen-tts's distribution?

Sampled codes never agree token for token, so each token is judged by what qwen-tts
expected of it. At every sampled position, teacher forcing gives the distribution
decoding draws from (temperature, top-k, top-p applied, renormalised), hence the
drawn token's log-probability l, its expectation E (minus the entropy) and its
variance V there. If the candidate samples from that distribution, every l - E has
mean zero given everything before it (a martingale difference), so over a suite

    z = sum(l - E) / sqrt(sum(V))

is standard normal. A candidate that samples too hot, ignores top-k inside the
support, or draws from another model gives a strongly negative z; one that samples
too cold (or greedily) a strongly positive one. qwen-tts's own samples of the same
segments go through the same test: their z is the check that the test itself is
calibrated on this machine (an uncalibrated test is reported, and fails nothing).
Tokens outside the support are each segment's talker_defect and are left out here.
"""

from __future__ import annotations

import math

import numpy as np

from ..compare.forced import sampled
from ..scores import ScoreFile


def _columns(sf: ScoreFile) -> np.ndarray:
    """The sampled codebooks of this stream's decoding."""
    cols = np.zeros(sf.arrays["rank"].shape[1], bool)
    cols[0] = bool(sf.settings.get("do_sample"))
    cols[1:] = bool(sf.settings.get("subtalker_dosample"))
    return cols


PARTS = {"talker": slice(0, 1), "code_predictor": slice(1, None)}  # codebook 0; codebooks 1-15


def statistic(files: list[ScoreFile]) -> dict | None:
    """z over the sampled, in-support positions of these streams, for the talker's codebook 0 and the
    code predictor's codebooks apart (a defect in one is not diluted by the other's tokens); `z` is
    the one of larger magnitude. None when nothing was sampled."""
    parts = {}
    for part, cols in PARTS.items():
        diff = var = 0.0
        tokens = 0
        for sf in files:
            if not sampled(sf):
                continue
            mask = (sf.arrays["in_support"] & _columns(sf)[None, :])[:, cols]
            lp, ex = sf.arrays["sample_logprob"][:, cols], sf.arrays["expected_logprob"][:, cols]
            diff += float((lp[mask] - ex[mask]).sum())
            var += float(sf.arrays["logprob_var"][:, cols][mask].sum())
            tokens += int(mask.sum())
        if tokens:
            parts[part] = {"z": round(diff / math.sqrt(var), 3) if var > 0 else 0.0, "tokens": tokens,
                           "mean_excess_logprob": round(diff / tokens, 5)}
    if not parts:
        return None
    worst = max(parts, key=lambda p: abs(parts[p]["z"]))
    return {**parts[worst], "part": worst, "parts": parts}


def judge(scores: dict[str, dict[str, ScoreFile]], max_z: float) -> dict | None:
    """The run-level finding from every role's scores (role -> segment -> ScoreFile): None when
    nothing was sampled, else {"verdict": "sampling_defect" | "pass", ...}."""
    stats = {role: statistic(list(files.values())) for role, files in scores.items()}
    stats = {k: v for k, v in stats.items() if v is not None}
    if not stats:
        return None
    ref = stats.get("reference")
    calibrated = ref is None or abs(ref["z"]) <= max_z
    off = {role: s for role, s in stats.items() if role != "reference" and abs(s["z"]) > max_z}
    out = {"statistics": stats, "max_z": max_z, "calibrated": calibrated}
    if not calibrated:
        return {**out, "verdict": "pass",
                "summary": f"sampling test not calibrated: qwen-tts's own samples give z = {ref['z']} "
                           f"(|z| <= {max_z} expected); candidate not judged on it"}
    if off:
        role, s = max(off.items(), key=lambda kv: abs(kv[1]["z"]))
        how = "less likely than qwen-tts's own sampling makes them" if s["z"] < 0 else \
            "more likely than sampling makes them (too cold, or greedy)"
        where = {"candidate": "at concurrency N", "control": "at concurrency 1"}.get(role, role)
        return {**out, "verdict": "sampling_defect",
                "summary": f"the candidate's sampled codes {where} are {how}: z = {s['z']} over {s['tokens']} "
                           f"{s['part'].replace('_', ' ')} tokens "
                           f"({s['mean_excess_logprob']:+.3g} nats a token; |z| <= {max_z} allowed"
                           + (f"; qwen-tts's own samples: z = {ref['z']}" if ref else "") + ")"}
    return {**out, "verdict": "pass",
            "summary": "sampled codes drawn as qwen-tts draws them: " + ", ".join(
                f"{role} z = {s['z']}" for role, s in stats.items())}
