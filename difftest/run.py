"""`difftest run`: the whole job, from a suite to a verdict.

suite -> reference (store or runner) -> candidate at 1 and at N -> cross-decodes
through the reference vocoder (own reference codes; each co-batched request's
where the vocoder check fails) -> verdicts -> report.json, summary, MLflow.

Everything lands on disk as soon as it exists, so a run interrupted anywhere
and started again with the same --out reuses every finished result.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

from . import __version__
from .engines import engine_death, url_reuse
from .engines.base import Engine
from .engines.reference import ReferenceEngine, ReferenceOptions, reference_python
from .engines.scorer import Scorer
from .engines.start import (
    CPU_ENGINE,
    URL,
    VLLM_OMNI,
    VLLM_OMNI_OFFLINE,
    CandidateSpec,
    Setup,
    engine_identity,
    start_candidate,
)
from .errors import BadInput
from .pipeline import null_phase
from .pipeline.cross import Vocoder, vocoder_numerics
from .pipeline.judging import judge_at_one, judge_segments
from .pipeline.options import RunOptions
from .pipeline.passes import (
    REPEAT,
    pass_order,
    result_folders,
    results_with_codes,
    serve_passes,
    server_counters,
    stop_if_disk_full,
)
from .pipeline.scoring import score_streams, shared_seeds
from .pipeline.starting import announce, resolve_models, start_ray_candidate, start_ray_pool, start_reference_runner
from .process.runner_client import RunnerProcess
from .records.report import build_report, overall, write_report
from .results import ResultStore, atomic_write, prepare_out
from .suites.checkpoints import check_suite
from .suites.suite import Suite
from .verdicts import exercised, sampling
from .verdicts import null as measured_null
from .verdicts.policy import Policy

__all__ = ["CPU_ENGINE", "URL", "VLLM_OMNI", "VLLM_OMNI_OFFLINE", "CandidateSpec", "RunOptions", "run"]


class _Timings(dict):
    """`with timings("phase_s"):` records how long a phase took."""

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self[name] = time.perf_counter() - t0


def run(suite: Suite, spec: CandidateSpec, out: Path, policy: Policy, opts: RunOptions,
        runner: RunnerProcess | None = None, candidate: Engine | None = None) -> dict:
    """Run everything; returns report.json's content (already written under `out`).

    `runner`: a reference runner already started (with the models this run needs), to share one
    between runs; it is left running. Otherwise one is started and stopped here. `candidate`: the
    candidate `spec` names, already started (start_candidate; bisect serves one build for several
    runs); otherwise it is started and stopped here."""
    out = prepare_out(out)  # resolved: engines and runners run in other working folders
    prepare_out(opts.store, "--store")
    t_start = time.perf_counter()
    run_id = uuid.uuid4().hex[:8]  # tags capture files: engines may serve several runs at once
    timings = _Timings()
    python = reference_python(opts.reference.python)
    pattern = _pattern(spec, opts)
    store = ResultStore(opts.store)
    with timings("checkpoints_s"):
        models = resolve_models(suite, opts, python)  # builds the tiny checkpoints on first use
    check_suite(suite, models)  # every segment servable, before any model loads
    ref_opts = ReferenceOptions(**{**opts.reference.__dict__, "models": models})

    with ExitStack() as stack:
        if runner is None:
            with timings("runner_start_s"):
                runner = (start_ray_pool(python, models, ref_opts, opts.ray) if opts.ray is not None else
                          start_reference_runner(python, models, ref_opts, out / "logs" / "reference-runner.log",
                                               suite.family))
            stack.push(lambda *exc: runner.kill() if exc[0] else runner.close())  # interrupted: no grace
        # What the candidate is, before any model work: a run folder holding another's results is refused.
        setup = Setup(out, models, python, suite, opts, runner.hello.get("fingerprint") or {})
        engine = engine_identity(spec, setup)
        folders = result_folders(out, engine, opts, pattern)
        voc_numerics, null_vocoder = vocoder_numerics(engine, opts, runner, out, store.root)
        atomic_write(out / "run.json", json.dumps({
            "suite": str(suite.path), "suite_hash": suite.hash, "candidate": spec.label, "engine": engine,
            "concurrency": opts.concurrency, "pattern": pattern, "order": opts.order,
            "store": str(store.root.resolve()), "models": models, "difftest_version": __version__,
            "replay": replay_record(spec, opts),
        }, indent=1, sort_keys=True).encode())

        with timings("reference_s"):
            ref_run = ReferenceEngine(runner, store.root, opts.reference.timeout).generate(suite.segments)
        stop_if_disk_full(ref_run.errors, store.root)
        if candidate is None:
            with timings("candidate_start_s"):
                candidate = _start(spec, setup, opts, stack, run_id)
        announce(candidate.info)
        if not spec.is_.started_here and spec.declared is None:  # whatever answers at the URL now: re-checked
            url_reuse.check(candidate, suite.segments, {n: folders[n] for n in sorted(folders, key=pass_order)},
                            engine, spec.url, opts.reuse_unidentified)
        # a server serves several runs (difftest repro's probes): its counters are read before and after this one
        counted_before = server_counters(candidate.info)
        outcomes = serve_passes(candidate, suite, folders, timings)
        cand, ctrl, again = outcomes[opts.concurrency], outcomes[1], outcomes.get(REPEAT)
        cand_info = _served(candidate.info, outcomes, counted_before)

        roles = {"candidate": cand, "control": ctrl}
        if any(s.decode.get("do_sample") or s.decode.get("subtalker_dosample") for s in suite.segments):
            roles["reference"] = ref_run  # the reference's own samples: the sampling test's calibration
        if "score_version" not in runner.hello:  # a reference that cannot teacher-force (Qwen3-Omni's so far)
            why = f"{suite.family.display}'s reference runner does not teacher-force yet"
            print(f"teacher forcing: none ({why}); code_divergence fails this run", file=sys.stderr, flush=True)
            scores = ({r: {} for r in roles}, {r: {} for r in roles})
            null = null_phase.unmeasured(engine, opts.candidate_dtype, ctrl, ref_run, why,
                                         suite.family.reference_name)
            # code_divergence passes because teacher forcing found the codes plausible; with nothing to
            # teacher-force them, a divergence (a talker prompted with another speaker) is not told from numerics
            policy = replace(policy, fail_on=policy.fail_on | {"code_divergence"})
            null.warnings.append("code_divergence fails this run: no teacher forcing judged the candidate's "
                                 "codes, so a divergence cannot be told from the numerics' drift")
        else:
            print(f"teacher forcing: {len(results_with_codes(cand.results))} segments at c={opts.concurrency} and "
                  f"{len(results_with_codes(ctrl.results))} at c=1 through {suite.family.reference_name}'s talker",
                  file=sys.stderr, flush=True)
            with timings("score_s"):
                scorer = Scorer(runner, store.root, opts.reference.timeout)
                scores = score_streams(scorer, suite, roles)
            with timings("null_s"):
                null = null_phase.measure(suite, scorer, ReferenceEngine(runner, store.root, opts.reference.timeout),
                                          ref_run, engine, opts.candidate_dtype, opts.concurrency, cand, ctrl,
                                          scores[0], policy)
        print(f"cross-decodes: {len(results_with_codes(cand.results))} segments through the reference vocoder",
              file=sys.stderr, flush=True)
        with timings("cross_decode_s"):
            vocoder = Vocoder(runner, out / "results" / "cross", opts.reference.timeout, store.root)
            verdicts, vocoder_nulls = judge_segments(suite, ref_run, cand, ctrl, vocoder, policy, again, scores, null,
                                                     null_vocoder)

    ordered = [verdicts[s.id] for s in suite.segments]
    for sid, notes in measured_null.suspect_notes([null.at_one, null.at_n]).items():  # a run-level failure names them
        verdicts[sid].notes.extend(notes)
    at_one = judge_at_one(suite, ref_run, ctrl, scores[0], null, vocoder_nulls, voc_numerics, policy)
    timings["total_s"] = time.perf_counter() - t_start
    report = _report(suite, spec, opts, policy, pattern, engine, folders, ref_run, outcomes, cand_info, ordered, at_one,
                     scores, null, voc_numerics, timings)
    write_report(out, report)
    return report


def _pattern(spec: CandidateSpec, opts: RunOptions) -> str:
    """The arrival pattern the run serves its waves in."""
    if spec.is_.one_batch_per_wave and (opts.pattern != "barrier" or opts.voice_mode != "inline"):
        raise BadInput(f"--pattern {opts.pattern} / --voices {opts.voice_mode}: the offline runner sends each "
                       f"wave of N as one batch with its voices inline (use the defaults, or --candidate {VLLM_OMNI})")
    return "batch" if spec.is_.one_batch_per_wave else opts.pattern


def _start(spec: CandidateSpec, setup: Setup, opts: RunOptions, stack: ExitStack, run_id: str) -> Engine:
    """The candidate, started here (or in a Ray actor), stopped when `stack` closes."""
    if (opts.ray or {}).get("candidate"):
        candidate = start_ray_candidate(spec, setup, opts.ray, run_id)
        stack.callback(candidate.close)
        return candidate
    return start_candidate(spec, setup, stack, run_tag=run_id)


def _served(info: dict, outcomes: dict, counted_before: dict) -> dict:
    """The candidate's info once its passes are served: a stage that died named in its segments' errors
    (from the server's log); its counters' share of this run, read while the servers still run (did the
    cache serve, was any request preempted?)."""
    from .engines.vllm_omni import counters_since

    logs = [s["log"] for s in info.get("servers") or [] if s.get("log")]
    for o in outcomes.values():
        engine_death.attribute(o.errors, logs)
    return {**info, **{k: counters_since(v, counted_before.get(k)) for k, v in server_counters(info).items()}}


def _report(suite: Suite, spec: CandidateSpec, opts: RunOptions, policy: Policy, pattern: str, engine: dict,
            folders: dict, ref_run, outcomes: dict, cand_info: dict, ordered: list, at_one: list,
            scores: tuple[dict, dict], null: null_phase.MeasuredNull, voc_numerics: dict, timings: dict) -> dict:
    """report.json's content (difftest/records/report.py builds it) from every phase's outcome."""
    cand, ctrl, again = outcomes[opts.concurrency], outcomes[1], outcomes.get(REPEAT)
    passes = {f"c={opts.concurrency}": cand.results, "c=1": ctrl.results,
              **({"repeat": again.results} if again else {})}
    judged = {"concurrency": exercised.concurrency(opts.concurrency, cand.results, len(suite.segments)),
              "codes": exercised.codes_judged(ordered),
              "references": exercised.references(suite.segments, {"reference": ref_run.results, **passes})}
    sampling_roles = null.sampling_roles(scores[0])
    report = build_report(
        ordered, policy,
        suite={"name": suite.name, "path": str(suite.path), "hash": suite.hash, "segments": len(suite.segments)},
        reference={"label": suite.family.reference_label, "fingerprint": ref_run.fingerprint,
                   "provenance": ref_run.provenance, "cached_segments": len(ref_run.cached)},
        candidate={**{k: v for k, v in cand_info.items() if k != "served_configuration"}, "pattern": pattern,
                   "order": opts.order, "voice_mode": opts.voice_mode,
                   "batches": cand.batches, "identity": engine, "identity_key": folders[opts.concurrency][1]},
        concurrency=opts.concurrency,
        provenance={"difftest": __version__, "timings": {k: round(v, 3) for k, v in timings.items()}},
        warnings=policy.warnings() + [f"{sid}: reference: {e['message']}" for sid, e in ref_run.errors.items()]
        + [f"{sid}: teacher forcing of the reference's own sample: {m}" for sid, m in scores[1].get("reference", {}).items()]
        + null.warnings + shared_seeds(suite)
        + ([] if opts.concurrency > 1 else ["concurrency 1: every request was served alone; a cross-request defect "
                                            "(the seed's leak) cannot show in this run"])
        + exercised.unbatched_warning(judged["concurrency"]),
        sampling=sampling.judge(sampling_roles, policy.forced.sampling_max_z, policy.forced.sampling_false_flag_rate),
        null=null.at_one, null_n=null.at_n,
        configuration=exercised.finding(cand_info, passes, judged, opts.require_paths,
                                        sum(len(o.errors) for o in outcomes.values())),
        served_configuration=cand_info.get("served_configuration"),
    )
    one = sampling.judge({k: v for k, v in sampling_roles.items() if k != "candidate"}, policy.forced.sampling_max_z,
                         policy.forced.sampling_false_flag_rate)
    report["vocoder_numerics"] = voc_numerics
    report["at_concurrency_1"] = {
        "verdict": overall(at_one, policy, [f for f in (one, null.at_one) if f])[0],
        "segments": [{"id": v.id, "verdict": v.verdict, "first_divergent_chunk": v.first_divergent_chunk,
                      "summary": v.summary} for v in at_one],
    }
    return report


def replay_record(spec: CandidateSpec, opts: RunOptions) -> dict:
    """What starting this candidate again takes (`difftest repro` serves its probes to the same
    engine and configuration): the spec's fields and the run's engine settings, as JSON."""
    return {"spec": spec.to_json(),
            "vllm_omni": opts.vllm_omni, "voice_mode": opts.voice_mode, "candidate_dtype": opts.candidate_dtype,
            "candidate_vocoder_dtype": opts.candidate_vocoder_dtype,
            "repeat": opts.repeat, "reference": {"dtype": opts.reference.dtype, "device": opts.reference.device,
                                                 "python": opts.reference.python}}


