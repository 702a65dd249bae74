"""vLLM-Omni's offline entry point, one `Omni` per checkpoint type, started on first use.

`Omni.generate(prompts, sampling_params_list)` runs a batch through both stages
(talker, Code2Wav) and answers each request with float32 audio: the waveform
before the speech API quantises it to 16 bits. An `Omni` that raised is closed
by vLLM-Omni itself (omni.py), so it is dropped here and the next batch starts
a fresh one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from runners.reference.checkpoint import Checkpoint
from runners.reference.environment import log

from .prompts import ref_code_length

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


@dataclass
class Answer:
    request_id: str
    wav: np.ndarray  # float32 mono
    sample_rate: int


class OmniPool:
    def __init__(self, checkpoints: dict[str, Checkpoint], deploy_config: str, stage_init_timeout: int):
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
            from vllm_omni import Omni

            t0 = time.perf_counter()
            self._omni[key] = Omni(model=key, deploy_config=self.deploy_config,
                                   stage_init_timeout=self.stage_init_timeout)
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

    def generate(self, task: str, prompts: list[dict], sampling: dict) -> list[Answer]:
        """One batch; answers in prompt order. Raises what vLLM-Omni raised (the engine is then dropped)."""
        omni = self.omni(task)
        defaults = omni.default_sampling_params_list
        talker = defaults[0].clone()
        for name, value in sampling.items():
            setattr(talker, name, value)
        try:
            outputs = omni.generate(prompts, [talker, *defaults[1:]], use_tqdm=False)
        except BaseException:
            self._omni.pop(str(self.checkpoints[task].path), None)
            raise
        by_index = {}
        for out in outputs:
            rid = str(out.request_id)
            mm = out.multimodal_output if getattr(out, "multimodal_output", None) else \
                out.request_output.outputs[0].multimodal_output
            audio = mm["audio"]
            if isinstance(audio, list):  # streamed chunks
                audio = np.concatenate([_np(a) for a in audio]) if audio else np.zeros(0, np.float32)
            sr = mm.get("sr", 24000)
            sr = sr[-1] if isinstance(sr, list) else sr
            # Omni names requests "<index in the batch>_<uuid>"
            by_index[int(rid.split("_", 1)[0])] = Answer(rid, _np(audio), int(sr.item() if hasattr(sr, "item") else sr))
        missing = [i for i in range(len(prompts)) if i not in by_index]
        if missing:
            raise RuntimeError(f"vLLM-Omni answered {len(by_index)} of {len(prompts)} requests (missing {missing})")
        return [by_index[i] for i in range(len(prompts))]

    def close(self) -> None:
        for omni in self._omni.values():
            try:
                omni.close()
            except Exception as e:  # shutting down: say it, go on
                log(f"closing vLLM-Omni: {type(e).__name__}: {e}")
        self._omni.clear()


def _np(t) -> np.ndarray:
    if hasattr(t, "detach"):
        t = t.detach().to("cpu").float().numpy()
    return np.asarray(t, np.float32).reshape(-1)
