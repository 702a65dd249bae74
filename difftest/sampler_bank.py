"""The named ways a sampler goes wrong, as the sampling test looks for them (issue #31).

Each sampler site draws from a distribution fixed by its parameters: the talker's codebook 0
(temperature, top-k, top-p, repetition penalty) and the code predictor's codebooks 1-15 (the
`subtalker_*` parameters, no penalty). An alternative is the distribution a plausible serving bug
would draw from instead: the temperature off, top-k or top-p not applied as asked, the penalty
dropped or applied twice, the other site's parameters, the logits before any processing.

The scorer (runners/reference/scoring.py) evaluates every alternative at every sampled position
of a forced stream; the tester (difftest/verdicts/sampling.py) turns that into a likelihood-ratio
test against the bank and a power analysis. Pure Python: both environments import it.
"""

from __future__ import annotations

import math

# Stable order: the score files' third axis.
ALTERNATIVES = ("temperature+0.1", "temperature-0.1", "temperature+0.3", "temperature-0.3",
                "top_k_halved", "top_k_ignored", "top_p_other", "repetition_penalty_ignored",
                "repetition_penalty_twice", "other_site_parameters", "unprocessed_logits")

SITES = ("talker", "code_predictor")

# The temperature grid for the maximum-likelihood estimate, as multiples of the requested one.
GRID_LO, GRID_HI, GRID_POINTS = 0.5, 2.0, 81


def temperature_grid(requested: float) -> list[float]:
    step = math.log(GRID_HI / GRID_LO) / (GRID_POINTS - 1)
    return [requested * GRID_LO * math.exp(i * step) for i in range(GRID_POINTS)]


def site_parameters(settings: dict, site: str) -> dict | None:
    """The requested distribution of a site from the decode settings; None where it is greedy."""
    if site == "talker":
        if not settings.get("do_sample"):
            return None
        return {"temperature": float(settings.get("temperature") or 1.0), "top_k": int(settings.get("top_k") or 0),
                "top_p": float(1.0 if settings.get("top_p") is None else settings["top_p"]),
                "repetition_penalty": float(settings.get("repetition_penalty") or 1.0), "processed": True}
    if not settings.get("subtalker_dosample"):
        return None
    return {"temperature": float(settings.get("subtalker_temperature") or 1.0),
            "top_k": int(settings.get("subtalker_top_k") or 0),
            "top_p": float(1.0 if settings.get("subtalker_top_p") is None else settings["subtalker_top_p"]),
            "repetition_penalty": 1.0, "processed": True}


def _other_site(settings: dict, site: str) -> dict:
    """The other site's sampler parameters as they would stand here (greedy: its temperature of 1)."""
    keys = ("subtalker_temperature", "subtalker_top_k", "subtalker_top_p") if site == "talker" \
        else ("temperature", "top_k", "top_p")
    t, k, p = (settings.get(x) for x in keys)
    return {"temperature": float(t or 1.0), "top_k": int(k or 0), "top_p": float(1.0 if p is None else p)}


def alternative(settings: dict, site: str, name: str) -> dict | None:
    """The alternative's parameters at this site, or None where it is not one (greedy site, a
    temperature that would not be positive, a penalty of 1 that cannot be dropped, parameters equal
    to the requested ones): such an alternative cannot be told apart, and is reported so."""
    req = site_parameters(settings, site)
    if req is None:
        return None
    alt = dict(req)
    if name.startswith("temperature"):
        alt["temperature"] = req["temperature"] + float(name[len("temperature"):])
        if alt["temperature"] <= 0.05:
            return None
    elif name == "top_k_halved":
        alt["top_k"] = req["top_k"] // 2 if req["top_k"] > 1 else 0
    elif name == "top_k_ignored":
        alt["top_k"] = 0
    elif name == "top_p_other":
        alt["top_p"] = 0.8 if req["top_p"] >= 1.0 else 1.0
    elif name == "repetition_penalty_ignored":
        alt["repetition_penalty"] = 1.0
    elif name == "repetition_penalty_twice":
        alt["repetition_penalty"] = req["repetition_penalty"] ** 2
    elif name == "other_site_parameters":
        alt.update(_other_site(settings, site))
    elif name == "unprocessed_logits":
        alt = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0, "processed": False}
    else:
        raise ValueError(f"unknown sampler alternative {name!r}")
    return None if alt == req else alt
