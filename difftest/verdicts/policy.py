"""The policy: tolerance tiers and which verdicts fail a run. Data, not code."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from .. import yamlfile
from ..compare.audio import ChunkMetrics
from ..compare.forced import ForcedPolicy
from ..errors import BadInput
from .null import NullPolicy
from .numerics import NumericsPolicy

DEFAULT_POLICY = Path(__file__).with_name("default_policy.yaml")

TIERS = ("identical", "within_quantisation", "close", "diverged")
VERDICTS = (
    "identical", "numeric_drift", "code_divergence", "audio_divergence", "length_mismatch",
    "concurrency_defect", "history_defect", "vocoder_defect", "talker_defect", "handoff_defect", "contamination", "error",
    "reference_encoder_defect", "sampling_defect",  # run-level only: report.json's `sampling` (difftest/verdicts/sampling.py)
)
RUN_VERDICTS = ("pass", "fail", "error")  # a report's overall verdict


@dataclass(frozen=True)
class Policy:
    quantisation_max_abs: float
    close_max_abs: float
    close_snr_db: float
    close_logmel: float
    require: dict  # comparison -> tier name
    donor_max_ratio: float
    fail_on: frozenset
    source: str = ""
    # `difftest gate --baseline-version`: which baseline runs count, and whether a segment that
    # already failed in the baseline (a known failure) fails the gate.
    baseline_verdicts: frozenset = frozenset({"pass", "fail"})
    known_failures_fail: bool = False
    forced: ForcedPolicy = ForcedPolicy()  # teacher-forced scoring thresholds
    # the candidate's reference codes against qwen-tts's: the share of (frame, codebook) entries that must agree
    encoder_min_agreement: float = 0.5
    null: NullPolicy = NullPolicy()  # the measured null's run-level test
    numerics: NumericsPolicy = NumericsPolicy()  # the run's teacher-forced counts against the baseline's

    def tier_index(self, comparison: str) -> int:
        return TIERS.index(self.require[comparison])

    def fails(self, verdict: str) -> bool:
        return verdict in self.fail_on

    def as_dict(self) -> dict:
        return {
            "tiers": {"quantisation_max_abs": self.quantisation_max_abs, "close_max_abs": self.close_max_abs,
                      "close_snr_db": self.close_snr_db, "close_logmel": self.close_logmel},
            "require": dict(self.require), "donor": {"max_ratio": self.donor_max_ratio},
            "fail_on": sorted(self.fail_on),
            "baseline": {"verdicts": sorted(self.baseline_verdicts), "known_failures_fail": self.known_failures_fail,
                         **{f"numerics_{k}": v for k, v in self.numerics.__dict__.items()}},
            "forced": dict(self.forced.__dict__),
            "reference_encoder": {"min_agreement": self.encoder_min_agreement},
            "measured_null": dict(self.null.__dict__),
            "source": self.source,
        }


# Every key a policy file may hold; anything else is a typo that would silently change a verdict.
SCHEMA = {
    "tiers": {"quantisation_max_abs", "close_max_abs", "close_snr_db", "close_logmel"},
    "require": {"concurrency", "vocoder", "drift"},
    "donor": {"max_ratio"},
    "fail_on": None,
    "baseline": {"verdicts", "known_failures_fail", *(f"numerics_{k}" for k in NumericsPolicy.__dataclass_fields__)},
    "forced": set(ForcedPolicy.__dataclass_fields__),
    "reference_encoder": {"min_agreement"},
    "measured_null": set(NullPolicy.__dataclass_fields__),
}


def load_policy(path: str | Path | None = None) -> Policy:
    """Load and validate a policy: every section and key known, every value of the right type;
    BadInput names the file, the field and the problem."""
    path = Path(path) if path else DEFAULT_POLICY

    def bad(field, problem):
        raise BadInput(f"{path}: {field}: {problem}")

    try:
        raw = yamlfile.load_file(path)
    except FileNotFoundError:
        raise BadInput(f"{path}: policy file not found") from None
    except IsADirectoryError:
        raise BadInput(f"{path}: a folder, not a policy file") from None
    except UnicodeDecodeError:
        raise BadInput(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        raise BadInput(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        bad("(top level)", "expected a mapping")
    for section in raw:
        if section not in SCHEMA:
            bad(str(section), f"unknown section (known: {', '.join(SCHEMA)})")
        keys = SCHEMA[section]
        if keys is None:
            continue
        if not isinstance(raw[section], dict):
            bad(section, f"expected a mapping, got {type(raw[section]).__name__}")
        for key in raw[section]:
            if key not in keys:
                bad(f"{section}.{key}", f"unknown key (known: {', '.join(sorted(keys))})")
    tiers = raw.get("tiers", {})
    vals = {}
    for k in ("quantisation_max_abs", "close_max_abs", "close_snr_db", "close_logmel"):
        v = tiers.get(k)
        try:  # YAML reads 1e-4 (no dot) as a string: accept it as the number it means
            if isinstance(v, bool):
                raise TypeError
            vals[k] = float(v)
        except (TypeError, ValueError):
            bad(f"tiers.{k}", f"expected a number, got {yamlfile.quote(v)}")
        if not math.isfinite(vals[k]) or (k != "close_snr_db" and vals[k] < 0):
            bad(f"tiers.{k}", f"expected a finite{' non-negative' if k != 'close_snr_db' else ''} number, got {yamlfile.quote(v)}")
    require = raw.get("require", {})
    for comp in ("concurrency", "vocoder", "drift"):
        if require.get(comp) not in TIERS[:-1]:
            bad(f"require.{comp}", f"expected one of {', '.join(TIERS[:-1])}, got {require.get(comp)!r}")
    ratio = raw.get("donor", {}).get("max_ratio")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        bad("donor.max_ratio", f"expected a number in (0, 1), got {yamlfile.quote(ratio)}")
    if "fail_on" not in raw:
        bad("fail_on", "required: the verdicts that fail a run (write [] to fail none)")
    fail_on = raw["fail_on"]
    if not isinstance(fail_on, list):
        bad("fail_on", "expected a list of verdicts")
    for v in fail_on:
        if v not in VERDICTS:
            bad("fail_on", f"unknown verdict {yamlfile.quote(v)} (known: {', '.join(VERDICTS)})")
    baseline = raw.get("baseline") or {}
    run_verdicts = baseline.get("verdicts", ["pass", "fail"])
    if not isinstance(run_verdicts, list) or not run_verdicts or any(v not in RUN_VERDICTS for v in run_verdicts):
        bad("baseline.verdicts", f"expected a non-empty list of {', '.join(RUN_VERDICTS)}, got {yamlfile.quote(run_verdicts)}")
    known_fail = baseline.get("known_failures_fail", False)
    if not isinstance(known_fail, bool):
        bad("baseline.known_failures_fail", f"expected true or false, got {yamlfile.quote(known_fail)}")
    numerics = {}
    for key, default in NumericsPolicy().__dict__.items():
        v = baseline.get(f"numerics_{key}", default)
        if isinstance(default, bool):
            if not isinstance(v, bool):
                bad(f"baseline.numerics_{key}", f"expected true or false, got {yamlfile.quote(v)}")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
                key == "false_flag_rate" and not 0 < v < 1) or (key == "rate_margin" and v < 1):
            bad(f"baseline.numerics_{key}", f"expected {'a number in (0, 1)' if key == 'false_flag_rate' else 'a number of at least 1'}, "
                                            f"got {yamlfile.quote(v)}")
        numerics[key] = v if isinstance(default, bool) else float(v)
    forced = {}
    for key, default in ForcedPolicy().__dict__.items():  # an absent key keeps the built-in value
        v = (raw.get("forced") or {}).get(key, default)
        integral = isinstance(default, int)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (integral and not isinstance(v, int)):
            bad(f"forced.{key}", f"expected {'an integer' if integral else 'a number'}, got {yamlfile.quote(v)}")
        if not math.isfinite(v) or v < 0 or (key.endswith("share") and v > 1) or (key == "near_tie_top_k" and v < 1):
            bad(f"forced.{key}", f"out of range: {yamlfile.quote(v)}")
        forced[key] = v
    agreement = (raw.get("reference_encoder") or {}).get("min_agreement", Policy.encoder_min_agreement)
    if isinstance(agreement, bool) or not isinstance(agreement, (int, float)) or not 0 <= agreement <= 1:
        bad("reference_encoder.min_agreement", f"expected a number in [0, 1], got {yamlfile.quote(agreement)}")
    null = {}
    for key, default in NullPolicy().__dict__.items():
        v = (raw.get("measured_null") or {}).get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            bad(f"measured_null.{key}", f"expected a number, got {yamlfile.quote(v)}")
        if (key == "false_flag_rate" and not 0 < v < 1) or (key == "rate_margin" and v < 1):
            bad(f"measured_null.{key}", f"out of range: {yamlfile.quote(v)} "
                               f"({'in (0, 1)' if key == 'false_flag_rate' else 'at least 1'})")
        null[key] = float(v)
    return Policy(vals["quantisation_max_abs"], vals["close_max_abs"], vals["close_snr_db"],
                  vals["close_logmel"], {c: require[c] for c in ("concurrency", "vocoder", "drift")},
                  float(ratio), frozenset(fail_on), str(path), frozenset(run_verdicts), known_fail,
                  ForcedPolicy(**forced), float(agreement), NullPolicy(**null), NumericsPolicy(**numerics))


def chunk_tiers(m: ChunkMetrics, policy: Policy, quantised: bool = False) -> np.ndarray:
    """Tier index per chunk (0 identical .. 3 diverged).

    When either side went through 16-bit PCM, a difference that quantisation
    alone explains is within_quantisation: the best tier such audio can reach
    against float audio. Between two float signals there is no such tier.
    """
    tiers = np.full(len(m.max_abs), 3, dtype=np.int64)
    close = (m.max_abs <= policy.close_max_abs) | (
        (m.snr_db >= policy.close_snr_db) & (m.logmel <= policy.close_logmel))
    tiers[close] = 2
    if quantised:
        tiers[m.max_abs <= policy.quantisation_max_abs] = 1
    tiers[m.max_abs == 0] = 0
    return tiers
