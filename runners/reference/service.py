"""The reference runner's jobs: `generate`, `decode` and `score` (docs/runner-protocol.md).

Everything that can be decided without torch is decided here, before the model
is touched: whether a result is already cached, whether the segment's inputs
are usable. So a fully cached run never loads a model, and a bad input costs
nothing.
"""

from __future__ import annotations

import hashlib
import io
import time
from pathlib import Path

import numpy as np

from difftest.compare.align import lead_of
from difftest.family import CODEBOOK_SIZE, CODEBOOKS
from difftest.results import CorruptResult, Result, ResultStore, read_result, write_result
from difftest.scores import ScoreFile, read_scores, write_scores
from difftest.suites.suite import DECODE_FIELDS
from difftest.suites.voices import VoiceError, check_voice
from runners.reference.checkpoint import MODEL_TYPE_OF_TASK, Checkpoint
from runners.reference.engine import QwenTTSEngine, Utterance
from runners.reference.environment import log

LABEL = "qwen-tts"
REQUIRED_DECODE = ("seed", "max_new_tokens")
# A generate job's, decode item's or score item's `dtype`: qwen-tts in another dtype than the runner's own (the
# measured nulls, difftest/verdicts/null.py and vocoder_null.py), a second copy of the models loaded
# on first use.
DTYPES = ("float32", "bfloat16")


class BadInput(ValueError):
    """A segment or item that cannot be run as given; the message names what is wrong."""


def each_item(job: dict, emit, one, op: str) -> None:
    """`one(item)` for each of a `decode` or `score` job's items: a bad item, or the model failing on
    it, is that item's error (named by the item), and the next goes on."""
    for item in job.get("items") or []:
        name = item.get("name", "?") if isinstance(item, dict) else "?"
        try:
            one(item)
        except BadInput as e:
            emit("error", item=name, segment=name, kind="bad_input", message=str(e))
        except Exception as e:
            log(f"{op} {name}: {type(e).__name__}: {e}")
            emit("error", item=name, segment=name, kind="engine", message=f"{type(e).__name__}: {e}")


def score_job(job: dict, emit, score_one) -> None:
    """A `score` job: `score_one(item, name, segment, input, out, segment id, segment hash)` for each
    item not already scored (score_item), each item's failure its own (each_item)."""
    def one(item):
        head = score_item(item, emit)
        if head is not None:
            score_one(item, *head)

    each_item(job, emit, one, "score")


def score_item(item, emit) -> tuple | None:
    """A score item's (name, segment, input, out, segment id, segment hash), checked; None once a
    valid cached score at its `out` is announced (a corrupt one is scored again)."""
    if not isinstance(item, dict):
        raise BadInput("a score item must be a JSON object")
    name, seg, src, out = item.get("name"), item.get("segment"), item.get("input"), item.get("out")
    if not name or not isinstance(seg, dict) or not src or not out:
        raise BadInput("a score item needs name, segment, input and out")
    sid, shash = _segment_key(seg)
    side = _sidecar(Path(out))
    if side.exists():
        try:
            read_scores(side)
            emit("result", item=name, segment=sid, path=str(side), cached=True, seconds=0.0)
            return None
        except CorruptResult as e:
            log(f"rescoring: {e}")
    return name, seg, src, out, sid, shash


class ReferenceService:
    def __init__(self, checkpoints: dict[str, Checkpoint], engine: QwenTTSEngine, provenance: dict):
        self.checkpoints = checkpoints
        self.engine = engine
        self.provenance = provenance  # shared by every result this runner writes
        self._in_dtype: dict[str, QwenTTSEngine] = {}

    def _engine(self, dtype: str | None) -> QwenTTSEngine:
        if dtype in (None, self.engine.dtype):
            return self.engine
        if dtype not in self._in_dtype:
            e = self.engine
            self._in_dtype[dtype] = QwenTTSEngine(e.checkpoints, device=e.device, dtype=dtype, threads=e.threads)
        return self._in_dtype[dtype]

    # -- generate ------------------------------------------------------
    def generate(self, job: dict, emit) -> None:
        segments = job.get("segments") or []
        concurrency = job.get("concurrency", 1)
        out_dir = job.get("out_dir")
        dtype = job.get("dtype")
        waves = job.get("waves")  # lists of segment ids, each decoded as one batch (the measured null at N)
        codes_only = bool(job.get("codes_only"))  # the null's codes: no vocoder, no audio

        def refuse(message):
            for seg in segments:
                emit("error", segment=seg.get("id", "?") if isinstance(seg, dict) else "?", kind="bad_input",
                     message=message)

        if dtype is not None and dtype not in DTYPES:
            return refuse(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        if concurrency != 1:
            return refuse(f"the reference runs at concurrency 1 only (asked for {concurrency}); "
                          f"`waves` decodes batches")
        if not out_dir:
            return refuse("generate job has no out_dir")
        engine = self._engine(dtype)
        if waves is not None:
            return self._generate_waves(segments, waves, Path(out_dir), emit, engine, codes_only)
        for seg in segments:
            sid = seg.get("id", "?") if isinstance(seg, dict) else "?"
            try:
                self._generate_one(seg, Path(out_dir), emit, engine, codes_only)
            except BadInput as e:
                emit("error", segment=sid, kind="bad_input", message=str(e))
            except Exception as e:  # the model failed on this segment; go on with the next
                log(f"segment {sid}: {type(e).__name__}: {e}")
                emit("error", segment=sid, kind="engine", message=f"{type(e).__name__}: {e}")

    def _generate_one(self, seg: dict, out_dir: Path, emit, engine: QwenTTSEngine, codes_only: bool = False) -> None:
        stem = uncached(seg, out_dir, emit)
        if stem is None:
            return
        utt, voice = self._utterance(seg)
        load_s = self._load(engine, utt.task, seg["id"], emit)
        syn = engine.synthesize_batch([utt], codes_only=True)[0] if codes_only else engine.synthesize(utt)
        self._write(seg, utt, voice, syn, stem, emit, engine, load_s, {"concurrency": 1})

    def _generate_waves(self, segments: list, waves, out_dir: Path, emit, engine: QwenTTSEngine,
                        codes_only: bool) -> None:
        """Each wave through one batched qwen-tts call (QwenTTSEngine.synthesize_batch): its segments
        share a task and decode parameters and are greedy (a batch's one seed would draw for all). A
        wave is decoded again whole unless every result of it is in `out_dir` (its mates decide its codes)."""
        by_id = {s.get("id"): s for s in segments if isinstance(s, dict)}
        if (not isinstance(waves, list) or not all(isinstance(w, list) and w for w in waves)
                or sorted(i for w in waves for i in w) != sorted(by_id)):
            for sid in by_id or ["?"]:
                emit("error", segment=sid, kind="bad_input", message="`waves` must list every segment once, in lists")
            return
        for wave in waves:
            segs = [by_id[i] for i in wave]
            try:
                parsed = [(_segment_key(seg), *self._utterance(seg)) for seg in segs]
                utts = [u for _, u, _ in parsed]
                if any(u.decode.get("do_sample") or u.decode.get("subtalker_dosample") for u in utts):
                    raise BadInput("a batched wave must be greedy (one seed draws for the whole batch)")
                stems = [ResultStore.stem(out_dir, sid, shash) for (sid, shash), _, _ in parsed]
                cached = [_valid_result(stem, shash) for stem, ((_, shash), _, _) in zip(stems, parsed)]
                if all(c is not None for c in cached):
                    for stem, c, ((sid, _), _, _) in zip(stems, cached, parsed):
                        emit("result", segment=sid, path=str(_sidecar(stem)), cached=True,
                             seconds=float(c.timings.get("seconds", 0.0)), audio_seconds=c.seconds)
                    continue
                load_s = self._load(engine, utts[0].task, wave[0], emit)
                try:
                    syns = engine.synthesize_batch(utts, codes_only=codes_only)
                except ValueError as e:  # mixed tasks or decode parameters
                    raise BadInput(str(e)) from None
                for seg, (_, utt, voice), syn, stem in zip(segs, parsed, syns, stems):
                    self._write(seg, utt, voice, syn, stem, emit, engine, load_s, {"concurrency": len(wave),
                                                                                  "batch": list(wave)})
            except BadInput as e:
                for sid in wave:
                    emit("error", segment=sid, kind="bad_input", message=f"wave {', '.join(wave)}: {e}")
            except Exception as e:
                log(f"wave {wave}: {type(e).__name__}: {e}")
                for sid in wave:
                    emit("error", segment=sid, kind="engine", message=f"{type(e).__name__}: {e}")

    @staticmethod
    def _load(engine: QwenTTSEngine, task: str, sid: str, emit) -> float:
        if not engine.is_loaded(task):
            emit("progress", segment=sid, stage="load",
                 message=f"loading the {MODEL_TYPE_OF_TASK[task]} model in {engine.dtype}")
        t0 = time.perf_counter()
        engine.model(task)
        return time.perf_counter() - t0

    def _write(self, seg: dict, utt: Utterance, voice: dict | None, syn, stem: Path, emit, engine: QwenTTSEngine,
               load_s: float, meta: dict) -> None:
        sid, shash = _segment_key(seg)
        ckpt = self.checkpoints[utt.task]
        audio_s = len(syn.wav) / syn.sample_rate
        seconds = sum(v for k, v in syn.timings.items() if k.endswith("_s"))
        timings = {**syn.timings, "seconds": seconds, "audio_s": audio_s,
                   "rtf": seconds / audio_s if audio_s else None}
        if load_s > 0.01:
            timings["load_s"] = load_s
        provenance = {
            **self.provenance,
            "dtype": engine.dtype,
            "checkpoint": {"path": str(ckpt.path), "model": ckpt.spec, "sha256": ckpt.sha256,
                           "tts_model_type": ckpt.model_type},
            "decode": {**syn.generate_kwargs, "seed": utt.decode["seed"]},
            "task": utt.task,
            "voice": voice,
        }
        codes_only = not len(syn.wav)
        result = Result(segment_id=sid, segment_hash=shash, wav=syn.wav, sample_rate=syn.sample_rate,
                        codes=syn.codes, ref_codes=syn.ref_codes, provenance=provenance, timings=timings,
                        meta={"runner": LABEL, **meta, **({"codes_only": True} if codes_only else {}),
                              "lead_samples": 0 if codes_only else lead_of(len(syn.wav), len(syn.codes))},
                        extra={**syn.inputs,
                               **({} if syn.ref_codes_bf16 is None else {"ref_codes_bf16": syn.ref_codes_bf16}),
                               **({} if syn.speaker_embedding_bf16 is None
                                  else {"speaker_embedding_bf16": syn.speaker_embedding_bf16})})
        side = write_result(stem, result)
        emit("result", segment=sid, path=str(side), cached=False, seconds=seconds, audio_seconds=audio_s)

    def _utterance(self, seg: dict) -> tuple[Utterance, dict | None]:
        return parse_segment(seg, self.checkpoints)

    # -- decode (the cross-decode) -------------------------------------
    def decode(self, job: dict, emit) -> None:
        items = job.get("items") or []
        task = job.get("task")
        if task is None:  # the vocoder is the same in every 12 Hz checkpoint; any loaded one will do
            task = next((t for t in ("voice_clone", "custom_voice", "voice_design") if t in self.checkpoints), None)

        def one(item):
            if task not in self.checkpoints:
                raise BadInput(f"no checkpoint for task {task!r} to take the vocoder from")
            self._decode_one(item, task, emit)

        each_item({"items": items}, emit, one, "decode")

    def _decode_one(self, item: dict, task: str, emit) -> None:
        name, src, out = item.get("name"), item.get("input"), item.get("out")
        if not name or not src or not out:
            raise BadInput("a decode item needs name, input and out")
        dtype = item.get("dtype")  # qwen-tts's vocoder in another dtype (a candidate's: the vocoder's null)
        if dtype is not None and dtype not in DTYPES:
            raise BadInput(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        codes, ref_codes = _load_codes(Path(src))
        engine = self._engine(dtype)
        if not engine.is_loaded(task):
            emit("progress", item=name, segment=name, stage="load",
                 message=f"loading the {MODEL_TYPE_OF_TASK[task]} model in {engine.dtype}")
        engine.model(task)
        t0 = time.perf_counter()
        wav, sr = engine.vocode(codes, ref_codes, task)
        seconds = time.perf_counter() - t0
        ckpt = self.checkpoints[task]
        provenance = {**self.provenance, "op": "decode", "input": str(src), "dtype": engine.dtype,
                      "checkpoint": {"path": str(ckpt.path), "model": ckpt.spec, "sha256": ckpt.sha256,
                                     "tts_model_type": ckpt.model_type}}
        result = Result(segment_id=str(item.get("segment_id", name)), segment_hash=str(item.get("segment_hash", "")),
                        wav=wav, sample_rate=sr, codes=codes, ref_codes=ref_codes, provenance=provenance,
                        timings={"decode_s": seconds, "audio_s": len(wav) / sr},
                        meta={"runner": LABEL, "op": "decode", "item": name,
                              "lead_samples": lead_of(len(wav), len(codes))})
        side = write_result(Path(out), result)
        emit("result", item=name, segment=name, path=str(side), cached=False, seconds=seconds,
             audio_seconds=len(wav) / sr)


    # -- score (teacher forcing) ----------------------------------------
    def score(self, job: dict, emit) -> None:
        """Teacher-forced scores of given code streams (runners/reference/scoring.py). Each item: the
        segment (as in generate), `input` (npz: `codes` (T, 16), and `ref_codes` to condition the
        talker on instead of the voice's own, where `condition` is "given"), `ended_by_eos` and `out`."""
        score_job(job, emit, lambda item, *head: self._score_one(item, emit, *head))

    def _score_one(self, item: dict, emit, name, seg, src, out, sid, shash) -> None:
        try:
            utt, _ = self._utterance(seg)
            codes, ref_codes = _load_codes(Path(src))
        except BadInput as e:
            raise BadInput(f"score item {name} (segment {sid}): {e}") from None
        condition = item.get("condition", "voice")
        if condition not in ("given", "voice"):
            raise BadInput(f"score item {name}: condition must be 'given' or 'voice', not {condition!r}")
        if condition == "given" and (utt.task != "voice_clone" or utt.xvector_only):
            raise BadInput(f"score item {name}: reference codes to condition on, but segment {sid} has no "
                           f"in-context reference (task {utt.task}{', x-vector only' if utt.xvector_only else ''})")
        if condition == "given" and not len(ref_codes):
            raise BadInput(f"score item {name}: condition 'given' with no ref_codes in {src}")
        dtype = item.get("dtype")  # qwen-tts in another dtype scores too (the measured null's noise model)
        if dtype is not None and dtype not in DTYPES:
            raise BadInput(f"score item {name}: dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        engine = self._engine(dtype)
        if not engine.is_loaded(utt.task):
            emit("progress", item=name, segment=sid, stage="load",
                 message=f"loading the {MODEL_TYPE_OF_TASK[utt.task]} model" + (f" in {dtype}" if dtype else ""))
        t0 = time.perf_counter()
        try:
            sc = engine.score(utt, codes, ref_codes if condition == "given" else None,
                              bool(item.get("ended_by_eos", False)))
        except ValueError as e:  # codes the checkpoint cannot score (codebooks, ids)
            raise BadInput(f"score item {name} (segment {sid}): {e}") from None
        seconds = time.perf_counter() - t0
        ckpt = self.checkpoints[utt.task]
        conditioning = {"ref_codes": condition if utt.task == "voice_clone" and not utt.xvector_only else "none",
                        "frames": int(len(ref_codes)) if condition == "given" else None}
        result = ScoreFile(sid, shash, sc.arrays, sc.eos, sc.settings, conditioning,
                           {**self.provenance, "op": "score", "input": str(src), "dtype": engine.dtype,
                            "checkpoint": {"path": str(ckpt.path), "sha256": ckpt.sha256,
                                           "tts_model_type": ckpt.model_type}},
                           {"score_s": seconds, "frames": int(len(codes))}, bank=sc.bank)
        side = write_scores(Path(out), result)
        emit("result", item=name, segment=sid, path=str(side), cached=False, seconds=seconds)


def parse_segment(seg: dict, checkpoints: dict[str, Checkpoint]) -> tuple[Utterance, dict | None]:
    """A segment job checked against the checkpoints (BadInput names what is wrong), and its voice's provenance.

    Shared with the vLLM-Omni offline runner, so both sides refuse the same inputs the same way."""
    task = seg.get("task")
    if task not in MODEL_TYPE_OF_TASK:
        raise BadInput(f"unknown task {task!r}")
    ckpt = checkpoints.get(task)
    if ckpt is None:
        have = ", ".join(f"{c.model_type} ({c.spec})" for c in checkpoints.values()) or "none"
        raise BadInput(f"no {MODEL_TYPE_OF_TASK[task]} checkpoint for this {task} segment "
                       f"(start the runner with --model <a {MODEL_TYPE_OF_TASK[task]} checkpoint>; it has: {have})")
    text = seg.get("text")
    if not isinstance(text, str) or not text.strip():
        raise BadInput("empty text")
    language = seg.get("language") or "Auto"
    if not isinstance(language, str) or language.lower() not in ckpt.languages():
        raise BadInput(f"unsupported language {language!r} (the {ckpt.model_type} checkpoint knows: "
                       f"{', '.join(sorted(ckpt.languages()))})")
    decode = _decode_params(seg.get("decode"))
    utt = Utterance(text=text, language=language, task=task, decode=decode)
    voice_prov = None
    if task == "voice_clone":
        voice = seg.get("voice")
        if not isinstance(voice, dict) or not voice.get("wav"):
            raise BadInput("a voice_clone segment needs a voice with a wav")
        mode = voice.get("mode", "icl")
        if mode not in ("icl", "xvector"):
            raise BadInput(f"voice mode {mode!r} is not icl or xvector")
        transcript = (voice.get("transcript") or "").strip()
        if mode == "icl" and not transcript:
            raise BadInput(f"voice {voice.get('id')!r}: in-context cloning needs the reference transcript")
        wav_path = Path(voice["wav"])
        sha, utt.voice_bytes = _check_voice_wav(wav_path, voice.get("wav_sha256"))
        utt.voice_wav, utt.transcript, utt.xvector_only = wav_path, transcript or None, mode == "xvector"
        voice_prov = {"id": voice.get("id"), "wav": str(wav_path), "wav_sha256": sha, "mode": mode}
    elif task == "custom_voice":
        speaker = seg.get("speaker")
        if not isinstance(speaker, str) or speaker.lower() not in ckpt.speakers():
            raise BadInput(f"unknown speaker {speaker!r} (the checkpoint has: {', '.join(sorted(ckpt.speakers()))})")
        utt.speaker, utt.instructions = speaker, seg.get("instructions") or None
    else:
        instructions = seg.get("instructions")
        if not isinstance(instructions, str) or not instructions.strip():
            raise BadInput("a voice_design segment needs instructions")
        utt.instructions = instructions
    return utt, voice_prov


def uncached(seg, out_dir: Path, emit) -> Path | None:
    """The result stem of a segment the store lacks; None once a valid cached result is announced."""
    sid, shash = _segment_key(seg)
    stem = ResultStore.stem(out_dir, sid, shash)
    cached = _valid_result(stem, shash)
    if cached is None:
        return stem
    emit("result", segment=sid, path=str(_sidecar(stem)), cached=True,
         seconds=float(cached.timings.get("seconds", 0.0)), audio_seconds=cached.seconds)
    return None


def _segment_key(seg) -> tuple[str, str]:
    if not isinstance(seg, dict):
        raise BadInput("a segment must be a JSON object")
    sid, shash = seg.get("id"), seg.get("hash")
    if not isinstance(sid, str) or not sid or not isinstance(shash, str) or len(shash) < 16:
        raise BadInput("a segment needs an id and its content hash")
    return sid, shash


def _sidecar(stem: Path) -> Path:
    return stem.with_name(stem.name + ".json")  # stems hold a dot (<id>.<hash>): no with_suffix


def _valid_result(stem: Path, segment_hash: str) -> Result | None:
    side = _sidecar(stem)
    if not side.exists():
        return None
    try:
        r = read_result(side)
    except CorruptResult as e:
        log(f"recomputing: {e}")
        return None
    return r if r.segment_hash == segment_hash else None


def _decode_params(raw) -> dict:
    if not isinstance(raw, dict):
        raise BadInput("decode parameters missing")
    unknown = sorted(set(raw) - set(DECODE_FIELDS))
    if unknown:
        raise BadInput(f"unknown decode parameter {unknown[0]!r}")
    for name in REQUIRED_DECODE:
        if not isinstance(raw.get(name), int) or isinstance(raw.get(name), bool):
            raise BadInput(f"decode.{name} must be given as an integer")
    if raw["max_new_tokens"] <= 0:
        raise BadInput(f"decode.max_new_tokens must be positive, got {raw['max_new_tokens']}")
    return dict(raw)


def _check_voice_wav(path: Path, expected_sha256: str | None) -> tuple[str, bytes]:
    """Reject a voice wav qwen-tts would misread or resample; returns its sha256 and the bytes hashed
    (qwen-tts is given those, not the file again: QwenTTSEngine._voice_prompt)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BadInput(f"voice wav {path}: not found") from None
    except OSError as e:
        raise BadInput(f"voice wav {path}: unreadable ({e.strerror or e})") from None
    try:
        check_voice(data)
    except VoiceError as e:
        raise BadInput(f"voice wav {path}: {e}") from None
    sha = hashlib.sha256(data).hexdigest()
    if expected_sha256 and sha != expected_sha256:
        # The segment's cache key was computed from other bytes.
        raise BadInput(f"voice wav {path}: changed since the suite was loaded (sha256 {sha[:12]}, "
                       f"expected {expected_sha256[:12]})")
    return sha, data


def _load_codes(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise BadInput(f"codes file {path}: unreadable ({e.strerror or e})") from None
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("codes", "ref_codes") if k in z.files}
    except Exception as e:
        raise BadInput(f"codes file {path}: not a readable npz ({e})") from None
    if "codes" not in arrays:
        raise BadInput(f"codes file {path}: no 'codes' array")
    out = []
    for name in ("codes", "ref_codes"):
        a = arrays.get(name, np.zeros((0, CODEBOOKS), np.int64))
        if a.size == 0:
            a = np.zeros((0, CODEBOOKS), np.int64)
        if a.ndim != 2 or a.shape[1] != CODEBOOKS or not np.issubdtype(a.dtype, np.integer):
            raise BadInput(f"codes file {path}: {name} must be integers of shape (T, {CODEBOOKS}), "
                           f"got {a.dtype} {a.shape}")
        if a.size and (a.min() < 0 or a.max() >= CODEBOOK_SIZE):
            raise BadInput(f"codes file {path}: {name} holds ids outside [0, {CODEBOOK_SIZE})")
        out.append(a.astype(np.int64))
    if out[0].shape[0] == 0:
        raise BadInput(f"codes file {path}: codes are empty")
    return out[0], out[1]
