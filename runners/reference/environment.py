"""What the reference environment is, and how qwen-tts gets imported in it."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

PACKAGES = ("qwen-tts", "transformers", "torch", "numpy", "accelerate", "tokenizers", "safetensors", "librosa")
REPO = Path(__file__).resolve().parents[2]


def package_versions(names=PACKAGES) -> dict[str, str | None]:
    """Installed versions, read from metadata (importing torch takes seconds)."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def repo_commit() -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (r.stdout.strip() or None) if r.returncode == 0 else None


def visible_gpu() -> str:
    """The host's index (or UUID) of the GPU this process calls cuda:0: the first entry of
    CUDA_VISIBLE_DEVICES, which nvidia-smi ignores (its -i is the host's numbering)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return first or "0"


def cuda_device_name() -> str | None:
    """The name of the GPU this process uses, without importing torch (nvidia-smi), or None."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", visible_gpu()],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


def host() -> dict:
    return {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine()}


def import_qwen_tts():
    """Import qwen_tts the one way this runner does: offline, torchaudio stood in if unusable."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from runners.reference.torchaudio_stub import install

    install()
    import qwen_tts

    return qwen_tts


def log(message: str) -> None:
    print(f"[reference] {message}", file=sys.stderr, flush=True)
