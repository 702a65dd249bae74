"""The one rule for a reference voice's WAV, applied wherever one enters: a suite (difftest), the
reference runner, the CPU test engine's speech API.

PCM of 16 bits or more, mono or stereo, 8 to 48 kHz, not empty, at most a minute. A voice is sent
as it was uploaded, its bytes unchanged: difftest neither resamples nor mixes it down. A reference
at another rate than the model's 24 kHz, or in stereo, is what users upload, and each engine
resamples and mixes it down its own way (qwen-tts: librosa's soxr_hq and a channel mean; vLLM-Omni:
torchaudio and a channel mean; docs/verdicts.md, "References at other sample rates"): a difference
there is a difference users hear, which cases/suites/resampled.yaml tests. 8-bit PCM is refused (it
is unsigned and coarse, and libsndfile and difftest's reader disagree on it), and so are more than
two channels and rates outside 8-48 kHz: nothing users upload as a voice, and nothing the suites
test.
"""

from __future__ import annotations

from ..family import SAMPLE_RATE, SAMPLES_PER_FRAME  # SAMPLE_RATE: where both engines resample a voice to
from . import wavio

MIN_BITS = 16
MAX_SECONDS = 60.0
MAX_CHANNELS = 2
MIN_RATE, MAX_RATE = 8000, 48000


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
    if info.channels > MAX_CHANNELS:
        raise VoiceError(f"has {info.channels} channels; a reference voice is mono or stereo")
    if not MIN_RATE <= info.sample_rate <= MAX_RATE:
        raise VoiceError(f"is {info.sample_rate} Hz; a reference voice is {MIN_RATE}-{MAX_RATE} Hz "
                         f"(the model's is {SAMPLE_RATE})")
    if info.n_frames == 0:
        raise VoiceError("holds no samples")
    if info.n_frames > MAX_SECONDS * info.sample_rate:
        raise VoiceError(f"lasts {info.n_frames / info.sample_rate:.1f} s; a reference voice may last at most "
                         f"{MAX_SECONDS:.0f} s")
    return info


def samples_at_model_rate(n_frames: int, sample_rate: int) -> int:
    """A voice's length once resampled to the model's 24 kHz: ceil(n * 24000 / rate), what both
    engines' resamplers give (librosa's soxr_hq in qwen-tts, torchaudio in vLLM-Omni). `n_frames`
    is its length at its own rate (frames: a stereo voice's sample pairs count once)."""
    return -(-int(n_frames) * SAMPLE_RATE // int(sample_rate))


def reference_frames(n_frames: int, sample_rate: int) -> int:
    """The codec frames of a voice's reference codes: its 24 kHz length in 1920-sample frames, ceil."""
    return -(-samples_at_model_rate(n_frames, sample_rate) // SAMPLES_PER_FRAME)
