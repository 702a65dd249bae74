"""The CPU test engine's torch-free parts: the hand-off, the scheduler, request validation, and the
HTTP surface with a stand-in for the model (tests/test_cpu_engine.py runs the real one)."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from difftest.engines.speech_client import SpeechClient, SpeechError
from difftest.suites import wavio
from runners.cpu_engine import ENGINE_NAME, LABEL, handoff
from runners.cpu_engine.api import BadRequest, ModelInfo, VoiceStore, parse_speech, parse_voice_upload
from runners.cpu_engine.defects import DEFECTS, check
from runners.cpu_engine.scheduler import WAVE_GUARD_S, Batcher
from runners.cpu_engine.server import EngineServer

SR = 24000
MODELS = {
    "voice_clone": ModelInfo("voice_clone", frozenset({"auto", "english", "german"}), frozenset()),
    "custom_voice": ModelInfo("custom_voice", frozenset({"auto", "english"}), frozenset({"alice", "bob"})),
    "voice_design": ModelInfo("voice_design", frozenset({"auto", "english"}), frozenset()),
}


def codes(n: int, base: int) -> np.ndarray:
    return (np.arange(n * 16, dtype=np.int64).reshape(n, 16) + base) % 2048


def wav_bytes(seconds=0.5, sr=SR, channels=1, subtype="pcm16", bits=16) -> bytes:
    x = (0.3 * np.sin(np.arange(int(seconds * sr)) / 7.0)).astype(np.float32)
    data = wavio.encode(x, sr, subtype)
    if channels > 1:  # rewrite the header for more channels (same bytes: 1/channels as many frames)
        data = data[:22] + channels.to_bytes(2, "little") + data[24:28] + (sr * 2 * channels).to_bytes(4, "little") \
            + (2 * channels).to_bytes(2, "little") + data[34:]
    if bits == 8:  # 8-bit unsigned PCM: one byte a sample
        body = bytes(np.clip(np.rint(x * 127 + 128), 0, 255).astype(np.uint8))
        data = (data[:28] + sr.to_bytes(4, "little") + (1).to_bytes(2, "little") + (8).to_bytes(2, "little")
                + data[36:40] + len(body).to_bytes(4, "little") + body)
        data = data[:4] + (len(data) - 8).to_bytes(4, "little") + data[8:]
    return data


def data_url(data: bytes) -> str:
    return "data:audio/wav;base64," + base64.b64encode(data).decode()


# -- the hand-off ---------------------------------------------------------
def test_clean_handoff_keeps_each_request_its_own_reference():
    c = [codes(3, 0), codes(5, 100), codes(2, 200)]
    refs = [codes(4, 1000), None, codes(6, 1500)]
    payload = handoff.make_omni_output(c, refs)
    assert payload["codes.audio"].shape == (10, 16)
    assert [r.shape[0] for r in payload["codes.ref"]] == [4, 0, 6]  # batch-aligned, empty placeholder (#4373)
    for i in range(3):
        el = handoff.to_payload_element(payload, i)
        np.testing.assert_array_equal(el["codes.audio"], c[i])
        stage = handoff.talker2code2wav(el)
        want_ref = refs[i] if refs[i] is not None else np.zeros((0, 16), np.int64)
        np.testing.assert_array_equal(stage["ref_codes"], want_ref)
        np.testing.assert_array_equal(stage["decoder_input"], np.concatenate([want_ref, c[i]]))
        assert stage["meta.left_context_size"] == want_ref.shape[0]


def test_ref_leak_hands_the_last_writers_reference_to_every_request():
    c = [codes(3, 0), codes(3, 100), codes(3, 200)]
    refs = [codes(4, 1000), None, codes(6, 1500)]
    payload = handoff.make_omni_output(c, refs, ref_leak=True)
    assert len(payload["codes.ref"]) == 1  # one slot, last writer wins
    for i in range(3):  # the element[0] fallback: everyone gets request 2's reference, even request 1
        stage = handoff.talker2code2wav(handoff.to_payload_element(payload, i))
        np.testing.assert_array_equal(stage["ref_codes"], refs[2])
        np.testing.assert_array_equal(stage["codes"], c[i])  # the codes are still right
    alone = handoff.make_omni_output([c[0]], [refs[0]], ref_leak=True)  # concurrency 1: its own
    np.testing.assert_array_equal(handoff.talker2code2wav(handoff.to_payload_element(alone, 0))["ref_codes"], refs[0])


def test_pick_is_vllm_omnis_lookup_with_its_fallback():
    assert handoff.pick(["a", "b"], 1) == "b"
    assert handoff.pick(["a"], 3) == "a"
    assert handoff.pick([], 0) is None


def test_batch_mixup_gives_everyone_request_zeros_codes():
    c = [codes(3, 0), codes(5, 100)]
    refs = [codes(2, 1000), codes(4, 1500)]
    payload = handoff.make_omni_output(c, refs)
    el = handoff.to_payload_element(payload, 1, batch_mixup=True)
    np.testing.assert_array_equal(el["codes.audio"], c[0])
    np.testing.assert_array_equal(el["codes.ref"], refs[1])


def test_off_by_one_and_untrimmed_reference():
    payload = handoff.make_omni_output([codes(5, 0), codes(5, 9)], [codes(2, 1000), codes(2, 1000)],
                                       stopped_at_max=[True, False])
    dropped = handoff.talker2code2wav(handoff.to_payload_element(payload, 0), drop_last_at_max=True)
    kept = handoff.talker2code2wav(handoff.to_payload_element(payload, 1), drop_last_at_max=True)
    assert dropped["codes"].shape[0] == 4 and kept["codes"].shape[0] == 5  # only a max-length stop loses a frame
    lost = handoff.talker2code2wav(handoff.to_payload_element(payload, 0), trim_key="meta.ref_code_len")
    assert "meta.left_context_size" not in lost  # the vocoder finds no trim (#4421)


def test_trim_uses_qwen_tts_float_cut():
    wav = np.arange(49 * 1920, dtype=np.float32)
    assert handoff.trim_reference(wav, 1, 49).shape[0] == 48 * 1920 + 1  # int(1/49*94080) = 1919
    assert handoff.trim_reference(wav, 0, 49).shape[0] == 49 * 1920
    assert handoff.trim_reference(wav[: 10 * 1920], 4, 10)[0] == 4 * 1920


def test_defect_names():
    assert set(DEFECTS) == {"ref-leak", "shared-rng", "batch-mixup", "chunk-boundary", "ref-in-output", "off-by-one",
                            "prompt-truncated", "prompt-padded", "sampled-greedy", "codebook-shift",
                            "language-dropped", "streaming-layout", "temperature-ignored", "top-k-narrowed",
                            "top-k-ignored", "ref-audio-rate", "speaker-scaled", "speaker-leak", "text-word-dropped",
                            "prompt-embeds-scaled", "cobatch-blend", "prompt-row-moved", "talker-temperature-hot",
                            "talker-temperature-cold", "top-k-halved", "top-p-applied", "repetition-penalty-dropped",
                            "repetition-penalty-twice", "unprocessed-logits", "subtalker-temperature-hot"}
    assert check("none") is None and check(None) is None
    with pytest.raises(ValueError, match="unknown defect"):
        check("everything")


# -- the scheduler ----------------------------------------------------------
class Recorder:
    def __init__(self, delay=0.0, fail=None):
        self.batches, self.delay, self.fail = [], delay, fail

    def __call__(self, jobs):
        self.batches.append(list(jobs))
        time.sleep(self.delay)
        if self.fail and any(self.fail in j for j in jobs):
            raise RuntimeError(f"boom on {self.fail}")
        return [j.upper() for j in jobs]


def submit_all(b: Batcher, items):
    return [b.submit(job, key) for job, key in items]


def test_batches_compatible_requests_up_to_max_and_in_arrival_order():
    rec = Recorder()
    b = Batcher(rec, max_batch=3, window_s=0.2)
    pend = submit_all(b, [("a", 1), ("b", 1), ("x", 2), ("c", 1), ("d", 1), ("y", 2)])
    b.start()
    assert [p.wait(5) for p in pend] == ["A", "B", "X", "C", "D", "Y"]
    b.stop()
    assert rec.batches == [["a", "b", "c"], ["x", "y"], ["d"]]
    assert (pend[0].batch_size, pend[0].batch_index, pend[3].batch_index) == (3, 0, 2)


def test_a_request_with_no_key_runs_alone_and_the_window_waits_for_stragglers():
    rec = Recorder()
    # A window far longer than any delay a loaded machine adds; the batch closes when it is full.
    b = Batcher(rec, max_batch=2, window_s=120).start()
    p1 = b.submit("s1", None)
    p2 = b.submit("s2", None)
    first = b.submit("g1", "k")
    time.sleep(0.1)
    late = b.submit("g2", "k")  # after g1, within its window
    for p in (p1, p2, first, late):
        p.wait(5)
    b.stop()
    assert ["s1"] in rec.batches and ["s2"] in rec.batches and ["g1", "g2"] in rec.batches


def test_a_request_that_names_its_wave_closes_the_batch_when_the_wave_is_in():
    """X-Difftest-Wave: under a 120 s window, a wave of one runs at once and a wave of two as soon as
    its second request arrives (the waits below would time out if the window were waited out)."""
    rec = Recorder()
    b = Batcher(rec, max_batch=4, window_s=120).start()
    assert b.submit("alone", "k", wave=1).wait(60) == "ALONE"
    first = b.submit("w1", "k", wave=2)
    time.sleep(0.1)
    second = b.submit("w2", "k", wave=2)
    assert (first.wait(60), second.wait(60)) == ("W1", "W2")
    b.stop()
    assert rec.batches == [["alone"], ["w1", "w2"]] and first.batch_size == 2


def test_a_named_wave_waits_for_a_member_that_arrives_after_the_window():
    """On a loaded machine a wave-mate can arrive after the 50 ms window: a wave that names itself is
    batched whole however late its members come, and a wave of mixed keys closes each batch once
    every member is in (no wait for members held for the other key)."""
    rec = Recorder()
    b = Batcher(rec, max_batch=4, window_s=0.05).start()
    def submit(job, key, wave, wave_id):
        return b.submit(job, key, wave=wave, wave_id=wave_id)

    first = submit("w1", "k", 2, "a")
    time.sleep(0.5)  # ten windows
    second = submit("w2", "k", 2, "a")
    assert (first.wait(60), second.wait(60)) == ("W1", "W2")
    t0 = time.monotonic()
    mixed = [submit(f"m{i}", "k" if i % 2 else "j", 4, "b") for i in range(4)]
    assert [p.wait(60) for p in mixed] == ["M0", "M1", "M2", "M3"]
    b.settled("c")  # a member the server refused before it reached the batcher: the wave is still whole
    alone = submit("c2", "k", 2, "c")
    assert alone.wait(60) == "C2"
    b.stop()
    assert rec.batches[0] == ["w1", "w2"] and sorted(map(sorted, rec.batches[1:3])) == [["m0", "m2"], ["m1", "m3"]]
    assert rec.batches[3] == ["c2"]
    assert time.monotonic() - t0 < WAVE_GUARD_S  # no batch waited out the guard


def test_a_failing_batch_is_retried_one_by_one():
    rec = Recorder(fail="bad")
    b = Batcher(rec, max_batch=4, window_s=0.2)
    pend = submit_all(b, [("ok1", 1), ("bad", 1), ("ok2", 1)])
    b.start()
    assert pend[0].wait(5) == "OK1" and pend[2].wait(5) == "OK2"
    with pytest.raises(RuntimeError, match="boom on bad"):
        pend[1].wait(5)
    b.stop()
    assert rec.batches[0] == ["ok1", "bad", "ok2"] and ["bad"] in rec.batches


# -- request validation -------------------------------------------------------
@pytest.fixture
def store(tmp_path):
    s = VoiceStore(tmp_path / "voices")
    s.register("amy", wav_bytes(), "Hello there.")
    s.register("xv", wav_bytes(0.3), None)
    return s


def base_body(**kw):
    b = {"input": "Hi.", "task_type": "Base", "language": "English", "ref_audio": data_url(wav_bytes()),
         "ref_text": "Reference.", "seed": 3, "max_new_tokens": 12,
         "extra_params": {"difftest_tag": "t-1", "temperature": 0.0, "repetition_penalty": 1.0}}
    b.update(kw)
    return b


def test_parses_every_field_difftest_sends(store):
    job = parse_speech(base_body(non_streaming_mode=True), MODELS, store)
    assert (job.task, job.language, job.seed, job.max_new_tokens, job.do_sample) == ("voice_clone", "English", 3, 12, False)
    assert (job.repetition_penalty, job.non_streaming_mode, job.tag, job.ref_text) == (1.0, True, "t-1", "Reference.")
    assert job.voice_wav.read_bytes() == wav_bytes() and job.temperature is None
    sampled = parse_speech(base_body(extra_params={"temperature": 0.7, "top_k": 20, "top_p": 0.9,
                                                   "repetition_penalty": 1.05}), MODELS, store)
    assert (sampled.do_sample, sampled.temperature, sampled.top_k, sampled.top_p) == (True, 0.7, 20, 0.9)
    assert sampled.batch_key() is None and sampled.batch_key(share_sampled=True) is not None
    reg = parse_speech({"input": "Hi.", "task_type": "Base", "voice": "AMY"}, MODELS, store)
    assert (reg.voice_name, reg.ref_text, reg.xvector_only) == ("amy", "Hello there.", False)
    assert parse_speech({"input": "Hi.", "voice": "xv"}, MODELS, store).xvector_only  # uploaded without text
    cv = parse_speech({"input": "Hi.", "task_type": "CustomVoice", "voice": "Alice", "instructions": "Happy."},
                      MODELS, store)
    assert (cv.task, cv.speaker, cv.instructions, cv.non_streaming_mode) == ("custom_voice", "alice", "Happy.", True)
    vd = parse_speech({"input": "Hi.", "task_type": "VoiceDesign", "instructions": "Calm."}, MODELS, store)
    assert (vd.task, vd.instructions, vd.response_format) == ("voice_design", "Calm.", "wav")
    # greedy requests batch whatever their seeds; different decode parameters do not
    assert parse_speech(base_body(seed=9), MODELS, store).batch_key() == parse_speech(base_body(), MODELS,
                                                                                       store).batch_key()
    assert parse_speech(base_body(max_new_tokens=13), MODELS, store).batch_key() != parse_speech(
        base_body(), MODELS, store).batch_key()


@pytest.mark.parametrize("change, field", [
    ({"input": "  "}, "input"),
    ({"input": None}, "input"),
    ({"task_type": "Karaoke"}, "task_type"),
    ({"response_format": "mp3"}, "response_format"),
    ({"ref_audio": "data:audio/wav;base64,@@@not base64"}, "ref_audio"),
    ({"ref_audio": data_url(b"RIFF....WAVEnope")}, "ref_audio"),
    ({"ref_audio": data_url(wav_bytes(sr=96000))}, "ref_audio"),
    ({"ref_audio": data_url(wav_bytes(channels=3))}, "ref_audio"),
    ({"ref_audio": data_url(wav_bytes(bits=8))}, "ref_audio"),
    ({"ref_audio": data_url(wav_bytes(subtype="float"))}, "ref_audio"),
    ({"ref_audio": "https://example.com/a.wav"}, "ref_audio"),
    ({"ref_text": None}, "ref_text"),
    ({"language": "Klingon"}, "language"),
    ({"seed": -1}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"extra_params": {"difftest_tag": "../../etc/x"}}, "extra_params.difftest_tag"),
    ({"extra_params": {"top_p": 1.5}}, "extra_params.top_p"),
    ({"extra_params": []}, "extra_params"),
    ({"x_vector_only_mode": "yes"}, "x_vector_only_mode"),
    ({"stream": True}, "stream"),
])
def test_bad_fields_are_named(store, change, field):
    with pytest.raises(BadRequest) as e:
        parse_speech(base_body(**change), MODELS, store)
    assert e.value.field == field and e.value.status == 400


@pytest.mark.parametrize("data, message", [
    (wav_bytes(sr=96000), "ref_audio: is 96000 Hz; a reference voice is 8000-48000 Hz (the model's is 24000)"),
    (wav_bytes(channels=3), "ref_audio: has 3 channels; a reference voice is mono or stereo"),
    (wav_bytes(bits=8), "ref_audio: is 8-bit; use 16-bit PCM or better"),
])
def test_voices_outside_the_rule_are_refused_with_its_message(store, data, message):
    with pytest.raises(BadRequest) as e:
        parse_speech(base_body(ref_audio=data_url(data)), MODELS, store)
    assert (e.value.field, e.value.status, str(e.value)) == ("ref_audio", 400, message)


@pytest.mark.parametrize("sr, channels", [(16000, 1), (22050, 1), (44100, 1), (48000, 2), (24000, 2)])
def test_voices_at_other_rates_and_in_stereo_are_taken_as_uploaded(store, sr, channels):
    """qwen-tts reads the stored file itself (librosa: channel mean, soxr_hq to 24 kHz), so the
    engine stores the upload's bytes unchanged, whatever its rate and channels."""
    data = wav_bytes(sr=sr, channels=channels)
    job = parse_speech(base_body(ref_audio=data_url(data)), MODELS, store)
    assert job.voice_wav.read_bytes() == data
    assert job.voice_sha256 == hashlib.sha256(data).hexdigest()
    v = store.register("up", data, "Hello.")
    assert (v.sample_rate, v.channels, v.n_samples) == (sr, channels, int(0.5 * sr) // channels)
    assert v.seconds == pytest.approx(0.5 / channels, abs=1e-4)


def test_bad_voices_and_tasks_are_named(store):
    cases = [
        ({"input": "Hi.", "task_type": "Base", "voice": "nobody"}, "voice", "unknown voice 'nobody'"),
        ({"input": "Hi.", "task_type": "CustomVoice", "voice": "carol"}, "voice", "unknown speaker 'carol'"),
        ({"input": "Hi.", "task_type": "CustomVoice"}, "voice", "needs a speaker"),
        ({"input": "Hi.", "task_type": "VoiceDesign"}, "instructions", "needs instructions"),
        ({"input": "Hi.", "task_type": "Base"}, "ref_audio", "needs ref_audio or a registered voice"),
    ]
    for body, field, text in cases:
        with pytest.raises(BadRequest, match=text) as e:
            parse_speech(body, MODELS, store)
        assert e.value.field == field
    with pytest.raises(BadRequest, match="needs a custom_voice checkpoint") as e:
        parse_speech({"input": "Hi.", "task_type": "CustomVoice", "voice": "alice"},
                     {"voice_clone": MODELS["voice_clone"]}, store)
    assert e.value.field == "task_type"


def multipart(fields: dict, files: dict) -> tuple[str, bytes]:
    boundary = "XyZ123boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    for k, (fname, data) in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="{fname}"\r\n'
                     f'Content-Type: audio/wav\r\n\r\n'.encode() + data + b"\r\n")
    return f"multipart/form-data; boundary={boundary}", b"".join(parts) + f"--{boundary}--\r\n".encode()


def test_voice_upload_parsing():
    ctype, body = multipart({"name": "Amy", "consent": "true", "ref_text": "Hello."}, {"audio_sample": ("a.wav", wav_bytes())})
    form = parse_voice_upload(ctype, body)
    assert (form["name"], form["ref_text"], form["audio"]) == ("amy", "Hello.", wav_bytes())
    bad = [
        (({"name": "amy", "consent": "true"}, {}), "audio_sample"),
        (({"consent": "true"}, {"audio_sample": ("a.wav", wav_bytes())}), "name"),
        (({"name": "amy"}, {"audio_sample": ("a.wav", wav_bytes())}), "consent"),
        (({"name": "amy", "consent": "false"}, {"audio_sample": ("a.wav", wav_bytes())}), "consent"),
        (({"name": "a b/c", "consent": "true"}, {"audio_sample": ("a.wav", wav_bytes())}), "name"),
        (({"name": "amy", "consent": "true"}, {"audio_sample": ("a.wav", b"not a wav")}), "audio_sample"),
    ]
    for (fields, files), field in bad:
        with pytest.raises(BadRequest) as e:
            parse_voice_upload(*multipart(fields, files))
        assert e.value.field == field, (fields, e.value)
    # the voice rule (difftest/suites/voices.py), its message named by the field
    refused = [
        (wav_bytes(sr=96000), "is 96000 Hz; a reference voice is 8000-48000 Hz (the model's is 24000)"),
        (wav_bytes(channels=3), "has 3 channels; a reference voice is mono or stereo"),
        (wav_bytes(bits=8), "is 8-bit; use 16-bit PCM or better"),
    ]
    for data, message in refused:
        with pytest.raises(BadRequest) as e:
            parse_voice_upload(*multipart({"name": "amy", "consent": "true"}, {"audio_sample": ("a.wav", data)}))
        assert (e.value.field, str(e.value)) == ("audio_sample", f"audio_sample: {message}")
    # what users upload: another rate, stereo; kept byte for byte
    for data in (wav_bytes(sr=22050), wav_bytes(sr=48000, channels=2)):
        form = parse_voice_upload(*multipart({"name": "amy", "consent": "true"}, {"audio_sample": ("a.wav", data)}))
        assert form["audio"] == data
    with pytest.raises(BadRequest) as e:
        parse_voice_upload("application/json", b"{}")
    assert e.value.status == 415


def test_voice_upload_keeps_binary_audio_byte_for_byte():
    rng = np.random.default_rng(0)
    for i in range(5):
        head = wavio.encode(np.zeros(12000 + i, np.float32), SR, "pcm16")[:44]
        data = head + bytes(rng.choice([0, 10, 13, 45, 255], size=2 * (12000 + i)).astype(np.uint8))  # CR/LF-heavy
        assert parse_voice_upload(*multipart({"name": "a", "consent": "true"}, {"audio_sample": ("a.wav", data)}))[
            "audio"] == data


# -- the HTTP surface with a stand-in model ------------------------------------
@dataclass
class FakeOut:
    codes: np.ndarray
    ref_codes: np.ndarray
    wav: np.ndarray
    sample_rate: int = SR
    talker: dict = field(default_factory=dict)  # no talker stage: a capture of schema 1's content


def fake_execute(jobs):
    out = []
    for j in jobs:
        if "explode" in j.text:
            raise RuntimeError("the model exploded")
        n = j.max_new_tokens - 1
        wav = (0.5 * np.sin(np.arange(n * 1920) * (0.01 + 0.001 * len(j.text)))).astype(np.float32)
        ref = codes(3, 7) if j.task == "voice_clone" and not j.xvector_only else np.zeros((0, 16), np.int64)
        out.append(FakeOut(codes(n, len(j.text)), ref, wav))
    return out


@pytest.fixture
def fake_server(tmp_path, request):
    # indirect parametrisation: (max_batch, window_ms); a wave test closes batches by size, not by time
    max_batch, window_ms = getattr(request, "param", (8, 20))
    ident = {"engine": ENGINE_NAME, "label": LABEL, "defect": None, "models": {}}
    srv = EngineServer(fake_execute, MODELS, identity=ident, capture_dir=tmp_path / "capture", max_batch=max_batch,
                       batch_window_ms=window_ms, voices=VoiceStore(tmp_path / "voices")).start()
    yield srv
    srv.stop()


def post(url: str, path: str, body: bytes, ctype="application/json") -> tuple[int, dict, bytes]:
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, body=body, headers={"Content-Type": ctype})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), data


def test_http_errors_are_json_naming_the_field_and_the_server_goes_on(fake_server):
    url = fake_server.url
    cases = [
        (b"{not json", None, 400),
        (json.dumps({"task_type": "Base"}).encode(), "input", 400),
        (json.dumps(base_body(response_format="flac")).encode(), "response_format", 400),
        (json.dumps(base_body(task_type="Sing")).encode(), "task_type", 400),
        (json.dumps({"input": "Hi.", "task_type": "Base", "voice": "ghost"}).encode(), "voice", 400),
        (json.dumps(base_body(ref_audio="data:audio/wav;base64,!!")).encode(), "ref_audio", 400),
        (json.dumps(base_body(input="please explode")).encode(), None, 500),
    ]
    for body, field, status in cases:
        code, _, data = post(url, "/v1/audio/speech", body)
        err = json.loads(data)["error"]
        assert code == status and err["param"] == field and err["code"] == status, (body[:60], data)
        if field:
            assert err["message"].startswith(field)
    assert "the model exploded" in json.loads(post(url, "/v1/audio/speech",
                                                   json.dumps(base_body(input="explode"))
                                                   .encode())[2])["error"]["message"]
    assert post(url, "/v1/nothing", b"{}")[0] == 404
    assert SpeechClient(url).health()
    assert SpeechClient(url).speech(base_body()).audio[:4] == b"RIFF"


def test_http_capture_is_written_before_the_answer_and_matches_it(fake_server, tmp_path):
    client = SpeechClient(fake_server.url)
    for fmt in ("wav", "pcm"):
        tag = f"cap-{fmt}"
        ans = client.speech(base_body(response_format=fmt, extra_params={"difftest_tag": tag, "temperature": 0}))
        cap = tmp_path / "capture" / f"{tag}.npz"
        assert cap.exists()  # already there when the answer arrives
        with np.load(cap, allow_pickle=False) as z:
            assert z["codes"].shape == (11, 16) and z["codes"].dtype == np.int64
            assert z["ref_codes"].shape == (3, 16) and z["wav"].dtype == np.float32
            served = wavio.read(ans.audio)[0] if fmt == "wav" else np.frombuffer(ans.audio, "<i2") / 32768.0
            assert np.abs(np.rint(served * 32768) - wavio.pcm16(z["wav"])).max() <= 1
        assert ans.headers["content-type"] == ("audio/wav" if fmt == "wav" else "audio/pcm")
    assert not list((tmp_path / "capture").glob("*.tmp")) and not list((tmp_path / "capture").glob(".*"))


@pytest.mark.parametrize("fake_server", [(4, 120_000)], indirect=True)  # the wave of 4 is one batch, however late
def test_http_voices_identity_and_concurrent_batching(fake_server):
    url = fake_server.url
    ctype, body = multipart({"name": "amy", "consent": "true", "ref_text": "Hello."},
                            {"audio_sample": ("a.wav", wav_bytes())})
    code, _, data = post(url, "/v1/audio/voices", body, ctype)
    assert code == 200 and json.loads(data)["voice"]["mode"] == "icl"
    ctype, body = multipart({"name": "amy", "consent": "true"}, {})
    code, _, data = post(url, "/v1/audio/voices", body, ctype)
    assert code == 400 and json.loads(data)["error"]["param"] == "audio_sample"
    conn = http.client.HTTPConnection(*url.split("//")[1].split(":"))
    conn.request("GET", "/v1/audio/voices")
    voices = json.loads(conn.getresponse().read())
    assert "amy" in voices["voices"] and "alice" in voices["voices"]
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read()) == {"status": "healthy", "engine": ENGINE_NAME, "defect": None}
    conn.request("GET", "/v1/engine")
    assert json.loads(conn.getresponse().read())["label"] == "difftest CPU test engine (not vLLM-Omni)"

    client = SpeechClient(url)
    barrier = threading.Barrier(4)
    answers = [None] * 4

    def one(i):
        barrier.wait()
        answers[i] = client.speech({"input": f"Hello number {i}.", "voice": "amy", "seed": 0, "max_new_tokens": 8,
                                    "extra_params": {"temperature": 0}})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sizes = [int(a.headers["x-difftest-batch-size"]) for a in answers]
    assert sizes == [4, 4, 4, 4] and sum(1 for a in answers if a.audio[:4] == b"RIFF") == 4
    with pytest.raises(SpeechError) as e:
        client.speech({"input": "Hi.", "voice": "amy", "response_format": "opus"})
    assert e.value.status == 400


@pytest.mark.parametrize("fake_server", [(4, 120_000)], indirect=True)
def test_the_wave_header_closes_a_batch_under_a_long_window(fake_server):
    """Over HTTP, as difftest's runner sends it: with a 120 s window, a request alone in its wave and a
    wave of two are answered at once (a client timeout of 60 s would expire if the window were waited
    out); a header that is no count is ignored, not an error."""
    from runners.cpu_engine.server import _wave

    client = SpeechClient(fake_server.url, timeout=60)
    body = {"input": "Hi.", "voice": "alice", "seed": 0, "max_new_tokens": 4, "extra_params": {"temperature": 0}}
    assert client.speech(body, {"X-Difftest-Wave": "1"}).headers["x-difftest-batch-size"] == "1"
    answers = [None, None]
    barrier = threading.Barrier(2)

    def one(i):
        barrier.wait()
        answers[i] = client.speech({**body, "input": f"Hi {i}."}, {"X-Difftest-Wave": "2"})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [a.headers["x-difftest-batch-size"] for a in answers] == ["2", "2"]
    assert [_wave(v) for v in ("3", "3;ab", "0;ab", "-1", "x", None)] == [
        (3, None), (3, "ab"), (None, None), (None, None), (None, None), (None, None)]


def test_one_voice_rule_for_suites_the_reference_runner_and_the_engine(tmp_path):
    """difftest/suites/voices.py is the rule everywhere a voice enters: the same WAV is refused with
    the same words by a suite, by the reference runner, and by the CPU engine's speech API."""
    from difftest.errors import SuiteError
    from difftest.suites import wavio
    from difftest.suites.suite import load_suite
    from runners.cpu_engine.api import check_voice_wav
    from runners.reference.service import BadInput as RunnerBadInput
    from runners.reference.service import _check_voice_wav

    wav = tmp_path / "v.wav"
    wavio.write(wav, np.zeros(24000 * 61, np.float32), 24000, "pcm16")  # a minute and a second
    problem = "lasts 61.0 s; a reference voice may last at most 60 s"
    with pytest.raises(BadRequest, match=problem):
        check_voice_wav(wav.read_bytes(), "ref_audio")
    with pytest.raises(RunnerBadInput, match=problem):
        _check_voice_wav(wav, None)
    (tmp_path / "s.yaml").write_text("name: s\ndecode: {repetition_penalty: 1.0, max_new_tokens: 4, seed: 0}\n"
                                     "voices: [{id: v, wav: v.wav, transcript: hi}]\n"
                                     "segments: [{id: a, text: hi, voice: v}]\n")
    with pytest.raises(SuiteError, match=problem):
        load_suite(tmp_path / "s.yaml")


@pytest.mark.parametrize("defect,changed", [
    (None, {}),
    ("talker-temperature-hot", {"temperature": 1.0}), ("talker-temperature-cold", {"temperature": 0.8}),
    ("top-k-halved", {"top_k": 25}), ("top-p-applied", {"top_p": 0.8}), ("repetition-penalty-dropped", {"repetition_penalty": 1.0}),
    ("repetition-penalty-twice", {"repetition_penalty": 1.05 ** 2}),
    ("unprocessed-logits", {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}),
    ("subtalker-temperature-hot", {"subtalker_temperature": 1.0}),
])
def test_sampler_bank_defects_change_only_their_parameter(defect, changed, store):
    """Each planted sampler defect (issue #31) draws with exactly the alternative it stands for."""
    from runners.cpu_engine.engine import BatchEngine, SubtalkerSampling

    engine = BatchEngine({}, defect=defect, subtalker=SubtalkerSampling(do_sample=True), qwen=object())
    job = parse_speech(base_body(extra_params={"temperature": 0.9, "top_k": 50, "top_p": 1.0,
                                               "repetition_penalty": 1.05}), MODELS, store)
    clean = {"do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05,
             "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_k": 50, "subtalker_top_p": 1.0}
    got = engine._generate_kwargs(job)
    assert {k: got[k] for k in clean} == pytest.approx({**clean, **changed})


def test_the_talker_capture_keeps_what_its_mode_says():
    """--talker-capture: full keeps the talker's input and output, no-input drops every input_* array
    (the ingredient comparison then has nothing to compare), none keeps no talker array at all."""
    from runners.cpu_engine import held

    side = {"input_text_ids": np.arange(3), "input_speaker_embedding": np.ones(4), "talker_tokens": np.arange(5),
            "talker_ref_codes": np.zeros((0, 16)), "talker_prompt": np.array([0, 0, -1]),
            "input_prompt_embeds": np.ones((9, 4), np.float32), "input_prompt_dtype": np.array("float32")}
    assert held("full", side) == side
    assert sorted(held("no-input", side)) == ["talker_prompt", "talker_ref_codes", "talker_tokens"]
    assert held("none", side) == {}
    with pytest.raises(ValueError, match="'partial'"):
        held("partial", side)
