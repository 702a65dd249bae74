"""What the capture costs this process: seconds spent in capture code, not in the functions it
wraps, for benchmarks/bench_capture.py. Kept in `<dir>/.difftest-capture/cost/<pid>.json`
(`{"seconds", "calls"}`), rewritten at most every 0.25 s by the call that passes that mark: the
file is behind by at most the calls of the last quarter second, which the benchmark's closing
request flushes."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

FLUSH_S = 0.25


class Cost:
    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self.path: Path | None = None
        self._flushed = 0.0

    def configure(self, side: Path) -> None:
        (side / "cost").mkdir(parents=True, exist_ok=True)
        self.path = side / "cost" / f"{os.getpid()}.json"

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1
        now = time.perf_counter()
        if self.path is not None and now - self._flushed >= FLUSH_S:
            self._flushed = now
            tmp = self.path.with_suffix(".tmp")
            try:
                tmp.write_text(json.dumps({"seconds": self.seconds, "calls": self.calls}))
                os.replace(tmp, self.path)
            except OSError:
                pass
            self.seconds += time.perf_counter() - now  # the flush is capture code too

    @contextmanager
    def timed(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(time.perf_counter() - t)


COST = Cost()
