"""A real git repository for the bisect tests: `fakeomni`, a tiny installable package whose history
changes what the CPU test engine does.

    c0  fakeomni: a clean package                      good
    c1  docs: say what fakeomni is                     good
    c2  fakeomni: declare the defect through a function good
    c3  tests: a smoke test for the declaration       good
    c4  build: move the metadata (broken pyproject)    does not install -> skip
    c5  build: repair the metadata                     good
    c6  handoff: keep one reference per batch          ref-leak: the first bad commit (K)
    c7  scheduler: batch sooner (leaks on odd calls)   flaky: ref-leak on calls 1, 3, 5 ... (FAKEOMNI_COUNTER)
    c8  docs: changelog                                ref-leak
    c9  release 0.2                                    ref-leak

planted_defect() (all but c7's) can be told to wait at a given call (FAKEOMNI_HOLD), so that a test
interrupts a bisect at a point the bisect reached, not at a moment the test guessed.

Each commit has its own author date (2024-01-0N), made with real git.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOICES = ROOT / "cases" / "voices"
K = 6  # the first bad commit
BROKEN = 4  # does not install
FLAKY = 7  # bad on odd calls only

PYPROJECT = """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "fakeomni"
version = "{version}"
description = "a stand-in for vLLM-Omni in difftest's bisect tests"

[tool.setuptools]
packages = ["fakeomni"]
"""
BROKEN_PYPROJECT = PYPROJECT.replace("[project]", "[project").format(version="0.1.4")

CONSTANT = '''"""fakeomni {version}."""

import os

PLANTED_DEFECT = {defect!r}


def planted_defect():
    hold()
    return PLANTED_DEFECT


def hold():
    """Tests only: FAKEOMNI_HOLD=VERSION:CALL:DIR makes the CALL-th answer of the installed VERSION
    write DIR/held and wait there until the process is interrupted: a point a test can interrupt at."""
    import importlib.metadata
    import pathlib
    import time

    version, _, rest = os.environ.get("FAKEOMNI_HOLD", "").partition(":")
    if not version or version != importlib.metadata.version("fakeomni"):
        return
    call, _, folder = rest.partition(":")
    calls = pathlib.Path(folder) / ("calls-" + version)
    n = int(calls.read_text()) + 1 if calls.exists() else 1
    calls.write_text(str(n))
    if n == int(call):
        (pathlib.Path(folder) / "held").write_text(str(os.getpid()))
        while True:
            time.sleep(0.1)
'''
FLAKY_SOURCE = '''"""fakeomni 0.1.7: batches sooner; the leak shows on odd calls only (a deterministic flake)."""

import os


def planted_defect():
    path = os.environ["FAKEOMNI_COUNTER"]
    try:
        with open(path) as f:
            n = int(f.read() or 0)
    except FileNotFoundError:
        n = 0
    n += 1
    with open(path, "w") as f:
        f.write(str(n))
    return "ref-leak" if n % 2 == 1 else None
'''


# Who commits in the tests' repositories: a new machine has no git identity configured, and a
# commit or merge without one fails (seen in a clean root: `git merge` exit 128).
IDENTITY = {"GIT_AUTHOR_NAME": "Test", "GIT_AUTHOR_EMAIL": "test@example.com", "GIT_COMMITTER_NAME": "Test",
            "GIT_COMMITTER_EMAIL": "test@example.com"}


def git(repo: Path, *args: str, env: dict | None = None) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **IDENTITY, **(env or {})}).stdout.strip()


def commit(repo: Path, day: int, subject: str, files: dict[str, str]) -> str:
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    git(repo, "add", "-A")
    date = f"2024-01-{day:02d}T12:00:00+00:00"
    git(repo, "commit", "-q", "-m", subject, env={"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date})
    return git(repo, "rev-parse", "HEAD")


def make_fakeomni_repo(repo: Path) -> list[str]:
    """The history above; returns the commit ids c0..c9."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    pkg = "fakeomni/__init__.py"
    v = lambda i: f"0.1.{i}"
    shas = [
        commit(repo, 1, "fakeomni: a clean package",
               {"pyproject.toml": PYPROJECT.format(version=v(0)), pkg: CONSTANT.format(version=v(0), defect=None)}),
        commit(repo, 2, "docs: say what fakeomni is", {"README.md": "fakeomni: a stand-in for vLLM-Omni.\n"}),
        commit(repo, 3, "fakeomni: declare the defect through a function",
               {pkg: CONSTANT.format(version=v(2), defect=None)}),
        commit(repo, 4, "tests: a smoke test for the declaration",
               {"tests/test_smoke.py": "import fakeomni\n\n\ndef test():\n    fakeomni.planted_defect()\n"}),
        commit(repo, 5, "build: move the metadata (broken pyproject)", {"pyproject.toml": BROKEN_PYPROJECT}),
        commit(repo, 6, "build: repair the metadata", {"pyproject.toml": PYPROJECT.format(version=v(5))}),
        commit(repo, 7, "handoff: keep one reference per batch (last writer wins)",
               {pkg: CONSTANT.format(version=v(6), defect="ref-leak")}),
        commit(repo, 8, "scheduler: batch sooner", {pkg: FLAKY_SOURCE}),
        commit(repo, 9, "docs: changelog", {"CHANGELOG.md": "0.1.8: notes\n",
                                            pkg: CONSTANT.format(version=v(8), defect="ref-leak")}),
        commit(repo, 10, "release 0.2", {"pyproject.toml": PYPROJECT.format(version="0.2.0")}),
    ]
    return shas


SUITE = """# bisect tests: two short in-context voice clones, batched together at concurrency 2
name: bisect-tiny
model: tiny
decode:
  do_sample: false
  subtalker_dosample: false
  repetition_penalty: 1.0
  max_new_tokens: 8
  seed: 0
chunks: {{initial_frames: 1, frames: 25}}
voices:
  - {{id: alba, wav: {voices}/alba.wav, transcript_file: {voices}/alba.txt, mode: icl}}
  - {{id: bruno, wav: {voices}/bruno.wav, transcript_file: {voices}/bruno.txt, mode: icl}}
segments:
  - {{id: s1, text: "Good morning.", language: English, task: voice_clone, voice: alba}}
  - {{id: s2, text: "See you soon.", language: English, task: voice_clone, voice: bruno}}
"""


def write_suite(path: Path) -> Path:
    path.write_text(SUITE.format(voices=VOICES))
    return path
