"""The CPU test engine as real processes on the tiny checkpoints, with the real qwen-tts.

Three processes for the whole module, started together (importing qwen-tts costs
seconds each): the clean engine through its own command line
(`python -m runners.cpu_engine`), one process serving the six planted defects
(`python -m runners.cpu_engine.multi`, one listener each, the same server and
engine code), and the reference runner (qwen-tts one at a time), which the clean
engine must match. All are killed with their process groups at the end, also on
failure. Without `.venv-reference` these tests fail and say how to make it.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
from reference_support import (
    REPO,
    all_models,
    by_segment,
    generate,
    reference_python,
    segment,
    start_runner,
    tiny,  # noqa: F401
    voice,
    write_voice,
)

from difftest.compare import align
from difftest.engines import capture
from difftest.engines.http import run_candidate
from difftest.engines.speech_client import SpeechClient, SpeechError, speech_request
from difftest.process.launcher import ServerProcess, free_port, free_ports
from difftest.results import read_result
from difftest.suites import wavio
from difftest.suites.suite import DECODE_DEFAULTS
from runners.cpu_engine import ENGINE_NAME, LABEL
from runners.cpu_engine.defects import DEFECTS
from runners.reference.checkpoint import open_checkpoint

VOICES = REPO / "cases" / "voices"
WINDOW_MS = 150  # wide enough that a barrier-released wave lands in one batch on a busy 2-core box
AUDIO_TOL = 1e-4  # batched vs single vocoder numerics (research: up to ~4.4e-5)
GREEDY = {**DECODE_DEFAULTS, "repetition_penalty": 1.05, "max_new_tokens": 16, "seed": 0}
SHORT = {**DECODE_DEFAULTS, "repetition_penalty": 1.0, "max_new_tokens": 12, "seed": 0}


def case_voice(name: str, mode: str = "icl"):
    return voice(VOICES / f"{name}.wav", (VOICES / f"{name}.txt").read_text(encoding="utf-8").strip(),
                 mode=mode, vid=name)


# Eight voice clones for the concurrency-8 wave: in-context and x-vector mixed, several languages.
WAVE = [
    ("c1", "Good morning, how are you today?", "English", "alba", "icl"),
    ("c2", "The weather is lovely this afternoon.", "English", "bruno", "icl"),
    ("c3", "Guten Morgen, wie geht es dir?", "German", "chloe", "icl"),
    ("c4", "Thank you, see you tomorrow.", "English", "dario", "xvector"),
    ("c5", "Where is the train station, please?", "English", "elena", "icl"),
    ("c6", "Numbers like 42 and 7 are fine.", "Auto", "fabio", "icl"),
    ("c7", "A short one.", "English", "greta", "icl"),
    ("c8", "The last of eight requests in this wave.", "English", "mei", "icl"),
]


def wave_segments():
    return [segment(sid, text, language=lang, decode=GREEDY, voice=case_voice(v, mode))
            for sid, text, lang, v, mode in WAVE]


def field_segments():
    """The other fields difftest sends: speakers, instructions, non_streaming_mode, sampling."""
    return [
        segment("cv", "Custom voice here.", task="custom_voice", speaker="Bob", instructions="Speak happily.",
                decode={**SHORT, "non_streaming_mode": False}),
        segment("vd", "Designed voice.", task="voice_design", instructions="A calm, low voice.", decode=SHORT),
        segment("smp", "Sampled with a seed.", voice=case_voice("alba"),
                decode={**SHORT, "do_sample": True, "temperature": 0.8, "top_k": 30, "top_p": 0.95,
                        "repetition_penalty": 1.05, "seed": 1234}),
        segment("smp_cv", "Sampled custom voice.", task="custom_voice", speaker="alice",
                decode={**SHORT, "do_sample": True, "repetition_penalty": 1.05, "seed": 77}),
    ]


def resampled_segments():
    """Voices as users upload them (cases/suites/resampled.yaml): 48 kHz stereo, in-context and
    x-vector. qwen-tts reads the file itself in both the engine and the reference runner."""
    return [
        segment("rs48s", "Good morning, how are you today?", decode=GREEDY, voice=case_voice("greta-48k-stereo")),
        segment("rs48s_x", "Thank you, see you tomorrow.", decode=GREEDY,
                voice=case_voice("greta-48k-stereo", "xvector")),
    ]


def bad_voices(tmp_path: Path) -> dict[str, tuple[bytes, str]]:
    """Voices outside the rule (difftest/suites/voices.py): the bytes and the rule's message."""
    x = wavio.encode(0.3 * np.sin(np.arange(9600) / 7.0).astype(np.float32), 24000, "pcm16")
    # the same 19200 bytes as 3 channels: 3200 frames of 6 bytes
    three = (x[:22] + (3).to_bytes(2, "little") + x[24:28] + (24000 * 6).to_bytes(4, "little")
             + (6).to_bytes(2, "little") + x[34:])
    body = bytes(np.arange(4800, dtype=np.int64) % 200 + 28)  # 8-bit PCM is unsigned, one byte a sample
    eight = x[:28] + (24000).to_bytes(4, "little") + (1).to_bytes(2, "little") + (8).to_bytes(2, "little") \
        + x[36:40] + len(body).to_bytes(4, "little") + body
    return {
        "96k": (write_voice(tmp_path / "96k.wav", 1.0, sr=96000).read_bytes(),
                "is 96000 Hz; a reference voice is 8000-48000 Hz (the model's is 24000)"),
        "3ch": (three, "has 3 channels; a reference voice is mono or stereo"),
        "8bit": (eight, "is 8-bit; use 16-bit PCM or better"),
    }


# -- the processes ---------------------------------------------------------
@dataclass
class World:
    clean: ServerProcess
    defect_urls: dict
    capture: Path
    runner: object
    reference: dict = field(default_factory=dict)  # segment id -> Result (qwen-tts, one at a time)
    log_dir: Path | None = None

    @property
    def url(self) -> str:
        return self.clean.url


@pytest.fixture(scope="module")
def world(tiny, tmp_path_factory):
    python = str(reference_python())
    d = tmp_path_factory.mktemp("cpu-engine")
    capture = d / "capture"
    models = all_models(tiny)
    model_args = [a for m in models for a in ("--model", m)]
    env = dict(os.environ, DIFFTEST_CAPTURE_DIR=str(capture), HF_HUB_OFFLINE="1",
               DIFFTEST_CPU_ENGINE_FAIL_ON="FAIL-ME")
    clean_port, *others = free_ports(len(DEFECTS) + 1)
    clean = ServerProcess([python, "-m", "runners.cpu_engine", "--port", str(clean_port),
                           "--batch-window-ms", str(WINDOW_MS), *model_args],
                          f"http://127.0.0.1:{clean_port}", d / "clean.log", env=env, cwd=REPO,
                          health_timeout=300, name="the clean CPU engine")
    ports = dict(zip(DEFECTS, others))
    multi = ServerProcess([python, "-m", "runners.cpu_engine.multi", "--batch-window-ms", str(WINDOW_MS),
                           *model_args, *[a for n, p in ports.items() for a in ("--serve", f"{n}={p}")]],
                          f"http://127.0.0.1:{ports['off-by-one']}", d / "defects.log", env=env, cwd=REPO,
                          health_timeout=300, name="the defect engines")
    runner = None
    segs = wave_segments() + field_segments() + resampled_segments()
    ref_out = d / "reference"
    started = []
    try:
        runner = start_runner(models, log_path=d / "reference.log")
        ref_events = {}
        ref_thread = threading.Thread(target=lambda: ref_events.update(
            by_segment(generate(runner, segs, ref_out), "result")), daemon=True)
        ref_thread.start()  # qwen-tts generates the references while the engines load
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(p.start) for p in (clean, multi)]
            for p, f in zip((clean, multi), futs):
                f.result()
                started.append(p)
        ref_thread.join(600)
        missing = [s.id for s in segs if s.id not in ref_events]
        assert not missing, f"the reference runner gave no result for {missing}: {runner.log_tail()}"
        w = World(clean, {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}, capture, runner,
                  {sid: read_result(e["path"]) for sid, e in ref_events.items()}, d)
        yield w
    finally:
        for p in (clean, multi):
            p.stop()
        if runner is not None:
            runner.kill()


# -- helpers ------------------------------------------------------------------
@dataclass
class Served:
    wav: np.ndarray  # what came over HTTP
    headers: dict
    cap: dict  # the capture file: codes, ref_codes, wav

    @property
    def batch(self) -> tuple[int, int, int]:
        h = self.headers
        return int(h["x-difftest-batch-id"]), int(h["x-difftest-batch-size"]), int(h["x-difftest-batch-index"])


def load_capture(capture: Path, tag: str) -> dict:
    path = capture / f"{tag}.npz"
    assert path.exists(), f"no capture for {tag}: it must be written before the answer"
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def send(url: str, capture: Path, seg, tag: str, **kw) -> Served:
    ans = SpeechClient(url, timeout=300).speech(speech_request(seg, tag, **kw))
    if kw.get("response_format") == "pcm":
        wav = np.frombuffer(ans.audio, "<i2").astype(np.float32) / 32768.0
    else:
        wav, info = wavio.read(ans.audio)
        assert (info.sample_rate, info.channels, info.bits, info.format) == (24000, 1, 16, "pcm")
    return Served(wav, ans.headers, load_capture(capture, tag))


def wave(url: str, capture: Path, segs, prefix: str, **kw) -> dict[str, Served]:
    """All segments at once (released by a barrier): concurrency len(segs)."""
    barrier = threading.Barrier(len(segs))

    def one(seg):
        barrier.wait()
        return send(url, capture, seg, f"{prefix}-{seg.id}", **kw)

    with ThreadPoolExecutor(len(segs)) as ex:
        return dict(zip([s.id for s in segs], ex.map(one, segs)))


def one_at_a_time(url: str, capture: Path, segs, prefix: str, **kw) -> dict[str, Served]:
    return {s.id: send(url, capture, s, f"{prefix}-{s.id}", **kw) for s in segs}


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, f"lengths differ: {a.shape} vs {b.shape}"
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.size else 0.0


def assert_served_is_capture(s: Served):
    """The HTTP audio is the captured float waveform, 16-bit quantised: within 1 LSB."""
    served = np.rint(s.wav.astype(np.float64) * 32768)
    assert served.shape == s.cap["wav"].shape
    assert np.abs(served - wavio.pcm16(s.cap["wav"])).max() <= 1


def assert_matches_reference(s: Served, ref, tol: float = AUDIO_TOL) -> float:
    np.testing.assert_array_equal(s.cap["codes"], ref.codes)
    np.testing.assert_array_equal(s.cap["ref_codes"], ref.ref_codes)
    d = max_diff(s.cap["wav"], ref.wav)
    assert d <= tol, f"audio differs from qwen-tts by {d:.2e}"
    assert_served_is_capture(s)
    return d


def batches(served: dict[str, Served]) -> dict[int, list[str]]:
    """Batch id -> segment ids in batch order, from the engine's headers."""
    out: dict[int, list] = {}
    for sid, s in served.items():
        bid, _, idx = s.batch
        out.setdefault(bid, []).append((idx, sid))
    return {b: [sid for _, sid in sorted(v)] for b, v in out.items()}


def get_json(url: str, path: str) -> tuple[int, dict]:
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", path)
    r = conn.getresponse()
    data = json.loads(r.read())
    conn.close()
    return r.status, data


def post_raw(url: str, path: str, body: bytes, ctype: str) -> tuple[int, dict]:
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=body, headers={"Content-Type": ctype})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data)


# -- identity ------------------------------------------------------------------
def test_it_says_what_it_is(world, tiny):
    assert get_json(world.url, "/health") == (200, {"status": "healthy", "engine": ENGINE_NAME, "defect": None})
    _, ident = get_json(world.url, "/v1/engine")
    assert ident["label"] == LABEL == "difftest CPU test engine (not vLLM-Omni)" and ident["not_vllm_omni"] is True
    assert ident["versions"]["qwen-tts"] == "0.1.1" and ident["defect"] is None
    assert ident["models"]["voice_clone"]["sha256"] == open_checkpoint(str(tiny / "base")).sha256
    assert ident["vocoder"] == {"chunk_frames": 300, "left_context_frames": 25}
    assert "difftest CPU test engine (not vLLM-Omni)" in world.clean.log_path.read_text()
    for name, url in world.defect_urls.items():
        assert get_json(url, "/health")[1] == {"status": "healthy", "engine": ENGINE_NAME, "defect": name}
        info = get_json(url, "/v1/engine")[1]["defect_info"]
        assert info["name"] == name and info["family"]
    assert get_json(world.defect_urls["chunk-boundary"], "/v1/engine")[1]["vocoder"]["left_context_frames"] == 4


# -- the clean engine against qwen-tts ------------------------------------------------
def test_clean_engine_at_concurrency_8_matches_qwen_tts_one_at_a_time(world, capsys):
    segs = wave_segments()
    at8 = wave(world.url, world.capture, segs, "n8")
    at1 = one_at_a_time(world.url, world.capture, segs, "n1")
    d8 = [assert_matches_reference(at8[s.id], world.reference[s.id]) for s in segs]
    d1 = [assert_matches_reference(at1[s.id], world.reference[s.id]) for s in segs]
    sizes8 = sorted({(b, len(ids)) for b, ids in batches(at8).items()})
    assert max(n for _, n in sizes8) >= 4, f"the wave was not batched: {sizes8}"
    assert all(s.batch[1] == 1 for s in at1.values())
    with capsys.disabled():
        print(f"\n[cpu-engine] clean c=8 batches {[n for _, n in sizes8]}: codes equal qwen-tts; max |audio diff| "
              f"{max(d8):.2e} (c=8), {max(d1):.2e} (c=1)")


def test_every_field_difftest_sends(world):
    segs = {s.id: s for s in field_segments()}
    body = speech_request(segs["smp"], "x")
    assert body["extra_params"] == {"difftest_tag": "x", "repetition_penalty": 1.05, "temperature": 0.8,
                                    "top_k": 30, "top_p": 0.95}
    assert {"ref_audio", "ref_text", "seed", "max_new_tokens", "language", "task_type"} <= set(body)
    body = speech_request(segs["cv"], "x")
    assert (body["voice"], body["instructions"], body["non_streaming_mode"]) == ("Bob", "Speak happily.", False)
    # all at once: different tasks never share a batch; sampled requests run alone with their own seed
    served = wave(world.url, world.capture, list(segs.values()), "fields")
    for sid, s in served.items():
        assert_matches_reference(s, world.reference[sid])
    assert all(s.batch[1] == 1 for sid, s in served.items() if sid.startswith("smp"))
    pcm = send(world.url, world.capture, segs["vd"], "fields-pcm", response_format="pcm")
    assert_matches_reference(pcm, world.reference["vd"])
    x = send(world.url, world.capture, wave_segments()[3], "fields-xvec")  # x_vector_only_mode
    assert x.cap["ref_codes"].shape == (0, 16)
    assert_matches_reference(x, world.reference["c4"])


def test_registered_voices_serve_what_inline_voices_serve(world):
    client = SpeechClient(world.url)
    icl, xvec = wave_segments()[0], wave_segments()[3]
    names = [client.register_voice(icl.voice), client.register_voice(xvec.voice)]
    _, listed = get_json(world.url, "/v1/audio/voices")
    assert set(names) <= set(listed["voices"])
    modes = {v["name"]: v["mode"] for v in listed["uploaded_voices"]}
    assert [modes[n] for n in names] == ["icl", "xvector"]
    for seg in (icl, xvec):
        s = send(world.url, world.capture, seg, f"reg-{seg.id}", voice_mode="registered")
        assert_matches_reference(s, world.reference[seg.id])


def test_a_48_khz_stereo_voice_gets_qwen_tts_s_reference_codes(world):
    """A voice as users upload it (48 kHz stereo): the engine hands the file to qwen-tts as the
    reference runner does, which mixes it down (channel mean) and resamples it with librosa's
    soxr_hq: the same reference codes, generated codes and audio, inline and registered. 115200
    frames at 48 kHz are 57600 samples at 24 kHz, 30 reference frames (read as 24 kHz: 60)."""
    icl, xvec = resampled_segments()
    assert (VOICES / "greta-48k-stereo.wav").read_bytes()[22:28] == (2).to_bytes(2, "little") + (48000).to_bytes(
        4, "little")
    ref = world.reference["rs48s"]
    assert ref.ref_codes.shape == (30, 16)
    SpeechClient(world.url).register_voice(icl.voice)
    for mode in ("inline", "registered"):
        s = send(world.url, world.capture, icl, f"rs48s-{mode}", voice_mode=mode)
        assert s.cap["ref_codes"].shape == (30, 16)
        assert_matches_reference(s, ref)
    x = send(world.url, world.capture, xvec, "rs48s-x")
    assert x.cap["ref_codes"].shape == (0, 16)
    assert_matches_reference(x, world.reference["rs48s_x"])


def test_bad_uploads_are_refused_with_the_field_named(world, tmp_path):
    boundary = "b0undary"

    def form(fields: dict, audio: bytes | None) -> bytes:
        parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
                 for k, v in fields.items()]
        if audio is not None:
            parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="audio_sample"; filename="v.wav"\r\n'
                         f'Content-Type: audio/wav\r\n\r\n'.encode() + audio + b"\r\n")
        return b"".join(parts) + f"--{boundary}--\r\n".encode()

    good = (VOICES / "alba.wav").read_bytes()
    cases = [
        (form({"name": "v1", "consent": "true"}, None), "audio_sample"),
        (form({"name": "v1", "consent": "true"}, b"RIFF1234WAVEjunk"), "audio_sample"),
        (form({"name": "v1", "consent": "true"}, good[: len(good) // 2] + b"x"), "audio_sample"),
        (form({"consent": "true"}, good), "name"),
        (form({"name": "v1"}, good), "consent"),
    ]
    for body, param in cases:
        status, err = post_raw(world.url, "/v1/audio/voices", body, f"multipart/form-data; boundary={boundary}")
        assert (status, err["error"]["param"]) == (400, param), err
    for data, message in bad_voices(tmp_path).values():  # the voice rule's refusals, its message sent back
        body = form({"name": "v1", "consent": "true"}, data)
        status, err = post_raw(world.url, "/v1/audio/voices", body, f"multipart/form-data; boundary={boundary}")
        assert (status, err["error"]["param"], err["error"]["message"]) == (400, "audio_sample",
                                                                             f"audio_sample: {message}"), err
    status, err = post_raw(world.url, "/v1/audio/voices", b"{}", "application/json")
    assert status == 415
    assert get_json(world.url, "/health")[0] == 200


def test_bad_requests_get_a_4xx_naming_the_field(world, tmp_path):
    seg = wave_segments()[0]
    ok = speech_request(seg, "bad-ok")
    bad = bad_voices(tmp_path)

    def url_of(b: bytes) -> str:
        return "data:audio/wav;base64," + base64.b64encode(b).decode()

    cases = [
        ({**ok, "ref_audio": None, "voice": "never-registered"}, "voice"),
        ({k: v for k, v in ok.items() if k != "input"}, "input"),
        ({**ok, "ref_audio": "data:audio/wav;base64,%%%not-base64%%%"}, "ref_audio"),
        ({**ok, "response_format": "mp3"}, "response_format"),
        ({**ok, "task_type": "Whisper"}, "task_type"),
        ({**ok, "ref_audio": url_of(bad["96k"][0])}, "ref_audio"),
        ({**ok, "ref_audio": url_of(bad["3ch"][0])}, "ref_audio"),
        ({**ok, "ref_audio": url_of(bad["8bit"][0])}, "ref_audio"),
        ({**ok, "language": "Klingon"}, "language"),
        ({**ok, "max_new_tokens": -3}, "max_new_tokens"),
        ({**ok, "extra_params": {"difftest_tag": "../escape"}}, "extra_params.difftest_tag"),
        ({"input": "Hi.", "task_type": "CustomVoice", "voice": "nobody", "max_new_tokens": 8, "seed": 0}, "voice"),
        ({"input": "Hi.", "task_type": "VoiceDesign", "max_new_tokens": 8, "seed": 0}, "instructions"),
    ]
    for body, param in cases:
        body = {k: v for k, v in body.items() if v is not None}
        status, err = post_raw(world.url, "/v1/audio/speech", json.dumps(body).encode(), "application/json")
        assert (status, err["error"]["param"]) == (400, param), err
        assert err["error"]["message"].startswith(param)
    for data, message in bad.values():  # the voice rule's own message
        body = json.dumps({**ok, "ref_audio": url_of(data)}).encode()
        status, err = post_raw(world.url, "/v1/audio/speech", body, "application/json")
        assert (status, err["error"]["message"]) == (400, f"ref_audio: {message}"), err
    status, err = post_raw(world.url, "/v1/audio/speech", b"{oops", "application/json")
    assert status == 400 and "JSON" in err["error"]["message"]
    assert not (world.capture / "bad-ok.npz").exists()
    # still serving
    assert_matches_reference(send(world.url, world.capture, seg, "bad-after"), world.reference["c1"])


def test_an_engine_error_is_a_500_and_only_for_that_request(world):
    segs = wave_segments()[:3]
    bad = replace(segs[1], text="Please FAIL-ME now.")
    outcomes = {}

    def one(seg, barrier=threading.Barrier(3)):
        barrier.wait()
        try:
            outcomes[seg.id] = send(world.url, world.capture, seg, f"err-{seg.id}")
        except SpeechError as e:
            outcomes[seg.id] = e

    with ThreadPoolExecutor(3) as ex:
        list(ex.map(one, [segs[0], bad, segs[2]]))
    err = outcomes["c2"]
    assert isinstance(err, SpeechError) and err.status == 500 and "injected engine failure" in str(err)
    for sid in ("c1", "c3"):
        assert_matches_reference(outcomes[sid], world.reference[sid])
    assert get_json(world.url, "/health")[0] == 200


def test_run_candidate_reads_the_engine_and_its_captures(world, tmp_path):
    segs = wave_segments()[:4]
    out = run_candidate(segs, SpeechClient(world.url), tmp_path / "cand", concurrency=4, pattern="pool",
                        voice_mode="registered", capture_dir=world.capture, label="cpu-engine", run_tag="rc")
    assert not out.errors and set(out.results) == {s.id for s in segs}
    for s in segs:
        r, ref = out.results[s.id], world.reference[s.id]
        assert r.has_codes and r.meta["capture"]
        np.testing.assert_array_equal(r.codes, ref.codes)
        np.testing.assert_array_equal(r.ref_codes, ref.ref_codes)
        assert max_diff(r.extra["capture_wav"], ref.wav) <= AUDIO_TOL
        assert np.abs(np.rint(r.wav * 32768) - wavio.pcm16(r.extra["capture_wav"])).max() <= 1


def test_capture_files_are_whole_and_typed(world):
    wave(world.url, world.capture, wave_segments()[:3], "typed")
    files = sorted(world.capture.glob("*.npz"))
    assert {f"typed-c{i}.npz" for i in (1, 2, 3)} <= {p.name for p in files}
    assert not [p for p in world.capture.iterdir() if p.suffix != ".npz"]  # no temp files left behind
    for p in files:
        with np.load(p, allow_pickle=False) as z:
            assert set(z.files) == {"codes", "ref_codes", "wav", "lead_samples", "schema_version",
                                    "talker_ref_codes", "talker_prompt", "talker_tokens", *capture.INPUT,
                                    *capture.PROMPT}  # the rows' labels are the reference's to give
            codes, ref, wav, lead = z["codes"], z["ref_codes"], z["wav"], int(z["lead_samples"])
            tokens = z["talker_tokens"]
            assert int(z["schema_version"]) == 3 and z["input_text_ids"].dtype == np.int64
            # a clone's prompt holds the encoder's reference codes and its x-vector, as qwen-tts's generate got them
            assert np.array_equal(z["input_ref_codes"].reshape(-1, 16), z["talker_ref_codes"])
            assert z["input_speaker_embedding"].dtype == np.float32
            if p.name.startswith("typed-"):  # this test's clones (the folder holds other tests' requests too)
                assert len(z["input_speaker_embedding"]) and str(z["input_speaker_dtype"]) == "float32"
                # the prompt as its talker got it, batched: qwen-tts's own rows for the request, bit for bit
                theirs = world.reference[p.name.removeprefix("typed-").removesuffix(".npz")].extra
                assert str(z["input_prompt_dtype"]) == "float32" and z["input_prompt_embeds"].dtype == np.float32
                assert np.array_equal(z["input_prompt_embeds"], theirs["input_prompt_embeds"]), p.name
        # the talker's side: every frame's codebook-0 token the vocoder got, then the final token
        assert tokens.tolist() == [*codes[:, 0].tolist(), 2150]
        assert codes.dtype == np.int64 and codes.ndim == 2 and codes.shape[1] == 16
        assert ref.dtype == np.int64 and ref.ndim == 2 and ref.shape[1] == 16
        assert wav.dtype == np.float32 and wav.ndim == 1
        # what the vocoder gave back for these codes, the reference part cut (qwen's cut may leave 1 sample)
        # or, from the ref-in-output engine, not cut
        t, r = codes.shape[0], ref.shape[0]
        assert wav.shape[0] in (t * 1920, t * 1920 + 1, (r + t) * 1920), (p.name, wav.shape, t, r)
        assert lead == (wav.shape[0] - t * 1920 if wav.shape[0] - t * 1920 in (0, 1) else 0)
        assert lead == (align.lead_samples(r, t) if wav.shape[0] <= t * 1920 + 1 else 0)


# -- the planted defects -----------------------------------------------------------
def defect_segments(decode=SHORT, seeds=None):
    specs = [("d1", "First of the wave.", "alba", "icl"), ("d2", "Second, without a reference.", "chloe", "xvector"),
             ("d3", "Third in line.", "elena", "icl"), ("d4", "Fourth and last writer.", "greta", "icl")]
    return [segment(sid, text, decode={**decode, "seed": seeds[i]} if seeds else decode, voice=case_voice(v, mode))
            for i, (sid, text, v, mode) in enumerate(specs)]


SAMPLED = {**SHORT, "do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0}
SEEDS = [11, 12, 13, 14]


@pytest.fixture(scope="module")
def baseline(world):
    """The clean engine, one request at a time (equal to qwen-tts: see the tests above)."""
    return {
        "greedy": one_at_a_time(world.url, world.capture, defect_segments(), "base"),
        "sampled": one_at_a_time(world.url, world.capture, defect_segments(SAMPLED, SEEDS), "base-smp"),
    }


def same_as(s: Served, b: Served, tol: float = AUDIO_TOL) -> bool:
    return (np.array_equal(s.cap["codes"], b.cap["codes"]) and np.array_equal(s.cap["ref_codes"], b.cap["ref_codes"])
            and s.cap["wav"].shape == b.cap["wav"].shape and max_diff(s.cap["wav"], b.cap["wav"]) <= tol)


def assert_invisible_at_1(world, name: str, base: dict, segs, prefix: str):
    at1 = one_at_a_time(world.defect_urls[name], world.capture, segs, prefix)
    for sid, s in at1.items():
        assert s.batch[1] == 1
        assert same_as(s, base[sid]), f"{name} at concurrency 1 changed {sid}"
        assert_served_is_capture(s)


def test_ref_leak_decodes_every_request_with_the_last_writers_reference(world, baseline):
    base, segs = baseline["greedy"], defect_segments()
    served = wave(world.defect_urls["ref-leak"], world.capture, segs, "leak4")
    multi = [ids for ids in batches(served).values() if len(ids) > 1]
    assert multi, "the wave was not batched; nothing to leak"
    leaked = 0
    for ids in batches(served).values():
        writers = [sid for sid in ids if base[sid].cap["ref_codes"].shape[0]]
        donor = writers[-1] if writers else None  # last writer wins
        for sid in ids:
            s, b = served[sid], base[sid]
            want_ref = base[donor].cap["ref_codes"] if donor else b.cap["ref_codes"]
            np.testing.assert_array_equal(s.cap["codes"], b.cap["codes"])  # the talker is untouched
            np.testing.assert_array_equal(s.cap["ref_codes"], want_ref)
            assert s.cap["wav"].shape == b.cap["wav"].shape  # same length: only the onset voice is wrong
            if sid == donor or donor is None:
                assert max_diff(s.cap["wav"], b.cap["wav"]) <= AUDIO_TOL
            else:
                assert max_diff(s.cap["wav"], b.cap["wav"]) > 1e-2
                leaked += 1
            assert_served_is_capture(s)
    assert leaked >= 1
    d2_batch = next(ids for ids in batches(served).values() if "d2" in ids)
    if len(d2_batch) > 1:  # the x-vector request has no reference of its own, and still gets one (#4370)
        assert served["d2"].cap["ref_codes"].shape[0] > 0
    assert_invisible_at_1(world, "ref-leak", base, segs, "leak1")


def test_batch_mixup_decodes_request_zeros_codes_for_everyone(world, baseline):
    base, segs = baseline["greedy"], defect_segments()
    served = wave(world.defect_urls["batch-mixup"], world.capture, segs, "mix4")
    assert any(len(ids) > 1 for ids in batches(served).values())
    for ids in batches(served).values():
        for sid in ids:
            s = served[sid]
            np.testing.assert_array_equal(s.cap["codes"], base[ids[0]].cap["codes"])
            np.testing.assert_array_equal(s.cap["ref_codes"], base[sid].cap["ref_codes"])  # its own reference
            if sid != ids[0]:
                assert not np.array_equal(base[sid].cap["codes"], base[ids[0]].cap["codes"])
    assert_invisible_at_1(world, "batch-mixup", base, segs, "mix1")


def test_shared_rng_changes_sampled_requests_at_concurrency_only(world, baseline):
    base = baseline["sampled"]
    segs = defect_segments(SAMPLED, SEEDS)
    clean4 = wave(world.url, world.capture, segs, "smp-clean4")  # clean: each sampled request alone, own seed
    for sid, s in clean4.items():
        assert s.batch[1] == 1 and same_as(s, base[sid])
    served = wave(world.defect_urls["shared-rng"], world.capture, segs, "rng4")
    together = [sid for ids in batches(served).values() if len(ids) > 1 for sid in ids]
    assert together, "the sampled wave was not batched"
    for sid, s in served.items():
        np.testing.assert_array_equal(s.cap["ref_codes"], base[sid].cap["ref_codes"])
        if sid in together:
            assert not np.array_equal(s.cap["codes"], base[sid].cap["codes"]), f"{sid} drew its own numbers"
    assert_invisible_at_1(world, "shared-rng", base, segs, "rng1")
    greedy = wave(world.defect_urls["shared-rng"], world.capture, defect_segments(), "rng-greedy4")
    for sid, s in greedy.items():  # greedy decoding draws nothing: unaffected at any concurrency
        assert same_as(s, baseline["greedy"][sid])


def test_ref_in_output_serves_the_reference_audio_too(world, baseline):
    base, segs = baseline["greedy"], defect_segments()
    served = one_at_a_time(world.defect_urls["ref-in-output"], world.capture, segs, "rio1")
    for sid, s in served.items():
        b = base[sid]
        np.testing.assert_array_equal(s.cap["codes"], b.cap["codes"])
        np.testing.assert_array_equal(s.cap["ref_codes"], b.cap["ref_codes"])
        r, t = b.cap["ref_codes"].shape[0], b.cap["codes"].shape[0]
        if r == 0:  # x-vector: nothing to trim, nothing wrong
            assert same_as(s, b)
            continue
        assert s.cap["wav"].shape[0] == (r + t) * 1920  # nothing cut
        assert max_diff(s.cap["wav"][-b.cap["wav"].shape[0]:], b.cap["wav"]) <= AUDIO_TOL  # the right speech, late
        assert_served_is_capture(s)


def test_off_by_one_drops_the_last_frame_at_a_max_length_stop(world, baseline):
    base, segs = baseline["greedy"], defect_segments()
    served = one_at_a_time(world.defect_urls["off-by-one"], world.capture, segs, "obo1")
    for sid, s in served.items():
        b = base[sid]
        r, t = b.cap["ref_codes"].shape[0], b.cap["codes"].shape[0]
        assert t == SHORT["max_new_tokens"] - 1  # the tiny model never emits EOS: every stop is at max length
        np.testing.assert_array_equal(s.cap["codes"], b.cap["codes"][:-1])
        np.testing.assert_array_equal(s.cap["ref_codes"], b.cap["ref_codes"])
        cut_b = int(r / (r + t) * ((r + t) * 1920)) if r else 0  # qwen-tts's float cut, both runs
        cut_d = int(r / (r + t - 1) * ((r + t - 1) * 1920)) if r else 0
        n = s.cap["wav"].shape[0]
        assert n == (r + t - 1) * 1920 - cut_d
        # the decoder is causal: the frames that are left sound as before
        assert max_diff(s.cap["wav"], b.cap["wav"][cut_d - cut_b: cut_d - cut_b + n]) <= AUDIO_TOL


def test_chunk_boundary_corrupts_audio_past_the_300_frame_chunk(world, baseline, tmp_path_factory):
    wav = write_voice(tmp_path_factory.mktemp("long") / "long.wav", 23.0, 180.0, seed=5)
    long_seg = segment("long", "A long reference leads into a short answer.",
                       decode={**SHORT, "max_new_tokens": 24}, voice=voice(wav, "This is the long reference.", vid="long"))
    clean = send(world.url, world.capture, long_seg, "cb-clean")
    bad = send(world.defect_urls["chunk-boundary"], world.capture, long_seg, "cb-defect")
    r, t = clean.cap["ref_codes"].shape[0], clean.cap["codes"].shape[0]
    assert r + t > 300 > r
    np.testing.assert_array_equal(bad.cap["codes"], clean.cap["codes"])
    np.testing.assert_array_equal(bad.cap["ref_codes"], clean.cap["ref_codes"])
    assert bad.cap["wav"].shape == clean.cap["wav"].shape
    boundary = (300 - r) * 1920 - 1  # first output sample of the second chunk (qwen's cut may be 1 short)
    assert max_diff(bad.cap["wav"][:boundary], clean.cap["wav"][:boundary]) <= AUDIO_TOL
    assert max_diff(bad.cap["wav"][boundary + 2:], clean.cap["wav"][boundary + 2:]) > 1e-3
    assert_served_is_capture(bad)
    # below one chunk there is no boundary: the short requests are untouched
    short = one_at_a_time(world.defect_urls["chunk-boundary"], world.capture, defect_segments()[:2], "cb-short")
    for sid, s in short.items():
        assert same_as(s, baseline["greedy"][sid])


def test_prompt_row_moved_moves_the_speaker_row_and_nothing_else(world, baseline):
    """Every ingredient the capture records is the clean engine's; the talker's prompt rows are, but for
    the speaker row (a clone's x-vector, a custom voice's speaker) after the codec pad row; a designed
    voice has no speaker row and is untouched. At concurrency N as at 1."""
    segs = defect_segments() + field_segments()[:2]  # clones (in-context, x-vector), a custom voice, a design
    clean = one_at_a_time(world.url, world.capture, field_segments()[:2], "moved-clean")
    base = {**baseline["greedy"], **clean}
    for served in (one_at_a_time(world.defect_urls["prompt-row-moved"], world.capture, segs, "moved1"),
                   wave(world.defect_urls["prompt-row-moved"], world.capture, segs[:4], "moved4")):
        for sid, s in served.items():
            b = base[sid].cap
            for name in capture.INPUT:
                np.testing.assert_array_equal(s.cap[name], b[name], err_msg=f"{sid}: {name}")
            rows, want = s.cap["input_prompt_embeds"], b["input_prompt_embeds"].copy()
            if sid == "vd":
                np.testing.assert_array_equal(rows, want)  # no speaker row
                continue
            # where qwen-tts's layout puts it: the clones (English, no instruction) at 3 role + 4 prefill rows
            at = 7
            if sid in world.reference:
                labels = [capture.PROMPT_ROWS[i] for i in world.reference[sid].extra["input_prompt_rows"]]
                at = labels.index("speaker")
                assert labels[at + 1] == "codec pad", (sid, labels)
            want[[at, at + 1]] = want[[at + 1, at]]
            np.testing.assert_array_equal(rows, want, err_msg=sid)
            assert not np.array_equal(rows, b["input_prompt_embeds"])


def test_a_taken_port_stops_the_multi_engine_before_any_listener_serves(tiny, tmp_path):
    """Every listener binds before any serves: one port already taken fails the process (exit 3,
    naming the port) instead of leaving a half-started engine whose first health check passes."""
    import socket
    import subprocess

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken, free = held.getsockname()[1], free_port()
        p = subprocess.run([str(reference_python()), "-m", "runners.cpu_engine.multi",
                            "--serve", f"none={free}", "--serve", f"ref-leak={taken}",
                            *[a for m in all_models(tiny) for a in ("--model", m)]],
                           cwd=REPO, capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert p.returncode == 3, p.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{taken} for ref-leak" in p.stderr
    assert "listening on" not in p.stderr + p.stdout  # the first listener never served

