"""ISSUE.md shows every user- or server-controlled string as its own characters (issue 56, item 7): no HTML,
no heading, list, link or table cell of the text's own, the table keeps its columns. issue_text is called
directly with such strings in every place a run can put them."""

from __future__ import annotations

import html
import re
from pathlib import Path
from types import SimpleNamespace

from difftest.repro.bundle import AGAINST, issue_text, issue_title, md
from difftest.repro.probe import Finding
from difftest.repro.shrink import Case

H = ("<img src=x onerror=alert(1)> a|b \\| `c` ```d``` &amp; *e* _f_ \n## heading\n| x | y |\n"
     "- [link](javascript:alert(1)) ![i](http://t/p.png) 1. @user #12 $x$")
FLAT = " ".join(H.splitlines())
TARGET, DONOR, TICKS = "t<1>", "d|`2`", "t`x``y"
HEADINGS = ["## Symptom", "## Environment", "## Minimal reproduction",
            "## Diagnosis (from difftest's capture of what each stage received)", "## Checked", "## Notes"]


def _recover(cell: str) -> str:
    """What a reader sees: a code span's content, or escaped text unescaped."""
    cell = cell.strip()
    n = len(cell) - len(cell.lstrip("`"))
    if n:
        inner = cell[n:-n]
        assert cell.endswith("`" * n) and "`" * n not in inner  # the fence outruns every backtick run inside
        return inner[1:-1] if inner[:1] == inner[-1:] == " " else inner
    return html.unescape(re.sub(r"\\(.)", r"\1", cell))


def _cells(row: str) -> list[str]:
    """A GFM table row's cells: a backslash escapes the next character (`\\|` is no border)."""
    cells, cur, i = [], "", 0
    while i < len(row):
        if row[i] == "\\":
            cur, i = cur + row[i:i + 2], i + 2
            continue
        if row[i] == "|":
            cells.append(cur)
            cur = ""
        else:
            cur += row[i]
        i += 1
    return [c.strip() for c in cells[1:]]  # the text before the first border; the last border closes the row


def _issue() -> str:
    finding = Finding(segment=TARGET, verdict="contamination", stage="handoff", donor=DONOR, donor_kind=H, chunk=0,
                      summary=H, at_one=None, wave=[TARGET, DONOR])
    case = Case(segments=(TARGET, DONOR), concurrency=2, settings=(("async_chunk", H),), edits=((TARGET, "text", H),))
    seg = {"id": TARGET, "verdict": "contamination", "stage": "handoff", "donor": DONOR, "donor_kind": H,
           "summary": H, "first_divergent_chunk": 0, "evidence": {H: H}}
    report = {"candidate": {"engine": H + "\x1b[31m", "versions": {"vllm_omni": H}, "device": H,
                            "identity": {"checkpoints": {"base": H}}},
              "segments": [seg, {**seg, "id": DONOR, "donor": TARGET}]}
    body = {"task_type": "Base", "language": H, "input": H, "max_new_tokens": 16}
    bundle = {"title": issue_title(finding, case, {"engine_label": H}), "against_label": AGAINST["own_c1"],
              "requests": [{"id": TARGET, "body": body, "ref_audio_file": f"voices/{H}.wav"},
                           {"id": DONOR, "body": body}, {"id": TICKS, "body": body, "ref_audio_file": "voices/`v`.wav"}]}
    origin = SimpleNamespace(out=Path("/runs/a|<b>"), suite=SimpleNamespace(name=H, segments=[1, 2]),
                             run={"concurrency": 2, "pattern": H})
    meta = {"rate": {"reproduced": 2, "tries": 3}, "notes": [H], "validation": {H: 1}, "engine_label": H}
    return issue_text(origin, finding, case, report, bundle, meta, False)


def test_no_markup_of_the_inputs_survives_and_the_structure_is_the_issues_own():
    issue = _issue()
    lines = issue.splitlines()
    assert "<img" not in issue and "<" not in issue and ">" not in issue and "\x1b" not in issue
    assert "\\x1b" in issue  # the control character shown, not sent to a terminal
    assert [ln for ln in lines if ln.startswith("#")][1:] == HEADINGS and lines[0].startswith("# ")
    assert [ln for ln in lines if ln.lstrip().startswith("```")] == ["```", "```"]  # only the command's block
    rows = [ln for ln in lines if ln.startswith("|")]
    assert len(rows) == 2 + 3 and all(len(_cells(r)) == 5 for r in rows), rows
    assert not any(ln.startswith(("- [", "1.", "> ", "| x")) for ln in lines)


def test_the_inputs_are_still_readable():
    issue = _issue()
    lines = issue.splitlines()
    target, donor, ticks = [_cells(r) for r in lines if r.startswith("|")][2:]
    assert _recover(target[0].removesuffix(" (target)")) == TARGET
    assert _recover(donor[0].removesuffix(" (donor)")) == DONOR and _recover(ticks[0]) == TICKS
    assert _recover(target[2]) == FLAT and _recover(target[4]) == "16"
    assert _recover(target[3]) == f"{FLAT}, reference voices/{FLAT}.wav"
    text, ref = ticks[3].split(", reference ")
    assert _recover(text) == FLAT and _recover(ref) == "voices/`v`.wav"
    symptom = lines[lines.index("## Symptom") + 2]
    assert _recover(symptom.removesuffix(".")) == FLAT
    assert f"- `repro.py` against {md(H)}: exit 1" in lines and _recover(md(H)) == FLAT
    assert _recover(lines[0].removeprefix("# ")).startswith(FLAT + ": one request's ")


def test_md_fences_code_longer_than_its_backticks_and_escapes_what_code_cannot_hold():
    assert md("hm-08-zh", True) == "`hm-08-zh`" and md("hm-08-zh") == "hm-08-zh"  # plain ids read as before
    assert md("a``b", True) == "```a``b```" and md("`a`", True) == "`` `a` ``"
    assert md("a|b<c>", True) == "a\\|b&lt;c&gt;" and md("two\nlines\r\nthree") == "two lines three"
    assert md("1. first") == "1\\. first" and md("- item") == "\\- item"
