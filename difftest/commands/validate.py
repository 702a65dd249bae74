"""`difftest validate SUITE`: a suite file checked, nothing run (difftest/suites/suite.py)."""

from __future__ import annotations

import argparse

from ..suites.suite import load_suite


def cmd_validate(args) -> int:
    for p in args.suites:
        s = load_suite(p)
        tasks = sorted({seg.task for seg in s.segments})
        print(f"{s.path.name}: ok: suite {s.name}, {len(s.segments)} segments, {len(s.voices)} voices, "
              f"tasks {', '.join(tasks)}, hash {s.hash[:12]}")
    return 0


def add_validate_parser(subparsers) -> argparse.ArgumentParser:
    v = subparsers.add_parser("validate", help="validate suite files")
    v.add_argument("suites", nargs="+")
    v.set_defaults(func=cmd_validate)
    return v
