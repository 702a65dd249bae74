"""Does a refactor change what difftest says? The same `difftest run` made by two commits, their
report.json compared with timings, dates, run folders, the store's fingerprint folders and the
version string set aside (issue 59: no behaviour change).

    python benchmarks/report_identity.py --base c582155 [--head HEAD] \
        --run "cases/suites/smoke.yaml --candidate cpu-engine:ref-leak -n 4" [--run ...] --out DIR

Each commit runs from a git worktree of this repository with this checkout's environments (the
worktree's own `difftest` and `runners` come first on the path). Both share one fresh store, so
the reference is computed by the first and read by the second only where the fingerprint agrees.
Prints one JSON object: per run, whether the two reports are the same and the first differences.
Exit 0 all the same, 1 a difference.

Compare runs whose outcome timing does not decide: `cpu-engine:ref-leak` hands every request of a
batch the reference of whichever wrote last, so two runs of one commit fail different segments
(measured: HEAD against HEAD, smoke at 4). Stop 66's comparison, c582155 against 27f2d96, on smoke
at 4: the clean engine, ref-in-output, prompt-padded and prompt-row-moved, all four the same apart
from what produced them (the CPU engine's code hash, its identity key, the commit)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOLATILE = {"created", "difftest_version", "timings", "host", "start_seconds", "cached_segments"}  # the moment's or the machine's
# what produced the run, which differs by construction between two commits: reported, never a difference
PROVENANCE = {".candidate.identity.code", ".candidate.identity_key", ".reference.provenance.commit",
              ".reference.provenance.runner_code", ".reference.fingerprint"}
HEX = re.compile(r"\b[0-9a-f]{16}\b")


def normalise(x, roots: dict[str, str]):
    if isinstance(x, dict):
        return {k: normalise(v, roots) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [normalise(v, roots) for v in x]
    if isinstance(x, str):
        for root, name in roots.items():
            x = x.replace(root, name)
        return HEX.sub("<hash16>", x) if "<" in x else x  # a fingerprint inside a path only
    return x


def differences(a, b, path="", out=None, limit=20):
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            differences(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}", out, limit)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            differences(x, y, f"{path}[{i}]", out, limit)
    elif a != b:
        out.append({"at": path or ".", "base": a, "head": b})
    return out


def run_at(tree: Path, args: list[str], out: Path, store: Path) -> dict:
    argv = [sys.executable, "-m", "difftest", "run", *args, "--out", str(out), "--store", str(store), "--no-mlflow"]
    # this checkout's environments (a worktree has none of its own)
    env = {"DIFFTEST_REFERENCE_PYTHON": str(REPO / ".venv-reference" / "bin" / "python"),
           "DIFFTEST_VLLM_OMNI_PYTHON": str(REPO / ".venv-vllm-omni" / "bin" / "python"), **os.environ}
    r = subprocess.run(argv, cwd=tree, capture_output=True, text=True, env=env)
    report = out / "report.json"
    if not report.exists():
        raise SystemExit(f"{tree}: {' '.join(argv)} wrote no report (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(report.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--run", action="append", required=True, help="a `difftest run` command line after `run`")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    trees = {}
    for side, rev in (("base", a.base), ("head", a.head)):
        trees[side] = a.out / f"tree-{side}"
        if not trees[side].exists():
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(trees[side]), rev], check=True,
                           capture_output=True)
    store = a.out / "store"
    results = []
    for i, line in enumerate(a.run):
        reports = {}
        for side in ("base", "head"):
            out = a.out / f"run{i}" / side
            reports[side] = normalise(run_at(trees[side], shlex.split(line), out, store),
                                      {str(out): "<out>", str(store): "<store>", str(trees[side]): "<repo>"})
        found = differences(reports["base"], reports["head"], limit=200)
        diff = [d for d in found if d["at"] not in PROVENANCE][:20]
        results.append({"run": line, "same": not diff, "verdict": reports["head"].get("verdict"),
                        "segments": len(reports["head"].get("segments", [])), "differences": diff,
                        "provenance": [d["at"] for d in found if d["at"] in PROVENANCE]})
        print(f"{line}: {'same' if not diff else f'{len(diff)}+ differences'}", file=sys.stderr)
    print(json.dumps({"base": a.base, "head": a.head, "runs": results}, indent=1, sort_keys=True, default=str))
    return 0 if all(r["same"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
