import struct

import numpy as np
import pytest

from difftest.suites import wavio


def test_pcm16_roundtrip_is_within_one_lsb():
    x = np.linspace(-0.9, 0.9, 1000, dtype=np.float32)
    y, info = wavio.read(wavio.encode(x, 24000, "pcm16"))
    assert (info.sample_rate, info.channels, info.bits, info.format, info.n_frames) == (24000, 1, 16, "pcm", 1000)
    assert np.max(np.abs(y - x)) <= 2 / 32768


def test_float_roundtrip_is_exact():
    x = np.random.default_rng(0).standard_normal(777).astype(np.float32) * 0.3
    y, info = wavio.read(wavio.encode(x, 16000))
    assert info.format == "float" and info.sample_rate == 16000
    assert np.array_equal(x, y)


def test_pcm16_scaling_matches_libsndfile():
    assert wavio.pcm16(np.array([1.0, -1.0, 0.5, 2.0])).tolist() == [32767, -32767, 16384, 32767]


def test_truncated_data_chunk_is_named():
    data = wavio.encode(np.zeros(100), 24000, "pcm16")
    with pytest.raises(wavio.WavError, match="truncated: header says 200 bytes, file has 150"):
        wavio.read(data[:-50])


def test_not_riff():
    with pytest.raises(wavio.WavError, match="not a RIFF/WAVE file"):
        wavio.read(b"ID3\x03" + b"\0" * 40)


def test_stereo_and_24_bit():
    frames = np.array([[1, -1], [256, -256]], dtype=np.int32)
    payload = b"".join(int(v & 0xFFFFFF).to_bytes(3, "little") for v in frames.reshape(-1))
    fmt = struct.pack("<IHHIIHH", 16, 1, 2, 24000, 24000 * 6, 6, 24)
    data = b"RIFF" + struct.pack("<I", 36 + len(payload)) + b"WAVE" + b"fmt " + fmt + b"data" + struct.pack("<I", len(payload)) + payload
    x, info = wavio.read(data)
    assert info.channels == 2 and info.bits == 24 and x.shape == (2, 2)
    assert x[1, 1] == pytest.approx(-256 / 2**23)


def test_odd_payload_is_rejected():
    data = bytearray(wavio.encode(np.zeros(4), 24000, "pcm16"))
    data[40:44] = struct.pack("<I", 7)
    with pytest.raises(wavio.WavError, match="not a whole number"):
        wavio.read(bytes(data[:44 + 7]))
