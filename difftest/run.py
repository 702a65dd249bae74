"""`difftest run`: the whole job, from a suite to a verdict.

suite -> reference (store or runner) -> candidate at 1 and at N -> cross-decodes
through the reference vocoder (own reference codes; each co-batched request's
where the vocoder check fails) -> verdicts -> report.json, summary, MLflow.

Everything lands on disk as soon as it exists, so a run interrupted anywhere
and started again with the same --out reuses every finished result.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import __version__
from .engines import engine_death, url_reuse
from .engines import identity as ident
from .engines.base import Engine
from .engines.reference import (
    REPO,
    ReferenceEngine,
    ReferenceOptions,
    reference_python,
    runner_argv,
    runner_env,
    tiny_checkpoints,
)
from .engines.scorer import ScoreItem, Scorer
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
from .errors import BadInput, InfraError, no_space
from .family import CODEBOOKS
from .process.runner_client import RunnerDied, RunnerProcess, item_answers
from .progress import Progress
from .records.report import build_report, overall, write_report
from .results import CorruptResult, Result, ResultStore, _ext, atomic_write, prepare_out, read_result
from .suites.checkpoints import check_suite
from .suites.suite import TINY_HAZARD, TINY_MODELS, Suite, content_hash, hf_cached
from .verdicts import exercised, sampling, vocoder_null
from .verdicts import null as measured_null
from .verdicts.classify import Evidence, classify, talker_stage
from .verdicts.policy import Policy
from .verdicts.talker_input import inputs_of

__all__ = ["CPU_ENGINE", "URL", "VLLM_OMNI", "VLLM_OMNI_OFFLINE", "CandidateSpec", "RunOptions", "run"]


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
    vllm_omni: dict = field(default_factory=dict)  # difftest.engines.vllm_omni.VllmOmniOptions fields (python, device, ...)
    replace: bool = False  # discard a run folder's results that another candidate or configuration produced
    repeat: bool = True  # serve every segment once more at concurrency 1, after the others (history check)
    ray: dict | None = None  # {"address": ..., "workers": N}: the reference side on Ray (difftest.scale)
    candidate_dtype: str | None = None  # the candidate talker's dtype, declared (the measured null's numerics)
    candidate_vocoder_dtype: str | None = None  # the candidate vocoder's dtype, declared (the vocoder's null)
    reuse_unidentified: bool = False  # reuse a URL candidate's results though it says nothing of itself (url_reuse)
    require_paths: tuple = ()  # serving paths the run must show it took (verdicts/exercised.PATHS)


def _segments_with_codes(results: dict) -> dict:
    return {k: r for k, r in results.items() if r.has_codes and len(r.codes)}


class _Vocoder:
    """Cross-decodes through the reference runner's `decode` job. Each is kept in the store (a
    later run of the same codes through the same reference vocoder loads no model for it) and
    copied into the run's own folder, which the report names."""

    def __init__(self, runner: RunnerProcess, out: Path, timeout: float, store_root: Path, dtype: str | None = None):
        self.runner, self.out, self.timeout = runner, out, timeout
        # A decode is reused only from the same reference vocoder (checkpoint, dtype, device, threads,
        # runner version: the fingerprint) and the same input codes (the key). `dtype`: qwen-tts's
        # vocoder in another dtype than the runner's own (the vocoder's null), under that fingerprint.
        fingerprint = runner.hello.get("fingerprint") or {}
        self.dtype = dtype if dtype != fingerprint.get("dtype") else None
        if self.dtype is not None:
            if self.dtype not in runner.hello.get("decode_dtypes", ()):
                raise InfraError(f"the reference runner cannot decode in {self.dtype} (an older runner?): restart it "
                                 f"from this checkout")
            fingerprint = {**fingerprint, "dtype": self.dtype}
        self.salt = content_hash(fingerprint)
        self.kept = ResultStore(store_root).config_dir("cross", fingerprint)
        self.out.mkdir(parents=True, exist_ok=True)

    def _copy(self, name: str, key: str) -> Result:
        """The kept decode, copied into the run folder and read from there."""
        src, dst = self.kept / f"{name}.{key}", self.out / f"{name}.{key}"
        for ext in (".npz", ".json"):  # the sidecar last: it commits to the npz
            atomic_write(_ext(dst, ext), _ext(src, ext).read_bytes())
        return read_result(_ext(dst, ".json"))

    def decode(self, items: dict[str, tuple[str, np.ndarray, np.ndarray]]) -> dict[str, Result | str]:
        """name -> (segment id, codes, ref codes); returns name -> Result, or an error message.

        Outputs are named by the content of their inputs, so a re-run reuses them
        and changed codes never reuse a stale decode."""
        done: dict[str, Result | str] = {}
        todo, keys = [], {}
        for name, (sid, codes, ref) in items.items():
            key = keys[name] = _codes_key(codes, ref, self.salt)[:16]
            for read in (lambda: read_result(_ext(self.out / f"{name}.{key}", ".json")), lambda: self._copy(name, key)):
                try:
                    done[name] = read()
                    break
                except (CorruptResult, FileNotFoundError):
                    pass
            if name in done:
                continue
            stem = self.kept / f"{name}.{key}"
            src = _ext(stem, ".in.npz")
            buf = io.BytesIO()
            np.savez(buf, codes=codes, ref_codes=ref)
            atomic_write(src, buf.getvalue())
            todo.append({"name": name, "input": str(src), "out": str(stem), "segment_id": sid,
                         **({"dtype": self.dtype} if self.dtype else {})})
        if not todo:
            return done
        answers = item_answers(self.runner, "decode", todo, self.timeout, read_result, "during cross-decode")
        for name, got in answers.items():
            if isinstance(got, Result):
                got = self._copy(name, keys[name])
            done[name] = got
        return done


def _codes_key(codes: np.ndarray, ref: np.ndarray, salt: str = "") -> str:
    h = hashlib.sha256(salt.encode())
    for a in (codes, ref):
        a = np.ascontiguousarray(a, dtype=np.int64)
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def start_reference_runner(python: Path, models: list[str], ref_opts: ReferenceOptions, log: Path) -> RunnerProcess:
    runner = RunnerProcess(runner_argv(python, models, ref_opts), env=runner_env(ref_opts),
                           log_path=log, cwd=REPO)
    try:
        runner.start()
    except RunnerDied as e:
        raise InfraError(f"the reference runner did not start: {e}") from None
    return runner


def start_ray_pool(python: Path, models: list[str], ref_opts: ReferenceOptions, ray: dict):
    """Reference runners as Ray actors (difftest.scale.ray_pool), behind the RunnerProcess surface."""
    from .scale.ray_pool import RayRunnerPool

    options = {k: v for k, v in ref_opts.__dict__.items() if k in ("device", "dtype", "threads")}
    pool = RayRunnerPool(python, models, options, workers=int(ray.get("workers") or 2), address=ray.get("address"))
    print(f"reference: {pool.workers} qwen-tts runners on Ray ({ray.get('address') or 'a local cluster'})",
          file=sys.stderr, flush=True)
    pool.start()
    return pool


def start_ray_candidate(spec: CandidateSpec, setup: Setup, ray: dict, run_tag: str):
    """The candidate in a Ray actor (difftest.scale.ray_candidate): its engine on whichever node has room."""
    from .scale.ray_candidate import RayCandidate

    if not spec.is_.started_here:
        raise BadInput("--ray-candidate: a URL candidate is already served elsewhere; start vllm-omni, "
                       "vllm-omni-offline or cpu-engine in the actor instead")
    gpus = float(ray.get("candidate_gpus") or 0)
    print(f"candidate: {spec.label} in a Ray actor ({gpus:g} GPU)", file=sys.stderr, flush=True)
    return RayCandidate(spec, setup, address=ray.get("address"), gpus=gpus, run_tag=run_tag)


def resolve_models(suite: Suite, opts: RunOptions, python: Path) -> list[str]:
    if opts.reference.models:
        return list(opts.reference.models)
    if suite.model in TINY_MODELS:
        return tiny_checkpoints(ResultStore(opts.store).root, python, hazard=suite.model == TINY_HAZARD)
    if not Path(suite.model).expanduser().is_dir() and not hf_cached(suite.model):
        raise BadInput(f"{suite.path}: model: {suite.model!r} is no folder and not in the local Hugging Face cache "
                       f"(nothing is downloaded: fetch it first, or pass --reference-model FOLDER)")
    return [suite.model]


class _Timings(dict):
    """`with timings("phase_s"):` records how long a phase took."""

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self[name] = time.perf_counter() - t0


def _engine_starts(outcome, started: dict) -> float:
    """Seconds of engine start inside a candidate pass: the offline runner starts each checkpoint
    type's engine at the first request that needs it, and says how long that took in each result
    it computed (`engine_start_s`). `started`: the checkpoints whose engine was already counted."""
    took = 0.0
    for sid, r in outcome.results.items():
        seconds = (r.timings or {}).get("engine_start_s")
        ckpt = ((r.provenance or {}).get("checkpoint") or {}).get("path")
        if sid in outcome.cached or seconds is None or ckpt in started:
            continue
        started[ckpt] = seconds
        took += seconds
    return took


def _result_folders(out: Path, engine: dict, opts: RunOptions, pattern: str) -> dict[int, tuple[Path, str]]:
    """concurrency -> (folder of its candidate results, identity key), each checked against what the
    folder already holds (BadInput, before any model work) or discarded first with --replace."""
    folders = {}
    for n in sorted({1, opts.concurrency}):
        load = {"concurrency": n, "pattern": pattern, "order": opts.order, "voice_mode": opts.voice_mode, "seed": 0}
        folders[n] = (out / "results" / f"candidate-c{n}", ident.folder_identity(engine, load))
    if opts.repeat:  # concurrency 1 again, the suite reversed, after the other passes
        load = {"concurrency": 1, "pattern": pattern, "order": opts.order, "voice_mode": opts.voice_mode, "seed": 0,
                "repeat": "reversed, after the other passes"}
        folders[REPEAT] = (out / "results" / "candidate-c1-repeat", ident.folder_identity(engine, load))
    for folder, identity in folders.values():
        try:
            ident.check(folder, identity)
        except BadInput:
            if not opts.replace:
                raise
            ident.discard(folder)
    for folder, identity in folders.values():
        ident.claim(folder, identity)
    return {n: (folder, ident.key(identity)) for n, (folder, identity) in folders.items()}


REPEAT = "repeat"  # the history check's pass (difftest/verdicts/history.py)


def _pass_order(n) -> tuple:
    """The pass at N first, then at 1, then the repeat."""
    return (n == REPEAT, n == 1)


def _candidate_at(n, engine, suite: Suite, folder: Path, key: str):
    """The candidate's pass at concurrency `n`, or the repeat pass (`REPEAT`: at 1, the suite reversed,
    so each segment comes after another history than in the first pass)."""
    segments = list(reversed(suite.segments)) if n == REPEAT else suite.segments
    progress = Progress(len(segments), label="candidate c=1 again, reversed" if n == REPEAT else f"candidate c={n}")
    outcome = engine.generate(segments, concurrency=1 if n == REPEAT else n, out_dir=folder, identity_key=key,
                              progress=progress)
    for sid, err in outcome.errors.items():
        progress.segment(sid, error=err["message"])
    for sid in sorted(outcome.cached):  # reused from the run folder: engines report only what they compute
        progress.segment(sid, cached=True)
    progress.close()
    _stop_if_disk_full(outcome.errors, folder)
    hung = next((e["message"] for e in outcome.errors.values() if e.get("server_dead")), None)
    if hung:  # every later request would wait out the timeout too: stop, keeping what was received
        raise InfraError(f"candidate: {hung}; what it answered is kept, the same command resumes")
    return outcome


def _stop_if_disk_full(errors: dict, folder: Path) -> None:
    """A full disk failed these segments (an engine's capture write, a runner's result): the run
    stops with exit 3 naming the folder, instead of judging the engine by the machine's failure.
    What was written stays; the same command resumes once there is room."""
    full = sorted(sid for sid, e in errors.items() if no_space(e.get("message", "")))
    if full:
        raise InfraError(f"{folder}: no space left on device ({len(full)} segment(s) failed writing there: "
                         f"{', '.join(full[:4])}{', ...' if len(full) > 4 else ''}); free space and run the same "
                         f"command again: what was written is kept")


def _conditioning(seg, r: Result) -> np.ndarray | None:
    """The reference codes a candidate's talker was prompted with (the capture's talker stage, else
    what reached the vocoder), to teacher-force its codes in the same context; None where the
    segment has no in-context reference (the voice's own prompt is then the whole context)."""
    if seg.task != "voice_clone" or seg.voice is None or seg.voice.mode != "icl":
        return None
    talker = talker_stage(r)
    rc = talker["ref_codes"] if talker is not None else r.ref_codes
    return rc if len(rc) else None


def score_streams(scorer: Scorer, suite: Suite, outcomes: dict, only: set | None = None) -> tuple[dict, dict]:
    """Teacher-forced scores of every candidate stream with codes: (role -> sid -> ScoreFile,
    role -> sid -> error message). `outcomes`: role -> the candidate's outcome at that role;
    `only`: these segments' streams alone."""
    items = {}
    for role, o in outcomes.items():
        for seg in suite.segments:
            r = o.results.get(seg.id)
            if only is not None and seg.id not in only:
                continue
            if r is None or not r.has_codes or not len(r.codes):
                continue
            # qwen-tts yields max_new_tokens - 1 frames when no EOS came (the last token never becomes one)
            eos = len(r.codes) < int(seg.decode["max_new_tokens"]) - 1
            items[f"{role}:{seg.id}"] = ScoreItem(seg, r.codes, _conditioning(seg, r), eos)
    got = scorer.score(items) if items else {}
    scores: dict = {role: {} for role in outcomes}
    errors: dict = {role: {} for role in outcomes}
    for name, sf in got.items():
        role, sid = name.split(":", 1)
        (errors if isinstance(sf, str) else scores)[role][sid] = sf
    return scores, errors


def shared_seeds(suite: Suite) -> list[str]:
    """A warning for sampled segments that share a seed: they draw the same random numbers, so their
    tokens are not independent and the sampling test's false-flag rate is not what it states."""
    by_seed: dict = {}
    for s in suite.segments:
        if s.decode.get("do_sample") or s.decode.get("subtalker_dosample"):
            by_seed.setdefault(s.decode.get("seed"), []).append(s.id)
    return [f"sampled segments {', '.join(ids)} share seed {seed}: their draws are not independent, and the "
            f"sampling test's false-flag rate holds only for segments with seeds of their own"
            for seed, ids in by_seed.items() if len(ids) > 1]


def null_finding(suite: Suite, scorer: Scorer, ref_engine: ReferenceEngine, ref_run, control: dict,
                 numerics: dict, policy: Policy, share: float = 1.0) -> tuple[dict | None, list[str], tuple | None]:
    """The measured null's run-level test of the candidate's streams at concurrency 1 (`control`:
    segment -> ScoreFile), warnings for the segments it could not decode or score, and the null
    itself (`_null_alone`'s answer, for the run at N; None when not decoded). The null is qwen-tts
    in the candidate talker's dtype (`numerics`): the reference itself when that is the reference's
    own, else decoded (codes only, cached in the store) now; none at all when no greedy token needs
    explaining. `share`: the part of the run's false-flag rate it spends."""
    if not measured_null.needed(control):
        return measured_null.judge(control, None, policy.null, numerics, share=share), [], None, None
    alone = _null_alone(suite, scorer, ref_engine, ref_run, numerics, [s for s in suite.segments if s.id in control])
    finding = measured_null.judge(control, alone[1], policy.null, numerics, share=share)
    model, warnings = _noise_model(suite, scorer, alone, numerics, policy, len(control))
    if finding is not None and model is not None:
        finding["noise_model"] = model.to_json()
    return finding, alone[2] + warnings, alone, model


def _noise_model(suite: Suite, scorer: Scorer, alone, numerics: dict, policy: Policy, segments: int):
    """The null's streams scored by qwen-tts in their own numerics too: how far those numerics move each
    margin (null.NoiseModel), for each segment's own flips. None in the reference's own numerics (the
    float32 tie rule judges there) or where nothing could be scored."""
    if numerics["exact"] or not alone[1]:
        return None, []
    own = Scorer(scorer.runner, scorer.store_root, scorer.timeout, dtype=numerics["dtype"])
    got, errors = score_streams(own, suite, {"null": alone[0]}, set(alone[1]))
    warnings = [f"{sid}: measured null's noise model, scoring in {numerics['dtype']}: {m}"
                for sid, m in errors["null"].items()]
    p = policy.null
    return measured_null.noise_model(alone[1], got["null"], numerics["dtype"], p.noise_scale,
                                     p.segment_false_flag_rate, segments), warnings


def _null_alone(suite: Suite, scorer: Scorer, ref_engine: ReferenceEngine, ref_run, numerics: dict, segments: list):
    """qwen-tts in the null's dtype, each segment alone (the reference itself where that is its own
    dtype), teacher-forced: (its run, segment -> ScoreFile, warnings, what it is). Sets numerics["null"]."""
    dtype = numerics["dtype"]
    own = dtype == ref_run.fingerprint.get("dtype")
    null_run = ref_run if own else ref_engine.generate(segments, dtype=dtype, codes_only=True)
    numerics["null"] = "the reference itself" if own else f"qwen-tts in {dtype}, cached at {null_run.config_dir}"
    got, errors = score_streams(scorer, suite, {"null": null_run}, {s.id for s in segments})
    wanted = {s.id for s in segments}
    warnings = [f"{sid}: measured null: {e['message']}" for sid, e in null_run.errors.items() if sid in wanted]
    warnings += [f"{sid}: measured null, teacher forcing: {m}" for sid, m in errors["null"].items()]
    return null_run, got["null"], warnings, numerics["null"]


def null_at_n_finding(suite: Suite, scorer: Scorer, ref_engine: ReferenceEngine, ref_run, cand, ctrl,
                      scores_1: dict, scores_n: dict, numerics: dict, policy: Policy, at_one: str | None,
                      alone: tuple | None = None) -> tuple[dict | None, dict | None, list[str]]:
    """The run at concurrency N against the null batched as its waves (difftest/verdicts/null.py):
    (the run-level finding, the null's batch noise for the near-tie rule, warnings). Nothing is
    decoded where nothing needs explaining: no greedy segment's codes part between 1 and N, and
    every greedy token at N is qwen-tts's top-1. `alone`: the null at 1, where already decoded."""
    ok = lambda s: all(s.id in o.results and o.results[s.id].has_codes for o in (cand, ctrl))  # noqa: E731
    groups = [kept for g in measured_null.batch_groups(suite.segments, cand.batches)
              if (kept := [s for s in g if ok(s)])]
    ids = [s.id for g in groups for s in g]
    flips = {}  # segment -> where its greedy codes at N part from those at 1, and the width of that tie
    for sid in ids:
        if (at := measured_null.flip_at(ctrl.results[sid].codes, cand.results[sid].codes)) is not None:
            gap = measured_null.flip_gap(scores_1.get(sid), scores_n.get(sid), at)
            flips[sid] = {"frame": at[0], "codebook": at[1], "gap": gap}
    scored = {sid: sf for sid, sf in scores_n.items() if sid in set(ids)}
    numerics = dict(numerics)
    if not flips and not measured_null.needed(scored):
        return measured_null.judge_at_n(scored, None, None, {}, policy.null, numerics, at_one), None, []
    if alone is None or not set(ids) <= set(alone[0].results) | set(alone[0].errors):
        alone = _null_alone(suite, scorer, ref_engine, ref_run, numerics, [s for g in groups for s in g])
        warnings = alone[2]
    else:
        warnings = []  # said already, at 1
        numerics["null"] = alone[3]
    alone, alone_scores = alone[0], alone[1]
    batched = ref_engine.generate_waves(groups, dtype=numerics["dtype"])
    got, errors = score_streams(scorer, suite, {"null_n": batched}, set(ids))
    warnings += [f"{sid}: measured null at N: {e['message']}" for sid, e in batched.errors.items()]
    warnings += [f"{sid}: measured null at N, teacher forcing: {m}" for sid, m in errors["null_n"].items()]
    both = [sid for sid in ids if sid in alone.results and sid in batched.results]
    noise = measured_null.batch_noise(alone.results, batched.results, alone_scores, got["null_n"], both, numerics)
    numerics["null_n"] = f"qwen-tts in {numerics['dtype']}, the candidate's waves as {len(groups)} batches"
    finding = measured_null.judge_at_n(scored, got["null_n"], noise, {s: a for s, a in flips.items() if s in both},
                                       policy.null, numerics, at_one)
    missing = sorted(set(ids) - set(both))
    if missing and finding["verdict"] == "pass":  # never a pass on a null that is not there
        finding.update(verdict="error", summary=f"the measured null at N (qwen-tts in {numerics['dtype']}, batched) "
                                                f"has no stream for {', '.join(missing)}: the run's warnings say why")
    return finding, noise, warnings


def _judge(suite: Suite, ref_run, cand, ctrl, vocoder: _Vocoder, policy: Policy, again=None,
           scores: tuple[dict, dict] | None = None, noise: dict | None = None,
           support: dict | None = None, null_vocoder: _Vocoder | None = None,
           numerics: dict | None = None, noise_model=None) -> tuple[dict, dict]:
    """Every segment's verdict: cross-decodes through the reference vocoder, the classifier, and
    where the vocoder check fails, the donor search with each co-batched request's reference.
    `null_vocoder`: qwen-tts's vocoder in the candidate's vocoder dtype, where that is not the
    reference's (difftest/verdicts/vocoder_null.py). Returns (verdicts, segment -> the null's decode)."""

    # Each segment's own reference codes: what the candidate's talker was prompted with (the capture's
    # talker stage), else what the candidate makes of its voice alone (c=1), else what qwen-tts makes of it.
    def own_ref(sid):
        talker = talker_stage(cand.results.get(sid))
        if talker is not None:
            return talker["ref_codes"]
        c = ctrl.results.get(sid)
        if c is not None and c.has_codes:
            return c.ref_codes
        r = ref_run.results.get(sid)
        return r.ref_codes if r is not None else np.zeros((0, CODEBOOKS), np.int64)

    score_ok, score_errors = scores or ({}, {})
    with_codes = _segments_with_codes(cand.results)
    cross = vocoder.decode({f"{sid}.own": (sid, r.codes, own_ref(sid)) for sid, r in with_codes.items()})
    nulls = (null_vocoder.decode({f"{sid}.own-{null_vocoder.dtype}": (sid, r.codes, own_ref(sid))
                                  for sid, r in with_codes.items()}) if null_vocoder is not None else {})
    nulls = {k.rsplit(".own-", 1)[0]: v for k, v in nulls.items()}
    peers_of = {}
    for wave in cand.batches:
        for sid in wave:
            peers_of[sid] = [p for p in wave if p != sid]

    def evidence(sid, donors=None):
        errors = []
        for label, o in (("reference", ref_run), ("candidate", cand), ("control", ctrl), ("repeat", again)):
            if o is not None and sid in o.errors:
                errors.append({**o.errors[sid], "source": label})
        for role in ("candidate", "control"):
            if sid in score_errors.get(role, {}):
                errors.append({"source": f"teacher forcing ({role})", "kind": "infrastructure",
                               "message": score_errors[role][sid]})
        x = cross.get(f"{sid}.own")
        if isinstance(x, str):
            errors.append({"source": "cross-decode", "kind": "infrastructure", "message": x})
            x = None
        null = nulls.get(sid)
        if isinstance(null, str):  # never judged without the null it needs
            errors.append({"source": f"vocoder null ({null_vocoder.dtype}) cross-decode", "kind": "infrastructure",
                           "message": null})
            null = None
        peers = peers_of.get(sid, [])
        return Evidence(
            segment_id=sid, reference=ref_run.results.get(sid), candidate=cand.results.get(sid),
            control=ctrl.results.get(sid), cross_own=x, cross_donors=donors or {},
            peer_ref_codes={p: own_ref(p) for p in peers},
            history_ref_codes={p: own_ref(p) for p in cand.results if p != sid and talker_stage(cand.results[p])},
            peer_tokens={p: t["tokens"] for p in peers if (t := talker_stage(cand.results.get(p)))},
            errors=errors, initial_frames=suite.chunks["initial_frames"], chunk_frames=suite.chunks["frames"],
            repeat=again.results.get(sid) if again is not None else None,
            scores={role: got[sid] for role, got in score_ok.items() if sid in got},
            other_inputs={p: i for p, i in ref_inputs.items() if p != sid}, batch_noise=noise, support_noise=support,
            vocoder_null=null, vocoder_dtype=null_vocoder.dtype if null_vocoder is not None else None,
            numerics=numerics, noise_model=noise_model)

    ref_inputs = {sid: i for sid, r in ref_run.results.items() if (i := inputs_of(r)) is not None}
    verdicts = {s.id: classify(evidence(s.id), policy) for s in suite.segments}
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
    return verdicts, {sid: r for sid, r in nulls.items() if isinstance(r, Result)}


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
    if spec.is_.one_batch_per_wave and (opts.pattern != "barrier" or opts.voice_mode != "inline"):
        raise BadInput(f"--pattern {opts.pattern} / --voices {opts.voice_mode}: the offline runner sends each "
                       f"wave of N as one batch with its voices inline (use the defaults, or --candidate {VLLM_OMNI})")
    pattern = "batch" if spec.is_.one_batch_per_wave else opts.pattern
    store = ResultStore(opts.store)
    with timings("checkpoints_s"):
        models = resolve_models(suite, opts, python)  # builds the tiny checkpoints on first use
    check_suite(suite, models)  # every segment servable, before any model loads
    ref_opts = ReferenceOptions(**{**opts.reference.__dict__, "models": models})

    with ExitStack() as stack:
        if runner is None:
            with timings("runner_start_s"):
                runner = (start_ray_pool(python, models, ref_opts, opts.ray) if opts.ray is not None else
                          start_reference_runner(python, models, ref_opts, out / "logs" / "reference-runner.log"))
            stack.push(lambda *exc: runner.kill() if exc[0] else runner.close())  # interrupted: no grace
        # What the candidate is, before any model work: a run folder holding another's results is refused.
        setup = Setup(out, models, python, suite, opts, runner.hello.get("fingerprint") or {})
        engine = engine_identity(spec, setup)
        folders = _result_folders(out, engine, opts, pattern)
        vocoder_numerics, null_vocoder = _vocoder_numerics(engine, opts, runner, out, store.root)
        atomic_write(out / "run.json", json.dumps({
            "suite": str(suite.path), "suite_hash": suite.hash, "candidate": spec.label, "engine": engine,
            "concurrency": opts.concurrency, "pattern": pattern, "order": opts.order,
            "store": str(store.root.resolve()), "models": models, "difftest_version": __version__,
            "replay": replay_record(spec, opts),
        }, indent=1, sort_keys=True).encode())

        with timings("reference_s"):
            ref_run = ReferenceEngine(runner, store.root, opts.reference.timeout).generate(suite.segments)
        _stop_if_disk_full(ref_run.errors, store.root)
        if candidate is None:
            with timings("candidate_start_s"):
                if (opts.ray or {}).get("candidate"):
                    candidate = start_ray_candidate(spec, setup, opts.ray, run_id)
                    stack.callback(candidate.close)
                else:
                    candidate = start_candidate(spec, setup, stack, run_tag=run_id)
        cand_info = candidate.info
        _announce(cand_info)
        if not spec.is_.started_here and spec.declared is None:  # whatever answers at the URL now: re-checked
            url_reuse.check(candidate, suite.segments, {n: folders[n] for n in sorted(folders, key=_pass_order)},
                            engine, spec.url, opts.reuse_unidentified)
        # a server serves several runs (difftest repro's probes): its counters are read before and after this one
        counted_before = _server_counters(cand_info)
        outcomes = {}
        started: dict = {}
        for n, (folder, key) in folders.items():
            phase = "candidate_repeat_s" if n == REPEAT else f"candidate_c{n}_s"
            with timings(phase):
                outcomes[n] = _candidate_at(n, candidate, suite, folder, key)
            took = _engine_starts(outcomes[n], started)
            if took:  # counted as the candidate's start, as every other candidate's is
                timings[phase] -= took
                timings["candidate_start_s"] = timings.get("candidate_start_s", 0.0) + took
        cand, ctrl, again = outcomes[opts.concurrency], outcomes[1], outcomes.get(REPEAT)
        logs = [s["log"] for s in cand_info.get("servers") or [] if s.get("log")]
        for o in outcomes.values():  # a stage that died: its name and cause, from the server's log
            engine_death.attribute(o.errors, logs)
        # read while the servers still run: did the cache serve, was any request preempted? (this run's share)
        from .engines.vllm_omni import counters_since

        cand_info = {**cand_info, **{k: counters_since(v, counted_before.get(k))
                                     for k, v in _server_counters(cand_info).items()}}
        print(f"teacher forcing: {len(_segments_with_codes(cand.results))} segments at c={opts.concurrency} and "
              f"{len(_segments_with_codes(ctrl.results))} at c=1 through qwen-tts's talker", file=sys.stderr, flush=True)
        with timings("score_s"):
            roles = {"candidate": cand, "control": ctrl}
            if any(s.decode.get("do_sample") or s.decode.get("subtalker_dosample") for s in suite.segments):
                roles["reference"] = ref_run  # qwen-tts's own samples: the sampling test's calibration
            scorer = Scorer(runner, store.root, opts.reference.timeout)
            scores = score_streams(scorer, suite, roles)
        with timings("null_s"):
            dtype, source = measured_null.talker_dtype(engine, opts.candidate_dtype, ctrl.results)
            # exact: the reference's own numerics, where the null's counts of zero are structure, not chance
            numerics = {"dtype": dtype, "from": source, "exact": dtype == ref_run.fingerprint.get("dtype")}
            ref_engine = ReferenceEngine(runner, store.root, opts.reference.timeout)
            at_n = opts.concurrency > 1  # the run at N spends half the false-flag rate (null.judge_at_n)
            null, null_warnings, alone, noise_model = null_finding(suite, scorer, ref_engine, ref_run,
                                                                   scores[0]["control"], numerics, policy,
                                                                   share=0.5 if at_n else 1.0)
            null_n, noise, warnings_n = (null_at_n_finding(suite, scorer, ref_engine, ref_run, cand, ctrl,
                                                           scores[0]["control"], scores[0]["candidate"], numerics,
                                                           policy, null and null["verdict"], alone)
                                         if at_n else (None, None, []))
            null_warnings += warnings_n
            support = measured_null.support_noise(null)
        print(f"cross-decodes: {len(_segments_with_codes(cand.results))} segments through the reference vocoder",
              file=sys.stderr, flush=True)
        with timings("cross_decode_s"):
            verdicts, vocoder_nulls = _judge(suite, ref_run, cand, ctrl,
                                             _Vocoder(runner, out / "results" / "cross", opts.reference.timeout,
                                                      store.root), policy, again, scores, noise, support, null_vocoder,
                                             numerics, noise_model)

    ordered = [verdicts[s.id] for s in suite.segments]
    for sid, notes in measured_null.suspect_notes([null, null_n]).items():  # a run-level failure names its segments
        verdicts[sid].notes.extend(notes)
    judged = {"concurrency": exercised.concurrency(opts.concurrency, cand.results, len(suite.segments)),
              "codes": exercised.codes_judged(ordered),
              "references": exercised.references(suite.segments, {"reference": ref_run.results,
                                                                  f"c={opts.concurrency}": cand.results,
                                                                  "c=1": ctrl.results,
                                                                  **({"repeat": again.results} if again else {})})}
    # qwen-tts's samples in the candidate's numerics calibrate the sampling test too (not where that
    # is the reference's own: the reference's samples say it already)
    sampling_roles = {**scores[0], **({"null": alone[1]} if alone and not numerics["exact"] else {})}
    # The candidate at concurrency 1 judged on its own against the reference: a defect that only
    # concurrency causes must leave this clean (no extra model work: every input is already here).
    at_one = [classify(Evidence(segment_id=s.id, reference=ref_run.results.get(s.id),
                                candidate=ctrl.results.get(s.id),
                                errors=[{**ctrl.errors[s.id], "source": "control"}] if s.id in ctrl.errors else [],
                                initial_frames=suite.chunks["initial_frames"], chunk_frames=suite.chunks["frames"],
                                scores={"candidate": scores[0]["control"][s.id]}
                                if s.id in scores[0]["control"] else {}, support_noise=support, numerics=numerics,
                                noise_model=noise_model,
                                **_null_for(vocoder_nulls.get(s.id), ctrl.results.get(s.id), vocoder_numerics)),
                       policy) for s in suite.segments]
    timings["total_s"] = time.perf_counter() - t_start
    report = build_report(
        ordered, policy,
        suite={"name": suite.name, "path": str(suite.path), "hash": suite.hash, "segments": len(suite.segments)},
        reference={"label": "qwen-tts", "fingerprint": ref_run.fingerprint, "provenance": ref_run.provenance,
                   "cached_segments": len(ref_run.cached)},
        candidate={**{k: v for k, v in cand_info.items() if k != "served_configuration"}, "pattern": pattern,
                   "order": opts.order, "voice_mode": opts.voice_mode,
                   "batches": cand.batches, "identity": engine, "identity_key": folders[opts.concurrency][1]},
        concurrency=opts.concurrency,
        provenance={"difftest": __version__, "timings": {k: round(v, 3) for k, v in timings.items()}},
        warnings=policy.warnings() + [f"{sid}: reference: {e['message']}" for sid, e in ref_run.errors.items()]
        + [f"{sid}: teacher forcing of qwen-tts's own sample: {m}" for sid, m in scores[1].get("reference", {}).items()]
        + null_warnings + shared_seeds(suite)
        + ([] if opts.concurrency > 1 else ["concurrency 1: every request was served alone; a cross-request defect "
                                            "(the seed's leak) cannot show in this run"])
        + exercised.unbatched_warning(judged["concurrency"]),
        sampling=sampling.judge(sampling_roles, policy.forced.sampling_max_z, policy.forced.sampling_false_flag_rate),
        null=null, null_n=null_n,
        configuration=exercised.finding(cand_info, {f"c={opts.concurrency}": cand.results, "c=1": ctrl.results,
                                                    **({"repeat": again.results} if again else {})}, judged,
                                        opts.require_paths, sum(len(o.errors) for o in outcomes.values())),
        served_configuration=cand_info.get("served_configuration"),
    )
    one = sampling.judge({k: v for k, v in sampling_roles.items() if k != "candidate"}, policy.forced.sampling_max_z,
                         policy.forced.sampling_false_flag_rate)
    report["vocoder_numerics"] = vocoder_numerics
    report["at_concurrency_1"] = {
        "verdict": overall(at_one, policy, [f for f in (one, null) if f])[0],
        "segments": [{"id": v.id, "verdict": v.verdict, "first_divergent_chunk": v.first_divergent_chunk,
                      "summary": v.summary} for v in at_one],
    }
    write_report(out, report)
    return report


def _vocoder_numerics(engine: dict, opts: RunOptions, runner, out: Path,
                      store_root: Path) -> tuple[dict, _Vocoder | None]:
    """The candidate vocoder's dtype (report.json `vocoder_numerics`), and qwen-tts's vocoder in it
    where that is not the reference's: the vocoder's measured null (difftest/verdicts/vocoder_null.py)."""
    ref_dtype = (runner.hello.get("fingerprint") or {}).get("dtype")
    dtype, source = vocoder_null.vocoder_dtype(engine, opts.candidate_vocoder_dtype, ref_dtype)
    info = {"dtype": dtype, "from": source, "reference_dtype": ref_dtype, "null": None}
    if dtype == ref_dtype:
        return info, None
    if dtype not in runner.hello.get("decode_dtypes", ()):
        raise BadInput(f"the candidate's vocoder runs in {dtype} ({source}): qwen-tts's vocoder cannot decode in it, "
                       f"so no measured allowance exists; serve the vocoder in {ref_dtype} or bfloat16")
    info["null"] = f"qwen-tts's vocoder in {dtype} on the candidate's codes"
    return info, _Vocoder(runner, out / "results" / "cross", opts.reference.timeout, store_root, dtype=dtype)


def _null_for(null: Result | None, ctrl: Result | None, numerics: dict) -> dict:
    """The vocoder's null for the candidate at 1 judged alone: the decode of the candidate's codes at
    N, where the codes at 1 are the same."""
    if null is None or ctrl is None or not ctrl.has_codes or not (np.array_equal(null.codes, ctrl.codes)
                                                                  and np.array_equal(null.ref_codes, ctrl.ref_codes)):
        return {}
    return {"vocoder_null": null, "vocoder_dtype": numerics["dtype"]}


def _server_counters(cand_info: dict) -> dict:
    """The candidate's servers' counters now: preemptions, and prefix-cache hits where a stage has the
    cache on; {} for a candidate without servers difftest started."""
    if not (cand_info.get("servers") or cand_info.get("prefix_caching_stages")):
        return {}
    from .engines.vllm_omni import preemption_counters, prefix_cache_counters

    urls = [s["url"] for s in cand_info.get("servers") or [{"url": cand_info["url"]}]]
    return {"preemption_counters": preemption_counters(urls),
            **({"prefix_cache": prefix_cache_counters(urls)} if cand_info.get("prefix_caching_stages") else {})}


def replay_record(spec: CandidateSpec, opts: RunOptions) -> dict:
    """What starting this candidate again takes (`difftest repro` serves its probes to the same
    engine and configuration): the spec's fields and the run's engine settings, as JSON."""
    return {"spec": {"kind": spec.kind, "url": spec.url, "defect": spec.defect, "api": spec.api,
                     "capture_dir": str(spec.capture_dir) if spec.capture_dir else None,
                     "declared": spec.declared, "python": spec.python, "engine_args": [str(a) for a in spec.engine_args],
                     "options": spec.options},
            "vllm_omni": opts.vllm_omni, "voice_mode": opts.voice_mode, "candidate_dtype": opts.candidate_dtype,
            "candidate_vocoder_dtype": opts.candidate_vocoder_dtype,
            "repeat": opts.repeat, "reference": {"dtype": opts.reference.dtype, "device": opts.reference.device,
                                                 "python": opts.reference.python}}


def _announce(info: dict, stream=sys.stderr) -> None:
    """Say what the candidate is, in the words a reader must not mistake."""
    what = info.get("engine") or info.get("label") or "candidate"
    print(f"candidate: {what}", file=stream, flush=True)
