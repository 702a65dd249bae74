"""The vocoder's measured null (difftest/verdicts/vocoder_null.py): a vocoder in another dtype than
the reference's is allowed, per chunk, what qwen-tts's own vocoder in that dtype moves from its
float32 output, times the policy's margin; nothing more (synthetic audio, tests/toy.py)."""

from dataclasses import replace

import numpy as np
import pytest
from toy import toy_codes, toy_decode, toy_evidence, toy_result

from difftest.errors import InfraError
from difftest.verdicts import vocoder_null
from difftest.verdicts.classify import classify
from difftest.verdicts.evidence import compared

CODES, OWN = toy_codes(60, 1), toy_codes(20, 2)
FP32 = toy_decode(CODES, OWN)
LEVEL = 3e-3  # bf16-like rounding noise: above close_max_abs, and it fills the mel bands the toy leaves empty


def noise(seed: int, level: float = LEVEL) -> np.ndarray:
    return (level * np.random.default_rng(seed).standard_normal(len(FP32))).astype(np.float32)


def ev(cand_wav, null_wav=None, dtype="bfloat16"):
    cand = toy_result("a", CODES, OWN, wav=np.asarray(cand_wav, np.float32))
    null = None if null_wav is None else toy_result("a", CODES, OWN, wav=np.asarray(null_wav, np.float32))
    return toy_evidence(cand, codes=CODES, own=OWN, control=cand, vocoder_null=null,
                        vocoder_dtype=dtype if null is not None else None)


def test_a_vocoder_as_far_from_float32_as_qwen_tts_in_its_dtype_passes(policy):
    cand, null = FP32 + noise(1), FP32 + noise(2)
    strict = classify(ev(cand), policy)  # without the null: the float tiers, as before
    assert strict.verdict == "vocoder_defect" and strict.stage == "vocoder"
    v = classify(ev(cand, null), policy)
    assert v.verdict == "numeric_drift", v.summary
    assert v.summary.startswith(f"same codes; audio within {policy.vocoder_null_margin:g}x qwen-tts's own bfloat16 "
                                f"vocoder's distance")
    n = v.comparisons["vocoder_null"]
    assert n["dtype"] == "bfloat16" and n["margin"] == policy.vocoder_null_margin
    assert n["excused"] == list(range(len(v.comparisons["vocoder"]["tiers"])))  # every chunk was diverged
    assert all(0.8 < r < 1.25 for m in ("rms", "logmel") for r in n["ratio"][m])  # the same noise, other draws


@pytest.mark.parametrize("how", ["louder", "gain", "offset"])
def test_a_vocoder_defect_beyond_the_null_still_fails(policy, how):
    m = policy.vocoder_null_margin
    cand = {"louder": FP32 + noise(1, LEVEL * m * 1.5),
            "gain": np.float32(0.9) * FP32 + noise(1),
            "offset": FP32 + noise(1) + np.float32(LEVEL * m * 1.5)}[how]
    v = classify(ev(cand, FP32 + noise(2)), policy)
    assert v.verdict == "vocoder_defect" and v.stage == "vocoder", v.summary
    assert v.first_divergent_chunk == 0
    assert f"beyond {m:g}x what qwen-tts's own bfloat16 vocoder moves from the reference's decode: rms" in v.summary
    worst_rms = float(v.summary.split(": rms ")[1].split("x")[0])
    assert worst_rms > m
    assert v.comparisons["vocoder_null"]["excused"] == []


def test_a_hiss_the_null_does_not_have_fails_on_the_log_mel_alone(policy):
    from scipy.signal import butter, sosfilt

    low = sosfilt(butter(8, 2000, "lp", fs=24000, output="sos"), noise(2))
    low = (low * LEVEL / np.std(low)).astype(np.float32)  # the null's rounding noise stays in the signal's bands
    v = classify(ev(FP32 + noise(1), FP32 + low), policy)  # as loud, but spread over every band
    r = v.comparisons["vocoder_null"]["ratio"]
    assert all(0.9 < x < 1.1 for x in r["rms"]) and all(x > 2.5 for x in r["logmel"])
    assert v.verdict == "vocoder_defect" and ", logmel " in v.summary


def test_only_the_chunks_beyond_the_null_fail(policy):
    cand = FP32 + noise(1)
    s, e = 30 * 1920, 40 * 1920  # frames 30-39: a defect in one stretch of the utterance
    cand[s:e] += noise(3, LEVEL * 4)[s:e]
    v = classify(ev(cand, FP32 + noise(2)), policy)
    voc = v.comparisons["vocoder"]
    bad = [int(c) for c in v.summary.split("(chunks ")[1].split(",")[0].split("-")]
    assert v.verdict == "vocoder_defect" and bad[0] == v.first_divergent_chunk > 0
    assert set(v.comparisons["vocoder_null"]["excused"]) == set(range(len(voc["tiers"]))) - set(
        range(bad[0], bad[-1] + 1))


def test_a_chunk_where_the_null_is_float32_exactly_allows_nothing(policy):
    null = FP32 + noise(2)
    null[:1920 * 5] = FP32[:1920 * 5]  # qwen-tts in bf16 matched float32 here: no allowance in chunk 0
    v = classify(ev(FP32 + noise(1), null), policy)
    assert v.verdict == "vocoder_defect" and v.first_divergent_chunk == 0
    assert v.comparisons["vocoder_null"]["ratio"]["rms"][0] is None  # infinite: JSON has none
    assert 0 not in v.comparisons["vocoder_null"]["excused"]


def test_the_margin_is_the_policys(policy):
    cand, null = FP32 + noise(1, LEVEL * 1.5), FP32 + noise(2)
    assert classify(ev(cand, null), replace(policy, vocoder_null_margin=2.0)).verdict == "numeric_drift"
    v = classify(ev(cand, null), replace(policy, vocoder_null_margin=1.2))
    assert v.verdict == "vocoder_defect" and "beyond 1.2x" in v.summary


def test_excused_needs_the_same_chunks_on_both_sides(policy):
    e = ev(FP32 + noise(1), FP32 + noise(2))
    cand = compared(e.cross_own, e.candidate, e, policy)
    short = toy_result("a", CODES[:30], OWN, wav=(FP32 + noise(2))[:30 * 1920])
    null = compared(toy_result("a", CODES[:30], OWN, wav=FP32[:30 * 1920]), short, e, policy)
    assert not vocoder_null.excused(cand, null, 2.0).any()
    same = compared(e.cross_own, e.vocoder_null, e, policy)
    assert vocoder_null.excused(cand, same, 2.0).all() and not vocoder_null.excused(cand, same, 0.5).any()


def test_the_candidates_vocoder_dtype_and_where_it_came_from():
    overlay = {"overlay": {"stages": [{"stage_id": 0, "dtype": "bfloat16"}, {"stage_id": 1, "dtype": "bf16"}]}}
    assert vocoder_null.vocoder_dtype(overlay, None, "float32") == ("bfloat16", "the deploy overlay's stage 1")
    assert vocoder_null.vocoder_dtype(overlay, "float32", "float32") == ("float32",
                                                                         "declared (--candidate-vocoder-dtype)")
    assert vocoder_null.vocoder_dtype({"vocoder_dtype": "torch.bfloat16"}, None, "float32") == (
        "bfloat16", "the engine's identity")
    assert vocoder_null.vocoder_dtype({"kind": "url"}, None, "float32") == ("float32", "not declared: the reference's")
    fp32 = {"overlay": {"stages": [{"stage_id": 0, "dtype": "bfloat16"}, {"stage_id": 1, "dtype": "float32"}]}}
    assert vocoder_null.vocoder_dtype(fp32, None, "float32")[0] == "float32"  # the release run: no null


class FakeRunner:
    """Answers `decode` items as the reference runner does: one result file per item."""

    def __init__(self, dtypes=("float32", "bfloat16")):
        self.hello = {"fingerprint": {"engine": "qwen-tts", "dtype": "float32"}, "decode_dtypes": list(dtypes)}
        self.items = []

    def request(self, op, timeout, items):
        from pathlib import Path

        from difftest.results import write_result

        for it in items:
            self.items.append(it)
            wav = FP32 + (noise(2) if it.get("dtype") == "bfloat16" else 0)
            side = write_result(Path(it["out"]), toy_result(it["segment_id"], CODES, OWN, wav=wav))
            yield {"event": "result", "item": it["name"], "path": str(side)}


def test_the_nulls_decodes_are_asked_in_its_dtype_and_kept_under_their_own_key(tmp_path):
    from difftest.pipeline.cross import Vocoder as _Vocoder

    runner = FakeRunner()
    own = _Vocoder(runner, tmp_path / "out", 60, tmp_path / "store")
    null = _Vocoder(runner, tmp_path / "out", 60, tmp_path / "store", dtype="bfloat16")
    assert own.dtype is None and null.dtype == "bfloat16" and own.kept != null.kept
    a = own.decode({"a.own": ("a", CODES, OWN)})["a.own"]
    b = null.decode({"a.own-bfloat16": ("a", CODES, OWN)})["a.own-bfloat16"]
    assert [it.get("dtype") for it in runner.items] == [None, "bfloat16"]
    assert np.array_equal(a.wav, FP32) and not np.array_equal(b.wav, FP32)
    again = _Vocoder(runner, tmp_path / "out2", 60, tmp_path / "store", dtype="bfloat16")
    assert np.array_equal(again.decode({"a.own-bfloat16": ("a", CODES, OWN)})["a.own-bfloat16"].wav, b.wav)
    assert len(runner.items) == 2  # kept in the store: not decoded again
    assert _Vocoder(runner, tmp_path / "out", 60, tmp_path / "store", dtype="float32").dtype is None  # its own
    with pytest.raises(InfraError, match="cannot decode in bfloat16"):
        _Vocoder(FakeRunner(dtypes=()), tmp_path / "out", 60, tmp_path / "store", dtype="bfloat16")
