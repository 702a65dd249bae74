"""Shared pieces of the reference-runner tests (tests/test_reference_*.py).

These tests run the real qwen-tts 0.1.1 in `.venv-reference`; without it they
fail, and say how to create it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from difftest.process import zygote
from difftest.process.runner_client import RunnerProcess
from difftest.suites import wavio
from difftest.suites.suite import DECODE_DEFAULTS, Segment, Voice, content_hash

REPO = Path(__file__).resolve().parents[1]
VENV_PYTHON = REPO / ".venv-reference" / "bin" / "python"
SR = 24000
DECODE = {**DECODE_DEFAULTS, "repetition_penalty": 1.0, "max_new_tokens": 16, "seed": 0}


def reference_python() -> Path:
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run runners/reference/make_env.sh first "
                    f"(these tests run the real qwen-tts in that environment)", pytrace=False)
    return VENV_PYTHON


def build_checkpoints(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(reference_python()), "-m", "runners.reference.tiny_checkpoint", str(out), *args]
    # forked where the session's zygote can stand for it (offline, as the builder makes itself)
    return zygote.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """The seed-0 tiny checkpoint set (base, custom_voice, voice_design), built once a session.

    Imported by several test modules; the builder keeps an intact build, so a
    second module's call costs a hash check, not a build.
    """
    out = tmp_path_factory.getbasetemp() / "tiny-seed0-listen3"
    r = build_checkpoints(out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def all_models(tiny: Path) -> list[str]:
    return [str(tiny / t) for t in ("base", "custom_voice", "voice_design")]


def write_voice(path: Path, seconds: float = 1.3, f0: float = 220.0, sr: int = SR, seed: int = 0) -> Path:
    """A tone with noise, 16-bit mono; the default length is not a whole number of 1920-sample frames."""
    t = np.arange(int(seconds * sr)) / sr
    x = 0.4 * np.sin(2 * np.pi * f0 * t) + 0.05 * np.random.default_rng(seed).standard_normal(t.shape)
    wavio.write(path, x.astype(np.float32), sr, subtype="pcm16")
    return path


def voice(path: Path, transcript: str = "This is the reference.", mode: str = "icl", vid: str = "v") -> Voice:
    data = Path(path).read_bytes() if Path(path).is_file() else b""
    try:
        n = wavio.info(data).n_frames
    except wavio.WavError:
        n = 0
    return Voice(vid, Path(path), transcript, mode, hashlib.sha256(data).hexdigest(), n)


def segment(sid: str, text: str, task: str = "voice_clone", language: str = "English", decode: dict | None = None,
            **kw) -> Segment:
    seg = Segment(sid, text, language, task, dict(decode or DECODE), **kw)
    return replace(seg, hash=content_hash(seg.fingerprint()))


def start_runner(models: list[str], log_path: Path | None = None) -> RunnerProcess:
    argv = [str(reference_python()), "-m", "runners.reference", "--threads", "1"]
    for m in models:
        argv += ["--model", m]
    r = RunnerProcess(argv, cwd=REPO, log_path=log_path, start_timeout=120)
    r.start()
    return r


def generate(runner: RunnerProcess, segments: list[Segment], out_dir: Path, **fields) -> list[dict]:
    events = list(runner.request("generate", timeout=300, segments=[s.to_job() for s in segments],
                                 out_dir=str(out_dir), concurrency=fields.pop("concurrency", 1), **fields))
    return events


def by_segment(events: list[dict], kind: str | None = None) -> dict[str, dict]:
    return {e["segment"]: e for e in events if e.get("segment") and (kind is None or e["event"] == kind)}


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def run_python(code: str, timeout: float = 120) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stdout


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


class Stopwatch:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
