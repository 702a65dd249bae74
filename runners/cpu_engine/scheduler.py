"""Dynamic batching: one scheduler thread gathers compatible requests and runs them together.

A batch opens when its first request is taken and closes when the batch window
(counted from that request's arrival) has passed or `max_batch` requests are
in it. Only requests with the same batch key join (same task, same decode
parameters); the others wait, in arrival order, for a later batch. A request
whose key is None never shares a batch. Requests that queued up while the
engine was busy join at once (their window has already passed), the way a
continuously batching server picks up its waiting queue.

A request may say how many requests its client released together with it (its
wave: difftest's HTTP runner sends `X-Difftest-Wave`). The batch it opens then
closes as soon as that many compatible requests are in, instead of waiting the
window out: nothing else is coming. The batches are the same; a lone request at
concurrency 1 no longer waits a window per request. Where the wave also names
itself (`N;ID`), its batch waits for the whole wave however late its members
arrive (up to WAVE_GUARD_S): on a loaded machine a wave-mate can arrive after
the window, and a leak between the two would then not show (seen: a repro
reproduced 2 times of 3); it closes once every member of the wave is in the
engine, in this batch or held for another (incompatible ones).

The engine runs batches one at a time in this thread (the model is not
thread-safe). If a batch raises, its requests are retried one by one so that
one bad request cannot fail its batch-mates; an error that persists is that
request's answer.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable


WAVE_GUARD_S = 30.0  # the longest a named wave's batch waits for its members (a member the client never sent)


class EngineStopped(RuntimeError):
    pass


@dataclass
class Pending:
    job: Any
    key: Hashable | None
    seq: int
    arrival: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    batch_id: int | None = None
    batch_size: int | None = None
    batch_index: int | None = None
    wave: int | None = None  # how many requests the client released together with this one
    wave_id: str | None = None  # which wave, where the client names it

    def wait(self, timeout: float | None = None) -> Any:
        if not self.done.wait(timeout):
            raise TimeoutError(f"no answer from the engine within {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        return self.result


class Batcher:
    def __init__(self, execute: Callable[[list], list], *, max_batch: int = 8, window_s: float = 0.05,
                 log: Callable[[str], None] = lambda m: None):
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.execute = execute
        self.max_batch = max_batch
        self.window_s = max(0.0, window_s)
        self.log = log
        self._queue: queue.Queue[Pending] = queue.Queue()
        self._held: deque[Pending] = deque()
        self._seq = itertools.count()
        self._batch_ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-engine-scheduler", daemon=True)
        self.batches_run = 0
        self.batch_sizes: list[int] = []
        self._arrived: dict[str, list] = {}  # wave id -> [requests of it submitted, when the first was]
        self._lock = threading.Lock()

    def start(self) -> "Batcher":
        self._thread.start()
        return self

    def submit(self, job: Any, key: Hashable | None, wave: int | None = None, wave_id: str | None = None) -> Pending:
        if self._stop.is_set():
            raise EngineStopped("the engine is shutting down")
        wave = wave if wave and wave > 0 else None
        p = Pending(job, key, next(self._seq), wave=wave, wave_id=wave_id if wave else None)
        self.settled(p.wave_id)  # counted before it is queued: the gatherer sees it counted when it gets it
        self._queue.put(p)
        return p

    def settled(self, wave_id: str | None) -> None:
        """A request of this named wave is submitted, or refused before it could be (the server calls
        this for one it refuses: its wave's batch would wait the guard out for it otherwise)."""
        if not wave_id:
            return
        with self._lock:
            now = time.monotonic()
            for old in [w for w, (_, t) in self._arrived.items() if now - t > 10 * WAVE_GUARD_S]:
                del self._arrived[old]
            self._arrived.setdefault(wave_id, [0, now])[0] += 1

    def _wave_in(self, p: Pending) -> bool:
        """Every member of `p`'s named wave is submitted (or refused)."""
        with self._lock:
            return bool(p.wave_id) and self._arrived.get(p.wave_id, [0])[0] >= p.wave

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        for p in list(self._held) + _drain(self._queue):
            p.error = EngineStopped("the engine shut down before this request ran")
            p.done.set()

    # -- gathering -------------------------------------------------------
    def _take_first(self) -> Pending | None:
        if self._held:
            return self._held.popleft()
        while not self._stop.is_set():
            try:
                return self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
        return None

    def next_batch(self) -> list[Pending]:
        first = self._take_first()
        if first is None:
            return []
        batch = [first]
        limit = min(self.max_batch, first.wave or self.max_batch)
        if first.key is None or limit == 1:
            return batch
        for p in list(self._held):
            if len(batch) >= limit:
                break
            if p.key == first.key:
                batch.append(p)
                self._held.remove(p)
        deadline = first.arrival + (WAVE_GUARD_S if first.wave_id else self.window_s)
        while len(batch) < limit:
            if self._wave_in(first) and self._queue.empty():
                break  # the whole wave is in: the rest of it is held for a batch of its own key
            remaining = deadline - time.monotonic()
            try:
                p = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if p.key is not None and p.key == first.key:
                batch.append(p)
            else:
                self._held.append(p)
        batch.sort(key=lambda p: p.seq)
        return batch

    # -- running ---------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            batch = self.next_batch()
            if batch:
                self.run(batch)

    def run(self, batch: list[Pending]) -> None:
        bid = next(self._batch_ids)
        for i, p in enumerate(batch):
            p.batch_id, p.batch_size, p.batch_index = bid, len(batch), i
        self.batches_run += 1
        self.batch_sizes.append(len(batch))
        try:
            results = self.execute([p.job for p in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"the engine answered {len(results)} results for a batch of {len(batch)}")
        except Exception as e:
            self.log(f"batch {bid} ({len(batch)} requests) failed: {type(e).__name__}: {e}\n"
                     + traceback.format_exc(limit=6))
            if len(batch) == 1:
                batch[0].error = e
                batch[0].done.set()
                return
            self.log(f"batch {bid}: retrying its {len(batch)} requests one at a time")
            for p in batch:
                self.run([p])
            return
        for p, r in zip(batch, results):
            p.result = r
            p.done.set()


def _drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
