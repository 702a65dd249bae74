#!/usr/bin/env python3
"""Make the synthetic reference voices in cases/voices/.

Each voice is one sentence spoken by espeak-ng (a language/voice variant,
pitch -p and speed -s), shifted by sox (pitch in cents, tempo) and resampled
by sox to 24000 Hz. numpy then strips the silence espeak leaves around the
speech, peak-normalises to -3 dBFS and pads the speech with silence to the
exact length the table below asks for; the result is written as 16-bit PCM
mono WAV with its transcript beside it.

Some target lengths are exact multiples of 1920 samples (one codec frame at
24 kHz), the rest are multiples of neither 1920 nor 960: the reference's
frame alignment is one of the things the suites vary. The script asserts
both per voice.

Deterministic: sox runs with -R (repeatable) and -D (no dither) and writes
float samples; rounding to 16 bits happens here. Running it twice gives
byte-identical wavs.

    python3 cases/make_voices.py            # writes cases/voices/<id>.wav and <id>.txt

Needs espeak-ng and sox on PATH (Debian packages espeak-ng, sox) and numpy.

The voices at 16, 22.05, 44.1 and 48 kHz and in stereo (issue 62) are derived from these by
cases/make_resampled_voices.py, in integer arithmetic, without espeak-ng or sox.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RATE = 24000
FRAME = 1920  # samples per codec frame at 24 kHz
PEAK_DBFS = -3.0
LEAD_SILENCE = 2400  # 0.1 s of silence before the speech
MIN_SAMPLES, MAX_SAMPLES = int(1.5 * RATE), 4 * RATE
OUT_DIR = Path(__file__).resolve().parent / "voices"


@dataclass(frozen=True)
class VoiceSpec:
    id: str
    espeak: str  # espeak-ng voice, e.g. "en-us+f3" (language + variant)
    pitch: int  # espeak -p, 0..99
    speed: int  # espeak -s, words per minute
    cents: int  # sox pitch shift in cents (0: none)
    tempo: float  # sox tempo factor (1.0: none)
    target: int  # exact length in samples
    multiple: bool  # target is meant to be a multiple of FRAME
    text: str  # the sentence spoken, also the transcript


# fmt: off
VOICES = [
    #         id       espeak           -p   -s  cents tempo  target  k*1920?  text
    VoiceSpec("alba",  "en-us+f3",      60, 165,    0, 1.00, 32 * FRAME, True,
              "The morning train was late again today."),
    VoiceSpec("bruno", "de+m3",         35, 150, -200, 1.00,    64700, False,
              "Der Zug kommt heute etwas später an."),
    VoiceSpec("chloe", "fr-fr+f2",      70, 160,  150, 1.00, 24 * FRAME, True,
              "Il fait très beau ce matin à Paris."),
    VoiceSpec("dario", "it+m5",         45, 155,    0, 0.95,    62300, False,
              "Oggi andiamo al mercato con gli amici."),
    VoiceSpec("elena", "es+f4",         65, 170,  100, 1.05, 28 * FRAME, True,
              "Mañana vamos a la playa con mi hermana."),
    VoiceSpec("fabio", "pt-br+m2",      40, 150, -100, 1.00,    66500, False,
              "O café da manhã está pronto na mesa."),
    VoiceSpec("greta", "en-gb+f5",      75, 175,    0, 1.00, 31 * FRAME, True,
              "Please close the garden gate before you leave."),
    VoiceSpec("hugo",  "en-us+m7",      30, 165, -300, 0.95,    78100, False,
              "A quiet river runs past the old mill by the road."),
    VoiceSpec("iris",  "en-gb-x-rp+f1", 55, 150,  200, 1.00,    80500, False,
              "She wrote the letter slowly, choosing every word."),
    VoiceSpec("jonas", "en-us+m1",      50, 175,    0, 1.10, 39 * FRAME, True,
              "Every evening the keeper climbs the stairs to light the lamp."),
    VoiceSpec("mei",   "cmn+f3",        60, 175,    0, 1.00,    69700, False,
              "今天天气很好。"),
]
# fmt: on


def run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def synthesise(spec: VoiceSpec, tmp: Path) -> np.ndarray:
    """espeak-ng at 22050 Hz -> sox shifts and resamples -> float32 at RATE."""
    raw_wav, f32 = tmp / f"{spec.id}.espeak.wav", tmp / f"{spec.id}.f32"
    run(["espeak-ng", "-v", spec.espeak, "-p", str(spec.pitch), "-s", str(spec.speed),
         "-w", str(raw_wav), "--", spec.text])
    effects = []
    if spec.cents:
        effects += ["pitch", str(spec.cents)]
    if spec.tempo != 1.0:
        effects += ["tempo", "-s", f"{spec.tempo:.2f}"]
    effects += ["rate", "-v", str(RATE)]
    run(["sox", "-R", "-D", str(raw_wav),
         "-t", "raw", "-e", "floating-point", "-b", "32", "-c", "1", str(f32), *effects])
    return np.fromfile(f32, dtype="<f4").astype(np.float64)


def shape(spec: VoiceSpec, x: np.ndarray) -> np.ndarray:
    """Strip silence, peak-normalise, pad to exactly spec.target samples."""
    loud = np.flatnonzero(np.abs(x) > 0.01 * np.abs(x).max())
    speech = x[loud[0] : loud[-1] + 1]
    speech = speech * (10 ** (PEAK_DBFS / 20) / np.abs(speech).max())
    need = LEAD_SILENCE + len(speech)
    assert need <= spec.target, (
        f"{spec.id}: speech needs {need} samples, target is {spec.target}: raise the target or shorten the text")
    out = np.zeros(spec.target)
    out[LEAD_SILENCE : need] = speech
    return out


def check(spec: VoiceSpec, pcm: np.ndarray) -> None:
    n = len(pcm)
    assert n == spec.target, f"{spec.id}: {n} samples, wanted {spec.target}"
    assert MIN_SAMPLES <= n <= MAX_SAMPLES, f"{spec.id}: {n / RATE:.2f} s is outside 1.5-4 s"
    if spec.multiple:
        assert n % FRAME == 0, f"{spec.id}: {n} is not a multiple of {FRAME}"
    else:
        assert n % FRAME and n % (FRAME // 2), f"{spec.id}: {n} must be a multiple of neither {FRAME} nor {FRAME // 2}"


def write_wav(path: Path, pcm: np.ndarray) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.astype("<i2").tobytes())


def main() -> int:
    assert len({v.id for v in VOICES}) == len(VOICES), "duplicate voice id"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        for spec in VOICES:
            audio = shape(spec, synthesise(spec, Path(td)))
            pcm = np.clip(np.round(audio * 32767), -32768, 32767).astype(np.int16)
            check(spec, pcm)
            write_wav(OUT_DIR / f"{spec.id}.wav", pcm)
            (OUT_DIR / f"{spec.id}.txt").write_text(spec.text + "\n", encoding="utf-8")
            n = len(pcm)
            print(f"{spec.id:6} {n:6d} samples  {n / RATE:.3f} s  "
                  f"multiple of {FRAME}: {'yes' if n % FRAME == 0 else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
