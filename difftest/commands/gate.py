"""`difftest gate OUT`: the CI decision on a run, with the exit codes of contract 7 (docs/architecture.md).

The command's parser and handler; the work is difftest/records/gate.py's."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import BadInput
from ..records.gate import decide, load_baseline
from ..records.gate_output import headline, junit_xml, markdown, policy_lines
from ..records.tracking import read_report
from ..results import atomic_write
from ..verdicts.policy import load_policy, out_of_bounds


def main_gate(args) -> int:
    out = Path(args.out)
    report, _ = read_report(out)
    if not report.get("segments"):
        raise BadInput(f"{out / 'report.json'}: no segments to gate on")
    if problems := out_of_bounds(report.get("policy")):  # its verdicts rest on a tolerance that accepts anything
        raise BadInput(f"{out / 'report.json'}: the run was judged under a policy out of bounds: {'; '.join(problems)}")
    policy = load_policy(args.policy)
    baseline = load_baseline(out, args.baseline_version, policy, args.tracking_uri) if args.baseline_version else None
    result = decide(report, policy, baseline)
    junit = Path(args.junit) if args.junit else out / "junit.xml"
    md = Path(args.markdown) if args.markdown else out / "gate.md"
    for path, data in ((junit, junit_xml(report, result)), (md, markdown(report, result, policy).encode())):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)
    print("\n".join(headline(report, result) + policy_lines(report, policy)))
    print(f"junit: {junit}\nmarkdown: {md}")
    return result.exit_code


def add_gate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gate", help="decide pass/fail for CI from a run's report, optionally against a baseline",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="a difftest output folder (holds report.json)")
    p.add_argument("--policy", help="policy YAML (default: the built-in difftest/verdicts/default_policy.yaml)")
    p.add_argument("--baseline-version", metavar="V", help="compare with the latest logged run of candidate version V")
    p.add_argument("--tracking-uri", help="MLflow tracking URI for the baseline "
                                          "(default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--junit", metavar="PATH", help="JUnit XML output (default: OUT/junit.xml)")
    p.add_argument("--markdown", metavar="PATH", help="Markdown summary output (default: OUT/gate.md)")
    p.set_defaults(func=main_gate)
    return p
