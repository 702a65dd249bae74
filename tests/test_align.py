"""Frames, samples and chunks: hand-computed cases and properties."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from difftest.compare.align import chunk_frame_bounds, chunk_of_frame, frame_sample_bounds, frames_for_samples


def test_hand_cases():
    assert frames_for_samples(0) == 0
    assert frames_for_samples(1) == 1
    assert frames_for_samples(1920) == 1
    assert frames_for_samples(1921) == 1  # qwen-tts's one trailing sample
    assert frames_for_samples(1922) == 2
    assert frames_for_samples(23 * 1920 + 1) == 23
    assert chunk_frame_bounds(0).shape == (0, 2)
    assert chunk_frame_bounds(1).tolist() == [[0, 1]]
    assert chunk_frame_bounds(27).tolist() == [[0, 1], [1, 26], [26, 27]]
    assert chunk_frame_bounds(26).tolist() == [[0, 1], [1, 26]]
    assert chunk_frame_bounds(10, 4, 3).tolist() == [[0, 4], [4, 7], [7, 10]]
    assert frame_sample_bounds(3841).tolist() == [[0, 1920], [1920, 3841]]
    assert frame_sample_bounds(4000).tolist() == [[0, 1920], [1920, 3840], [3840, 4000]]
    b = chunk_frame_bounds(60)
    assert [chunk_of_frame(f, b) for f in (None, 0, 1, 25, 26, 59, 60)] == [None, 0, 1, 1, 2, 3, 4]


@given(st.integers(0, 5000), st.integers(1, 30), st.integers(1, 30))
def test_chunks_tile_the_frames(n, first, size):
    b = chunk_frame_bounds(n, first, size)
    if n == 0:
        assert len(b) == 0
        return
    assert b[0, 0] == 0 and b[-1, 1] == n
    assert np.all(b[1:, 0] == b[:-1, 1])
    assert np.all(b[:, 1] > b[:, 0])
    assert b[0, 1] - b[0, 0] == min(first, n)
    assert np.all(b[1:-1, 1] - b[1:-1, 0] == size)
    for f in {0, n - 1, n // 2}:
        c = chunk_of_frame(f, b)
        assert b[c, 0] <= f < b[c, 1]


@given(st.integers(0, 200_000))
def test_frames_tile_the_samples(n):
    fb = frame_sample_bounds(n)
    if n == 0:
        assert len(fb) == 0
        return
    assert fb[0, 0] == 0 and fb[-1, 1] == n
    assert np.all(fb[1:, 0] == fb[:-1, 1])
    assert np.all(fb[:-1, 1] - fb[:-1, 0] == 1920)
    last = fb[-1, 1] - fb[-1, 0]
    assert 1 <= last <= 1921
