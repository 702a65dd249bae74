"""`difftest selfcheck` for the defects only teacher forcing and the encoder check can see: the CPU
test engine's talker and encoder defects at concurrency 1, real qwen-tts (a file of its own, so a
second test worker can take it while test_selfcheck.py runs)."""

import json
import subprocess
import sys

import pytest

from reference_support import reference_python

# The full tier (docs/ci.md, `bash scripts/test.sh --all`): the talker defects' selfcheck; CI runs
# test_selfcheck.py's planted defects.
pytestmark = pytest.mark.heavy


def test_selfcheck_catches_talker_defects_at_concurrency_1_by_teacher_forcing(tmp_path):
    """Talker defects and an encoder defect the capture's ingredients cannot see (it reports what the
    request asked for): a padded prompt (greedy: tokens far down qwen-tts's ranking; and the assembled
    prompt the talker got holds 24 rows more than qwen-tts's: placed at talker_input), sampling from the
    whole codebook (tokens outside the support), sampling from the top 5 of 50 (every token inside the
    support; only the suite's likelihood shows it), a voice encoded at the wrong sample rate, and the
    prompt's embeddings scaled by 0.97 after the builder (every token plausible: the run against the
    measured null shows it, and the assembled prompt, captured in float32, in every segment). Each must
    fail at concurrency 1 alone, the clean engines not at all."""
    reference_python()
    p = subprocess.run([sys.executable, "-m", "difftest", "selfcheck", "--defects",
                        "prompt-padded,top-k-ignored,top-k-narrowed,ref-audio-rate,prompt-embeds-scaled",
                        "--out", str(tmp_path / "sc"), "--store", str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads((tmp_path / "sc" / "selfcheck.json").read_text())["checks"]}
    assert list(rows) == ["clean", "clean, sampled", "prompt-padded", "top-k-narrowed", "top-k-ignored",
                          "prompt-embeds-scaled", "ref-audio-rate"]
    for clean in ("clean", "clean, sampled"):
        assert rows[clean]["ok"] and rows[clean]["verdict"] == "pass" and rows[clean]["at_concurrency_1"] == "pass"
    for name, verdict, chunk, stage in (("prompt-padded", "talker_defect", 0, "talker_input"),
                                        ("top-k-ignored", "talker_defect", 0, "talker"),
                                        ("top-k-narrowed", "sampling_defect", None, "talker")):
        r = rows[name]
        assert r["ok"] and r["verdict"] == "fail" and r["at_concurrency_1"] == "fail", r
        assert verdict in r["verdicts"] and r["stage"] == stage and r["chunk"] == chunk, r
    padded = json.loads((tmp_path / "sc" / "prompt-padded" / "report.json").read_text())
    for s in padded["segments"]:  # the pad rows come first: row 0 is not qwen-tts's, 24 rows too many
        assert (s["verdict"], s["stage"]) == ("talker_defect", "talker_input"), s
        got = s["comparisons"]["talker_prompt"]
        assert got["first_differing_row"] == 0 and got["rows"] == got["reference_rows"] + 24, got
        assert "qwen-tts's whole prompt follows them: 24 rows put in front of it" in s["summary"], s["summary"]
    enc = rows["ref-audio-rate"]  # the encoder consistently wrong: talker, capture and hand-off agree with it
    # (the x-vector from the mis-sampled voice may move the talker too: then it is a talker_defect as well)
    assert enc["ok"] and enc["stage"] == "reference_encoder" and "reference_encoder_defect" in enc["verdicts"]
    assert set(enc["verdicts"]) <= {"reference_encoder_defect", "talker_defect"}, enc
    sampled = json.loads((tmp_path / "sc" / "top-k-narrowed" / "report.json").read_text())["sampling"]
    assert sampled["verdict"] == "sampling_defect" and sampled["statistics"]["candidate"]["parts"]["talker"]["z"] > 4
    assert abs(sampled["statistics"]["reference"]["parts"]["talker"]["z"]) <= 4  # the test itself calibrated
    # prompt-embeds-scaled: each token within the per-token lines; the run is a talker_defect against qwen-tts's
    # own float32 stream (the CPU engine's numerics), which never leaves its top-1; and every segment is one at
    # talker_input, from the assembled prompt (float32 against float32: exact; a bf16 candidate's 0.97 lies
    # inside the bf16 allowance, where only the null sees it)
    r = rows["prompt-embeds-scaled"]
    assert r["ok"] and r["verdict"] == "fail" and r["at_concurrency_1"] == "fail" and r["stage"] == "talker_input", r
    rep = json.loads((tmp_path / "sc" / "prompt-embeds-scaled" / "report.json").read_text())
    assert {(s["verdict"], s["stage"]) for s in rep["segments"]} == {("talker_defect", "talker_input")}
    assert all(s["comparisons"]["talker_prompt"]["first_differing_row"] == 0
               and abs(s["comparisons"]["talker_prompt"]["worst_rel"] - 0.03) < 1e-3 for s in rep["segments"])
    null = rep["measured_null"]
    assert null["verdict"] == "talker_defect" and null["numerics"]["dtype"] == "float32"
    assert null["numerics"]["null"] == "the reference itself"
    site = null["sites"][null["site"]]
    assert site["null"]["off_top1"] == 0 and site["candidate"]["off_top1"] >= 11 and site["p_value"] < site["alpha"]
    for clean in ("clean", "clean, sampled"):  # the clean engine's codes are qwen-tts's: no null was needed
        rep = json.loads((tmp_path / "sc" / clean.replace(", ", "-") / "report.json").read_text())
        assert rep["measured_null"] is None or not rep["measured_null"]["null_decoded"], clean

    # Against the last release (`difftest gate --baseline-version`'s numerics test): with the clean
    # engine's run as the baseline, the scaled prompt's run is a numerics_regression at the talker,
    # where no segment failed; the clean run against itself is not.
    from difftest.verdicts.numerics import NumericsPolicy, compare

    clean = json.loads((tmp_path / "sc" / "clean" / "report.json").read_text())
    scaled = json.loads((tmp_path / "sc" / "prompt-embeds-scaled" / "report.json").read_text())
    got = compare(scaled, clean, NumericsPolicy(), "the clean engine")
    assert (got["verdict"], got["stage"]) == ("numerics_regression", "talker"), got
    worst = next(t for t in got["tests"] if t["site"] == got["site"])
    assert worst["baseline"][0] == 0 and worst["run"][0] >= 9 and worst["p_value"] < got["alpha"]
    assert compare(clean, clean, NumericsPolicy(), "itself")["verdict"] == "pass"
