"""Segment jobs as vLLM-Omni offline prompts: what the speech API would have built, without HTTP.

`additional_information` mirrors vLLM-Omni 0.30's `_build_tts_params` for an
inline request (tts_adapters/qwen3_tts.py): every value a one-element list; the
reference audio as `[[samples, sample_rate]]` (what the server hands the model
after resolving a data URL: mono by the channel mean, at the file's own rate, which
the model resamples to 24 kHz) and its `ref_code_length` (ceil(seconds * 12.5)).
The placeholder prompt must have the exact length of the talker's prompt
embeddings, so its length comes from vLLM-Omni's own estimator (passed in).

Stage-0 sampling is per request in the API (`seed`, `max_new_tokens`,
`extra_params`) but shared by all prompts of one `Omni.generate` call, so
`sampling_key` groups a wave's segments by what must be shared.

No torch and no vLLM here: the tester's tests import this module.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from difftest.family import FAMILY, SAMPLE_RATE, SAMPLES_PER_FRAME
from difftest.suites import wavio

API_TASK = FAMILY.tasks
# 12.5 frames a second, exactly: vLLM-Omni computes a reference's code length from seconds
CODEC_FRAME_RATE = SAMPLE_RATE / SAMPLES_PER_FRAME


def ref_code_length(samples: int, sample_rate: int) -> int:
    return math.ceil(samples / sample_rate * CODEC_FRAME_RATE)


def read_voice(path: Path) -> tuple[np.ndarray, int]:
    """The voice as the speech API hands it to the model: decoded at the file's own rate (vLLM's
    `load_audio_soundfile` with sr=None), a stereo one mixed down by the channel mean as there
    (and again in `_finalize_fetched_ref_audio`), float32, and the file's rate passed along: the
    model resamples to 24 kHz itself (torchaudio), offline as served."""
    wav, info = wavio.read(Path(path).read_bytes())
    wav = np.asarray(wav, np.float32)
    if wav.ndim > 1:
        wav = wav.T  # (channels, n), as soundfile's read(...).T
        wav = np.mean(wav, axis=tuple(range(wav.ndim - 1)))
    return wav, int(info.sample_rate)


def additional_information(utt, voice: tuple[np.ndarray, int] | None = None) -> dict:
    """The model's per-request inputs for one `runners.reference.engine.Utterance`."""
    task = API_TASK[utt.task]
    info: dict = {"task_type": [task], "text": [utt.text], "language": [utt.language],
                  "instruct": [utt.instructions or ""], "max_new_tokens": [int(utt.decode["max_new_tokens"])]}
    if "non_streaming_mode" in utt.decode:
        info["non_streaming_mode"] = [bool(utt.decode["non_streaming_mode"])]
    elif task == "VoiceDesign":
        info["non_streaming_mode"] = [True]  # the API's fallback for VoiceDesign
    if utt.task == "custom_voice":
        info["speaker"] = [utt.speaker]
    elif utt.task == "voice_clone":
        if voice is None:
            raise ValueError("a voice_clone utterance needs its reference audio")
        samples, sr = voice
        info["ref_audio"] = [[samples.tolist(), sr]]
        info["ref_code_length"] = [ref_code_length(len(samples), sr)]
        info["x_vector_only_mode"] = [bool(utt.xvector_only)]
        if not utt.xvector_only:
            info["ref_text"] = [utt.transcript]
    return info


def prompt(info: dict, prompt_len: int) -> dict:
    return {"prompt_token_ids": [0] * int(prompt_len), "additional_information": info}


def sampling_key(decode: dict) -> tuple:
    """What stage 0's SamplingParams carry for this decode; equal keys can share one generate call.

    The sub-talker's settings are per engine (the deploy overlay), not per request."""
    if decode.get("do_sample"):
        sampling = (float(decode.get("temperature", 1.0)), int(decode.get("top_k", -1)),
                    float(decode.get("top_p", 1.0)))
    else:
        sampling = (0.0, -1, 1.0)  # greedy, as the HTTP runner asks with extra_params
    return (int(decode["seed"]), int(decode["max_new_tokens"]), float(decode.get("repetition_penalty", 1.0)),
            *sampling)


def sampling_fields(key: tuple) -> dict:
    seed, max_tokens, repetition_penalty, temperature, top_k, top_p = key
    return {"seed": seed, "max_tokens": max_tokens, "repetition_penalty": repetition_penalty,
            "temperature": temperature, "top_k": top_k, "top_p": top_p}
