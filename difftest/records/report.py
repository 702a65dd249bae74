"""report.json, the overall verdict and exit code, the summary (contracts 6 and 7, docs/architecture.md)."""

from __future__ import annotations

import datetime as _dt
import json
import sys
from collections import Counter
from pathlib import Path

from .. import __version__
from ..errors import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_INFRA, EXIT_PASS, BadInput
from ..results import atomic_write
from ..verdicts.catalogue import CLEAN, VERDICTS
from ..verdicts.classify import SegmentVerdict
from ..verdicts.policy import RUN_VERDICTS, Policy
from ..verdicts.where import donor_text, where

FORMAT = "difftest.report/1"


def overall(verdicts: list[SegmentVerdict], policy: Policy, run_findings: list | tuple = ()) -> tuple[str, int]:
    """`error` when infrastructure failed a segment (exit 3) or an input was unusable (exit 2);
    else `fail` (exit 1) when the policy says so of a segment's verdict or a run-level finding
    (`{"verdict": ...}`, e.g. the sampling test); else `pass` (exit 0)."""
    kinds = {v.error_kind for v in verdicts if v.verdict == "error"}
    if "infrastructure" in kinds or any(f["verdict"] == "error" for f in run_findings):
        return "error", EXIT_INFRA  # a run-level finding that could not be made (the measured null missing)
    if "bad_input" in kinds:
        return "error", EXIT_BAD_INPUT
    if any(policy.fails(v.verdict) for v in verdicts) or any(policy.fails(f["verdict"]) for f in run_findings):
        return "fail", EXIT_FAIL
    return "pass", EXIT_PASS


def build_report(verdicts: list[SegmentVerdict], policy: Policy, *, suite: dict | None = None,
                 reference: dict | None = None, candidate: dict | None = None,
                 concurrency: int | None = None, provenance: dict | None = None,
                 warnings: list[str] | None = None, sampling: dict | None = None, null: dict | None = None,
                 null_n: dict | None = None, configuration: dict | None = None,
                 served_configuration: dict | None = None) -> dict:
    """`sampling`: the run-level sampling test (difftest/verdicts/sampling.py), None when nothing was
    sampled; `null`: the measured null's test at concurrency 1 (difftest/verdicts/null.py), None when
    nothing was greedy; `null_n`: its test of the run at N (null.judge_at_n), None at concurrency 1;
    `configuration`: whether what the candidate was configured to run ran (verdicts/exercised.py),
    None when nothing needed showing; `served_configuration`: how the candidate's deploy settings differ
    from the release's deploy file (difftest.engines.deploy_diff), report.json's `configuration`,
    None for a candidate difftest did not configure."""
    verdict, code = overall(verdicts, policy, [f for f in (sampling, null, null_n, configuration) if f])
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
        "sampling": sampling,
        "measured_null": null,
        "measured_null_at_n": null_n,
        "configuration_exercised": configuration,
        "configuration": served_configuration,
        "warnings": list(warnings or []),
    }


# The fields a consumer of report.json (gate, log, dashboard) relies on, with their types.
_SEGMENT_FIELDS = {"id": (str,), "verdict": (str,), "summary": (str,), "first_divergent_frame": (int, type(None)),
                   "first_divergent_chunk": (int, type(None)), "stage": (str, type(None)),
                   "donor": (str, type(None)), "notes": (list,), "comparisons": (dict,), "artifacts": (dict,),
                   "also": (list,)}
_TOP_FIELDS = {"verdict": (str,), "segments": (list,), "suite": (dict, type(None)), "candidate": (dict, type(None)),
               "reference": (dict, type(None)), "concurrency": (int, type(None)), "provenance": (dict,),
               "counts": (dict,), "warnings": (list,), "sampling": (dict, type(None)),
               "measured_null": (dict, type(None)), "measured_null_at_n": (dict, type(None)),
               "configuration": (dict, type(None))}
_DIFFERENCE_FIELDS = ("key", "production", "served", "why")


def check_report(report, where: str | Path) -> dict:
    """A report read back from disk, checked field by field; BadInput names the field."""
    def bad(field, problem):
        raise BadInput(f"{where}: {field}: {problem}")

    if not isinstance(report, dict) or not str(report.get("format", "")).startswith("difftest.report/"):
        bad("format", "not a difftest report")
    for name, types in _TOP_FIELDS.items():
        if name in report and not isinstance(report[name], types):
            bad(name, f"expected {' or '.join(t.__name__ for t in types)}, got {type(report[name]).__name__}")
    served = report.get("configuration") or {}
    if not isinstance(served.get("differences", []), list):
        bad("configuration.differences", "expected a list")
    for i, d in enumerate(served.get("differences") or []):
        if not isinstance(d, dict) or any(k not in d for k in _DIFFERENCE_FIELDS):
            bad(f"configuration.differences[{i}]", f"expected a mapping with {', '.join(_DIFFERENCE_FIELDS)}")
        if not isinstance(d["key"], str) or not isinstance(d["why"], str) or not d["why"]:
            bad(f"configuration.differences[{i}]", "expected a key and a reason (texts)")
    if report.get("verdict") not in (*RUN_VERDICTS, None):
        bad("verdict", f"unknown run verdict {report.get('verdict')!r}")
    for i, seg in enumerate(report.get("segments") or []):
        if not isinstance(seg, dict):
            bad(f"segments[{i}]", "expected a mapping")
        for name, types in _SEGMENT_FIELDS.items():
            if name in ("id", "verdict") and name not in seg:
                bad(f"segments[{i}].{name}", "missing")
            if name in seg and (not isinstance(seg[name], types) or isinstance(seg[name], bool)):
                bad(f"segments[{i}].{name}",
                    f"expected {' or '.join(t.__name__ for t in types)}, got {type(seg[name]).__name__}")
        if seg["verdict"] not in VERDICTS:
            bad(f"segments[{i}].verdict", f"unknown verdict {seg['verdict']!r}")
    return report


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
    sampling = report.get("sampling")
    if sampling:
        lines.append(f"  sampling: {sampling['verdict']}: {sampling['summary']}")
    for key, name in (("measured_null", "measured null"), ("measured_null_at_n", "measured null at N"),
                      ("configuration_exercised", "configuration")):
        null = report.get(key)
        if null and null["verdict"] != "pass":
            lines.append(f"  {name}: {null['verdict']}: {null['summary']}")
    shown = 0
    for s in segs:
        if s["verdict"] in CLEAN:
            continue
        if shown == limit:
            lines.append(f"  ... {sum(1 for x in segs if x['verdict'] not in ('identical', 'numeric_drift')) - limit} more in report.json")
            break
        at = where(s)
        lines.append(f"  {s['id']}: {s['verdict']}" + (f" [{at}]" if at else "") + f" {s['summary']}")
        lines += [f"    also {f['verdict']}" + (f" [{w}]" if (w := where(f)) else "") + f" {f['summary']}"
                  for f in s.get("also", []) if f["verdict"] not in CLEAN and f["verdict"] != s["verdict"]]
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


def print_summary(report: dict, out: Path, stream=sys.stdout) -> None:
    print("\n".join(summary_lines(report)), file=stream)
    one = report.get("at_concurrency_1")
    if one and report.get("concurrency", 1) > 1:
        bad = [s["id"] for s in one["segments"] if s["verdict"] not in CLEAN]
        print(f"  at concurrency 1 alone: {one['verdict']}" + (f" ({', '.join(bad)} not clean)" if bad else ""),
              file=stream)
    print(f"report: {Path(out) / 'report.json'}", file=stream)
