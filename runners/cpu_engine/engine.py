"""The torch side of the CPU engine: a batch of requests through qwen-tts, split between stages.

One batch = one task and one set of decode parameters (the scheduler sees to
it). It runs in three steps, the way vLLM-Omni's two-stage pipeline does:

1. Talker step. qwen-tts's batched API (`generate_voice_clone` /
   `generate_custom_voice` / `generate_voice_design` with lists) runs the
   talker and the code predictor for all requests together. Voice-clone
   prompts are built one per request with `create_voice_clone_prompt` (a
   prompt built for a batch encodes the references zero-padded together,
   which changes their last frame). The batched call's own vocoder call
   (`speech_tokenizer.decode`, shadowed on the instance for the duration)
   only records its input and returns zeros; the generated codes come from
   the reference runner's capture of `model.generate`.
2. Hand-off (handoff.py): one batch payload, a per-request lookup by
   position, the vocoder input with the reference codes prepended.
3. Vocoder step. The official vocoder, `speech_tokenizer.decode`, batched
   over the requests, on reference + generated codes (chunked 300/25 inside,
   as qwen-tts does), then the reference part cut by the length of the
   reference codes the vocoder actually got.

Models are loaded through runners.reference.QwenTTSEngine (same loader, same
code capture). The module lock serialises batches of every engine in the
process: the shadowed methods are instance state.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np

from difftest.family import CODEBOOKS, SAMPLE_RATE, SAMPLES_PER_FRAME, STOP_ID
from runners.cpu_engine import defects, handoff, held
from runners.cpu_engine.api import SpeechJob
from runners.reference.checkpoint import Checkpoint
from runners.reference.engine import QwenTTSEngine

MODEL_LOCK = threading.Lock()
PROMPT_CACHE_SIZE = 64


@dataclass
class Output:
    codes: np.ndarray  # (T, 16) as handed to the vocoder
    ref_codes: np.ndarray  # (R, 16) as handed to the vocoder
    wav: np.ndarray  # float32, the vocoder output after the reference cut (what is served)
    sample_rate: int
    generated_frames: int  # what the talker produced for this request
    timings: dict = field(default_factory=dict)
    talker: dict = field(default_factory=dict)  # the talker's side, capture schema v2 (difftest/engines/capture.py)


@dataclass
class SubtalkerSampling:
    """Deploy-level sub-talker settings (vLLM-Omni: stage-0 `subtalker_sampling_params`; they
    cannot be set per request). Default greedy, as difftest's deploy overlay sets it."""
    do_sample: bool = False
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0

    def kwargs(self) -> dict:
        d = {"subtalker_dosample": self.do_sample}
        if self.do_sample:
            d.update(subtalker_temperature=self.temperature, subtalker_top_k=self.top_k, subtalker_top_p=self.top_p)
        return d


def talker_side(codes: np.ndarray, ref: np.ndarray | None, inputs: dict) -> dict:
    """What this request's talker was prompted with and generated, before the hand-off: what its
    prompt was made of (`inputs`, as qwen-tts's generate got them), its own reference codes and its
    codebook-0 tokens, closed by the final token that never becomes a frame (qwen-tts builds its
    prompt as it goes, so nothing is reserved: reserved = built = 0)."""
    ref = np.zeros((0, CODEBOOKS), np.int64) if ref is None else np.asarray(ref, np.int64).reshape(-1, CODEBOOKS)
    # the prompt's rows as the talker got them, without qwen-tts's row labels (the reference's to give)
    inputs = {k: v for k, v in inputs.items() if k != "input_prompt_rows"}
    return {**inputs, "talker_ref_codes": ref,
            "talker_prompt": np.array([0, 0, len(ref) if len(ref) else -1], np.int64),
            "talker_tokens": np.append(np.asarray(codes, np.int64)[:, 0], STOP_ID)}


class BatchEngine:
    def __init__(self, checkpoints: dict[str, Checkpoint], *, defect: str | None = None,
                 subtalker: SubtalkerSampling | None = None, qwen: QwenTTSEngine | None = None,
                 fail_on: str | None = None, talker_dtype: str = "float32", talker_capture: str = "full"):
        self.checkpoints = checkpoints
        self.defect = defects.check(defect)
        self.subtalker = subtalker or SubtalkerSampling()
        # the vocoder's models (float32); the talker and encoders in `talker_dtype`, a second copy if other
        self.vocoder_qwen = qwen or QwenTTSEngine(checkpoints, device="cpu", dtype="float32", threads=1)
        self.qwen = (self.vocoder_qwen if talker_dtype == "float32" else
                     QwenTTSEngine(checkpoints, device="cpu", dtype=talker_dtype, threads=1))
        self.fail_on = fail_on  # test hook: a request whose input contains it raises inside the engine
        self._prompts: OrderedDict = OrderedDict()
        self.talker_capture = talker_capture
        held(talker_capture, {})  # refused here, not at the first request

    def load(self) -> None:
        with MODEL_LOCK:
            for task in self.checkpoints:
                self.qwen.model(task)
                self.vocoder_qwen.model(task)

    @property
    def torch(self):
        return self.qwen._import()

    # -- a batch ---------------------------------------------------------
    def run_batch(self, jobs: list[SpeechJob]) -> list[Output]:
        if not jobs:
            return []
        task = jobs[0].task
        if any(j.task != task for j in jobs):
            raise RuntimeError("a batch mixes tasks (scheduler bug)")
        if self.fail_on:
            for j in jobs:
                if self.fail_on in j.text:
                    raise RuntimeError(f"injected engine failure for input {j.text!r} (DIFFTEST_ENGINE_FAIL_ON)")
        with MODEL_LOCK:
            t0 = time.perf_counter()
            codes, refs, at_max, inputs = self._talker(jobs)
            t1 = time.perf_counter()
            payload = handoff.make_omni_output(codes, refs, stopped_at_max=at_max,
                                               ref_leak=self.defect == "ref-leak")
            stage_inputs = []
            for i in range(len(jobs)):
                element = handoff.to_payload_element(payload, i, batch_mixup=self.defect == "batch-mixup")
                stage_inputs.append(handoff.talker2code2wav(
                    element, drop_last_at_max=self.defect == "off-by-one",
                    trim_key="meta.ref_code_len" if self.defect == "ref-in-output" else "meta.left_context_size"))
            wavs, sr = self._vocoder(task, stage_inputs)
            t2 = time.perf_counter()
        timings = {"talker_s": round(t1 - t0, 4), "vocoder_s": round(t2 - t1, 4), "batch_size": len(jobs)}
        return [Output(codes=s["codes"], ref_codes=s["ref_codes"], wav=w, sample_rate=sr,
                       generated_frames=int(c.shape[0]), timings=dict(timings), talker=self._captured(c, r, i))
                for s, w, c, r, i in zip(stage_inputs, wavs, codes, refs, inputs)]

    def _captured(self, codes, ref, inputs: dict) -> dict:
        return held(self.talker_capture, talker_side(codes, ref, inputs))

    # -- step 1: the talker ---------------------------------------------
    def _prompt(self, tts, job: SpeechJob):
        key = (job.voice_sha256, job.ref_text, job.xvector_only)
        item = self._prompts.get(key)
        if item is None:
            audio = str(job.voice_wav)
            if self.defect == "ref-audio-rate":
                from difftest.suites import wavio

                samples, wi = wavio.read(job.voice_wav)
                samples = np.asarray(samples, np.float32)
                if samples.ndim > 1:
                    samples = samples.mean(axis=1)  # qwen-tts's (librosa's) channel mean
                audio = (samples.reshape(-1), defects.wrong_rate(wi.sample_rate))
            item = tts.create_voice_clone_prompt(ref_audio=audio, ref_text=job.ref_text,
                                                 x_vector_only_mode=job.xvector_only)[0]
            self._prompts[key] = item
            while len(self._prompts) > PROMPT_CACHE_SIZE:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        return item

    def _generate_kwargs(self, job: SpeechJob) -> dict:
        kw = {"do_sample": job.do_sample, "repetition_penalty": job.repetition_penalty,
              "max_new_tokens": job.max_new_tokens, "non_streaming_mode": job.non_streaming_mode}
        if job.do_sample:
            kw.update(temperature=job.temperature, top_k=job.top_k, top_p=job.top_p)
            if self.defect == "temperature-ignored":
                kw["temperature"] = defects.HOT_TEMPERATURE
            elif self.defect == "top-k-narrowed":
                kw["top_k"] = defects.NARROW_TOP_K
            elif self.defect == "top-k-ignored":
                kw["top_k"] = 0
            elif self.defect in ("talker-temperature-hot", "talker-temperature-cold"):
                kw["temperature"] = job.temperature + defects.TEMPERATURE_STEP * (1 if self.defect.endswith("hot") else -1)
            elif self.defect == "top-k-halved":
                kw["top_k"] = job.top_k // 2
            elif self.defect == "top-p-applied":
                kw["top_p"] = defects.NUCLEUS
            elif self.defect == "repetition-penalty-dropped":
                kw["repetition_penalty"] = 1.0
            elif self.defect == "repetition-penalty-twice":
                kw["repetition_penalty"] = job.repetition_penalty ** 2
            elif self.defect == "unprocessed-logits":
                kw.update(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
        elif self.defect == "sampled-greedy":
            kw.update(do_sample=True, temperature=0.9, top_k=50, top_p=1.0)
        if self.defect == "streaming-layout":
            kw["non_streaming_mode"] = not job.non_streaming_mode
        kw.update(self.subtalker.kwargs())
        if self.defect == "subtalker-temperature-hot" and job.do_sample and kw.get("subtalker_dosample"):
            kw["subtalker_temperature"] += defects.TEMPERATURE_STEP
        return kw

    def _talker(self, jobs: list[SpeechJob]):
        torch = self.torch
        task = jobs[0].task
        tts = self.qwen.model(task)
        capture = self.qwen._models[task][1]
        kwargs = self._generate_kwargs(jobs[0])
        texts = [j.text for j in jobs]
        languages = [j.language for j in jobs]
        refs: list[np.ndarray | None] = [None] * len(jobs)
        if task == "voice_clone":
            items = [self._prompt(tts, j) for j in jobs]
            refs = [None if it.ref_code is None else it.ref_code.detach().cpu().numpy().astype(np.int64)
                    for it in items]
            if self.defect == "prompt-truncated":  # the hand-off and the capture keep `refs` whole
                items = [it if it.ref_code is None else replace(it, ref_code=it.ref_code[:defects.TRUNCATED_REF_FRAMES])
                         for it in items]
            elif self.defect == "speaker-scaled":
                items = [replace(it, ref_spk_embedding=it.ref_spk_embedding * defects.SPEAKER_SCALE) for it in items]
            elif self.defect == "speaker-leak":
                items = [replace(it, ref_spk_embedding=items[0].ref_spk_embedding) for it in items]
        if self.defect == "language-dropped":
            languages = ["Auto"] * len(jobs)
        if self.defect == "text-word-dropped":
            texts = [t.rsplit(None, 1)[0] if len(t.split()) > 1 else t for t in texts]

        vocoder_calls = []

        def talker_only_decode(encoded):
            # The batched call's own vocoder pass: record what it would decode, return zeros
            # (the vocoder runs later, per request, after the hand-off).
            vocoder_calls.append([int(e["audio_codes"].shape[0]) for e in encoded])
            return [np.zeros(int(e["audio_codes"].shape[0]) * SAMPLES_PER_FRAME, np.float32) for e in encoded], SAMPLE_RATE

        st = tts.model.speech_tokenizer
        st.decode = talker_only_decode  # an instance attribute shadows the bound method
        if self.defect == "prompt-padded":
            _pad_talker_prompt(tts.model.talker, defects.PADDED_ROWS)
        elif self.defect == "prompt-embeds-scaled":
            _scale_talker_prompt(tts.model.talker, defects.EMBEDS_SCALE)
        elif self.defect == "cobatch-blend":
            _blend_talker_prompt(tts.model.talker, defects.BLEND)
        elif self.defect == "prompt-row-moved":
            _move_speaker_row(tts.model.talker, capture.recorder)
        capture.codes = capture.inputs = None
        try:
            # Clean: a sampled request is always alone here, seeded with its own seed, which is
            # exactly the reference's `torch.manual_seed(seed)` before the call. shared-rng: a
            # batch of sampled requests, one generator seeded once with the first request's seed.
            torch.manual_seed(int(jobs[0].seed))
            if task == "voice_clone":
                tts.generate_voice_clone(text=texts, language=languages, voice_clone_prompt=items, **kwargs)
            elif task == "custom_voice":
                tts.generate_custom_voice(text=texts, speaker=[j.speaker for j in jobs], language=languages,
                                          instruct=[j.instructions for j in jobs], **kwargs)
            else:
                tts.generate_voice_design(text=texts, instruct=[j.instructions for j in jobs], language=languages,
                                          **kwargs)
        finally:
            del st.decode
            if self.defect in ("prompt-padded", "prompt-embeds-scaled", "cobatch-blend", "prompt-row-moved"):
                del tts.model.talker.generate
        if capture.codes is None or len(capture.codes) != len(jobs):
            raise RuntimeError(f"qwen-tts returned {0 if capture.codes is None else len(capture.codes)} code "
                               f"sequences for a batch of {len(jobs)}")
        codes = [c.numpy().astype(np.int64) for c in capture.codes]
        if self.defect == "codebook-shift":
            codes = [np.concatenate([c[:, :1], np.roll(c[:, 1:], 1, axis=1)], axis=1) for c in codes]
        # qwen-tts gives N-1 frames for N talker tokens when no EOS came: a max-length stop.
        at_max = [c.shape[0] >= j.max_new_tokens - 1 for c, j in zip(codes, jobs)]
        return codes, refs, at_max, capture.inputs

    # -- step 3: the vocoder --------------------------------------------
    def _vocoder(self, task: str, stage_inputs: list[dict]) -> tuple[list[np.ndarray], int]:
        torch = self.torch
        tts = self.vocoder_qwen.model(task)
        st = tts.model.speech_tokenizer
        sr = int(st.get_output_sample_rate())
        wavs: list[np.ndarray] = [np.zeros(0, np.float32)] * len(stage_inputs)
        todo = [i for i, s in enumerate(stage_inputs) if s["decoder_input"].shape[0] > 0]
        if not todo:
            return wavs, sr
        decoder = st.model.decoder
        if self.defect == "chunk-boundary":
            inner = type(decoder).chunked_decode

            def short_context_chunked_decode(codes, chunk_size=defects.DECODE_CHUNK_FRAMES, left_context_size=None):
                return inner(decoder, codes, chunk_size=chunk_size, left_context_size=defects.DEFECT_LEFT_CONTEXT)

            decoder.chunked_decode = short_context_chunked_decode
        try:
            decoded, sr = st.decode([{"audio_codes": torch.from_numpy(stage_inputs[i]["decoder_input"])}
                                     for i in todo])
        finally:
            if self.defect == "chunk-boundary":
                del decoder.chunked_decode
        for i, wav in zip(todo, decoded):
            s = stage_inputs[i]
            left = int(s.get("meta.left_context_size", 0))  # ref-in-output: the trim went elsewhere
            wavs[i] = np.asarray(handoff.trim_reference(wav, left, s["decoder_input"].shape[0]), dtype=np.float32)
        return wavs, int(sr)


def _pad_talker_prompt(talker, rows: int) -> None:
    """prompt-padded: shadow `talker.generate` (an instance attribute; the caller deletes it) so that
    every prompt gets `rows` attended rows of the text pad embedding in front."""
    inner = type(talker).generate

    def padded_generate(inputs_embeds=None, attention_mask=None, tts_pad_embed=None, **kwargs):
        import torch

        pad = tts_pad_embed.expand(inputs_embeds.shape[0], rows, -1).to(inputs_embeds.dtype)
        inputs_embeds = torch.cat([pad, inputs_embeds], dim=1)
        attention_mask = torch.cat([torch.ones(attention_mask.shape[0], rows, dtype=attention_mask.dtype,
                                               device=attention_mask.device), attention_mask], dim=1)
        return inner(talker, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                     tts_pad_embed=tts_pad_embed, **kwargs)

    talker.generate = padded_generate


def _scale_talker_prompt(talker, scale: float) -> None:
    """prompt-embeds-scaled: shadow `talker.generate` (an instance attribute; the caller deletes it)
    so that the prompt's embeddings reach it scaled."""
    inner = type(talker).generate

    def scaled_generate(inputs_embeds=None, **kwargs):
        return inner(talker, inputs_embeds=inputs_embeds * scale, **kwargs)

    talker.generate = scaled_generate


def _blend_talker_prompt(talker, share: float) -> None:
    """cobatch-blend: shadow `talker.generate` (an instance attribute; the caller deletes it) so that
    every row of a batch but the first gets `share` of the first row's prompt embeddings (the prompts
    are left-padded, so their ends line up). A batch of one is untouched."""
    inner = type(talker).generate

    def blended_generate(inputs_embeds=None, **kwargs):
        if inputs_embeds.shape[0] > 1:
            inputs_embeds = inputs_embeds.clone()
            inputs_embeds[1:] = (1 - share) * inputs_embeds[1:] + share * inputs_embeds[:1]
        return inner(talker, inputs_embeds=inputs_embeds, **kwargs)

    talker.generate = blended_generate


def _move_speaker_row(talker, recorder) -> None:
    """prompt-row-moved: shadow `talker.generate` (an instance attribute; the caller deletes it) so that
    in every prompt with a speaker row (a custom voice's speaker id, a clone's x-vector) that row comes
    after the codec pad row instead of before it. Every row is still there, each ingredient intact: only
    the assembly differs. Where the row is comes from qwen-tts's layout of the call in progress
    (runners/reference/prompt_inputs.py), counted from each prompt's end (the batch is left-padded)."""
    inner = type(talker).generate

    def moved_generate(inputs_embeds=None, **kwargs):
        layouts = recorder.layout_now()
        inputs_embeds = inputs_embeds.clone()
        for i, rows in enumerate(layouts):
            if rows is None or "speaker" not in rows:
                continue
            at = inputs_embeds.shape[1] - len(rows) + rows.index("speaker")
            if rows[rows.index("speaker") + 1] != "codec pad":
                raise RuntimeError(f"prompt-row-moved: no codec pad row after the speaker row ({rows})")
            inputs_embeds[i, [at, at + 1]] = inputs_embeds[i, [at + 1, at]]
        return inner(talker, inputs_embeds=inputs_embeds, **kwargs)

    talker.generate = moved_generate
