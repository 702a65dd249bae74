"""A model family: the one place for what difftest knows of a speech model's codec, its requests, its
serving stages and its reference (issue 59, item 2). Qwen3-TTS is the first entry; a second family
(issue 60) is a second entry here, not branches elsewhere.

Nothing outside this module writes these numbers (tests/test_family.py reads every module's code for
them). Standard library only: the runners import it in their own environments (the reference's, the
CPU test engine's, a vLLM-Omni release's hand-off probe)."""

from __future__ import annotations

from dataclasses import dataclass
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
    tasks: Mapping[str, str]  # difftest's task -> the speech API's task_type
    languages: tuple[str, ...]  # what the reference accepts (case as written here)
    checkpoint_types: Mapping[str, str]  # difftest's task -> the checkpoint type that serves it
    # the serving stages (vLLM-Omni's stage ids, in order) and the diagnosis stages a finding names,
    # upstream first
    serving_stages: tuple[str, ...]
    stages: tuple[str, ...]
    # the reference
    reference_package: str  # the official package, as pip names it
    reference_runner: str  # the module its environment's interpreter runs (contract 3)
    checkpoint_builder: str  # the module that builds the seeded tiny checkpoints

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
    # qwen-tts 0.1.1 accepts "auto" plus every non-dialect codec_language_id key
    languages=("Auto", "Chinese", "English", "German", "Spanish", "Japanese",
               "French", "Korean", "Russian", "Italian", "Portuguese"),
    checkpoint_types=MappingProxyType({"voice_clone": "base", "custom_voice": "custom_voice",
                                       "voice_design": "voice_design"}),  # config.json's tts_model_type
    serving_stages=("talker", "vocoder"),
    stages=("talker_input", "talker", "reference_encoder", "handoff", "vocoder"),
    reference_package="qwen-tts",
    reference_runner="runners.reference",
    checkpoint_builder="runners.reference.tiny_checkpoint",
)

FAMILIES = MappingProxyType({f.name: f for f in (QWEN3_TTS,)})

# The family every suite speaks to until issue 60 carries a suite's family through a run: the names
# the modules read.
FAMILY = QWEN3_TTS
CODEBOOKS = FAMILY.codebooks
SAMPLE_RATE = FAMILY.sample_rate
SAMPLES_PER_FRAME = FAMILY.samples_per_frame
STOP_ID = FAMILY.stop_id
CODEBOOK_SIZE = FAMILY.codebook_size
