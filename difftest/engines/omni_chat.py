"""Qwen3-Omni through vLLM-Omni: a segment as a chat completion with audio output, the answer's audio,
and the deploy overlay that serves it on this CPU (issue 60).

What vLLM-Omni 0.30.0 does with a chat request (measured on this CPU against the tiny build; the
helper's report, docs/qwen3-omni.md):
- the speaker is the body's `speaker` (or `voice`): `serving_chat.py` puts it in the request's
  additional information, and the talker's prefill reads it per request;
- the request's own OpenAI fields reach the thinker only; each stage's sampling is
  `sampling_params_list`, one dict per stage in order (thinker, talker, code2wav). A listed stage's
  dict replaces its deploy defaults whole, so every setting is sent; a stage left off gets the
  deploy's. `logit_bias` there is never sent: its JSON keys are strings, and the talker's engine core
  dies decoding them, after which every request hangs while /health still answers 200;
- the answer's one choice carries the audio as base64 WAV (`message.audio.data`), 16-bit PCM.
"""

from __future__ import annotations

import base64
import binascii
import json

from ..errors import BadInput
from ..family import QWEN3_OMNI
from ..suites.suite import Segment

THINKER_MAX_NEW_TOKENS = 8  # a segment that names none (runners/reference_omni/engine.py says the same)
GREEDY_ENV = "DIFFTEST_OMNI_SUBTALKER_GREEDY"  # the capture plugin's opt-in (difftest_capture/omni_greedy.py)


def chat_body(segment: Segment, tag: str | None = None, model: str | None = None) -> dict:
    """The JSON body for one segment: its text as the user's turn, its speaker, and every stage's
    sampling; `tag` rides in the talker's extra_args, where the capture plugin reads it."""
    d = segment.decode
    if d.get("do_sample"):
        raise BadInput(f"segment {segment.id}: a sampled Qwen3-Omni talker cannot be compared exactly "
                       f"(its code predictor's draws are not the reference's); set do_sample: false")
    thinker = {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "seed": int(d["seed"]),
               "max_tokens": int(d.get("thinker_max_new_tokens", THINKER_MAX_NEW_TOKENS))}
    talker = {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "seed": int(d["seed"]),
              "max_tokens": int(d["max_new_tokens"]), "repetition_penalty": float(d["repetition_penalty"]),
              "stop_token_ids": [QWEN3_OMNI.stop_id], "detokenize": False,
              **({"extra_args": {"difftest_tag": tag}} if tag else {})}
    body = {"messages": [{"role": "user", "content": segment.text}], "modalities": ["text", "audio"],
            "speaker": segment.speaker, "sampling_params_list": [thinker, talker]}
    if model:
        body["model"] = model
    return body


def answer_bound(body: dict) -> int:
    """The most bytes a chat answer to `body` may hold: 16-bit samples of the talker's max_tokens frames,
    base64 (4/3), and room for the JSON around them and the thinker's text."""
    frames = int(body["sampling_params_list"][1]["max_tokens"])
    return frames * QWEN3_OMNI.samples_per_frame * 2 * 4 // 3 + (1 << 16)


def answer_wav(data: bytes) -> bytes:
    """The WAV bytes of a chat completion's audio; ValueError saying what is missing."""
    try:
        answer = json.loads(data)
        audio = next(c["message"]["audio"] for c in answer["choices"] if (c.get("message") or {}).get("audio"))
        return base64.b64decode(audio["data"], validate=True)
    except (ValueError, KeyError, TypeError, StopIteration, binascii.Error) as e:
        raise ValueError(f"no audio in the chat completion ({type(e).__name__}: {str(e)[:200]})") from None


def deploy_overlay(base_config: str, *, max_num_seqs: int, async_chunk: bool, dtype: str = "float32",
                   max_tokens: int = 2048, threads_bind: str = "nobind", omp_threads: int | None = 1) -> dict:
    """The release's qwen3_omni_moe.yaml made to serve the tiny build on the CPU, each key measured:
    - every stage on device "0": the release puts talker and code2wav on "1", which the CPU platform
      reads as a memory node and a one-node host filters away (IndexError in vLLM's CPU worker);
    - moe_backend auto on thinker and talker: the release's triton has no CPU kernel (vLLM then picks
      its CPU experts);
    - eager, v1 runner, uni executor, explicit KV bytes, async scheduling off: as for Qwen3-TTS
      (docs/vllm-omni.md);
    - the talker greedy by default (its sub-talker: GREEDY_ENV in the server's environment, read by the
      capture plugin in every stage process);
    - code2wav in the reference's dtype (`dtype`); thinker and talker in bf16, production's: the talker
      runs nothing else (it casts its inputs to bf16: float32 dies at the first request), and a float32
      thinker's streamed hidden states kill it with async_chunk ("mat1 and mat2 must have the same
      dtype, but got Float and BFloat16", measured)."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": threads_bind, **({"OMP_NUM_THREADS": str(omp_threads)} if omp_threads else {})}
    common = {"devices": "0", "max_num_seqs": max_num_seqs, "enforce_eager": True, "async_scheduling": False}
    thinker = {"stage_id": 0, **common, "dtype": "bfloat16", "moe_backend": "auto", "max_model_len": 2048, "max_num_batched_tokens": 512,
               "kv_cache_memory_bytes": 64 << 20, "env": dict(env)}
    talker = {"stage_id": 1, **common, "dtype": "bfloat16", "moe_backend": "auto", "max_model_len": 2048, "max_num_batched_tokens": 512,
              "kv_cache_memory_bytes": 64 << 20, "env": dict(env),
              "default_sampling_params": {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "max_tokens": max_tokens,
                                          "repetition_penalty": 1.0}}
    code2wav = {"stage_id": 2, **common, "dtype": dtype, "max_model_len": 16384,
                "max_num_batched_tokens": 16384, "kv_cache_memory_bytes": 32 << 20, "env": dict(env)}
    return {"base_config": str(base_config), "async_chunk": bool(async_chunk), "model_runner": "v1",
            "distributed_executor_backend": "uni", "stages": [thinker, talker, code2wav]}
