"""Capture files come from the engine under test: every kind of nonsense in one is that segment's
candidate error, named, and never crashes the run or is cast into something plausible."""

from pathlib import Path

import numpy as np
import pytest
from fake_speech_server import FakeSpeechServer
from toy import toy_codes

from difftest.engines import capture
from difftest.engines.http import run_candidate
from difftest.engines.speech_client import SpeechClient
from difftest.suites.suite import load_suite

ROOT = Path(__file__).resolve().parent.parent
GOOD = {"codes": toy_codes(6, 1), "ref_codes": toy_codes(3, 2), "wav": np.zeros(6 * 1920, np.float32)}


def write(tmp_path, **arrays) -> Path:
    p = tmp_path / "t.npz"
    np.savez(p, **arrays)
    return p


def test_a_good_capture_reads_back(tmp_path):
    c = capture.load(write(tmp_path, **GOOD, lead_samples=np.int64(1), sample_rate=np.int64(24000)))
    assert np.array_equal(c.codes, GOOD["codes"]) and c.codes.dtype == np.int64
    assert np.array_equal(c.ref_codes, GOOD["ref_codes"]) and c.lead_samples == 1 and c.sample_rate == 24000
    c = capture.load(write(tmp_path, codes=GOOD["codes"]))  # the talker's side alone
    assert c.ref_codes.shape == (0, 16) and c.wav is None and c.lead_samples == 0


HOSTILE = {
    "float codes": ({**GOOD, "codes": GOOD["codes"].astype(np.float32)}, "codes holds float32 values"),
    "string codes": ({**GOOD, "codes": np.array(["a", "b"])}, "codes holds <U1 values"),
    "8 codebooks": ({**GOOD, "codes": toy_codes(6, 1)[:, :8]}, "codes has shape (6, 8)"),
    "17 codebooks": ({**GOOD, "codes": np.concatenate([toy_codes(6, 1), toy_codes(6, 1)[:, :1]], 1)},
                     "codes has shape (6, 17)"),
    "1-D codes": ({**GOOD, "codes": toy_codes(6, 1).reshape(-1)}, "codes has shape (96,)"),
    "no codes": ({"ref_codes": GOOD["ref_codes"], "wav": GOOD["wav"]}, "no 'codes' array"),
    "uint64 beyond int64": ({**GOOD, "codes": np.full((6, 16), 2**64 - 1, np.uint64)},
                            "codes[0, 0] = 18446744073709551615 lies outside the codebook [0, 2048)"),
    "out of range": ({**GOOD, "codes": np.where(np.arange(96).reshape(6, 16) == 37, 4096, GOOD["codes"])},
                     "codes[2, 5] = 4096 lies outside the codebook"),
    "negative ref codes": ({**GOOD, "ref_codes": -np.ones((3, 16), np.int64)}, "ref_codes[0, 0] = -1"),
    "integer wav": ({**GOOD, "wav": np.zeros(100, np.int16)}, "wav holds int16 values"),
    "2-D wav": ({**GOOD, "wav": np.zeros((2, 1920), np.float32)}, "wav has shape (2, 1920), expected mono"),
    "lead of 5": ({**GOOD, "lead_samples": np.int64(5)}, "lead_samples 5 outside [0, 1]"),
    "NaN in the audio": ({**GOOD, "wav": np.where(np.arange(6 * 1920) == 7, np.nan, GOOD["wav"]).astype(np.float32)},
                         "wav sample 7 is nan (1 samples not finite)"),
    "infinity in the audio": ({**GOOD, "wav": np.where(np.arange(6 * 1920) >= 100, np.inf, 0).astype(np.float32)},
                              "wav sample 100 is inf"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_captures_are_named(tmp_path, name):
    arrays, problem = HOSTILE[name]
    with pytest.raises(capture.CaptureError) as e:
        capture.load(write(tmp_path, **arrays))
    assert problem in str(e.value) and "t.npz" in str(e.value)


def test_not_an_archive_and_too_big(tmp_path, monkeypatch):
    p = tmp_path / "t.npz"
    p.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(capture.CaptureError, match="unreadable capture"):
        capture.load(p)
    np.save(tmp_path / "one.npy", GOOD["codes"])
    with pytest.raises(capture.CaptureError, match="not an npz archive"):
        capture.load(tmp_path / "one.npy")
    monkeypatch.setattr(capture, "MAX_BYTES", 100)
    with pytest.raises(capture.CaptureError, match="more than the 0 MiB"):
        capture.load(write(tmp_path, **GOOD))


def test_a_run_keeps_going_past_hostile_captures(tmp_path, monkeypatch):
    """Through the HTTP runner: each hostile capture is that segment's candidate error; a missing one
    (asked for, never written) is an infrastructure error; the others are results."""
    suite = load_suite(ROOT / "cases" / "suites" / "voice-clone-concurrency.yaml")
    segs = [s for s in suite.segments if s.task == "voice_clone"][:6]
    cap_dir = tmp_path / "cap"
    cap_dir.mkdir()
    monkeypatch.setattr("difftest.engines.http.CAPTURE_WAIT_S", 1.0)  # the missing one is waited for
    with FakeSpeechServer(capture_dir=cap_dir, delay=0.0) as srv:
        srv.capture_override = {segs[0].text: HOSTILE["float codes"][0],
                                segs[1].text: HOSTILE["uint64 beyond int64"][0],
                                segs[2].text: HOSTILE["no codes"][0],
                                segs[3].text: None}
        out = run_candidate(segs, SpeechClient(srv.url), tmp_path / "res", concurrency=3, capture_dir=cap_dir,
                            run_tag="r", reuse=False)
    assert {sid: e["kind"] for sid, e in out.errors.items()} == {
        segs[0].id: "candidate", segs[1].id: "candidate", segs[2].id: "candidate", segs[3].id: "infrastructure"}
    assert "codes holds float32 values" in out.errors[segs[0].id]["message"]
    assert "engine wrote no capture" in out.errors[segs[3].id]["message"]
    assert sorted(out.results) == sorted(s.id for s in segs[4:])
    assert all(r.has_codes and r.codes.dtype == np.int64 for r in out.results.values())


def test_a_missing_capture_is_waited_for_then_named(tmp_path, monkeypatch):
    monkeypatch.setattr("difftest.engines.http.CAPTURE_WAIT_S", 0.2)
    from difftest.engines.http import read_capture

    with pytest.raises(capture.CaptureMissing, match="no capture for this request within 0 s"):
        read_capture(tmp_path, "absent")
    assert read_capture(None, "absent") is None  # no capture asked for: an audio-only candidate


def test_the_writer_and_the_reader_share_one_versioned_schema(tmp_path):
    path = capture.write(tmp_path / "w.npz", {"codes": GOOD["codes"].astype(np.int32), "wav": GOOD["wav"],
                                              "lead_samples": 1, "handoff": np.array("full_payload")})
    with np.load(path, allow_pickle=False) as z:
        assert int(z["schema_version"]) == capture.SCHEMA_VERSION and z["codes"].dtype == np.int64
        assert str(z["handoff"]) == "full_payload"  # a writer's own arrays ride along
    assert capture.load(path).lead_samples == 1 and path.stat().st_mode & 0o777 == 0o644
    np.savez(tmp_path / "v4.npz", **GOOD, schema_version=np.int64(4))
    with pytest.raises(capture.CaptureError, match="capture schema version 4; this difftest reads versions 1, 2, 3"):
        capture.load(tmp_path / "v4.npz")
    np.savez(tmp_path / "v1.npz", **GOOD, schema_version=np.int64(1))  # an older plugin: no talker stage
    assert capture.load(tmp_path / "v1.npz").stage_arrays() == {}


TALKER = {"talker_ref_codes": np.arange(48).reshape(3, 16) % 2048, "talker_prompt": np.array([40, 40, 3]),
          "talker_tokens": np.array([5, 6, 7, 2150])}


def test_the_talker_stage_round_trips_and_is_checked(tmp_path):
    path = capture.write(tmp_path / "t.npz", {**GOOD, **TALKER})
    got = capture.load(path).stage_arrays()
    assert got["talker_ref_codes"].shape == (3, 16) and got["talker_prompt"].tolist() == [40, 40, 3]
    assert got["talker_tokens"].tolist() == [5, 6, 7, 2150]  # specials (EOS) lie beyond the codebook: allowed here
    for bad, words in (({"talker_tokens": None}, "talker_tokens missing"),
                       ({"talker_prompt": np.array([1, 2])}, "talker_prompt must be 3 integers"),
                       ({"talker_tokens": np.array([1.5])}, "talker_tokens must be a row of integers"),
                       ({"talker_tokens": np.array([-1, 3])}, "negative"),
                       ({"talker_ref_codes": np.full((1, 16), 4096)}, r"talker_ref_codes\[0, 0\] = 4096")):
        arrays = {**GOOD, **TALKER, **bad}
        arrays = {k: v for k, v in arrays.items() if v is not None}
        np.savez(tmp_path / "bad.npz", **arrays)
        with pytest.raises(capture.CaptureError, match=words):
            capture.load(tmp_path / "bad.npz")


TOPK = {"talker_topk_ids": np.array([[5, 9], [6, 1], [7, 2], [2150, 3]]),
        "talker_topk_logprobs": np.array([[-0.1, -2.0], [-0.2, -0.3], [-0.5, -0.5], [-0.01, -6.0]], np.float32)}


def test_the_talker_own_top_k_round_trips_and_is_checked(tmp_path):
    """Optional, with the talker's tokens: one row per token, ids >= 0, finite log-probabilities
    <= 0, best first; zero rows (the plugin could not line them up) read as not captured."""
    got = capture.load(capture.write(tmp_path / "k.npz", {**GOOD, **TALKER, **TOPK})).stage_arrays()
    assert got["talker_topk_ids"].tolist()[1] == [6, 1] and got["talker_topk_logprobs"].dtype == np.float32
    empty = {"talker_topk_ids": np.zeros((0, 5), np.int64), "talker_topk_logprobs": np.zeros((0, 5), np.float32)}
    assert "talker_topk_ids" not in capture.load(capture.write(tmp_path / "e.npz", {**GOOD, **TALKER, **empty})).stage_arrays()
    lp = TOPK["talker_topk_logprobs"]
    for bad, words in (({"talker_topk_logprobs": None}, "come together"),
                       ({"talker_topk_ids": TOPK["talker_topk_ids"][:3], "talker_topk_logprobs": lp[:3]},
                        r"shape \(3, 2\), expected \(4, k >= 2\)"),
                       ({"talker_topk_ids": TOPK["talker_topk_ids"].astype(float)}, "must be integer and float"),
                       ({"talker_topk_logprobs": lp[:, ::-1].copy()}, "best first"),
                       ({"talker_topk_logprobs": np.where(lp == -6.0, np.nan, lp)}, "finite"),
                       ({"talker_topk_logprobs": lp + 1.0}, "<= 0"),
                       ({"talker_tokens": None, "talker_ref_codes": None, "talker_prompt": None},
                        "without the talker's tokens")):
        arrays = {k: v for k, v in {**GOOD, **TALKER, **TOPK, **bad}.items() if v is not None}
        np.savez(tmp_path / "bad.npz", **arrays)
        with pytest.raises(capture.CaptureError, match=words):
            capture.load(tmp_path / "bad.npz")


def _npz_claiming(path: Path, name: str, shape: tuple, dtype: str = "<i8") -> Path:
    """An npz whose member's header claims `shape` and holds a few bytes: what a hostile or broken
    writer can leave; np.load would allocate the whole claim before finding the data short."""
    import io
    import zipfile

    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": dtype, "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}.npy", head.getvalue() + b"\0" * 64)
        zf.writestr("wav.npy", _npy(GOOD["wav"]))
    return path


def _npy(a) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_a_capture_that_claims_gigabytes_is_refused_from_its_headers(tmp_path):
    """A 1 KB capture claiming 2.2 GB of codes, or a compressed one of 200,000 frames for a request
    allowed 8: refused before anything is unpacked (the reference runner once went to 19 GB)."""
    import tracemalloc

    bomb = _npz_claiming(tmp_path / "bomb.npz", "codes", (2**24, 16))
    assert bomb.stat().st_size < 48_000
    tracemalloc.start()
    with pytest.raises(capture.CaptureError, match=r"member codes.npy claims shape \(16777216, 16\) of int64"):
        capture.load(bomb)
    assert tracemalloc.get_traced_memory()[1] < 16 << 20  # the peak: nothing of the claim was allocated
    tracemalloc.stop()
    many = tmp_path / "many.npz"
    np.savez_compressed(many, codes=np.zeros((200_000, 16), np.int64), wav=GOOD["wav"])
    assert many.stat().st_size < 200_000
    with pytest.raises(capture.CaptureError, match=r"200000 frames, more than the request's max_new_tokens \(8\) allows"):
        capture.load(many, max_frames=8)
    tokens = {**GOOD, **TALKER, "talker_tokens": np.arange(8)}  # 6 frames, 8 talker tokens: one too many for 6
    with pytest.raises(capture.CaptureError, match="8 talker tokens, more than the request's max_new_tokens"):
        capture.load(capture.write(tmp_path / "tok.npz", tokens), max_frames=6)
    assert len(capture.load(capture.write(tmp_path / "ok.npz", {**GOOD, **TALKER}), max_frames=6).codes) == 6


def test_more_frames_than_the_request_allowed_is_that_segments_candidate_error(tmp_path):
    suite = load_suite(ROOT / "cases" / "suites" / "voice-clone-concurrency.yaml")
    segs = [s for s in suite.segments if s.task == "voice_clone"][:3]
    limit = segs[0].decode["max_new_tokens"]
    cap_dir = tmp_path / "cap"
    cap_dir.mkdir()
    with FakeSpeechServer(capture_dir=cap_dir, delay=0.0) as srv:
        # segs[1]: the reference left in front of a full-length stream (#4421) is a defect to judge
        srv.capture_override = {segs[0].text: {**GOOD, "codes": toy_codes(limit + 3 + 1, 3)},
                                segs[1].text: {**GOOD, "codes": toy_codes(limit + 3, 3)}}
        out = run_candidate(segs, SpeechClient(srv.url), tmp_path / "res", concurrency=3, capture_dir=cap_dir,
                            run_tag="r", reuse=False)
    assert out.errors[segs[0].id]["kind"] == "candidate"
    assert (f"{limit + 4} frames, more than the request's max_new_tokens ({limit}) plus its 3-frame reference allows"
            in out.errors[segs[0].id]["message"])
    assert sorted(out.results) == sorted(s.id for s in segs[1:])
    assert len(out.results[segs[1].id].codes) == limit + 3
