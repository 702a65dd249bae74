"""The HTTP runner's mechanics against tests/fake_speech_server.py (a test double).
Against a real engine: tests of the CPU engine and the vLLM-Omni server."""

from pathlib import Path

import numpy as np
import pytest
from fake_speech_server import FakeSpeechServer, decode_ref_audio

from difftest.engines.http import order_segments, run_candidate
from difftest.engines.speech_client import SpeechClient, registered_name, speech_request
from difftest.results import read_result
from difftest.suites.suite import load_suite

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def suite():
    return load_suite(ROOT / "cases" / "suites" / "voice-clone-concurrency.yaml")


def clone_segments(suite, n):
    return [s for s in suite.segments if s.task == "voice_clone"][:n]


def test_request_body_carries_what_difftest_always_sends(suite):
    seg = next(s for s in suite.segments if s.task == "voice_clone" and s.voice.mode == "icl")
    body = speech_request(seg, "tag-1")
    assert body["seed"] == seg.decode["seed"] and body["max_new_tokens"] == seg.decode["max_new_tokens"]
    assert body["extra_params"] == {"difftest_tag": "tag-1", "temperature": 0.0,
                                    "repetition_penalty": seg.decode["repetition_penalty"]}
    assert body["task_type"] == "Base" and body["ref_text"] == seg.voice.transcript
    assert decode_ref_audio(body) == seg.voice.wav.read_bytes()
    xv = next(s for s in suite.segments if s.task == "voice_clone" and s.voice.mode == "xvector")
    b = speech_request(xv, "t", voice_mode="registered")
    assert b["voice"] == registered_name(xv.voice) and b["x_vector_only_mode"] is True and "ref_text" not in b
    cv = next(s for s in suite.segments if s.task == "custom_voice")
    assert speech_request(cv, "t")["voice"] == cv.speaker and speech_request(cv, "t")["task_type"] == "CustomVoice"


def test_barrier_waves_capture_and_quantised_audio(suite, tmp_path):
    segs = clone_segments(suite, 8)
    with FakeSpeechServer(capture_dir=tmp_path, delay=0.1, gather=4) as srv:
        out = run_candidate(segs, SpeechClient(srv.url), tmp_path / "res", concurrency=4, capture_dir=tmp_path,
                            label="fake", run_tag="r1")
        first, second = srv.requests[:4], srv.requests[4:]
    assert not out.errors and len(out.results) == 8
    assert out.batches == [[s.id for s in segs[:4]], [s.id for s in segs[4:]]]
    # released together (the server answers none of a wave before all four are in), wave by wave (the
    # second wave is sent after the first's answers)
    assert srv.max_in_flight == 4
    assert min(r["t"] for r in second) > max(r["t_done"] for r in first)
    # each request says how many were released with it (a window-batching server closes its batch then)
    sizes, ids = zip(*(r["wave_header"].split(";") for r in srv.requests))
    assert sizes == ("4",) * 8 and len(set(ids)) == 2  # each wave names itself, once for its four requests
    r = read_result(out.results[segs[0].id].source)
    assert r.quantised and r.has_codes and r.codes.shape == (segs[0].decode["max_new_tokens"] - 1, 16)
    assert r.meta["tag"] == f"r1-{segs[0].id}-c4" and r.meta["concurrency"] == 4
    assert np.max(np.abs(r.wav - r.extra["capture_wav"])) <= 2 / 32768


def test_pool_staggered_orders(suite, tmp_path):
    segs = clone_segments(suite, 6)
    with FakeSpeechServer(delay=0.1) as srv:
        run_candidate(segs, SpeechClient(srv.url), tmp_path / "a", concurrency=4, pattern="staggered", stagger_ms=300)
        t = sorted(r["t"] for r in srv.requests)
        assert sorted(r["wave_header"].split(";")[0] for r in srv.requests) == ["2", "2", "4", "4", "4", "4"]  # waves of 4, then 2
    assert t[1] - t[0] >= 0.15 and t[2] - t[1] >= 0.15
    assert [s.id for s in order_segments(segs, "permuted", 1)] == [s.id for s in order_segments(segs, "permuted", 1)]
    assert sorted(s.id for s in order_segments(segs, "permuted", 1)) == sorted(s.id for s in segs)
    mixed = order_segments(suite.segments, "mixed")
    assert len({s.task for s in mixed[:3]}) == 3
    with FakeSpeechServer(delay=0.05) as srv:
        out = run_candidate(segs, SpeechClient(srv.url), tmp_path / "b", concurrency=3, pattern="pool")
    assert len(out.results) == 6 and srv.max_in_flight <= 3
    assert {r["wave_header"] for r in srv.requests} == {None}  # a pool has no waves
    assert all(not r.has_codes for r in out.results.values())  # no capture dir: audio only


def test_registered_voices(suite, tmp_path):
    segs = clone_segments(suite, 4)
    with FakeSpeechServer() as srv:
        out = run_candidate(segs, SpeechClient(srv.url), tmp_path, concurrency=2, voice_mode="registered")
        assert set(srv.voices) == {registered_name(s.voice) for s in segs}
        assert all("ref_audio" not in r and r["voice"].startswith("difftest-") for r in srv.requests)
    assert len(out.results) == 4


def test_errors_mid_suite_keep_the_rest(suite, tmp_path):
    segs = clone_segments(suite, 6)
    with FakeSpeechServer() as srv:
        srv.fail[segs[1].text] = 500
        srv.truncate.add(segs[2].text)
        out = run_candidate(segs, SpeechClient(srv.url), tmp_path, concurrency=2)
    assert set(out.results) == {segs[i].id for i in (0, 3, 4, 5)}
    assert out.errors[segs[1].id]["message"] == "HTTP 500: engine exploded"
    assert out.errors[segs[1].id]["kind"] == "candidate"
    assert "truncated body" in out.errors[segs[2].id]["message"]


def test_server_dying_mid_suite_loses_nothing_received(suite, tmp_path):
    segs = clone_segments(suite, 6)
    with FakeSpeechServer() as srv:
        srv.die_after = 2
        out = run_candidate(segs, SpeechClient(srv.url, connect_retries=1, retry_wait=0.1), tmp_path, concurrency=1)
    assert set(out.results) == {segs[0].id, segs[1].id}
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert {e["kind"] for e in out.errors.values()} == {"infrastructure"}
    assert len(out.errors) == 4
    # Started again against a live server, it reuses what it has.
    with FakeSpeechServer() as srv:
        again = run_candidate(segs, SpeechClient(srv.url), tmp_path, concurrency=2)
        assert len(srv.requests) == 4
    assert len(again.results) == 6 and not again.errors


def test_unreachable_server(suite, tmp_path):
    c = SpeechClient("http://127.0.0.1:9", connect_retries=1, retry_wait=0.01)
    assert c.health() is False
    out = run_candidate(clone_segments(suite, 2), c, tmp_path, concurrency=2)
    assert {e["kind"] for e in out.errors.values()} == {"infrastructure"}


def test_an_edited_segment_is_served_again_with_its_whole_wave(suite, tmp_path):
    """#34 item 1. Reproduced before the fix: after one segment's text changed, it was served alone
    and its wave-mate's old result reused, so a leak between them had no donor to come from: the
    CPU test engine's ref-leak run went from exit 1 (contamination) to exit 0, PASS."""
    import dataclasses

    from difftest.suites.suite import content_hash

    a, b, c, d = clone_segments(suite, 4)
    out = tmp_path / "res"
    with FakeSpeechServer(delay=0.0) as srv:
        first = run_candidate([a, b, c, d], SpeechClient(srv.url), out, concurrency=2, run_tag="r1", identity_key="k")
        assert first.batches == [[a.id, b.id], [c.id, d.id]] and not first.cached
        edited = dataclasses.replace(b, text=b.text + " Again.")
        edited = dataclasses.replace(edited, hash=content_hash(edited.fingerprint()))
        again = run_candidate([a, edited, c, d], SpeechClient(srv.url), out, concurrency=2, run_tag="r2",
                              identity_key="k")
        texts = [r["input"] for r in srv.requests[4:]]
    assert sorted(texts) == sorted([a.text, edited.text])  # the edited one's wave, both members
    assert again.cached == {c.id, d.id} and sorted(map(sorted, again.batches)) == [[a.id, b.id], [c.id, d.id]]
    assert again.results[a.id].meta["wave"] == [a.id, b.id] and again.results[b.id].segment_hash == edited.hash
