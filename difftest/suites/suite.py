"""Suites: what to synthesise and how, loaded from YAML and validated.

A suite names voices (a reference wav and its transcript), segments (text,
language, and a voice, a built-in speaker or design instructions) and the
decode parameters both sides must use. Validation names the file, the field
and the problem; nothing runs on an invalid suite.

Where voices may come from: a voice's `wav` and `transcript_file` are sent to the candidate, so a
suite may only name files that resolve (symlinks followed) inside
- the suite file's own folder tree,
- the repository's shipped voices, cases/voices (public, and what cases/suites/*.yaml name as
  `../voices/...`; tests and scratch suites name them by absolute path),
- a root the user names: `--allow-root DIR` (repeatable) on every command that loads suites, or
  $DIFFTEST_ALLOW_ROOTS (folders separated by `:`), which the processes difftest starts inherit,
- or a file the caller allows by name (`load_suite(..., also=...)`: repro's probe suites name their
  origin's voices by absolute path).
Not the suite's parent folder: a suite downloaded into ~/Downloads would reach ~/.ssh, one in /tmp
every file. Anything else (`/proc/self/environ`, `../../../etc/passwd`) is bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .. import yamlfile
from ..checkout import REPO
from ..errors import SuiteError
from ..family import FAMILIES, FAMILY, QWEN3_TTS, SAMPLE_RATE, ModelFamily, family_of_model
from .voices import VoiceError, check_voice

# Qwen3-TTS's request vocabulary (difftest/family.py); a suite's own family's is `suite.family`'s
LANGUAGES = FAMILY.languages
TASKS = tuple(FAMILY.tasks)
API_TASK_TYPE = FAMILY.tasks  # the vLLM-Omni speech API's task_type for each task
CLONE_MODES = ("icl", "xvector")
# a suite's `model:` naming difftest's seeded tiny checkpoints (each family's builder): Qwen3-TTS's as
# built, and with a trained model's massive activations planted (`--hazard`, issue 58), Qwen3-Omni's
TINY, TINY_HAZARD = QWEN3_TTS.tiny
TINY_MODELS = tuple(name for f in FAMILIES.values() for name in f.tiny)

# Decode parameters: name -> (type, required). Greedy decoding is the default
# because only greedy decoding can agree sample for sample across engines.
DECODE_FIELDS: dict[str, tuple[type, bool]] = {
    "do_sample": (bool, False),
    "subtalker_dosample": (bool, False),
    "top_k": (int, False),
    "top_p": (float, False),
    "temperature": (float, False),
    "subtalker_top_k": (int, False),
    "subtalker_top_p": (float, False),
    "subtalker_temperature": (float, False),
    "repetition_penalty": (float, True),
    "max_new_tokens": (int, True),
    "seed": (int, True),
    "non_streaming_mode": (bool, False),
    "thinker_max_new_tokens": (int, False),  # a family whose first stage is a thinker: its answer's length
}
DECODE_DEFAULTS = {"do_sample": False, "subtalker_dosample": False}

DEFAULT_CHUNKS = {"initial_frames": 1, "frames": 25}

# Limits that keep one suite line from taking the machine (a 10 MB text drove qwen-tts to 6.8 GB in
# 38 s). max_new_tokens: the released checkpoints' own generation_config bound (8192 frames, 11 min).
MAX_TEXT_CHARS = 5000  # text, transcript, instructions; a long audiobook paragraph is about 1,500
MAX_ID_CHARS = 100  # ids become file names (with a hash and a suffix)
MAX_NEW_TOKENS = 8192
# qwen-tts returns max_new_tokens - 1 frames (a step's residual codebooks come with the next step):
# 1 would be no audio at all, and a raw RuntimeError from torch.stack in the reference runner.
MIN_NEW_TOKENS = 2

ALLOW_ROOTS_ENV = "DIFFTEST_ALLOW_ROOTS"
SHIPPED_VOICES = (REPO / "cases" / "voices").resolve()


@dataclass(frozen=True)
class Voice:
    id: str
    wav: Path
    transcript: str
    mode: str  # "icl" (reference codes as context) or "xvector" (speaker embedding only)
    wav_sha256: str
    n_samples: int  # frames in the wav, at its own rate (sample_rate): not 24 kHz samples unless it is 24 kHz
    sample_rate: int = SAMPLE_RATE  # as uploaded: difftest sends the bytes unchanged, each engine resamples
    channels: int = 1  # as uploaded: each engine mixes a stereo voice down itself

    def fingerprint(self) -> dict:
        return {"wav_sha256": self.wav_sha256, "transcript": self.transcript, "mode": self.mode}


@dataclass(frozen=True)
class Segment:
    id: str
    text: str
    language: str
    task: str
    decode: dict
    voice: Voice | None = None
    speaker: str | None = None
    instructions: str | None = None
    hash: str = ""

    def fingerprint(self) -> dict:
        """Everything that determines this segment's output, for hashing."""
        return {
            "text": self.text,
            "language": self.language,
            "task": self.task,
            "voice": self.voice.fingerprint() if self.voice else None,
            "speaker": self.speaker,
            "instructions": self.instructions,
            "decode": dict(sorted(self.decode.items())),
        }

    def to_job(self) -> dict:
        """The JSON form a runner receives (paths absolute)."""
        job = {"id": self.id, "hash": self.hash, "text": self.text, "language": self.language,
               "task": self.task, "decode": self.decode, "speaker": self.speaker,
               "instructions": self.instructions, "voice": None}
        if self.voice:
            v = self.voice
            job["voice"] = {"id": v.id, "wav": str(v.wav), "transcript": v.transcript, "mode": v.mode,
                            "wav_sha256": v.wav_sha256}
        return job


@dataclass(frozen=True)
class Suite:
    name: str
    path: Path
    model: str
    decode: dict
    chunks: dict
    voices: dict[str, Voice]
    segments: list[Segment]
    description: str = ""
    hash: str = field(default="")
    family: ModelFamily = QWEN3_TTS  # from `model:` (difftest.family.family_of_model)

    def segment(self, segment_id: str) -> Segment:
        for s in self.segments:
            if s.id == segment_id:
                return s
        raise KeyError(segment_id)


def content_hash(obj: Any) -> str:
    """sha256 of canonical JSON: the same content always gives the same key."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


class _Checker:
    def __init__(self, path: Path, also: frozenset = frozenset()):
        self.path, self.also = path, also  # also: files the caller allows by name (_inside)

    def fail(self, where: str, problem: str):
        raise SuiteError(self.path, where, problem)

    def mapping(self, value, where: str) -> dict:
        if not isinstance(value, dict):
            self.fail(where, f"expected a mapping, got {type(value).__name__}")
        return value

    def text(self, value, where: str, allow_empty=False) -> str:
        if not isinstance(value, str):
            self.fail(where, f"expected a string, got {type(value).__name__}")
        if not allow_empty and not value.strip():
            self.fail(where, "is empty")
        if len(value) > MAX_TEXT_CHARS:
            self.fail(where, f"{len(value)} characters, more than the {MAX_TEXT_CHARS} a segment may hold")
        return value

    def ident(self, value, where: str) -> str:
        value = self.text(value, where)
        # ids name files and folders: `..` or `.x` would land outside, or hidden in, the run folder
        if not all(c.isascii() and (c.isalnum() or c in "-_.") for c in value) or not value[0].isalnum():
            self.fail(where, f"{yamlfile.quote(value)} may only hold ASCII letters, digits, '-', '_' and '.', "
                             f"and must begin with a letter or digit")
        if len(value) > MAX_ID_CHARS:
            self.fail(where, f"{len(value)} characters, more than the {MAX_ID_CHARS} an id may hold")
        return value

    def unknown_keys(self, d: dict, allowed: set, where: str):
        extra = sorted(set(d) - allowed)
        if extra:
            self.fail(f"{where}.{extra[0]}", f"unknown field (allowed: {', '.join(sorted(allowed))})")


def decode_fields(family: ModelFamily) -> set[str]:
    """The decode parameters a family's suites may set: a thinker's only where there is one."""
    return set(DECODE_FIELDS) - ({"thinker_max_new_tokens"} if "thinker" not in family.serving_stages else set())


def _decode_params(chk: _Checker, raw, where: str, base: dict | None, family: ModelFamily = QWEN3_TTS) -> dict:
    raw = chk.mapping(raw if raw is not None else {}, where)
    chk.unknown_keys(raw, decode_fields(family), where)
    out = dict(DECODE_DEFAULTS if base is None else base)
    for name, value in raw.items():
        typ, _ = DECODE_FIELDS[name]
        w = f"{where}.{name}"
        if typ is bool and not isinstance(value, bool):
            chk.fail(w, f"expected true or false, got {yamlfile.quote(value)}")
        if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
            chk.fail(w, f"expected an integer, got {yamlfile.quote(value)}")
        if typ is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                chk.fail(w, f"expected a finite number, got {yamlfile.quote(value)}")
            value = float(value)
        out[name] = value
    if base is None:
        for name, (_, required) in DECODE_FIELDS.items():
            if required and name not in out:
                chk.fail(f"{where}.{name}", "is required (both engines must apply the same explicit value)")
    if not MIN_NEW_TOKENS <= out["max_new_tokens"] <= MAX_NEW_TOKENS:
        chk.fail(f"{where}.max_new_tokens", f"must lie in {MIN_NEW_TOKENS}..{MAX_NEW_TOKENS}, got "
                 f"{out['max_new_tokens']} (qwen-tts makes max_new_tokens - 1 frames; 1 would be no audio)")
    if out.get("thinker_max_new_tokens", 1) < 1:
        chk.fail(f"{where}.thinker_max_new_tokens", f"must be positive, got {out['thinker_max_new_tokens']}")
    if out["seed"] < 0:
        chk.fail(f"{where}.seed", f"must be >= 0, got {out['seed']}")
    if out["repetition_penalty"] <= 0:
        chk.fail(f"{where}.repetition_penalty", f"must be positive, got {out['repetition_penalty']}")
    for name in ("top_p", "subtalker_top_p"):
        if name in out and not 0 < out[name] <= 1:
            chk.fail(f"{where}.{name}", f"must lie in (0, 1], got {out[name]}")
    return out


def allowed_roots(suite_dir: Path) -> list[Path]:
    """The folders a suite in `suite_dir` may name voices and transcripts in (the module's text)."""
    extra = os.environ.get(ALLOW_ROOTS_ENV, "").split(os.pathsep)
    return [suite_dir, SHIPPED_VOICES, *(Path(d).expanduser().resolve() for d in extra if d)]


@contextlib.contextmanager
def allowing(roots):
    """$DIFFTEST_ALLOW_ROOTS with `roots` added, while the block runs (and in what it starts)."""
    old = os.environ.get(ALLOW_ROOTS_ENV)
    if roots:
        given = [str(Path(r).expanduser().resolve()) for r in roots]
        os.environ[ALLOW_ROOTS_ENV] = os.pathsep.join([*given, old] if old else given)
    try:
        yield
    finally:
        if roots and old is None:
            os.environ.pop(ALLOW_ROOTS_ENV, None)
        elif roots:
            os.environ[ALLOW_ROOTS_ENV] = old


def allow_root_arg(text: str) -> str:
    """argparse type of --allow-root: an existing folder."""
    if not Path(text).expanduser().is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a folder")
    return text


def _inside(chk: _Checker, name: str, where: str, base_dir: Path) -> Path:
    """`name` (relative to the suite's folder) resolved, if it lies where the suite may read."""
    if "\0" in name:
        chk.fail(where, "holds a NUL character")
    path = (base_dir / name).resolve()
    roots = allowed_roots(base_dir)
    if path not in chk.also and not any(path.is_relative_to(r) for r in roots):
        chk.fail(where, f"{yamlfile.quote(name)} resolves to {path}, outside the folders a suite may read "
                        f"({', '.join(map(str, roots))}); name its folder with --allow-root DIR or ${ALLOW_ROOTS_ENV}")
    return path


def _voice(chk: _Checker, raw, i: int, base_dir: Path) -> Voice:
    where = f"voices[{i}]"
    raw = chk.mapping(raw, where)
    vid = chk.ident(raw.get("id"), f"{where}.id")
    where = f"voices[{vid}]"
    chk.unknown_keys(raw, {"id", "wav", "transcript", "transcript_file", "mode"}, where)
    wav = _inside(chk, chk.text(raw.get("wav"), f"{where}.wav"), f"{where}.wav", base_dir)
    if not wav.is_file():
        chk.fail(f"{where}.wav", f"file not found: {wav}")
    data = wav.read_bytes()
    try:
        wi = check_voice(data)
    except VoiceError as e:
        chk.fail(f"{where}.wav", f"{wav.name} {e}")
    if "transcript" in raw and "transcript_file" in raw:
        chk.fail(where, "give transcript or transcript_file, not both")
    if "transcript_file" in raw:
        tpath = _inside(chk, chk.text(raw["transcript_file"], f"{where}.transcript_file"), f"{where}.transcript_file",
                        base_dir)
        if not tpath.is_file():
            chk.fail(f"{where}.transcript_file", f"file not found: {tpath}")
        try:
            transcript = tpath.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError:
            chk.fail(f"{where}.transcript_file", f"{tpath.name} is not UTF-8 text")
        if len(transcript) > MAX_TEXT_CHARS:
            chk.fail(f"{where}.transcript_file", f"{len(transcript)} characters, more than {MAX_TEXT_CHARS}")
    else:
        transcript = raw.get("transcript", "")
        transcript = chk.text(transcript, f"{where}.transcript", allow_empty=True).strip()
    mode = raw.get("mode", "icl")
    if mode not in CLONE_MODES:
        chk.fail(f"{where}.mode", f"{yamlfile.quote(mode)} is not one of {', '.join(CLONE_MODES)}")
    if mode == "icl" and not transcript:
        chk.fail(f"{where}.transcript", "in-context cloning (mode icl) needs the reference transcript")
    return Voice(vid, wav, transcript, mode, hashlib.sha256(data).hexdigest(), wi.n_frames, wi.sample_rate,
                 wi.channels)


def _segment(chk: _Checker, raw, i: int, voices: dict, decode: dict, family: ModelFamily = QWEN3_TTS) -> Segment:
    where = f"segments[{i}]"
    raw = chk.mapping(raw, where)
    sid = chk.ident(raw.get("id"), f"{where}.id")
    where = f"segments[{sid}]"
    chk.unknown_keys(raw, {"id", "text", "language", "task", "voice", "speaker", "instructions", "decode"}, where)
    text = chk.text(raw.get("text"), f"{where}.text")
    lang_raw = raw.get("language", "Auto")
    if not isinstance(lang_raw, str) or lang_raw.strip().title() not in family.languages:
        chk.fail(f"{where}.language", f"unknown language {yamlfile.quote(lang_raw)} "
                                      f"(known to {family.display}: {', '.join(family.languages)})")
    language = lang_raw.strip().title()
    task = raw.get("task", next(iter(family.tasks)))
    if task not in family.tasks:
        chk.fail(f"{where}.task", f"{yamlfile.quote(task)} is not one of {', '.join(family.tasks)} "
                                  f"(the tasks of {family.display})")
    takes = family.task_inputs[task]  # what names the segment's voice: a voice, a speaker or instructions
    voice = speaker = instructions = None
    if "instructions" in raw:
        instructions = chk.text(raw["instructions"], f"{where}.instructions")
    if takes == "voice":
        vid = raw.get("voice")
        if vid is None:
            chk.fail(f"{where}.voice", f"a {task} segment needs a voice")
        if vid not in voices:
            chk.fail(f"{where}.voice", f"unknown voice {yamlfile.quote(vid)} (suite voices: {', '.join(voices) or 'none'})")
        voice = voices[vid]
        for other in ("speaker", "instructions"):
            if other in raw:
                chk.fail(f"{where}.{other}", f"not used by a {task} segment")
    elif takes == "speaker":
        speaker = chk.ident(raw.get("speaker"), f"{where}.speaker")
        if "voice" in raw:
            chk.fail(f"{where}.voice", f"not used by a {task} segment (use speaker)")
    else:
        if instructions is None:
            chk.fail(f"{where}.instructions", f"a {task} segment needs instructions")
        for other in ("voice", "speaker"):
            if other in raw:
                chk.fail(f"{where}.{other}", f"not used by a {task} segment")
    seg_decode = _decode_params(chk, raw.get("decode"), f"{where}.decode", decode, family)
    seg = Segment(sid, text, language, task, seg_decode, voice, speaker, instructions)
    return Segment(**{**seg.__dict__, "hash": content_hash(seg.fingerprint())})


def _hf_id(text: str) -> bool:
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and all(text.split("/"))


def hf_cached(model_id: str) -> bool:
    """Whether a Hugging Face id is in the local cache (where the reference runner looks; nothing is
    ever downloaded)."""
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    hub = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub")
    snapshots = hub / ("models--" + model_id.replace("/", "--")) / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def load_suite(path: str | Path, also: frozenset[Path] = frozenset()) -> Suite:
    """Load and validate a suite file; raises SuiteError naming file, field and problem. `also`:
    files its voices may name wherever they lie (resolved paths; repro's probes of a suite)."""
    path = Path(path).resolve()
    chk = _Checker(path, frozenset(also))
    if not path.is_file():
        raise SuiteError(path, "(file)", "not found")
    try:
        raw = yamlfile.load_file(path)
    except yamlfile.TooLarge as e:  # valid YAML, only too large
        raise SuiteError(path, "(file)", e.problem) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(file)"
        raise SuiteError(path, where, f"not valid YAML: {getattr(e, 'problem', e)}") from None
    except UnicodeDecodeError:
        raise SuiteError(path, "(file)", "not UTF-8 text") from None
    raw = chk.mapping(raw, "(top level)")
    chk.unknown_keys(raw, {"name", "description", "model", "decode", "chunks", "voices", "segments"}, "(top level)")
    name = chk.ident(raw.get("name"), "name")
    model = chk.text(raw.get("model", TINY), "model")
    if model not in TINY_MODELS and not _hf_id(model) and not Path(model).expanduser().is_dir():
        chk.fail("model", f"{yamlfile.quote(model)}: expected tiny (the seeded tiny Qwen3-TTS checkpoints), "
                          f"tiny-hazard (the same with massive activations), tiny-omni (a seeded tiny Qwen3-Omni), "
                          f"a Hugging Face id (org/name) or a checkpoint folder")
    family = family_of_model(model)
    decode = _decode_params(chk, raw.get("decode"), "decode", None, family)

    chunks = dict(DEFAULT_CHUNKS)
    chunks_raw = chk.mapping(raw.get("chunks", {}), "chunks")
    chk.unknown_keys(chunks_raw, set(DEFAULT_CHUNKS), "chunks")
    for k, v in chunks_raw.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            chk.fail(f"chunks.{k}", f"must be a positive integer, got {yamlfile.quote(v)}")
        chunks[k] = v

    voices: dict[str, Voice] = {}
    voices_raw = raw.get("voices", []) or []
    if not isinstance(voices_raw, list):
        chk.fail("voices", "expected a list")
    for i, v in enumerate(voices_raw):
        voice = _voice(chk, v, i, path.parent)
        if voice.id in voices:
            chk.fail(f"voices[{i}].id", f"duplicate voice id {yamlfile.quote(voice.id)}")
        voices[voice.id] = voice

    segs_raw = raw.get("segments")
    if not isinstance(segs_raw, list) or not segs_raw:
        chk.fail("segments", "expected a non-empty list")
    segments, seen = [], set()
    for i, s in enumerate(segs_raw):
        seg = _segment(chk, s, i, voices, decode, family)
        if seg.id in seen:
            chk.fail(f"segments[{i}].id", f"duplicate segment id {yamlfile.quote(seg.id)}")
        seen.add(seg.id)
        segments.append(seg)

    suite_hash = content_hash({"name": name, "chunks": chunks, "segments": [(s.id, s.hash) for s in segments]})
    return Suite(name, path, model, decode, chunks, voices, segments,
                 chk.text(raw.get("description", ""), "description", allow_empty=True), suite_hash, family)
