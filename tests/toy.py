"""A test double for an engine's vocoder: numpy only, deterministic, and like the real
one in the ways the comparison cares about: each 1920-sample frame depends on its own
16 codes and on the two frames before it, so the reference codes (left context) shape
the onset, and a different reference changes the first chunks only."""

from __future__ import annotations

import numpy as np

from difftest.results import Result
from difftest.verdicts.evidence import Evidence

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


def toy_evidence(candidate: Result | None, *, codes: np.ndarray, own: np.ndarray, sid: str = "a",
                 reference: Result | None = None, cross: Result | bool = True, **kw) -> Evidence:
    """One segment's evidence as a run assembles it, for the verdict tests: qwen-tts's result (its
    `codes` on the voice's own reference codes `own`, unless `reference` is given), the candidate at
    N, and the reference vocoder's cross-decode of the candidate's codes on `own` (`cross=False`:
    none; a Result: that one). Everything else (control, peers, scores, ...) by keyword."""
    if cross is True:
        cross = toy_result(sid, candidate.codes, own) if candidate is not None else None
    return Evidence(segment_id=sid, reference=reference or toy_result(sid, codes, own), candidate=candidate,
                    cross_own=cross or None, **kw)
