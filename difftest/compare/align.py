"""Frames, samples and chunks.

A codec frame f covers samples [1920 f, 1920 (f + 1)) at 24 kHz. The
candidate streams audio in chunks of frames: a first chunk of
`initial_frames`, then chunks of `frames` (vLLM-Omni: 1, then 25). Lengths
need not be multiples of either: the last frame or chunk may be ragged.

qwen-tts cuts the reference part of an in-context decode at
`int(R / (R + T) * len(wav))`, which for some (R, T) is one sample short of
R * 1920: its audio then starts one sample before frame 0. A result records
that as `meta.lead_samples`, and every comparison starts each side at its
frame 0 (`Result.grid_wav`), so a 1-sample shift at the front never reads as a
divergence (measured on vLLM-Omni 0.30.0: SNR -3 dB unaligned, 83.6 dB aligned).
"""

from __future__ import annotations

import numpy as np

from ..family import SAMPLES_PER_FRAME

TRAILING_SAMPLES = 1  # extra samples past the last whole frame that count as that frame's


def qwen_tts_cut(ref_frames: int, total_frames: int, n_samples: int) -> int:
    """Where qwen-tts cuts the reference part off a decode of `total_frames` (float arithmetic, as it does)."""
    return int(ref_frames / max(total_frames, 1) * n_samples)


def lead_samples(ref_frames: int, gen_frames: int, spf: int = SAMPLES_PER_FRAME) -> int:
    """Samples that qwen-tts's cut leaves before the first generated frame (0 or 1)."""
    if ref_frames <= 0:
        return 0
    total = ref_frames + gen_frames
    return ref_frames * spf - qwen_tts_cut(ref_frames, total, total * spf)


def lead_of(n_samples: int, gen_frames: int, spf: int = SAMPLES_PER_FRAME) -> int:
    """The lead of audio that decodes `gen_frames` frames: the one sample qwen-tts's cut can leave
    in front, else 0 (a decoder's own output is always whole frames)."""
    extra = n_samples - gen_frames * spf
    return extra if 0 <= extra <= 1 and gen_frames else 0


def frames_for_samples(n_samples: int, spf: int = SAMPLES_PER_FRAME) -> int:
    """How many frames n samples span; a trailing sample does not open a new frame."""
    if n_samples <= 0:
        return 0
    whole, rest = divmod(n_samples, spf)
    if whole and rest <= TRAILING_SAMPLES:
        return whole
    return whole + (1 if rest else 0)


def chunk_frame_bounds(n_frames: int, initial_frames: int = 1, frames: int = 25) -> np.ndarray:
    """(K, 2) int array of [start, end) frame ranges covering n_frames; K = 0 for n_frames = 0."""
    if initial_frames <= 0 or frames <= 0:
        raise ValueError("chunk sizes must be positive")
    if n_frames <= 0:
        return np.zeros((0, 2), dtype=np.int64)
    starts = np.concatenate([[0], np.arange(initial_frames, n_frames, frames)]).astype(np.int64)
    ends = np.append(starts[1:], n_frames)
    return np.stack([starts, ends], axis=1)


def frame_sample_bounds(n_samples: int, spf: int = SAMPLES_PER_FRAME) -> np.ndarray:
    """(F, 2) sample ranges of each frame; the last frame takes any ragged or trailing samples."""
    n_frames = frames_for_samples(n_samples, spf)
    if n_frames == 0:
        return np.zeros((0, 2), dtype=np.int64)
    starts = np.arange(n_frames, dtype=np.int64) * spf
    ends = np.minimum(starts + spf, n_samples)
    ends[-1] = n_samples
    return np.stack([starts, ends], axis=1)


def chunk_of_frame(frame: int | None, bounds: np.ndarray) -> int | None:
    """Index of the chunk holding a frame (None for None; past the end -> the next chunk index)."""
    if frame is None:
        return None
    if len(bounds) == 0:
        return 0
    idx = int(np.searchsorted(bounds[:, 1], frame, side="right"))
    return idx
