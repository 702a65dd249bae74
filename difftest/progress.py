"""Progress of a run on stderr: segments done, audio seconds, real-time factor.

On a terminal it is one line rewritten in place; elsewhere (CI logs, files) it
is one line per segment, so nothing relies on carriage returns.
"""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str = "run", stream: TextIO | None = None, tty: bool | None = None):
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = self.cached = self.failed = 0
        self.audio_seconds = 0.0  # audio computed in this run (cached results excluded)
        self.compute_seconds = 0.0
        self._status_shown = False

    @property
    def rtf(self) -> float | None:
        """Real-time factor: compute seconds per audio second (below 1 is faster than real time)."""
        return self.compute_seconds / self.audio_seconds if self.audio_seconds else None

    def summary(self) -> str:
        parts = [f"{self.done}/{self.total} segments"]
        if self.cached:
            parts.append(f"{self.cached} cached")
        if self.failed:
            parts.append(f"{self.failed} failed")
        if self.audio_seconds or not self.compute_seconds:  # a codes-only decode (the measured null) makes none
            parts.append(f"{self.audio_seconds:.1f} s audio")
        if self.rtf is not None:
            parts.append(f"RTF {self.rtf:.2f}")
        return f"{self.label}: " + ", ".join(parts)

    def _write_line(self, text: str) -> None:
        if self.tty and self._status_shown:
            self.stream.write("\r\x1b[2K")
            self._status_shown = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def _show_status(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.summary())
            self.stream.flush()
            self._status_shown = True

    def note(self, message: str) -> None:
        """A message that is not a segment's outcome (loading a model, ...)."""
        self._write_line(f"{self.label}: {message}")
        self._show_status()

    def segment(self, segment_id: str, *, cached: bool = False, seconds: float = 0.0, audio_seconds: float = 0.0,
                error: str | None = None) -> None:
        self.done += 1
        if error is not None:
            self.failed += 1
            first_line = error.strip().splitlines()[0] if error.strip() else "error"
            self._write_line(f"{self.label} [{self.done}/{self.total}] {segment_id}: ERROR {first_line}")
        elif cached:
            self.cached += 1
            if not self.tty:
                self._write_line(f"{self.label} [{self.done}/{self.total}] {segment_id}: cached")
        else:
            self.audio_seconds += audio_seconds
            self.compute_seconds += seconds
            if not self.tty:
                rtf = f", RTF {seconds / audio_seconds:.2f}" if audio_seconds else ""
                made = f"{audio_seconds:.2f} s audio" if audio_seconds else "codes"
                self._write_line(f"{self.label} [{self.done}/{self.total}] {segment_id}: {made} in {seconds:.2f} s{rtf}")
        self._show_status()

    def close(self) -> None:
        if self.tty and self._status_shown:
            self.stream.write("\n")
            self._status_shown = False
        else:
            self.stream.write(self.summary() + "\n")
        self.stream.flush()
