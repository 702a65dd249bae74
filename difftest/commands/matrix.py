"""`difftest matrix FILE --out OUT`: a release gate over candidates x suites x concurrency x configurations.

    # gate.yaml (paths relative to it)
    suites: [../cases/suites/smoke.yaml, ../cases/suites/handoff-mix.yaml]
    candidates:
      - vllm-omni                                          # a --candidate value, or a mapping:
      - {candidate: vllm-omni, label: main, vllm_omni_python: ../.venv-omni-main/bin/python}
      - {candidate: "cpu-engine:ref-leak", label: control}  # the negative control
    concurrency: [4, 16]
    configs: {default: [], async: [async_chunk=true]}      # optional: name -> --engine-arg list
    store: ../difftest-store                               # optional (default: difftest run's)

Or cells named one by one (cases/gates/*.yaml), each with what it covers, run for every candidate:

    cells:
      - name: mixed-waves-c4                                # the cell's folder name
        suite: ../suites/handoff-mix.yaml
        concurrency: 4
        pattern: barrier                                   # optional: difftest run --pattern, --order, --voices
        config: [async_chunk=true]                         # optional: --engine-arg list
        covers: [a reference handed to the wrong request]  # optional: the bug families, for people
        production: [async_chunk]                          # optional: keys served as the release's deploy file has them
        exercises: [preemption]                            # optional: serving paths the run must show it took

Every cell (of the product, or named) is one whole `difftest run`, its own process, into `OUT/cells/<cell>/`
(its log beside it); `--workers K` runs K cells at once (each starts its own candidate: size K to
what the machine or its GPUs can serve; a suite that several cells share has its qwen-tts reference
computed once into the store before they start, which they would otherwise each compute at once),
and `--ray ADDRESS` puts every cell's reference side on that cluster (`difftest run --ray`). As each
cell finishes it is gated (difftest.records.gate, the policy's fail_on) and logged to MLflow (tags `difftest.commands.run_matrix`, `difftest.commands.run_matrix.cell`).

OUT/matrix.json (stable JSON, rewritten after each cell: a stopped matrix keeps what it ran), OUT/junit.xml
(a testsuite per cell, a testcase per segment), OUT/summary.md (a table a release manager reads).
Exit 1 when a cell fails (a judged divergence), else 3 when a cell could not be judged, else 0; a
broken matrix file exits 2 before any cell runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .. import yamlfile
from ..errors import EXIT_FAIL, EXIT_INFRA, EXIT_PASS, BadInput
from ..process import lifeline
from ..process.launcher import interrupt_groups, log_tail
from ..results import atomic_write
from ..verdicts.exercised import PATHS

FORMAT = "difftest.gate-matrix/1"
MAX_CELLS = 64
KEYS = {"suites", "candidates", "concurrency", "configs", "store", "name", "cells", "description"}
CELL_KEYS = {"name", "suite", "concurrency", "config", "pattern", "order", "voices", "covers", "note", "production",
             "exercises"}
CELL_CHOICES = {"pattern": ("barrier", "pool", "staggered"), "order": ("suite", "permuted", "mixed", "long-first"),
                "voices": ("inline", "registered")}  # as difftest run takes them
CANDIDATE_KEYS = {"candidate", "label", "vllm_omni_python", "engine_args"}


@dataclass(frozen=True)
class Candidate:
    spec: str
    label: str
    python: str | None = None
    engine_args: tuple = ()


@dataclass
class Matrix:
    path: Path
    name: str
    suites: list[Path]
    candidates: list[Candidate]
    concurrency: list[int]
    configs: dict[str, list[str]]
    store: str | None = None
    cells: list[dict] = field(default_factory=list)
    named: bool = False  # cells listed one by one (`cells:`), not a product
    description: str = ""


def _fail(path: Path, where: str, problem: str):
    raise BadInput(f"{path}: {where}: {problem}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def load_matrix(path: str | Path) -> Matrix:
    """Read and check a matrix file; BadInput names the file, the field and the problem."""
    path = Path(path).resolve()
    try:
        raw = yamlfile.load_file(path)
    except OSError as e:
        raise BadInput(f"{path}: cannot read: {e.strerror or e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise BadInput(f"{path}: {where}{getattr(e, 'problem', None) or str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        _fail(path, "(top level)", "expected a mapping")
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        _fail(path, unknown[0], f"unknown key (known: {', '.join(sorted(KEYS))})")
    base = path.parent

    def listed(key: str) -> list:
        v = raw.get(key)
        if not isinstance(v, list) or not v:
            _fail(path, key, "expected a non-empty list")
        return v

    named = raw.get("cells") is not None
    if named:
        both = sorted(set(raw) & {"suites", "concurrency", "configs"})
        if both:
            _fail(path, both[0], "give either `cells` or suites x concurrency x configs, not both")
    suites = []
    for i, s in enumerate([] if named else listed("suites")):
        if not isinstance(s, str) or not (base / s).is_file():
            _fail(path, f"suites[{i}]", f"no suite file {yamlfile.quote(s)}")
        suites.append((base / s).resolve())
    candidates = []
    for i, c in enumerate(listed("candidates")):
        if isinstance(c, str):
            c = {"candidate": c}
        if not isinstance(c, dict) or not isinstance(c.get("candidate"), str) or not c["candidate"].strip():
            _fail(path, f"candidates[{i}]", "expected a --candidate value or a mapping with `candidate`")
        bad = sorted(set(c) - CANDIDATE_KEYS)
        if bad:
            _fail(path, f"candidates[{i}].{bad[0]}", f"unknown key (known: {', '.join(sorted(CANDIDATE_KEYS))})")
        args = c.get("engine_args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            _fail(path, f"candidates[{i}].engine_args", "expected a list of KEY=VALUE texts")
        py = c.get("vllm_omni_python")
        candidates.append(Candidate(c["candidate"], str(c.get("label") or c["candidate"]),
                                    str((base / py).resolve()) if py else None, tuple(args)))
    labels = [c.label for c in candidates]
    if len(set(labels)) != len(labels):
        _fail(path, "candidates", f"two candidates share the label {next(x for x in labels if labels.count(x) > 1)!r} "
                                  f"(give each a `label`)")
    conc = [] if named else listed("concurrency")
    for i, n in enumerate(conc):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            _fail(path, f"concurrency[{i}]", f"expected a positive integer, got {yamlfile.quote(n)}")
    configs = {"default": []} if named else raw.get("configs", {"default": []})
    if not isinstance(configs, dict) or not configs:
        _fail(path, "configs", "expected a mapping of name -> list of engine args")
    for k, v in configs.items():
        if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
            _fail(path, f"configs.{k}", "expected a list of KEY=VALUE texts")
    store = raw.get("store")
    if store is not None and not isinstance(store, str):
        _fail(path, "store", "expected a path")
    m = Matrix(path, str(raw.get("name") or path.stem), suites, candidates, [int(n) for n in conc],
               {str(k): list(v) for k, v in configs.items()}, str((base / store).resolve()) if store else None,
               named=named, description=str(raw.get("description") or "").strip())
    if named:
        for one, cand in itertools.product(_named_cells(path, raw["cells"]), candidates):
            name = one["name"] if len(candidates) == 1 else f"{one['name']}__{_slug(cand.label)}"
            m.cells.append({"cell": name, "suite": one["suite"], "candidate": cand.spec, "label": cand.label,
                            "concurrency": one["concurrency"], "config": one["name"],
                            "engine_args": [*cand.engine_args, *one["config"]], "python": cand.python,
                            **{k: one[k] for k in ("pattern", "order", "voices", "covers", "note", "production",
                                                   "exercises")}})
        m.suites = sorted({Path(c["suite"]) for c in m.cells})
        m.concurrency = sorted({c["concurrency"] for c in m.cells})
    for suite, cand, n, (cfg, args) in itertools.product(suites, candidates, m.concurrency if not named else [],
                                                         m.configs.items()):
        name = "__".join(_slug(x) for x in (suite.stem, cand.label, f"c{n}", cfg))
        m.cells.append({"cell": name, "suite": str(suite), "candidate": cand.spec, "label": cand.label, "concurrency": n,
                        "config": cfg, "engine_args": [*cand.engine_args, *args], "python": cand.python})
    if len(m.cells) > MAX_CELLS:
        _fail(path, "(product)", f"{len(m.cells)} cells, at most {MAX_CELLS}")
    named: dict[str, dict] = {}
    for cell in m.cells:  # one folder per cell: two cells in one folder would be judged from one report
        other = named.setdefault(cell["cell"], cell)
        if other is not cell:
            _fail(path, "candidates" if other["label"] != cell["label"] else "configs",
                  f"two cells would share the folder {cell['cell']!r} ({_cell_words(other)} and {_cell_words(cell)}); "
                  f"give them names that differ in letters or digits")
    _check_cells(path, m)
    _check_production(path, m)
    return m


def _named_cells(path: Path, raw) -> list[dict]:
    """The `cells:` list checked: each a mapping with a name, a suite file and a concurrency."""
    from ..engines.engine_args import parse

    if not isinstance(raw, list) or not raw:
        _fail(path, "cells", "expected a non-empty list of cells")
    out = []
    for i, c in enumerate(raw):
        where = f"cells[{i}]"
        if not isinstance(c, dict):
            _fail(path, where, "expected a mapping (name, suite, concurrency, ...)")
        bad = sorted(set(c) - CELL_KEYS)
        if bad:
            _fail(path, f"{where}.{bad[0]}", f"unknown key (known: {', '.join(sorted(CELL_KEYS))})")
        name = c.get("name")
        if not isinstance(name, str) or _slug(name) != name:
            _fail(path, f"{where}.name", f"expected a folder name of letters, digits, '.', '_' or '-', got "
                                         f"{yamlfile.quote(name)}")
        suite = c.get("suite")
        if not isinstance(suite, str) or not (path.parent / suite).is_file():
            _fail(path, f"{where}.suite", f"no suite file {yamlfile.quote(suite)}")
        n = c.get("concurrency")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            _fail(path, f"{where}.concurrency", f"expected a positive integer, got {yamlfile.quote(n)}")
        config = c.get("config") or []
        if not isinstance(config, list) or not all(isinstance(a, str) for a in config):
            _fail(path, f"{where}.config", "expected a list of KEY=VALUE texts (as --engine-arg takes them)")
        try:
            parse(config)
        except BadInput as e:
            _fail(path, f"{where}.config", str(e))
        for key, choices in CELL_CHOICES.items():
            if c.get(key) is not None and c[key] not in choices:
                _fail(path, f"{where}.{key}", f"expected one of {', '.join(choices)}, got {yamlfile.quote(c[key])}")
        covers = c.get("covers") or []
        if not isinstance(covers, list) or not all(isinstance(x, str) for x in covers):
            _fail(path, f"{where}.covers", "expected a list of texts (the bug families the cell is there for)")
        production = c.get("production") or []
        if not isinstance(production, list) or not all(isinstance(x, str) and x.strip() for x in production):
            _fail(path, f"{where}.production", "expected a list of deploy keys (e.g. talker.max_num_batched_tokens)")
        exercises = c.get("exercises") or []
        if not isinstance(exercises, list) or any(x not in PATHS for x in exercises):
            _fail(path, f"{where}.exercises", f"expected a list of serving paths the cell must show it took "
                                              f"({', '.join(PATHS)}), got {yamlfile.quote(exercises)}")
        if name in {o["name"] for o in out}:
            _fail(path, f"{where}.name", f"{name!r} is already a cell")
        out.append({"name": name, "suite": str((path.parent / suite).resolve()), "concurrency": n, "config": config,
                    "pattern": c.get("pattern"), "order": c.get("order"), "voices": c.get("voices"),
                    "covers": covers, "note": str(c.get("note") or "").strip(), "production": production,
                    "exercises": exercises})
    return out


def _cell_words(cell: dict) -> str:
    return f"{cell['label']!r} at c={cell['concurrency']}, config {cell['config']!r}"


def _check_cells(path: Path, m: Matrix) -> None:
    """What each cell's own run would refuse, refused when the matrix loads (exit 2, naming it)
    rather than as a cell with no report: every suite valid, every candidate one difftest knows."""
    from ..engines.reference import reference_python
    from ..engines.start import CandidateSpec, cpu_engine_defects
    from ..suites.suite import load_suite

    where = ({Path(c["suite"]): f"cells ({c['config']}).suite" for c in reversed(m.cells)} if m.named else
             {s: f"suites[{i}]" for i, s in enumerate(m.suites)})
    for suite in m.suites:
        try:
            load_suite(suite)
        except BadInput as e:
            _fail(path, where[suite], str(e))
    known = None
    for i, cand in enumerate(m.candidates):
        try:
            spec = CandidateSpec.parse(cand.spec)
        except BadInput as e:
            _fail(path, f"candidates[{i}]", str(e))
        if spec.is_.planted_defects and spec.defect is not None:
            if known is None:  # asked of the engine, in its environment (difftest never imports runners/)
                known = cpu_engine_defects(Path(spec.python) if spec.python else reference_python())
            if spec.defect not in known:
                _fail(path, f"candidates[{i}]", f"the CPU test engine has no defect {yamlfile.quote(spec.defect)} "
                                                f"(known: {', '.join(known)})")


def _check_production(path: Path, m: Matrix) -> None:
    """A cell's `production: [KEY, ...]`: the cell must serve the release's deploy file's value for each
    key (difftest.engines.deploy_diff); exit 2 before any cell runs when it cannot."""
    import tempfile

    from ..engines.deploy_diff import require_production
    from ..engines.start import DEPLOY_FILE_KINDS, CandidateSpec
    from ..engines.vllm_omni import cell_overlay, write_overlay

    for cell in m.cells:
        if not cell.get("production"):
            continue
        where = f"{path}: cell {cell['cell']}: production"
        if not CandidateSpec.parse(cell["candidate"]).is_.deploy_file:
            raise BadInput(f"{where}: {cell['label']} serves no vLLM-Omni deploy file (only "
                           f"{' and '.join(DEPLOY_FILE_KINDS)} do)")
        # a cell's `difftest run` gets no --candidate-device: its vLLM-Omni is on the CPU
        production, overlay, keys = cell_overlay(cell["suite"], cell["concurrency"], cell["engine_args"],
                                                 python=cell["python"], device="cpu")
        with tempfile.TemporaryDirectory(prefix="difftest-overlay-") as d:
            require_production(cell["production"], production, write_overlay(Path(d) / "deploy-overlay.yaml", overlay),
                               overlay, "cpu", keys, where=where)


def cell_argv(cell: dict, out: Path, store: str | None, ray: str | None, policy: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "difftest", "run", cell["suite"], "--candidate", cell["candidate"],
            "--concurrency", str(cell["concurrency"]), "--out", str(out), "--no-mlflow"]
    argv += [f"--engine-arg={a}" for a in cell["engine_args"]]
    for key in ("pattern", "order", "voices"):
        if cell.get(key):
            argv += [f"--{key}", cell[key]]
    for path in cell.get("exercises") or ():
        argv += ["--require-path", path]
    if cell["python"]:
        argv += ["--vllm-omni-python", cell["python"]]
    if store:
        argv += ["--store", store]
    if ray:
        argv += ["--ray", ray]
    if policy:
        argv += ["--policy", policy]
    return argv


def _judge(cell: dict, folder: Path, code: int, policy, baseline_version: str | None = None,
           tracking_uri: str | None = None, baselines: dict | None = None) -> dict:
    """The cell's row: its gate decision (the policy's fail_on) from its report; with
    `baseline_version`, against that version's run of the same cell logged to MLflow (its segments'
    verdicts and its numerics, difftest.records.gate), kept in `baselines` for the JUnit file."""
    from ..errors import DifftestError
    from ..records.gate import decide, load_baseline
    from ..records.report import check_report

    row = {**{k: cell[k] for k in ("cell", "suite", "candidate", "label", "concurrency", "config", "engine_args")},
           "exit_code": code, "folder": str(folder)}
    try:
        report = check_report(json.loads((folder / "report.json").read_text(encoding="utf-8")), folder / "report.json")
    except (OSError, ValueError, BadInput) as e:
        tail = log_tail(folder.with_suffix(".log"), 15)
        own = [ln[len("difftest: "):] for ln in tail.splitlines() if ln.startswith(("difftest: error:", "difftest: internal"))]
        why = own[-1] if own else f"no report ({str(e).splitlines()[0]})"
        return {**row, "verdict": "error", "error": f"exit {code}: {why}", "log_tail": tail}
    baseline = None
    if baseline_version:
        try:
            baseline = load_baseline(folder, baseline_version, policy, tracking_uri, {"difftest.commands.run_matrix.cell": cell["cell"]})
        except DifftestError as e:
            return {**row, "verdict": "error", "error": f"baseline {baseline_version}: {str(e).splitlines()[0]}"}
        if baselines is not None:
            baselines[cell["cell"]] = baseline
    result = decide(report, policy, baseline)
    failing = [r.segment for r in result.segments if result.fails(r)]
    if baseline is not None:
        num = result.numerics or {}
        row["baseline"] = {"version": baseline.version, "run_id": baseline.run_id,
                           "regressions": [r.id for r in result.segments if r.status in ("regression", "new")],
                           "numerics": {k: num.get(k) for k in ("verdict", "site", "effect", "summary")}}
    return {**row, "verdict": result.verdict, "gate_exit_code": result.exit_code, "counts": report.get("counts") or {},
            "failing": [{"id": s["id"], "verdict": s["verdict"], "stage": s.get("stage"), "donor": s.get("donor"),
                         "first_divergent_chunk": s.get("first_divergent_chunk")} for s in failing],
            "at_concurrency_1": (report.get("at_concurrency_1") or {}).get("verdict"),
            "engine": (report.get("candidate") or {}).get("engine")}


def exit_code(rows: list[dict]) -> int:
    if any(r["verdict"] == "fail" for r in rows):
        return EXIT_FAIL
    if any(r["verdict"] != "pass" for r in rows):
        return EXIT_INFRA
    return EXIT_PASS


def junit(rows: list[dict], policy, baselines: dict | None = None) -> bytes:
    """One testsuite per cell (its segments as testcases, from the gate's own JUnit), one file."""
    from ..records.gate import decide
    from ..records.gate_output import junit_xml

    root = ET.Element("testsuites", name="difftest-matrix")
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    for r in rows:
        try:
            report = json.loads((Path(r["folder"]) / "report.json").read_text(encoding="utf-8"))
            cell = ET.fromstring(junit_xml(report, decide(report, policy, (baselines or {}).get(r["cell"]))))[0]
        except (OSError, ValueError, KeyError):
            cell = ET.Element("testsuite", tests="1", failures="0", errors="1", skipped="0")
            ET.SubElement(ET.SubElement(cell, "testcase", classname="difftest.commands.run_matrix", name=r["cell"]), "error",
                          type="no-report", message=r.get("error", "no report"))
        cell.set("name", f"difftest.commands.run_matrix.{r['cell']}")
        root.append(cell)
        for k in totals:
            totals[k] += int(cell.get(k, 0))
    for k, v in totals.items():
        root.set(k, str(v))
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def markdown(m: Matrix, rows: list[dict], code: int) -> str:
    icon = {EXIT_PASS: "✅", EXIT_FAIL: "❌"}.get(code, "⚠️")
    word = {EXIT_PASS: "pass", EXIT_FAIL: "fail"}.get(code, "error")
    lines = [f"## {icon} difftest matrix {m.name}: {word}", "",
             (f"{len(rows)} cells: {len(m.cells) // len(m.candidates)} named cell(s) x {len(m.candidates)} candidate(s)"
              if m.named else
              f"{len(rows)} cells: {len(m.suites)} suite(s) x {len(m.candidates)} candidate(s) x "
              f"{len(m.concurrency)} concurrency level(s) x {len(m.configs)} configuration(s)"), "",
             "| cell | verdict | at c=1 | segments | failing (verdict, stage, donor) |", "|---|---|---|---|---|"]
    for r in rows:
        counts = ", ".join(f"{n} {v}" for v, n in sorted((r.get("counts") or {}).items()))
        failing = "; ".join(f"{f['id']} {f['verdict']}" + (f" @{f['stage']}" if f.get("stage") else "")
                            + (f" from {f['donor']}" if f.get("donor") else "") for f in r.get("failing") or [])
        lines.append(f"| {r['cell']} | {r['verdict']} | {r.get('at_concurrency_1') or '-'} | {counts or '-'} | "
                     f"{failing or r.get('error', '') or '-'} |")
    return "\n".join(lines) + "\n"


def run_matrix_file(m: Matrix, out: Path, policy, *, workers: int = 1, ray: str | None = None,
                    tracking_uri: str | None = None, mlflow: bool = True, policy_path: str | None = None,
                    baseline_version: str | None = None, stream=sys.stderr) -> int:
    out = out.resolve()
    (out / "cells").mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    baselines: dict = {}
    started = time.time()

    def save(done: bool) -> None:
        atomic_write(out / "matrix.json", json.dumps({
            "format": FORMAT, "name": m.name, "file": str(m.path), "complete": done,
            "exit_code": exit_code(rows) if done else None, "seconds": round(time.time() - started, 1),
            "cells": sorted(rows, key=lambda r: [c["cell"] for c in m.cells].index(r["cell"]))},
            indent=1, sort_keys=True).encode())

    if workers > 1 and ray is None:
        _references_first(m, out, stream)
    queue = list(m.cells)
    running: dict = {}
    lines: dict[str, int | None] = {}
    try:
        while queue or running:
            while queue and len(running) < max(workers, 1):
                cell = queue.pop(0)
                folder = out / "cells" / cell["cell"]
                # judged only from a report this cell's run writes: never one left by an earlier matrix
                (folder / "report.json").unlink(missing_ok=True)
                log = open(folder.with_suffix(".log"), "wb")
                proc = subprocess.Popen(cell_argv(cell, folder, m.store, ray, policy_path), stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True, env=lifeline.child_env(None))
                lines[cell["cell"]] = lifeline.guard(proc)  # the cell (and its engines) end with the matrix
                running[cell["cell"]] = (proc, log, cell, folder, time.monotonic())
                print(f"matrix: {cell['cell']} started ({len(rows) + len(running)}/{len(m.cells)})", file=stream,
                      flush=True)
            for name, (proc, log, cell, folder, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                lifeline.release(lines.pop(name, None))
                del running[name]
                row = _judge(cell, folder, proc.returncode, policy, baseline_version, tracking_uri, baselines)
                row["seconds"] = round(time.monotonic() - t0, 1)
                # a cell without a baseline is still logged: it is the next release's baseline
                if mlflow and (row["verdict"] != "error" or row.get("error", "").startswith("baseline ")):
                    from ..records.tracking import log_run

                    log_run(folder, tracking_uri, tags={"difftest.commands.run_matrix": m.name, "difftest.commands.run_matrix.cell": name})
                rows.append(row)
                save(False)
                fails = ", ".join(f"{f['id']} {f['verdict']}" for f in row.get("failing") or [])
                print(f"matrix: {name}: {row['verdict'].upper()}" + (f" ({fails})" if fails else "")
                      + (f" ({row['error']})" if row.get("error") else "") + f" in {row['seconds']:.0f} s",
                      file=stream, flush=True)
            time.sleep(0.2)
    except BaseException:
        interrupt_groups([p for p, *_ in running.values()])
        for fd in lines.values():
            lifeline.release(fd)
        save(False)
        raise
    code = exit_code(rows)
    save(True)
    atomic_write(out / "junit.xml", junit(rows, policy, baselines))
    atomic_write(out / "summary.md", markdown(m, sorted(rows, key=lambda r: [c["cell"] for c in m.cells].index(
        r["cell"])), code).encode())
    print(f"matrix {m.name}: {sum(r['verdict'] == 'pass' for r in rows)} pass, "
          f"{sum(r['verdict'] == 'fail' for r in rows)} fail, {sum(r['verdict'] == 'error' for r in rows)} error; "
          f"{out / 'summary.md'}, {out / 'junit.xml'}", file=stream, flush=True)
    return code


def _references_first(m: Matrix, out: Path, stream) -> None:
    """With cells side by side, the first K would each compute the same qwen-tts reference into the
    store at once (none finds the other's): compute each suite's once, before any cell starts, so
    every cell finds it cached. The cells keep their own runs' checks: a suite whose reference fails
    here is left to its cells, which report it as they would have."""
    suites: dict[str, int] = {}
    for cell in m.cells:
        suites[cell["suite"]] = suites.get(cell["suite"], 0) + 1
    store = m.store or os.environ.get("DIFFTEST_STORE", "difftest-store")  # difftest run's default
    for suite, n in suites.items():
        if n < 2:
            continue
        log_path = out / "references" / f"{Path(suite).stem}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        print(f"matrix: the qwen-tts reference for {Path(suite).name} first (shared by {n} cells)", file=stream,
              flush=True)
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "difftest", "reference", suite, "--store", store],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=lifeline.child_env(None))
            line = lifeline.guard(proc)
            try:
                code = proc.wait()
            except BaseException:
                interrupt_groups([proc])
                raise
            finally:
                lifeline.release(line)
        print(f"matrix: reference for {Path(suite).name} " + (f"ready in {time.monotonic() - t0:.0f} s" if code == 0 else
              f"failed (exit {code}, {log_path}); its cells compute what they need"), file=stream, flush=True)


def cmd_matrix(args) -> int:
    from ..verdicts.policy import load_policy

    m = load_matrix(args.file)
    policy = load_policy(args.policy)
    if args.workers < 1:
        raise BadInput("--workers must be at least 1")
    return run_matrix_file(m, Path(args.out), policy, workers=args.workers, ray=args.ray,
                           tracking_uri=args.tracking_uri, mlflow=not args.no_mlflow,
                           policy_path=str(Path(args.policy).resolve()) if args.policy else None,
                           baseline_version=args.baseline_version)


def add_matrix_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("matrix", help="a release gate over candidates x suites x concurrency x configurations",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="the matrix YAML (suites, candidates, concurrency, configs)")
    p.add_argument("--out", required=True, help="OUT/matrix.json, junit.xml, summary.md, cells/<cell>/")
    p.add_argument("--workers", type=int, default=1, metavar="K", help="cells at once (default 1)")
    p.add_argument("--ray", metavar="ADDRESS", help="every cell's reference side on this Ray cluster")
    p.add_argument("--policy", help="policy YAML for the gate (default: the built-in one)")
    p.add_argument("--tracking-uri", help="MLflow (default $MLFLOW_TRACKING_URI, else sqlite:///./mlflow.db)")
    p.add_argument("--no-mlflow", action="store_true")
    p.add_argument("--baseline-version", metavar="V",
                   help="gate every cell against version V's run of the same cell logged to MLflow (as `difftest gate "
                        "--baseline-version`: segment regressions and numerics against the last release)")
    p.set_defaults(func=cmd_matrix)
    return p

