"""The pytest plugin (difftest/pytest_plugin.py, a `pytest11` entry point) used the way a vLLM-Omni
test would use it: one test file, one fixture, the candidate chosen on the command line. Against
the clean CPU test engine it passes; against the seed's leak planted in it, it fails and prints the
segment, chunk, stage, donor and the two code vectors where they part. Real qwen-tts; each run of
the sample is its own pytest process."""

from __future__ import annotations

import importlib.metadata as md
import json
import re
from pathlib import Path

import pytest
from reference_support import reference_python

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parents[1]

SAMPLE = '''
import pytest


@pytest.mark.difftest
def test_serving_at_4_says_what_qwen_tts_says(difftest_compare):
    report = difftest_compare("{suite}", concurrency=4, repeat=False)
    assert report["verdict"] == "pass"
'''


@pytest.fixture(scope="module")
def registered():
    if "difftest" not in {e.name for e in md.entry_points(group="pytest11")}:
        pytest.fail("the difftest pytest plugin is not registered in this environment: reinstall difftest "
                    "(pip install -e '.[test]'), which registers its pytest11 entry point", pytrace=False)


@pytest.mark.heavy
def test_the_sample_passes_on_the_clean_engine_and_prints_the_divergence_on_the_leak(pytester, registered, tmp_path):
    reference_python()
    pytester.makepyfile(test_sample=SAMPLE.format(suite=REPO / "cases" / "suites" / "smoke.yaml"))
    store = tmp_path / "store"
    clean = pytester.runpytest_subprocess("--difftest-candidate", "cpu-engine", "--difftest-store", str(store),
                                          "-p", "no:cacheprovider", timeout=900)
    clean.assert_outcomes(passed=1)
    leak = pytester.runpytest_subprocess("--difftest-candidate", "cpu-engine:ref-leak", "--difftest-store", str(store),
                                         "-p", "no:cacheprovider", timeout=900)
    leak.assert_outcomes(failed=1)
    text = leak.stdout.str()
    assert "difftest: difftest CPU test engine (not vLLM-Omni) at concurrency 4 against qwen-tts at 1: fail" in text, \
        text[-3000:]
    hits = [ln for ln in text.splitlines() if ": contamination at chunk 0, " in ln]
    assert hits and all("stage handoff, donor smoke-0" in ln for ln in hits), text[-3000:]
    # the vectors where the two part: the reference prefix the vocoder got is another request's
    at = text.index("reference prefix at the vocoder, frame")
    ours, theirs = (re.sub(r"^E\s+", "", ln).split(None, 1) for ln in text[at:].splitlines()[1:3])  # pytest's "E"
    assert ours[0] == "qwen-tts" and theirs[0] == "candidate"
    a, b = json.loads(ours[1]), json.loads(theirs[1])
    assert len(a) == len(b) == 16 and a != b
