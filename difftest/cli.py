"""The `difftest` command. Exit codes follow the design's contract 7:
0 pass, 1 a divergence the policy calls a failure, 2 bad input or usage, 3 infrastructure failure."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from . import __version__
from .errors import EXIT_BAD_INPUT, EXIT_INFRA, DifftestError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors are bad input: exit 2, as argparse does, with our wording
        self.print_usage(sys.stderr)
        print(f"difftest: error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def _chunks(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
        if a <= 0 or b <= 0:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected INITIAL,FRAMES (positive integers), got {text!r}") from None
    return a, b


def cmd_compare(args) -> int:
    from .compare_sets import compare_result_sets
    from .policy import load_policy
    from .report import summary_lines, write_report

    policy = load_policy(args.policy)
    report = compare_result_sets(args.reference, args.candidate, policy, control_dir=args.control,
                                 initial_frames=args.chunks[0], chunk_frames=args.chunks[1])
    path = write_report(args.out, report)
    _print_summary(summary_lines(report), path, args)
    return report["exit_code"]


def cmd_validate(args) -> int:
    from .suite import load_suite

    for p in args.suites:
        s = load_suite(p)
        tasks = sorted({seg.task for seg in s.segments})
        print(f"{s.path.name}: ok: suite {s.name}, {len(s.segments)} segments, {len(s.voices)} voices, "
              f"tasks {', '.join(tasks)}, hash {s.hash[:12]}")
    return 0


def _print_summary(lines, path, args):
    if getattr(args, "json", False):
        print(json.dumps({"report": str(path)}))
    else:
        print("\n".join(lines))
        print(f"report: {path}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="difftest", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"difftest {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    c = sub.add_parser("compare", help="compare two result sets and write report.json")
    c.add_argument("reference", help="directory of reference results")
    c.add_argument("candidate", help="directory of candidate results (at concurrency N)")
    c.add_argument("--control", help="directory of candidate results at concurrency 1")
    c.add_argument("--out", required=True, help="where report.json and summary.md go")
    c.add_argument("--policy", help="policy YAML (default: the built-in difftest/default_policy.yaml)")
    c.add_argument("--chunks", type=_chunks, default=(1, 25), metavar="INITIAL,FRAMES",
                   help="the candidate's chunk schedule in frames (default 1,25)")
    c.add_argument("--json", action="store_true", help="print only the report path as JSON")
    c.set_defaults(func=cmd_compare)

    v = sub.add_parser("validate", help="validate suite files")
    v.add_argument("suites", nargs="+")
    v.set_defaults(func=cmd_validate)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="difftest: %(levelname)s: %(message)s")
    try:
        return args.func(args)
    except DifftestError as e:
        print(f"difftest: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("difftest: interrupted; finished results are kept", file=sys.stderr)
        return EXIT_INFRA


if __name__ == "__main__":
    sys.exit(main())
