"""Minimal RIFF/WAVE reading and writing, numpy only.

The stdlib `wave` module cannot read float WAVs and says little about what is
wrong with a file; difftest needs to name the problem (non-PCM, stereo,
truncated) and to know whether audio was quantised.
"""

from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_PCM = 1
FORMAT_FLOAT = 3
FORMAT_EXTENSIBLE = 0xFFFE


class WavError(ValueError):
    """The bytes are not a WAV file difftest can read; the message says why."""


@dataclass(frozen=True)
class WavInfo:
    sample_rate: int
    channels: int
    bits: int
    format: str  # "pcm" or "float"
    n_frames: int


def _parse(data: bytes) -> tuple[WavInfo, bytes]:
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise WavError("not a RIFF/WAVE file")
    pos, fmt, payload = 12, None, None
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        body = data[pos + 8 : pos + 8 + size]
        if cid == b"fmt ":
            if len(body) < 16:
                raise WavError("fmt chunk is truncated")
            tag, ch, sr, _, _, bits = struct.unpack("<HHIIHH", body[:16])
            if tag == FORMAT_EXTENSIBLE and len(body) >= 26:
                tag = struct.unpack("<H", body[24:26])[0]
            fmt = (tag, ch, sr, bits)
        elif cid == b"data":
            # Streaming writers put 0 or 0xFFFFFFFF here; anything else that
            # overruns the file means the file was cut short.
            if size in (0, 0xFFFFFFFF):
                body = data[pos + 8 :]
            elif len(body) < size:
                raise WavError(f"data chunk is truncated: header says {size} bytes, file has {len(body)}")
            payload = body
            break
        pos += 8 + size + (size & 1)
    if fmt is None:
        raise WavError("no fmt chunk")
    if payload is None:
        raise WavError("no data chunk")
    tag, ch, sr, bits = fmt
    if tag == FORMAT_PCM and bits in (8, 16, 24, 32):
        kind = "pcm"
    elif tag == FORMAT_FLOAT and bits in (32, 64):
        kind = "float"
    else:
        raise WavError(f"unsupported encoding (format tag {tag}, {bits} bits)")
    if ch < 1 or sr < 1:
        raise WavError(f"invalid header: {ch} channels at {sr} Hz")
    block = ch * bits // 8
    if len(payload) % block:
        raise WavError(f"data chunk holds {len(payload)} bytes, not a whole number of {block}-byte frames")
    return WavInfo(sr, ch, bits, kind, len(payload) // block), payload


def info(path_or_bytes: str | os.PathLike | bytes) -> WavInfo:
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    return _parse(data)[0]


def head(data: bytes, n_frames: int) -> bytes:
    """The first n_frames frames of a WAV, their bytes unchanged (no decode and re-encode: a 16-bit
    recording cut stays the same samples), under a plain fmt/data header."""
    wi, payload = _parse(data)
    block = wi.channels * wi.bits // 8
    body = payload[: max(n_frames, 0) * block]
    tag = FORMAT_FLOAT if wi.format == "float" else FORMAT_PCM
    return (b"RIFF" + struct.pack("<I", 36 + len(body)) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, tag, wi.channels, wi.sample_rate, wi.sample_rate * block, block,
                                    wi.bits)
            + b"data" + struct.pack("<I", len(body)) + body)


def read(path_or_bytes: str | os.PathLike | bytes) -> tuple[np.ndarray, WavInfo]:
    """Samples as float32 in [-1, 1), shape (n,) for mono or (n, channels)."""
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    wi, payload = _parse(data)
    if wi.format == "float":
        x = np.frombuffer(payload, dtype="<f4" if wi.bits == 32 else "<f8").astype(np.float32)
    elif wi.bits == 8:
        x = (np.frombuffer(payload, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif wi.bits == 16:
        x = np.frombuffer(payload, dtype="<i2").astype(np.float32) / 32768.0
    elif wi.bits == 24:
        b = np.frombuffer(payload, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    else:
        x = np.frombuffer(payload, dtype="<i4").astype(np.float64) / float(1 << 31)
        x = x.astype(np.float32)
    if wi.channels > 1:
        x = x.reshape(-1, wi.channels)
    return x, wi


def pcm16(x: np.ndarray) -> np.ndarray:
    """Float audio to 16-bit integers the way libsndfile does it (scale 32767, round)."""
    return np.clip(np.rint(np.asarray(x, dtype=np.float64) * 32767.0), -32768, 32767).astype("<i2")


def encode(x: np.ndarray, sample_rate: int, subtype: str = "float") -> bytes:
    """A mono WAV as bytes; subtype "float" (32-bit float) or "pcm16"."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if subtype == "float":
        payload, tag, bits = x.astype("<f4").tobytes(), FORMAT_FLOAT, 32
    elif subtype == "pcm16":
        payload, tag, bits = pcm16(x).tobytes(), FORMAT_PCM, 16
    else:
        raise ValueError(f"unknown subtype {subtype!r}")
    block = bits // 8
    buf = io.BytesIO()
    buf.write(b"RIFF" + struct.pack("<I", 36 + len(payload)) + b"WAVE")
    buf.write(b"fmt " + struct.pack("<IHHIIHH", 16, tag, 1, sample_rate, sample_rate * block, block, bits))
    buf.write(b"data" + struct.pack("<I", len(payload)) + payload)
    return buf.getvalue()


def write(path: str | os.PathLike, x: np.ndarray, sample_rate: int, subtype: str = "float") -> None:
    Path(path).write_bytes(encode(x, sample_rate, subtype))
