"""The policy: tolerance tiers and which verdicts fail a run. Data, not code."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from .. import yamlfile
from ..compare.chunks import TIERS, Thresholds
from ..compare.forced import ForcedPolicy
from ..errors import BadInput
from .catalogue import FAILS, VERDICTS
from .null import NullPolicy
from .numerics import NumericsPolicy

DEFAULT_POLICY = Path(__file__).with_name("default_policy.yaml")

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
    # a vocoder in another dtype than the reference's: per chunk at most this many times as far from qwen-tts's
    # float32 decode as qwen-tts's own vocoder in that dtype (difftest/verdicts/vocoder_null.py)
    vocoder_null_margin: float = 1.3
    # the talker's assembled prompt in bf16 against qwen-tts's float32 one: per row, max |diff| over the row's
    # largest |value| at most this (difftest/verdicts/talker_prompt.py; the same dtype: exact)
    prompt_bf16_max_rel: float = 0.05

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(self.quantisation_max_abs, self.close_max_abs, self.close_snr_db, self.close_logmel)

    def tier_index(self, comparison: str) -> int:
        return TIERS.index(self.require[comparison])

    def fails(self, verdict: str) -> bool:
        return verdict in self.fail_on

    @property
    def sha256(self) -> str:
        return policy_sha256(self.as_dict())

    def warnings(self) -> list[str]:
        """Loud lines for report.json's `warnings` and the gate: a fail_on that lets defects pass."""
        passed = [v for v in DEFECTS if v not in self.fail_on]
        return [f"POLICY: fail_on of {self.source or 'the policy'} leaves out {', '.join(passed)}: a segment with "
                f"{'one of these verdicts' if len(passed) > 1 else 'this verdict'} PASSES"] if passed else []

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
            "vocoder_null": {"margin": self.vocoder_null_margin},
            "talker_input": {"prompt_bf16_max_rel": self.prompt_bf16_max_rel},
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
    "vocoder_null": {"margin"},
    "talker_input": {"prompt_bf16_max_rel"},
}

# Every number a policy holds, with the range it must lie in (exit 2 otherwise: BadInput names the
# field and the range). Each range holds the default and any value a user could mean, and stops
# where the tolerance would accept anything, so that a failing verdict stays reachable. A `(` or
# `)` is an open end. docs/verdicts.md, "The policy", has this table; tests/test_policy_bounds.py
# holds the two to each other.
_GAP = ("[0, 8]", "nats below qwen-tts's top-1 (or its sampling support's last token): 8 nats is a token "
        "e^8 = 3000x less likely than qwen-tts's choice, a ratio above a codebook's 2048 codes; wider excuses "
        "almost any token (defaults 0.05-1.5)")
_RATE = ("[1e-6, 0.5]", "a test's false-flag rate: 0 never flags; below 1e-6 only gross defects on large suites "
         "could; above one half a correct engine fails more often than not (default 0.01)")
_MARGIN = ("[1, 10]", "H0: a rate of tokens off qwen-tts's top-1 at most this many times the null's (the "
           "baseline's): below 1 a correct engine fails; 10x is a defect, not numerics (real vLLM-Omni "
           "0.30.0: 0.5-1.1x; defaults 1.5, 1.0)")
_TOPK = ("[{lo}, 128]", "a rank among qwen-tts's 2048 codes per codebook (0 = its top-1): a token outside the top "
         "128 is no near-miss (defaults 10, 3)")
BOUNDS = {
    "tiers.quantisation_max_abs": ("[0, 1e-3]", "16-bit PCM moves a sample by about 3e-5 (1 LSB; the default "
                                   "6.2e-5 is 2 LSB); 1e-3 is 32 LSB and below an 8-bit step (7.8e-3): beyond, the "
                                   "tier takes audio no 16-bit rounding made"),
    "tiers.close_max_abs": ("[0, 0.1]", "samples lie in [-1, 1], so 2 accepts anything; float32 drift is about 4e-5 "
                            "(default 1e-3); a tenth of full scale (-20 dBFS) is audible, not drift"),
    "tiers.close_snr_db": ("[10, 100]", "at 0 dB noise as loud as the signal passes; below 10 dB the difference is "
                           "a third of the signal's amplitude (another voice); 100 is the SNR cap, above which this "
                           "route never passes (default 30)"),
    "tiers.close_logmel": ("[0, 1]", "mean |ln mel a - ln mel b| over bands: 1 is an e-fold (4.3 dB) difference in "
                           "every band, another sound (default 0.1)"),
    "donor.max_ratio": ("(0, 1)", "a ratio of log-mel distances: at 1 a peer that explains the chunks no better is "
                        "named the donor, at 0 none ever is (default 0.5)"),
    "forced.max_rank": (_TOPK[0].format(lo=0), _TOPK[1]),
    "forced.near_tie_top_k": (_TOPK[0].format(lo=1), _TOPK[1]),
    **{f"forced.{k}": _GAP for k in ("max_gap", "near_tie_max_gap", "near_tie_gross_gap", "support_max_gap",
                                     "support_gross_gap")},
    **{f"forced.{k}": ("[0.5, 1]", "a greedy stream's share of positions on qwen-tts's top-1: 0 passes any "
                                   "stream; below one half a stream mostly off qwen-tts's choices is plausible "
                                   "(defaults 0.8, 0.9)") for k in ("min_top1_share", "min_sub_top1_share")},
    "forced.exact_tie_gap": ("[0, 1e-3]", "nats between qwen-tts's top-1 and a token a float32 implementation may "
                             "take instead: float32 reordering moves them by at most 2.5e-5 (another thread count, "
                             "another shape; default 5e-5); 1e-3 is 40x that, where a scaled embedding's first flip "
                             "already hides"),
    "forced.sampling_max_z": ("(0, 10]", "|z| of a standard normal: 10 is a false-flag rate of 1e-23; a larger line "
                              "buys no safety and only loses defects (default 4)"),
    "forced.sampling_false_flag_rate": _RATE,
    "reference_encoder.min_agreement": ("[0.05, 1]", "the share of reference-code entries that agree: another "
                                        "voice's codes agree by chance (1 in 2048), so 0 passes any codes; 0.05 is "
                                        "100x chance, under bf16-with-AMX against float32 (0.10-0.13) (default 0.5)"),
    "measured_null.false_flag_rate": _RATE,
    "measured_null.rate_margin": _MARGIN,
    "measured_null.segment_false_flag_rate": _RATE,
    "measured_null.noise_scale": ("[1, 10]", "how many times as far as qwen-tts in the same dtype the candidate's "
                                  "kernels may move a token's margin: below 1 a correct engine's widest flips fail; "
                                  "at 10 a bf16 margin move of 0.85 nats (this CPU's widest) excuses any flip "
                                  "(default 1.5)"),
    "baseline.numerics_false_flag_rate": _RATE,
    "baseline.numerics_rate_margin": _MARGIN,
    "vocoder_null.margin": ("[1, 2]", "the candidate's distance from qwen-tts's float32 vocoder output over "
                            "qwen-tts's own vocoder's in the candidate's dtype: below 1 a correct engine fails; at 2 "
                            "a gain of 0.9 or noise at -20 dB passes in most segments of the tiny checkpoint, whose "
                            "bf16 vocoder is 17 dB from float32 (real vLLM-Omni 0.30.0: at most 1.22; default 1.3)"),
    "talker_input.prompt_bf16_max_rel": ("[0, 0.5]", "per prompt row, max |diff| over the row's largest |value|: "
                                         "qwen-tts's own bf16 prompt is at most 0.0095 from its float32 one (49 "
                                         "segments of the CPU suites); a row moved or another row in its place "
                                         "differs by 0.89 or more: at 0.5 half a row's largest value passes "
                                         "(default 0.05)"),
}
INTEGERS = {f"forced.{k}" for k, v in ForcedPolicy().__dict__.items() if isinstance(v, int)}
# The verdicts that name something wrong with the candidate: the default policy fails on each; a
# policy whose fail_on leaves one out is allowed, loudly (Policy.warnings).
DEFECTS = FAILS


def _in_range(x: float, text: str) -> bool:
    lo, hi = (float(t) for t in text[1:-1].split(","))
    return (lo < x if text[0] == "(" else lo <= x) and (x < hi if text[-1] == ")" else x <= hi)


def number(field: str, v, where: str = ""):
    """The one parser of a policy's numbers: an int or float, or a string YAML 1.1 leaves unparsed
    (`2e0`, `1e-4`: an exponent without a dot), never a bool, NaN or infinity, within BOUNDS[field].
    BadInput starts with `where` (the file)."""
    integer, (allowed, why) = field in INTEGERS, BOUNDS[field]
    try:
        x = None if isinstance(v, bool) or not isinstance(v, (int, float, str)) else float(v)
    except (ValueError, OverflowError):
        x = None
    problem = (f"expected {'an integer' if integer else 'a number'}" if x is None else
               "expected a finite number" if not math.isfinite(x) else
               "expected an integer" if integer and x != int(x) else None)
    if problem:
        raise BadInput(f"{where}{field}: {problem}, got {yamlfile.quote(v)}")
    if not _in_range(x, allowed):
        raise BadInput(f"{where}{field}: out of range: {yamlfile.quote(v)}, allowed {allowed}: {why}")
    return int(x) if integer else x


def out_of_bounds(policy: dict) -> list[str]:
    """A policy as report.json records it (Policy.as_dict), checked against BOUNDS: one line per
    number that is out of range (an absent one is not checked)."""
    problems = []
    for field in BOUNDS if isinstance(policy, dict) else ():
        section, key = field.split(".")
        if isinstance(policy.get(section), dict) and key in policy[section]:
            try:
                number(field, policy[section][key])
            except BadInput as e:
                problems.append(str(e))
    return problems


def policy_sha256(policy: dict) -> str:
    """The first 12 hex digits of the sha256 of a policy's values (Policy.as_dict, `source` left
    out): two policies with the same digest judge alike, whatever their files are called."""
    values = {k: v for k, v in policy.items() if k != "source"}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]


def load_policy(path: str | Path | None = None) -> Policy:
    """Load and validate a policy: every section and key known, every value of the right type and
    every number within BOUNDS; BadInput names the file, the field and the problem."""
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

    def num(field, default=None):  # no default: the key is required
        section, key = field.split(".")
        return number(field, (raw.get(section) or {}).get(key, default), f"{path}: ")

    vals = {k: num(f"tiers.{k}") for k in ("quantisation_max_abs", "close_max_abs", "close_snr_db", "close_logmel")}
    require = raw.get("require", {})
    for comp in ("concurrency", "vocoder", "drift"):
        if require.get(comp) not in TIERS[:-1]:
            bad(f"require.{comp}", f"expected one of {', '.join(TIERS[:-1])}, got {require.get(comp)!r}")
    ratio = num("donor.max_ratio")
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
    numerics_fail = baseline.get("numerics_fail", NumericsPolicy.fail)
    if not isinstance(numerics_fail, bool):
        bad("baseline.numerics_fail", f"expected true or false, got {yamlfile.quote(numerics_fail)}")
    numerics = NumericsPolicy(num("baseline.numerics_false_flag_rate", NumericsPolicy.false_flag_rate),
                              num("baseline.numerics_rate_margin", NumericsPolicy.rate_margin), numerics_fail)
    # an absent key keeps the built-in value
    forced = ForcedPolicy(**{k: num(f"forced.{k}", d) for k, d in ForcedPolicy().__dict__.items()})
    null = NullPolicy(**{k: num(f"measured_null.{k}", d) for k, d in NullPolicy().__dict__.items()})
    agreement = num("reference_encoder.min_agreement", Policy.encoder_min_agreement)
    return Policy(vals["quantisation_max_abs"], vals["close_max_abs"], vals["close_snr_db"],
                  vals["close_logmel"], {c: require[c] for c in ("concurrency", "vocoder", "drift")},
                  ratio, frozenset(fail_on), str(path), frozenset(run_verdicts), known_fail,
                  forced, agreement, null, numerics, num("vocoder_null.margin", Policy.vocoder_null_margin),
                  num("talker_input.prompt_bf16_max_rel", Policy.prompt_bf16_max_rel))
