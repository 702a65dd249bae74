"""Whether a run caught a bug-corpus entry: what `difftest bugs` (one run per entry) and its gate
coverage (every entry against every gate cell, difftest/bugs/coverage.py) both ask of a report."""

from __future__ import annotations

from ..verdicts.numerics import compare as compare_numerics
from ..verdicts.policy import Policy, load_policy
from ..verdicts.where import where
from .corpus import Entry

NUMERICS = "numerics_regression"  # a run-level verdict, judged against the release's own run


def judge(entry: Entry, report: dict, control: dict | None = None, policy: Policy | None = None) -> dict:
    """Whether the run caught the entry's bug, and the segment that shows it. `control`: the
    unmodified release's report of the same run (suite, configuration): a segment that gets the
    expected verdict there too is the release's own finding, not the bug's, and catches nothing.
    An entry expecting `numerics_regression` is judged on the run as a whole against `control`, as
    `difftest gate --baseline-version` judges a release against the last one."""
    want = entry.expect
    if want["verdict"] == NUMERICS:
        return _judge_numerics(want, report, control, policy)
    own = {(s["id"], f["verdict"], f.get("stage")) for s in (control or {}).get("segments", []) for f in _findings(s)}
    hits = [(s, f) for s in report["segments"] for f in _findings(s)
            if f["verdict"] == want["verdict"] and f.get("stage") == want["stage"]
            and (f.get("donor") or not want.get("donor")) and (s["id"], f["verdict"], f.get("stage")) not in own]
    got = sorted({f"{s['verdict']}@{s.get('stage') or '-'}" for s in report["segments"]})
    seg, found = hits[0] if hits else (None, None)
    under = found is not None and found is not seg  # named under the segment's top verdict (the release's own)
    return {"caught": report["verdict"] == "fail" and bool(hits), "got": got,
            "segment": seg["id"] if seg else None, "where": where(found) if seg else None,
            "summary": (f"{found['summary']} (under {seg['verdict']}: {seg['summary']})" if under
                        else found["summary"]) if seg else None, "run_verdict": report["verdict"]}


def _findings(seg: dict) -> list[dict]:
    """A report segment's findings: its verdict's, then the others (`also`; absent in older reports)."""
    return [seg, *seg.get("also", [])]


def _judge_numerics(want: dict, report: dict, control: dict | None, policy: Policy | None) -> dict:
    if control is None:  # `bugs --gate` when no entry the release carries ran this cell
        return {"caught": False, "got": ["not judged"], "segment": None, "where": None, "run_verdict": report["verdict"],
                "summary": "a numerics_regression entry is judged against the release's own run of the same cell: none was made"}
    finding = compare_numerics(report, control, (policy or load_policy()).numerics, "the release")
    caught = finding["verdict"] == NUMERICS and finding["stage"] == want["stage"] and (
        not want.get("site") or finding["site"] == want["site"])
    where = f"{finding['stage']} ({finding['site']})" if finding.get("stage") else None
    return {"caught": caught, "got": [f"{finding['verdict']}@{where or '-'}"], "segment": None, "where": where,
            "summary": finding["summary"], "run_verdict": report["verdict"], "numerics": finding}
