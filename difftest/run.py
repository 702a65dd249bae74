"""`difftest run`: the whole job, from a suite to a verdict.

suite -> reference (store or runner) -> candidate at 1 and at N -> cross-decodes
through the reference vocoder (own reference codes; each co-batched request's
where the vocoder check fails) -> verdicts -> report.json, summary, MLflow.

Everything lands on disk as soon as it exists, so a run interrupted anywhere
and started again with the same --out reuses every finished result.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import __version__
from .candidate_http import run_candidate
from .candidate_runner import run_candidate_runner
from .errors import BadInput, InfraError
from .launcher import ServerProcess, free_port
from .policy import Policy
from .progress import Progress
from .reference import REPO, ReferenceOptions, reference_python, run_reference, runner_argv, tiny_checkpoints
from .report import build_report, overall, summary_lines, write_report
from .results import CorruptResult, Result, ResultStore, atomic_write, _ext, read_result
from .runner_client import RunnerDied, RunnerProcess
from .speech_client import SpeechClient
from .suite import Suite
from .verdicts import Evidence, classify

CPU_ENGINE = "cpu-engine"
VLLM_OMNI = "vllm-omni"
VLLM_OMNI_OFFLINE = "vllm-omni-offline"


@dataclass
class CandidateSpec:
    """What to test: a server URL (with an optional capture dir), vLLM-Omni started here (its server or its
    offline API), or the CPU test engine started here."""

    kind: str  # "url", "cpu-engine", "vllm-omni" or "vllm-omni-offline"
    url: str | None = None
    defect: str | None = None
    capture_dir: Path | None = None
    api: str = "batch"  # vllm-omni-offline: "batch" (Omni.generate) or "async" (AsyncOmni, a request each)

    @classmethod
    def parse(cls, text: str, capture_dir: str | None = None) -> "CandidateSpec":
        if text == CPU_ENGINE or text.startswith(CPU_ENGINE + ":"):
            defect = text.split(":", 1)[1] if ":" in text else None
            return cls("cpu-engine", defect=defect or None)
        if text == VLLM_OMNI:
            return cls(text)
        if text == VLLM_OMNI_OFFLINE or text.startswith(VLLM_OMNI_OFFLINE + ":"):
            api = text.split(":", 1)[1] if ":" in text else "batch"
            if api not in ("batch", "async"):
                raise BadInput(f"--candidate {text!r}: the offline API is batch (vllm_omni.Omni) or async "
                               f"(vllm_omni.AsyncOmni)")
            return cls(VLLM_OMNI_OFFLINE, api=api)
        if text.startswith(("http://", "https://")):
            return cls("url", url=text.rstrip("/"), capture_dir=Path(capture_dir) if capture_dir else None)
        raise BadInput(f"--candidate {text!r}: expected a server URL (http://host:port), {VLLM_OMNI} "
                       f"(vLLM-Omni's server started here), {VLLM_OMNI_OFFLINE}[:async] (its offline API, float32 "
                       f"audio) or {CPU_ENGINE}[:DEFECT] (the CPU test engine, not vLLM-Omni)")

    @property
    def label(self) -> str:
        if self.kind == VLLM_OMNI:
            return self.kind
        if self.kind == VLLM_OMNI_OFFLINE:
            return self.kind + (":async" if self.api == "async" else "")
        if self.kind == "cpu-engine":
            return "difftest-cpu-engine" + (f":{self.defect}" if self.defect else "")
        return self.url


@dataclass
class RunOptions:
    concurrency: int = 4
    pattern: str = "barrier"
    order: str = "suite"
    voice_mode: str = "inline"
    store: Path = Path("difftest-store")
    reference: ReferenceOptions = field(default_factory=ReferenceOptions)
    request_timeout: float = 600.0
    engine_health_timeout: float = 300.0
    vllm_omni: dict = field(default_factory=dict)  # difftest.vllm_omni.VllmOmniOptions fields (python, device, ...)


def _segments_with_codes(results: dict) -> dict:
    return {k: r for k, r in results.items() if r.has_codes and len(r.codes)}


class _Vocoder:
    """Cross-decodes through the reference runner's `decode` job, cached on disk under the run."""

    def __init__(self, runner: RunnerProcess, out: Path, timeout: float):
        self.runner, self.out, self.timeout = runner, out, timeout
        self.out.mkdir(parents=True, exist_ok=True)

    def decode(self, items: dict[str, tuple[str, np.ndarray, np.ndarray]]) -> dict[str, Result | str]:
        """name -> (segment id, codes, ref codes); returns name -> Result, or an error message.

        Outputs are named by the content of their inputs, so a re-run reuses them
        and changed codes never reuse a stale decode."""
        done: dict[str, Result | str] = {}
        todo, names = [], {}
        for name, (sid, codes, ref) in items.items():
            stem = self.out / f"{name}.{_codes_key(codes, ref)[:16]}"
            try:
                done[name] = read_result(_ext(stem, ".json"))
                continue
            except CorruptResult:
                pass
            src = _ext(stem, ".in.npz")
            np.savez(src, codes=codes, ref_codes=ref)
            todo.append({"name": name, "input": str(src), "out": str(stem), "segment_id": sid})
            names[name] = stem
        if not todo:
            return done
        try:
            for ev in self.runner.request("decode", timeout=self.timeout, items=todo):
                name = ev.get("item") or ev.get("segment")
                if name not in names:
                    continue
                if ev.get("event") == "result":
                    try:
                        done[name] = read_result(ev["path"])
                    except CorruptResult as e:
                        done[name] = str(e)
                elif ev.get("event") == "error":
                    done[name] = ev.get("message", "decode failed")
        except RunnerDied as e:
            for name in names:
                done.setdefault(name, f"reference runner died during cross-decode: {str(e).splitlines()[0]}")
        for name in names:
            done.setdefault(name, "the reference runner did not answer this decode")
        return done


def _codes_key(codes: np.ndarray, ref: np.ndarray) -> str:
    import hashlib

    h = hashlib.sha256()
    for a in (codes, ref):
        a = np.ascontiguousarray(a, dtype=np.int64)
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def start_reference_runner(python: Path, models: list[str], ref_opts: ReferenceOptions, log: Path) -> RunnerProcess:
    runner = RunnerProcess(runner_argv(python, models, ref_opts), env=dict(os.environ, HF_HUB_OFFLINE="1"),
                           log_path=log, cwd=REPO)
    try:
        runner.start()
    except RunnerDied as e:
        raise InfraError(f"the reference runner did not start: {e}") from None
    return runner


def resolve_models(suite: Suite, opts: RunOptions, python: Path) -> list[str]:
    return list(opts.reference.models) or (
        tiny_checkpoints(ResultStore(opts.store).root, python) if suite.model == "tiny" else [suite.model])


def _start_candidate(spec: CandidateSpec, out: Path, models: list[str], python: Path, opts: RunOptions,
                     stack: ExitStack, suite: Suite) -> tuple[SpeechClient | RunnerProcess, Path | None, dict]:
    if spec.kind in (VLLM_OMNI, VLLM_OMNI_OFFLINE):
        from .vllm_omni import VllmOmniOptions, decode_settings, start_vllm_omni, start_vllm_omni_offline

        decode, warnings = decode_settings(suite.segments)
        settings = {"request_timeout": opts.request_timeout, "vocoder_dtype": opts.reference.dtype,
                    # the seeded tiny checkpoints never emit EOS: let a length-capped voice clone answer
                    "accept_length_finish": suite.model == "tiny", **opts.vllm_omni}
        vo_opts = VllmOmniOptions.for_decode(decode, opts.concurrency, **settings)
        tasks = {s.task for s in suite.segments}
        if spec.kind == VLLM_OMNI_OFFLINE:
            runner, info = start_vllm_omni_offline(out, models, vo_opts, stack, tasks=tasks, api=spec.api)
            info["warnings"] = warnings
            return runner, None, info
        client, capture, info = start_vllm_omni(out, models, vo_opts, stack, tasks=tasks)
        info["warnings"] = warnings
        return client, capture, info
    if spec.kind == "url":
        client = SpeechClient(spec.url, timeout=opts.request_timeout)
        if not client.health():
            raise InfraError(f"candidate {spec.url} is not healthy (GET /health)")
        return client, spec.capture_dir, {"label": spec.label, "url": spec.url}
    capture = out / "capture"
    capture.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [str(python), "-m", "runners.cpu_engine", "--port", str(port)]
    for m in models:
        argv += ["--model", m]
    if spec.defect:
        argv += ["--defect", spec.defect]
    env = dict(os.environ, DIFFTEST_CAPTURE_DIR=str(capture), HF_HUB_OFFLINE="1")
    srv = ServerProcess(argv, f"http://127.0.0.1:{port}", out / "logs" / "cpu-engine.log", env=env, cwd=REPO,
                        health_timeout=opts.engine_health_timeout, name="the CPU test engine")
    stack.enter_context(srv)
    client = SpeechClient(srv.url, timeout=opts.request_timeout)
    info = {"label": spec.label, "engine": "difftest CPU test engine (not vLLM-Omni)", "defect": spec.defect,
            "start_seconds": round(srv.started_s or 0.0, 2)}
    return client, capture, info


def run(suite: Suite, spec: CandidateSpec, out: Path, policy: Policy, opts: RunOptions,
        runner: RunnerProcess | None = None) -> dict:
    """Run everything; returns report.json's content (already written under `out`).

    `runner`: a reference runner already started (with the models this run needs), to share one
    between runs; it is left running. Otherwise one is started and stopped here."""
    out = Path(out).resolve()  # engines and runners run in other working folders
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    run_id = uuid.uuid4().hex[:8]  # tags capture files: engines may serve several runs at once
    timings: dict[str, float] = {}
    python = reference_python(opts.reference.python)
    if spec.kind == "url" and not SpeechClient(spec.url, connect_retries=1).health():
        raise InfraError(f"candidate {spec.url} is not healthy (GET /health)")  # before any model work
    if spec.kind == VLLM_OMNI_OFFLINE and (opts.pattern != "barrier" or opts.voice_mode != "inline"):
        raise BadInput(f"--pattern {opts.pattern} / --voices {opts.voice_mode}: the offline runner sends each "
                       f"wave of N as one batch with its voices inline (use the defaults, or --candidate {VLLM_OMNI})")
    pattern = "batch" if spec.kind == VLLM_OMNI_OFFLINE else opts.pattern
    store = ResultStore(opts.store)
    t0 = time.perf_counter()
    models = resolve_models(suite, opts, python)  # builds the tiny checkpoints on first use
    timings["checkpoints_s"] = time.perf_counter() - t0
    ref_opts = ReferenceOptions(**{**opts.reference.__dict__, "models": models})
    atomic_write(out / "run.json", json.dumps({
        "suite": str(suite.path), "suite_hash": suite.hash, "candidate": spec.label,
        "concurrency": opts.concurrency, "pattern": pattern, "order": opts.order,
        "store": str(store.root.resolve()), "models": models, "difftest_version": __version__,
    }, indent=1).encode())

    with ExitStack() as stack:
        if runner is None:
            t0 = time.perf_counter()
            runner = start_reference_runner(python, models, ref_opts, out / "logs" / "reference-runner.log")
            stack.callback(runner.close)
            timings["runner_start_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        ref_run = run_reference(suite, store.root, ref_opts, runner=runner)
        timings["reference_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        client, capture, cand_info = _start_candidate(spec, out, models, python, opts, stack, suite)
        timings["candidate_start_s"] = time.perf_counter() - t0
        outcomes = {}
        for n in sorted({1, opts.concurrency}):
            progress = Progress(len(suite.segments), label=f"candidate c={n}")
            t0 = time.perf_counter()
            if isinstance(client, RunnerProcess):  # the offline runner: each wave one batch
                outcomes[n] = run_candidate_runner(
                    suite.segments, client, out / "results" / f"candidate-c{n}", concurrency=n, order=opts.order,
                    timeout=opts.vllm_omni.get("health_timeout", 900.0), on_progress=progress.note,
                    on_result=lambda seg, r, p=progress: p.segment(seg.id, audio_seconds=r.seconds,
                                                                  seconds=r.timings.get("batch_seconds", 0.0)))
            else:
                outcomes[n] = run_candidate(
                    suite.segments, client, out / "results" / f"candidate-c{n}", concurrency=n,
                    pattern=opts.pattern, order=opts.order, voice_mode=opts.voice_mode, capture_dir=capture,
                    label=spec.label, provenance=cand_info, run_tag=f"{run_id}c{n}",
                    on_result=lambda seg, r, p=progress: p.segment(seg.id, audio_seconds=r.seconds,
                                                                  seconds=r.timings.get("request_seconds", 0.0)))
            for sid, err in outcomes[n].errors.items():
                progress.segment(sid, error=err["message"])
            progress.close()
            timings[f"candidate_c{n}_s"] = time.perf_counter() - t0
        cand, ctrl = outcomes[opts.concurrency], outcomes[1]

        # Each segment's own reference codes: what the candidate makes of its voice alone (c=1),
        # else what qwen-tts makes of it.
        def own_ref(sid):
            c = ctrl.results.get(sid)
            if c is not None and c.has_codes:
                return c.ref_codes
            r = ref_run.results.get(sid)
            return r.ref_codes if r is not None else np.zeros((0, 16), np.int64)

        t0 = time.perf_counter()
        vocoder = _Vocoder(runner, out / "results" / "cross", opts.reference.timeout)
        with_codes = _segments_with_codes(cand.results)
        cross = vocoder.decode({f"{sid}.own": (sid, r.codes, own_ref(sid)) for sid, r in with_codes.items()})
        peers_of = {}
        for wave in cand.batches:
            for sid in wave:
                peers_of[sid] = [p for p in wave if p != sid]

        def evidence(sid, donors=None):
            errors = []
            if sid in ref_run.failures:
                f = ref_run.failures[sid]
                errors.append({"source": "reference", "message": f.message,
                               "kind": "bad_input" if f.kind == "bad_input" else "infrastructure"})
            for label, o in (("candidate", cand), ("control", ctrl)):
                if sid in o.errors:
                    errors.append({**o.errors[sid], "source": label})
            x = cross.get(f"{sid}.own")
            if isinstance(x, str):
                errors.append({"source": "cross-decode", "kind": "infrastructure", "message": x})
                x = None
            return Evidence(sid, ref_run.results.get(sid), cand.results.get(sid), ctrl.results.get(sid), x,
                            donors or {}, {p: own_ref(p) for p in peers_of.get(sid, [])}, errors,
                            suite.chunks["initial_frames"], suite.chunks["frames"])

        verdicts = {s.id: classify(evidence(s.id), policy) for s in suite.segments}
        # Donor search where the vocoder check failed: decode with each co-batched request's reference.
        need = {}
        for sid, v in verdicts.items():
            if "vocoder" in v.comparisons and sid in with_codes and v.verdict in ("vocoder_defect", "contamination"):
                for p in peers_of.get(sid, []):
                    rc = own_ref(p)
                    if len(rc):
                        need[f"{sid}.donor-{p}"] = (sid, with_codes[sid].codes, rc)
        if need:
            donors = vocoder.decode(need)
            for sid in {k.split(".donor-")[0] for k in need}:
                found = {k.split(".donor-")[1]: r for k, r in donors.items()
                         if k.startswith(f"{sid}.donor-") and isinstance(r, Result)}
                verdicts[sid] = classify(evidence(sid, found), policy)
        timings["cross_decode_s"] = time.perf_counter() - t0

    ordered = [verdicts[s.id] for s in suite.segments]
    # The candidate at concurrency 1 judged on its own against the reference: a defect that only
    # concurrency causes must leave this clean (no extra model work: every input is already here).
    at_one = [classify(Evidence(s.id, ref_run.results.get(s.id), ctrl.results.get(s.id),
                                errors=[{**ctrl.errors[s.id], "source": "control"}] if s.id in ctrl.errors else [],
                                initial_frames=suite.chunks["initial_frames"], chunk_frames=suite.chunks["frames"]),
                       policy) for s in suite.segments]
    timings["total_s"] = time.perf_counter() - t_start
    report = build_report(
        ordered, policy,
        suite={"name": suite.name, "path": str(suite.path), "hash": suite.hash, "segments": len(suite.segments)},
        reference={"label": "qwen-tts", "fingerprint": ref_run.fingerprint, "provenance": ref_run.provenance,
                   "cached_segments": len(ref_run.cached)},
        candidate={**cand_info, "pattern": pattern, "order": opts.order, "voice_mode": opts.voice_mode,
                   "batches": cand.batches},
        concurrency=opts.concurrency,
        provenance={"difftest": __version__, "timings": {k: round(v, 3) for k, v in timings.items()}},
        warnings=[f"{sid}: reference: {f.message}" for sid, f in ref_run.failures.items()],
    )
    report["at_concurrency_1"] = {
        "verdict": overall(at_one, policy)[0],
        "segments": [{"id": v.id, "verdict": v.verdict, "first_divergent_chunk": v.first_divergent_chunk,
                      "summary": v.summary} for v in at_one],
    }
    write_report(out, report)
    return report


def print_summary(report: dict, out: Path, stream=sys.stdout) -> None:
    print("\n".join(summary_lines(report)), file=stream)
    one = report.get("at_concurrency_1")
    if one and report.get("concurrency", 1) > 1:
        bad = [s["id"] for s in one["segments"] if s["verdict"] not in ("identical", "numeric_drift")]
        print(f"  at concurrency 1 alone: {one['verdict']}" + (f" ({', '.join(bad)} not clean)" if bad else ""),
              file=stream)
    print(f"report: {Path(out) / 'report.json'}", file=stream)
