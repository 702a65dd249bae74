import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from difftest.compare.codes import diff_codes


def codes(n, seed=0):
    return np.random.default_rng(seed).integers(0, 2048, (n, 16))


def test_equal():
    a = codes(30)
    d = diff_codes(a, a.copy())
    assert d.equal and d.first_divergent_frame is None and d.frames_differing == 0
    assert d.chunk_agreement == [1.0, 1.0, 1.0]


def test_one_code_differs():
    a = codes(30)
    b = a.copy()
    b[7, 5] = (b[7, 5] + 1) % 2048
    d = diff_codes(a, b)
    assert d.first_divergent_frame == 7
    assert d.a_at_divergence == a[7].tolist() and d.b_at_divergence == b[7].tolist()
    assert d.frames_differing == 1
    assert d.codebooks_differing == [0] * 5 + [1] + [0] * 10
    assert d.chunk_agreement == [1.0, 24 / 25, 1.0]  # chunks [0,1) [1,26) [26,30)
    assert not d.length_only


def test_length_only():
    a = codes(30)
    d = diff_codes(a, a[:27])
    assert d.first_divergent_frame == 27 and d.length_only
    assert d.a_at_divergence == a[27].tolist() and d.b_at_divergence is None
    assert d.chunk_agreement == [1.0, 1.0, 0.25]


def test_empty_streams():
    d = diff_codes(np.zeros((0, 16)), np.zeros((0, 16)))
    assert d.equal and d.chunk_agreement == []
    d = diff_codes(np.zeros((0, 16)), codes(1))
    assert d.first_divergent_frame == 0 and d.length_only and d.chunk_agreement == [0.0]


@given(st.integers(0, 80), st.integers(0, 80), st.integers(0, 3))
def test_first_divergence_is_first(n, k, seed):
    a = codes(n, seed)
    b = a.copy()
    if k < n:
        b[k:, 0] += 1
    d = diff_codes(a, b)
    assert d.first_divergent_frame == (k if k < n else None)
    assert d.frames_differing == max(0, n - k)
