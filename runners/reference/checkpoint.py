"""Checkpoint folders: where they are, whether they are complete, what they hash to.

No torch here: the runner validates and fingerprints its checkpoints before it
announces itself, and loading the model is left for the first segment.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from difftest.family import FAMILY

# the content hash, the tester's: it checks a cached tiny checkpoint with it (difftest/suites/checkpoints.py)
from difftest.suites.checkpoints import MANIFEST, content_files, hash_files, sha256_file  # noqa: F401

MODEL_TYPE_OF_TASK = dict(FAMILY.checkpoint_types)
TASK_OF_MODEL_TYPE = {mtype: task for task, mtype in MODEL_TYPE_OF_TASK.items()}

# What Qwen3TTSModel.from_pretrained reads (the weights may also be sharded).
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "speech_tokenizer/config.json",
    "speech_tokenizer/model.safetensors",
    "speech_tokenizer/preprocessor_config.json",
    "tokenizer_config.json",
)
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
# A Qwen2 tokenizer needs either its fast form or the BPE pair.
TOKENIZER_FORMS = (("tokenizer.json",), ("vocab.json", "merges.txt"))


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the folder and the problem."""


@dataclass(frozen=True)
class Checkpoint:
    spec: str  # what the user gave: a folder or a Hugging Face id
    path: Path  # the local folder
    config: dict
    files: dict  # relative path -> sha256

    @property
    def model_type(self) -> str:
        return self.config.get("tts_model_type", "")

    @property
    def task(self) -> str:
        return TASK_OF_MODEL_TYPE[self.model_type]

    @property
    def sha256(self) -> str:
        return folder_sha256(self.files)

    def languages(self) -> set[str]:
        """Lower-case language names qwen-tts accepts for this model ("auto" + non-dialect ids)."""
        ids = self.config.get("talker_config", {}).get("codec_language_id", {}) or {}
        return {"auto"} | {k.lower() for k in ids if "dialect" not in k}

    def speakers(self) -> set[str]:
        return {k.lower() for k in (self.config.get("talker_config", {}).get("spk_id", {}) or {})}


def folder_sha256(files: dict) -> str:
    """One hash over every file's path and content (`files`: relative path -> sha256): a checkpoint's."""
    h = hashlib.sha256()
    for rel, digest in sorted(files.items()):
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def missing_files(folder: Path) -> list[str]:
    """Required files absent from `folder`, by relative path."""
    missing = [rel for rel in REQUIRED_FILES if not (folder / rel).is_file()]
    if not any((folder / w).is_file() for w in WEIGHTS):
        missing.append(WEIGHTS[0])
    if not any(all((folder / f).is_file() for f in form) for form in TOKENIZER_FORMS):
        missing.append(" or ".join("+".join(form) for form in TOKENIZER_FORMS))
    return missing


def resolve(spec: str) -> Path:
    """A local folder, or a Hugging Face id already in the local cache (never downloads)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise CheckpointError(f"{spec}: not a folder")
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise CheckpointError(f"{spec}: no such checkpoint folder")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"{spec}: no such folder, and huggingface_hub is not installed to look it up") from None
    try:
        return Path(snapshot_download(spec, local_files_only=True))
    except Exception as e:  # not in the cache; nothing may be downloaded
        raise CheckpointError(f"{spec}: not a folder and not in the local Hugging Face cache ({type(e).__name__})") from None


def open_checkpoint(spec: str) -> Checkpoint:
    """Resolve, validate and hash a checkpoint; raises CheckpointError naming what is wrong."""
    folder = resolve(spec)
    missing = missing_files(folder)
    if missing:
        raise CheckpointError(f"{folder}: missing {', '.join(missing)}")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{folder / 'config.json'}: not valid JSON ({e})") from None
    mtype = config.get("tts_model_type") if isinstance(config, dict) else None
    if mtype not in TASK_OF_MODEL_TYPE:
        raise CheckpointError(f"{folder / 'config.json'}: tts_model_type is {mtype!r}, "
                              f"expected one of {', '.join(TASK_OF_MODEL_TYPE)}")
    return Checkpoint(spec, folder, config, hash_files(folder))


def open_checkpoints(specs: list[str]) -> dict[str, Checkpoint]:
    """Checkpoints by the task they serve; two for one task is an error."""
    by_task: dict[str, Checkpoint] = {}
    for spec in specs:
        ckpt = open_checkpoint(spec)
        if ckpt.task in by_task:
            raise CheckpointError(f"{spec} and {by_task[ckpt.task].spec} are both {ckpt.model_type} "
                                  f"checkpoints; give one per model type")
        by_task[ckpt.task] = ckpt
    return by_task
