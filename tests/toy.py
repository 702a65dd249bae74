"""A test double for an engine's vocoder: numpy only, deterministic, and like the real
one in the ways the comparison cares about: each 1920-sample frame depends on its own
16 codes and on the two frames before it, so the reference codes (left context) shape
the onset, and a different reference changes the first chunks only."""

from __future__ import annotations

import numpy as np

from difftest.results import Result

SPF = 1920
T = np.arange(SPF) / 24000.0


def frame_wave(codes_row: np.ndarray) -> np.ndarray:
    f = 80.0 + (codes_row[:4] % 512) * 3.0
    return (0.2 * np.sin(2 * np.pi * f[:, None] * T[None, :])).sum(axis=0) / 4


def toy_decode(codes: np.ndarray, ref_codes: np.ndarray) -> np.ndarray:
    """Waveform for `codes` with `ref_codes` as left context (context audio cut off)."""
    allc = np.concatenate([ref_codes.reshape(-1, 16), codes.reshape(-1, 16)]).astype(np.int64)
    frames = [frame_wave(r) for r in allc]
    out = []
    for i in range(len(ref_codes), len(allc)):
        ctx = sum(0.3 * frames[j] for j in range(max(0, i - 2), i))
        out.append(frames[i] + ctx)
    return (np.concatenate(out) if out else np.zeros(0)).astype(np.float32)


def toy_codes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2048, size=(n, 16), dtype=np.int64)


def toy_result(sid: str, codes, ref_codes, wav=None, **kw) -> Result:
    wav = toy_decode(codes, ref_codes) if wav is None else wav
    return Result(segment_id=sid, segment_hash=kw.pop("segment_hash", "h" * 64), wav=wav,
                  sample_rate=24000, codes=codes, ref_codes=ref_codes, **kw)
