"""`difftest selfcheck` for real: the CPU test engines (clean and planted), real qwen-tts, the table."""

import json
import subprocess
import sys

import pytest
from reference_support import reference_python


@pytest.mark.heavy
def test_selfcheck_catches_planted_defects_and_passes_the_clean_engine(tmp_path):
    reference_python()
    p = subprocess.run([sys.executable, "-m", "difftest", "selfcheck", "--defects", "ref-in-output,batch-mixup,cobatch-blend",
                        "--out", str(tmp_path / "sc"), "--store", str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads((tmp_path / "sc" / "selfcheck.json").read_text())["checks"]}
    assert list(rows) == ["clean", "batch-mixup", "ref-in-output", "cobatch-blend"]
    assert rows["clean"]["ok"] and rows["clean"]["verdict"] == "pass" and rows["clean"]["at_concurrency_1"] == "pass"
    mix = rows["batch-mixup"]
    assert mix["ok"] and mix["verdict"] == "fail" and mix["at_concurrency_1"] == "pass"  # invisible at 1
    # the talker's side of the capture names whose generated codes every request got: request 0's
    # (which segment that is depends on how the engine formed the batch), checked against the capture
    assert "contamination" in mix["verdicts"] and mix["donor"] and mix["donor_right"]
    rio = rows["ref-in-output"]
    assert rio["ok"] and rio["verdicts"] == ["length_mismatch"] and rio["stage"] == "vocoder"
    assert rio["chunk"] == 0  # the reference re-synthesised opens the answer
    assert rio["at_concurrency_1"] == "fail"  # not a concurrency defect: visible alone too
    blend = rows["cobatch-blend"]  # the co-batched requests' codes part from theirs at 1, each token plausible
    assert blend["ok"] and blend["verdict"] == "fail" and blend["at_concurrency_1"] == "pass", blend
    # the prompt each blended request's talker got is not qwen-tts's, and was right at 1: placed where it enters
    assert blend["stage"] == "talker_input" and "talker_defect" in blend["verdicts"], blend
    rep = json.loads((tmp_path / "sc" / "cobatch-blend" / "report.json").read_text())
    hit = [s for s in rep["segments"] if s["verdict"] == "talker_defect"]
    assert hit and all(s["stage"] == "talker_input" and s["summary"].endswith("at concurrency N (right at 1)")
                       for s in hit), hit
    at_n = rep["measured_null_at_n"]  # which requests share a batch depends on arrival: the run decides
    assert at_n["verdict"] == "concurrency_defect" and at_n["null_decoded"], at_n
    assert at_n["numerics"]["dtype"] == "float32" and at_n["flips"]["null"] == 0 and at_n["flips"]["candidate"] >= 1
    site = at_n["sites"][at_n["site"]]
    assert site["null"]["off_top1"] == 0 and site["p_value"] < site["alpha"]
    for s in rep["segments"]:  # every flip judged against the null's batch noise: none in float32
        if "near_tie" in s["comparisons"]:
            assert s["comparisons"]["near_tie"]["null_n"]["flips"] == 0 and s["verdict"] != "code_divergence", s
    clean = json.loads((tmp_path / "sc" / "clean" / "report.json").read_text())["measured_null_at_n"]
    assert clean["verdict"] == "pass" and not clean["null_decoded"]  # nothing parted, nothing off the top-1
    table = p.stdout
    assert "check" in table.splitlines()[0] and "batch-mixup" in table
    assert "every planted defect caught" in table


def test_unknown_defect_is_bad_input(tmp_path):
    p = subprocess.run([sys.executable, "-m", "difftest", "selfcheck", "--defects", "gremlins",
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and "unknown gremlins" in p.stderr
