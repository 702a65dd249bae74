"""The torch side of the reference runner: qwen-tts models, one utterance at a time.

Nothing here decides what to run or where results go (service.py does); this
module turns one validated request into codes and a waveform, through the
official `Qwen3TTSModel` API only. qwen-tts returns waveforms but not the
codes behind them, so the codes are captured by shadowing two bound methods on
the model *instance* (`model.generate`, `speech_tokenizer.decode`); the
package's source is never changed.
"""

from __future__ import annotations

import copy
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from difftest.family import CODEBOOKS
from runners.reference.checkpoint import Checkpoint
from runners.reference.environment import import_qwen_tts, log
from runners.reference.prompt_inputs import PromptInputs

# Decode parameters passed to qwen-tts by name (`seed` and `non_streaming_mode` are handled apart).
GENERATE_KWARGS = ("do_sample", "subtalker_dosample", "repetition_penalty", "max_new_tokens", "top_k", "top_p",
                   "temperature", "subtalker_top_k", "subtalker_top_p", "subtalker_temperature")


@dataclass
class Utterance:
    text: str
    language: str
    task: str  # voice_clone | custom_voice | voice_design
    decode: dict
    voice_wav: Path | None = None
    transcript: str | None = None
    xvector_only: bool = False
    speaker: str | None = None
    instructions: str | None = None
    voice_bytes: bytes | None = None  # the wav's bytes as the runner read and hashed them: what qwen-tts reads


def _in_dtype(module, dtype):
    """`module` behind a cast of its input to `dtype`: qwen-tts's `extract_speaker_embedding` casts
    the mels to the model's dtype, which is not a bf16 copy's."""
    import torch

    class InDtype(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, x, *args, **kwargs):
            return self.inner(x.to(dtype), *args, **kwargs)

    return InDtype()


@dataclass
class Synthesis:
    codes: np.ndarray  # (T, 16) generated
    ref_codes: np.ndarray  # (R, 16); R = 0 unless in-context voice clone
    wav: np.ndarray  # float32, what qwen-tts returned
    sample_rate: int
    timings: dict = field(default_factory=dict)
    generate_kwargs: dict = field(default_factory=dict)
    ref_codes_bf16: np.ndarray | None = None  # the same voice through qwen-tts's encoder in bf16 (float32 runs)
    inputs: dict = field(default_factory=dict)  # what the talker's prompt was made of (capture v3's input_*)
    speaker_embedding_bf16: np.ndarray | None = None  # the clone's x-vector from a bf16 copy of the encoder


class _Capture:
    """Records what the instance's `generate` returned for the latest call, and what each
    request's talker prompt was made of (`inputs`: capture schema v3's input_* arrays)."""

    def __init__(self, tts):
        self.codes = None
        self.inputs = None
        inner_generate = tts.model.generate
        recorder = self.recorder = PromptInputs()  # the CPU engine's prompt-row-moved reads its layout mid-call

        def generate_and_capture(*args, **kwargs):
            codes_list, hidden_list = recorder.observe(tts.model, inner_generate, *args, **kwargs)
            self.codes = [c.detach().to("cpu").clone() for c in codes_list]
            self.inputs = recorder.items
            return codes_list, hidden_list

        tts.model.generate = generate_and_capture  # an instance attribute shadows the class method


class QwenTTSEngine:
    """Loads each checkpoint on first use and synthesises with it."""

    def __init__(self, checkpoints: dict[str, Checkpoint], device: str = "cpu", dtype: str = "float32",
                 threads: int = 1):
        self.checkpoints = checkpoints
        self.device = device
        self.dtype = dtype
        self.threads = threads
        self._models: dict[str, tuple[object, _Capture]] = {}
        self._bf16_encoders: dict[str, object] = {}
        self._torch = None

    # -- loading -------------------------------------------------------
    def _import(self):
        if self._torch is None:
            t0 = time.perf_counter()
            import_qwen_tts()
            import torch

            if self.threads:
                torch.set_num_threads(self.threads)
            self._torch = torch
            log(f"imported qwen_tts and torch {torch.__version__} in {time.perf_counter() - t0:.1f} s "
                f"({torch.get_num_threads()} threads)")
        return self._torch

    def is_loaded(self, task: str) -> bool:
        return task in self._models

    def model(self, task: str):
        if task not in self._models:
            torch = self._import()
            from qwen_tts import Qwen3TTSModel

            ckpt = self.checkpoints[task]
            t0 = time.perf_counter()
            # cuda:0 is the runner's own GPU: difftest confines it with CUDA_VISIBLE_DEVICES (placement.py)
            device_map = "cuda:0" if self.device == "cuda" else self.device
            tts = Qwen3TTSModel.from_pretrained(str(ckpt.path), dtype=getattr(torch, self.dtype), device_map=device_map)
            self._models[task] = (tts, _Capture(tts))
            log(f"loaded {ckpt.model_type} model {ckpt.path} in {time.perf_counter() - t0:.1f} s")
        return self._models[task][0]

    # -- synthesis -----------------------------------------------------
    def synthesize(self, u: Utterance) -> Synthesis:
        torch = self._import()
        tts = self.model(u.task)
        capture = self._models[u.task][1]
        kwargs = {k: u.decode[k] for k in GENERATE_KWARGS if k in u.decode}
        if "non_streaming_mode" in u.decode:
            kwargs["non_streaming_mode"] = u.decode["non_streaming_mode"]
        ref_codes = None
        timings = {}
        t0 = time.perf_counter()
        prompt = self._voice_prompt(tts, u)
        if prompt is not None and prompt[0].ref_code is not None:
            ref_codes = prompt[0].ref_code.detach().to("cpu").numpy()
        if prompt is not None:
            timings["prompt_s"] = time.perf_counter() - t0
        ref_codes_bf16 = spk_bf16 = None
        if prompt is not None and self.dtype != "bfloat16":
            t_bf16 = time.perf_counter()
            ref_codes_bf16, spk_bf16 = self._bf16_prompt(tts, u)
            timings["prompt_bf16_s"] = time.perf_counter() - t_bf16  # counted in the result's `seconds`
        capture.codes = None
        torch.manual_seed(int(u.decode["seed"]))
        t1 = time.perf_counter()
        wavs, sr = _official_call(u, prompt, kwargs)(tts)
        if self.device == "cuda":
            torch.cuda.synchronize()
        timings["generate_s"] = time.perf_counter() - t1
        if capture.codes is None or len(capture.codes) != 1:
            raise RuntimeError("qwen-tts did not call model.generate once; codes were not captured")
        codes = capture.codes[0].numpy()
        return Synthesis(codes=codes, ref_codes=np.zeros((0, CODEBOOKS), np.int64) if ref_codes is None else ref_codes,
                         wav=np.asarray(wavs[0], dtype=np.float32), sample_rate=int(sr), timings=timings,
                         generate_kwargs=kwargs, ref_codes_bf16=ref_codes_bf16, inputs=capture.inputs[0],
                         speaker_embedding_bf16=spk_bf16)

    def synthesize_batch(self, utts: list[Utterance], codes_only: bool = False) -> list[Synthesis]:
        """`utts` through one official batched call (qwen-tts's own batched generation): the measured
        null at concurrency N, qwen-tts batched as a candidate's wave was (difftest/verdicts/null.py).
        They share a task and decode parameters (the caller groups them); each voice prompt is built
        alone, as a per-item prompt (a prompt built for the batch would encode the references
        zero-padded together and change their last frame). `codes_only`: the vocoder is not run
        (the null's audio is never read); the waveforms are then empty."""
        torch = self._import()
        task = utts[0].task
        if any(u.task != task or u.decode != utts[0].decode | {"seed": u.decode["seed"]} for u in utts):
            raise ValueError("a batch must share its task and decode parameters")
        tts = self.model(task)
        capture = self._models[task][1]
        kwargs = {k: utts[0].decode[k] for k in GENERATE_KWARGS if k in utts[0].decode}
        if "non_streaming_mode" in utts[0].decode:
            kwargs["non_streaming_mode"] = utts[0].decode["non_streaming_mode"]
        prompts = [self._voice_prompt(tts, u) for u in utts]
        st = tts.model.speech_tokenizer
        if codes_only:  # an instance attribute shadows the bound method; deleted below
            st.decode = lambda encoded: ([np.zeros(0, np.float32) for _ in encoded], int(st.get_output_sample_rate()))
        capture.codes = None
        torch.manual_seed(int(utts[0].decode["seed"]))  # greedy batches: the seed draws nothing
        t0 = time.perf_counter()
        try:
            wavs, sr = _batched_call(utts, prompts, kwargs)(tts)
        finally:
            if codes_only:
                del st.decode
        seconds = time.perf_counter() - t0
        if capture.codes is None or len(capture.codes) != len(utts):
            raise RuntimeError(f"qwen-tts returned {0 if capture.codes is None else len(capture.codes)} code "
                               f"sequences for a batch of {len(utts)}")
        out = []
        for u, p, c, w, inputs in zip(utts, prompts, capture.codes, wavs, capture.inputs):
            ref = None if p is None or p[0].ref_code is None else p[0].ref_code.detach().to("cpu").numpy()
            out.append(Synthesis(codes=c.numpy(), ref_codes=np.zeros((0, CODEBOOKS), np.int64) if ref is None else ref,
                                 wav=np.asarray(w, dtype=np.float32), sample_rate=int(sr),
                                 timings={"generate_s": seconds / len(utts), "batch_size": len(utts)},
                                 generate_kwargs=kwargs, inputs=inputs))
        return out

    def _bf16_prompt(self, tts, u: Utterance) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The voice's reference codes and x-vector from bf16 copies of qwen-tts's own speech and
        speaker encoders, through its own `create_voice_clone_prompt` (None where the prompt has none).

        vLLM-Omni encodes reference audio and computes the x-vector in bf16; qwen-tts here in
        `--dtype`. Residual codes are sensitive to that: on a CPU with AMX, 10-13% of (frame,
        codebook) entries of the tiny checkpoint's float32 and bf16 encodings agree, 78% without
        AMX. The verdict compares the candidate's codes with both (classify.py, `_encoder_finding`),
        and a bf16 speaker embedding with the bf16 one (talker_input.py)."""
        torch = self._torch
        tokenizer, model = tts.model.speech_tokenizer.model, tts.model
        if u.task not in self._bf16_encoders:
            self._bf16_encoders[u.task] = (
                copy.deepcopy(tokenizer.encoder).to(torch.bfloat16),
                _in_dtype(copy.deepcopy(model.speaker_encoder).to(torch.bfloat16), torch.bfloat16))
        own = tokenizer.encoder, model.speaker_encoder
        tokenizer.encoder, model.speaker_encoder = self._bf16_encoders[u.task]  # swapped back below
        try:
            prompt = self._voice_prompt(tts, u)[0]
        finally:
            tokenizer.encoder, model.speaker_encoder = own
        codes = None if prompt.ref_code is None else prompt.ref_code.detach().to("cpu").numpy()
        spk = prompt.ref_spk_embedding
        return codes, None if spk is None else spk.detach().to("cpu").float().reshape(-1).numpy()

    def _voice_prompt(self, tts, u: Utterance):
        if u.task != "voice_clone":
            return None
        # One prompt per utterance: a prompt built for a batch would encode the
        # references zero-padded together, which changes their last frame.
        def prompt(path):
            return tts.create_voice_clone_prompt(ref_audio=str(path), ref_text=u.transcript or None,
                                                 x_vector_only_mode=u.xvector_only)

        if u.voice_bytes is None:
            return prompt(u.voice_wav)
        # qwen-tts reads a private copy of the bytes the segment's hash was checked against: the voice
        # file edited (and restored) meanwhile cannot reach a result stored under that hash
        with tempfile.NamedTemporaryFile(suffix=".wav", prefix="difftest-voice-") as f:
            f.write(u.voice_bytes)
            f.flush()
            return prompt(f.name)

    # -- teacher-forced scoring ----------------------------------------
    def score(self, u: Utterance, codes: np.ndarray, ref_codes: np.ndarray | None, ended_by_eos: bool):
        """qwen-tts's view of `codes` for this utterance (runners/reference/scoring.py), conditioned
        on `ref_codes` as the in-context reference where given, else on the voice's own."""
        from runners.reference import scoring

        torch = self._import()
        tts = self.model(u.task)
        prompt = self._voice_prompt(tts, u)
        if ref_codes is not None and prompt is not None:
            prompt = scoring.override_ref_code(prompt, ref_codes, torch)
        kwargs = {k: u.decode[k] for k in GENERATE_KWARGS if k in u.decode}
        if "non_streaming_mode" in u.decode:
            kwargs["non_streaming_mode"] = u.decode["non_streaming_mode"]
        talker_kwargs = scoring.capture_prompt(tts, _official_call(u, prompt, kwargs))
        return scoring.score_stream(tts, talker_kwargs, codes, ended_by_eos)

    # -- the vocoder alone ---------------------------------------------
    def vocode(self, codes: np.ndarray, ref_codes: np.ndarray, task: str) -> tuple[np.ndarray, int]:
        """The waveform qwen-tts's voice-clone path gives for these codes.

        The same call (`speech_tokenizer.decode` on ref codes + codes, chunked
        300/25 inside) and the same float cut of the reference part.
        """
        torch = self._import()
        tts = self.model(task)
        ref_len = int(ref_codes.shape[0])
        full = np.concatenate([ref_codes, codes], axis=0) if ref_len else codes
        audio_codes = torch.from_numpy(np.ascontiguousarray(full, dtype=np.int64)).to(tts.device)
        wavs, sr = tts.model.speech_tokenizer.decode([{"audio_codes": audio_codes}])
        wav = wavs[0]
        if ref_len:
            total_len = int(full.shape[0])
            cut = int(ref_len / max(total_len, 1) * wav.shape[0])
            wav = wav[cut:]
        return np.asarray(wav, dtype=np.float32), int(sr)


def _batched_call(utts: list[Utterance], prompts: list, kwargs: dict):
    """The official qwen-tts call for a batch of utterances (lists), as a function of the loaded model."""
    task, langs, texts = utts[0].task, [u.language for u in utts], [u.text for u in utts]
    if task == "voice_clone":
        items = [p[0] for p in prompts]
        return lambda tts: tts.generate_voice_clone(text=texts, language=langs, voice_clone_prompt=items, **kwargs)
    if task == "custom_voice":
        return lambda tts: tts.generate_custom_voice(text=texts, speaker=[u.speaker for u in utts], language=langs,
                                                     instruct=[u.instructions for u in utts], **kwargs)
    if task == "voice_design":
        return lambda tts: tts.generate_voice_design(text=texts, instruct=[u.instructions for u in utts],
                                                     language=langs, **kwargs)
    raise ValueError(f"unknown task {task!r}")


def _official_call(u: Utterance, prompt, kwargs: dict):
    """The official qwen-tts call for this utterance, as a function of the loaded model."""
    if u.task == "voice_clone":
        return lambda tts: tts.generate_voice_clone(text=u.text, language=u.language, voice_clone_prompt=prompt,
                                                    **kwargs)
    if u.task == "custom_voice":
        return lambda tts: tts.generate_custom_voice(text=u.text, speaker=u.speaker, language=u.language,
                                                     instruct=u.instructions, **kwargs)
    if u.task == "voice_design":
        return lambda tts: tts.generate_voice_design(text=u.text, instruct=u.instructions, language=u.language,
                                                     **kwargs)
    raise ValueError(f"unknown task {u.task!r}")
