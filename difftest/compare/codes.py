"""Code-stream comparison: pure functions over (T, 16) integer arrays."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..family import CODEBOOKS
from .align import chunk_frame_bounds


@dataclass(frozen=True)
class CodeDiff:
    len_a: int
    len_b: int
    first_divergent_frame: int | None  # first frame that differs, or that only one side has
    a_at_divergence: list[int] | None  # the 16 codes of each side at that frame (None past its end)
    b_at_divergence: list[int] | None
    frames_differing: int  # within the common length
    codebooks_differing: list[int]  # per codebook, frames that differ within the common length
    chunk_agreement: list[float]  # per chunk of b's schedule: fraction of frames equal on both sides

    @property
    def equal(self) -> bool:
        return self.first_divergent_frame is None

    @property
    def length_only(self) -> bool:
        """Same codes over the common length; one side is longer."""
        return self.frames_differing == 0 and self.len_a != self.len_b


def diff_codes(a: np.ndarray, b: np.ndarray, initial_frames: int = 1, frames: int = 25) -> CodeDiff:
    a = np.asarray(a).reshape(-1, CODEBOOKS) if np.size(a) else np.zeros((0, CODEBOOKS), np.int64)
    b = np.asarray(b).reshape(-1, CODEBOOKS) if np.size(b) else np.zeros((0, CODEBOOKS), np.int64)
    la, lb = len(a), len(b)
    if la == lb and np.array_equal(a, b):  # the common case: what the general path gives for equal codes
        k = len(chunk_frame_bounds(la, initial_frames, frames))
        return CodeDiff(la, lb, None, None, None, 0, [0] * CODEBOOKS, [1.0] * k)
    n = min(la, lb)
    row_diff = (a[:n] != b[:n])  # (n, 16)
    frame_diff = row_diff.any(axis=1)
    hits = np.flatnonzero(frame_diff)
    if len(hits):
        first = int(hits[0])
    elif la != lb:
        first = n
    else:
        first = None
    a_vec = a[first].tolist() if first is not None and first < la else None
    b_vec = b[first].tolist() if first is not None and first < lb else None

    # Chunk agreement over the longer stream, on b's (the candidate's) schedule:
    # a frame only one side has counts as a disagreement.
    total = max(la, lb)
    equal = np.zeros(total, dtype=bool)
    equal[:n] = ~frame_diff
    bounds = chunk_frame_bounds(total, initial_frames, frames)
    # Per chunk: equal frames / frames, the float64 division a bool array's mean makes.
    c = np.concatenate([[0], np.cumsum(equal)])
    s, e = bounds[:, 0], bounds[:, 1]
    agreement = ((c[e] - c[s]) / (e - s)).tolist()
    return CodeDiff(la, lb, first, a_vec, b_vec, int(frame_diff.sum()),
                    row_diff.sum(axis=0).astype(int).tolist() if n else [0] * CODEBOOKS, agreement)
