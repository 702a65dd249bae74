"""The Qwen3-Omni reference runner's jobs: `generate`, `decode` and `score` (docs/runner-protocol.md).

As the Qwen3-TTS runner (runners/reference/service.py, whose segment keys, result cache and codes
files this shares): a cached result or a bad segment costs no model work, every other segment is
decoded alone (concurrency 1), and each result records what each stage handed on:
`codes` (what code2wav received), `wav`, and in `extra` the chat turn as the thinker read it
(`prompt_ids`), the thinker's answer handed to the talker (`answer_ids`) and the talker's own frames
(`talker_codes`, before the hand-off to code2wav), and what the talker's prompt was made of (the
`input_*` arrays of the capture schema: the chat turn, the codec prefill, the speaker id).

A job's `dtype` (generate, score) runs transformers in another dtype than the runner's own, a second
copy loaded on first use: the measured null (difftest/verdicts/null.py) decodes and scores in the
candidate's numerics. transformers' Qwen3-Omni speaks one request at a time (`generate` refuses a
batch with audio), so `waves` (the null batched as the candidate's waves) is refused, and the
runner's announcement says so (`generate_waves: false`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from difftest.family import QWEN3_OMNI
from difftest.results import Result, write_result
from difftest.scores import ScoreFile, write_scores
from difftest.suites.checkpoints import hash_files
from runners.reference.checkpoint import folder_sha256
from runners.reference.environment import log
from runners.reference.service import (
    DTYPES,
    BadInput,
    _decode_params,
    _load_codes,
    _segment_key,
    each_item,
    score_job,
    uncached,
)
from runners.reference_omni.engine import OmniEngine, Utterance

LABEL = "transformers-qwen3-omni"
TASK = "chat"
MIN_NEW_TOKENS = 2  # the talker's last token never becomes a frame: 1 would be no audio


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the folder and the problem."""


@dataclass(frozen=True)
class OmniCheckpoint:
    spec: str
    path: Path
    config: dict
    files: dict  # relative path -> sha256

    @property
    def sha256(self) -> str:
        return folder_sha256(self.files)

    def speakers(self) -> set[str]:
        return {k.lower() for k in (self.config.get("talker_config", {}).get("speaker_id") or {})}


def open_checkpoint(spec: str) -> OmniCheckpoint:
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"{spec}: no such checkpoint folder")
    folder = folder.resolve()
    missing = [f for f in ("config.json", "tokenizer_config.json", "tokenizer.json") if not (folder / f).is_file()]
    if not any((folder / w).is_file() for w in ("model.safetensors", "model.safetensors.index.json")):
        missing.append("model.safetensors")
    if missing:
        raise CheckpointError(f"{folder}: missing {', '.join(missing)}")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{folder / 'config.json'}: not valid JSON ({e})") from None
    want = QWEN3_OMNI.checkpoint_types[TASK]
    if not isinstance(config, dict) or config.get("model_type") != want:
        got = config.get("model_type") if isinstance(config, dict) else None
        raise CheckpointError(f"{folder / 'config.json'}: model_type is {got!r}, expected {want!r}")
    return OmniCheckpoint(spec, folder, config, hash_files(folder))


def parse_segment(seg: dict, ckpt: OmniCheckpoint) -> Utterance:
    """A segment job checked against the checkpoint; BadInput names what is wrong."""
    if seg.get("task") != TASK:
        raise BadInput(f"task {seg.get('task')!r}: a {QWEN3_OMNI.display} checkpoint serves {TASK!r} segments")
    text = seg.get("text")
    if not isinstance(text, str) or not text.strip():
        raise BadInput("empty text")
    speaker = seg.get("speaker")
    if not isinstance(speaker, str) or speaker.lower() not in ckpt.speakers():
        raise BadInput(f"unknown speaker {speaker!r} (the checkpoint has: {', '.join(sorted(ckpt.speakers()))})")
    decode = _decode_params(seg.get("decode"))
    if decode["max_new_tokens"] < MIN_NEW_TOKENS:
        raise BadInput(f"decode.max_new_tokens must be at least {MIN_NEW_TOKENS}, got {decode['max_new_tokens']}")
    return Utterance(text=text, speaker=speaker, decode=decode)


class OmniService:
    def __init__(self, ckpt: OmniCheckpoint, engine: OmniEngine, provenance: dict):
        self.ckpt, self.engine, self.provenance = ckpt, engine, provenance
        self._in_dtype: dict[str, OmniEngine] = {}

    def _engine(self, dtype: str | None) -> OmniEngine:
        if dtype in (None, self.engine.dtype):
            return self.engine
        if dtype not in DTYPES:
            raise BadInput(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        if dtype not in self._in_dtype:
            e = self.engine
            self._in_dtype[dtype] = OmniEngine(e.path, e.device, dtype, e.threads)
        return self._in_dtype[dtype]

    def _load(self, sid: str, emit, engine: OmniEngine | None = None) -> float:
        engine = engine or self.engine
        if not engine.is_loaded():
            emit("progress", segment=sid, stage="load", message=f"loading {QWEN3_OMNI.display} in {engine.dtype}")
        t0 = time.perf_counter()
        engine.load()
        return time.perf_counter() - t0

    def generate(self, job: dict, emit) -> None:
        segments = job.get("segments") or []
        out_dir = job.get("out_dir")
        dtype = job.get("dtype")
        problem = ("the reference runs at concurrency 1 only" if job.get("concurrency", 1) != 1
                   else "generate job has no out_dir" if not out_dir
                   else f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}" if dtype not in (None, *DTYPES)
                   else (f"{QWEN3_OMNI.display} in transformers speaks one request at a time: no batched waves")
                   if job.get("waves") is not None
                   else None)
        codes_only = bool(job.get("codes_only"))  # the null's codes: the waveform is not kept
        for seg in segments:
            sid = seg.get("id", "?") if isinstance(seg, dict) else "?"
            try:
                if problem:
                    raise BadInput(problem)
                self._generate_one(seg, Path(out_dir), emit, self._engine(dtype), codes_only)
            except BadInput as e:
                emit("error", segment=sid, kind="bad_input", message=str(e))
            except Exception as e:  # the model failed on this segment; go on with the next
                log(f"segment {sid}: {type(e).__name__}: {e}")
                emit("error", segment=sid, kind="engine", message=f"{type(e).__name__}: {e}")

    def _generate_one(self, seg: dict, out_dir: Path, emit, engine: OmniEngine, codes_only: bool) -> None:
        stem = uncached(seg, out_dir, emit)
        if stem is None:
            return
        sid, shash = _segment_key(seg)
        utt = parse_segment(seg, self.ckpt)
        load_s = self._load(sid, emit, engine)
        syn = engine.synthesize(utt)
        if codes_only:
            syn.wav = syn.wav[:0]
        audio_s = (len(syn.wav) or len(syn.codes) * QWEN3_OMNI.samples_per_frame) / syn.sample_rate
        seconds = syn.timings["generate_s"]
        timings = {**syn.timings, "seconds": seconds, "audio_s": audio_s, "rtf": seconds / audio_s if audio_s else None,
                   **({"load_s": load_s} if load_s > 0.01 else {})}
        provenance = {**self.provenance, "checkpoint": self._checkpoint(), "task": TASK, "speaker": utt.speaker,
                      "dtype": engine.dtype, "decode": {**syn.generate_kwargs, "seed": utt.decode["seed"]}}
        result = Result(segment_id=sid, segment_hash=shash, wav=syn.wav, sample_rate=syn.sample_rate, codes=syn.codes,
                        provenance=provenance, timings=timings,
                        meta={"runner": LABEL, "concurrency": 1, "lead_samples": 0,
                              **({"codes_only": True} if codes_only else {})},
                        extra={"prompt_ids": syn.prompt_ids, "answer_ids": syn.answer_ids,
                               "talker_codes": syn.talker_codes, **syn.talker_inputs})
        side = write_result(stem, result)
        emit("result", segment=sid, path=str(side), cached=False, seconds=seconds, audio_seconds=audio_s)

    def _checkpoint(self) -> dict:
        c = self.ckpt
        return {"path": str(c.path), "model": c.spec, "sha256": c.sha256, "model_type": c.config.get("model_type")}

    def decode(self, job: dict, emit) -> None:
        """code2wav of given codes (the cross-decode): `items`, each name, input (npz with `codes`) and out."""
        each_item(job, emit, lambda item: self._decode_one(item, emit), "decode")

    def _decode_one(self, item, emit) -> None:
        if not isinstance(item, dict) or not item.get("name") or not item.get("input") or not item.get("out"):
            raise BadInput("a decode item needs name, input and out")
        if item.get("dtype") not in (None, self.engine.dtype):
            raise BadInput(f"this runner decodes in {self.engine.dtype} only")
        name = item["name"]
        codes, _ = _load_codes(Path(item["input"]))
        self._load(name, emit)
        t0 = time.perf_counter()
        wav = self.engine.vocode(codes)
        seconds = time.perf_counter() - t0
        sr = QWEN3_OMNI.sample_rate
        result = Result(segment_id=str(item.get("segment_id", name)), segment_hash=str(item.get("segment_hash", "")),
                        wav=wav, sample_rate=sr, codes=codes,
                        provenance={**self.provenance, "op": "decode", "input": str(item["input"]),
                                    "checkpoint": self._checkpoint()},
                        timings={"decode_s": seconds, "audio_s": len(wav) / sr},
                        meta={"runner": LABEL, "op": "decode", "item": name, "lead_samples": 0})
        side = write_result(Path(item["out"]), result)
        emit("result", item=name, segment=name, path=str(side), cached=False, seconds=seconds,
             audio_seconds=len(wav) / sr)

    def score(self, job: dict, emit) -> None:
        """Teacher-forced scores of given code streams (OmniEngine.score). Each item: the segment (as in
        generate), `input` (npz with `codes` (T, 16)), `ended_by_eos`, `out`, and `dtype` to score in
        another dtype; `condition` is "voice" only (a chat turn has no in-context reference codes)."""
        score_job(job, emit, lambda item, *head: self._score_one(item, emit, *head))

    def _score_one(self, item: dict, emit, name, seg, src, out, sid, shash) -> None:
        if item.get("condition", "voice") != "voice":
            raise BadInput(f"score item {name}: a {QWEN3_OMNI.display} chat turn has no in-context reference codes "
                           f"to condition on (condition must be 'voice')")
        try:
            utt = parse_segment(seg, self.ckpt)
            codes, _ = _load_codes(Path(src))
        except BadInput as e:
            raise BadInput(f"score item {name} (segment {sid}): {e}") from None
        engine = self._engine(item.get("dtype"))
        self._load(sid, emit, engine)
        t0 = time.perf_counter()
        try:
            sc = engine.score(utt, codes, bool(item.get("ended_by_eos", False)))
        except ValueError as e:  # codes the checkpoint cannot score (codebooks, ids)
            raise BadInput(f"score item {name} (segment {sid}): {e}") from None
        seconds = time.perf_counter() - t0
        result = ScoreFile(sid, shash, sc.arrays, sc.eos, sc.settings, {"ref_codes": "none", "frames": None},
                           {**self.provenance, "op": "score", "input": str(src), "dtype": engine.dtype,
                            "checkpoint": self._checkpoint()},
                           {"score_s": seconds, "frames": len(codes)}, bank=sc.bank)
        side = write_scores(Path(out), result)
        emit("result", item=name, segment=sid, path=str(side), cached=False, seconds=seconds)
