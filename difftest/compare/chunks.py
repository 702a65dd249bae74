"""One audio comparison, chunk by chunk: two results' audio on the frame grid, per-frame and
per-chunk metrics (compare/audio.py), and each chunk's tier at the thresholds passed in. Pure: the
policy and the segment's chunking are arguments, not read here."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..results import Result
from . import align
from .audio import ChunkMetrics, FrameMetrics, add_log_mel, frame_metrics, log_mel, reduce_frames

TIERS = ("identical", "within_quantisation", "close", "diverged")


@dataclass(frozen=True)
class Thresholds:
    """The tiers' bounds (the policy's `tiers:`, docs/verdicts.md)."""
    quantisation_max_abs: float
    close_max_abs: float
    close_snr_db: float
    close_logmel: float


def chunk_tiers(m: ChunkMetrics, t: Thresholds, quantised: bool = False) -> np.ndarray:
    """Tier index per chunk (0 identical .. 3 diverged).

    When either side went through 16-bit PCM, a difference that quantisation
    alone explains is within_quantisation: the best tier such audio can reach
    against float audio. Between two float signals there is no such tier.
    """
    tiers = np.full(len(m.max_abs), 3, dtype=np.int64)
    close = (m.max_abs <= t.close_max_abs) | (
        (m.snr_db >= t.close_snr_db) & (m.logmel <= t.close_logmel))
    tiers[close] = 2
    if quantised:
        tiers[m.max_abs <= t.quantisation_max_abs] = 1
    tiers[m.max_abs == 0] = 0
    return tiers


class Audio:
    """One audio comparison: per-frame stats, per-chunk metrics and tiers."""

    def __init__(self, a: Result, b: Result, thresholds: Thresholds, chunking: tuple[int, int],
                 mels: dict | None = None):
        # `chunking`: (initial_frames, chunk_frames); `mels`: id(result) -> log-mel, and the comparisons
        # made, shared across one segment's comparisons
        mels = {} if mels is None else mels
        self.thresholds = thresholds
        self.fm, self.bounds, self.chunks = _compared(a, b, thresholds, chunking, mels)
        self.logmel_computed = _needs_logmel(self.fm, thresholds)
        self.quantised = a.quantised or b.quantised
        self.tiers = chunk_tiers(self.chunks, thresholds, self.quantised)
        self.len_a, self.len_b = len(a.grid_wav), len(b.grid_wav)

    @property
    def worst(self) -> int:
        return int(self.tiers.max()) if len(self.tiers) else 0

    def bad_chunks(self, allowed_tier: int, excused: np.ndarray | None = None) -> np.ndarray:
        """Chunks above the allowed tier; `excused` (bool per chunk): those a measured null allows."""
        over = self.tiers > allowed_tier
        return np.flatnonzero(over & ~excused if excused is not None else over)

    def first_bad(self, allowed_tier: int, excused: np.ndarray | None = None) -> tuple[int | None, int | None]:
        """(frame, chunk) where the comparison first leaves the allowed tier."""
        bad = self.bad_chunks(allowed_tier, excused)
        if not len(bad):
            return None, None
        c = int(bad[0])
        s, e = self.bounds[c]
        thr = self.thresholds.quantisation_max_abs if allowed_tier < 2 else self.thresholds.close_max_abs
        inner = np.flatnonzero(self.fm.max_abs[s:e] > thr)
        return int(s + (inner[0] if len(inner) else 0)), c

    @property
    def length_gap(self) -> int:
        """Sample-count difference beyond the one trailing sample qwen-tts may add."""
        gap = abs(self.len_a - self.len_b)
        return 0 if gap <= align.TRAILING_SAMPLES else gap

    def to_json(self) -> dict:
        return {"tiers": [TIERS[t] for t in self.tiers], "worst_tier": TIERS[self.worst],
                "samples": [self.len_a, self.len_b], "quantised": self.quantised,
                "logmel_computed": self.logmel_computed, "chunks": self.chunks.as_lists()}


def _needs_logmel(fm: FrameMetrics, t: Thresholds) -> bool:
    """The log-mel decides a chunk's tier only where its max |diff| is above close_max_abs (chunk_tiers):
    where no frame's is (identical or quantisation-level audio, the common case) it is not computed,
    and its chunk values read 0 with `logmel_computed: false`."""
    return bool(len(fm.max_abs)) and float(fm.max_abs.max()) > t.close_max_abs


def _compared(a: Result, b: Result, t: Thresholds, chunking: tuple[int, int],
              mels: dict) -> tuple[FrameMetrics, np.ndarray, ChunkMetrics]:
    """b's audio against a's: per-frame metrics (the log-mel only where _needs_logmel), chunk bounds,
    per-chunk metrics. A comparison already made for this segment between the same audio (bit for
    bit: the control often equals the candidate, the reference vocoder on the reference's own codes
    decodes the reference's audio) is not made again: the same inputs give the same numbers."""
    # Both sides from their frame 0: qwen-tts's cut can leave one sample in front (difftest.compare.align).
    wa, wb = a.grid_wav, b.grid_wav
    key = (a.sample_rate, t.close_max_abs, *chunking)
    made = mels.setdefault("compared", [])
    for x, y, k, out in made:
        if k == key and _same_audio(y, wb) and _same_audio(x, wa):
            return out
    fm = frame_metrics(wa, wb, a.sample_rate, with_mel=False, energy_if_equal=False)
    if _needs_logmel(fm, t):
        for r in (a, b):
            if id(r) not in mels:
                mels[id(r)] = log_mel(r.grid_wav, r.sample_rate)
        fm = add_log_mel(fm, wa, wb, a.sample_rate, mel_a=mels[id(a)], mel_b=mels[id(b)])
    bounds = align.chunk_frame_bounds(len(fm.max_abs), *chunking)
    out = (fm, bounds, reduce_frames(fm, bounds))
    for arr in (*fm.__dict__.values(), bounds, *out[2].__dict__.values()):
        if arr is not None:
            arr.flags.writeable = False  # shared by every Audio that reuses it
    made.append((wa, wb, key, out))
    return out


def _same_audio(x: np.ndarray, y: np.ndarray) -> bool:
    """The same samples bit for bit: the same memory, or equal bits (compared as unsigned integers,
    so NaN and -0.0 are no exceptions)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.__array_interface__["data"][0] == y.__array_interface__["data"][0] and x.strides == y.strides:
        return True
    if x.dtype.kind != "f" or x.dtype.itemsize not in (2, 4, 8):
        return bool(np.array_equal(x, y))
    bits = np.dtype(f"u{x.dtype.itemsize}")
    return bool(np.array_equal(x.view(bits), y.view(bits)))
