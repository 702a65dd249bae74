"""Opt-in (`DIFFTEST_ACCEPT_LENGTH_FINISH=1`): answer a voice-clone request that reached its
`max_new_tokens` with its audio, as qwen-tts does, instead of HTTP 500.

vLLM-Omni 0.30 rejects a Base (voice clone) generation whose talker stopped on the token budget
rather than on codec EOS (`Qwen3TTSAdapter.validate_generation` raises
`Qwen3TTSCodecLimitError`). difftest caps every request with an explicit `max_new_tokens`, and the
seeded tiny checkpoints never emit EOS, so without this every tiny voice-clone segment is an
error. Only that API-level check is skipped: codes and audio are what the engine made. difftest
records in the run's provenance that the option was on.

The adapter lives in the API server's import tree (heavy to import elsewhere), so the patch is
applied when that module is first imported, in whichever process imports it.
"""

from __future__ import annotations

import functools
import logging

from runners.vllm_omni.difftest_capture.difftest_capture.after_import import when_imported

ENV = "DIFFTEST_ACCEPT_LENGTH_FINISH"
MODULE = "vllm_omni.entrypoints.openai.tts_adapters.qwen3_tts"
MARK = "__difftest_length_cap__"

logger = logging.getLogger("vllm.difftest_capture")


def patch(module) -> bool:
    cls = getattr(module, "Qwen3TTSAdapter", None)
    original = getattr(cls, "validate_generation", None)
    if original is None or getattr(original, MARK, False):
        return False

    @functools.wraps(original)
    def validate_generation(self, tts_params, *args, **kwargs):
        if kwargs.get("stage0_finish_reason") == "length":
            return None  # accepted: the request's own max_new_tokens ended it
        return original(self, tts_params, *args, **kwargs)

    setattr(validate_generation, MARK, True)
    cls.validate_generation = validate_generation
    logger.info("difftest: %s set: voice clones that reach max_new_tokens are answered, not refused", ENV)
    return True


def install() -> None:
    when_imported(MODULE, patch)
