"""`difftest bugs`: the bug corpus run and judged (difftest/bugs/)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..bugs.corpus import DEFAULT_CORPUS, load_corpus
from ..bugs.run import FORMAT, exit_code, run_entries, table
from ..engines.reference import ReferenceOptions
from ..errors import BadInput
from ..results import atomic_write
from ..run import RunOptions
from ..verdicts.policy import load_policy


def cmd_bugs(args) -> int:
    only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only is not None else None
    if only == []:  # `--only ","` or `--only ""`: a selection of nothing, not the whole corpus
        raise BadInput(f"--only {args.only!r}: names no entry (give entry ids, comma-separated)")
    entries = load_corpus(Path(args.corpus), only)
    if not entries:
        raise BadInput(f"no entries in {args.corpus}")
    policy = load_policy(args.policy)
    opts = RunOptions(store=Path(args.store),
                      reference=ReferenceOptions(python=args.reference_python))
    if args.vllm_omni_python:
        base = Path(args.vllm_omni_python)
    else:
        from ..engines.vllm_omni import omni_python

        base = omni_python()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.gate:
        from ..commands.matrix import load_matrix
        from .coverage import run_coverage

        return run_coverage(entries, load_matrix(args.gate), out, policy, opts, base)

    def save(rows, done=False):
        atomic_write(out / "bugs.json", json.dumps({
            "format": FORMAT, "corpus": str(Path(args.corpus).resolve()), "complete": done,
            "exit_code": exit_code(rows) if done else None, "entries": rows}, indent=1, sort_keys=True).encode())

    rows = run_entries(entries, out, policy, opts, base, args.tracking_uri, not args.no_mlflow, save=save)
    code = exit_code(rows)
    save(rows, done=True)
    print(table(rows))
    print(f"table: {out / 'bugs.json'}")
    return code


def add_bugs_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bugs", help="re-create real vLLM-Omni bugs in a release and check that difftest catches each",
        description="For each entry of the bug corpus (cases/bugs/<id>/bug.yaml): the release's vLLM-Omni with the "
                    "entry's patch as an overlay environment (seconds), a `difftest run` of its suite against it, "
                    "and whether the expected verdict, stage and donor came out. Exit 0: every entry caught (or a "
                    "known miss); 1: an entry missed; 2: bad input; 3: a run could not be made.")
    p.add_argument("--out", required=True, help="folder: one run folder per entry, bugs.json, logs")
    p.add_argument("--only", help="comma-separated entry ids (default: all)")
    p.add_argument("--gate", metavar="FILE", help="run every entry through every cell of this gate (cases/gates/*.yaml) "
                                                  "instead of its own run: OUT/coverage.json, the entry x cell table and "
                                                  "the smallest set of cells that catches every entry (difftest/bugs/coverage.py)")
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="corpus folder (default cases/bugs)")
    p.add_argument("--vllm-omni-python", help="the release environment's interpreter (default .venv-vllm-omni)")
    p.add_argument("--store", default=os.environ.get("DIFFTEST_STORE", "difftest-store"),
                   help="reference result store (default ./difftest-store or $DIFFTEST_STORE)")
    p.add_argument("--policy", help="policy YAML (default: the built-in one)")
    p.add_argument("--reference-python", help="the reference environment's interpreter")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.set_defaults(func=cmd_bugs)
    return p
