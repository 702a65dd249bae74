"""`difftest run ... --matrix KEY=V1,V2 [--matrix ...]`: one gate run over a configuration matrix.

    difftest run SUITE --candidate vllm-omni -n 4 --out OUT \\
        --matrix async_chunk=false,true --matrix talker.enable_prefix_caching=false,true

Each cell of the cartesian product is a whole `difftest run` with the cell's settings added to the
`--engine-arg`s (keys and values as difftest.engines.engine_args reads them), into `OUT/<cell>/`,
all cells sharing one reference runner; each starts its own vLLM-Omni (the settings are the
server's). `OUT/matrix.json` (stable JSON) has a row per cell, rewritten after each so a stopped
matrix keeps what it ran; each cell is logged to MLflow as its own run, tagged `difftest.commands.run_matrix`.

Exit: 1 when a cell's verdict fails (a judged divergence), else 3 when a cell could not be run,
else 0. Bad input (an unknown key in any cell) exits 2 before any cell runs.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from ..engines.engine_args import check, parse
from ..engines.reference import ReferenceOptions, reference_python
from ..engines.start import DEPLOY_FILE_KINDS, CandidateSpec
from ..errors import EXIT_FAIL, EXIT_INFRA, EXIT_PASS, BadInput, DifftestError
from ..pipeline.starting import resolve_models, start_reference_runner
from ..records.report import print_summary
from ..results import atomic_write
from ..run import run

FORMAT = "difftest.commands.run_matrix/1"
MAX_CELLS = 16


def axes(texts) -> list[tuple[str, list[str]]]:
    """[(key, [value text, ...]), ...] from `KEY=V1,V2` texts; BadInput naming the text."""
    out = []
    for text in texts:
        key, sep, values = str(text).partition("=")
        key = key.strip()
        vals = [v.strip() for v in values.split(",")]
        if not sep or not key or not all(vals):
            raise BadInput(f"--matrix {text!r}: expected KEY=VALUE1,VALUE2 (e.g. async_chunk=false,true)")
        if key in {k for k, _ in out}:
            raise BadInput(f"--matrix {text!r}: {key} is already an axis")
        parse([f"{key}={v}" for v in vals])  # each value must be a setting engine_args can read
        out.append((key, vals))
    return out


def cells(axes_: list[tuple[str, list[str]]]) -> list[list[str]]:
    """Every combination, as `KEY=VALUE` lists, the first axis slowest."""
    combos = [list(zip([k for k, _ in axes_], values)) for values in itertools.product(*[v for _, v in axes_])]
    if len(combos) > MAX_CELLS:
        raise BadInput(f"--matrix: {len(combos)} cells, at most {MAX_CELLS} (each starts its own engine)")
    grid = [[f"{k}={v}" for k, v in combo] for combo in combos]
    seen: dict[str, list[str]] = {}
    for cell in grid:  # one folder each: two cells in one folder would be judged from one report
        other = seen.setdefault(cell_name(cell), cell)
        if other is not cell:
            raise BadInput(f"--matrix: cells {' '.join(other)!r} and {' '.join(cell)!r} would share the folder "
                           f"{cell_name(cell)!r}; give values that differ in letters or digits")
    return grid


def cell_name(settings: list[str]) -> str:
    """A folder name for a cell: `async_chunk-true__talker.enable_prefix_caching-false`."""
    return "__".join(re.sub(r"[^A-Za-z0-9._-]+", "-", s.replace("=", "-")) for s in settings)


def exit_code(rows: list[dict]) -> int:
    codes = [r.get("exit_code") for r in rows]
    if EXIT_FAIL in codes:
        return EXIT_FAIL
    if any(c not in (EXIT_PASS, EXIT_FAIL) for c in codes):
        return EXIT_INFRA
    return EXIT_PASS


def run_matrix(args, suite, policy, spec: CandidateSpec, opts, settings_of, stream=sys.stderr) -> int:
    """Every cell of `args.matrix`; `settings_of(engine_args)` makes a cell's VllmOmniOptions fields."""
    from ..records.tracking import log_run  # MLflow: imported when a matrix runs

    if not spec.is_.deploy_file:
        raise BadInput(f"--matrix varies the settings of a vLLM-Omni that difftest starts "
                       f"(--candidate {' or '.join(DEPLOY_FILE_KINDS)}), not {spec.label}")
    grid = cells(axes(args.matrix))
    all_settings = [settings_of([*args.engine_arg, *cell]) for cell in grid]
    from ..engines.vllm_omni import omni_python

    for s in all_settings:  # every key of every cell checked before any model work
        check(omni_python(s.get("python")), s["deploy_overrides"], s["stage_overrides"])
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = reference_python(opts.reference.python)
    models = resolve_models(suite, opts, python)
    rows: list[dict] = []

    def save(done=False):
        atomic_write(out / "matrix.json", json.dumps({
            "format": FORMAT, "suite": suite.name, "candidate": spec.label, "concurrency": opts.concurrency,
            "axes": [{"key": k, "values": v} for k, v in axes(args.matrix)], "complete": done,
            "exit_code": exit_code(rows) if done else None, "cells": rows}, indent=1, sort_keys=True).encode())

    with ExitStack() as stack:
        ref_opts = ReferenceOptions(**{**opts.reference.__dict__, "models": models})
        runner = start_reference_runner(python, models, ref_opts, out / "logs" / "reference-runner.log",
                                               suite.family)
        stack.callback(runner.close)
        for i, (cell, settings) in enumerate(zip(grid, all_settings), 1):
            name = cell_name(cell)
            print(f"matrix cell {i}/{len(grid)}: {' '.join(cell)}", file=stream, flush=True)
            row = {"cell": name, "settings": cell}
            try:
                report = run(suite, spec, out / name, policy, replace(opts, vllm_omni=settings), runner=runner)
                print_summary(report, out / name, stream=stream)
                failing = [s["id"] for s in report["segments"] if policy.fails(s["verdict"])]
                row.update(verdict=report["verdict"], exit_code=report["exit_code"], failing=failing,
                           verdicts=sorted({f"{s['verdict']}@{s.get('stage') or '-'}" for s in report["segments"]}))
                if not args.no_mlflow:
                    log_run(out / name, args.tracking_uri, tags={"difftest.commands.run_matrix": name})
            except DifftestError as err:
                if isinstance(err, BadInput):
                    raise
                row.update(verdict="error", exit_code=EXIT_INFRA, error=str(err).splitlines()[0])
            rows.append(row)
            save()
    save(done=True)
    width = max(len(r["cell"]) for r in rows)
    for r in rows:
        print(f"{r['cell'].ljust(width)}  {r['verdict'].upper()}  {', '.join(r.get('failing') or []) or r.get('error', '')}")
    print(f"matrix: {out / 'matrix.json'}")
    return exit_code(rows)
