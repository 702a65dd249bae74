"""transformers' Qwen3-Omni, one chat turn at a time: text in, the thinker's answer spoken by the talker.

`OmniEngine.synthesize` calls `Qwen3OmniMoeForConditionalGeneration.generate(..., return_audio=True)`
untouched, and reads what each stage handed on by shadowing three methods on the loaded instance
(never on the class, and never changing an argument or a return value, except the one test setting):
- `talker.generate`: the talker's stream (codebook 0 per step, the 16 codes of each frame);
- `talker.code_predictor.generate`: codebooks 1-15. transformers hard-codes
  `do_sample=True, top_k=50, top_p=0.8` there (modeling_qwen3_omni_moe.py, `Qwen3OmniMoeTalker.generate`),
  and no argument reaches it. With `subtalker_dosample: false` (a suite's default) the shadow
  forces greedy: the recorded test setting that makes both sides' codebooks 1-15 comparable exactly
  (vLLM-Omni's side: its code predictor's top_k=1);
- `code2wav.chunked_decode`: the codes the vocoder received and the waveform it returned.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from difftest.family import QWEN3_OMNI

THINKER_MAX_NEW_TOKENS = 8  # a suite's `thinker_max_new_tokens` when it names none


@dataclass
class Utterance:
    text: str
    speaker: str
    decode: dict


@dataclass
class Synthesis:
    codes: np.ndarray  # (F, 16): what code2wav received
    wav: np.ndarray  # float32, code2wav's output
    sample_rate: int
    prompt_ids: np.ndarray  # the chat turn as the thinker read it
    answer_ids: np.ndarray  # what the thinker handed the talker (its new tokens)
    talker_codes: np.ndarray  # (F, 16): the talker's own frames, before the hand-off to code2wav
    generate_kwargs: dict
    timings: dict = field(default_factory=dict)


def generate_kwargs(utt: Utterance) -> dict:
    """generate()'s arguments for one utterance (JSON-able: the result's provenance records them)."""
    d = utt.decode
    kw = {"speaker": utt.speaker, "thinker_max_new_tokens": int(d.get("thinker_max_new_tokens", THINKER_MAX_NEW_TOKENS)),
          "thinker_do_sample": False, "talker_max_new_tokens": int(d["max_new_tokens"]),
          "talker_do_sample": bool(d.get("do_sample", False)),
          "talker_repetition_penalty": float(d.get("repetition_penalty", 1.0))}
    if kw["talker_do_sample"]:
        kw.update(talker_temperature=float(d.get("temperature", 0.9)), talker_top_k=int(d.get("top_k", 50)),
                  talker_top_p=float(d.get("top_p", 1.0)))
    return kw


class OmniEngine:
    def __init__(self, path: str | Path, device: str = "cpu", dtype: str = "float32", threads: int = 1):
        self.path, self.device, self.dtype, self.threads = str(path), device, dtype, threads
        self._model = self._tok = None
        self._lock = threading.Lock()
        self._capture: dict = {}
        self._greedy_predictor = True

    def is_loaded(self) -> bool:
        return self._model is not None

    def load(self):
        with self._lock:
            if self._model is None:
                import torch
                from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

                torch.set_num_threads(self.threads)
                model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
                    self.path, dtype=getattr(torch, self.dtype)).to(self.device).eval()
                self._shadow(model)
                self._tok = AutoTokenizer.from_pretrained(self.path)
                self._model = model
        return self._model

    def _shadow(self, model) -> None:
        cap = self._capture
        talker_generate = model.talker.generate
        predictor_generate = model.talker.code_predictor.generate
        chunked_decode = model.code2wav.chunked_decode

        def talker(*a, **k):
            out = talker_generate(*a, **k)
            cap["talker"] = out
            return out

        def predictor(*a, **k):
            if self._greedy_predictor:
                k = {**k, "do_sample": False, "top_k": None, "top_p": None}
            return predictor_generate(*a, **k)

        def decode(codes, *a, **k):
            cap["codes"] = codes.detach().clone()
            wav = chunked_decode(codes, *a, **k)
            cap["wav"] = wav.detach().clone()
            return wav

        model.talker.generate = talker
        model.talker.code_predictor.generate = predictor
        model.code2wav.chunked_decode = decode

    def synthesize(self, utt: Utterance) -> Synthesis:
        import torch

        model = self.load()
        kw = generate_kwargs(utt)
        messages = [{"role": "user", "content": [{"type": "text", "text": utt.text}]}]
        enc = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True, return_tensors="pt")
        self._capture.clear()
        self._greedy_predictor = not utt.decode.get("subtalker_dosample", False)
        torch.manual_seed(int(utt.decode["seed"]))
        t0 = time.perf_counter()
        with torch.inference_mode():
            thinker, _ = model.generate(input_ids=enc["input_ids"].to(self.device),
                                        attention_mask=enc["attention_mask"].to(self.device), return_audio=True, **kw)
        seconds = time.perf_counter() - t0
        prompt = enc["input_ids"][0]
        steps = self._capture["talker"].hidden_states
        frames = [h[-1] for h in steps if h[-1] is not None]  # each (1, 16): a frame's codes
        talker_codes = torch.cat(frames, 0) if frames else torch.zeros((0, QWEN3_OMNI.codebooks), dtype=torch.long)
        return Synthesis(
            codes=self._capture["codes"][0].T.cpu().numpy().astype(np.int64),
            wav=self._capture["wav"].reshape(-1).float().cpu().numpy(),
            sample_rate=QWEN3_OMNI.sample_rate,
            prompt_ids=prompt.cpu().numpy().astype(np.int64),
            answer_ids=thinker.sequences[0, len(prompt):].cpu().numpy().astype(np.int64),
            talker_codes=talker_codes.cpu().numpy().astype(np.int64),
            generate_kwargs={**kw, "subtalker_greedy": self._greedy_predictor},
            timings={"generate_s": seconds},
        )

    def vocode(self, codes: np.ndarray) -> np.ndarray:
        """code2wav of (F, 16) codes as generate decodes them (chunked_decode's own windows)."""
        import torch

        model = self.load()
        with torch.inference_mode():
            wav = model.code2wav.chunked_decode(torch.as_tensor(codes.T[None], dtype=torch.long, device=self.device))
        return wav.reshape(-1).float().cpu().numpy()
