"""`difftest selfcheck` for real: the CPU test engines (clean and planted), real qwen-tts, the table."""

import json
import subprocess
import sys

from reference_support import reference_python


def test_selfcheck_catches_planted_defects_and_passes_the_clean_engine(tmp_path):
    reference_python()
    p = subprocess.run([sys.executable, "-m", "difftest", "selfcheck", "--defects", "ref-in-output,batch-mixup",
                        "--out", str(tmp_path / "sc"), "--store", str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads((tmp_path / "sc" / "selfcheck.json").read_text())["checks"]}
    assert list(rows) == ["clean", "batch-mixup", "ref-in-output"]
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
    table = p.stdout
    assert "check" in table.splitlines()[0] and "batch-mixup" in table
    assert "every planted defect caught" in table


def test_unknown_defect_is_bad_input(tmp_path):
    p = subprocess.run([sys.executable, "-m", "difftest", "selfcheck", "--defects", "gremlins",
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and "unknown gremlins" in p.stderr


def test_selfcheck_catches_talker_defects_at_concurrency_1_by_teacher_forcing(tmp_path):
    """Three talker defects and an encoder defect the capture cannot see (it reports what the request asked for): a padded
    prompt (greedy: tokens far down qwen-tts's ranking), sampling from the whole codebook (tokens
    outside the support) and sampling from the top 5 of 50 (every token inside the support; only the
    suite's likelihood shows it). Each must fail at concurrency 1 alone, the clean engines not at all."""
    reference_python()
    p = subprocess.run([sys.executable, "-m", "difftest", "selfcheck", "--defects",
                        "prompt-padded,top-k-ignored,top-k-narrowed,ref-audio-rate",
                        "--out", str(tmp_path / "sc"), "--store", str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads((tmp_path / "sc" / "selfcheck.json").read_text())["checks"]}
    assert list(rows) == ["clean", "clean, sampled", "prompt-padded", "top-k-narrowed", "top-k-ignored",
                          "ref-audio-rate"]
    for clean in ("clean", "clean, sampled"):
        assert rows[clean]["ok"] and rows[clean]["verdict"] == "pass" and rows[clean]["at_concurrency_1"] == "pass"
    for name, verdict, chunk in (("prompt-padded", "talker_defect", 0), ("top-k-ignored", "talker_defect", 0),
                                 ("top-k-narrowed", "sampling_defect", None)):
        r = rows[name]
        assert r["ok"] and r["verdict"] == "fail" and r["at_concurrency_1"] == "fail", r
        assert verdict in r["verdicts"] and r["stage"] == "talker" and r["chunk"] == chunk, r
    enc = rows["ref-audio-rate"]  # the encoder consistently wrong: talker, capture and hand-off agree with it
    assert enc["ok"] and enc["verdicts"] == ["reference_encoder_defect"] and enc["stage"] == "reference_encoder"
    sampled = json.loads((tmp_path / "sc" / "top-k-narrowed" / "report.json").read_text())["sampling"]
    assert sampled["verdict"] == "sampling_defect" and sampled["statistics"]["candidate"]["parts"]["talker"]["z"] > 4
    assert abs(sampled["statistics"]["reference"]["parts"]["talker"]["z"]) <= 4  # the test itself calibrated
