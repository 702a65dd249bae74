"""A gate decision for people and CI: JUnit XML (one testcase per segment) and a Markdown
summary short enough for a CI annotation or a job summary."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from ..verdicts.policy import policy_sha256
from ..verdicts.where import donor_text, where
from .mlflow_records import CLEAN, canonical_tags

ORDER = ("error", "regression", "new", "fail", "known", "fixed", "pass")
LABEL = {"error": "error", "regression": "regression", "new": "new failure", "fail": "failing",
         "known": "known failure", "fixed": "fixed", "pass": "passing"}


def _where(seg: dict) -> str:
    return where(seg, stage_word=True)


def _why(row, result) -> str:
    b = result.baseline
    if b is None:
        return ""
    if row.status == "new":
        return f"not in baseline {b.version}"
    if row.baseline_verdict is not None:
        return f"{row.baseline_verdict} in baseline {b.version}"
    return ""


def _details(row, result) -> str:
    s = row.segment
    lines = [f"verdict: {s['verdict']}", f"gate: {LABEL[row.status]}" + (f" ({w})" if (w := _why(row, result)) else "")]
    if s.get("first_divergent_chunk") is not None or s.get("first_divergent_frame") is not None:
        lines.append(f"first divergent chunk: {s.get('first_divergent_chunk')} (frame {s.get('first_divergent_frame')})")
    for k in ("stage", "donor", "donor_kind", "error_kind"):
        if s.get(k):
            lines.append(f"{k}: {s[k]}")
    lines.append(f"summary: {s.get('summary', '')}")
    lines += [f"note: {n}" for n in s.get("notes") or []]
    return "\n".join(lines)


def junit_xml(report: dict, result) -> bytes:
    name = f"difftest.{(report.get('suite') or {}).get('name') or 'adhoc'}"
    n = len(result.segments)
    failures = sum(1 for r in result.segments if r.status != "error" and result.fails(r))
    errors = result.count("error")
    skipped = sum(1 for r in result.segments if r.status == "known" and not result.fails(r))
    num = result.numerics
    if num is not None:
        n, failures = n + 1, failures + bool(num["fails"])
    counts = {"tests": str(n), "failures": str(failures), "errors": str(errors), "skipped": str(skipped)}
    root = ET.Element("testsuites", name="difftest", **counts)
    suite = ET.SubElement(root, "testsuite", name=name, timestamp=str(report.get("created", "")), **counts)
    props = ET.SubElement(suite, "properties")
    info = {"gate.verdict": result.verdict, **canonical_tags(report)}  # canonical `verdict` is the report's
    if result.policy_sha256:  # the policy the gate judged with
        info.update({"gate.policy": result.policy_source, "gate.policy.sha256": result.policy_sha256})
    if result.baseline:
        info.update({"baseline.version": result.baseline.version, "baseline.run_id": result.baseline.run_id})
    for k, v in info.items():
        ET.SubElement(props, "property", name=k, value=str(v))
    for row in result.segments:
        s = row.segment
        case = ET.SubElement(suite, "testcase", classname=name, name=s["id"])
        where = _where(s)
        message = f"{s['verdict']}" + (f" at {where}" if where else "") + f": {s.get('summary', '')}"
        if row.status == "error":
            ET.SubElement(case, "error", type=s["verdict"], message=message[:1000]).text = _details(row, result)
        elif result.fails(row):
            why = _why(row, result)
            ET.SubElement(case, "failure", type=s["verdict"],
                          message=(f"{LABEL[row.status]}: " if result.baseline else "") + message[:1000]
                          + (f" ({why})" if why else "")).text = _details(row, result)
        elif row.status == "known":
            ET.SubElement(case, "skipped", message=f"known failure ({_why(row, result)}): {message[:1000]}")
        elif s["verdict"] not in CLEAN or row.status == "fixed":
            ET.SubElement(case, "system-out").text = _details(row, result)
    if num is not None:  # the run against the baseline's numerics: one more testcase
        case = ET.SubElement(suite, "testcase", classname=name, name=f"numerics against {result.baseline.version}")
        if num["verdict"] == "numerics_regression":
            tag = "failure" if num["fails"] else "system-out"
            el = ET.SubElement(case, tag, **({"type": num["verdict"], "message": num["summary"][:1000]} if tag == "failure" else {}))
            el.text = numerics_line(num)
        else:
            ET.SubElement(case, "system-out").text = numerics_line(num)
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def numerics_line(num: dict) -> str:
    where = f" at the {num['stage']} ({num['site'].replace('_', ' ')})" if num.get("stage") else ""
    return f"numerics: {num['verdict']}{where}: {num['summary']}"


def headline(report: dict, result) -> list[str]:
    """Three lines: the decision with counts, what was gated, and the baseline (and, with a
    baseline, a fourth: the numerics against it)."""
    counts = ", ".join(f"{result.count(st)} {LABEL[st]}" for st in ORDER if result.count(st))
    t = canonical_tags(report)
    suite = t.get("suite.name", "adhoc") + (f" ({t['suite.hash'][:12]})" if "suite.hash" in t else "")
    label, version = t.get("candidate.label", "?"), t.get("candidate.version")
    if version and version in label.split():  # "vllm-omni 0.30.0" already says it
        version = None
    what = " ".join(filter(None, ["candidate", label, version,
                                  f"at concurrency {t.get('concurrency', '?')}",
                                  f"on {t['device']}" if "device" in t else None]))
    b = result.baseline
    lines = [f"GATE {result.verdict.upper()}: {len(result.segments)} segments of suite {suite}: {counts}", what,
             f"baseline: candidate {b.version}, run {b.run_id} of {b.started} (verdict {b.verdict})"
             if b else "baseline: none"]
    return lines + ([numerics_line(result.numerics)] if result.numerics is not None else [])


def policy_lines(report: dict, policy) -> list[str]:
    """The policy the gate judged with (its file and the sha256 of its values); the run's, where its
    values differ (the segment verdicts are the run's policy's: the gate applies only its own
    fail_on and baseline sections); and the gate policy's warnings (a fail_on that lets defects pass)."""
    lines = [f"policy: {policy.source} (sha256 {policy.sha256})"
             + ("; known failures fail" if policy.known_failures_fail else "")]
    run = report.get("policy")
    if isinstance(run, dict) and policy_sha256(run) != policy.sha256:
        lines.append(f"the run judged its segments under another policy: {run.get('source') or '(unnamed)'} "
                     f"(sha256 {policy_sha256(run)}); this gate applied its own fail_on and baseline sections only")
    return lines + [f"WARNING: {w}" for w in policy.warnings()]


def markdown(report: dict, result, policy, rows: int = 50) -> str:
    title, what, baseline, *numerics = headline(report, result)
    icon = {"pass": "✅", "fail": "❌", "error": "⚠️"}[result.verdict]
    out = [f"## {icon} difftest gate: {result.verdict}", "", title.split(": ", 1)[1], "",
           what + "  ", baseline + "  ",  # two trailing spaces: a Markdown line break
           *(n + "  " for n in numerics),
           *(line + "  " for line in policy_lines(report, policy)), ""]
    shown = sorted((r for r in result.segments if r.status != "pass" or r.segment["verdict"] not in CLEAN),
                   key=lambda r: ORDER.index(r.status))
    if not shown:
        return "\n".join(out + ["Every segment is clean."]) + "\n"
    out += ["| segment | gate | verdict | chunk | stage | donor | summary |", "|---|---|---|---|---|---|---|"]
    for r in shown[:rows]:
        s = r.segment
        chunk = "" if s.get("first_divergent_chunk") is None else str(s["first_divergent_chunk"])
        summary = str(s.get("summary", "")).replace("|", "\\|").replace("\n", " ")
        gate = f"**{LABEL[r.status]}**" if result.fails(r) or r.status == "error" else LABEL[r.status]
        out.append(f"| {s['id']} | {gate} | {s['verdict']} | {chunk} | {s.get('stage') or ''} | "
                   f"{donor_text(s)} | {summary} |")
    if len(shown) > rows:
        out.append(f"\n{len(shown) - rows} more in report.json")
    return "\n".join(out) + "\n"
