"""A stand-in for torchaudio, installed before `import qwen_tts`.

`import qwen_tts` reaches `qwen_tts/core/tokenizer_25hz/vq/speech_vq.py`, which
runs `import torchaudio.compliance.kaldi` at module level. Only the 25 Hz
tokenizer ever calls it; the 12 Hz models this project tests never do. PyPI's
torchaudio wheels are CUDA builds that fail to load against a CPU torch
(`libc10_cuda.so` missing), so where no working torchaudio exists an empty
module tree takes its place. A working torchaudio is always preferred.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

_NAMES = ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi")


def _real_torchaudio_works() -> bool:
    if importlib.util.find_spec("torchaudio") is None:
        return False
    try:
        import torchaudio.compliance.kaldi  # noqa: F401
        return True
    except Exception:  # e.g. OSError: libc10_cuda.so from a CUDA wheel on a CPU torch
        for name in [n for n in sys.modules if n == "torchaudio" or n.startswith("torchaudio.")]:
            del sys.modules[name]
        return False


def _fbank_unavailable(*args, **kwargs):
    raise NotImplementedError("torchaudio is a stand-in here (runners/reference/torchaudio_stub.py); "
                              "kaldi.fbank serves only the 25 Hz tokenizer")


def install() -> str:
    """Make `import torchaudio.compliance.kaldi` succeed; returns "real" or "stub"."""
    existing = sys.modules.get("torchaudio")
    if existing is not None:
        return "stub" if getattr(existing, "__difftest_stub__", False) else "real"
    if _real_torchaudio_works():
        return "real"
    modules = {}
    for name in _NAMES:
        is_package = name != _NAMES[-1]
        mod = types.ModuleType(name)
        # A real spec keeps importlib.util.find_spec("torchaudio") from raising;
        # transformers still reports torchaudio as unavailable (no dist metadata).
        mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=is_package)
        if is_package:
            mod.__path__ = []
        mod.__difftest_stub__ = True
        modules[name] = mod
    modules["torchaudio"].compliance = modules["torchaudio.compliance"]
    modules["torchaudio.compliance"].kaldi = modules["torchaudio.compliance.kaldi"]
    modules["torchaudio.compliance.kaldi"].fbank = _fbank_unavailable
    sys.modules.update(modules)
    return "stub"
