"""The candidate's passes: at concurrency N, at 1, and at 1 again after the others (the
history check), each into its own folder, checked against what that folder already holds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..engines import identity as ident
from ..errors import BadInput, InfraError, no_space
from ..progress import Progress
from ..suites.suite import Suite

if TYPE_CHECKING:
    from .options import RunOptions


def results_with_codes(results: dict) -> dict:
    return {k: r for k, r in results.items() if r.has_codes and len(r.codes)}


def engine_starts(outcome, started: dict) -> float:
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


def result_folders(out: Path, engine: dict, opts: RunOptions, pattern: str) -> dict[int, tuple[Path, str]]:
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


def pass_order(n) -> tuple:
    """The pass at N first, then at 1, then the repeat."""
    return (n == REPEAT, n == 1)


def candidate_at(n, engine, suite: Suite, folder: Path, key: str):
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
    stop_if_disk_full(outcome.errors, folder)
    hung = next((e["message"] for e in outcome.errors.values() if e.get("server_dead")), None)
    if hung:  # every later request would wait out the timeout too: stop, keeping what was received
        raise InfraError(f"candidate: {hung}; what it answered is kept, the same command resumes")
    return outcome


def stop_if_disk_full(errors: dict, folder: Path) -> None:
    """A full disk failed these segments (an engine's capture write, a runner's result): the run
    stops with exit 3 naming the folder, instead of judging the engine by the machine's failure.
    What was written stays; the same command resumes once there is room."""
    full = sorted(sid for sid, e in errors.items() if no_space(e.get("message", "")))
    if full:
        raise InfraError(f"{folder}: no space left on device ({len(full)} segment(s) failed writing there: "
                         f"{', '.join(full[:4])}{', ...' if len(full) > 4 else ''}); free space and run the same "
                         f"command again: what was written is kept")


def server_counters(cand_info: dict) -> dict:
    """The candidate's servers' counters now: preemptions, and prefix-cache hits where a stage has the
    cache on; {} for a candidate without servers difftest started."""
    if not (cand_info.get("servers") or cand_info.get("prefix_caching_stages")):
        return {}
    from ..engines.vllm_omni import preemption_counters, prefix_cache_counters

    urls = [s["url"] for s in cand_info.get("servers") or [{"url": cand_info["url"]}]]
    return {"preemption_counters": preemption_counters(urls),
            **({"prefix_cache": prefix_cache_counters(urls)} if cand_info.get("prefix_caching_stages") else {})}


def serve_passes(candidate, suite: Suite, folders: dict, timings) -> dict:
    """Every pass, the one at N first: concurrency (or REPEAT) -> its outcome. `timings` records each
    pass's seconds, less the engine starts inside it, which count as the candidate's start."""
    outcomes, started = {}, {}
    for n, (folder, key) in folders.items():
        phase = "candidate_repeat_s" if n == REPEAT else f"candidate_c{n}_s"
        with timings(phase):
            outcomes[n] = candidate_at(n, candidate, suite, folder, key)
        took = engine_starts(outcomes[n], started)
        if took:  # counted as the candidate's start, as every other candidate's is
            timings[phase] -= took
            timings["candidate_start_s"] = timings.get("candidate_start_s", 0.0) + took
    return outcomes
