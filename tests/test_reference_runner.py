"""The reference runner through its protocol, on the tiny checkpoints, with the real qwen-tts."""

from __future__ import annotations

import math
import shutil
import wave

import numpy as np
import pytest
from reference_support import (
    DECODE,
    Stopwatch,
    all_models,
    by_segment,
    generate,
    load_npz,
    segment,
    start_runner,
    tiny,  # noqa: F401
    voice,
    write_voice,
)

from difftest.compare import align
from difftest.process.runner_client import RunnerDied
from difftest.results import read_result
from difftest.suites import wavio
from difftest.suites.voices import reference_frames

VOICE_SECONDS = 1.3  # 31200 samples: 16.25 frames, so the reference encodes to 17 frames


def write_pcm(path, x, sr: int, sampwidth: int = 2):
    """x (n, channels) in [-1, 1) as 16-bit or 8-bit (unsigned) PCM, by the stdlib's wave module."""
    x = np.asarray(x, np.float64).reshape(len(x), -1)
    if sampwidth == 1:
        data = np.clip(np.rint(x * 127 + 128), 0, 255).astype(np.uint8)
    else:
        data = np.clip(np.rint(x * 32767), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(x.shape[1])
        w.setsampwidth(sampwidth)
        w.setframerate(sr)
        w.writeframes(data.tobytes())
    return path


@pytest.fixture(scope="module")
def voices(tmp_path_factory):
    d = tmp_path_factory.mktemp("voices")
    good = write_voice(d / "good.wav", VOICE_SECONDS, 220.0, seed=0)
    other = write_voice(d / "other.wav", 1.0, 330.0, seed=1)
    truncated = d / "truncated.wav"
    truncated.write_bytes(good.read_bytes()[:-1001])
    # what users upload: another rate, stereo (qwen-tts mixes down and resamples to 24 kHz itself)
    low_rate = write_voice(d / "16k.wav", 1.0, 220.0, sr=16000)  # 16000 frames -> 24000 samples: 13 frames
    mono48, _ = wavio.read(write_voice(d / "48k.wav", VOICE_SECONDS, 220.0, sr=48000, seed=2))
    right = np.concatenate([np.zeros(3, np.float32), 0.875 * mono48[:-3]])
    stereo48 = write_pcm(d / "48k-stereo.wav", np.stack([mono48, right], 1), 48000)  # 62400 -> 31200: 17 frames
    # outside the voice rule (difftest/suites/voices.py)
    tone = 0.3 * np.sin(np.arange(24000) / 7.0)
    rate96k = write_voice(d / "96k.wav", 1.0, 220.0, sr=96000)
    three = write_pcm(d / "3ch.wav", np.stack([tone, tone, tone], 1), 24000)
    eight = write_pcm(d / "8bit.wav", tone, 24000, sampwidth=1)
    return {"good": good, "other": other, "truncated": truncated, "16k": low_rate, "48k-stereo": stereo48,
            "96k": rate96k, "3ch": three, "8bit": eight, "missing": d / "missing.wav"}


@pytest.fixture(scope="module")
def segments(voices):
    good = voice(voices["good"])
    return {
        "icl": segment("icl", "Hello world.", voice=good),
        "xvec": segment("xvec", "Hello world, said another way.",
                        voice=voice(voices["good"], mode="xvector", vid="vx")),
        "icl2": segment("icl2", "A second sentence.", voice=voice(voices["other"], "Another reference.", vid="o"),
                        decode={**DECODE, "max_new_tokens": 12}),
        "custom": segment("custom", "Custom voice here.", task="custom_voice", speaker="alice",
                          instructions="Speak happily."),
        "design": segment("design", "Designed voice.", task="voice_design", instructions="A calm, low voice."),
    }


@pytest.fixture(scope="module")
def resampled_segments(voices):
    """Voices at another rate and in stereo: accepted, resampled and mixed down by qwen-tts."""
    return {
        "icl16k": segment("icl16k", "Hello from sixteen kilohertz.", voice=voice(voices["16k"], vid="v16k")),
        "icl48s": segment("icl48s", "Hello in stereo.", voice=voice(voices["48k-stereo"], vid="v48s")),
        "xvec48s": segment("xvec48s", "Stereo, speaker only.",
                           voice=voice(voices["48k-stereo"], mode="xvector", vid="v48sx")),
    }


@pytest.fixture(scope="module")
def bad_segments(voices):
    good = voice(voices["good"])
    return {
        "no_wav": segment("no_wav", "Hello.", voice=voice(voices["missing"])),
        "truncated": segment("truncated", "Hello.", voice=voice(voices["truncated"])),
        "rate96k": segment("rate96k", "Hello.", voice=voice(voices["96k"])),
        "three_ch": segment("three_ch", "Hello.", voice=voice(voices["3ch"])),
        "eight_bit": segment("eight_bit", "Hello.", voice=voice(voices["8bit"])),
        "empty": segment("empty", "   ", voice=good),
        "klingon": segment("klingon", "Hello.", language="Klingon", voice=good),
    }


@pytest.fixture(scope="module")
def first_run(tiny, segments, resampled_segments, bad_segments, tmp_path_factory):
    """One runner, all three models: good and bad segments interleaved in one job."""
    out = tmp_path_factory.mktemp("first")
    rs = resampled_segments
    order = [segments["icl"], bad_segments["no_wav"], segments["xvec"], bad_segments["truncated"],
             bad_segments["rate96k"], rs["icl16k"], bad_segments["three_ch"], rs["icl48s"], bad_segments["eight_bit"],
             rs["xvec48s"], segments["custom"], bad_segments["empty"], segments["design"],
             bad_segments["klingon"], segments["icl2"]]
    runner = start_runner(all_models(tiny), log_path=out / "runner.log")
    try:
        events = generate(runner, order, out)
        decode_dir = out / "decoded"
        items = []
        for sid in ("icl", "xvec", "custom", "design", "icl2"):
            seg = segments[sid]
            items.append({"name": sid, "input": str(out / f"{sid}.{seg.hash[:16]}.npz"), "out": str(decode_dir / sid)})
        # The cross-decode of icl's codes with icl2's reference codes (a "donor").
        mixed = out / "mixed.npz"
        a, b = load_npz(items[0]["input"]), load_npz(items[4]["input"])
        np.savez(mixed, codes=a["codes"], ref_codes=b["ref_codes"])
        items.append({"name": "mixed", "input": str(mixed), "out": str(decode_dir / "mixed")})
        decoded = list(runner.request("decode", timeout=120, items=items))
        hello = runner.hello
    finally:
        runner.close()
    return {"out": out, "events": events, "decoded": decoded, "hello": hello}


def _result(run, seg):
    return read_result(run["out"] / f"{seg.id}.{seg.hash[:16]}.json")


def test_announces_fingerprint_without_loading(first_run, tiny):
    hello = first_run["hello"]
    assert hello["label"] == "qwen-tts"
    fp = hello["fingerprint"]
    assert fp["engine"] == "qwen-tts" and fp["dtype"] == "float32" and fp["device"] == "cpu" and fp["threads"] == 1
    assert fp["versions"]["qwen-tts"] == "0.1.1" and fp["versions"]["transformers"] == "4.57.3"
    assert fp["versions"]["torch"].startswith("2.13.0")
    assert set(fp["checkpoints"]) == {"base", "custom_voice", "voice_design"}
    assert all(len(h) == 64 for h in fp["checkpoints"].values())
    assert hello["provenance"]["models"]["base"]["path"] == str(tiny / "base")


def test_generate_writes_codes_ref_codes_and_wav(first_run, segments, resampled_segments):
    results = by_segment(first_run["events"], "result")
    assert set(results) == {"icl", "xvec", "icl2", "custom", "design", "icl16k", "icl48s", "xvec48s"}
    assert not any(e["cached"] for e in results.values())
    # a voice at another rate or in stereo: qwen-tts's reference codes are its length at 24 kHz
    # (ceil(n * 24000 / rate)) in 1920-sample frames, not its frames read as if 24 kHz
    for sid, (rate, channels, n, want) in {"icl16k": (16000, 1, 16000, 13), "icl48s": (48000, 2, 62400, 17),
                                           "xvec48s": (48000, 2, 62400, 0)}.items():
        seg, r = resampled_segments[sid], _result(first_run, resampled_segments[sid])
        wi = wavio.info(seg.voice.wav)
        assert (wi.sample_rate, wi.channels, wi.n_frames) == (rate, channels, n)
        assert want in (0, reference_frames(n, rate)) and want != -(-n // 1920)
        assert r.ref_codes.shape == (want, 16), sid
        frames = seg.decode["max_new_tokens"] - 1
        assert r.codes.shape == (frames, 16) and len(r.grid_wav) == frames * 1920
        assert r.meta["lead_samples"] == (align.lead_samples(want, frames) if want else 0)
        assert r.provenance["voice"]["wav_sha256"] == seg.voice.wav_sha256  # sent as uploaded
    for sid, seg in segments.items():
        r = _result(first_run, seg)
        frames = seg.decode["max_new_tokens"] - 1  # the residual groups come one step late: N tokens, N-1 frames
        assert r.codes.shape == (frames, 16), sid
        assert r.codes.min() >= 0 and r.codes.max() < 2048  # no special ids leak into the codes
        assert len(np.unique(r.codes[:, 0])) > frames // 2  # the talker really varies its output
        assert r.sample_rate == 24000 and r.wav.dtype == np.float32
        assert 0.05 < float(r.wav.std()) < 0.6 and float(np.abs(r.wav).max()) <= 1.0
        if seg.voice is not None and seg.voice.mode == "icl":
            assert r.ref_codes.shape == (math.ceil(seg.voice.n_samples / 1920), 16)
            # qwen-tts cuts the reference part with a float expression: one sample in front of frame 0
            # when it falls short, and the result says so (difftest.compare.align).
            lead = align.lead_samples(len(r.ref_codes), frames)
            assert len(r.wav) - frames * 1920 == lead
            # and the voice through a bf16 copy of the same encoder: same frames, other residual codes
            bf16 = r.extra["ref_codes_bf16"]
            assert bf16.shape == r.ref_codes.shape and not np.array_equal(bf16, r.ref_codes), sid
            assert 0.05 < float((bf16 == r.ref_codes).mean()) < 1.0
            assert r.timings["prompt_bf16_s"] > 0  # its cost is in the reference's model time
        else:
            assert r.ref_codes.shape == (0, 16) and "ref_codes_bf16" not in r.extra
            assert len(r.wav) == frames * 1920
            lead = 0
        assert r.meta == {"runner": "qwen-tts", "concurrency": 1, "lead_samples": lead}
        assert len(r.grid_wav) == frames * 1920
        dec = r.provenance["decode"]
        assert dec["do_sample"] is False and dec["subtalker_dosample"] is False
        assert dec["repetition_penalty"] == 1.0 and dec["max_new_tokens"] == seg.decode["max_new_tokens"]
        assert dec["seed"] == 0
        assert r.provenance["versions"]["qwen-tts"] == "0.1.1"
        assert r.provenance["checkpoint"]["sha256"] == first_run["hello"]["fingerprint"]["checkpoints"][
            {"voice_clone": "base"}.get(seg.task, seg.task)]
        assert r.timings["generate_s"] > 0 and r.timings["audio_s"] == pytest.approx(len(r.wav) / 24000)
        assert results[sid]["audio_seconds"] == pytest.approx(len(r.wav) / 24000)


def test_vocoder_output_depends_on_the_codes(first_run, segments):
    a = _result(first_run, segments["custom"]).wav
    b = _result(first_run, segments["design"]).wav
    corr = float(np.corrcoef(a, b)[0, 1])
    assert abs(corr) < 0.9, corr


def test_bad_inputs_are_named_and_the_job_goes_on(first_run, bad_segments, voices):
    errors = by_segment(first_run["events"], "error")
    assert set(errors) == set(bad_segments)
    assert all(e["kind"] == "bad_input" for e in errors.values())
    msg = {k: e["message"] for k, e in errors.items()}
    assert "not found" in msg["no_wav"] and str(voices["missing"]) in msg["no_wav"]
    assert "truncated" in msg["truncated"] and "truncated.wav" in msg["truncated"]
    assert msg["rate96k"] == (f"voice wav {voices['96k']}: is 96000 Hz; a reference voice is 8000-48000 Hz "
                              f"(the model's is 24000)")
    assert msg["three_ch"] == f"voice wav {voices['3ch']}: has 3 channels; a reference voice is mono or stereo"
    assert msg["eight_bit"] == f"voice wav {voices['8bit']}: is 8-bit; use 16-bit PCM or better"
    assert msg["empty"] == "empty text"
    assert "Klingon" in msg["klingon"] and "english" in msg["klingon"]
    assert not list(first_run["out"].glob("no_wav.*")) and not list(first_run["out"].glob("klingon.*"))
    # The last segment of the job came after a bad one and was still computed.
    assert first_run["events"][-1]["segment"] == "icl2" and first_run["events"][-1]["event"] == "result"


def test_cross_decode_reproduces_the_generated_wav_exactly(first_run, segments):
    answers = {e["item"]: e for e in first_run["decoded"]}
    assert all(e["event"] == "result" for e in answers.values()), answers
    for sid, seg in segments.items():
        own = _result(first_run, seg)
        again = read_result(answers[sid]["path"])
        assert np.array_equal(again.codes, own.codes) and np.array_equal(again.ref_codes, own.ref_codes)
        assert again.wav.dtype == np.float32 and again.wav.shape == own.wav.shape, sid
        assert np.array_equal(again.wav, own.wav), f"{sid}: max diff {np.abs(again.wav - own.wav).max()}"
    # Another request's reference codes as left context change the audio (what donor detection relies on).
    icl = _result(first_run, segments["icl"]).wav
    mixed = read_result(answers["mixed"]["path"]).wav
    n = min(len(icl), len(mixed))
    assert np.abs(icl[:n] - mixed[:n]).max() > 0.05


def test_cached_results_are_answered_without_loading_a_model(first_run, tiny, segments, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(first_run["out"], out)
    # Only the base model: a custom_voice segment that is not cached names what is missing.
    runner = start_runner([str(tiny / "base")])
    try:
        new_custom = segment("custom_new", "Not cached.", task="custom_voice", speaker="bob")
        with Stopwatch() as sw:
            events = generate(runner, [segments["icl"], segments["xvec"], new_custom], out)
        tail = runner.log_tail(200)
    finally:
        runner.close()
    results = by_segment(events, "result")
    assert results["icl"]["cached"] is True and results["xvec"]["cached"] is True
    err = by_segment(events, "error")["custom_new"]
    assert err["kind"] == "bad_input" and "no custom_voice checkpoint" in err["message"]
    assert not any(e["event"] == "progress" for e in events)
    assert "imported qwen_tts" not in tail and "loaded" not in tail  # served from the store, no model loaded
    print(f"cached results: {sw.seconds:.2f} s")


def test_run_to_run_determinism_on_recomputing_damaged_results(first_run, tiny, segments, tmp_path):
    """A second process recomputes the damaged results: bitwise what the first process wrote."""
    out = tmp_path / "damaged"
    shutil.copytree(first_run["out"], out)
    icl, xvec, custom = segments["icl"], segments["xvec"], segments["custom"]
    npz = out / f"{icl.id}.{icl.hash[:16]}.npz"
    npz.write_bytes(npz.read_bytes()[:-100])  # truncated
    (out / f"{xvec.id}.{xvec.hash[:16]}.json").unlink()  # sidecar lost (crash between the writes)
    runner = start_runner(all_models(tiny))
    try:
        events = generate(runner, [icl, xvec, custom], out)
    finally:
        runner.close()
    results = by_segment(events, "result")
    assert results["icl"]["cached"] is False and results["xvec"]["cached"] is False
    assert results["custom"]["cached"] is True
    for seg in (icl, xvec):
        a, b = _result(first_run, seg), read_result(out / f"{seg.id}.{seg.hash[:16]}.json")
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.ref_codes, b.ref_codes)
        assert np.array_equal(a.wav, b.wav)


def test_kill_9_mid_job_then_rerun_computes_only_the_missing(tiny, voices, tmp_path):
    v = voice(voices["good"])
    segs = [segment(f"k{i}", f"Sentence number {i}.", voice=v, decode={**DECODE, "max_new_tokens": 24})
            for i in range(3)]
    out = tmp_path / "killed"
    runner = start_runner(all_models(tiny))
    first = None
    try:
        for ev in runner.request("generate", timeout=300, segments=[s.to_job() for s in segs], out_dir=str(out),
                                 concurrency=1):
            if ev["event"] == "result":
                first = ev
                runner.kill()  # SIGKILL to the runner's process group
                break
        with pytest.raises(RunnerDied):
            list(runner.request("generate", segments=[], out_dir=str(out)))
    finally:
        runner.kill()
    assert first is not None and first["segment"] == "k0"
    done_before = {p.name.split(".")[0] for p in out.glob("*.json")}
    assert "k0" in done_before and len(done_before) < 3
    sidecar_before = (out / f"k0.{segs[0].hash[:16]}.json").read_bytes()

    runner = start_runner(all_models(tiny))
    try:
        events = generate(runner, segs, out)
    finally:
        runner.close()
    results = by_segment(events, "result")
    assert set(results) == {"k0", "k1", "k2"}
    assert {sid for sid, e in results.items() if e["cached"]} == done_before
    assert (out / f"k0.{segs[0].hash[:16]}.json").read_bytes() == sidecar_before  # not rewritten
    for s in segs:
        assert read_result(out / f"{s.id}.{s.hash[:16]}.json").codes.shape == (23, 16)
    assert not list(out.glob("*.tmp"))


def test_concurrency_other_than_1_is_refused(tiny, segments, tmp_path):
    runner = start_runner([str(tiny / "base")])
    try:
        events = generate(runner, [segments["icl"]], tmp_path, concurrency=4)
    finally:
        runner.close()
    err = by_segment(events, "error")["icl"]
    assert err["kind"] == "bad_input" and "concurrency 1" in err["message"]


def test_waves_are_decoded_as_batches_codes_only(first_run, tiny, segments, voices, tmp_path):
    """The measured null at N: a wave through one batched qwen-tts call, codes only (no vocoder). In
    float32 qwen-tts batched is qwen-tts alone, code for code (the null's own batch noise is none);
    a wave qwen-tts cannot batch (other decode parameters, sampling) is refused, naming the wave."""
    sampled = segment("hot", "Sampled.", voice=voice(voices["good"]), decode={**DECODE, "do_sample": True})
    runner = start_runner([str(tiny / "base")])
    try:
        assert runner.hello["generate_waves"] and runner.hello["generate_codes_only"]
        alone = generate(runner, [segments["icl"]], tmp_path / "alone", codes_only=True)
        pair = [segments["icl"], segments["xvec"]]
        batched = generate(runner, pair, tmp_path / "batched", codes_only=True, waves=[["icl", "xvec"]])
        again = generate(runner, pair, tmp_path / "batched", codes_only=True, waves=[["icl", "xvec"]])
        mixed = generate(runner, [segments["icl"], segments["icl2"]], tmp_path / "mixed", waves=[["icl", "icl2"]])
        hot = generate(runner, [segments["icl"], sampled], tmp_path / "hot", waves=[["icl", "hot"]])
        partial = generate(runner, pair, tmp_path / "partial", waves=[["icl"]])
    finally:
        runner.close()
    one = read_result(by_segment(alone, "result")["icl"]["path"])
    assert one.wav.size == 0 and one.meta["codes_only"] and one.meta["concurrency"] == 1
    assert np.array_equal(one.codes, _result(first_run, segments["icl"]).codes)  # the full decode's codes
    got = by_segment(batched, "result")
    assert set(got) == {"icl", "xvec"} and not any(e["cached"] for e in got.values())
    for sid in ("icl", "xvec"):
        r = read_result(got[sid]["path"])
        assert r.meta["batch"] == ["icl", "xvec"] and r.meta["concurrency"] == 2 and r.wav.size == 0
        assert np.array_equal(r.codes, _result(first_run, segments[sid]).codes), sid
        assert np.array_equal(r.ref_codes, _result(first_run, segments[sid]).ref_codes), sid
    assert all(e["cached"] for e in by_segment(again, "result").values())
    for events, why in ((mixed, "share its task and decode parameters"), (hot, "must be greedy"),
                        (partial, "every segment once")):
        errs = by_segment(events, "error")
        assert errs and all(e["kind"] == "bad_input" and why in e["message"] for e in errs.values()), events
        assert not by_segment(events, "result")


def test_checkpoint_without_weights_is_refused_at_start(tiny, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny / "base", broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(RunnerDied) as info:
        start_runner([str(broken)])
    assert "exited with status 2" in str(info.value)
    assert "model.safetensors" in info.value.tail and str(broken) in info.value.tail

