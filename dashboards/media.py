"""The site's copies of a run's media: MLflow keeps each diverged segment's audio as float32 WAVs
(`audio/<segment>/<role>.wav`, 4 bytes a sample) and a spectrogram PNG; the site stores them smaller.

Audio (`difftest dashboard --audio`):
  opus  (default) lossy Opus listening copies at a 60 kbit/s target (OPUS_KBPS): the smallest site; the
        page says they are lossy, and each player links the float32 original in MLflow.
  flac  lossless FLAC (about 5.5x the size of the Opus site). 16-bit where the samples are 16-bit PCM
        already (exact); else 24-bit: FLAC holds integers, so the float32 samples are rounded to steps
        of 2^-23 (about 1.2e-7; error at most one step).
  wav   the float32 WAVs as MLflow has them.
A file whose peak is beyond full scale (a difference of two loud signals can reach 2) is stored at 1/2,
1/4, ... of its level (Opus and FLAC) and the page says so.
Either way a file that cannot be encoded (non-finite samples, a rate Opus lacks, not a WAV difftest
reads) is copied as it is. Identical samples under two roles of a segment (the candidate alone and at
concurrency N often agree) are stored once.

Spectrograms: a 256-colour palette PNG when no pixel moves by more than PALETTE_MAX_ERROR in any
channel (matplotlib's pictures have about 1,200 colours, nearly all in two colour maps: within 5/255),
else every colour kept (the smaller of a re-compressed copy and the original).
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import shutil
from pathlib import Path

import numpy as np

from difftest.suites import wavio

log = logging.getLogger(__name__)

AUDIO_FORMATS = ("opus", "flac", "wav")
DEFAULT_AUDIO = "opus"  # lossy listening copies; every player links MLflow's float32 original
# The Opus copies' target bitrate. libsndfile leaves libopus at its automatic rate (about 37-40 kbit/s
# here for 24 kHz mono), where libopus codes speech in its SILK or hybrid modes: 0.10-0.16 s to encode
# 3.12 s. From about 55 kbit/s (mono, OPUS_APPLICATION_AUDIO, libopus 1.4) it codes every frame in CELT
# alone: 0.05-0.06 s, and a log-mel distance to the original of 0.12-0.22 instead of 0.29-0.38; the files
# 1.6x the bytes (docs/dashboard.md has the measurements). 60 leaves a margin above the switch.
OPUS_KBPS = 60
STEP_24 = 2.0 ** -23  # the 24-bit quantisation step, as a fraction of full scale
PALETTE_MAX_ERROR = 8  # of 255, per channel: above it the picture keeps every colour


def _soundfile():
    import soundfile  # the mlflow extra's; imported here so that a site without audio needs none

    return soundfile


def _headroom(peak: float) -> int:
    """The power of two to divide by so that the samples fit a fixed-point file's full scale."""
    return 1 if peak <= 1.0 else 2 ** math.ceil(math.log2(peak))


def _is_pcm16(x: np.ndarray) -> bool:
    scaled = x.astype(np.float64) * 32768.0
    return bool(np.all(scaled == np.rint(scaled)) and scaled.min() >= -32768 and scaled.max() <= 32767)


def _flac(x: np.ndarray, rate: int, dst: Path, comment: str) -> dict:
    sf = _soundfile()
    peak = float(np.abs(x).max()) if x.size else 0.0
    if _is_pcm16(x):
        bits, scale, exact = 16, 1, True
        data = np.rint(x.astype(np.float64) * 32768.0).astype(np.int16)
    else:
        bits, scale = 24, _headroom(peak)
        ints = np.clip(np.rint(x.astype(np.float64) / scale / STEP_24), -2 ** 23, 2 ** 23 - 1).astype(np.int32)
        data = ints << 8  # libsndfile writes int32 data to a 24-bit file by its top 24 bits
        exact = bool(np.array_equal(ints * (STEP_24 * scale), x.astype(np.float64)))
    with sf.SoundFile(dst, "w", rate, x.shape[1] if x.ndim > 1 else 1, f"PCM_{bits}", format="FLAC") as f:
        note = "; ".join(x for x in (comment, f"stored at 1/{scale} of its level" if scale > 1 else "") if x)
        if note:  # libsndfile refuses an empty string
            f.comment = note
        f.write(data)
    return {"format": "flac", "bits": bits, "scale": scale, "peak": peak, "lossless": True, "exact": exact}


def _opus(x: np.ndarray, rate: int, dst: Path, comment: str) -> dict:
    sf = _soundfile()
    peak = float(np.abs(x).max()) if x.size else 0.0
    scale = _headroom(peak)
    channels = x.shape[1] if x.ndim > 1 else 1
    # libsndfile maps compression_level c to a target of ((1 - c) * 250 + 6) kbit/s per channel
    level = 1.0 - (OPUS_KBPS - 6) / 250
    with sf.SoundFile(dst, "w", rate, channels, "OPUS", format="OGG", compression_level=level) as f:
        note = "; ".join(x for x in (comment, "lossy", f"stored at 1/{scale} of its level" if scale > 1 else "") if x)
        f.comment = note
        f.write(np.clip(x / scale, -1.0, 1.0).astype(np.float32))
    return {"format": "opus", "bits": None, "scale": scale, "peak": peak, "lossless": False, "exact": False}


def audio_settings(fmt: str) -> str:
    """What a site's copies were made with, as fetched.json keeps it: a run stored otherwise is fetched
    and encoded again."""
    return f"opus {OPUS_KBPS} kbit/s" if fmt == "opus" else fmt


def store_audio(src: Path, dst_stem: Path, fmt: str, comment: str = "") -> dict:
    """Write `src` (a WAV from MLflow) as dst_stem.{flac,opus,wav}; what was written, for the page:
    file name, format, bits, scale (stored at 1/scale of its level), lossless, exact, seconds, bytes."""
    dst_stem.parent.mkdir(parents=True, exist_ok=True)
    try:
        x, info = wavio.read(src)
        seconds = info.n_frames / info.sample_rate
    except (OSError, wavio.WavError) as e:
        log.warning("%s: not a WAV the dashboard reads (%s): copied as it is", src, e)
        x, info, seconds = None, None, None
    meta = None
    if x is not None and fmt != "wav" and np.all(np.isfinite(x)):
        dst = dst_stem.with_suffix(f".{fmt}")
        try:
            meta = (_flac if fmt == "flac" else _opus)(x, info.sample_rate, dst, comment)
        except Exception as e:  # libsndfile refuses (e.g. a rate Opus has not): lossless FLAC then
            dst.unlink(missing_ok=True)
            if fmt == "opus":
                log.warning("%s: no Opus copy (%s): FLAC instead", src, e)
                return store_audio(src, dst_stem, "flac", comment)
            log.warning("%s: no FLAC copy (%s): copied as it is", src, e)
    if meta is None:
        dst = dst_stem.with_suffix(src.suffix or ".wav")
        shutil.copyfile(src, dst)
        meta = {"format": "wav", "bits": info.bits if info else None, "scale": 1, "peak": None,
                "lossless": True, "exact": True}
    return {**meta, "file": dst.name, "seconds": seconds, "bytes": dst.stat().st_size}


def samples_key(path: Path) -> str | None:
    """What two roles share when their samples are the same (rate and samples); None when unreadable."""
    try:
        x, info = wavio.read(path)
    except (OSError, wavio.WavError):
        return None
    return hashlib.sha256(f"{info.sample_rate}:{x.shape}".encode() + x.tobytes()).hexdigest()


def store_segment_audio(src_dir: Path, dst_dir: Path, fmt: str, roles, comment: str = "") -> dict:
    """A segment's `<role>.wav` files from src_dir into dst_dir, each role once per distinct samples:
    role -> store_audio()'s answer, with `same_as` naming the role whose file it shares."""
    out, first = {}, {}
    for role in roles:
        src = src_dir / f"{role}.wav"
        if not src.is_file():
            continue
        key = samples_key(src)
        if key is not None and key in first:
            out[role] = {**out[first[key]], "same_as": first[key]}
            continue
        out[role] = {**store_audio(src, dst_dir / role, fmt, f"{comment}/{role}.wav"), "same_as": None}
        if key is not None:
            first[key] = role
    return out


def store_picture(src: Path, dst: Path) -> dict:
    """A spectrogram PNG, with a 256-colour palette when that changes no pixel by more than
    PALETTE_MAX_ERROR per channel; else all its colours (whichever file is smaller). Copied as it is when
    Pillow cannot read it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        from PIL import Image  # matplotlib's dependency, so the mlflow extra's

        with Image.open(src) as im:
            opaque = "A" not in im.getbands() or im.getchannel("A").getextrema()[0] == 255
            rgb = im.convert("RGB")
    except Exception as e:  # not a picture Pillow reads: the site keeps the bytes
        log.warning("%s: not re-encoded (%s): copied as it is", src, e)
        opaque = False
    if not opaque:  # unreadable, or see-through (matplotlib's are not): kept as it is
        shutil.copyfile(src, dst)
        return {"palette": False, "max_error": 0}
    # MAXCOVERAGE spends the palette where the pixels are (the colour maps' cells), unlike an
    # octree, which merges the faint tints of the difference panel into white.
    pal = rgb.quantize(256, method=Image.Quantize.MAXCOVERAGE, dither=Image.Dither.NONE)
    err = int(np.abs(np.asarray(pal.convert("RGB"), np.int16) - np.asarray(rgb, np.int16)).max())
    buf = io.BytesIO()
    (pal if err <= PALETTE_MAX_ERROR else rgb).save(buf, "PNG")  # zlib's level 6: optimize saves 3% in 4x the time
    if len(buf.getvalue()) < src.stat().st_size:
        dst.write_bytes(buf.getvalue())
    else:
        shutil.copyfile(src, dst)
    return {"palette": err <= PALETTE_MAX_ERROR, "max_error": err if err <= PALETTE_MAX_ERROR else 0}
