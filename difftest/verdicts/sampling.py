"""The sampling test: does the candidate draw its codes from qwen-tts's distribution, and what could it see?

Sampled codes never agree token for token, so each token is judged by what qwen-tts
expected of it. Teacher forcing gives, at every sampled position, the distribution p
decoding draws from (temperature, top-k, top-p applied, renormalised over the support S),
and for every alternative q of the sampler bank (difftest/sampler_bank.py: the temperature
off by 0.1 or 0.3, top-k or top-p not as asked, the penalty dropped or doubled, the other
site's parameters, the unprocessed logits) q's mass outside S and, with q renormalised over
S, the drawn token's log-likelihood ratio and q's KL divergence from p. Per sampler site (the
talker's codebook 0; the code predictor's codebooks 1-15), per role:

- `z`, the score test in the likelihood direction: sum(log p(x) - E) / sqrt(sum V), standard
  normal under p; |z| > `max_z` flags (negative: too hot or another model; positive: too cold).
- `evalue`, the likelihood ratio against the bank, anytime-valid: E = mean over the K
  applicable alternatives of prod q(x)/p(x). Under p, E is a nonnegative martingale of mean 1,
  so P(E ever reaches 1/alpha) <= alpha (Ville's inequality), whatever the number of tokens;
  averaging over K costs log K nats. log E >= log(1/alpha) flags, and names the alternative
  that carries it.
- `pit`, the catch-all for what the bank does not name: u = P(tokens ranked before x) + U p(x),
  U uniform, is exactly uniform and independent under p (randomised probability-integral
  transform); a Kolmogorov-Smirnov test of the u's flags below alpha.
- `temperature`: the maximum-likelihood temperature over S and its 95% profile-likelihood
  interval, the effect size.
- `power`: per alternative, before any judging, the chance that the e-value reaches its line
  if the candidate drew from that alternative at these positions (log E of the alternative's own
  component is a sum of independent terms of mean KL and variance Var: normal approximation), or
  that one of its draws falls outside S (the support check, a per-segment `talker_defect`); and
  the tokens that 95% power would need at this site's mean KL.

The run's false-flag rate `forced.sampling_false_flag_rate` is split evenly over the roles
judged (the candidate at N and at 1), the two sites and the two tests (e-value, PIT); the z line
adds 6e-5 per site and role. qwen-tts's own samples (`reference`) and, for a candidate in other
numerics, the measured null's samples (qwen-tts in that dtype, the same seeds) go through the same
tests: a flag there means the test is not calibrated for this machine or dtype, and the candidate
is not judged by it (reported, fails nothing). Tokens outside S are each segment's
`talker_defect` and are left out here.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from .. import sampler_bank
from ..compare.forced import sampled
from ..scores import ScoreFile

PARTS = {"talker": slice(0, 1), "code_predictor": slice(1, None)}  # codebook 0; codebooks 1-15
Z95 = 1.6448536269514722  # the one-sided normal quantile of 95% power
CI_DROP = 1.9207294103470844  # chi-square(1) 95% / 2: the profile-likelihood interval's drop


def _columns(sf: ScoreFile) -> np.ndarray:
    """The sampled codebooks of this stream's decoding."""
    cols = np.zeros(sf.arrays["rank"].shape[1], bool)
    cols[0] = bool(sf.settings.get("do_sample"))
    cols[1:] = bool(sf.settings.get("subtalker_dosample"))
    return cols


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def ks_pvalue(u: np.ndarray) -> tuple[float, float]:
    """(D, p) of the one-sample Kolmogorov-Smirnov test of `u` against U(0, 1): Stephens'
    small-sample correction of the asymptotic Kolmogorov distribution (within 1% of exact from n = 5)."""
    n = len(u)
    if n == 0:
        return 0.0, 1.0
    s = np.sort(u)
    i = np.arange(1, n + 1)
    d = float(max((i / n - s).max(), (s - (i - 1) / n).max()))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    if lam < 0.2:
        return d, 1.0
    p = 2.0 * sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))


def tokens_for_power(kl: float, var: float, line: float, power_z: float = Z95) -> int | None:
    """Tokens n at which n kl - power_z sqrt(n var) reaches `line` (the e-value's, in nats): the
    alternative's own component then crosses with the given power. None where kl is 0."""
    if not kl > 0:
        return None
    s = (power_z * math.sqrt(var) + math.sqrt(power_z * power_z * var + 4.0 * kl * line)) / (2.0 * kl)
    return int(math.ceil(s * s))


def _temperature(loglik: np.ndarray, grid: list[float], requested: float) -> dict:
    """Maximum-likelihood temperature over the grid (parabolic refinement in log T) and its 95%
    profile-likelihood interval: where it lies within a grid step of the maximum, from the parabola
    through the three points there; else interpolated between grid points. An end of the grid is
    reported as a bound."""
    g = np.log(np.asarray(grid))
    h = g[1] - g[0]
    i = int(np.argmax(loglik))
    best, t_hat, den = float(loglik[i]), g[i], 0.0
    if 0 < i < len(g) - 1:
        a, b, c = loglik[i - 1], loglik[i], loglik[i + 1]
        den = a - 2 * b + c
        if den < 0:
            off = 0.5 * (a - c) / den
            t_hat = g[i] + off * h
            best = float(b - 0.25 * (a - c) * off)
    line = best - CI_DROP

    def edge(step: int) -> tuple[float, bool]:
        j = i
        while 0 <= j + step < len(g) and loglik[j + step] >= line:
            j += step
        if not 0 <= j + step < len(g):
            return float(np.exp(g[j])), True
        if j == i and den < 0:  # narrower than a grid step (many tokens): the parabola's own crossing
            half = h * math.sqrt(2.0 * CI_DROP / -den)
            return float(np.exp(np.clip(t_hat + step * half, g[i - 1], g[i + 1]))), False
        y0, y1 = loglik[j], loglik[j + step]
        frac = (y0 - line) / (y0 - y1) if y0 != y1 else 0.0
        return float(np.exp(g[j] + frac * (g[j + step] - g[j]))), False

    (lo, lo_open), (hi, hi_open) = edge(-1), edge(+1)
    return {"requested": round(requested, 4), "estimate": round(float(np.exp(t_hat)), 4),
            "ci95": [round(lo, 4), round(hi, 4)], "ci_open": [lo_open, hi_open],
            "grid": [round(grid[0], 4), round(grid[-1], 4)]}


def _site(files: list[ScoreFile], part: str, alpha: float, label: str) -> dict | None:
    """One role's statistics at one sampler site, at the per-test false-flag rate `alpha`."""
    cols = PARTS[part]
    diff = var = 0.0
    tokens = 0
    names = sampler_bank.ALTERNATIVES
    llr, kl, kvar = np.zeros(len(names)), np.zeros(len(names)), np.zeros(len(names))
    stay = np.ones(len(names))  # prod (1 - mass outside S): no draw of the alternative leaves S
    applicable = np.zeros(len(names), bool)
    loglik, grid, requested = None, None, None
    pit_lo, pit_p, seeds = [], [], []
    for sf in files:
        if not sampled(sf):
            continue
        mask = (sf.arrays["in_support"] & _columns(sf)[None, :])[:, cols]
        if not mask.any():
            continue
        a = {k: v[:, cols] for k, v in sf.arrays.items()}
        diff += float((a["sample_logprob"][mask] - a["expected_logprob"][mask]).sum())
        var += float(a["logprob_var"][mask].sum())
        tokens += int(mask.sum())
        site = (sf.bank or {}).get("sites", {}).get(part)
        if site is None:
            continue
        app = np.asarray(site["applicable"], bool)
        applicable |= app
        # an alternative that does not apply here is the requested distribution itself: ratio 1, KL 0
        r = a["alt_llr"][mask]
        llr += np.where(app, np.where(np.isnan(r), 0.0, r), 0.0).sum(0)  # -inf stays: a draw q cannot make
        kl += np.where(app, np.nan_to_num(a["alt_kl"][mask], nan=0.0), 0.0).sum(0)
        kvar += np.where(app, np.nan_to_num(a["alt_var"][mask], nan=0.0), 0.0).sum(0)
        stay *= np.where(app, np.prod(1.0 - np.nan_to_num(a["alt_outside"][mask], nan=0.0), axis=0), 1.0)
        ll = a["temp_loglik"][mask].astype(np.float64).sum(0)
        if grid is None or site["temperature_grid"] == grid:
            loglik = ll if loglik is None else loglik + ll
            grid = site["temperature_grid"]
            requested = grid[0] / sampler_bank.GRID_LO
        pit_lo.append(a["mass_above"][mask].astype(np.float64))
        pit_p.append(np.exp(a["sample_logprob"][mask].astype(np.float64)))
        seeds.append(f"{sf.segment_id}:{sf.segment_hash}")
    if not tokens:
        return None
    out = {"z": round(diff / math.sqrt(var), 3) if var > 0 else 0.0, "tokens": tokens,
           "mean_excess_logprob": round(diff / tokens, 5)}
    if not pit_lo:
        return out  # score files without the bank (none written since score version 4)
    k = int(applicable.sum())
    line = math.log(1.0 / alpha)
    component_line = line + math.log(max(k, 1))
    finite = llr[applicable]
    log_e = float(np.logaddexp.reduce(finite) - math.log(k)) if k else float("-inf")
    # the first of the alternatives that lead (two can coincide over S: the raw logits at a site without
    # penalty or suppression are temperature 1.0 there; float noise must not pick the later name)
    best = np.max(np.where(applicable, llr, -np.inf)) if k else None
    lead = next(n for j, n in enumerate(names) if applicable[j] and llr[j] >= best - 1e-3) if k else None
    alternatives = {}
    for j, name in enumerate(names):
        if not applicable[j]:
            alternatives[name] = {"applicable": False}
            continue
        p_in = _phi((kl[j] - component_line) / math.sqrt(kvar[j])) if kvar[j] > 0 else float(kl[j] >= component_line)
        p_out = 1.0 - stay[j]
        mean_out = 1.0 - stay[j] ** (1.0 / tokens)
        need_out = math.ceil(math.log(0.05) / math.log(1.0 - mean_out)) if 1e-12 < mean_out < 1 else None
        need_in = tokens_for_power(kl[j] / tokens, kvar[j] / tokens, component_line)
        alternatives[name] = {
            "applicable": True, "log_likelihood_ratio": round(float(llr[j]), 3) if np.isfinite(llr[j]) else None,
            "kl_per_token": round(float(kl[j] / tokens), 5), "outside_per_token": round(float(mean_out), 5),
            "power": round(1.0 - (1.0 - p_in) * (1.0 - p_out), 4),
            "tokens_for_95": min((n for n in (need_in, need_out) if n), default=None)}
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(
        f"{label}|{part}|{'|'.join(sorted(seeds))}".encode()).digest()[:8], "little"))
    lo, p = np.concatenate(pit_lo), np.concatenate(pit_p)
    u = np.clip(lo + rng.random(len(lo)) * p, 0.0, 1.0)
    d, pit_pvalue = ks_pvalue(u)
    out.update({
        "evalue": {"log_e": round(log_e, 3) if np.isfinite(log_e) else None, "line": round(line, 3),
                   "alternatives_averaged": k, "leading": lead, "flagged": bool(log_e >= line)},
        "pit": {"ks_d": round(d, 5), "p": float(f"{pit_pvalue:.4g}"), "alpha": float(f"{alpha:.4g}"),
                "flagged": bool(pit_pvalue < alpha), "mean_u": round(float(u.mean()), 4)},
        "temperature": _temperature(loglik, grid, requested) if loglik is not None else None,
        "alternatives": alternatives,
    })
    return out


def statistic(files: list[ScoreFile], alpha: float = 0.01 / 8, label: str = "") -> dict | None:
    """Per sampler site's statistics over these streams (a defect in one is not diluted by the
    other's tokens); `z` and `part` are the site of larger |z|. None when nothing was sampled."""
    parts = {}
    for part in PARTS:
        if (s := _site(files, part, alpha, label)) is not None:
            parts[part] = s
    if not parts:
        return None
    worst = max(parts, key=lambda p: abs(parts[p]["z"]))
    return {"z": parts[worst]["z"], "tokens": parts[worst]["tokens"],
            "mean_excess_logprob": parts[worst]["mean_excess_logprob"], "part": worst, "parts": parts}


def _flags(stat: dict, max_z: float) -> list[str]:
    """What flags in one role's statistics: 'site: test (detail)'."""
    out = []
    for part, s in stat["parts"].items():
        where = part.replace("_", " ")
        if abs(s["z"]) > max_z:
            how = "less likely than qwen-tts's own sampling makes them" if s["z"] < 0 else \
                "more likely than sampling makes them (too cold, or greedy)"
            out.append(f"{where}: z = {s['z']} over {s['tokens']} tokens, {how} "
                       f"({s['mean_excess_logprob']:+.3g} nats a token; |z| <= {max_z} allowed)")
        ev = s.get("evalue")
        if ev and ev["flagged"]:
            t = s.get("temperature") or {}
            out.append(f"{where}: likelihood ratio against the sampler bank log E = {ev['log_e']} >= {ev['line']}, "
                       f"led by {ev['leading']}"
                       + (f"; temperature estimated {t['estimate']} (95% {t['ci95'][0]}-{t['ci95'][1]}, "
                          f"{t['requested']} asked)" if t else ""))
        pit = s.get("pit")
        if pit and pit["flagged"]:
            out.append(f"{where}: ranks of the drawn tokens not uniform (PIT, KS p = {pit['p']} < {pit['alpha']}, "
                       f"mean u {pit['mean_u']}: 0.5 expected)")
    return out


def power_summary(stat: dict | None) -> dict:
    """What the suite can see, per site: the power against the weakest temperature alternatives and
    against each other alternative ("talker temperature errors of 0.1 or more: power 0.97")."""
    out = {}
    for part, s in ((stat or {}).get("parts") or {}).items():
        alts = s.get("alternatives") or {}
        temp = [alts[n]["power"] for n in ("temperature+0.1", "temperature-0.1") if alts.get(n, {}).get("applicable")]
        if temp:
            out[part] = {"temperature_0.1": min(temp),
                         "sentence": f"{part.replace('_', ' ')} temperature errors of 0.1 or more: power {min(temp):.2f} "
                                     f"over {s['tokens']} tokens"
                                     + ("" if min(temp) >= 0.95 else
                                        f" (95% needs about {max(alts[n]['tokens_for_95'] or 0 for n in ('temperature+0.1', 'temperature-0.1'))})"),
                         "blind": sorted(n for n, a in alts.items() if a.get("applicable") and a["power"] < 0.5),
                         "not_distinguishable": sorted(n for n, a in alts.items() if not a.get("applicable"))}
    return out


def judge(scores: dict[str, dict[str, ScoreFile]], max_z: float, false_flag_rate: float = 0.01) -> dict | None:
    """The run-level finding from every role's scores (role -> segment -> ScoreFile): None when
    nothing was sampled, else {"verdict": "sampling_defect" | "pass", ...}. Roles `reference` (qwen-tts's
    own samples) and `null` (qwen-tts in the candidate's numerics) calibrate; the others are judged."""
    judged = [r for r in scores if r not in ("reference", "null")]
    alpha = false_flag_rate / (max(len(judged), 1) * len(PARTS) * 2)
    stats = {role: statistic(list(files.values()), alpha, role) for role, files in scores.items()}
    stats = {k: v for k, v in stats.items() if v is not None}
    if not stats:
        return None
    out = {"statistics": stats, "max_z": max_z, "false_flag_rate": false_flag_rate,
           "alpha_per_test": float(f"{alpha:.4g}"),
           "power": power_summary(stats.get("candidate") or next(iter(stats.values())))}
    calibration = {role: _flags(stats[role], max_z) for role in ("reference", "null") if role in stats}
    uncalibrated = {role: f for role, f in calibration.items() if f}
    out["calibrated"] = not uncalibrated
    if uncalibrated:
        who = {"reference": "qwen-tts's own samples", "null": "qwen-tts's samples in the candidate's numerics"}
        return {**out, "verdict": "pass",
                "summary": "sampling test not calibrated: " + "; ".join(
                    f"{who[r]} flag it ({f[0]})" for r, f in uncalibrated.items()) + "; candidate not judged on it"}
    flagged = {role: f for role in judged if role in stats and (f := _flags(stats[role], max_z))}
    if flagged:
        role, f = next(iter(flagged.items()))
        where = {"candidate": "at concurrency N", "control": "at concurrency 1"}.get(role, role)
        return {**out, "verdict": "sampling_defect",
                "summary": f"the candidate's sampled codes {where} are not drawn as qwen-tts draws them: "
                           + "; ".join(f)}
    powers = "; ".join(p["sentence"] for p in out["power"].values())
    return {**out, "verdict": "pass",
            "summary": "sampled codes drawn as qwen-tts draws them: " + ", ".join(
                f"{role} z = {s['z']}" for role, s in stats.items()) + (f" ({powers})" if powers else "")}
