"""`difftest repro OUT SEGMENT` (or `--all`): a finding shrunk to a minimal, standalone reproduction.

Against the candidate the run used (started again, same engine and settings; a URL is reached
again), delta debugging (difftest.repro.shrink) finds the smallest case that still gives the
segment's verdict at its stage (and from its donor): the fewest requests of its wave, the lowest
concurrency, the simplest arrival, the fewest settings, fewer frames, the shortest text and
references. Each probe is a short `difftest run`, cached under OUT/repro/SEGMENT/probes/ (a second
`difftest repro` resumes). The minimal case is then served `--repeats` times for its reproduction
rate, and written as a bundle (difftest.repro.bundle) whose repro.py is run, without difftest,
against the candidate (it must exit 1) and against the clean control where one exists (the CPU
test engine without its defect, the release under a re-created bug: it must exit 0).

Writes OUT/repro/SEGMENT/repro.json and OUT/repro/SEGMENT/bundle/. Exit 0: every finding asked
for was reproduced and bundled; 1: one did not reproduce; 2: bad input; 3: an engine or runner failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from ..engines.reference import ReferenceOptions, reference_python
from ..errors import EXIT_FAIL, EXIT_PASS, BadInput, InfraError
from ..repro.bundle import NoBundle, write_bundle
from ..repro.probe import Finding, Live, Origin, Prober, opts_for
from ..repro.shrink import STEPS, Case, Subject, settings_of, shrink
from ..results import atomic_write
from ..verdicts.policy import load_policy

FORMAT = "difftest.repro/1"


def subject_of(origin: Origin, finding: Finding) -> Subject:
    segs = {s.id: s for s in origin.suite.segments}
    return Subject(finding.segment, finding.donor, {k: s.text for k, s in segs.items()},
                   {k: s.decode["max_new_tokens"] for k, s in segs.items()},
                   {k: (s.voice.id, s.voice.n_samples, s.voice.sample_rate) for k, s in segs.items()
                    if s.voice is not None})


def starts(origin: Origin, finding: Finding, opts) -> list[Case]:
    """The cases a search may begin from: the segment's wave as it was sent, then the whole run
    (a finding that needs earlier waves: a cache, a history)."""
    base = Case(tuple(finding.wave), origin.run["concurrency"], opts.pattern, "suite",
                settings_of(origin.spec.options))
    whole = replace(base, segments=tuple(s.id for s in origin.suite.segments), order=opts.order)
    return [base] if whole.segments == base.segments else [base, whole]


def run_standalone(bundle_dir: Path, url: str, log: Path) -> int:
    """repro.py in an interpreter that cannot import difftest (-I: no user site or working folder;
    -S: no site-packages)."""
    p = subprocess.run([sys.executable, "-I", "-S", str(bundle_dir / "repro.py"), "--url", url],
                       cwd=bundle_dir, capture_output=True, text=True, timeout=1800, env={"PATH": os.defpath})
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(p.stdout + p.stderr, encoding="utf-8")
    return p.returncode


def _url(engine, spec) -> str | None:
    client = getattr(engine, "client", None)
    return getattr(client, "base_url", None) or spec.url


def reproduce(origin: Origin, sid: str, policy, runner, live: Live, opts, budget: int, repeats: int,
              steps=STEPS, stream=sys.stderr) -> dict:
    t0 = time.perf_counter()
    finding = origin.finding(sid)
    work = origin.out / "repro" / sid
    prober = Prober(origin, finding, work, policy, runner, live, opts, stream)
    subject = subject_of(origin, finding)
    print(f"repro {sid}: {finding.verdict}@{finding.stage}" + (f" from {finding.donor}" if finding.donor else "")
          + f", wave of {len(finding.wave)} at concurrency {origin.run['concurrency']}", file=stream, flush=True)
    result = None
    for start in starts(origin, finding, opts):
        result = shrink(start, subject, prober, budget=budget, repeats=repeats, steps=steps,
                        tries=2 if finding.donor else 1,
                        on_step=lambda name, case: print(f"repro {sid}: step {name}: {case.describe()}",
                                                         file=stream, flush=True))
        if result.reproduced:
            break
    row = {"format": FORMAT, "segment": sid, "run": str(origin.out), "finding": finding.__dict__,
           "start": result.case.describe() if not result.reproduced else None, "probes": result.probes,
           "steps": result.steps, "complete": result.complete, "reproduced": result.reproduced}
    if result.reproduced:
        case = result.case
        outcomes = [prober.outcome(replace(case, attempt=k)) for k in range(max(repeats, 1))]
        tries = [o["reproduced"] for o in outcomes]
        rate = {"reproduced": sum(tries), "tries": len(tries)}
        # the bundle is written from a try that shows the finding as the run did (target and donor as
        # named), else from one where it ran the other way; the search's own reproducing try last
        order = sorted(range(len(outcomes)), key=lambda k: (not outcomes[k]["reproduced"], outcomes[k].get("swapped")))
        candidates = [replace(case, attempt=k) for k in order if outcomes[k]["reproduced"]] + [case]
        notes = []
        swaps = sum(o.get("swapped", False) for o in outcomes)
        if swaps:
            notes.append(f"in {swaps} of the tries the leak ran the other way ({finding.donor} took {finding.segment}'s): "
                         f"which request's is handed on depends on the order the engine takes them in")
        if rate["reproduced"] < rate["tries"]:
            notes.append(f"reproduced in {rate['reproduced']} of {rate['tries']} tries: it depends on how the "
                         f"engine schedules the requests (which share a step)")
        bundle_dir = work / "bundle"
        clean_dir = None
        exact = ((origin.report.get("measured_null") or {}).get("numerics") or {}).get("exact", True)
        if not exact and not (case.concurrency > 1 and finding.needs_concurrency):
            # qwen-tts's float32 audio is no yardstick for another numerics' audio (a correct bfloat16
            # engine differs from it too): where a clean control exists, its audio of the same case is
            clean_case = replace(case, attempt=0)
            try:
                ctrl = prober.outcome(clean_case, clean=True)
                clean_dir = prober.folder(clean_case, clean=True)
                if ctrl["reproduced"]:
                    notes.append("the clean control shows the same finding on this case: it is not the defect's alone")
            except BadInput:  # no clean control: compared with qwen-tts, and the notes say what that can show
                dtype = ((origin.report.get("measured_null") or {}).get("numerics") or {}).get("dtype")
                notes.append(f"no clean control for this candidate: repro.py compares with "
                             f"{origin.suite.family.reference_name}'s float32 audio, "
                             f"from which a correct {dtype or 'other-numerics'} engine differs too on this "
                             f"checkpoint; its exit 1 alone does not tell the defect from drift: the diagnosis "
                             f"below (what the capture saw each stage get) is the evidence")
        for case in candidates:
            cand = json.loads((prober.folder(case) / "run" / "report.json").read_text())["candidate"]
            meta = {"rate": rate, "notes": notes, "engine_label": cand.get("engine") or cand.get("label")}
            try:
                write_bundle(bundle_dir, origin, finding, case, prober.folder(case), policy, meta, clean_dir)
                break
            except NoBundle as e:
                notes.append(f"not bundled from {prober.folder(case).name}: {e}")
        else:
            raise InfraError(f"repro {sid}: no try of the minimal case has every request's audio ({notes[-1]})")
        validation = validate(bundle_dir, live, case, origin, opts, work)
        meta["validation"] = validation
        if validation.get("the clean control", 0) != 0:
            notes.append("repro.py exits 1 on the clean control too: this case does not separate the defect from what "
                         "the clean engine itself does here (its own batch-to-batch variance, or a defect the release "
                         "carries); the run's verdict, from the capture, is the evidence")
        write_bundle(bundle_dir, origin, finding, case, prober.folder(case), policy, meta, clean_dir)  # with the checks
        row.update({"minimal": {"segments": list(case.segments), "concurrency": case.concurrency,
                                "pattern": case.pattern, "order": case.order,
                                "settings": dict(case.settings), "edits": [list(e) for e in case.edits]},
                    "minimal_case": case.describe(), "rate": rate, "bundle": str(bundle_dir),
                    "validation": validation, "notes": notes})
    row["probes"] = len(prober.log)  # the search's, the reproduction rate's; cached ones included
    row["probes_run"] = sum(not p["cached"] for p in prober.log)
    row["probe_seconds"] = round(sum(p["seconds"] for p in prober.log if not p["cached"]), 1)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    atomic_write(work / "repro.json", (json.dumps(row, indent=1, sort_keys=True) + "\n").encode())
    print(f"repro {sid}: " + (f"{row['minimal_case']}, reproduced {rate['reproduced']}/{rate['tries']}, "
                              f"{result.probes} probes ({row['probes_run']} run), bundle {row['bundle']}"
                              if result.reproduced else f"NOT reproduced in {result.probes} probes"),
          file=stream, flush=True)
    return row


def validate(bundle_dir: Path, live: Live, case: Case, origin: Origin, opts, work: Path) -> dict:
    """repro.py's exit status against the candidate, and against its clean control where there is one."""
    out = {}
    from ..suites.suite import load_suite

    suite = load_suite(bundle_dir / "suite.yaml")
    for clean in (False, True):
        try:
            spec, engine = live.engine(case.settings, suite, replace(
                opts, vllm_omni={**opts.vllm_omni, "max_num_seqs": max(origin.run["concurrency"], 1)}), clean,
                fresh=live.stateful)  # a cache's state from the probes must not stand in for the bug
        except BadInput:
            continue  # no clean control for this candidate
        url = _url(engine, spec)
        if url is None:
            continue
        who = "the clean control" if clean else "the candidate"
        out[who] = run_standalone(bundle_dir, url, work / "logs" / f"repro-py-{'clean' if clean else 'candidate'}.log")
    return out


def cmd_repro(args) -> int:
    out = Path(args.out).resolve()
    origin = Origin.load(out)
    if args.all:
        segments = origin.failing()
        if not segments:
            raise BadInput(f"{out}: the run has no failing segment to reproduce")
    elif args.segment:
        segments = [args.segment]
    else:
        raise BadInput("name a SEGMENT of the run, or --all")
    steps = STEPS if args.steps == "all" else tuple(s.strip() for s in args.steps.split(",") if s.strip())
    unknown = set(steps) - set(STEPS)
    if unknown or not steps:
        raise BadInput(f"--steps: unknown {', '.join(sorted(unknown)) or '(none given)'} (known: {', '.join(STEPS)})")
    if args.budget < 1 or args.repeats < 1:
        raise BadInput("--budget and --repeats must be at least 1")
    for sid in segments:
        origin.finding(sid)  # every name checked before any engine starts
    policy_src = (origin.report.get("policy") or {}).get("source")
    policy = load_policy(args.policy or (policy_src if policy_src and Path(policy_src).is_file() else None))
    opts = opts_for(origin, Path(args.store) if args.store else None)
    from ..pipeline.starting import start_reference_runner

    python = reference_python(opts.reference.python)
    rows = []
    with ExitStack() as stack:
        ref_opts = ReferenceOptions(**{**opts.reference.__dict__})
        runner = start_reference_runner(python, list(opts.reference.models), ref_opts,
                                        out / "repro" / "logs" / "reference-runner.log", origin.suite.family)
        stack.callback(runner.close)
        live = Live(origin, stack, out / "repro")
        for sid in segments:
            rows.append(reproduce(origin, sid, policy, runner, live, opts, args.budget, args.repeats, steps))
    if any(r["reproduced"] for r in rows) and not args.no_mlflow:
        from ..records.tracking import log_repro

        for run_id in log_repro(out):
            print(f"bundles added to MLflow run {run_id} (the dashboard's segment pages link them)", file=sys.stderr)
    print(table(rows))
    return EXIT_PASS if all(r["reproduced"] for r in rows) else EXIT_FAIL


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if not r["reproduced"]:
            lines.append(f"{r['segment']}: not reproduced ({r['probes']} probes)")
            continue
        checks = ", ".join(f"{k}: exit {v}" for k, v in r["validation"].items())
        lines.append(f"{r['segment']}: {r['minimal_case']}; {r['rate']['reproduced']}/{r['rate']['tries']} tries; "
                     f"{r['probes']} probes, {r['seconds']:.0f} s; repro.py {checks or 'not run'}\n  {r['bundle']}")
    return "\n".join(lines)


def add_repro_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "repro", help="shrink a run's finding to a minimal reproduction and a standalone bundle (repro.py, ISSUE.md)",
        description="Delta debugging against the run's candidate (started again): the fewest requests, the lowest "
                    "concurrency, the simplest arrival, the fewest settings, the shortest text and references that "
                    "still give the segment's verdict at its stage (and donor). Writes OUT/repro/SEGMENT/repro.json and "
                    "bundle/ (repro.py: standard library only, exit 1 when the defect shows). Exit 0: reproduced and "
                    "bundled; 1: not reproduced; 2: bad input; 3: an engine failed.")
    p.add_argument("out", help="the run folder (`difftest run --out`, or an entry's folder of `difftest bugs`)")
    p.add_argument("segment", nargs="?", help="the failing segment to reproduce")
    p.add_argument("--all", action="store_true", help="every failing segment of the run, one after another")
    p.add_argument("--budget", type=int, default=40, help="probes per finding at most (default 40); cached ones count")
    p.add_argument("--repeats", type=int, default=3,
                   help="tries of the starting case before it is called not reproduced, and of the minimal case for "
                        "its reproduction rate (default 3)")
    p.add_argument("--steps", default="all", help=f"comma-separated steps of the search (default all: {','.join(STEPS)})")
    p.add_argument("--store", help="reference result store (default: the run's)")
    p.add_argument("--policy", help="policy YAML (default: the one the run used)")
    p.add_argument("--no-mlflow", action="store_true",
                   help="do not add the bundles to the MLflow runs the run folder was logged as (OUT/mlflow.json)")
    p.set_defaults(func=cmd_repro)
    return p
