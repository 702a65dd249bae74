"""vLLM-Omni's offline entry points, one engine per checkpoint type, started on first use.

- api "batch": `Omni.generate(prompts, sampling_params_list)`, the synchronous
  offline API, runs a batch through both stages (talker, Code2Wav). One
  `SamplingParams` per stage serves every prompt of the call.
- api "async": `AsyncOmni.generate(prompt, request_id=..., sampling_params_list=...)`
  per request, all of a batch submitted together on one event loop: each request
  has its own sampling settings, so a batch is never split (the engine the speech
  API drives, without HTTP).

Either answers each request with float32 audio: the waveform before the speech
API quantises it to 16 bits. An engine that raised is dropped (vLLM-Omni's `Omni`
closes itself on an error) and the next batch starts a fresh one.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass

import numpy as np

from difftest.family import SAMPLE_RATE
from runners.reference.checkpoint import Checkpoint
from runners.reference.environment import log
from runners.vllm_omni_offline.prompts import ref_code_length

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


@dataclass
class Answer:
    request_id: str
    wav: np.ndarray  # float32 mono
    sample_rate: int


APIS = ("batch", "async")


class OmniPool:
    def __init__(self, checkpoints: dict[str, Checkpoint], deploy_config: str, stage_init_timeout: int,
                 api: str = "batch"):
        if api not in APIS:
            raise ValueError(f"api {api!r}: expected one of {', '.join(APIS)}")
        self.api = api
        self._loop = asyncio.new_event_loop() if api == "async" else None
        self.checkpoints = checkpoints  # task -> checkpoint
        self.deploy_config = deploy_config
        self.stage_init_timeout = stage_init_timeout
        self._omni: dict[str, object] = {}  # checkpoint path -> Omni
        self._estimators: dict[str, object] = {}
        self.start_seconds: dict[str, float] = {}

    def is_started(self, task: str) -> bool:
        return str(self.checkpoints[task].path) in self._omni

    def omni(self, task: str):
        key = str(self.checkpoints[task].path)
        if key not in self._omni:
            t0 = time.perf_counter()
            kwargs = {"model": key, "deploy_config": self.deploy_config, "stage_init_timeout": self.stage_init_timeout}
            if self.api == "batch":
                from vllm_omni import Omni

                self._omni[key] = Omni(**kwargs)
            else:
                from vllm_omni import AsyncOmni

                async def start():
                    return AsyncOmni(**kwargs)

                self._omni[key] = self._loop.run_until_complete(start())
            self.start_seconds[self.checkpoints[task].model_type] = round(time.perf_counter() - t0, 2)
            log(f"vLLM-Omni offline engine for {key} started in {time.perf_counter() - t0:.1f} s")
        return self._omni[key]

    def prompt_len(self, task: str, info: dict) -> int:
        """vLLM-Omni's own estimate of the talker prompt's length (what the speech API uses)."""
        key = str(self.checkpoints[task].path)
        if key not in self._estimators:
            from transformers import AutoTokenizer
            from vllm_omni.model_executor.models.qwen3_tts.configuration_qwen3_tts import Qwen3TTSConfig

            tok = AutoTokenizer.from_pretrained(key, trust_remote_code=True, padding_side="left")
            talker = getattr(Qwen3TTSConfig.from_pretrained(key, trust_remote_code=True), "talker_config", None)
            self._estimators[key] = (tok, talker)
        tok, talker = self._estimators[key]
        from vllm_omni.model_executor.models.qwen3_tts.prompt_embeds_builder import Qwen3TTSPromptEmbedsBuilder

        def ref_len(ref_audio):
            samples, sr = ref_audio[0]
            return ref_code_length(len(samples), sr)

        return Qwen3TTSPromptEmbedsBuilder.estimate_prompt_len_from_additional_information(
            additional_information=info, task_type=info["task_type"][0],
            tokenize_prompt=lambda t: tok(t, padding=False)["input_ids"],
            codec_language_id=getattr(talker, "codec_language_id", None),
            spk_is_dialect=getattr(talker, "spk_is_dialect", None), estimate_ref_code_len=ref_len)

    def generate(self, task: str, prompts: list[dict], sampling: list[dict]) -> list[Answer]:
        """One batch (`sampling`: each prompt's stage-0 settings; equal for api "batch"); answers in
        prompt order. Raises what vLLM-Omni raised (the engine is then dropped)."""
        omni = self.omni(task)
        defaults = omni.default_sampling_params_list

        def params(fields: dict) -> list:
            talker = defaults[0].clone()
            for name, value in fields.items():
                setattr(talker, name, value)
            return [talker, *defaults[1:]]

        if self.api == "batch" and any(f != sampling[0] for f in sampling):
            raise ValueError("Omni.generate shares its sampling settings across a batch")  # the caller's bug
        try:
            if self.api == "batch":
                outputs = omni.generate(prompts, params(sampling[0]), use_tqdm=False)
                # Omni names requests "<index in the batch>_<uuid>"
                by_index = {int(str(o.request_id).split("_", 1)[0]): o for o in outputs}
                ordered = [by_index.get(i) for i in range(len(prompts))]
            else:
                from difftest_capture import TAG_KEY, request_id_tag

                ids = [f"{i}_{uuid.uuid4()}" for i in range(len(prompts))]

                async def one(p, rid, fields):
                    sps = params(fields)
                    # the engine suffixes request ids inside; the tag travels as the server's does
                    sps[0].extra_args = {**(sps[0].extra_args or {}), TAG_KEY: request_id_tag(rid)}
                    last = None
                    async for out in omni.generate(p, request_id=rid, sampling_params_list=sps):
                        last = out
                    return last

                async def wave():
                    return await asyncio.gather(*(one(p, rid, f) for p, rid, f in zip(prompts, ids, sampling)))

                ordered = self._loop.run_until_complete(wave())
        except BaseException:
            self._drop(task)
            raise
        missing = [i for i, o in enumerate(ordered) if o is None]
        if missing:
            raise RuntimeError(f"vLLM-Omni answered {len(prompts) - len(missing)} of {len(prompts)} requests "
                               f"(missing {missing})")
        return [_answer(o) for o in ordered]

    def _drop(self, task: str) -> None:
        omni = self._omni.pop(str(self.checkpoints[task].path), None)
        if omni is not None and self.api == "async":
            try:
                omni.shutdown()
            except Exception as e:
                log(f"closing a failed AsyncOmni: {type(e).__name__}: {e}")

    def close(self) -> None:
        for omni in self._omni.values():
            try:
                omni.close() if self.api == "batch" else omni.shutdown()
            except Exception as e:  # shutting down: say it, go on
                log(f"closing vLLM-Omni: {type(e).__name__}: {e}")
        self._omni.clear()


def _answer(out) -> Answer:
    mm = out.multimodal_output if getattr(out, "multimodal_output", None) else \
        out.request_output.outputs[0].multimodal_output
    audio = mm["audio"]
    if isinstance(audio, list):  # streamed chunks
        audio = np.concatenate([_np(a) for a in audio]) if audio else np.zeros(0, np.float32)
    sr = mm.get("sr", SAMPLE_RATE)
    sr = sr[-1] if isinstance(sr, list) else sr
    return Answer(str(out.request_id), _np(audio), int(sr.item() if hasattr(sr, "item") else sr))


def _np(t) -> np.ndarray:
    if hasattr(t, "detach"):
        t = t.detach().to("cpu").float().numpy()
    return np.asarray(t, np.float32).reshape(-1)
