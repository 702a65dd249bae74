"""`difftest matrix`: a gate over candidates x concurrency, every cell a real `difftest run` (qwen-tts
against the CPU test engine, clean and with the seed's leak planted: the negative control), two
cells at a time, gated, logged to a real MLflow (sqlite), one JUnit file and one summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from difftest.errors import BadInput
from difftest.commands.matrix import load_matrix
from reference_support import reference_python

REPO = Path(__file__).resolve().parents[1]

MATRIX = """\
name: release-check
suites: [{suite}]
candidates:
  - cpu-engine
  - {{candidate: "cpu-engine:ref-leak", label: planted-leak}}
concurrency: [2, 4]
store: store
"""


def _write(tmp_path, text) -> Path:
    path = tmp_path / "gate.yaml"
    path.write_text(text)
    return path


@pytest.mark.heavy
def test_two_candidates_at_two_concurrencies(tmp_path, mlflow_cwd):
    reference_python()
    path = _write(tmp_path, MATRIX.format(suite=REPO / "cases" / "suites" / "smoke.yaml"))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "difftest", "matrix", str(path), "--out", str(out), "--workers", "2"],
                       capture_output=True, text=True, timeout=1800, cwd=mlflow_cwd)
    assert r.returncode == 1, r.stderr[-3000:]  # the planted leak fails the gate
    m = json.loads((out / "matrix.json").read_text())
    assert m["complete"] and m["exit_code"] == 1
    rows = {c["cell"]: c for c in m["cells"]}
    assert sorted(rows) == ["smoke__cpu-engine__c2__default", "smoke__cpu-engine__c4__default",
                            "smoke__planted-leak__c2__default", "smoke__planted-leak__c4__default"]
    for n in (2, 4):
        clean, leak = rows[f"smoke__cpu-engine__c{n}__default"], rows[f"smoke__planted-leak__c{n}__default"]
        assert clean["verdict"] == "pass" and clean["failing"] == [] and clean["concurrency"] == n
        assert leak["verdict"] == "fail" and leak["at_concurrency_1"] == "pass"  # only concurrency leaks
        assert leak["failing"] and {f["verdict"] for f in leak["failing"]} == {"contamination"}
        assert all(f["donor"] and f["stage"] == "handoff" and f["first_divergent_chunk"] == 0 for f in leak["failing"])
        assert (out / "cells" / leak["cell"] / "report.json").is_file()
    # two cells at a time, one reference: computed before the cells, found cached by every one of them
    assert "the qwen-tts reference for smoke.yaml first (shared by 4 cells)" in r.stderr
    assert "reference for smoke.yaml ready" in r.stderr and (out / "references" / "smoke.log").is_file()
    for name in rows:
        ref = json.loads((out / "cells" / name / "report.json").read_text())["reference"]
        assert ref["cached_segments"] == 4, (name, ref["cached_segments"])
    suites = ET.parse(out / "junit.xml").getroot()
    assert suites.get("tests") == "16"  # 4 cells x 4 segments
    per_cell = {s.get("name"): int(s.get("failures")) for s in suites}
    assert per_cell["difftest.commands.run_matrix.smoke__cpu-engine__c4__default"] == 0
    assert per_cell["difftest.commands.run_matrix.smoke__planted-leak__c4__default"] == len(
        rows["smoke__planted-leak__c4__default"]["failing"])
    md = (out / "summary.md").read_text()
    assert md.startswith("## ❌ difftest matrix release-check: fail") and "| smoke__planted-leak__c2__default | fail |" in md

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{mlflow_cwd / 'mlflow.db'}")
    exp = client.get_experiment_by_name("difftest/smoke")
    runs = client.search_runs([exp.experiment_id], "tags.`difftest.commands.run_matrix` = 'release-check'", max_results=100)
    assert sorted(r.data.tags["difftest.commands.run_matrix.cell"] for r in runs if "difftest.commands.run_matrix.cell" in r.data.tags) == sorted(rows)


def test_a_reference_that_fails_first_is_left_to_the_cells(tmp_path):
    """The shared reference is computed before the cells; where it cannot be (here: no qwen-tts
    interpreter), the matrix says so and runs the cells anyway, each reporting its own error."""
    path = _write(tmp_path, "suites: [{s}]\ncandidates: [cpu-engine]\nconcurrency: [2, 4]\nstore: store\n".format(
        s=REPO / "cases" / "suites" / "smoke.yaml"))
    out = tmp_path / "out"
    env = {**os.environ, "DIFFTEST_REFERENCE_PYTHON": str(tmp_path / "no-such-venv" / "bin" / "python")}
    r = subprocess.run([sys.executable, "-m", "difftest", "matrix", str(path), "--out", str(out), "--workers", "2",
                        "--no-mlflow"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "reference for smoke.yaml failed (exit 2" in r.stderr  # bad input, as the cells say
    assert "no-such-venv" in (out / "references" / "smoke.log").read_text()
    m = json.loads((out / "matrix.json").read_text())
    assert m["complete"] and len(m["cells"]) == 2 and {c["verdict"] for c in m["cells"]} == {"error"}
    assert all("no-such-venv" in c["log_tail"] for c in m["cells"])


@pytest.mark.parametrize("body, where", [
    ("suites: [x.yaml]\ncandidates: [cpu-engine]\nconcurrency: [2]\n", "suites[0]"),
    ("suites: [{s}]\ncandidates: [cpu-engine]\nconcurrency: [0]\n", "concurrency[0]"),
    ("suites: [{s}]\ncandidates: [cpu-engine]\nconcurrency: [2]\ncandidats: []\n", "candidats"),
    ("suites: [{s}]\ncandidates: [cpu-engine, cpu-engine]\nconcurrency: [2]\n", "candidates"),
    ("suites: [{s}]\ncandidates: [{{candidate: cpu-engine, lable: x}}]\nconcurrency: [2]\n", "candidates[0].lable"),
    ("suites: [{s}]\ncandidates: []\nconcurrency: [2]\n", "candidates"),
    # #34 items 2, 3, 14, each reproduced first: one folder for two cells (exit 0 "2 pass", the leak
    # cell judged from the other's report); a key given twice (the last one won); a defect or a
    # suite the cell's own run refuses (exit 3 "no report", the reason only in the cell's log)
    ("suites: [{s}]\ncandidates: [{{candidate: cpu-engine, label: a b}}, {{candidate: 'cpu-engine:ref-leak', label: a/b}}]\n"
     "concurrency: [2]\n", "candidates"),
    ("suites: [{s}]\ncandidates: [cpu-engine]\nconcurrency: [2]\nconcurrency: [4]\n", "line 4: duplicate key 'concurrency'"),
    ("suites: [{s}]\ncandidates: ['cpu-engine:typo']\nconcurrency: [2]\n", "candidates[0]"),
    ("suites: [{bad}]\ncandidates: [cpu-engine]\nconcurrency: [2]\n", "suites[0]"),
])
def test_a_broken_matrix_file_is_named_before_any_cell_runs(tmp_path, body, where):
    if "{bad}" in body:  # a suite whose voice is 8-bit audio
        import wave

        (tmp_path / "v").mkdir()
        with wave.open(str(tmp_path / "v" / "a.wav"), "wb") as w:
            w.setnchannels(1), w.setsampwidth(1), w.setframerate(24000), w.writeframes(bytes(24000))
        (tmp_path / "v" / "a.txt").write_text("Hello.")
        (tmp_path / "bad.yaml").write_text("name: bad\nmodel: tiny\nvoices:\n  - id: a\n    wav: v/a.wav\n"
                                           "    transcript_file: v/a.txt\nsegments:\n  - id: s1\n    voice: a\n"
                                           "    text: Hello there.\n    language: English\n")
    path = _write(tmp_path, body.format(s=REPO / "cases" / "suites" / "smoke.yaml", bad=tmp_path / "bad.yaml"))
    with pytest.raises(BadInput, match=rf"gate.yaml: {where.replace('[', '.').replace(']', '.')}"):
        load_matrix(path)
    r = subprocess.run([sys.executable, "-m", "difftest", "matrix", str(path), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and where in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o" / "cells").exists() or not any((tmp_path / "o" / "cells").iterdir())
