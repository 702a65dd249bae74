"""A candidate behind the runner protocol (the vLLM-Omni offline runner): a suite in waves of N.

The HTTP runner's counterpart (difftest/candidate_http.py) for an engine that
takes a batch in one call: the waves are decided here, with the same orders,
and sent as one `generate` job; the runner decodes each wave as one batch.
Every answer is read back as soon as it arrives, so a runner that dies loses
nothing already written.
"""

from __future__ import annotations

from pathlib import Path

from ..process.runner_client import RunnerDied, RunnerProcess
from ..results import CorruptResult, ResultStore, read_result
from ..suites.suite import Segment
from .base import Outcome
from .capture import OverLength
from .http import _waves


def run_candidate_runner(segments: list[Segment], runner: RunnerProcess, out_dir: Path, *, concurrency: int,
                         order: str = "suite", seed: int = 0, timeout: float = 900.0, identity_key: str | None = None,
                         on_result=None, on_progress=None) -> Outcome:
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    outcome = Outcome()
    by_id = {s.id: s for s in segments}
    waves = _waves(list(segments), concurrency, order, seed)
    outcome.batches = [[s.id for s in w] for w in waves]
    pending = dict(by_id)
    try:
        for ev in runner.request("generate", timeout=timeout, segments=[s.to_job() for s in segments],
                                 out_dir=str(out_dir), concurrency=concurrency, waves=outcome.batches,
                                 identity=identity_key):
            sid, kind = ev.get("segment"), ev.get("event")
            if kind == "progress":
                if on_progress:
                    on_progress(f"{sid}: {ev.get('message', '')}")
                continue
            if sid not in pending:
                continue
            seg = pending.pop(sid)
            if kind == "result":
                try:
                    r = read_result(Path(ev.get("path", "")))
                    if r.segment_hash != seg.hash:
                        raise CorruptResult(f"{ev.get('path')}: result is for another version of {sid}")
                except CorruptResult as e:
                    outcome.errors[sid] = {"source": "candidate", "kind": "candidate", "message": str(e)}
                    continue
                outcome.results[sid] = r
                if on_result:
                    on_result(seg, r)
            else:
                outcome.errors[sid] = error_of(ev)
    except RunnerDied as e:
        # what the runner wrote before it died is on disk: keep it, and say what was lost
        store = ResultStore(out_dir)
        for sid, seg in list(pending.items()):
            r = store.get(out_dir, sid, seg.hash)
            if r is not None and r.meta.get("identity") == identity_key:
                outcome.results[sid] = r
            else:
                outcome.errors[sid] = {"source": "candidate", "kind": "infrastructure",
                                       "message": f"the offline runner died: {e}"}
        pending.clear()
    for sid in pending:
        outcome.errors[sid] = {"source": "candidate", "kind": "infrastructure",
                               "message": "the runner never answered this segment"}
    outcome.batches = _batches_run(outcome, outcome.batches)
    return outcome


def _batches_run(outcome: Outcome, waves: list[list[str]]) -> list[list[str]]:
    """The batches the engine actually ran (each result's `meta.batch`), in wave order: a runner may
    split a wave (one engine per checkpoint type; shared sampling settings), and the donor search
    must look only at requests that really shared a batch. A wave with no such record stays whole;
    its segments without one (errors) are listed together after the wave's batches."""
    out = []
    for wave in waves:
        recorded = {}
        for sid in wave:
            r = outcome.results.get(sid)
            batch = [b for b in (r.meta.get("batch") or []) if b in wave] if r is not None else []
            if batch:
                recorded[sid] = batch
        if not recorded:
            out.append(list(wave))
            continue
        seen = set()
        for sid in wave:
            if sid in recorded and sid not in seen:
                out.append(recorded[sid])
                seen.update(recorded[sid])
        rest = [sid for sid in wave if sid not in seen]
        if rest:
            out.append(rest)
    return out


class RunnerCandidate:
    """A candidate behind the runner protocol (the vLLM-Omni offline runner) behind the Engine surface
    (engines/base.py): each wave of N one batch."""

    def __init__(self, runner: RunnerProcess, label: str, info: dict, *, order: str = "suite",
                 timeout: float = 900.0):
        self.runner, self.label, self.info, self.order, self.timeout = runner, label, info, order, timeout

    def generate(self, segments, *, concurrency: int, out_dir: Path | None = None, identity_key: str | None = None,
                 progress=None) -> Outcome:
        def note(seg, r):
            if progress is not None:
                progress.segment(seg.id, audio_seconds=r.seconds, seconds=r.timings.get("batch_seconds", 0.0))

        return run_candidate_runner(segments, self.runner, out_dir, concurrency=concurrency, order=self.order,
                                    timeout=self.timeout, identity_key=identity_key, on_result=note,
                                    on_progress=progress.note if progress is not None else None)


def error_of(ev: dict) -> dict:
    """A runner's error event as a segment's error. The runner runs beside the engine under test, so
    its word is checked: the one defect it may report is a capture refused as over-length
    (capture.defect_of), anything else it claims is dropped."""
    kind = {"bad_input": "bad_input", "engine": "candidate", "capture": "infrastructure"}.get(ev.get("kind"), "candidate")
    defect = (ev.get("defect"), ev.get("stage"))
    return {"source": "candidate", "kind": kind, "message": ev.get("message", "error without a message"),
            **({"defect": defect[0], "stage": defect[1]} if defect == (OverLength.verdict, OverLength.stage) else {})}
