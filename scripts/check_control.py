"""Did the negative control catch its planted defect? `difftest selfcheck`'s own judgement of one run:

    .venv/bin/python scripts/check_control.py DEFECT RUN_DIR

Exit 0 when the run failed with the verdict the defect must cause, at the chunk and stage it acts
in, with the right donor (checked against the capture files), and was clean at concurrency 1 where
the defect needs concurrency; else 1, saying what was missed."""

import json
import sys
from pathlib import Path

from difftest.commands.selfcheck import CHECKS, judge


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    defect, out = argv[0], Path(argv[1])
    check = next((c for c in CHECKS if c.defect == defect), None)
    if check is None:
        print(f"no selfcheck for defect {defect!r}", file=sys.stderr)
        return 2
    row = judge(check, json.loads((out / "report.json").read_text()), out)
    where = f"chunk {row['chunk']}, stage {row['stage']}, donor {row['donor']}" + (
        " (right)" if row["donor_right"] else "")
    if row["ok"]:
        print(f"negative control {defect}: caught as {', '.join(v for v in row['verdicts'] if v in check.expect)}"
              f" at {where}; clean at concurrency 1: {row['at_concurrency_1']}")
        return 0
    print(f"negative control {defect}: NOT caught ({row['problem']}); verdicts {row['verdicts']}, {where}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
