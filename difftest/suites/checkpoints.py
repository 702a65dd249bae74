"""A suite checked against the checkpoints that will serve it, before any model work.

The reference runner refuses a segment whose task has no checkpoint, whose language
the checkpoint does not know or whose speaker it lacks, but only when it reaches
that segment, after every segment before it has been generated. This reads the
checkpoints' config.json here instead and names every such segment at once (exit 2):
`difftest run` refuses such a suite before any model work. (`difftest reference`, which
fills a store, computes what it can and lists the rest as bad_input, as before.)
A checkpoint not on this disk (a Hugging Face id) is typed by its released name
(...-Base, ...-CustomVoice, ...-VoiceDesign); its languages and speakers are then
left to the runner.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput
from ..family import FAMILIES, FAMILY_OF_TASK, QWEN3_TTS

TYPE_OF_TASK = {task: f.checkpoint_types[task] for task, f in FAMILY_OF_TASK.items()}
# a checkpoint type that is config.json's `model_type` itself (Qwen3-Omni's; Qwen3-TTS's is `tts_model_type`)
_MODEL_TYPES = {t for f in FAMILIES.values() if f is not QWEN3_TTS for t in f.checkpoint_types.values()}
MANIFEST = "difftest-checkpoint.json"  # what the tiny checkpoint builder writes beside a build; not hashed
_NAME_SUFFIX = {"-base": "base", "-customvoice": "custom_voice", "-voicedesign": "voice_design"}
SHOWN = 8  # problems listed before "and N more"


@dataclass(frozen=True)
class CheckpointFacts:
    model: str
    type: str | None
    languages: frozenset | None  # lower-case; None: unknown (no local config.json)
    speakers: frozenset | None


def _config(model: str) -> dict | None:
    try:
        cfg = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def checkpoint_type(model: str) -> str | None:
    """base, custom_voice or voice_design: from a local folder's config.json, else from a released
    checkpoint's name (Qwen/Qwen3-TTS-12Hz-1.7B-Base, ...); None when unknown."""
    cfg = _config(model)
    if cfg is not None:
        return cfg.get("tts_model_type") or (cfg.get("model_type") if cfg.get("model_type") in _MODEL_TYPES else None)
    name = model.rstrip("/").lower()
    for f in FAMILIES.values():
        if f is not QWEN3_TTS and name.rsplit("/", 1)[-1].startswith(f.name):
            return next(iter(f.checkpoint_types.values()))
    return next((t for suffix, t in _NAME_SUFFIX.items() if name.endswith(suffix)), None)


def facts(model: str) -> CheckpointFacts:
    cfg = _config(model)
    if cfg is None:
        return CheckpointFacts(model, checkpoint_type(model), None, None)
    talker = cfg.get("talker_config") if isinstance(cfg.get("talker_config"), dict) else {}
    # as qwen-tts 0.1.1 accepts them: "auto" and every non-dialect codec_language_id key
    languages = {"auto"} | {k.lower() for k in (talker.get("codec_language_id") or {}) if "dialect" not in k}
    # Qwen3-TTS's custom voices (spk_id), Qwen3-Omni's speakers (speaker_id)
    speakers = {k.lower() for k in (talker.get("spk_id") or talker.get("speaker_id") or {})}
    return CheckpointFacts(model, checkpoint_type(model), frozenset(languages), frozenset(speakers))


def problems(suite, models: list[str]) -> list[str]:
    """What the checkpoints cannot serve: one line per segment and field."""
    by_type: dict[str, CheckpointFacts] = {}
    for m in models:
        f = facts(m)
        if f.type is not None:
            by_type.setdefault(f.type, f)
    untyped = [m for m in models if facts(m).type is None]
    if untyped and len(models) == 1:  # one unnamed hub id: the runner will say what it is
        return []
    out = []
    for seg in suite.segments:
        where = f"{suite.path.name}: segment {seg.id}"
        ckpt = by_type.get(TYPE_OF_TASK[seg.task])
        if ckpt is None:
            have = ", ".join(f"{t} ({f.model})" for t, f in sorted(by_type.items())) or "none typed"
            out.append(f"{where}: task {seg.task} needs a {TYPE_OF_TASK[seg.task]} checkpoint (have: {have})")
            continue
        if ckpt.languages is not None and (seg.language or "Auto").lower() not in ckpt.languages:
            out.append(f"{where}: language {seg.language!r} is not one the {ckpt.type} checkpoint knows "
                       f"({', '.join(sorted(ckpt.languages))})")
        if (FAMILY_OF_TASK[seg.task].task_inputs[seg.task] == "speaker" and ckpt.speakers is not None
                and (seg.speaker or "").lower() not in ckpt.speakers):
            out.append(f"{where}: speaker {seg.speaker!r} is not in the {ckpt.type} checkpoint {ckpt.model} "
                       f"(it has: {', '.join(sorted(ckpt.speakers)) or 'none'})")
    return out


def check_suite(suite, models: list[str]) -> None:
    """BadInput naming every segment the checkpoints cannot serve (before any model is loaded)."""
    found = problems(suite, models)
    if found:
        more = f"\n  ... and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
        raise BadInput("the suite does not fit its checkpoints:\n  " + "\n  ".join(found[:SHOWN]) + more)


# A checkpoint's content hash: the reference runner's fingerprint, the tiny builder's manifest, and
# the tester's check of a cached build all read it here.
def sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def content_files(folder: Path) -> list[str]:
    """Relative paths of the files that make up a checkpoint (hidden files and the manifest excluded)."""
    out = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if name.startswith(".") or name.endswith(".tmp"):
                continue
            rel = (Path(root) / name).relative_to(folder).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def hash_files(folder: Path) -> dict[str, str]:
    return {rel: sha256_file(folder / rel) for rel in content_files(folder)}
