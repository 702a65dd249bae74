"""`difftest bugs --gate FILE`: which cells of a release gate catch which bug of the corpus.

    difftest bugs --gate cases/gates/cpu.yaml --out OUT [--only ID,...]

Every runnable corpus entry is run through every cell of the gate (difftest.commands.matrix): its
mutant (built once per entry) served with the cell's configuration, the cell's suite at the cell's
concurrency, arrivals and voices, judged as `difftest bugs` judges the entry's own run (the
expected verdict at the expected stage, and a donor where one enters). The cell decides how the
candidate serves (async chunks, engine arguments); from the entry's own `run.config` only the
capacity settings travel (`*_max_model_len`, `*_kv_cache_bytes`: a release is served with room
for its requests), so an entry that needs, say, async chunks is caught only by cells that turn
them on. A cell whose candidate is not the entry's kind (the CPU test engine, the offline API
for a server bug) is not applicable.

OUT/coverage.json (stable JSON, rewritten after each run: a stopped table keeps what it has, and
the same command goes on from there) holds the entry x cell table, and the smallest set of cells
that catches every entry any cell catches (the cheapest such set, by the cells' measured seconds,
where several are as small). A short table goes to stdout.

Exit: 0 every runnable entry is caught by some cell (or is a known miss); 1 an entry no cell
catches; 2 bad input; 3 a run could not be made.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from ..engines.engine_args import parse
from ..engines.reference import ReferenceOptions, reference_python
from ..engines.start import CandidateSpec
from ..errors import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_INFRA, EXIT_PASS, BadInput, DifftestError
from ..pipeline.starting import resolve_models, start_reference_runner
from ..results import atomic_write
from ..run import RunOptions, run
from ..suites.suite import load_suite
from .corpus import Entry
from .judge import judge
from .mutant import mutant_env

FORMAT = "difftest.bugs-coverage/1"
CAPACITY = ("_max_model_len", "_kv_cache_bytes")  # entry settings that travel into every cell
EXACT_UP_TO = 20  # cells: above this the smallest set is found greedily (2^20 subsets is enough)


def applicable(entry: Entry, cell: dict) -> bool:
    """A cell can catch an entry when it serves the entry's kind of candidate (its API) and its model
    family (a Qwen3-TTS cell never runs Qwen3-Omni's code)."""
    same_family = "suite" not in cell or load_suite(Path(cell["suite"])).family is load_suite(entry.suite).family
    return CandidateSpec.parse(cell["candidate"]).is_ is CandidateSpec.parse(entry.candidate).is_ \
        and CandidateSpec.parse(cell["candidate"]).api == CandidateSpec.parse(entry.candidate).api and same_family


def capacity(entry: Entry) -> dict:
    return {k: v for k, v in entry.config.items() if k.endswith(CAPACITY)}


def cell_key(cell: dict) -> dict:
    """What a cell's run is made of: a stored row is reused only when this is the same."""
    return {k: cell.get(k) for k in ("suite", "candidate", "concurrency", "engine_args", "pattern", "order", "voices")}


def minimal_cells(table: dict[str, dict[str, str]], seconds: dict[str, float]) -> tuple[list[str], list[str]]:
    """(the smallest set of cells that catches every entry some cell catches, those entries no cell
    catches); among equally small sets the one with the fewest measured seconds, then by name."""
    cells = sorted({c for row in table.values() for c in row})
    catches = {c: {e for e, row in table.items() if row.get(c) == "caught"} for c in cells}
    want = set().union(*catches.values()) if catches else set()
    never = sorted(e for e in table if e not in want)
    if not want:
        return [], never
    useful = [c for c in cells if catches[c]]

    def cost(combo) -> tuple:
        return (len(combo), sum(seconds.get(c, 0.0) for c in combo), combo)

    if len(useful) <= EXACT_UP_TO:
        for k in range(1, len(useful) + 1):
            found = [combo for combo in itertools.combinations(useful, k)
                     if set().union(*(catches[c] for c in combo)) == want]
            if found:
                return list(min(found, key=cost)), never
    chosen, left = [], set(want)  # greedy: the cell that catches most of what is left
    while left:
        best = max(useful, key=lambda c: (len(catches[c] & left), -seconds.get(c, 0.0), c))
        chosen.append(best)
        left -= catches[best]
    return sorted(chosen), never


def exit_code(entries: list[Entry], rows: list[dict], never: list[str]) -> int:
    known = {e.id for e in entries if e.known_miss}
    if [e for e in never if e not in known]:
        return EXIT_FAIL
    codes = [r["exit_code"] for r in rows if r["status"] == "error"]
    return min(codes) if codes else EXIT_PASS


def text_table(entry_ids: list[str], cells: list[dict], table: dict) -> str:
    mark = {"caught": "caught", "missed": "-", "n/a": "n/a", "error": "ERROR", None: "?"}
    head = ["bug", *[c["cell"] for c in cells]]
    lines = [head] + [[e, *[mark.get(table.get(e, {}).get(c["cell"]), "?") for c in cells]] for e in entry_ids]
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(x[i].ljust(widths[i]) for i in range(len(head))).rstrip() for x in lines)


def run_coverage(entries: list[Entry], matrix, out: Path, policy, opts: RunOptions, base_python: Path,
                 stream=sys.stderr) -> int:
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    state = out / "coverage.json"
    old, kept, kept_entries = {}, [], []
    chosen_ids = {e.id for e in entries}
    if state.is_file():  # the same command again: rows whose run is the same are kept
        try:
            prior = json.loads(state.read_text(encoding="utf-8"))
            old = {(r["entry"], r["cell"]): r for r in prior.get("runs", []) if r.get("status") in ("caught", "missed")}
            # entries this command does not run (--only): their rows stay in the table, as they were
            kept = [r for r in prior.get("runs", []) if r["entry"] not in chosen_ids
                    and r.get("status") in ("caught", "missed", "n/a")]
            kept_entries = [e for e in prior.get("entries", []) if e["id"] in {r["entry"] for r in kept}]
            expects = {e["id"]: e.get("expect") or {} for e in kept_entries}
            kept = [_judged_again(r["entry"], expects[r["entry"]], r["cell"], r, out)
                    if r.get("status") in ("caught", "missed") and r["entry"] in expects else r for r in kept]
        except (OSError, ValueError, KeyError, TypeError):
            old, kept, kept_entries = {}, [], []
    rows: list[dict] = []
    started = time.time()
    python = reference_python(opts.reference.python)
    cells = matrix.cells

    def summary(done: bool) -> dict:
        table = {e.id: {} for e in entries if e.cpu} | {e["id"]: {} for e in kept_entries}
        for r in kept + rows:
            table[r["entry"]][r["cell"]] = r["status"]
        seconds: dict[str, float] = {}
        for r in kept + rows:
            if r["status"] in ("caught", "missed"):
                seconds[r["cell"]] = seconds.get(r["cell"], 0.0) + r.get("seconds", 0.0)
        runs = {c: sum(1 for r in kept + rows if r["cell"] == c and r["status"] in ("caught", "missed")) for c in seconds}
        mean = {c: round(seconds[c] / runs[c], 1) for c in seconds if runs[c]}
        chosen, never = minimal_cells(table, mean)
        return {"format": FORMAT, "gate": str(matrix.path), "gate_name": matrix.name, "complete": done,
                "exit_code": exit_code(entries, rows, [e for e in never if e not in {k["id"] for k in kept_entries
                                                                                     if k.get("known_miss")}])
                if done else None,
                "seconds": round(time.time() - started, 1),
                "cells": [{"cell": c["cell"], **cell_key(c), "covers": c.get("covers") or [],
                           "mean_run_seconds": mean.get(c["cell"])} for c in cells],
                "entries": [{"id": e.id, "upstream": e.upstream_label, "expect": e.expect, "cpu": e.cpu,
                             "known_miss": e.known_miss} for e in entries] + kept_entries,
                "table": table, "minimal_cells": chosen, "minimal_cells_seconds": round(sum(mean.get(c, 0) for c in chosen), 1),
                "caught_by_no_cell": never, "runs": kept + rows}

    def save(done=False) -> dict:
        s = summary(done)
        atomic_write(state, json.dumps(s, indent=1, sort_keys=True).encode())
        return s

    with ExitStack() as stack:
        runners: dict[tuple, object] = {}
        entries = sorted(entries, key=lambda e: not e.release_carries_bug)  # the release's runs first: controls
        for i, e in enumerate(entries, 1):
            if not e.cpu:
                continue
            todo = []
            for c in cells:
                row = {"entry": e.id, "cell": c["cell"], "run": cell_key(c)}
                if not applicable(e, c):
                    rows.append({**row, "status": "n/a"})
                elif (e.id, c["cell"]) in old and old[(e.id, c["cell"])].get("run") == cell_key(c):
                    rows.append(_judged_again(e.id, e.expect, c["cell"], {**old[(e.id, c["cell"])], "reused": True},
                                              out))
                else:
                    todo.append((c, row))
            save()
            if not todo:
                continue
            print(f"coverage {i}/{len(entries)} {e.id}: " + ("the release itself carries it" if e.release_carries_bug
                                                               else "building the mutant"), file=stream, flush=True)
            try:
                with ExitStack() as held:
                    cand_python = base_python if e.release_carries_bug else held.enter_context(
                        mutant_env(e, base_python, out / "logs" / f"{e.id}-build.log"))
                    for c, row in todo:
                        t0 = time.perf_counter()
                        print(f"coverage {e.id} x {c['cell']}: running", file=stream, flush=True)
                        try:
                            report = _run_cell(e, c, cand_python, out, policy, opts, python, runners, stack)
                            control = None if e.release_carries_bug else release_report(out, c["cell"])
                            got = judge(e, report, control, policy)
                            row.update(status="caught" if got["caught"] else "missed", where=got["where"],
                                       got=got["got"], segment=got["segment"], run_verdict=got["run_verdict"],
                                       control=bool(control))
                        except DifftestError as err:
                            row.update(status="error", error=str(err).splitlines()[0],
                                       exit_code=EXIT_BAD_INPUT if isinstance(err, BadInput) else EXIT_INFRA)
                            runners.clear()  # a runner that failed is not handed on
                        row["seconds"] = round(time.perf_counter() - t0, 1)
                        rows.append(row)
                        save()
                        print(f"coverage {e.id} x {c['cell']}: {row['status']} in {row['seconds']:.0f} s",
                              file=stream, flush=True)
            except DifftestError as err:  # the mutant did not build: every cell of the entry says so
                for c, row in todo:
                    if not any(r is row for r in rows):
                        rows.append({**row, "status": "error", "error": str(err).splitlines()[0],
                                     "exit_code": EXIT_BAD_INPUT if isinstance(err, BadInput) else EXIT_INFRA})
                save()
    s = save(done=True)
    print(text_table(sorted(s["table"]), cells, s["table"]))
    if s["minimal_cells"]:
        print(f"smallest gate that catches every entry a cell catches: {', '.join(s['minimal_cells'])} "
              f"(about {s['minimal_cells_seconds']:.0f} s of runs here)")
    if s["caught_by_no_cell"]:
        print(f"caught by no cell: {', '.join(s['caught_by_no_cell'])}")
    print(f"table: {state}")
    return s["exit_code"]


def release_report(out: Path, cell: str) -> dict | None:
    """The unmodified release's report of `cell` in this table, when an entry the release itself
    carries (no patch: its runs are the release's) has run it; else None."""
    for path in sorted(out.glob(f"*/{cell}/report.json")):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if _is_release(report):
            return report
    return None


def _is_release(report: dict) -> bool:
    versions = (report.get("candidate") or {}).get("versions") or {}
    return "vllm_omni_mutant" in versions and versions["vllm_omni_mutant"] is None


def _judged_again(entry_id: str, expect: dict, cell: str, row: dict, out: Path) -> dict:
    """A stored row judged again from its report on disk, against the release's report of the
    cell (which may have run after it); as it was when its report is missing."""
    from types import SimpleNamespace

    try:
        report = json.loads((out / entry_id / cell / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return row
    control = None if _is_release(report) else release_report(out, cell)
    got = judge(SimpleNamespace(expect=expect), report, control)
    return {**row, "status": "caught" if got["caught"] else "missed", "where": got["where"], "got": got["got"],
            "segment": got["segment"], "run_verdict": got["run_verdict"], "control": bool(control)}


def _run_cell(e: Entry, cell: dict, cand_python: Path, out: Path, policy, opts: RunOptions, python: Path,
              runners: dict, stack: ExitStack) -> dict:
    suite = load_suite(Path(cell["suite"]))
    top, stages = parse(cell["engine_args"])
    c_opts = replace(opts, concurrency=cell["concurrency"], pattern=cell.get("pattern") or "barrier",
                     order=cell.get("order") or "suite", voice_mode=cell.get("voices") or "inline", replace=True,
                     vllm_omni={**opts.vllm_omni, "deploy_overrides": top, "stage_overrides": stages})
    models = resolve_models(suite, c_opts, python)
    if tuple(models) not in runners:
        ref_opts = ReferenceOptions(**{**opts.reference.__dict__, "models": models})
        runner = start_reference_runner(python, models, ref_opts, out / "logs" / "reference-runner.log",
                                               suite.family)
        stack.callback(runner.close)
        runners[tuple(models)] = runner
    spec = replace(CandidateSpec.parse(cell["candidate"]), python=str(cand_python), options=capacity(e))
    return run(suite, spec, out / e.id / cell["cell"], policy, c_opts, runner=runners[tuple(models)])
