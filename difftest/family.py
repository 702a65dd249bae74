"""A model family: the one place for what difftest knows of a speech model's codec, its requests, its
serving stages and its reference (issue 59, item 2). Qwen3-TTS is the first entry; a second family
(issue 60) is a second entry here, not branches elsewhere.

Nothing outside this module writes these numbers (tests/test_family.py reads every module's code for
them). Standard library only: the runners import it in their own environments (the reference's, the
CPU test engine's, a vLLM-Omni release's hand-off probe)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class ModelFamily:
    name: str  # as a suite names it
    display: str
    # the codec
    codebooks: int  # codes a frame: codebook 0 from the talker, 1.. from its code predictor
    codebook_size: int  # ids a codebook holds: a code is in [0, codebook_size); the talker's specials lie above
    sample_rate: int  # Hz: the vocoder's audio, and the rate both engines resample a voice to
    samples_per_frame: int  # one codec frame at sample_rate
    stop_id: int  # codebook 0's end of stream (the talker's last token, never a frame)
    # the requests
    tasks: Mapping[str, str]  # difftest's task -> the speech API's task_type (the first: a segment's default)
    task_inputs: Mapping[str, str]  # difftest's task -> what names its voice: "voice", "speaker" or "instructions"
    languages: tuple[str, ...]  # what the reference accepts (case as written here)
    checkpoint_types: Mapping[str, str]  # difftest's task -> the checkpoint type that serves it
    # the serving stages (vLLM-Omni's stage ids, in order) and the diagnosis stages a finding names,
    # upstream first
    serving_stages: tuple[str, ...]
    stages: tuple[str, ...]
    # the reference
    reference_package: str  # the official package, as pip names it
    reference_name: str  # the reference as a report names it
    deploy_file: str  # vLLM-Omni's deploy YAML for it, in the release's deploy folder (production's configuration)
    reference_label: str  # the label its runner announces: the store keys the reference's results by it
    reference_runner: str  # the module its environment's interpreter runs (contract 3)
    checkpoint_builder: str  # the module that builds the seeded tiny checkpoints
    tiny: tuple[str, ...]  # what a suite's `model:` says for them (the first: as built; tiny-hazard: issue 58)

    @property
    def frame_seconds(self) -> float:
        return self.samples_per_frame / self.sample_rate


QWEN3_TTS = ModelFamily(
    name="qwen3-tts",
    display="Qwen3-TTS",
    codebooks=16,
    codebook_size=2048,
    sample_rate=24000,
    samples_per_frame=1920,  # 80 ms: 12.5 frames a second
    stop_id=2150,  # codec_eos_token_id of every Qwen3-TTS 12 Hz checkpoint (and of the tiny ones)
    tasks=MappingProxyType({"voice_clone": "Base", "custom_voice": "CustomVoice", "voice_design": "VoiceDesign"}),
    task_inputs=MappingProxyType({"voice_clone": "voice", "custom_voice": "speaker", "voice_design": "instructions"}),
    # qwen-tts 0.1.1 accepts "auto" plus every non-dialect codec_language_id key
    languages=("Auto", "Chinese", "English", "German", "Spanish", "Japanese",
               "French", "Korean", "Russian", "Italian", "Portuguese"),
    checkpoint_types=MappingProxyType({"voice_clone": "base", "custom_voice": "custom_voice",
                                       "voice_design": "voice_design"}),  # config.json's tts_model_type
    serving_stages=("talker", "vocoder"),
    stages=("talker_input", "talker", "reference_encoder", "handoff", "vocoder"),
    reference_package="qwen-tts",
    reference_name="qwen-tts",
    deploy_file="qwen3_tts.yaml",
    reference_label="qwen-tts",
    reference_runner="runners.reference",
    checkpoint_builder="runners.reference.tiny_checkpoint",
    tiny=("tiny", "tiny-hazard"),
)

# Qwen3-Omni's talker speaks Qwen3-TTS's codec (the same code predictor, 16 codebooks at 12.5 Hz, 24 kHz,
# stop id 2150), so its codec is QWEN3_TTS's by construction. Its request is a chat turn: the thinker
# answers the user's text and the talker speaks the answer in one of the checkpoint's speakers.
QWEN3_OMNI = replace(
    QWEN3_TTS,
    name="qwen3-omni",
    display="Qwen3-Omni",
    tasks=MappingProxyType({"chat": "chat"}),  # chat completions with audio output
    task_inputs=MappingProxyType({"chat": "speaker"}),
    languages=("Auto",),  # the thinker answers in whatever language; a request names none
    checkpoint_types=MappingProxyType({"chat": "qwen3_omni_moe"}),  # config.json's model_type
    serving_stages=("thinker", "talker", "code2wav"),
    stages=("thinker", "talker_input", "talker", "handoff", "vocoder"),
    reference_package="transformers",
    reference_name="transformers' Qwen3-Omni",
    deploy_file="qwen3_omni_moe.yaml",
    reference_label="transformers-qwen3-omni",
    reference_runner="runners.reference_omni",
    checkpoint_builder="runners.reference_omni.tiny_checkpoint",
    tiny=("tiny-omni",),
)

FAMILIES = MappingProxyType({f.name: f for f in (QWEN3_TTS, QWEN3_OMNI)})


REFERENCE_NAMES = MappingProxyType({f.reference_label: f.reference_name for f in FAMILIES.values()})
FAMILY_OF_TASK = MappingProxyType({task: f for f in FAMILIES.values() for task in f.tasks})  # tasks are unique


def family_of_tasks(tasks) -> ModelFamily:
    """The one family these tasks belong to (Qwen3-TTS for none); ValueError naming a mix or an unknown task."""
    found = {FAMILY_OF_TASK[t].name if t in FAMILY_OF_TASK else None for t in tasks}
    if None in found:
        raise ValueError(f"unknown task among {sorted(tasks)} (known: {', '.join(FAMILY_OF_TASK)})")
    if len(found) > 1:
        raise ValueError(f"tasks of several model families in one run: {sorted(tasks)}")
    return FAMILIES[found.pop()] if found else QWEN3_TTS


def family_of_model(model: str) -> ModelFamily:
    """The family a suite's `model:` names: a tiny build by its name, a checkpoint folder by its
    config.json (Qwen3-Omni's `model_type`), a Hugging Face id by its name; Qwen3-TTS otherwise."""
    for f in FAMILIES.values():
        if model in f.tiny:
            return f
    try:
        config = json.loads((Path(model).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict):
        return next((f for f in FAMILIES.values() if config.get("model_type") in f.checkpoint_types.values()),
                    QWEN3_TTS)
    name = model.rstrip("/").rsplit("/", 1)[-1].lower()
    return next((f for f in FAMILIES.values() if name.startswith(f.name)), QWEN3_TTS)


# The family every suite speaks to until issue 60 carries a suite's family through a run: the names
# the modules read.
FAMILY = QWEN3_TTS
CODEBOOKS = FAMILY.codebooks
SAMPLE_RATE = FAMILY.sample_rate
SAMPLES_PER_FRAME = FAMILY.samples_per_frame
STOP_ID = FAMILY.stop_id
CODEBOOK_SIZE = FAMILY.codebook_size
