"""report.json (design contract 6), the overall verdict and exit code (contract 7), the summary."""

from __future__ import annotations

import datetime as _dt
import json
from collections import Counter
from pathlib import Path

from . import __version__
from .errors import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_INFRA, EXIT_PASS
from .mlflow_records import donor_text
from .policy import VERDICTS, Policy
from .results import atomic_write
from .verdicts import SegmentVerdict

FORMAT = "difftest.report/1"


def overall(verdicts: list[SegmentVerdict], policy: Policy) -> tuple[str, int]:
    """`error` when infrastructure failed a segment (exit 3) or an input was unusable (exit 2);
    else `fail` (exit 1) when the policy says so; else `pass` (exit 0)."""
    kinds = {v.error_kind for v in verdicts if v.verdict == "error"}
    if "infrastructure" in kinds:
        return "error", EXIT_INFRA
    if "bad_input" in kinds:
        return "error", EXIT_BAD_INPUT
    if any(policy.fails(v.verdict) for v in verdicts):
        return "fail", EXIT_FAIL
    return "pass", EXIT_PASS


def build_report(verdicts: list[SegmentVerdict], policy: Policy, *, suite: dict | None = None,
                 reference: dict | None = None, candidate: dict | None = None,
                 concurrency: int | None = None, provenance: dict | None = None,
                 warnings: list[str] | None = None) -> dict:
    verdict, code = overall(verdicts, policy)
    counts = Counter(v.verdict for v in verdicts)
    return {
        "format": FORMAT,
        "difftest_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "suite": suite,
        "reference": reference,
        "candidate": candidate,
        "concurrency": concurrency,
        "provenance": provenance or {},
        "policy": policy.as_dict(),
        "verdict": verdict,
        "exit_code": code,
        "counts": {k: counts[k] for k in VERDICTS if counts[k]},
        "failing": [v.id for v in verdicts if policy.fails(v.verdict)],
        "segments": [v.to_json() for v in verdicts],
        "warnings": list(warnings or []),
    }


def write_report(out_dir: str | Path, report: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    atomic_write(path, (json.dumps(report, indent=1, sort_keys=True, allow_nan=False) + "\n").encode())
    atomic_write(out / "summary.md", summary_markdown(report).encode())
    return path


def summary_lines(report: dict, limit: int = 20) -> list[str]:
    """A short summary for a person: the verdict, counts, then one line per non-clean segment."""
    segs = report["segments"]
    counts = ", ".join(f"{n} {k}" for k, n in report["counts"].items())
    lines = [f"{report['verdict'].upper()}: {len(segs)} segments ({counts})"]
    shown = 0
    for s in segs:
        if s["verdict"] in ("identical", "numeric_drift"):
            continue
        if shown == limit:
            lines.append(f"  ... {sum(1 for x in segs if x['verdict'] not in ('identical', 'numeric_drift')) - limit} more in report.json")
            break
        where = []
        if s["first_divergent_chunk"] is not None:
            where.append(f"chunk {s['first_divergent_chunk']}")
        if s["stage"]:
            where.append(s["stage"])
        if s["donor"]:
            where.append(f"donor {donor_text(s)}")
        lines.append(f"  {s['id']}: {s['verdict']}" + (f" [{', '.join(where)}]" if where else "") + f" {s['summary']}")
        shown += 1
    for w in report.get("warnings", [])[:5]:
        lines.append(f"  warning: {w}")
    return lines


def summary_markdown(report: dict) -> str:
    head = f"## difftest: {report['verdict']}\n\n"
    rows = ["| segment | verdict | chunk | stage | donor | summary |", "|---|---|---|---|---|---|"]
    for s in report["segments"]:
        chunk = "" if s["first_divergent_chunk"] is None else str(s["first_divergent_chunk"])
        summary = s["summary"].replace("|", "\\|")
        rows.append(f"| {s['id']} | {s['verdict']} | {chunk} | {s['stage'] or ''} | {donor_text(s)} | {summary} |")
    return head + "\n".join(summary_lines(report)[:1]) + "\n\n" + "\n".join(rows) + "\n"
