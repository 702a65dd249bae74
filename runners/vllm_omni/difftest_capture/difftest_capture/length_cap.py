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
import importlib.abc
import importlib.util
import logging
import sys

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


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `patch` right after MODULE is executed, wherever it is first imported."""

    _busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != MODULE or self._busy:
            return None
        self._busy = True  # let the other finders find the real module
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            patch(module)
        except Exception:
            logger.exception("difftest: could not apply %s", ENV)
        finally:
            if self in sys.meta_path:
                sys.meta_path.remove(self)


def install() -> None:
    module = sys.modules.get(MODULE)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
