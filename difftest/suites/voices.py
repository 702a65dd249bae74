"""The one rule for a reference voice's WAV, applied wherever one enters: a suite (difftest), the
reference runner, the CPU test engine's speech API.

24 kHz mono PCM of 16 bits or more, not empty, at most a minute: anything else the two engines would
resample, mix down or hear differently (8-bit PCM is unsigned and coarse), and the difference would
read as a divergence that is no serving bug.
"""

from __future__ import annotations

from . import wavio

SAMPLE_RATE = 24000
MIN_BITS = 16
MAX_SECONDS = 60.0


class VoiceError(ValueError):
    """The bytes are no usable reference voice; the message says why (without naming the file)."""


def check_voice(data: bytes) -> wavio.WavInfo:
    """The voice's WAV header, checked against the rule; VoiceError otherwise."""
    if not data:
        raise VoiceError("is empty")
    try:
        info = wavio.info(data)
    except wavio.WavError as e:
        raise VoiceError(f"not a usable WAV file ({e})") from None
    if info.format != "pcm":
        raise VoiceError(f"is {info.bits}-bit {info.format}, not PCM")
    if info.bits < MIN_BITS:
        raise VoiceError(f"is {info.bits}-bit; use 16-bit PCM or better")
    if info.channels != 1:
        raise VoiceError(f"has {info.channels} channels, must be mono")
    if info.sample_rate != SAMPLE_RATE:
        raise VoiceError(f"is {info.sample_rate} Hz; resample it to {SAMPLE_RATE} Hz")
    if info.n_frames == 0:
        raise VoiceError("holds no samples")
    if info.n_frames > MAX_SECONDS * SAMPLE_RATE:
        raise VoiceError(f"lasts {info.n_frames / SAMPLE_RATE:.1f} s; a reference voice may last at most "
                         f"{MAX_SECONDS:.0f} s")
    return info
