"""difftest.engines.reference: a suite's reference results through the runner, with the store as cache."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from reference_support import REPO, all_models, reference_python, tiny, write_voice  # noqa: F401

from difftest.cli import main as difftest_main
from difftest.engines import reference
from difftest.errors import BadInput
from difftest.process.runner_client import RunnerProcess
from difftest.progress import Progress
from difftest.results import Result, ResultStore
from difftest.suites.suite import load_suite

SUITE = """\
name: ref-run
model: tiny
decode: {repetition_penalty: 1.0, max_new_tokens: 16, seed: 3}
voices:
  - {id: anna, wav: anna.wav, transcript: "A short reference sentence."}
segments:
  - {id: s1, text: "First sentence.", language: English, voice: anna}
  - {id: s2, text: "Second sentence, longer.", voice: anna, decode: {max_new_tokens: 24}}
  - {id: s3, text: "Third.", task: voice_design, instructions: "Slow and deep.", decode: {max_new_tokens: 24}}
  - {id: s4, text: "Nobody.", task: custom_voice, speaker: zed}
"""


@pytest.fixture()
def suite(tmp_path):
    d = tmp_path / "suite"
    d.mkdir()
    write_voice(d / "anna.wav", 1.1, 180.0, seed=4)
    (d / "suite.yaml").write_text(SUITE)
    return load_suite(d / "suite.yaml")


def _runner_children() -> list[int]:
    """Our own child processes that are reference runners (the runner client starts them)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid() and b"runners.reference" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


class KillRunnerAfterFirstResult(Progress):
    """A progress display that kill -9s the runner once the first segment is computed."""

    def segment(self, segment_id, **kw):
        super().segment(segment_id, **kw)
        if kw.get("error") is None and not kw.get("cached") and self.done == 1:
            pids = _runner_children()
            assert len(pids) == 1, pids
            os.kill(pids[0], signal.SIGKILL)


def test_dies_mid_suite_then_resumes_then_serves_from_the_store(tiny, suite, tmp_path, capsys, plain_processes):
    store = tmp_path / "store"
    options = reference.ReferenceOptions(models=all_models(tiny), python=str(reference_python()))

    # 1. The runner is killed after the first result: the rest are failures naming why.
    log1 = io.StringIO()
    run1 = reference.run_reference(suite, store, options, progress=KillRunnerAfterFirstResult(4, "reference", log1))
    assert isinstance(run1.results["s1"], Result) and run1.cached == set()
    assert list(run1.results) == ["s1"] and sorted(run1.errors) == ["s2", "s3", "s4"]
    for sid in ("s2", "s3", "s4"):
        failure = run1.errors[sid]
        assert (failure["kind"], failure["source"]) == ("infrastructure", "reference")
        assert "exited with status -9" in failure["message"] and "runner log tail" in failure["message"]
    assert run1.config_dir.parent == store and run1.config_dir.name.startswith("qwen-tts-")
    assert run1.config_dir.name == f"qwen-tts-{ResultStore.config_key(run1.fingerprint)[:16]}"
    text1 = log1.getvalue()
    assert "reference [1/4] s1: 1.20 s audio in" in text1 and "s2: ERROR no answer: runner exited" in text1

    # 2. A new run computes only what is missing; s1 comes from the store.
    log2 = io.StringIO()
    run2 = reference.run_reference(suite, store, options, progress=Progress(4, "reference", log2))
    assert run2.config_dir == run1.config_dir and run2.cached == {"s1"}
    assert run2.results["s1"].codes.tolist() == run1.results["s1"].codes.tolist()
    assert run2.results["s2"].codes.shape == (23, 16) and run2.results["s3"].codes.shape == (23, 16)
    assert run2.results["s3"].provenance["task"] == "voice_design"
    failure = run2.errors["s4"]
    assert failure["kind"] == "bad_input" and "zed" in failure["message"]
    lines = log2.getvalue().splitlines()
    assert lines[0] == "reference [1/4] s1: cached"
    assert any(line.startswith("reference [2/4] s2: 1.84 s audio in") for line in lines)
    assert lines[-1].startswith("reference: 4/4 segments, 1 cached, 1 failed, 3.7 s audio, RTF ")

    # 3. Everything cached, through the command line, with the suite's own `model: tiny`
    #    (the store's tiny set is already there: the builder keeps an intact build).
    shutil.copytree(tiny, store / "checkpoints" / reference.tiny_folder())
    capsys.readouterr()
    code = difftest_main(["reference", str(suite.path), "--store", str(store), "--python", str(reference_python())])
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert code == 2  # s4 is bad input
    assert summary["store"] == str(run1.config_dir)
    assert {k: v["status"] for k, v in summary["segments"].items()} == {
        "s1": "cached", "s2": "cached", "s3": "cached", "s4": "error"}
    assert Path(summary["segments"]["s2"]["path"]).is_file()
    assert "4/4 segments, 3 cached, 1 failed" in err

    # 4. A runner the caller owns (to cross-decode with afterwards) is used and left running.
    runner = RunnerProcess(reference.runner_argv(reference_python(), all_models(tiny), options), cwd=REPO)
    try:
        run4 = reference.run_reference(suite, store, options, runner=runner, progress=Progress(4, stream=io.StringIO()))
        assert run4.cached == {"s1", "s2", "s3"} and run4.errors["s4"]["kind"] == "bad_input"
        assert runner.alive
    finally:
        runner.close()


def test_a_checkpoint_the_runner_refuses_is_bad_input(tiny, suite, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny / "base", broken)
    (broken / "speech_tokenizer" / "preprocessor_config.json").unlink()
    options = reference.ReferenceOptions(models=[str(broken)], python=str(reference_python()))
    with pytest.raises(BadInput, match="speech_tokenizer/preprocessor_config.json"):
        reference.run_reference(suite, tmp_path / "store", options, progress=Progress(4, stream=io.StringIO()))


def test_missing_environment_says_how_to_make_it(tmp_path):
    with pytest.raises(BadInput, match="runners/reference/make_env.sh"):
        reference.reference_python(str(tmp_path / "nowhere" / "python"))


def test_tester_side_never_imports_an_engine():
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "qwen_tts", "vllm_omni", "transformers"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import difftest.engines.reference, difftest.progress
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_progress_on_a_terminal_rewrites_one_line():
    out = io.StringIO()
    p = Progress(3, "reference", out, tty=True)
    p.segment("a", seconds=1.0, audio_seconds=2.0)
    p.segment("b", cached=True)
    p.segment("c", error="voice wav x.wav: not found\nmore")
    p.close()
    text = out.getvalue()
    assert text.count("\n") == 2  # the error line and the final newline
    assert "\r\x1b[2Kreference: 1/3 segments, 2.0 s audio, RTF 0.50" in text
    assert "reference [3/3] c: ERROR voice wav x.wav: not found\n" in text
    assert text.endswith("reference: 3/3 segments, 1 cached, 1 failed, 2.0 s audio, RTF 0.50\n")
