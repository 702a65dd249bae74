"""Per-frame and per-chunk audio metrics: pure, vectorised functions.

Everything is computed once per codec frame (sums, maxima, log-mel
differences) and then reduced over any grouping of frames, so chunks of any
schedule cost nothing extra. Signals of different lengths are compared over
their common length; the length difference is reported separately. Equal
audio (the common case) skips the sums of squared error and the spectra: their
exact values are known (0) without them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from ..family import SAMPLE_RATE, SAMPLES_PER_FRAME
from .align import frame_sample_bounds

SNR_CAP_DB = 100.0  # an exact match has infinite SNR; MLflow stores infinity badly
MEL_N_FFT = 1024
MEL_HOP = 480  # 4 mel frames per codec frame, so mel frames never straddle two codec frames
MEL_BANDS = 64
MEL_FMAX = 12000.0
LOG_FLOOR = 1e-5


@dataclass(frozen=True)
class FrameMetrics:
    """Sufficient statistics per codec frame over the common length."""

    max_abs: np.ndarray  # (F,) max |a - b|
    sq_err: np.ndarray  # (F,) sum (a - b)^2
    sq_ref: np.ndarray | None  # (F,) sum a^2; None only where asked not to compute it for equal audio
    n: np.ndarray  # (F,) samples in the frame
    mel_l1: np.ndarray  # (F,) sum over mel frames and bands of |log mel a - log mel b|
    mel_n: np.ndarray  # (F,) mel cells summed in mel_l1


@dataclass(frozen=True)
class ChunkMetrics:
    max_abs: np.ndarray  # (K,)
    rms: np.ndarray  # (K,) RMS of the difference
    snr_db: np.ndarray  # (K,) 10 log10(sum a^2 / sum (a-b)^2), capped at SNR_CAP_DB
    logmel: np.ndarray  # (K,) mean |log mel a - log mel b|

    def as_lists(self) -> dict:
        return {k: [float(x) for x in getattr(self, k)] for k in ("max_abs", "rms", "snr_db", "logmel")}


def snr_db(signal_energy, noise_energy):
    """SNR in dB, capped; zero noise gives the cap, zero signal with noise gives -cap."""
    signal_energy = np.asarray(signal_energy, dtype=np.float64)
    noise_energy = np.asarray(noise_energy, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = 10.0 * np.log10(signal_energy / noise_energy)
    v = np.where(noise_energy == 0, SNR_CAP_DB, v)
    v = np.where((signal_energy == 0) & (noise_energy > 0), -SNR_CAP_DB, v)
    return np.clip(v, -SNR_CAP_DB, SNR_CAP_DB)


@lru_cache(maxsize=4)
def mel_filterbank(sr: int = SAMPLE_RATE, n_fft: int = MEL_N_FFT, n_mels: int = MEL_BANDS,
                   fmax: float = MEL_FMAX) -> np.ndarray:
    """(n_fft//2+1, n_mels) triangular HTK-mel filters, float32."""
    def hz_to_mel(f):
        return 2595.0 * np.log10(1.0 + np.asarray(f) / 700.0)

    def mel_to_hz(m):
        return 700.0 * (10.0 ** (np.asarray(m) / 2595.0) - 1.0)

    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(fmax), n_mels + 2))
    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    up = (freqs[None, :] - lo) / (mid - lo)
    down = (hi - freqs[None, :]) / (hi - mid)
    return np.maximum(0.0, np.minimum(up, down)).T.astype(np.float32)


def log_mel(x: np.ndarray, sr: int = SAMPLE_RATE) -> np.ndarray:
    """(M, MEL_BANDS) log-mel frames; frame m starts at sample m * MEL_HOP, zero-padded at the end."""
    x = np.asarray(x, dtype=np.float32)
    n_frames = -(-len(x) // MEL_HOP)
    if n_frames == 0:
        return np.zeros((0, MEL_BANDS), np.float32)
    padded = np.zeros((n_frames - 1) * MEL_HOP + MEL_N_FFT, np.float32)
    padded[: len(x)] = x
    frames = np.lib.stride_tricks.sliding_window_view(padded, MEL_N_FFT)[::MEL_HOP]
    window = np.hanning(MEL_N_FFT).astype(np.float32)
    import scipy.fft  # here, not at the top: every CLI start would pay for it

    spec = np.abs(scipy.fft.rfft(frames * window, axis=1, workers=1)) ** 2  # complex64: 5x numpy's fft
    return np.log(spec @ mel_filterbank(sr) + LOG_FLOOR)


def _per_frame(x: np.ndarray, bounds: np.ndarray, reduce) -> np.ndarray:
    """reduce(rows, axis=1) per frame: full frames as one reshape, the ragged last one alone."""
    spf = int(bounds[0, 1] - bounds[0, 0]) if len(bounds) > 1 else 0
    full = len(bounds) - 1
    head = reduce(x[: full * spf].reshape(full, spf), axis=1) if full else np.zeros(0)
    tail = reduce(x[bounds[-1, 0]:][None, :], axis=1)
    return np.concatenate([head, tail]).astype(np.float64)


def frame_metrics(a: np.ndarray, b: np.ndarray, sr: int = SAMPLE_RATE, spf: int = SAMPLES_PER_FRAME,
                  with_mel: bool = True, mel_a: np.ndarray | None = None,
                  mel_b: np.ndarray | None = None, energy_if_equal: bool = True) -> FrameMetrics:
    """Per-frame statistics of b against a (a is the side taken as the signal), common length.

    `mel_a` / `mel_b`: log_mel of the full signals, when the caller already has them.
    `energy_if_equal=False`: sq_ref is None where no frame differs (reduce_frames needs no signal
    energy then: every SNR is the cap)."""
    fm = _time_metrics(a, b, spf, energy_if_equal)
    return add_log_mel(fm, a, b, sr, spf, mel_a, mel_b) if with_mel else fm


def _time_metrics(a: np.ndarray, b: np.ndarray, spf: int, energy_if_equal: bool = True) -> FrameMetrics:
    """frame_metrics without the log-mel (mel_l1 and mel_n zero)."""
    a = np.asarray(a, dtype=np.float32).reshape(-1)
    b = np.asarray(b, dtype=np.float32).reshape(-1)
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    bounds = frame_sample_bounds(n, spf)
    if len(bounds) == 0:
        z = np.zeros(0)
        return FrameMetrics(z, z, z, z.astype(np.int64), z, z.astype(np.int64))
    d = np.subtract(a, b)
    np.abs(d, out=d)  # |d| squares to exactly d^2: one array serves both

    def sumsq(rows, axis):
        return np.einsum("ij,ij->i", rows, rows, dtype=np.float64)

    max_abs = _per_frame(d, bounds, np.max)
    # Equal audio (the common case) has no error to sum: every d is 0, so the sum is exactly 0.
    # A NaN makes max_abs.any() true, so it still propagates as it did.
    differs = bool(max_abs.any())
    sq_err = _per_frame(d, bounds, sumsq) if differs else np.zeros(len(bounds))
    sq_ref = _per_frame(a, bounds, sumsq) if energy_if_equal or differs else None
    counts = bounds[:, 1] - bounds[:, 0]
    return FrameMetrics(max_abs, sq_err, sq_ref, counts, np.zeros(len(bounds)), np.zeros(len(bounds), dtype=np.int64))


def add_log_mel(fm: FrameMetrics, a: np.ndarray, b: np.ndarray, sr: int = SAMPLE_RATE, spf: int = SAMPLES_PER_FRAME,
                mel_a: np.ndarray | None = None, mel_b: np.ndarray | None = None) -> FrameMetrics:
    """`fm` (frame_metrics(a, b, with_mel=False)) with its log-mel fields filled in.

    Where the audio is equal over the common length (no frame has a difference) the log-mel
    distance is 0 by definition, and so it is in what the spectra would give: equal samples make
    equal mel rows (each row is computed from its own window, at the same place in both), so
    every |la - lb| is exactly 0. Then no spectrum is taken."""
    F = len(fm.max_abs)
    if F == 0:
        return fm
    a = np.asarray(a, dtype=np.float32).reshape(-1)
    b = np.asarray(b, dtype=np.float32).reshape(-1)
    n = min(len(a), len(b))
    if not fm.max_abs.any():
        owner = np.minimum(np.arange(-(-n // MEL_HOP)) * MEL_HOP // spf, F - 1)  # log_mel's rows over n samples
        return replace(fm, mel_l1=np.zeros(F), mel_n=np.bincount(owner, minlength=F) * MEL_BANDS)
    if len(a) != len(b):  # cached mels of the longer signal would see past the common end
        mel_a = mel_b = None
    la = log_mel(a[:n], sr) if mel_a is None else mel_a
    lb = log_mel(b[:n], sr) if mel_b is None else mel_b
    cell = np.abs(la - lb).sum(axis=1, dtype=np.float64)
    owner = np.minimum(np.arange(len(cell)) * MEL_HOP // spf, F - 1)
    mel_l1 = np.bincount(owner, weights=cell, minlength=F)
    return replace(fm, mel_l1=mel_l1, mel_n=np.bincount(owner, minlength=F) * MEL_BANDS)


def reduce_frames(fm: FrameMetrics, frame_bounds: np.ndarray) -> ChunkMetrics:
    """Aggregate per-frame statistics over [start, end) frame ranges (chunks past the end are empty)."""
    F = len(fm.max_abs)
    k = len(frame_bounds)
    out = {name: np.zeros(k) for name in ("max_abs", "rms", "snr_db", "logmel")}
    if k == 0:
        return ChunkMetrics(**out)
    if fm.sq_ref is None:  # no frame differs (frame_metrics): what the sums below give, every chunk
        out["snr_db"][:] = SNR_CAP_DB
        return ChunkMetrics(**out)
    s = np.clip(frame_bounds[:, 0], 0, F)
    e = np.clip(frame_bounds[:, 1], 0, F)
    nonempty = e > s

    # Sums over a chunk as differences of running sums: one cumsum for all five (along each row it
    # adds in the same order as a cumsum of that row alone, so the same floats).
    c = np.zeros((5, F + 1))
    np.cumsum(np.stack([fm.sq_err, fm.sq_ref, fm.n, fm.mel_l1, fm.mel_n]), axis=1, dtype=np.float64, out=c[:, 1:])
    sq_err, sq_ref, n, mel_l1, mel_n = c[:, e] - c[:, s]
    # The max over each [s, e) in one reduceat over (s, e) pairs; a trailing 0 keeps e = F a valid index.
    # An empty chunk's entry is a single element, replaced by 0.
    pairs = np.maximum.reduceat(np.append(fm.max_abs, 0.0), np.stack([s, e], axis=1).reshape(-1))
    out["max_abs"] = np.where(nonempty, pairs[::2], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out["rms"] = np.where(n > 0, np.sqrt(sq_err / np.maximum(n, 1)), 0.0)
        out["logmel"] = np.where(mel_n > 0, mel_l1 / np.maximum(mel_n, 1), 0.0)
    out["snr_db"] = np.where(nonempty, snr_db(sq_ref, sq_err), SNR_CAP_DB)
    return ChunkMetrics(**out)


def non_finite(x: np.ndarray) -> int | None:
    """Index of the first NaN or infinite sample, or None."""
    x = np.asarray(x)
    # A NaN or an infinity makes the sum NaN or infinite, so a finite sum clears the common case
    # in one pass (a sum that overflows is looked at sample by sample, as any other).
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(x.sum()):
            return None
    bad = np.flatnonzero(~np.isfinite(x))
    return int(bad[0]) if len(bad) else None
