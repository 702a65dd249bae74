"""The shipped release gates (cases/gates/*.yaml), gate files with named cells, and the coverage
table of `difftest bugs --gate` (which cells catch which corpus entry, the smallest such set).

The real coverage of cases/gates/cpu.yaml (every corpus entry's mutant served through every cell,
about 40 minutes here) is measured in docs/gates.md; here its bookkeeping: the table, the smallest
set, what is reused when the same command runs again, the exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from difftest.bugs import coverage
from difftest.bugs.corpus import load_corpus
from difftest.errors import BadInput
from difftest.commands.matrix import cell_argv, load_matrix

REPO = Path(__file__).resolve().parents[1]
GATES = REPO / "cases" / "gates"
SMOKE = REPO / "cases" / "suites" / "smoke.yaml"


@pytest.mark.parametrize("name", ["cpu", "release"])
def test_the_shipped_gates_load_and_say_what_each_cell_covers(name):
    m = load_matrix(GATES / f"{name}.yaml")
    assert m.named and m.name == name and [c.spec for c in m.candidates] == ["vllm-omni"]
    assert len(m.cells) >= 5 and len({c["cell"] for c in m.cells}) == len(m.cells)
    for c in m.cells:
        assert c["covers"] and Path(c["suite"]).is_file(), c
    if name == "cpu":  # what the issue asks a CPU gate to exercise, each in some cell
        by = {c["cell"]: c for c in m.cells}
        assert by["async-c4"]["engine_args"] == ["async_chunk=true"]
        assert by["registered-c4"]["voices"] == "registered" and by["many-voices-c4"]["pattern"] == "staggered"
        assert {Path(c["suite"]).stem for c in m.cells} >= {"smoke", "handoff-mix", "voice-clone-concurrency", "sampled"}
        assert "talker.enable_prefix_caching=true" in by["prefix-cache-c4"]["engine_args"]
        # production's paths (issue 62), each cell required to show it ran
        assert by["chunked-prefill-c4"]["exercises"] == ["chunked_prefill"]
        assert by["preempt-resume-c4"]["exercises"] == ["chunked_prefill", "preemption"]
        assert "talker.kv_cache_memory_bytes=524288" in by["preempt-resume-c4"]["engine_args"]
        assert by["async-long-c4"]["production"] == ["async_chunk", "connectors"]
        assert Path(by["resampled-c4"]["suite"]).stem == "resampled"
        # production's bf16 vocoder, judged against qwen-tts's bf16 vocoder as its measured null
        assert by["bf16-vocoder-c4"]["engine_args"] == ["vocoder.dtype=bfloat16"]
        assert by["bf16-vocoder-c4"]["production"] == ["vocoder.dtype"]
        argv = cell_argv(by["preempt-resume-c4"], Path("o"), None, None)
        assert argv.count("--require-path") == 2 and argv[argv.index("--require-path") + 1] == "chunked_prefill"


def test_a_named_cell_runs_with_its_arrivals_voices_and_engine_arguments(tmp_path):
    gate = tmp_path / "g.yaml"
    gate.write_text(f"candidates: [cpu-engine, {{candidate: 'cpu-engine:ref-leak', label: leak}}]\ncells:\n"
                    f"  - {{name: a, suite: {SMOKE}, concurrency: 3, pattern: pool, voices: registered, "
                    f"config: [talker.max_num_seqs=3], covers: [x]}}\n")
    m = load_matrix(gate)
    assert [c["cell"] for c in m.cells] == ["a__cpu-engine", "a__leak"]  # a cell per candidate
    argv = cell_argv(m.cells[1], tmp_path / "o", None, None)
    assert argv[argv.index("--candidate") + 1] == "cpu-engine:ref-leak" and argv[argv.index("--concurrency") + 1] == "3"
    assert ["--pattern", "pool"] == argv[argv.index("--pattern"):argv.index("--pattern") + 2]
    assert ["--voices", "registered"] == argv[argv.index("--voices"):argv.index("--voices") + 2]
    assert "--engine-arg=talker.max_num_seqs=3" in argv and "--order" not in argv


@pytest.mark.parametrize("cells, where", [
    ("  - {{name: a, suite: {s}, concurrency: 2, colour: red}}", "cells[0].colour"),
    ("  - {{name: a, suite: {s}, concurrency: 2, exercises: [warp_drive]}}", "cells[0].exercises"),
    ("  - {{name: 'a b', suite: {s}, concurrency: 2}}", "cells[0].name"),
    ("  - {{name: a, suite: nope.yaml, concurrency: 2}}", "cells[0].suite"),
    ("  - {{name: a, suite: {s}, concurrency: 0}}", "cells[0].concurrency"),
    ("  - {{name: a, suite: {s}, concurrency: 2, pattern: burst}}", "cells[0].pattern"),
    ("  - {{name: a, suite: {s}, concurrency: 2, config: [nokey]}}", "cells[0].config"),
    ("  - {{name: a, suite: {s}, concurrency: 2}}\n  - {{name: a, suite: {s}, concurrency: 4}}", "cells[1].name"),
    ("  - {{name: a, suite: {s}, concurrency: 2}}\nconcurrency: [2]", "concurrency"),
    ("  []", "cells"),
])
def test_a_broken_cell_is_named_before_anything_runs(tmp_path, cells, where):
    gate = tmp_path / "gate.yaml"
    gate.write_text("candidates: [cpu-engine]\ncells:\n" + cells.format(s=SMOKE) + "\n")
    with pytest.raises(BadInput, match=rf"gate.yaml: {where.replace('[', '.').replace(']', '.')}"):
        load_matrix(gate)
    r = subprocess.run([sys.executable, "-m", "difftest", "matrix", str(gate), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and where in r.stderr and "Traceback" not in r.stderr


def test_the_smallest_set_of_cells_is_the_cheapest_of_the_smallest():
    table = {"a": {"x": "caught", "y": "caught", "z": "missed"},
             "b": {"x": "missed", "y": "caught", "z": "caught"},
             "c": {"x": "missed", "y": "missed", "z": "caught"},
             "d": {"x": "missed", "y": "missed", "z": "n/a"}}
    # {y, z} and {x, z} both catch a, b, c; y is cheaper than x
    assert coverage.minimal_cells(table, {"x": 10.0, "y": 50.0, "z": 5.0}) == (["x", "z"], ["d"])
    assert coverage.minimal_cells(table, {"x": 60.0, "y": 50.0, "z": 5.0}) == (["y", "z"], ["d"])
    assert coverage.minimal_cells({"a": {"x": "missed"}}, {}) == ([], ["a"])
    # past EXACT_UP_TO cells, greedy: still a set that catches everything caught
    many = {f"e{i}": {f"c{j}": "caught" if j in (i, i + 1) else "missed" for j in range(25)} for i in range(24)}
    chosen, never = coverage.minimal_cells(many, {})
    assert never == [] and all(any(many[e][c] == "caught" for c in chosen) for e in many) and len(chosen) <= 13


def test_only_capacity_travels_from_an_entry_and_only_to_its_kind_of_candidate():
    entries = {e.id: e for e in load_corpus()}
    assert coverage.capacity(entries["prompt-len-fallback-1554"]) == {"talker_max_model_len": 4096}
    assert coverage.capacity(entries["async-ref-context-1731"]) == {}  # async chunks are the cell's to decide
    cell = {"candidate": "vllm-omni"}
    assert coverage.applicable(entries["ref-leak-4373"], cell)
    assert not coverage.applicable(entries["ref-leak-4373"], {"candidate": "cpu-engine:ref-leak"})
    assert not coverage.applicable(entries["ref-leak-4373"], {"candidate": "vllm-omni-offline"})
    # a cell of another model family never runs the entry's code
    omni = entries["omni-first-codes-planted"]
    assert not coverage.applicable(omni, {"candidate": "vllm-omni", "suite": str(SMOKE)})
    assert coverage.applicable(omni, {"candidate": "vllm-omni", "suite": str(omni.suite)})
    assert not coverage.applicable(entries["ref-leak-4373"], {"candidate": "vllm-omni", "suite": str(omni.suite)})


def test_the_table_is_kept_and_continued_and_an_entry_no_cell_catches_fails(tmp_path, monkeypatch):
    """The bookkeeping alone: each cell's run stood in for by a report (a double of difftest.run.run,
    which the real coverage in docs/gates.md runs), the mutant by the release itself."""
    from contextlib import nullcontext

    gate = tmp_path / "g.yaml"
    gate.write_text(f"candidates: [vllm-omni]\ncells:\n  - {{name: one, suite: {SMOKE}, concurrency: 4, covers: [x]}}\n"
                    f"  - {{name: two, suite: {SMOKE}, concurrency: 2, config: [async_chunk=true], covers: [y]}}\n")
    m = load_matrix(gate)
    entries = load_corpus(only=["no-async-trim-4429", "async-ref-context-1731"])
    calls = []

    def fake_run(e, cell, *a, **k):  # no-async-trim shows in cell one only; async-ref-context in none
        calls.append((e.id, cell["cell"]))
        hit = e.id == "no-async-trim-4429" and cell["cell"] == "one"
        seg = {"id": "s", "verdict": "handoff_defect" if hit else "identical", "stage": "handoff" if hit else None,
               "donor": None, "summary": "", "first_divergent_chunk": 0, "first_divergent_frame": 0}
        return {"verdict": "fail" if hit else "pass", "segments": [seg]}

    monkeypatch.setattr(coverage, "_run_cell", fake_run)
    monkeypatch.setattr(coverage, "mutant_env", lambda *a, **k: nullcontext(Path(sys.executable)))
    monkeypatch.setattr(coverage, "reference_python", lambda *a: Path(sys.executable))
    from difftest.run import RunOptions

    code = coverage.run_coverage(entries, m, tmp_path / "out", None, RunOptions(store=tmp_path / "s"), Path("py"))
    s = json.loads((tmp_path / "out" / "coverage.json").read_text())
    assert code == 1 and s["complete"] and s["exit_code"] == 1
    assert s["table"] == {"async-ref-context-1731": {"one": "missed", "two": "missed"},
                          "no-async-trim-4429": {"one": "caught", "two": "missed"}}
    assert s["minimal_cells"] == ["one"] and s["caught_by_no_cell"] == ["async-ref-context-1731"]
    assert len(calls) == 4
    calls.clear()  # the same command again: nothing is run twice
    coverage.run_coverage(entries, m, tmp_path / "out", None, RunOptions(store=tmp_path / "s"), Path("py"))
    assert calls == []
    gate.write_text(gate.read_text().replace("concurrency: 2", "concurrency: 3"))  # cell two changed: run again
    coverage.run_coverage(entries, load_matrix(gate), tmp_path / "out", None, RunOptions(store=tmp_path / "s"),
                          Path("py"))
    assert sorted(calls) == [("async-ref-context-1731", "two"), ("no-async-trim-4429", "two")]
    calls.clear()  # one entry again (--only): the other's rows stay in the table
    coverage.run_coverage(entries[1:], load_matrix(gate), tmp_path / "out", None, RunOptions(store=tmp_path / "s"),
                          Path("py"))
    s = json.loads((tmp_path / "out" / "coverage.json").read_text())
    assert calls == [] and sorted(s["table"]) == ["async-ref-context-1731", "no-async-trim-4429"]
    assert s["caught_by_no_cell"] == ["async-ref-context-1731"] and s["exit_code"] == 1


def test_a_finding_of_the_release_itself_catches_no_bug(tmp_path, monkeypatch):
    """In a cell where the unmodified release already fails a segment with the verdict a mutant's
    entry expects, that segment does not count for the mutant (the release's runs are its control;
    they run first): the float ceil of 0.30.0 is a talker_defect wherever the 28-frame reference
    goes, and used to credit prompt-len-fallback-1554 and prefix-salt-3665 with it."""
    from contextlib import nullcontext

    from difftest.run import RunOptions

    gate = tmp_path / "g.yaml"
    gate.write_text(f"candidates: [vllm-omni]\ncells:\n  - {{name: one, suite: {SMOKE}, concurrency: 4, covers: [x]}}\n")
    entries = load_corpus(only=["prompt-len-fallback-1554", "prompt-len-float-ceil"])
    shows = {"prompt-len-float-ceil": ["s"], "prompt-len-fallback-1554": ["s"]}

    def fake_run(e, cell, cand_python, out, *a, **k):  # writes its report where difftest.run.run does
        segs = [{"id": sid, "verdict": "talker_defect", "stage": "talker", "donor": None, "summary": "",
                 "first_divergent_chunk": 0, "first_divergent_frame": 0} for sid in shows[e.id]]
        mutant = None if e.release_carries_bug else {"bug": e.id}
        report = {"verdict": "fail", "segments": segs, "candidate": {"versions": {"vllm_omni_mutant": mutant}}}
        (out / e.id / cell["cell"]).mkdir(parents=True, exist_ok=True)
        (out / e.id / cell["cell"] / "report.json").write_text(json.dumps(report))
        return report

    monkeypatch.setattr(coverage, "_run_cell", fake_run)
    monkeypatch.setattr(coverage, "mutant_env", lambda *a, **k: nullcontext(Path(sys.executable)))
    monkeypatch.setattr(coverage, "reference_python", lambda *a: Path(sys.executable))
    coverage.run_coverage(entries, load_matrix(gate), tmp_path / "out", None, RunOptions(store=tmp_path / "s"), Path("py"))
    s = json.loads((tmp_path / "out" / "coverage.json").read_text())
    assert s["table"] == {"prompt-len-fallback-1554": {"one": "missed"}, "prompt-len-float-ceil": {"one": "caught"}}
    # the mutant's report on disk now shows it on a segment of its own too: judged again, without a run
    report = tmp_path / "out" / "prompt-len-fallback-1554" / "one" / "report.json"
    r = json.loads(report.read_text())
    r["segments"].append({**r["segments"][0], "id": "t"})
    report.write_text(json.dumps(r))
    coverage.run_coverage(entries, load_matrix(gate), tmp_path / "out", None, RunOptions(store=tmp_path / "s"), Path("py"))
    s = json.loads((tmp_path / "out" / "coverage.json").read_text())
    assert s["table"]["prompt-len-fallback-1554"] == {"one": "caught"}
    assert next(r for r in s["runs"] if r["entry"] == "prompt-len-fallback-1554")["segment"] == "t"


# -- a configuration set is not a configuration tested -------------------------------------------

def _result(sid: str, frames: int, handoff: str | None, chunks: int | None):
    import numpy as np

    from difftest.results import Result

    meta = {"handoff": handoff, "chunks": chunks} if handoff else {}
    return Result(segment_id=sid, segment_hash="h", wav=np.zeros(10, np.float32), sample_rate=24000,
                  codes=np.zeros((frames, 16), np.int64), ref_codes=np.zeros((0, 16), np.int64), meta=meta)


def test_async_chunks_configured_but_not_run_is_an_error_not_a_pass():
    from difftest.verdicts import exercised

    on = {"async_chunk": True}
    chunked = {"a": _result("a", 30, "async_chunk", 3), "b": _result("b", 1, "async_chunk", 1)}  # one frame: one piece
    assert exercised.finding({"async_chunk": False}, {"c=4": chunked}) is None  # nothing to show
    ok = exercised.finding(on, {"c=4": chunked, "c=1": chunked})
    assert ok["verdict"] == "pass" and ok["checks"]["async_chunk"]["passes"]["c=1"]["chunked"] == 1
    whole = {"a": _result("a", 30, "full_payload", 1), "b": _result("b", 30, "async_chunk", 2)}
    bad = exercised.finding(on, {"c=4": chunked, "c=1": whole})
    assert bad["verdict"] == "error" and bad["summary"].startswith("c=1: configuration not exercised: async_chunk is on, "
                                                                   "but 1 of 2 requests longer than a frame")
    assert bad["checks"]["async_chunk"]["passes"]["c=1"]["in_one_piece"] == ["a"]
    silent = exercised.finding(on, {"c=4": {"a": _result("a", 30, None, None)}})  # no capture: nothing shows it
    assert silent["verdict"] == "error" and "does not say how 1 of 1 requests" in silent["summary"]
    from difftest.records.report import overall
    from difftest.verdicts.policy import load_policy

    assert overall([], load_policy(None), [bad]) == ("error", 3)


def test_the_capture_says_how_the_vocoder_got_the_codes(tmp_path):
    import numpy as np

    from difftest.engines import capture

    codes = np.zeros((3, 16), np.int64)
    cap = capture.validate({"codes": codes, "handoff": np.array("async_chunk"),
                            "chunk_frames": np.array([1, 2], np.int64)}, tmp_path / "x.npz")
    assert cap.handoff == "async_chunk" and cap.chunk_frames.tolist() == [1, 2]
    assert capture.validate({"codes": codes}, tmp_path / "x.npz").handoff is None
    for bad in ({"handoff": np.array("carrier_pigeon")}, {"chunk_frames": np.array([[1]])},
                {"chunk_frames": np.array([-1])}, {"handoff": np.array(3)}):
        with pytest.raises(capture.CaptureError, match="x.npz: (handoff|chunk_frames)"):
            capture.validate({"codes": codes, **bad}, tmp_path / "x.npz")


def test_prefix_caching_configured_but_never_hit_is_an_error_not_a_pass():
    from difftest.verdicts import exercised

    assert exercised.finding({"prefix_caching_stages": []}, {}) is None
    cold = {"prefix_caching_stages": [0], "prefix_cache": {"0": {"queries": 302, "hits": 0}, "1": {"queries": 0, "hits": 0}}}
    f = exercised.finding(cold, {})
    assert f["verdict"] == "error" and f["summary"].startswith(
        "configuration not exercised: prefix caching is on for stage 0, but its cache was hit 0 times in 302")
    hot = {**cold, "prefix_cache": {"0": {"queries": 302, "hits": 128}}}
    assert exercised.finding(hot, {})["verdict"] == "pass"
    unread = {**cold, "prefix_cache": {"error": "http://127.0.0.1:1/metrics: refused"}}
    assert exercised.finding(unread, {})["verdict"] == "error"
    both = exercised.finding({**hot, "async_chunk": True}, {"c=4": {"a": _result("a", 30, "full_payload", 1)}})
    assert both["verdict"] == "error" and set(both["checks"]) == {"async_chunk", "prefix_caching"}
    assert both["checks"]["prefix_caching"]["verdict"] == "pass"


def test_the_servers_metrics_and_deploy_files_are_read_as_vllm_omni_writes_them(tmp_path):
    import http.server
    import threading

    from difftest.engines.vllm_omni import counters_since, preemption_counters, prefix_cache_counters, prefix_caching_stages

    text = ("# HELP vllm:prefix_cache_queries_total x\n"
            'vllm:prefix_cache_queries_total{model_name="m",replica="0",stage="0"} 302.0\n'
            'vllm:prefix_cache_queries_total{model_name="m",replica="0",stage="1"} 0.0\n'
            'vllm:prefix_cache_hits_total{model_name="m",replica="0",stage="0"} 16.0\n'
            'vllm:external_prefix_cache_hits_total{model_name="m",replica="0",stage="0"} 99.0\n'
            'vllm:prefix_cache_hits_created{model_name="m",replica="0",stage="0"} 1.79e+09\n'
            'vllm:num_preemptions_total{engine="0",model_name="m",stage="0"} 3.0\n'
            'vllm:num_preemptions_created{engine="0",model_name="m",stage="0"} 1.79e+09\n').encode()

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_port}"
        assert prefix_cache_counters([url, url]) == {"0": {"queries": 604, "hits": 32}, "1": {"queries": 0, "hits": 0}}
        assert preemption_counters([url]) == {"0": {"preemptions": 3}}
        # a server that served earlier runs (difftest repro's probes): this run's share only
        assert counters_since(preemption_counters([url]), {"0": {"preemptions": 2}}) == {"0": {"preemptions": 1}}
        assert counters_since({"error": "x"}, {"0": {"preemptions": 2}}) == {"error": "x"}
    finally:
        srv.shutdown()
    assert "error" in prefix_cache_counters(["http://127.0.0.1:9"], timeout=5)
    base = tmp_path / "base.yaml"
    base.write_text("stages:\n  - {stage_id: 0, enable_prefix_caching: false}\n  - {stage_id: 1, enable_prefix_caching: false}\n"
                    "platforms:\n  npu:\n    stages:\n      - {stage_id: 1, enable_prefix_caching: true}\n")
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(f"base_config: {base}\nstages:\n  - {{stage_id: 0, enable_prefix_caching: true}}\n  - {{stage_id: 1}}\n")
    assert prefix_caching_stages(overlay) == [0]
    overlay.write_text(f"base_config: {base}\nstages:\n  - {{stage_id: 0}}\n")
    assert prefix_caching_stages(overlay) == []
