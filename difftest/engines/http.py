"""The HTTP candidate runner: a suite's segments against a speech server at concurrency N.

Arrival patterns provoke batching bugs:
- `barrier`: waves of N requests released together (threading.Barrier), the
  next wave once the whole wave has answered;
- `pool`: N workers pulling continuously, so requests join a running batch;
- `staggered`: waves whose requests start `stagger_ms` apart.
Orders: `suite`, `permuted` (seeded shuffle), `mixed` (task types
interleaved), `long-first` (the longest segment leads each wave among short
ones).

Every answer is written to the result store as soon as it arrives, so a server
that dies mid-suite loses nothing already received; the segments it never
answered get errors.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..family import CODEBOOKS
from ..results import Result, ResultStore, reusable_together, write_result
from ..suites import wavio
from ..suites.suite import Segment
from . import capture
from .base import Outcome
from .capture import Capture, CaptureError, schedule_meta
from .apis import api_for
from .speech_client import RequestTimeout, ServerUnreachable, SpeechClient, SpeechError

PATTERNS = ("barrier", "pool", "staggered")
WAVE_HEADER = "X-Difftest-Wave"
# Engines write the capture before they answer; a server's stages can still finish a moment apart,
# and a busy machine stretches that moment. Waited out only when a capture is late.
CAPTURE_WAIT_S = 30.0
ORDERS = ("suite", "permuted", "mixed", "long-first")


def order_segments(segments: list[Segment], order: str, seed: int = 0) -> list[Segment]:
    if order == "suite":
        return list(segments)
    if order == "permuted":
        out = list(segments)
        random.Random(seed).shuffle(out)
        return out
    if order == "mixed":
        by_task: dict[str, list] = {}
        for s in segments:
            by_task.setdefault(s.task, []).append(s)
        mixed = itertools.zip_longest(*by_task.values())
        return [s for group in mixed for s in group if s is not None]
    if order == "long-first":
        return sorted(segments, key=lambda s: (-s.decode["max_new_tokens"], -len(s.text)))
    raise ValueError(f"unknown order {order!r} (known: {', '.join(ORDERS)})")


def _waves(segments: list[Segment], n: int, order: str, seed: int) -> list[list[Segment]]:
    ordered = order_segments(segments, order, seed)
    if order != "long-first":
        return [ordered[i:i + n] for i in range(0, len(ordered), n)]
    # One long segment leads each wave; the shortest fill it.
    longs, shorts = ordered, []
    waves = []
    while longs:
        head = longs.pop(0)
        shorts = longs[-(n - 1):] if n > 1 else []
        longs = longs[: len(longs) - len(shorts)]
        waves.append([head] + shorts[::-1])
    return waves


def read_capture(capture_dir: Path | None, tag: str, wait_s: float | None = None,
                 max_frames: int | None = None) -> Capture | None:
    """The engine's checked capture for a tag (docs/architecture.md, contract 5); None without a capture folder.

    Raises CaptureError when the capture was asked for and is missing or unusable: never a
    silent fall-back to an audio-only comparison."""
    if capture_dir is None:
        return None
    wait_s = CAPTURE_WAIT_S if wait_s is None else wait_s
    path = capture.wait_for(capture_dir, tag, wait_s)
    if path is None:
        raise capture.CaptureMissing(f"{Path(capture_dir) / (tag + '.npz')}: the engine wrote no capture for this request "
                           f"within {wait_s:.0f} s of answering")
    return capture.load(path, max_frames)


ANSWER_ENCODINGS = {("pcm", 16), ("float", 32)}  # what vLLM-Omni's speech API and the offline API give
BATCH_SIZE_HEADER = "x-difftest-batch-size"  # an engine's own word on how many requests it batched (the CPU engine)


def run_candidate(segments: list[Segment], client: SpeechClient, out_dir: Path, *, concurrency: int,
                  pattern: str = "barrier", order: str = "suite", seed: int = 0, stagger_ms: float = 50.0,
                  voice_mode: str = "inline", capture_dir: Path | None = None, label: str = "candidate",
                  provenance: dict | None = None, run_tag: str | None = None, reuse: bool = True,
                  identity_key: str | None = None, on_result=None) -> Outcome:
    """Send every segment; write each answer as a result under out_dir; return what happened.

    A result already in out_dir is reused when `reuse` and it records `identity_key` (what
    produced it: difftest.engines.identity); it keeps the wave it was sent in, for the donor search."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r} (known: {', '.join(PATTERNS)})")
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_tag = run_tag or uuid.uuid4().hex[:8]
    outcome = Outcome()
    lock = threading.Lock()
    dead = threading.Event()
    hung: list[str] = []  # why the server is dead: a request timed out (the run then stops, difftest.run)

    outcome.results = cached_results(segments, out_dir, identity_key) if reuse else {}
    outcome.cached = set(outcome.results)
    todo = [s for s in segments if s.id not in outcome.results]
    outcome.batches = recorded_waves(outcome.results.values(), {s.id for s in segments})

    if voice_mode == "registered":
        for v in {s.voice.id: s.voice for s in todo if s.voice}.values():
            try:
                client.register_voice(v)
            except (SpeechError, ServerUnreachable) as e:
                hang = {"kind": "infrastructure", "server_dead": True} if isinstance(e, RequestTimeout) else {}
                for s in todo:
                    if s.voice and s.voice.id == v.id:
                        outcome.errors[s.id] = {"source": "candidate", "kind": "candidate",
                                                "message": f"voice registration failed: {e}", **hang}
                if hang:  # no more registrations or requests: each would wait out the timeout
                    hung.append(f"{e}; the server is marked dead")
                    dead.set()
                    break
        todo = [s for s in todo if s.id not in outcome.errors]

    def error(seg: Segment, kind: str, message: str, **more) -> None:
        with lock:
            outcome.errors[seg.id] = {"source": "candidate", "kind": kind, "message": message, **more}

    def one(seg: Segment, wave: list[str], delay: float = 0.0, barrier: threading.Barrier | None = None,
            wave_id: str = ""):
        if barrier is not None:
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass
        if delay:
            time.sleep(delay)
        if dead.is_set():
            if hung:
                return error(seg, "infrastructure", f"not sent: {hung[0]}", server_dead=True)
            return error(seg, "infrastructure", "server unreachable earlier in the run")
        tag = f"{run_tag}-{seg.id}-c{concurrency}"
        # The wave's size, for a server that batches by a window (the CPU test engine): it may close
        # the batch once the wave is in. A server that does not know the header ignores it.
        hint = None if pattern == "pool" else {WAVE_HEADER: f"{len(wave)};{wave_id}"}  # the size, and which wave
        try:
            sent = time.time()
            ans, wav_bytes = api_for(seg).ask(client, seg, tag, voice_mode, hint)
            in_flight = [round(sent, 4), round(time.time(), 4)]  # the concurrency check (verdicts/exercised.py)
            wav, info = wavio.read(wav_bytes)
            if wav.ndim != 1:
                raise SpeechError(200, f"audio has {info.channels} channels, expected mono")
            if (info.format, info.bits) not in ANSWER_ENCODINGS:  # 8-bit would pass as 16-bit's rounding
                raise SpeechError(200, f"audio is {info.bits}-bit {info.format}, not a WAV encoding a speech server "
                                       f"answers with (16-bit PCM or 32-bit float)")
        except ServerUnreachable as e:
            dead.set()
            return error(seg, "infrastructure", str(e))
        except RequestTimeout as e:  # hung: every later request would wait out the timeout as well
            with lock:
                hung.append(f"{e}; the server is marked dead")
            dead.set()
            return error(seg, "infrastructure", hung[0], server_dead=True)
        except (SpeechError, wavio.WavError) as e:
            # status 0: the connection died or timed out mid-request: the engine is down or hung
            return error(seg, "infrastructure" if getattr(e, "status", None) == 0 else "candidate", str(e))
        try:
            cap = read_capture(capture_dir, tag, max_frames=seg.decode.get("max_new_tokens"))
        except CaptureError as e:
            # missing: the capture machinery failed us; unusable: the engine wrote nonsense about itself
            return error(seg, "infrastructure" if isinstance(e, capture.CaptureMissing) else "candidate", str(e),
                         **capture.defect_of(e))
        r = _result(seg, wav, info, cap, ans, label, provenance, wave,
                    {"concurrency": concurrency, "pattern": pattern, "order": order, "tag": tag,
                     "identity": identity_key, "in_flight": in_flight,
                     **({"batch_size": int(b)} if (b := ans.headers.get(BATCH_SIZE_HEADER, "")).isdigit() else {})})
        side = write_result(ResultStore.stem(out_dir, seg.id, seg.hash), r)
        r.source = side.resolve()
        with lock:
            outcome.results[seg.id] = r
        if on_result:
            on_result(seg, r)

    if pattern == "pool":
        ordered = order_segments(todo, order, seed)
        if ordered:
            outcome.batches.append([s.id for s in ordered])
        _send(concurrency, [(one, s, outcome.batches[-1] if ordered else []) for s in ordered])
    else:
        for wave in _waves(todo, concurrency, order, seed):
            ids = [s.id for s in wave]
            outcome.batches.append(ids)
            barrier, wave_id = threading.Barrier(len(wave)), uuid.uuid4().hex[:12]
            _send(len(wave), [(one, s, ids, (i * stagger_ms / 1000.0) if pattern == "staggered" else 0.0, barrier,
                               wave_id) for i, s in enumerate(wave)])
    return outcome


def cached_results(segments: list[Segment], out_dir: Path, identity_key: str | None) -> dict:
    """The results in `out_dir` that a pass with this identity may reuse: made from the same segment
    by the same identity, each with its whole wave (results.reusable_together)."""
    store = ResultStore(out_dir)
    found = {}
    for s in segments:
        r = store.get(out_dir, s.id, s.hash)
        if r is not None and r.meta.get("identity") == identity_key:
            found[s.id] = r
    return reusable_together(found)


def _send(workers: int, calls: list[tuple]) -> None:
    """Run the calls on `workers` threads and wait for them; on an interrupt, stop waiting at once
    (the caller then stops the engine, which ends the requests still in flight)."""
    ex = ThreadPoolExecutor(max(workers, 1))
    try:
        for f in [ex.submit(*c) for c in calls]:
            f.result()
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    ex.shutdown(wait=True)


def _result(seg: Segment, wav, info, cap: Capture | None, ans, label: str, provenance: dict | None,
            wave: list[str], meta: dict) -> Result:
    extra = {"capture_wav": cap.wav} if cap is not None and cap.wav is not None else {}
    extra.update(cap.stage_arrays() if cap is not None else {})
    empty = np.zeros((0, CODEBOOKS), np.int64)
    return Result(segment_id=seg.id, segment_hash=seg.hash, wav=wav, sample_rate=info.sample_rate,
                  codes=cap.codes if cap is not None else empty, ref_codes=cap.ref_codes if cap is not None else empty,
                  has_codes=cap is not None, quantised=info.format == "pcm", provenance=dict(provenance or {}),
                  timings={"request_seconds": round(ans.seconds, 4)},
                  meta={"runner": label, **meta, "retries": ans.retries, "capture": cap is not None,
                        "lead_samples": cap.lead_samples if cap is not None else 0, "wave": list(wave),
                        **({"handoff": cap.handoff} if cap is not None and cap.handoff else {}),
                        **({"chunks": len(cap.chunk_frames)} if cap is not None and cap.chunk_frames is not None else {}),
                        **(schedule_meta(cap.schedule) if cap is not None else {})},
                  extra=extra)


def recorded_waves(results, wanted: set[str]) -> list[list[str]]:
    """The waves reused results were sent in (their `meta.wave`, or the runner's `meta.batch`), each
    once, limited to `wanted`."""
    waves, seen = [], set()
    for r in results:
        wave = tuple(sid for sid in (r.meta.get("wave") or r.meta.get("batch") or [r.segment_id]) if sid in wanted)
        if wave and wave not in seen:
            seen.add(wave)
            waves.append(list(wave))
    return waves


class HttpCandidate:
    """A speech server (vLLM-Omni's, the CPU test engine, any URL) behind the Engine surface
    (engines/base.py): each `generate` sends a suite at a concurrency with the run's arrival settings."""

    def __init__(self, client: SpeechClient, capture_dir: Path | None, label: str, info: dict, *,
                 pattern: str = "barrier", order: str = "suite", voice_mode: str = "inline", run_tag: str = ""):
        self.client, self.capture_dir, self.label, self.info = client, capture_dir, label, info
        self.pattern, self.order, self.voice_mode, self.run_tag = pattern, order, voice_mode, run_tag

    def generate(self, segments, *, concurrency: int, out_dir: Path | None = None, identity_key: str | None = None,
                 progress=None) -> Outcome:
        def note(seg, r):
            if progress is not None:
                progress.segment(seg.id, audio_seconds=r.seconds, seconds=r.timings.get("request_seconds", 0.0))

        return run_candidate(segments, self.client, out_dir, concurrency=concurrency, pattern=self.pattern,
                             order=self.order, voice_mode=self.voice_mode, capture_dir=self.capture_dir,
                             label=self.label, provenance=self.info, run_tag=f"{self.run_tag}c{concurrency}",
                             identity_key=identity_key, on_result=note)

