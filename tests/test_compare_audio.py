"""Audio metrics on hand-computed cases."""

import numpy as np
import pytest

from difftest.compare.align import chunk_frame_bounds
from difftest.compare.audio import (
    MEL_BANDS,
    SNR_CAP_DB,
    frame_metrics,
    log_mel,
    mel_filterbank,
    non_finite,
    reduce_frames,
    snr_db,
)


def test_snr_hand_values():
    assert snr_db(100.0, 1.0) == pytest.approx(20.0)
    assert snr_db(1.0, 1.0) == pytest.approx(0.0)
    assert snr_db(1.0, 0.0) == SNR_CAP_DB
    assert snr_db(0.0, 0.0) == SNR_CAP_DB
    assert snr_db(0.0, 1.0) == -SNR_CAP_DB
    assert snr_db(1e30, 1e-30) == SNR_CAP_DB


def test_per_frame_and_per_chunk_hand_values():
    a = np.zeros(3 * 1920, np.float32)
    a[:] = 0.5
    b = a.copy()
    b[1920 + 10] = 0.25  # frame 1: one sample off by 0.25
    b[2 * 1920:] = 0.0  # frame 2: all off by 0.5
    fm = frame_metrics(a, b, with_mel=False)
    assert fm.max_abs.tolist() == [0.0, 0.25, 0.5]
    assert fm.sq_err.tolist() == pytest.approx([0.0, 0.0625, 0.25 * 1920])
    assert fm.sq_ref.tolist() == pytest.approx([0.25 * 1920] * 3)
    cm = reduce_frames(fm, np.array([[0, 1], [1, 3]]))
    assert cm.max_abs.tolist() == [0.0, 0.5]
    assert cm.rms.tolist() == pytest.approx([0.0, np.sqrt((0.0625 + 480) / 3840)])
    assert cm.snr_db.tolist() == pytest.approx([SNR_CAP_DB, 10 * np.log10(960 / (0.0625 + 480))])


def test_non_contiguous_chunks_and_chunks_past_the_end():
    a = np.zeros(5 * 1920, np.float32)
    b = a.copy()
    b[np.arange(5) * 1920] = [0.1, 0.2, 0.3, 0.4, 0.5]
    fm = frame_metrics(a, b, with_mel=False)
    cm = reduce_frames(fm, np.array([[3, 4], [0, 2], [6, 9]]))
    assert cm.max_abs.tolist() == pytest.approx([0.4, 0.2, 0.0])
    assert cm.snr_db[2] == SNR_CAP_DB  # an empty chunk is no evidence of difference


def test_common_length_and_ragged_last_frame():
    a = np.ones(1920 + 700, np.float32)
    b = np.ones(1920 + 500, np.float32)
    fm = frame_metrics(a, b, with_mel=False)
    assert fm.n.tolist() == [1920, 500]
    assert fm.max_abs.tolist() == [0.0, 0.0]


def test_trailing_sample_belongs_to_last_frame():
    fm = frame_metrics(np.zeros(2 * 1920 + 1), np.zeros(2 * 1920 + 1), with_mel=False)
    assert fm.n.tolist() == [1920, 1921]


def test_empty_signals():
    fm = frame_metrics(np.zeros(0), np.zeros(0))
    assert len(fm.max_abs) == 0
    cm = reduce_frames(fm, chunk_frame_bounds(0))
    assert len(cm.max_abs) == 0


def test_mel_filterbank_shape_and_coverage():
    fb = mel_filterbank()
    assert fb.shape == (513, MEL_BANDS)
    assert np.all(fb >= 0) and np.all(fb <= 1)
    assert np.all(fb.max(axis=0) > 0.5)  # every band has a peak
    assert fb[-1].sum() < 1e-6  # the top edge, 12 kHz, closes the last band


def test_log_mel_locates_a_tone():
    t = np.arange(24000) / 24000
    x = np.sin(2 * np.pi * 1000 * t).astype(np.float32)
    m = log_mel(x)
    assert m.shape == (50, MEL_BANDS)  # 24000 / 480
    band = int(np.argmax(m[10]))
    fb = mel_filterbank()
    assert fb[int(1000 / 24000 * 1024), band] > 0.3


def test_logmel_distance_zero_for_equal_and_large_for_different():
    rng = np.random.default_rng(0)
    a = (0.3 * rng.standard_normal(4 * 1920)).astype(np.float32)
    fm = frame_metrics(a, a)
    assert fm.mel_l1.sum() == 0
    assert fm.mel_n.tolist() == [4 * MEL_BANDS] * 4
    t = np.arange(4 * 1920) / 24000
    b = (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    cm = reduce_frames(frame_metrics(a, b), chunk_frame_bounds(4))
    assert np.all(cm.logmel > 1.0)


def test_non_finite():
    assert non_finite(np.array([0.0, 1.0])) is None
    assert non_finite(np.array([0.0, np.nan, np.inf])) == 1


def test_cached_log_mels_give_the_same_metrics():
    rng = np.random.default_rng(1)
    a = (0.3 * rng.standard_normal(3 * 1920 + 1)).astype(np.float32)
    b = (a + 0.01 * rng.standard_normal(len(a))).astype(np.float32)
    plain = frame_metrics(a, b)
    cached = frame_metrics(a, b, mel_a=log_mel(a), mel_b=log_mel(b))
    assert np.array_equal(plain.mel_l1, cached.mel_l1)
    # Different lengths: the cache of the longer signal is not used, so still the same.
    short = b[:2 * 1920 + 500]
    assert np.array_equal(frame_metrics(a, short).mel_l1,
                          frame_metrics(a, short, mel_a=log_mel(a), mel_b=log_mel(short)).mel_l1)
