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
- `code2wav.chunked_decode`: the codes the vocoder received and the waveform it returned;
- `_get_talker_assistant_parts`: the speaker id the talker's prompt was built with (vLLM-Omni's
  model has the same method, where its capture reads the same; difftest.engines.capture.chat_turn_inputs).

`OmniEngine.score` teacher-forces a given code stream (runners/reference/scoring.py's statistics):
the talker's prompt is what `generate` builds from the thinker's answer (the shadowed
`talker.generate` records its arguments and stops there, so nothing of the prompt layout is
re-implemented); one causal forward of the talker over prompt + the stream's frames gives every
codebook-0 distribution, one batched forward of the code predictor every codebook 1-15's.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from difftest.engines.capture import chat_turn_inputs
from difftest.family import QWEN3_OMNI

THINKER_MAX_NEW_TOKENS = 8  # a suite's `thinker_max_new_tokens` when it names none


# transformers hard-codes the code predictor's sampling in `Qwen3OmniMoeTalker.prepare_inputs_for_generation`
PREDICTOR_SAMPLING = {"subtalker_top_k": 50, "subtalker_top_p": 0.8, "subtalker_temperature": 1.0}


class Captured(Exception):
    """Raised by the shadowed `talker.generate` once it has recorded its arguments (scoring)."""

    def __init__(self, kwargs):
        super().__init__("talker prompt captured")
        self.kwargs = kwargs


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
    talker_inputs: dict  # what the talker's prompt was made of (capture.chat_turn_inputs)
    generate_kwargs: dict
    timings: dict = field(default_factory=dict)


def codec_prefill(talker_config) -> list[int]:
    """The codec ids the talker's assistant part opens with (both implementations' `_get_talker_assistant_parts`)."""
    return [int(talker_config.codec_nothink_id), int(talker_config.codec_think_bos_id),
            int(talker_config.codec_think_eos_id)]


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
        self._capture_prompt = False  # scoring: the shadowed talker.generate records its arguments and stops

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
        assistant_parts = model._get_talker_assistant_parts

        def talker(*a, **k):
            if self._capture_prompt:
                raise Captured(k)
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

        def assistant(im_start, end, speaker_id, *a, **k):
            cap["speaker_id"] = int(speaker_id)
            return assistant_parts(im_start, end, speaker_id, *a, **k)

        model._get_talker_assistant_parts = assistant
        model.talker.generate = talker
        model.talker.code_predictor.generate = predictor
        model.code2wav.chunked_decode = decode

    def _chat(self, utt: Utterance):
        """The utterance as the thinker reads it: its text as the user's turn, the assistant's to come."""
        messages = [{"role": "user", "content": [{"type": "text", "text": utt.text}]}]
        return self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True, return_tensors="pt")

    def _generate(self, utt: Utterance, enc, kw: dict):
        import torch

        self._capture.clear()
        self._greedy_predictor = not utt.decode.get("subtalker_dosample", False)
        torch.manual_seed(int(utt.decode["seed"]))
        with torch.inference_mode():
            return self._model.generate(input_ids=enc["input_ids"].to(self.device),
                                        attention_mask=enc["attention_mask"].to(self.device), return_audio=True,
                                        **kw)

    def synthesize(self, utt: Utterance) -> Synthesis:
        import torch

        self.load()
        kw = generate_kwargs(utt)
        enc = self._chat(utt)
        t0 = time.perf_counter()
        thinker, _ = self._generate(utt, enc, kw)
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
            talker_inputs=chat_turn_inputs(prompt.cpu().numpy(), codec_prefill(self._model.config.talker_config),
                                           self._capture["speaker_id"]),
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

    def talker_prompt(self, utt: Utterance) -> dict:
        """The talker's generate arguments for this utterance (prompt embeddings from the thinker's
        greedy answer, trailing text, pad embedding, sampling settings), without generating speech."""
        self.load()
        self._capture_prompt = True
        try:
            self._generate(utt, self._chat(utt), generate_kwargs(utt))
        except Captured as c:
            return c.kwargs
        finally:
            self._capture_prompt = False
        raise RuntimeError("transformers returned without calling the talker's generate: no prompt to score against")

    def score(self, utt: Utterance, codes: np.ndarray, ended_by_eos: bool):
        """transformers' view of `codes` (T, 16) for this utterance: runners/reference/scoring.py's
        Scores, the talker's settings as generate passed them, the code predictor's as forced
        (greedy: the test setting) or as transformers hard-codes them."""
        import torch

        from runners.reference import scoring

        kw = self.talker_prompt(utt)
        talker = self._model.talker
        predictor = talker.code_predictor
        cfg = talker.config
        n_groups = int(cfg.num_code_groups)
        codes = scoring.check_stream(codes, n_groups, int(cfg.text_config.vocab_size),
                                     int(cfg.code_predictor_config.vocab_size))
        T = codes.shape[0]
        prompt, ids = kw["inputs_embeds"], kw["talker_input_ids"]
        trailing, pad = kw["trailing_text_hidden"], kw["tts_pad_embed"]
        P = prompt.shape[1]
        c = torch.from_numpy(codes).to(self.device)
        with torch.inference_mode():
            emb0 = talker.get_input_embeddings()
            sub_embs = predictor.get_input_embeddings()
            # frame k's input: its 16 codes' embeddings summed, plus the k-th trailing text embedding
            # (the pad embedding once the text is used up), as prepare_inputs_for_generation builds it
            frames = emb0(c[:, 0]) + sum(sub_embs[i - 1](c[:, i]) for i in range(1, n_groups))
            text = torch.cat([trailing[0, :min(T, trailing.shape[1])],
                              pad[0].expand(max(0, T - trailing.shape[1]), -1)], dim=0)
            full = torch.cat([prompt, (frames + text).unsqueeze(0).to(prompt.dtype)], dim=1)
            # the 3-D rope reads ids: the frames are text-free positions, as the prompt's pad ids are
            ids = torch.cat([ids, ids.new_full((1, T), int(self._model.config.tts_pad_token_id))], dim=1)
            out = talker(inputs_embeds=full, attention_mask=torch.ones_like(ids), talker_input_ids=ids,
                         use_cache=False, output_hidden_states=True)
            hidden = out.hidden_states[0][-1][0, P - 1:P + T]  # the states that chose each codebook-0 token
            logits0 = out.logits[0, P - 1:P + T].float().cpu()
            # codebooks 1-15: the predictor's 16 positions per frame (hidden, codebooks 0-14), all frames at once
            sub_in = torch.cat([hidden[:T].unsqueeze(1), emb0(c[:, :1])]
                               + [sub_embs[i - 1](c[:, i:i + 1]) for i in range(1, n_groups - 1)], dim=1)
            h = predictor.model(inputs_embeds=sub_in).last_hidden_state
            sub_logits = torch.stack([predictor.lm_head[j](h[:, j + 1]) for j in range(n_groups - 1)],
                                     dim=1).float().cpu()
        settings = {k: kw.get(k) for k in ("do_sample", "top_k", "top_p", "temperature", "repetition_penalty",
                                           "suppress_tokens", "eos_token_id", "max_new_tokens", "min_new_tokens")}
        greedy = not utt.decode.get("subtalker_dosample", False)
        settings.update(subtalker_dosample=not greedy, **({} if greedy else PREDICTOR_SAMPLING))
        return scoring.score_logits(logits0, sub_logits, codes, settings, ended_by_eos)
