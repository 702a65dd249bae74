"""Per-file test durations from a pytest JUnit XML file (setup, call and teardown together).

    python benchmarks/ci_durations.py JUNIT.xml [--write tests/durations.txt] [--top N]

Prints the files, slowest first, with the sum and the two-worker lower bound (the larger of half the
sum and the slowest file). `--write` saves the order conftest.py schedules by: xdist hands out the
slowest files first, so no long file starts last and leaves one worker waiting (docs/ci.md).
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path


def per_file(junit: Path) -> dict[str, float]:
    seconds: collections.Counter[str] = collections.Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = (case.get("classname") or "").split(".")
        name = next((m for m in module if m.startswith("test_")), None)
        if name:
            seconds[f"{name}.py"] += float(case.get("time") or 0)
    return dict(seconds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", type=Path)
    ap.add_argument("--write", type=Path, help="save the files, slowest first, with their seconds")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--workers", type=int, default=3, help="the run's test workers (scripts/test.sh: cores + 1)")
    args = ap.parse_args(argv)
    files = sorted(per_file(args.junit).items(), key=lambda kv: -kv[1])
    total = sum(s for _, s in files)
    for name, s in files[:args.top]:
        print(f"{s:8.1f} s  {name}")
    print(f"{len(files)} files, {total:.0f} s in all; {args.workers} workers need at least "
          f"{max(total / args.workers, files[0][1] if files else 0):.0f} s")
    if args.write:
        args.write.write_text("# seconds per test file, slowest first (benchmarks/ci_durations.py --write)\n"
                              + "".join(f"{s:.0f} {name}\n" for name, s in files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
