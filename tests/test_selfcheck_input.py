"""`difftest selfcheck` for the defects in what the talker's prompt is made of (issue #29): the CPU
test engine writes its talker's input as qwen-tts's generate got it (capture schema v3), the
reference runner qwen-tts's own, and each planted defect is named at stage talker_input with its
field; the leak of a speaker embedding with its donor, checked against the captures; and the prompt
assembled from the right ingredients in the wrong order (`prompt-row-moved`), named at talker_input
from the rows the talker received (issue 57, item 5). Real qwen-tts (a file of its own, so a second
test worker can take it)."""

import json
import subprocess
import sys

import pytest

from reference_support import reference_python

# The full tier (docs/ci.md, `bash scripts/test.sh --all`): the prompt defects' selfcheck; CI runs
# test_selfcheck.py's planted defects.
pytestmark = pytest.mark.heavy

DEFECTS = ("language-dropped", "speaker-scaled", "text-word-dropped", "speaker-leak", "prompt-row-moved")


def test_selfcheck_names_each_prompt_defect_at_talker_input_with_its_field(tmp_path):
    reference_python()
    p = subprocess.run([sys.executable, "-m", "difftest", "selfcheck", "--defects", ",".join(DEFECTS),
                        "--out", str(tmp_path / "sc"), "--store", str(tmp_path / "store")],
                       capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads((tmp_path / "sc" / "selfcheck.json").read_text())["checks"]}
    assert set(rows) == {"clean", *DEFECTS}
    clean = json.loads((tmp_path / "sc" / "clean" / "report.json").read_text())
    assert rows["clean"]["ok"] and clean["verdict"] == "pass"
    # the clean engine's input was compared, field by field, and equal: not a check that never ran
    assert all(s["comparisons"]["talker_input"] == {"differ": [], "speaker_max_abs": 0.0}
               for s in clean["segments"]), [s["comparisons"].get("talker_input") for s in clean["segments"]]
    # ...and so was the prompt as assembled, row by row, bit for bit (float32 against float32), at 1 and at N
    for s in clean["segments"]:
        got = s["comparisons"]["talker_prompt"]
        assert got["equal"] and got["compared"] == got["rows"] == got["reference_rows"] > 10, s
        assert got["worst_rel"] == 0.0 and got["allowed_rel"] == 0.0 and got["dtype"] == "float32", s
    # every ingredient right, the speaker row after the codec pad: only the assembled prompt shows it, in every
    # segment (smoke's clones all hold an x-vector row), naming the row and what qwen-tts holds there
    moved = rows["prompt-row-moved"]
    assert moved["ok"] and moved["stage"] == "talker_input" and moved["at_concurrency_1"] == "fail", moved
    report = json.loads((tmp_path / "sc" / "prompt-row-moved" / "report.json").read_text())
    for s in report["segments"]:
        assert (s["verdict"], s["stage"], s["donor"]) == ("talker_defect", "talker_input", None), s
        assert s["comparisons"]["talker_input"]["differ"] == [], s  # no ingredient differs
        assert s["summary"].startswith("the talker's assembled prompt differs from qwen-tts's at row 7 of "), s
        assert "(it should hold the speaker row): the row there is qwen-tts's row 8 (codec pad)" in s["summary"], s
        assert s["comparisons"]["talker_prompt"]["first_differing_row"] == 7
    field = {"language-dropped": "codec prefill (language)", "speaker-scaled": "speaker embedding",
             "text-word-dropped": "text ids"}
    for name, what in field.items():
        r = rows[name]
        assert r["ok"] and r["stage"] == "talker_input" and r["at_concurrency_1"] == "fail", r
        report = json.loads((tmp_path / "sc" / name / "report.json").read_text())
        for s in report["segments"]:
            assert (s["verdict"], s["stage"]) == ("talker_defect", "talker_input"), s
            assert s["summary"].startswith(f"the talker's input differs from qwen-tts's in its {what}, at position "), s["summary"]
    leak = rows["speaker-leak"]
    assert leak["ok"] and leak["at_concurrency_1"] == "pass" and leak["donor"] and leak["donor_right"], leak
    report = json.loads((tmp_path / "sc" / "speaker-leak" / "report.json").read_text())
    hit = [s for s in report["segments"] if s["verdict"] == "contamination"]
    assert hit and all((s["stage"], s["donor_kind"]) == ("talker_input", "speaker embedding") for s in hit), hit
    assert all("speaker embedding at concurrency N (right at 1)" in s["summary"] for s in hit)
