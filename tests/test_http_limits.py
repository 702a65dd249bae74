"""The HTTP candidate's limits against tests/fake_speech_server.py (issue 56, items 9-11): a hung
server (the request timeout, then no more requests), an answer larger than its request allows, and
a server mounted under a path prefix."""

import time
import tracemalloc
from contextlib import ExitStack
from pathlib import Path

import pytest
from fake_speech_server import FakeSpeechServer

from difftest.engines.http import run_candidate
from difftest.engines.speech_client import SpeechClient, SpeechError, answer_bound, speech_request
from difftest.engines.start import CandidateSpec, Setup, engine_identity, start_candidate
from difftest.errors import BadInput
from difftest.run import RunOptions
from difftest.suites.suite import load_suite

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "cases" / "suites" / "smoke.yaml"


@pytest.fixture(scope="module")
def suite():
    return load_suite(ROOT / "cases" / "suites" / "voice-clone-concurrency.yaml")


def clone_segments(suite, n):
    return [s for s in suite.segments if s.task == "voice_clone"][:n]


def test_a_hung_server_is_dead_after_its_first_timeout(suite, tmp_path):
    """Reproduced before the fix: every remaining request was sent and waited out (the smoke suite:
    9 waves of 600 s each)."""
    segs = clone_segments(suite, 8)
    with FakeSpeechServer(delay=0.0) as srv:
        srv.hang_after = 2  # the first wave is answered, the second never
        t0 = time.monotonic()
        out = run_candidate(segs, SpeechClient(srv.url, timeout=2), tmp_path, concurrency=2)
        took = time.monotonic() - t0
        sent = len(srv.requests)
    assert sent == 4  # waves 3 and 4 were never sent
    assert took < 60  # one timeout (2 s), not one per wave; generous for a slow machine
    assert set(out.results) == {segs[0].id, segs[1].id} and len(list(tmp_path.glob("*.json"))) == 2
    assert set(out.errors) == {s.id for s in segs[2:]}
    assert {e["kind"] for e in out.errors.values()} == {"infrastructure"}
    for e in out.errors.values():
        assert srv.url in e["message"] and "no answer within 2 s" in e["message"] and e["server_dead"]


def test_a_trickling_answer_is_cut_at_the_timeout(suite, tmp_path):
    """A byte every 0.2 s never trips a socket's per-read timeout: the request's own deadline does.
    Before the fix it took the server's 20 s and ended as a truncated body."""
    seg = clone_segments(suite, 1)[0]
    with FakeSpeechServer() as srv:
        srv.trickle.add(seg.text)
        t0 = time.monotonic()
        with pytest.raises(SpeechError) as e:
            SpeechClient(srv.url, timeout=2).speech(speech_request(seg, "t"))
        took = time.monotonic() - t0
    assert e.value.status == 0 and "no answer within 2 s" in str(e.value)
    assert took < 15


def test_the_request_timeout_flag_ends_the_run_as_infrastructure(suite, tmp_path, monkeypatch, capsys):
    """`difftest run --request-timeout 2` against a server that never answers: exit 3 naming the server
    and the timeout. The run's reference side is left out (difftest.run.run replaced by the candidate
    pass itself)."""
    import difftest.commands.run as run_cli
    from difftest import cli
    from difftest.pipeline.passes import candidate_at as _candidate_at

    def candidate_only(suite, spec, out, policy, opts):
        assert opts.request_timeout == 2.0
        with ExitStack() as stack:
            engine = start_candidate(spec, Setup(out, [], Path("python"), suite, opts), stack)
            _candidate_at(1, engine, suite, out / "c1", "key")

    monkeypatch.setattr(run_cli, "run", candidate_only)
    with FakeSpeechServer() as srv:
        srv.hang_after = 0
        args = ["run", str(SMOKE), "--candidate", srv.url, "--out", str(tmp_path / "o"), "--no-mlflow"]
        code = cli.main(args + ["--request-timeout", "2"])
        sent = len(srv.requests)
    err = capsys.readouterr().err
    assert code == 3 and sent == 1
    assert f"{srv.url}: no answer within 2 s" in err and "--request-timeout" in err
    assert cli.main(args + ["--request-timeout", "0"]) == 2
    assert "--request-timeout 0" in capsys.readouterr().err


def test_an_answer_larger_than_its_request_allows_is_refused_while_read(suite, tmp_path):
    """Reproduced before the fix: a 512 MiB WAV answer took 15 GB of memory and wrote 8.1 GB."""
    ok, streamed, declared = clone_segments(suite, 3)
    bound = answer_bound(speech_request(streamed, "t"))
    assert bound < 8 << 20  # max_new_tokens 40 and the longest reference a suite accepts
    big = 128 << 20
    with FakeSpeechServer(delay=0.0) as srv:
        srv.oversize = {streamed.text: (big, False), declared.text: (big, True)}
        tracemalloc.start()
        try:
            out = run_candidate([ok, streamed, declared], SpeechClient(srv.url), tmp_path / "res", concurrency=1)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        sent = dict(srv.sent)
    assert set(out.results) == {ok.id}
    e = out.errors[streamed.id]
    assert e["kind"] == "candidate" and f"more than the {bound} bytes" in e["message"]
    assert "max_new_tokens 40" in e["message"]
    e = out.errors[declared.id]
    assert e["kind"] == "candidate" and f"{big} bytes (Content-Length)" in e["message"]
    assert sent[streamed.text] < big // 2  # reading stopped, the server could not send the rest
    assert peak < 48 << 20
    written = sum(p.stat().st_size for p in (tmp_path / "res").rglob("*") if p.is_file())
    assert written < 1 << 20


def test_a_server_under_a_path_prefix_is_reached_there(suite, tmp_path):
    """Reproduced before the fix: the path was dropped, every request went to the server's root."""
    segs = clone_segments(suite, 2)
    with FakeSpeechServer(delay=0.0, prefix="/tts/prefix") as srv:
        url = srv.url + "/tts/prefix"
        spec = CandidateSpec.parse(url + "/")
        setup = Setup(tmp_path, [], Path("python"), suite, RunOptions(concurrency=2))
        identity = engine_identity(spec, setup)
        with ExitStack() as stack:
            engine = start_candidate(spec, setup, stack)
            out = engine.generate(segs, concurrency=2, out_dir=tmp_path / "res")
        paths = list(srv.paths)
        assert SpeechClient(srv.url).health() is False  # nothing at the root
    assert spec.label == url and identity["url"] == url and identity["server"]["version"] == {"version": "fake"}
    assert engine.client.base_url == url
    assert not out.errors and len(out.results) == 2
    assert all(r.provenance["url"] == url and r.meta["runner"] == url for r in out.results.values())
    assert set(paths) == {"/tts/prefix/health", "/tts/prefix/version", "/tts/prefix/v1/models",
                          "/tts/prefix/v1/audio/speech"}
    for bad in ("http://127.0.0.1:8000/tts?key=1", "http://127.0.0.1:8000/tts#x"):
        with pytest.raises(BadInput, match="query or fragment"):
            CandidateSpec.parse(bad)


def test_a_hung_server_stops_voice_registration_too(suite, tmp_path):
    """--voices registered: the first registration past the timeout is the last request sent."""
    segs = [s for s in suite.segments if s.task == "voice_clone"]
    assert len({s.voice.id for s in segs}) >= 2
    with FakeSpeechServer() as srv:
        srv.hang_registration = True
        out = run_candidate(segs, SpeechClient(srv.url, timeout=2), tmp_path, concurrency=2, voice_mode="registered")
        paths = list(srv.paths)
    assert paths == ["/v1/audio/voices"] and not out.results and set(out.errors) == {s.id for s in segs}
    assert all(e["kind"] == "infrastructure" and e["server_dead"] and "no answer within 2 s" in e["message"]
               for e in out.errors.values())
