"""`difftest log OUT`: a run's report and evidence into MLflow.

The command's parser and handler; the work is difftest/records/tracking.py's."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import EXIT_INFRA, EXIT_PASS
from ..records.tracking import log_run_outcome, read_state


def _tag(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def main_log(args) -> int:
    run_id, uri = log_run_outcome(args.out, args.tracking_uri, experiment=args.experiment, tags=dict(args.tag))
    if run_id is None:
        return EXIT_INFRA
    state = read_state(Path(args.out))
    exp_id = next((r["experiment_id"] for r in state["runs"] if r["run_id"] == run_id), None)
    where = f"{uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}" if uri.startswith("http") else uri
    print(f"logged {args.out}: MLflow run {run_id} ({where})")
    return EXIT_PASS


def add_log_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("log", help="log a run's report, metrics and diverged audio to MLflow",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="a difftest output folder (holds report.json)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the URI of "
                                          "a pending upload, else sqlite:///<cwd>/mlflow.db with artifacts in ./mlruns)")
    p.add_argument("--experiment", help="experiment name (default: difftest/<suite name>, or difftest/adhoc)")
    p.add_argument("--tag", type=_tag, action="append", default=[], metavar="KEY=VALUE",
                   help="an extra tag on the parent run; overrides one taken from the report (repeatable)")
    p.set_defaults(func=main_log)
    return p
