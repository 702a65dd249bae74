"""The classifier with the comparison's fast paths (equal audio, a segment's comparisons of the same
audio made once) says exactly what it said without them: every verdict, and every number of its
report entry. The oracle is tests/test_compare_fast_path.py's full computation."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compare_fast_path import (
    full_chunk_frame_bounds,
    full_diff_codes,
    full_frame_metrics,
    full_non_finite,
    full_reduce_frames,
    pcm16,
)
from toy import toy_codes, toy_decode, toy_result

import difftest.compare.align as align_module
import difftest.compare.chunks as chunks_module
import difftest.verdicts.concurrency as concurrency_module
import difftest.verdicts.headline as headline_module
import difftest.verdicts.usable as usable_module
from difftest.compare.audio import log_mel
from difftest.compare.chunks import chunk_tiers
from difftest.verdicts.classify import Evidence, classify
from difftest.verdicts.policy import load_policy

CODES = toy_codes(40, 1)
REF_A, REF_B, REF_C = toy_codes(20, 2), toy_codes(15, 3), toy_codes(12, 4)
WAV = toy_decode(CODES, REF_A)


def full_audio_init(self, a, b, thresholds, chunking, mels=None):
    """Audio as it was: the time-domain metrics, then all of them again with the log-mel where it
    can decide a tier; nothing reused but each result's log-mel."""
    mels = {} if mels is None else mels
    self.fm = full_frame_metrics(a.grid_wav, b.grid_wav, a.sample_rate, with_mel=False)
    self.logmel_computed = bool(len(self.fm.max_abs)) and float(self.fm.max_abs.max()) > thresholds.close_max_abs
    if self.logmel_computed:
        for r in (a, b):
            if id(r) not in mels:
                mels[id(r)] = log_mel(r.grid_wav, r.sample_rate)
        self.fm = full_frame_metrics(a.grid_wav, b.grid_wav, a.sample_rate, mel_a=mels[id(a)], mel_b=mels[id(b)])
    self.bounds = full_chunk_frame_bounds(len(self.fm.max_abs), *chunking)
    self.chunks = full_reduce_frames(self.fm, self.bounds)
    self.quantised = a.quantised or b.quantised
    self.thresholds = thresholds
    self.tiers = chunk_tiers(self.chunks, thresholds, self.quantised)
    self.len_a, self.len_b = len(a.grid_wav), len(b.grid_wav)


def judged(ev: Evidence, policy, full: bool = False) -> str:
    """The segment's report entry as JSON text (floats as their shortest exact repr)."""
    with pytest.MonkeyPatch.context() as mp:
        if full:
            mp.setattr(chunks_module.Audio, "__init__", full_audio_init)
            mp.setattr(usable_module, "non_finite", full_non_finite)
            mp.setattr(headline_module, "diff_codes", full_diff_codes)
            mp.setattr(concurrency_module, "diff_codes", full_diff_codes)
            mp.setattr(align_module, "chunk_frame_bounds", full_chunk_frame_bounds)
        return json.dumps(classify(ev, policy).to_json(), sort_keys=True)


def res(wav=None, codes=CODES, ref=REF_A, **kw):
    """A result with its own copy of the audio, as read from its own file."""
    return toy_result("a", codes, ref, wav=(WAV if wav is None else wav).copy(), **kw)


def evidence(cand, control=None, reference=None, cross=None, repeat=None, donors=True):
    cross_donors = {"b": res(toy_decode(CODES, REF_B)), "c": res(toy_decode(CODES, REF_C))} if donors else {}
    return Evidence(segment_id="a", reference=reference or res(), candidate=cand, control=control,
                    cross_own=cross or res(), cross_donors=cross_donors,
                    peer_ref_codes={"b": REF_B, "c": REF_C}, repeat=repeat)


def garbled(from_frame=28):
    w = WAV.copy()
    w[from_frame * 1920:] = np.flip(w[from_frame * 1920:])
    return w


def shared(r):
    """Every role the same result: the same arrays."""
    return Evidence(segment_id="a", reference=r, candidate=r, control=r, cross_own=r, repeat=r)


DRIFT = WAV + np.float32(3e-5)
BF16 = WAV * np.float32(1.01)  # above close_max_abs, but close by SNR and log-mel: the log-mel is computed
HALVED = WAV.copy()
HALVED[30 * 1920:31 * 1920] *= 0.5
SCENARIOS = {
    "identical": lambda: evidence(res(), res(), repeat=res()),
    "identical, shared arrays": lambda: shared(res()),
    "drift": lambda: evidence(res(DRIFT), res(DRIFT), repeat=res(DRIFT)),
    "quantised": lambda: evidence(res(pcm16(WAV), quantised=True), res(pcm16(WAV), quantised=True),
                                  repeat=res(pcm16(WAV), quantised=True)),
    "quantised at N, float at 1": lambda: evidence(res(pcm16(WAV), quantised=True), res(DRIFT)),
    "bf16-like drift": lambda: evidence(res(BF16), res(BF16), repeat=res(BF16)),
    "vocoder defect": lambda: evidence(res(garbled()), res()),
    "contamination": lambda: evidence(res(toy_decode(CODES, REF_B)), res()),
    "concurrency defect, audio only": lambda: Evidence(segment_id="a", reference=res(),
                                                       candidate=res(HALVED, has_codes=False),
                                                       control=res(has_codes=False)),
    "history defect": lambda: evidence(res(), res(), repeat=res(HALVED)),
    "reference left in the output": lambda: evidence(
        res(np.concatenate([np.zeros(len(REF_A) * 1920, np.float32), WAV]))),
    "trailing sample": lambda: Evidence(segment_id="a", reference=res(np.append(WAV, np.float32(0.01))),
                                        candidate=res()),
    "lead sample": lambda: evidence(res(), res(), reference=res(np.insert(WAV, 0, np.float32(0.2)),
                                                                 meta={"lead_samples": 1})),
    "shorter audio": lambda: evidence(res(WAV[:-1000]), res(WAV[:-1000])),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_reports_as_without_the_fast_path(policy, name):
    fast, full = judged(SCENARIOS[name](), policy), judged(SCENARIOS[name](), policy, full=True)
    assert fast == full
    assert json.loads(fast)["verdict"] == {
        "identical": "identical", "identical, shared arrays": "identical", "drift": "numeric_drift",
        "quantised": "numeric_drift", "quantised at N, float at 1": "numeric_drift",
        "bf16-like drift": "numeric_drift", "vocoder defect": "vocoder_defect", "contamination": "contamination",
        "concurrency defect, audio only": "concurrency_defect", "history defect": "history_defect",
        "reference left in the output": "length_mismatch", "trailing sample": "identical",
        "lead sample": "identical", "shorter audio": "length_mismatch"}[name]


def test_a_strict_policy_reports_as_without_the_fast_path(policy, tmp_path):
    """Where identical is required, close chunks fail and their log-mel is in the summary and the
    donor search: still the same numbers."""
    strict = tmp_path / "strict.yaml"
    strict.write_text(Path(policy.source).read_text().replace("concurrency: close", "concurrency: identical")
                      .replace("vocoder: close", "vocoder: identical"))
    p = load_policy(strict)
    for make in (SCENARIOS["bf16-like drift"], SCENARIOS["quantised at N, float at 1"], SCENARIOS["drift"]):
        fast, full = judged(make(), p), judged(make(), p, full=True)
        assert fast == full and json.loads(fast)["verdict"] in ("vocoder_defect", "concurrency_defect",
                                                                 "contamination")


def test_equal_audio_is_compared_once_per_segment(policy, monkeypatch):
    """Reference, candidate at N and at 1, its repeat and the cross-decode all equal (read from five
    files): one comparison made, the other three reuse it."""
    made = []
    real = chunks_module.frame_metrics
    monkeypatch.setattr(chunks_module, "frame_metrics", lambda *a, **k: made.append(1) or real(*a, **k))
    v = classify(SCENARIOS["identical"](), policy)
    assert v.verdict == "identical" and len(made) == 1
    assert {k: v.comparisons[k]["worst_tier"] for k in ("audio", "concurrency", "vocoder", "repeat")} == dict.fromkeys(
        ("audio", "concurrency", "vocoder", "repeat"), "identical")
    made.clear()
    classify(SCENARIOS["quantised"](), policy)  # reference against PCM, and PCM against PCM
    assert len(made) == 2


def stretch(rng, base, kind):
    """`base` with one stretch of frames made identical, quantised, close or diverged."""
    w = base.copy()
    lo = int(rng.integers(0, 40)) * 1920
    hi = min(len(w), lo + int(rng.integers(1, 40)) * 1920)
    if kind == "quantised":
        w[lo:hi] = pcm16(w[lo:hi])
    elif kind == "close":
        w[lo:hi] += (3e-5 * rng.standard_normal(hi - lo)).astype(np.float32)
    elif kind == "bf16":
        w[lo:hi] *= np.float32(1.01)
    elif kind == "diverged":
        w[lo:hi] = np.flip(w[lo:hi])
    return w


roles = st.sampled_from(["identical", "quantised", "close", "bf16", "diverged"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), roles, roles, roles, roles, st.booleans(), st.sampled_from([(1, 25), (2, 7)]))
def test_any_mix_reports_as_without_the_fast_path(seed, k_cand, k_ctrl, k_rep, k_cross, ctrl_is_cand, schedule):
    policy = load_policy()
    rng = np.random.default_rng(seed)
    cand = stretch(rng, WAV, k_cand)
    ctrl = cand if ctrl_is_cand else stretch(rng, WAV, k_ctrl)
    rep, cross = stretch(rng, ctrl, k_rep), stretch(rng, WAV, k_cross)

    def make():
        q = k_cand == "quantised"
        return Evidence(segment_id="a", reference=res(), candidate=res(cand, quantised=q), control=res(ctrl),
                        cross_own=res(cross),
                        cross_donors={"b": res(toy_decode(CODES, REF_B)), "c": res(toy_decode(CODES, REF_C))},
                        peer_ref_codes={"b": REF_B, "c": REF_C}, repeat=res(rep), initial_frames=schedule[0],
                        chunk_frames=schedule[1])

    assert judged(make(), policy) == judged(make(), policy, full=True)
