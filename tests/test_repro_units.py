"""`difftest repro`'s parts without an engine: the search (against probe doubles: functions that
answer as a defect would), the suites it writes, and the bundle's repro.py against a WAV server double."""

import http.server
import base64
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from difftest.repro import shrink as S
from difftest.repro.probe import write_suite
from difftest.suites import wavio
from difftest.suites.suite import load_suite

REPO = Path(__file__).resolve().parents[1]


def test_ddmin_finds_the_one_minimal_subset_and_keeps_the_order():
    calls = []

    def needs_b_and_e(xs):
        calls.append(list(xs))
        return {"b", "e"} <= set(xs)

    assert S.ddmin(list("abcdefgh"), needs_b_and_e) == ["b", "e"]
    assert all(c == sorted(c) for c in calls)  # every subset tried in the original order
    assert S.ddmin(list("abcd"), lambda xs: True) == []  # nothing needed: nothing kept
    assert S.ddmin(list("abcd"), lambda xs: len(xs) == 4) == list("abcd")  # everything needed


def _subject(**kw):
    segs = ["s1", "s2", "s3", "s4"]
    return S.Subject("s1", kw.get("donor", "s3"), {s: "one two three four five six seven eight" for s in segs},
                     {s: 40 for s in segs}, {s: (f"v{s}", 20 * 1920 + 860) for s in segs})


def leak_double(case):
    """A leak as the seed's: s1 takes s3's reference when they share a batch (concurrency >= 2), whatever
    the text or length; it needs at least 3 frames generated and s3's reference at 15 frames or more."""
    return ({"s1", "s3"} <= set(case.segments) and case.concurrency >= 2
            and (case.edit("*", "max_new_tokens") or 40) >= 3
            and (case.edit("vs3", "ref_samples") or 10 ** 6) >= 15 * 1920)


def test_a_concurrency_finding_shrinks_to_target_and_donor_at_two():
    start = S.Case(("s1", "s2", "s3", "s4"), 4, "pool", "permuted", S.settings_of({"async_chunk": True}))
    got = S.shrink(start, _subject(), leak_double, budget=100)
    c = got.case
    assert got.reproduced and got.complete
    assert (c.segments, c.concurrency, c.pattern, c.order, c.settings) == (("s1", "s3"), 2, "barrier", "suite", ())
    assert c.edit("*", "max_new_tokens") == 5  # 40 -> 20 -> 10 -> 5; 2 loses it
    assert c.edit("s1", "text") == "one"
    assert c.edit("vs3", "ref_samples") is None  # 20 -> 13 frames loses it: s3's reference stays whole
    assert c.edit("vs1", "ref_samples") == S.MIN_REF_FRAMES * 1920 + 860  # s1's own does not matter: to the floor,
    # the remainder mod 1920 kept
    assert [s["step"] for s in got.steps] == list(S.STEPS)
    assert got.steps[0]["tried"] == 1  # the target and its donor alone: the first and only request probe
    assert S.shrink(start, _subject(), leak_double, budget=100).case == c  # deterministic


def test_a_finding_without_concurrency_ends_with_the_target_alone():
    got = S.shrink(S.Case(("s1", "s2", "s3"), 4), _subject(donor=None), lambda c: "s1" in c.segments,
                   budget=100, steps=("requests", "concurrency"))
    assert (got.case.segments, got.case.concurrency) == (("s1",), 1)
    assert got.steps[0]["tried"] == 1  # the target alone at 1 is the first thing tried


def test_the_budget_bounds_the_search_and_says_so():
    seen = []
    got = S.shrink(S.Case(("s1", "s2", "s3", "s4"), 4), _subject(), lambda c: seen.append(c) or leak_double(c),
                   budget=5)
    assert len(seen) == got.probes == 5 and not got.complete
    assert leak_double(got.case)  # what it returns still reproduces


def test_a_scheduling_dependent_start_is_tried_again_and_a_miss_is_reported():
    answers = iter([False, False, True] + [False] * 50)
    got = S.shrink(S.Case(("s1", "s3"), 2), _subject(), lambda c: next(answers), repeats=3, steps=())
    assert got.reproduced and got.case.attempt == 2 and got.probes == 3
    never = S.shrink(S.Case(("s1", "s3"), 2), _subject(), lambda c: False, repeats=3)
    assert not never.reproduced and never.probes == 3


def test_a_reference_is_cut_by_whole_frames_down_to_the_floor():
    assert S.cut_reference(28 * 1920) == 14 * 1920
    assert S.cut_reference(33 * 1920 + 860) == 17 * 1920 + 860
    assert S.cut_reference(S.MIN_REF_FRAMES * 1920 + 5) is None
    assert S.cut_reference(20 * 1920) == S.MIN_REF_FRAMES * 1920


def test_a_case_is_written_as_a_valid_suite_with_its_edits(tmp_path):
    origin = load_suite(REPO / "cases" / "suites" / "smoke.yaml")
    case = (S.Case(("smoke-02", "smoke-01"), 2).with_edit("*", "max_new_tokens", 8)
            .with_edit("smoke-02", "text", "The weather").with_edit("bruno", "ref_samples", 10 * 1920 + 1340))
    suite = load_suite(write_suite(origin, case, tmp_path / "p", "smoke-probe"))
    assert [s.id for s in suite.segments] == ["smoke-02", "smoke-01"]  # the order sent
    s2, s1 = suite.segments
    assert s2.text == "The weather" and s1.text == origin.segment("smoke-01").text
    assert s2.decode["max_new_tokens"] == s1.decode["max_new_tokens"] == 8
    assert s2.voice.n_samples == 10 * 1920 + 1340 and s1.voice.n_samples == origin.segment("smoke-01").voice.n_samples
    full, _ = wavio.read(origin.segment("smoke-02").voice.wav.read_bytes())
    cut, _ = wavio.read(s2.voice.wav.read_bytes())
    assert np.array_equal(cut, full[: len(cut)])  # the head of the same recording
    bundled = load_suite(write_suite(origin, case, tmp_path / "b", "b", copy_voices=True))
    assert all(s.voice.wav.is_relative_to(tmp_path / "b") for s in bundled.segments)  # travels with the bundle


class _WavServer(http.server.ThreadingHTTPServer):
    """A speech-server double: answers each request with the WAV its `input` names."""

    daemon_threads = True

    def __init__(self, answers: dict):
        self.answers, self.calls = answers, []
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path == "/v1/chat/completions"  # Qwen3-Omni's: the WAV in base64 in the JSON
        key = body["messages"][0]["content"] if chat else body["input"]
        wav = self.server.answers.get(key)
        if isinstance(wav, list):  # one answer per call, the last one repeated
            wav = wav.pop(0) if len(wav) > 1 else wav[0]
        self.server.calls.append(key if not chat else f"chat:{key}")
        self.send_response(200 if wav else 500)
        self.end_headers()
        if chat and wav:
            wav = json.dumps({"choices": [{"message": {"content": "hi"}},
                                          {"message": {"audio": {"data": base64.b64encode(wav).decode()}}}]}).encode()
        self.wfile.write(wav or b"no")


@pytest.fixture
def bundle(tmp_path):
    """A bundle as difftest writes one: two requests, the target's expected audio, a reference voice."""
    b = tmp_path / "bundle"
    (b / "expected").mkdir(parents=True)
    (b / "voices").mkdir()
    shutil.copyfile(REPO / "difftest" / "repro" / "standalone.py", b / "repro.py")
    rng = np.random.default_rng(0)
    audio = {rid: (0.3 * rng.standard_normal(30 * 1920)).astype(np.float32) for rid in ("t", "d")}
    for rid, x in audio.items():
        wavio.write(b / "expected" / f"{rid}.wav", x, 24000, "pcm16")
    wavio.write(b / "voices" / "v.wav", audio["d"][:1920 * 8], 24000, "pcm16")
    doc = {"title": "a test bundle", "target": "t", "concurrency": 2, "pattern": "barrier", "against": "qwen_tts",
           "against_label": "qwen-tts", "samples_per_frame": 1920, "chunks": {"initial_frames": 1, "frames": 25},
           "tolerance": {"close_max_abs": 0.001, "close_snr_db": 30.0},
           "requests": [{"id": rid, "expected": f"expected/{rid}.wav", "lead_samples": 0,
                         "ref_audio_file": "voices/v.wav", "body": {"input": rid, "task_type": "Base"}}
                        for rid in ("t", "d")]}
    (b / "bundle.json").write_text(json.dumps(doc))
    return b, audio


def _standalone(b: Path, answers: dict, calls: list | None = None) -> subprocess.CompletedProcess:
    srv = _WavServer(answers)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:  # -I -S: no working folder, no site-packages: neither difftest nor numpy importable
        return subprocess.run([sys.executable, "-I", "-S", "repro.py", "--url", f"http://127.0.0.1:{srv.server_port}"],
                              cwd=b, capture_output=True, text=True, timeout=120)
    finally:
        srv.shutdown()
        if calls is not None:
            calls.extend(srv.calls)


def test_a_concurrency_finding_is_sent_up_to_three_times(bundle):
    """Whether requests share a batch depends on when they arrive: a concurrency finding's requests
    are sent again until the defect shows, three times at most; one that needs none, once."""
    b, audio = bundle
    doc = json.loads((b / "bundle.json").read_text())
    (b / "bundle.json").write_text(json.dumps({**doc, "against": "own_c1", "against_label": "its own answers at 1"}))
    good = {rid: wavio.encode(x, 24000, "pcm16") for rid, x in audio.items()}
    bad_t = audio["t"].copy()
    bad_t[:1920] = audio["d"][:1920]  # chunk 0 from the other request's voice
    calls: list = []
    p = _standalone(b, {"t": [good["t"], wavio.encode(bad_t, 24000, "pcm16")], "d": [good["d"]]}, calls)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "try 1 of 3" in p.stdout and "try 2 of 3" in p.stdout and "try 3 of 3" not in p.stdout
    assert "TARGET t: chunk 0 differs" in p.stdout and sorted(calls) == ["d", "d", "t", "t"]
    calls.clear()
    p = _standalone(b, good, calls)  # a clean server: three tries, none shows
    assert p.returncode == 0 and p.stdout.count("does not show") == 3 and len(calls) == 6, p.stdout
    (b / "bundle.json").write_text(json.dumps(doc))  # against qwen-tts: no concurrency needed, one try
    calls.clear()
    p = _standalone(b, good, calls)
    assert p.returncode == 0 and "try 1" not in p.stdout and len(calls) == 2, p.stdout
    p = subprocess.run([sys.executable, "-I", "-S", "repro.py", "--url", "http://127.0.0.1:9", "--tries", "0"],
                       cwd=b, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--tries must be at least 1" in p.stderr  # never a silent "does not show"


def test_repro_py_needs_nothing_but_the_standard_library(bundle):
    p = subprocess.run([sys.executable, "-I", "-S", "-c", "import difftest"], capture_output=True, text=True)
    assert p.returncode != 0 and "No module named 'difftest'" in p.stderr
    b, audio = bundle
    same = {rid: wavio.encode(x, 24000, "pcm16") for rid, x in audio.items()}
    p = _standalone(b, same)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "does not show in t" in p.stdout


def test_repro_py_says_where_the_target_differs_and_exits_1(bundle):
    b, audio = bundle
    bad = audio["t"].copy()
    bad[1920 * 3 + 7: 1920 * 5] *= -1  # chunk 1 (frames 1-25) from frame 3, sample 5767
    answers = {"t": wavio.encode(bad, 24000, "pcm16"), "d": wavio.encode(audio["d"], 24000, "pcm16")}
    p = _standalone(b, answers)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "TARGET t: chunk 1 differs from sample 5767 (frame 3, 0.240 s)" in p.stdout
    assert "d: as expected" in p.stdout
    short = {**answers, "t": wavio.encode(audio["t"][:-1920], 24000, "pcm16")}  # a frame lost
    p = _standalone(b, short)
    assert p.returncode == 1 and "TARGET t: 55680 samples, expected 57600 (-1.00 frames of 80 ms)" in p.stdout


def test_repro_py_asks_a_chat_model_at_its_path_and_reads_the_audio_from_its_answer(bundle):
    b, audio = bundle
    doc = json.loads((b / "bundle.json").read_text())
    for item in doc["requests"]:  # as difftest bundles a Qwen3-Omni segment (engines/apis.py ChatApi)
        item.pop("ref_audio_file")
        item.update(path="/v1/chat/completions", answer="chat",
                    body={"messages": [{"role": "user", "content": item["id"]}], "modalities": ["text", "audio"]})
    (b / "bundle.json").write_text(json.dumps(doc))
    bad = audio["t"].copy()
    bad[:1920] = 0.0  # a first frame of silence: chunk 0
    calls: list = []
    p = _standalone(b, {"t": wavio.encode(bad, 24000, "pcm16"), "d": wavio.encode(audio["d"], 24000, "pcm16")}, calls)
    assert p.returncode == 1 and "TARGET t: chunk 0 differs from sample 0" in p.stdout, p.stdout + p.stderr
    assert sorted(calls) == ["chat:d", "chat:t"]


def test_a_qwen3_omni_case_is_bundled_as_chat_requests(tmp_path):
    from difftest.engines.apis import api_for

    origin = load_suite(REPO / "cases" / "suites" / "omni-smoke.yaml")
    case = S.Case(("omni-02",), 1).with_edit("*", "max_new_tokens", 6).with_edit("omni-02", "text", "Hi")
    suite = load_suite(write_suite(origin, case, tmp_path / "p", "omni-probe"))
    (seg,) = suite.segments
    assert suite.family.name == origin.family.name and (seg.task, seg.speaker, seg.text) == ("chat", "Chelsie", "Hi")
    assert seg.decode["max_new_tokens"] == 6
    assert seg.decode["thinker_max_new_tokens"] == origin.segment("omni-02").decode["thinker_max_new_tokens"]
    api = api_for(seg)
    body = api.repro_body(seg)
    assert (api.path, api.answer) == ("/v1/chat/completions", "chat") and body["speaker"] == "Chelsie"
    assert "difftest_tag" not in json.dumps(body) and body["sampling_params_list"][1]["max_tokens"] == 6


def test_repro_py_exits_2_when_the_server_gives_no_audio(bundle):
    b, audio = bundle
    p = _standalone(b, {"t": wavio.encode(audio["t"], 24000, "pcm16")})  # "d" gets an HTTP 500
    assert p.returncode == 2 and "d: no audio: HTTP Error 500" in p.stdout, p.stdout
    # a quieter difference than the policy's close tier is no defect
    b2 = json.loads((b / "bundle.json").read_text())
    assert b2["tolerance"]["close_max_abs"] == 0.001
    near = audio["t"] + np.float32(0.0004)
    p = _standalone(b, {"t": wavio.encode(near, 24000, "pcm16"), "d": wavio.encode(audio["d"], 24000, "pcm16")})
    assert p.returncode == 0, p.stdout


def test_a_donor_needed_beside_others_is_found_by_ddmin_and_flaky_probes_get_a_second_try():
    """s1 takes s3's reference only when s4 is in the batch too; and only on every other try."""
    def flaky(case):
        return {"s1", "s3", "s4"} <= set(case.segments) and case.attempt % 2 == 1

    start = S.Case(("s1", "s2", "s3", "s4"), 4)
    once = S.shrink(start, _subject(), flaky, budget=100, steps=("requests",), repeats=2)
    assert once.reproduced and once.case.segments == start.segments  # one try per smaller case: every one missed
    twice = S.shrink(start, _subject(), flaky, budget=100, steps=("requests",), repeats=2, tries=2)
    assert twice.case.segments == ("s1", "s3", "s4")
