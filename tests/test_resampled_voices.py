"""Issue 62: references at 16, 22.05, 44.1 and 48 kHz and in stereo, as users upload them.

The voices are what cases/voices/README.md's table says (rate, channels, length, where they land on
the frame grid once at 24 kHz), cases/make_resampled_voices.py regenerates them byte for byte, a
suite with them loads and sends their bytes unchanged, and the run's `references` check
(difftest/verdicts/exercised.py) tells a resampled reference from one read as if it were 24 kHz.
"""

import base64
import hashlib
import importlib.util
import sys
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from difftest.engines.speech_client import speech_request
from difftest.errors import SuiteError
from difftest.suites import wavio
from difftest.suites.suite import load_suite
from difftest.suites.voices import VoiceError, check_voice
from difftest.verdicts.exercised import references

ROOT = Path(__file__).resolve().parent.parent
VOICES = ROOT / "cases" / "voices"
SUITE = ROOT / "cases" / "suites" / "resampled.yaml"

# id: (source, rate, channels, frames at its rate, samples once at 24 kHz, reference frames, on the 1920 grid)
TABLE = {
    "bruno-16k": ("bruno", 16000, 1, 40960, 61440, 32, True),
    "dario-22k": ("dario", 22050, 1, 57230, 62292, 33, False),
    "hugo-44k": ("hugo", 44100, 1, 137592, 74880, 39, True),
    "iris-44k": ("iris", 44100, 1, 142000, 77279, 41, False),
    "chloe-48k": ("chloe", 48000, 1, 93001, 46501, 25, False),
    "greta-48k-stereo": ("greta", 48000, 2, 115200, 57600, 30, True),
    "alba-24k-stereo": ("alba", 24000, 2, 58000, 58000, 31, False),
}


def _maker():
    spec = importlib.util.spec_from_file_location("make_resampled_voices", ROOT / "cases" / "make_resampled_voices.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _read(path: Path) -> tuple[np.ndarray, int, int]:
    with wave.open(str(path), "rb") as w:
        assert w.getsampwidth() == 2
        x = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, w.getnchannels())
        return x.astype(np.int64), w.getframerate(), w.getnchannels()


@pytest.mark.parametrize("vid", sorted(TABLE))
def test_each_voice_is_what_the_table_says(vid):
    source, rate, channels, frames, at_24k, ref_frames, aligned = TABLE[vid]
    x, got_rate, got_channels = _read(VOICES / f"{vid}.wav")
    assert (got_rate, got_channels, len(x)) == (rate, channels, frames)
    assert 1.5 <= frames / rate <= 4.0
    assert -(-frames * 24000 // rate) == at_24k and -(-at_24k // 1920) == ref_frames
    if aligned:
        assert at_24k % 1920 == 0
    else:
        assert at_24k % 1920 and at_24k % 960
    assert ref_frames not in (28, 55, 56)  # vLLM-Omni's float-ceil finding stays out of these
    assert (VOICES / f"{vid}.txt").read_text(encoding="utf-8") == (VOICES / f"{source}.txt").read_text(encoding="utf-8")
    # the source's speech, at the source's level: peak -3 dBFS within 1 dB, the 0.1 s lead silence kept
    src, _, _ = _read(VOICES / f"{source}.wav")
    peak_db = 20 * np.log10(np.abs(x[:, 0]).max() / 32767)
    assert abs(peak_db - 20 * np.log10(np.abs(src).max() / 32767)) < 1.0
    lead = int(0.1 * rate) - 64  # less the filter's reach
    assert not x[:lead].any() and np.abs(x[lead + 128 : lead + 128 + rate // 10]).max() > 100


def test_the_table_is_the_scripts_and_the_voices_regenerate_byte_for_byte():
    mk = _maker()
    assert {s.id: (s.source, s.rate, s.channels, s.target, s.samples_24k, s.ref_frames, s.aligned)
            for s in mk.VOICES} == TABLE
    for spec in mk.VOICES:
        mk.check(spec)
        data, text = mk.build(spec)
        assert data == (VOICES / f"{spec.id}.wav").read_bytes(), f"{spec.id}.wav differs from its regeneration"
        assert text == (VOICES / f"{spec.id}.txt").read_text(encoding="utf-8")
        assert data == mk.build(spec)[0]
    assert mk.main(["make_resampled_voices.py", "--check"]) == 0


def test_the_resampler_keeps_a_tone_and_a_constant():
    mk = _maker()
    t = np.arange(24000)
    tone = np.round(8000 * np.sin(2 * np.pi * 1000 * t / 24000)).astype(np.int64)
    for rate in (16000, 22050, 44100, 48000):
        y = mk.resample(tone, rate, rate)[200:-200].astype(np.float64)
        want = 8000 * np.sin(2 * np.pi * 1000 * np.arange(200, rate - 200) / rate)
        err = np.sqrt(np.mean((y - want) ** 2))
        assert err < 2.0, f"{rate} Hz: rms error {err:.2f} of 8000"
        assert (mk.resample(np.full(4000, 1234, np.int64), rate, 2000)[100:-100] == 1234).all()
    # a tone above 16 kHz's Nyquist is filtered out, not folded down
    high = np.round(8000 * np.sin(2 * np.pi * 10000 * t / 24000)).astype(np.int64)
    assert np.abs(mk.resample(high, 16000, 16000)[200:-200]).max() < 80


def test_the_stereo_voices_have_two_slightly_different_channels():
    for vid in ("greta-48k-stereo", "alba-24k-stereo"):
        x, _, _ = _read(VOICES / f"{vid}.wav")
        left, right = x[:, 0], x[:, 1]
        assert (right[3:] == (7 * left[:-3] + 4) >> 3).all() and not right[:3].any()
        assert not np.array_equal(left, right)
        assert 0.8 < np.abs(right).max() / np.abs(left).max() < 0.9


def test_the_suite_loads_and_sends_each_voice_as_uploaded():
    suite = load_suite(SUITE)
    by_file = {v.wav.name: v for v in suite.voices.values()}
    assert {Path(n).stem for n in by_file} == set(TABLE)
    for name, v in by_file.items():
        _, rate, channels, frames, *_ = TABLE[Path(name).stem]
        assert (v.sample_rate, v.channels, v.n_samples) == (rate, channels, frames)
        assert v.wav_sha256 == hashlib.sha256((VOICES / name).read_bytes()).hexdigest()
    used = {s.voice.id for s in suite.segments}
    assert used == set(suite.voices)  # one segment per voice at least
    assert {v.mode for v in suite.voices.values()} == {"icl", "xvector"}
    assert {v.sample_rate for v in suite.voices.values() if v.mode == "xvector"} == {44100, 48000}
    assert all(s.decode["max_new_tokens"] == 32 and not s.decode["do_sample"] for s in suite.segments)
    seg = next(s for s in suite.segments if s.voice.id == "greta-48k-stereo")
    body = speech_request(seg, "t")
    sent = base64.b64decode(body["ref_audio"].split(",", 1)[1])
    assert sent == (VOICES / "greta-48k-stereo.wav").read_bytes()  # not resampled, not mixed down
    assert body["ref_text"] == (VOICES / "greta.txt").read_text(encoding="utf-8").strip()


def test_the_voice_rule_takes_uploads_and_still_refuses_what_no_upload_is(tmp_path):
    x = np.sin(np.arange(44100) / 10.0).astype(np.float32) * 0.3
    stereo = bytearray(wavio.encode(np.repeat(x, 2), 44100, "pcm16"))
    stereo[22:24] = (2).to_bytes(2, "little")
    stereo[28:32] = (44100 * 4).to_bytes(4, "little")
    stereo[32:34] = (4).to_bytes(2, "little")
    info = check_voice(bytes(stereo))
    assert (info.sample_rate, info.channels, info.n_frames) == (44100, 2, 44100)
    for rate, problem in ((96000, "96000 Hz"), (4000, "4000 Hz")):
        with pytest.raises(VoiceError, match=problem):
            check_voice(wavio.encode(x[:4000], rate, "pcm16"))
    three = bytearray(wavio.encode(np.repeat(x[:3000], 3), 24000, "pcm16"))
    three[22:24] = (3).to_bytes(2, "little")
    with pytest.raises(VoiceError, match="3 channels"):
        check_voice(bytes(three))
    with pytest.raises(VoiceError, match="lasts 61.0 s"):  # a minute at the voice's own rate, not at 24 kHz
        check_voice(wavio.encode(np.zeros(16000 * 61, np.float32), 16000, "pcm16"))
    check_voice(wavio.encode(np.zeros(16000 * 59, np.float32), 16000, "pcm16"))
    (tmp_path / "v.wav").write_bytes(bytes(three))
    (tmp_path / "s.yaml").write_text("name: s\ndecode: {repetition_penalty: 1.0, max_new_tokens: 4, seed: 0}\n"
                                     "voices: [{id: v, wav: v.wav, transcript: hi}]\n"
                                     "segments: [{id: a, text: hi, voice: v}]\n")
    with pytest.raises(SuiteError, match="3 channels"):
        load_suite(tmp_path / "s.yaml")


def _result(frames: int):
    return SimpleNamespace(ref_codes=np.zeros((frames, 16), np.int64))


def test_the_references_check_shows_the_resampling_ran_or_is_an_error():
    suite = load_suite(SUITE)
    segs = {s.voice.id: s for s in suite.segments}
    assert references(load_suite(SUITE.parent / "smoke.yaml").segments, {}) is None  # 24 kHz mono: nothing to show

    nothing = references(suite.segments)
    assert nothing["verdict"] == "error" and "nothing shows the resampling ran" in nothing["summary"]
    assert nothing["voices"]["hugo-44k"] | {} == {"sample_rate": 44100, "channels": 1, "frames": 137592, "mode": "icl",
                                                  "samples_24k": 74880, "ref_frames": 39, "converted": True}
    assert nothing["voices"]["alba-24k-stereo"]["channels"] == 2 and len(nothing["converted"]) == 9

    right = {segs[v].id: _result(TABLE[v][5]) for v in TABLE}
    ok = references(suite.segments, {"reference": right, "c=4": right})
    assert ok["verdict"] == "pass" and ok["voices"]["iris-44k"]["ref_frames_captured"] == {
        "reference:rs-05-en-44k-unaligned": 41, "c=4:rs-05-en-44k-unaligned": 41}
    assert "each as many frames as their 24 kHz mono audio gives" in ok["summary"]

    # 44.1 kHz read as if 24 kHz (72 frames, not 39); stereo not mixed down (61, not 31)
    raw = {**right, segs["hugo-44k"].id: _result(72), segs["alba-24k-stereo"].id: _result(61)}
    bad = references(suite.segments, {"reference": right, "c=4": raw})
    assert bad["verdict"] == "error" and "not resampled or mixed down" in bad["summary"]
    assert "c=4:rs-03-en-44k-aligned" in bad["summary"] and "c=4:rs-09-en-24k-stereo" in bad["summary"]
    assert "reference:" not in bad["summary"]

    # the encoder's codes count, as the talker's prompt got them, not those a hand-off extended for the vocoder
    handed = SimpleNamespace(ref_codes=np.zeros((41, 16), np.int64), extra={"input_ref_codes": np.zeros((30, 16))})
    own = references(suite.segments, {"c=4": {**right, segs["greta-48k-stereo"].id: handed}})
    assert own["verdict"] == "pass" and own["voices"]["greta-48k-stereo"]["ref_frames_captured"] == {
        "c=4:rs-07-en-48k-stereo": 30}

    # a frame more than the 24 kHz audio gives is no proof the path did not run: the segment's verdict judges it
    off = references(suite.segments, {"reference": right, "c=4": {**right, segs["chloe-48k"].id: _result(26)}})
    assert off["verdict"] == "pass" and "1 of another length" in off["summary"] and "chloe-48k" in off["summary"]
