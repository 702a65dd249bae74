"""The comparison's fast paths give exactly what the full computation gives, bit for bit.

`full_*` below are the comparison as it was before the fast paths (every metric computed for
every frame, whatever the audio): the oracle. Cases: bit-identical audio, quantisation-level
(a 16-bit PCM round trip), close (float noise), diverged, and mixes of them along one signal."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from difftest.compare.align import chunk_frame_bounds, frame_sample_bounds
from difftest.compare.audio import (
    MEL_BANDS,
    MEL_HOP,
    SNR_CAP_DB,
    ChunkMetrics,
    FrameMetrics,
    add_log_mel,
    frame_metrics,
    log_mel,
    non_finite,
    reduce_frames,
    snr_db,
)
from difftest.compare.codes import CodeDiff, diff_codes

SPF = 1920


def full_frame_metrics(a, b, sr=24000, spf=SPF, with_mel=True, mel_a=None, mel_b=None) -> FrameMetrics:
    a = np.asarray(a, dtype=np.float32).reshape(-1)
    b = np.asarray(b, dtype=np.float32).reshape(-1)
    n = min(len(a), len(b))
    same_length = len(a) == len(b)
    a, b = a[:n], b[:n]
    bounds = frame_sample_bounds(n, spf)
    if len(bounds) == 0:
        z = np.zeros(0)
        return FrameMetrics(z, z, z, z.astype(np.int64), z, z.astype(np.int64))
    d = a - b

    def per_frame(x, reduce):
        full = len(bounds) - 1
        head = reduce(x[: full * spf].reshape(full, spf)) if full else np.zeros(0)
        tail = reduce(x[bounds[-1, 0]:][None, :])
        return np.concatenate([head, tail]).astype(np.float64)

    def sumsq(rows):
        return np.einsum("ij,ij->i", rows, rows, dtype=np.float64)

    max_abs = per_frame(np.abs(d), lambda r: np.max(r, axis=1))
    sq_err, sq_ref = per_frame(d, sumsq), per_frame(a, sumsq)
    counts = bounds[:, 1] - bounds[:, 0]
    if with_mel:
        if not same_length:
            mel_a = mel_b = None
        la = log_mel(a, sr) if mel_a is None else mel_a
        lb = log_mel(b, sr) if mel_b is None else mel_b
        cell = np.abs(la - lb).sum(axis=1, dtype=np.float64)
        owner = np.minimum(np.arange(len(cell)) * MEL_HOP // spf, len(bounds) - 1)
        mel_l1 = np.bincount(owner, weights=cell, minlength=len(bounds))
        mel_n = np.bincount(owner, minlength=len(bounds)) * MEL_BANDS
    else:
        mel_l1, mel_n = np.zeros(len(bounds)), np.zeros(len(bounds), dtype=np.int64)
    return FrameMetrics(max_abs, sq_err, sq_ref, counts, mel_l1, mel_n)


def full_reduce_frames(fm: FrameMetrics, frame_bounds) -> ChunkMetrics:
    F, k = len(fm.max_abs), len(frame_bounds)
    out = {name: np.zeros(k) for name in ("max_abs", "rms", "snr_db", "logmel")}
    if k == 0:
        return ChunkMetrics(**out)
    s, e = np.clip(frame_bounds[:, 0], 0, F), np.clip(frame_bounds[:, 1], 0, F)

    def seg_sum(x):
        c = np.concatenate([[0.0], np.cumsum(x, dtype=np.float64)])
        return c[e] - c[s]

    sq_err, sq_ref, n = seg_sum(fm.sq_err), seg_sum(fm.sq_ref), seg_sum(fm.n)
    mel_l1, mel_n = seg_sum(fm.mel_l1), seg_sum(fm.mel_n)
    out["max_abs"] = np.array([fm.max_abs[i:j].max() if j > i else 0.0 for i, j in zip(s, e)])
    with np.errstate(divide="ignore", invalid="ignore"):
        out["rms"] = np.where(n > 0, np.sqrt(sq_err / np.maximum(n, 1)), 0.0)
        out["logmel"] = np.where(mel_n > 0, mel_l1 / np.maximum(mel_n, 1), 0.0)
    out["snr_db"] = np.where(e > s, snr_db(sq_ref, sq_err), SNR_CAP_DB)
    return ChunkMetrics(**out)


def full_non_finite(x):
    bad = np.flatnonzero(~np.isfinite(np.asarray(x)))
    return int(bad[0]) if len(bad) else None


def full_chunk_frame_bounds(n_frames, initial_frames=1, frames=25):
    if n_frames <= 0:
        return np.zeros((0, 2), dtype=np.int64)
    starts, nxt = [0], initial_frames
    while nxt < n_frames:
        starts.append(nxt)
        nxt += frames
    starts = np.asarray(starts, dtype=np.int64)
    return np.stack([starts, np.append(starts[1:], n_frames)], axis=1)


def full_diff_codes(a, b, initial_frames=1, frames=25) -> CodeDiff:
    a = np.asarray(a).reshape(-1, 16) if np.size(a) else np.zeros((0, 16), np.int64)
    b = np.asarray(b).reshape(-1, 16) if np.size(b) else np.zeros((0, 16), np.int64)
    la, lb = len(a), len(b)
    n = min(la, lb)
    row_diff = a[:n] != b[:n]
    frame_diff = row_diff.any(axis=1)
    hits = np.flatnonzero(frame_diff)
    first = int(hits[0]) if len(hits) else (n if la != lb else None)
    a_vec = a[first].tolist() if first is not None and first < la else None
    b_vec = b[first].tolist() if first is not None and first < lb else None
    equal = np.zeros(max(la, lb), dtype=bool)
    equal[:n] = ~frame_diff
    agreement = [float(equal[s:e].mean()) for s, e in full_chunk_frame_bounds(max(la, lb), initial_frames, frames)]
    return CodeDiff(la, lb, first, a_vec, b_vec, int(frame_diff.sum()),
                    row_diff.sum(axis=0).astype(int).tolist() if n else [0] * 16, agreement)


def bits(x) -> bytes:
    """An array's dtype, shape and bytes: equal only for the same floats, sign of zero and NaN included."""
    x = np.asarray(x)
    return f"{x.dtype}{x.shape}".encode() + x.tobytes()


def same_metrics(x, y) -> bool:
    return all(bits(getattr(x, f)) == bits(getattr(y, f)) for f in x.__dataclass_fields__)


def pcm16(w):
    """A WAV's round trip: 32767 in, 32768 out."""
    return (np.rint(np.clip(w, -1, 1).astype(np.float64) * 32767) / 32768).astype(np.float32)


KINDS = ("identical", "quantised", "close", "diverged")


def make_pair(seed: int, n: int, kinds: list[str], n_b: int | None = None):
    """A signal and a second one that relates to it, stretch by stretch, as `kinds` says."""
    rng = np.random.default_rng(seed)
    a = (0.3 * rng.standard_normal(n)).astype(np.float32)
    b = a.copy()
    cuts = np.linspace(0, n, len(kinds) + 1).astype(int)
    for kind, lo, hi in zip(kinds, cuts[:-1], cuts[1:]):
        if kind == "quantised":
            b[lo:hi] = pcm16(a[lo:hi])
        elif kind == "close":
            b[lo:hi] = a[lo:hi] + (3e-5 * rng.standard_normal(hi - lo)).astype(np.float32)
        elif kind == "diverged":
            b[lo:hi] = (0.3 * rng.standard_normal(hi - lo)).astype(np.float32)
    if n_b is not None:  # the other side longer or shorter: compared over the common length
        b = np.concatenate([b, (0.3 * rng.standard_normal(max(0, n_b - n))).astype(np.float32)])[:n_b]
    return a, b


pairs = st.builds(
    make_pair, st.integers(0, 2**32 - 1),
    st.sampled_from([0, 1, 479, 1920, 1921, 2 * 1920 + 1, 3 * 1920 + 700, 9 * 1920]) | st.integers(0, 12 * 1920),
    st.lists(st.sampled_from(KINDS), min_size=1, max_size=4),
    st.none() | st.integers(0, 12 * 1920))
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(pairs)
def test_frame_metrics_are_the_full_computation_bit_for_bit(pair):
    a, b = pair
    full = full_frame_metrics(a, b)
    assert same_metrics(frame_metrics(a, b), full)
    assert same_metrics(frame_metrics(a, b, with_mel=False), full_frame_metrics(a, b, with_mel=False))
    # The log-mel added afterwards, with each side's cached spectra: what Audio does.
    time_only = frame_metrics(a, b, with_mel=False)
    assert same_metrics(add_log_mel(time_only, a, b, mel_a=log_mel(a), mel_b=log_mel(b)),
                        full_frame_metrics(a, b, mel_a=log_mel(a), mel_b=log_mel(b)))


@FAST
@given(pairs, st.integers(1, 5), st.integers(1, 30))
def test_chunk_metrics_are_the_full_computation_bit_for_bit(pair, initial, frames):
    a, b = pair
    full = full_frame_metrics(a, b)
    bounds = chunk_frame_bounds(len(full.max_abs), initial, frames)
    assert bits(bounds) == bits(full_chunk_frame_bounds(len(full.max_abs), initial, frames))
    want = full_reduce_frames(full, bounds)
    assert same_metrics(reduce_frames(frame_metrics(a, b), bounds), want)
    # Without the signal's energy where nothing differs: the same chunk metrics.
    lean = frame_metrics(a, b, energy_if_equal=False)
    assert (lean.sq_ref is None) == (len(full.max_abs) > 0 and not full.max_abs.any())
    assert same_metrics(reduce_frames(lean, bounds), want)


@FAST
@given(pairs, st.lists(st.tuples(st.integers(-2, 14), st.integers(-2, 14)), max_size=6))
def test_any_chunk_bounds_reduce_as_before(pair, raw):
    """Overlapping, out-of-order, empty and past-the-end chunks too."""
    fm = full_frame_metrics(*pair)
    bounds = np.array(raw, dtype=np.int64).reshape(-1, 2)
    assert same_metrics(reduce_frames(fm, bounds), full_reduce_frames(fm, bounds))


def test_identical_audio_is_zero_without_sums_or_spectra(monkeypatch):
    from difftest.compare import audio

    a = (0.3 * np.random.default_rng(3).standard_normal(5 * SPF + 1)).astype(np.float32)
    a[::7] = 0.0
    b = a.copy()
    b[::7] = -0.0  # equal values, another sign of zero: not the same bits, still no difference
    assert bits(a) != bits(b)
    monkeypatch.setattr(audio, "log_mel", lambda *x, **k: pytest.fail("a spectrum of equal audio"))
    einsums = []
    real = np.einsum
    monkeypatch.setattr(audio.np, "einsum", lambda *x, **k: einsums.append(1) or real(*x, **k))
    fm = frame_metrics(a, b, energy_if_equal=False)
    assert einsums == [] and fm.sq_ref is None
    assert fm.max_abs.tolist() == [0.0] * 5 and fm.sq_err.tolist() == [0.0] * 5 and fm.mel_l1.tolist() == [0.0] * 5
    assert fm.mel_n.tolist() == [4 * MEL_BANDS] * 4 + [5 * MEL_BANDS]  # the trailing sample opens a 21st mel row
    cm = reduce_frames(fm, chunk_frame_bounds(5, 1, 2))
    assert cm.as_lists() == {"max_abs": [0.0] * 3, "rms": [0.0] * 3, "snr_db": [SNR_CAP_DB] * 3, "logmel": [0.0] * 3}


@pytest.mark.parametrize("x", [
    np.zeros(0, np.float32), np.ones(7, np.float32), np.arange(5),
    np.array([0.0, 1.0, np.nan, np.inf]), np.array([0.0, -np.inf, np.inf]), np.array([np.inf, -np.inf]),
    np.full(8, 3e38, np.float32),  # a sum that overflows, every sample finite
    np.array([1e308, 1e308, np.nan]),
])
def test_non_finite_as_before(x):
    with np.errstate(all="raise"):  # and no floating-point warning on the way
        assert non_finite(x) == full_non_finite(x)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 60), st.integers(0, 60), st.integers(0, 2**32 - 1), st.floats(0, 1), st.integers(1, 4),
       st.integers(1, 30))
def test_code_diffs_as_before(la, lb, seed, p_differ, initial, frames):
    """Equal codes (the fast path), a longer or shorter side, differing frames: every field, every float."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 3, (la, 16))
    b = a[:lb].copy() if lb <= la else np.concatenate([a, rng.integers(0, 3, (lb - la, 16))])
    b[rng.random(len(b)) < p_differ] = 0
    got, want = diff_codes(a, b, initial, frames), full_diff_codes(a, b, initial, frames)
    assert got == want
    assert bits(got.chunk_agreement) == bits(want.chunk_agreement)
    assert [type(x) for x in got.codebooks_differing] == [type(x) for x in want.codebooks_differing]
