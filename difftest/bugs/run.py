"""`difftest bugs`: build each corpus entry's mutant, run it, and say whether difftest caught it.

    difftest bugs --out DIR [--only ID,...] [--corpus cases/bugs]

Per entry: the mutant environment (difftest.bugs.mutant; the release itself for an
entry whose release still carries the bug), then `difftest run` of the entry's
suite at its concurrency against it (difftest.run.run; one reference runner shared
by all entries), in `DIR/<id>/`, logged to MLflow like any run. An entry is
**caught** when the run fails and one of its segments has the expected verdict at
the expected stage (and names a donor where the entry says one enters). The table
(`DIR/bugs.json`, stable JSON; and a short text table on stdout) has a row per
entry. An entry that cannot show on the CPU is listed, not run; a known miss
stays a row with its reason.

Exit: 0 every entry that can run here was caught or is a known miss; 1 an entry
was missed; 2 bad input (a corpus entry, a patch that does not apply, a release
whose sources differ); 3 a run could not be made (an engine that did not start).
"""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from ..engines.reference import ReferenceOptions, reference_python
from ..engines.start import CandidateSpec
from ..errors import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_INFRA, EXIT_PASS, BadInput, DifftestError
from ..pipeline.starting import resolve_models, start_reference_runner
from ..run import RunOptions, run
from ..suites.suite import load_suite
from ..verdicts.policy import Policy
from .corpus import Entry
from .judge import NUMERICS, judge
from .mutant import mutant_env

FORMAT = "difftest.bugs/1"


def run_entries(entries: list[Entry], out: Path, policy: Policy, opts: RunOptions, base_python: Path,
                mlflow_uri: str | None = None, log_mlflow: bool = True, stream=sys.stderr,
                save=lambda rows: None) -> list[dict]:
    """A row per entry; an entry's bad input or broken run is its row's error, the others go on.
    `save(rows)` after each entry: what is done is kept if a later entry stops the command."""
    rows = []
    python = reference_python(opts.reference.python)
    with ExitStack() as stack:
        runners: dict[tuple, object] = {}
        for i, e in enumerate(entries, 1):
            row = {"id": e.id, "upstream": e.upstream_label, "title": e.title, "expect": e.expect,
                   "candidate": e.candidate, "suite": e.suite.stem, "concurrency": e.concurrency,
                   "config": e.config, "known_miss": e.known_miss, "cpu": e.cpu}
            t0 = time.perf_counter()
            if not e.cpu:
                rows.append({**row, "status": "not on CPU", "reason": e.cpu_why})
                save(rows)
                continue
            print(f"bug {i}/{len(entries)} {e.id} ({e.upstream_label}): building the mutant", file=stream, flush=True)
            try:
                with ExitStack() as held:
                    cand_python = base_python if e.release_carries_bug else held.enter_context(
                        mutant_env(e, base_python, out / "logs" / f"{e.id}-build.log"))
                    row["build_s"] = round(time.perf_counter() - t0, 1)
                    report = _run_one(e, cand_python, out, policy, opts, python, runners, stack, stream,
                                      f"bug {i}/{len(entries)} {e.id}")
                control = None
                if e.expect["verdict"] == NUMERICS:  # the release itself, same suite and settings: the baseline
                    control = _run_one(e, base_python, out, policy, opts, python, runners, stack, stream,
                                       f"bug {i}/{len(entries)} {e.id} (the release, as baseline)", "release")
                row.update(judge(e, report, control, policy))
                row["status"] = "caught" if row["caught"] else ("known miss" if e.known_miss else "missed")
                if log_mlflow:
                    from ..records.tracking import log_run

                    exp = e.expect
                    log_run(out / e.id, mlflow_uri, tags={
                        "difftest.bug": e.id, "difftest.bug.status": row["status"],
                        "difftest.bug.upstream": e.upstream_label,
                        "difftest.bug.expect": f"{exp['verdict']}@{exp['stage']}" + (" +donor" if exp.get("donor") else "")})
            except DifftestError as err:
                row.update(status="error", error=str(err).splitlines()[0],
                           exit_code=EXIT_BAD_INPUT if isinstance(err, BadInput) else EXIT_INFRA)
                if not isinstance(err, BadInput):
                    runners.clear()  # a reference runner that failed is not handed to the next entry
            row["seconds"] = round(time.perf_counter() - t0, 1)
            print(f"bug {i}/{len(entries)} {e.id}: {row['status']} in {row['seconds']:.0f} s", file=stream, flush=True)
            rows.append(row)
            save(rows)
    return rows


def _run_one(e: Entry, cand_python: Path, out: Path, policy: Policy, opts: RunOptions, python: Path,
             runners: dict, stack: ExitStack, stream, label: str, folder: str | None = None) -> dict:
    """`difftest run` of the entry against its mutant (in OUT/<id>/, or OUT/<id>/<folder>/), with
    the reference runner for its models (started once, shared by the entries that need the same
    checkpoints)."""
    suite = load_suite(e.suite)
    e_opts = replace(opts, concurrency=e.concurrency, pattern=e.pattern, order=e.order, replace=True)
    models = resolve_models(suite, e_opts, python)
    key = tuple(models)
    if key not in runners:
        ref_opts = ReferenceOptions(**{**opts.reference.__dict__, "models": models})
        runner = start_reference_runner(python, models, ref_opts, out / "logs" / "reference-runner.log",
                                               suite.family)
        stack.callback(runner.close)
        runners[key] = runner
    spec = replace(CandidateSpec.parse(e.candidate), python=str(cand_python), options=dict(e.config))
    print(f"{label}: running {suite.name} at {e.concurrency} ({e.pattern} arrivals) on {e.candidate}",
          file=stream, flush=True)
    return run(suite, spec, out / e.id / folder if folder else out / e.id, policy, e_opts, runner=runners[key])


def exit_code(rows: list[dict]) -> int:
    if any(r["status"] == "missed" for r in rows):
        return EXIT_FAIL
    codes = [r["exit_code"] for r in rows if r["status"] == "error"]
    if codes:
        return min(codes)  # bad input (2) before infrastructure (3)
    return EXIT_PASS


def table(rows: list[dict]) -> str:
    head = ("bug", "upstream", "expected", "status", "where", "s")
    lines = [head]
    for r in rows:
        exp = f"{r['expect']['verdict']}@{r['expect']['stage']}" + (" +donor" if r["expect"].get("donor") else "")
        status = r["status"] + (f": {r.get('error') or r.get('reason') or ''}" if r["status"] in ("error", "not on CPU")
                                else "")
        lines.append((r["id"], r["upstream"], exp, status[:70], r.get("where") or "", f"{r.get('seconds', 0):.0f}"))
    widths = [max(len(str(x[i])) for x in lines) for i in range(len(head))]
    text = "\n".join("  ".join(str(x[i]).ljust(widths[i]) for i in range(len(head))).rstrip() for x in lines)
    ran = [r for r in rows if r["status"] != "not on CPU"]
    caught = sum(r["status"] == "caught" for r in ran)
    return text + f"\ncaught {caught} of {len(ran)} entries that run on this machine ({len(rows) - len(ran)} not on CPU)"
