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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import wavio
from .results import CorruptResult, Result, ResultStore, write_result
from .speech_client import ServerUnreachable, SpeechClient, SpeechError, speech_request
from .suite import Segment

PATTERNS = ("barrier", "pool", "staggered")
ORDERS = ("suite", "permuted", "mixed", "long-first")


@dataclass
class CandidateOutcome:
    results: dict = field(default_factory=dict)  # segment id -> Result
    errors: dict = field(default_factory=dict)  # segment id -> {"source", "kind", "message"}
    batches: list = field(default_factory=list)  # waves of segment ids sent together (co-batch candidates)


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


def read_capture(capture_dir: Path | None, tag: str, wait_s: float = 2.0) -> dict | None:
    """The engine's capture file for a tag (contract 5), or None if it never appears."""
    if capture_dir is None:
        return None
    path = Path(capture_dir) / f"{tag}.npz"
    deadline = time.monotonic() + wait_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as e:  # a half-written capture is the engine's bug: say so, don't trust it
        raise CorruptResult(f"{path}: unreadable capture ({e})") from None


def run_candidate(segments: list[Segment], client: SpeechClient, out_dir: Path, *, concurrency: int,
                  pattern: str = "barrier", order: str = "suite", seed: int = 0, stagger_ms: float = 50.0,
                  voice_mode: str = "inline", capture_dir: Path | None = None, label: str = "candidate",
                  provenance: dict | None = None, run_tag: str | None = None, reuse: bool = True,
                  on_result=None) -> CandidateOutcome:
    """Send every segment; write each answer as a result under out_dir; return what happened."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r} (known: {', '.join(PATTERNS)})")
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_tag = run_tag or uuid.uuid4().hex[:8]
    outcome = CandidateOutcome()
    lock = threading.Lock()
    dead = threading.Event()

    todo = []
    store = ResultStore(out_dir)
    for s in segments:
        cached = store.get(out_dir, s.id, s.hash) if reuse else None
        if cached is not None:
            outcome.results[s.id] = cached
        else:
            todo.append(s)

    if voice_mode == "registered":
        for v in {s.voice.id: s.voice for s in todo if s.voice}.values():
            try:
                client.register_voice(v)
            except (SpeechError, ServerUnreachable) as e:
                for s in todo:
                    if s.voice and s.voice.id == v.id:
                        outcome.errors[s.id] = {"source": "candidate", "kind": "candidate",
                                                "message": f"voice registration failed: {e}"}
        todo = [s for s in todo if s.id not in outcome.errors]

    def one(seg: Segment, delay: float = 0.0, barrier: threading.Barrier | None = None):
        if barrier is not None:
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                pass
        if delay:
            time.sleep(delay)
        if dead.is_set():
            err = {"source": "candidate", "kind": "infrastructure", "message": "server unreachable earlier in the run"}
            with lock:
                outcome.errors[seg.id] = err
            return
        tag = f"{run_tag}-{seg.id}-c{concurrency}"
        body = speech_request(seg, tag, voice_mode=voice_mode)
        try:
            ans = client.speech(body)
            wav, info = wavio.read(ans.audio)
            if wav.ndim != 1:
                raise SpeechError(200, f"audio has {info.channels} channels, expected mono")
            cap = read_capture(capture_dir, tag)
        except ServerUnreachable as e:
            dead.set()
            with lock:
                outcome.errors[seg.id] = {"source": "candidate", "kind": "infrastructure", "message": str(e)}
            return
        except (SpeechError, wavio.WavError, CorruptResult) as e:
            # status 0: the connection died or timed out mid-request: the engine is down or hung
            kind = "infrastructure" if getattr(e, "status", None) == 0 else "candidate"
            with lock:
                outcome.errors[seg.id] = {"source": "candidate", "kind": kind, "message": str(e)}
            return
        extra = {}
        if cap is not None and "wav" in cap:
            extra["capture_wav"] = np.asarray(cap["wav"], np.float32).reshape(-1)
        r = Result(segment_id=seg.id, segment_hash=seg.hash, wav=wav, sample_rate=info.sample_rate,
                   codes=cap["codes"] if cap is not None else np.zeros((0, 16), np.int64),
                   ref_codes=cap.get("ref_codes", np.zeros((0, 16), np.int64)) if cap is not None
                   else np.zeros((0, 16), np.int64),
                   has_codes=cap is not None, quantised=info.format == "pcm",
                   provenance=dict(provenance or {}),
                   timings={"request_seconds": round(ans.seconds, 4)},
                   meta={"runner": label, "concurrency": concurrency, "pattern": pattern, "order": order,
                         "tag": tag, "retries": ans.retries, "capture": cap is not None},
                   extra=extra)
        side = write_result(ResultStore.stem(out_dir, seg.id, seg.hash), r)
        r.source = side.resolve()
        with lock:
            outcome.results[seg.id] = r
        if on_result:
            on_result(seg, r)

    if pattern == "pool":
        ordered = order_segments(todo, order, seed)
        outcome.batches = [[s.id for s in ordered]]
        with ThreadPoolExecutor(concurrency) as ex:
            list(ex.map(one, ordered))
    else:
        for wave in _waves(todo, concurrency, order, seed):
            outcome.batches.append([s.id for s in wave])
            barrier = threading.Barrier(len(wave))
            with ThreadPoolExecutor(len(wave)) as ex:
                futs = [ex.submit(one, s, (i * stagger_ms / 1000.0) if pattern == "staggered" else 0.0, barrier)
                        for i, s in enumerate(wave)]
                for f in futs:
                    f.result()
    return outcome
