#!/usr/bin/env python3
"""Make the reference voices at other sample rates, and in stereo, in cases/voices/.

Users upload references at 16, 22.05, 44.1 and 48 kHz, and in stereo; qwen-tts and vLLM-Omni
resample them to 24 kHz (and mix them down) themselves, each its own way (docs/verdicts.md,
"References at other sample rates"). These voices are how the suites send such uploads.

Each one is derived from a committed 24 kHz mono voice (cases/make_voices.py; espeak-ng and sox
are not needed here) by a deterministic band-limited resampling written out below, in integer
arithmetic so that every machine computes the same samples:

1. The source's 16-bit samples x[i] (24000 Hz) are resampled to `rate` by a polyphase
   windowed-sinc filter. With up/down = rate/24000 in lowest terms, output sample j lies at input
   time t = j * down / up, and y[j] = sum_m x[m] * h(t - m), where
   h(u) = fc * sinc(fc * u) * blackman(u / (ZEROS / fc)), fc = ROLLOFF * min(1, up / down)
   (the cutoff as a fraction of the lower Nyquist frequency), |u| < ZEROS / fc.
   Each of the `up` phases' taps is rounded to an integer in units of 2**-TAP_BITS (Python's
   math.sin/cos, then round()), and its largest tap takes the rounding residual so that every
   phase sums to exactly 2**TAP_BITS (a constant passes unchanged).
2. The sums are int64 (exact, in any order), rounded half up by (acc + 2**(TAP_BITS-1)) >>
   TAP_BITS and checked to fit 16 bits (no clipping).
3. The result is cut or padded with silence to the exact length the table asks for; a cut may
   only drop samples that are exactly 0 (the source's trailing silence), so no speech is lost.
4. A stereo voice's left channel is that signal; its right channel is the left delayed by
   STEREO_DELAY samples and scaled by 7/8 (r[i] = (7 * l[i - 3] + 4) >> 3): two slightly
   different channels, as a stereo microphone gives.
5. Written as 16-bit PCM WAV by the stdlib `wave` module (44-byte header), transcript beside it:
   the source voice's sentence.

Each voice's length is chosen for where it lands once resampled to 24 kHz: both engines make
ceil(n * 24000 / rate) samples of it (librosa's soxr_hq in qwen-tts, torchaudio in vLLM-Omni),
that is ceil(n * 24000 / rate / 1920) reference frames. "aligned" voices land on the 1920-sample
frame grid exactly, the others on a multiple of neither 1920 nor 960. The aligned ones avoid 28,
55 and 56 frames, the lengths at which vLLM-Omni's float ceil in `_estimate_ref_code_len` is one
frame long (docs/findings/prompt-len-float-ceil), so that finding cannot mix into these.

Deterministic: integer taps and integer sums; running it twice gives byte-identical wavs, and
tests/test_resampled_voices.py regenerates every voice and compares the bytes.

    python3 cases/make_resampled_voices.py           # writes cases/voices/<id>.wav and <id>.txt
    python3 cases/make_resampled_voices.py --check   # exit 1 if a committed voice differs

Needs numpy (and the committed 24 kHz voices) only.
"""

from __future__ import annotations

import io
import math
import sys
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SOURCE_RATE = 24000
FRAME = 1920  # samples per codec frame at 24 kHz
ZEROS = 16  # zero crossings of the sinc on each side of the centre tap
ROLLOFF = 0.95  # cutoff, a fraction of the lower of the two Nyquist frequencies
TAP_BITS = 22  # taps in units of 2**-22
STEREO_DELAY = 3  # samples the right channel lags the left
VOICES_DIR = Path(__file__).resolve().parent / "voices"


@dataclass(frozen=True)
class ResampledSpec:
    id: str
    source: str  # a 24 kHz mono voice in cases/voices/ (its .wav and .txt)
    rate: int  # Hz
    channels: int  # 1, or 2: left the resampled source, right a delayed and quieter copy
    target: int  # exact length in frames at `rate`
    aligned: bool  # once at 24 kHz, a whole number of 1920-sample frames

    @property
    def samples_24k(self) -> int:
        """Its length once resampled to 24 kHz (ceil, as librosa and torchaudio both do)."""
        return -(-self.target * SOURCE_RATE // self.rate)

    @property
    def ref_frames(self) -> int:
        return -(-self.samples_24k // FRAME)


# fmt: off
VOICES = [
    #               id                  source   rate   ch  target  aligned   -> 24 kHz samples, frames
    ResampledSpec("bruno-16k",         "bruno", 16000,  1,  40960, True),   # 61440 = 32 x 1920
    ResampledSpec("dario-22k",         "dario", 22050,  1,  57230, False),  # 62292, mod 1920 = 852 -> 33
    ResampledSpec("hugo-44k",          "hugo",  44100,  1, 137592, True),   # 74880 = 39 x 1920
    ResampledSpec("iris-44k",          "iris",  44100,  1, 142000, False),  # 77279, mod 1920 = 479 -> 41
    ResampledSpec("chloe-48k",         "chloe", 48000,  1,  93001, False),  # 46501, mod 1920 = 421 -> 25
    ResampledSpec("greta-48k-stereo",  "greta", 48000,  2, 115200, True),   # 57600 = 30 x 1920
    ResampledSpec("alba-24k-stereo",   "alba",  24000,  2,  58000, False),  # 58000, mod 1920 = 400 -> 31
]
# fmt: on


def read_source(name: str) -> np.ndarray:
    with wave.open(str(VOICES_DIR / f"{name}.wav"), "rb") as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SOURCE_RATE, 1, 2), (
            f"{name}.wav is not 24 kHz mono 16-bit")
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int64)


def taps(up: int, down: int) -> tuple[np.ndarray, int]:
    """Integer taps, shape (up, 2 * half): row p for output samples at input time i0 + p / up,
    column k weighting input sample i0 + k - half + 1; and half."""
    fc = ROLLOFF * min(1.0, up / down)
    width = ZEROS / fc  # half the window, in input samples
    half = math.ceil(width)
    unit = 1 << TAP_BITS
    rows = []
    for p in range(up):
        row = []
        for m in range(-half + 1, half + 1):
            u = p / up - m  # from input sample i0 + m to the output's position
            if abs(u) >= width:
                row.append(0)
                continue
            s = 1.0 if u == 0 else math.sin(math.pi * fc * u) / (math.pi * fc * u)
            a = math.pi * u / width
            blackman = 0.42 + 0.5 * math.cos(a) + 0.08 * math.cos(2 * a)
            row.append(round(fc * s * blackman * unit))
        centre = max(range(len(row)), key=lambda k: row[k])
        row[centre] += unit - sum(row)
        rows.append(row)
    return np.array(rows, dtype=np.int64), half


def resample(x: np.ndarray, rate: int, n_out: int) -> np.ndarray:
    """x (int64 16-bit samples at 24 kHz) at `rate`, n_out samples from time 0, as int64."""
    g = math.gcd(rate, SOURCE_RATE)
    up, down = rate // g, SOURCE_RATE // g
    if up == down:
        y = np.zeros(n_out, np.int64)
        y[: min(n_out, len(x))] = x[:n_out]
        return y
    h, half = taps(up, down)
    pos = np.arange(n_out, dtype=np.int64) * down
    i0, phase = pos // up, pos % up
    pad = half + 1
    xp = np.zeros(pad + max(len(x), int(i0[-1]) + 1) + pad, np.int64)
    xp[pad : pad + len(x)] = x
    acc = np.zeros(n_out, np.int64)
    for k, m in enumerate(range(-half + 1, half + 1)):
        acc += h[phase, k] * xp[i0 + m + pad]
    return (acc + (1 << (TAP_BITS - 1))) >> TAP_BITS


def build(spec: ResampledSpec) -> tuple[bytes, str]:
    """The voice's WAV bytes and its transcript."""
    x = read_source(spec.source)
    natural = -(-len(x) * spec.rate // SOURCE_RATE)
    y = resample(x, spec.rate, max(natural, spec.target))
    assert not y[spec.target :].any(), f"{spec.id}: a cut to {spec.target} frames would drop speech"
    y = y[: spec.target]
    assert y.min() >= -32768 and y.max() <= 32767, f"{spec.id}: resampling clipped ({y.min()}, {y.max()})"
    if spec.channels == 2:
        right = np.zeros_like(y)
        right[STEREO_DELAY:] = (7 * y[:-STEREO_DELAY] + 4) >> 3
        frames = np.stack([y, right], axis=1)
    else:
        frames = y
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(spec.channels)
        w.setsampwidth(2)
        w.setframerate(spec.rate)
        w.writeframes(frames.astype("<i2").tobytes())
    text = (VOICES_DIR / f"{spec.source}.txt").read_text(encoding="utf-8")
    return buf.getvalue(), text


def check(spec: ResampledSpec) -> None:
    n24 = spec.samples_24k
    if spec.aligned:
        assert n24 % FRAME == 0, f"{spec.id}: {n24} samples at 24 kHz is not a multiple of {FRAME}"
        assert spec.ref_frames not in (28, 55, 56), f"{spec.id}: {spec.ref_frames} frames meets the float-ceil finding"
    else:
        assert n24 % FRAME and n24 % (FRAME // 2), (
            f"{spec.id}: {n24} must be a multiple of neither {FRAME} nor {FRAME // 2}")
    assert 1.5 <= spec.target / spec.rate <= 4.0, f"{spec.id}: {spec.target / spec.rate:.2f} s is outside 1.5-4 s"


def main(argv: list[str]) -> int:
    check_only = argv[1:] == ["--check"]
    assert len({v.id for v in VOICES}) == len(VOICES), "duplicate voice id"
    stale = []
    for spec in VOICES:
        check(spec)
        data, text = build(spec)
        wav, txt = VOICES_DIR / f"{spec.id}.wav", VOICES_DIR / f"{spec.id}.txt"
        if check_only:
            if not wav.is_file() or wav.read_bytes() != data or txt.read_text(encoding="utf-8") != text:
                stale.append(spec.id)
            continue
        wav.write_bytes(data)
        txt.write_text(text, encoding="utf-8")
        print(f"{spec.id:17} {spec.rate:5d} Hz {spec.channels} ch {spec.target:6d} frames "
              f"{spec.target / spec.rate:.3f} s"
              f"  -> 24 kHz {spec.samples_24k:6d} samples, {spec.ref_frames} ref frames, "
              f"on the 1920 grid: {'yes' if spec.aligned else 'no'}")
    if stale:
        print(f"differs from the committed voice: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
