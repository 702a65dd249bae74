"""The GPU host's placement and the checks that run before any model work, on this CPU machine.

No GPU here: where a test needs `nvidia-smi`, it puts a test double of that name first on PATH
(FAKE_SMI: answers the queries difftest makes and logs its arguments). The runner's own
refusal without a GPU runs the real reference runner."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from reference_support import all_models, reference_python, tiny  # noqa: F401  (tiny: a fixture)

from difftest.engines import start
from difftest.engines.reference import ReferenceOptions, never_stops, runner_argv, runner_env
from difftest.errors import BadInput, InfraError
from difftest.process import placement
from difftest.run import RunOptions
from difftest.commands.run import add_run_parser, vllm_omni_settings
from difftest.suites.checkpoints import check_suite, problems
from difftest.suites.suite import load_suite

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30

FAKE_SMI = """#!/bin/sh
# test double for nvidia-smi: one GPU model, MEMORY_MIB of memory, every call logged
echo "$@" >> "$SMI_LOG"
case "$1" in
  --query-gpu=memory.total) echo "${MEMORY_MIB:-81920}" ;;
  --query-gpu=name) echo "NVIDIA H200" ;;
esac
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "smi.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SMI_LOG", str(log))
    return log


# --- devices ---

@pytest.mark.parametrize("text, kind, index", [("cpu", "cpu", None), ("cuda", "cuda", 0), ("CUDA:3", "cuda", 3)])
def test_device_names(text, kind, index):
    d = placement.parse_device(text)
    assert (d.kind, d.index) == (kind, index)


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:-1", "cuda:1,2", ""])
def test_bad_device_names_are_refused(text):
    with pytest.raises(BadInput, match="expected cpu, cuda or cuda:N"):
        placement.parse_device(text)


def test_candidate_gpus_default_to_the_references():
    assert placement.parse_gpus("1,2") == (1, 2) and placement.parse_gpus(None) == ()
    for bad in ("1,2,3", "a", "1,", "-1"):
        with pytest.raises(BadInput, match="--candidate-devices"):
            placement.parse_gpus(bad)
    assert placement.candidate_gpus((), placement.parse_device("cuda:2")) == (2,)  # one shared GPU
    assert placement.candidate_gpus((), placement.parse_device("cpu")) == (0,)
    assert placement.candidate_gpus((4, 5), placement.parse_device("cuda:2")) == (4, 5)
    assert placement.stage_devices((4, 5)) == ("0", "1") and placement.stage_devices((4,)) == ("0", "0")


def test_the_reference_runner_sees_only_its_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    opts = ReferenceOptions(device="cuda:3")
    argv = runner_argv(Path("/py"), ["/m"], opts)
    assert argv[argv.index("--device") + 1] == "cuda"  # inside, its one GPU is cuda:0
    assert runner_env(opts)["CUDA_VISIBLE_DEVICES"] == "3" and runner_env(opts)["HF_HUB_OFFLINE"] == "1"
    assert runner_env(ReferenceOptions(device="cpu"))["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # left as it was


def test_the_runner_names_the_gpu_it_was_given(fake_smi, monkeypatch):
    from runners.reference import environment

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert environment.cuda_device_name() == "NVIDIA H200"
    assert fake_smi.read_text().split()[-1] == "2"  # was always -i 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert environment.visible_gpu() == "0"


def test_the_reference_runner_refuses_cuda_without_a_gpu_before_loading(tiny):
    cmd = [str(reference_python()), "-m", "runners.reference", "--model", all_models(tiny)[0], "--device", "cuda"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "5"})
    assert r.returncode == 3, r.stderr
    assert "no NVIDIA GPU is visible" in r.stderr and "CUDA_VISIBLE_DEVICES=5" in r.stderr
    assert "loaded" not in r.stderr


# --- memory on a shared GPU ---

def test_a_shared_gpu_leaves_room_for_the_reference():
    # 100 GiB, the reference holds 25: 0.85 - 0.25 = 0.6 for the two stages of one server
    assert placement.stage_memory_fractions((0,), 1, 0, 25 * GiB, 100 * GiB) == (0.3, 0.3)
    assert placement.stage_memory_fractions((1,), 1, 0, 25 * GiB, 100 * GiB) == (0.425, 0.425)  # own GPU
    assert placement.stage_memory_fractions((0, 1), 1, 0, 25 * GiB, 100 * GiB) == (0.6, 0.85)  # talker beside it
    assert placement.stage_memory_fractions((0,), 3, 0, 25 * GiB, 100 * GiB) == (0.1, 0.1)  # three servers


def test_a_reference_that_fills_the_gpu_is_refused_with_the_fix():
    with pytest.raises(BadInput, match="--candidate-devices"):
        placement.stage_memory_fractions((0,), 1, 0, 84 * GiB, 100 * GiB)  # 0.5 GiB a stage
    with pytest.raises(InfraError, match="nvidia-smi"):
        placement.stage_memory_fractions((0,), 1, 0, 8 * GiB, None)


def test_reference_memory_counts_weights_not_configs(tmp_path):
    m = tmp_path / "ckpt"
    (m / "speech_tokenizer").mkdir(parents=True)
    (m / "model.safetensors").write_bytes(b"\0" * (3 << 20))
    (m / "speech_tokenizer" / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    (m / "config.json").write_text("{}" + " " * (5 << 20))
    assert placement.reference_bytes([str(m)]) == placement.REFERENCE_OVERHEAD + (4 << 20)
    assert placement.reference_bytes(["Qwen/Qwen3-TTS-12Hz-1.7B-Base"]) == (placement.REFERENCE_OVERHEAD
                                                                           + placement.REFERENCE_UNKNOWN)


# --- the command line to the candidate's options ---

def _args(*argv):
    import argparse

    p = argparse.ArgumentParser()
    add_run_parser(p.add_subparsers())
    return p.parse_args(["run", "suite.yaml", "--candidate", "vllm-omni", "--out", "o", *argv])


def test_gpu_flags_reach_the_candidate():
    a = _args("--reference-device", "cuda:1")
    assert a.device == "cuda:1"
    s = vllm_omni_settings(a)
    assert s["device"] == "cuda" and s["gpus"] == ()  # the reference's GPU, shared (resolved at start)
    s = vllm_omni_settings(_args("--candidate-devices", "2,3", "--enforce-eager", "--batch-invariant"))
    assert (s["device"], s["gpus"], s["enforce_eager"], s["batch_invariant"]) == ("cuda", (2, 3), True, True)
    assert vllm_omni_settings(_args())["device"] == "cpu"
    with pytest.raises(BadInput, match="--candidate-device cuda"):
        vllm_omni_settings(_args("--candidate-device", "cpu", "--candidate-devices", "1"))
    with pytest.raises(SystemExit) as e:
        _args("--reference-device", "gpu0")
    assert e.value.code == 2


def _setup(tmp_path, suite_file="smoke.yaml", device="cuda:1", models=None):
    suite = load_suite(REPO / "cases" / "suites" / suite_file)
    opts = RunOptions(reference=ReferenceOptions(device=device), vllm_omni={"device": "cuda"})
    return start.Setup(tmp_path, models or [str(_fake_ckpt(tmp_path / "base", "base"))], Path("/py"), suite, opts)


def _fake_ckpt(folder: Path, mtype: str, speakers=(), languages=("english", "german"), weights=0, tiny=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"tts_model_type": mtype, "talker_config": {
        "spk_id": {s: i for i, s in enumerate(speakers)}, "codec_language_id": {x: i for i, x in enumerate(languages)}}}))
    if weights:
        (folder / "model.safetensors").write_bytes(b"\0" * weights)
    if tiny is not None:
        (folder / "difftest-checkpoint.json").write_text(json.dumps({"format": "difftest.checkpoint/1", **tiny}))
    return folder


def test_the_candidate_shares_the_references_gpu_with_room_for_it(tmp_path, fake_smi, monkeypatch):
    monkeypatch.setenv("MEMORY_MIB", str(16 * 1024))  # a 16 GiB GPU
    setup = _setup(tmp_path, models=[str(_fake_ckpt(tmp_path / "b", "base", weights=6 << 20))])
    opts, _ = start._vllm_omni_options(start.CandidateSpec.parse("vllm-omni"), setup)
    assert opts.gpus == (1,)
    need = (placement.REFERENCE_OVERHEAD + (6 << 20)) / (16 * GiB)
    assert opts.memory_fractions == (round((0.85 - need) / 2, 3),) * 2
    assert "-i 1" in fake_smi.read_text()  # the reference's GPU, not GPU 0
    setup.opts.vllm_omni["gpus"] = (2,)  # the candidate on a GPU of its own: the whole ceiling
    opts, _ = start._vllm_omni_options(start.CandidateSpec.parse("vllm-omni"), setup)
    assert opts.gpus == (2,) and opts.memory_fractions == (0.425, 0.425)


def test_length_capped_answers_only_for_a_tiny_build_that_never_stops(tmp_path):
    never = _fake_ckpt(tmp_path / "t0", "base", tiny={"type": "base", "eos_bias": 0.0})
    stops = _fake_ckpt(tmp_path / "t1", "base", tiny={"type": "base", "eos_bias": 4.0})
    real = _fake_ckpt(tmp_path / "real", "base")
    assert never_stops([str(never)]) and not never_stops([str(stops)]) and not never_stops([str(real)])
    assert not never_stops(["Qwen/Qwen3-TTS-12Hz-1.7B-Base"])
    # a tiny suite served by real weights (--reference-model) no longer turns it on
    setup = _setup(tmp_path, device="cpu", models=[str(real)])
    setup.opts.vllm_omni["device"] = "cpu"
    opts, _ = start._vllm_omni_options(start.CandidateSpec.parse("vllm-omni"), setup)
    assert opts.accept_length_finish is False
    setup.models = [str(never)]
    assert start._vllm_omni_options(start.CandidateSpec.parse("vllm-omni"), setup)[0].accept_length_finish


# --- the suite against its checkpoints ---

SUITE = """
name: fit
model: tiny
decode: {repetition_penalty: 1.0, max_new_tokens: 8, seed: 0}
segments:
  - {id: cv-ok, text: "Hello.", language: English, task: custom_voice, speaker: alice}
  - {id: cv-typo, text: "Hello.", language: English, task: custom_voice, speaker: alcie}
  - {id: cv-lang, text: "Bonjour.", language: French, task: custom_voice, speaker: alice}
  - {id: vd, text: "Hello.", language: English, task: voice_design, instructions: "A calm voice."}
"""


def test_every_unservable_segment_is_named_before_model_work(tmp_path):
    path = tmp_path / "fit.yaml"
    path.write_text(SUITE)
    suite = load_suite(path)
    cv = _fake_ckpt(tmp_path / "cv", "custom_voice", speakers=("Alice", "bob"))
    found = problems(suite, [str(cv)])
    assert len(found) == 3
    assert "cv-typo: speaker 'alcie'" in found[0] and "alice, bob" in found[0]
    assert "cv-lang: language 'French'" in found[1]
    assert "vd: task voice_design needs a voice_design checkpoint" in found[2]
    vd = _fake_ckpt(tmp_path / "vd", "voice_design")
    with pytest.raises(BadInput, match="cv-typo"):
        check_suite(suite, [str(cv), str(vd)])
    assert problems(suite, ["Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign"]) == []


def test_difftest_run_refuses_such_a_suite_before_starting_anything(tmp_path):
    path = tmp_path / "fit.yaml"
    path.write_text(SUITE)
    cv = _fake_ckpt(tmp_path / "cv", "custom_voice", speakers=("alice",))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "difftest", "run", str(path), "--candidate", "cpu-engine",
                        "--reference-model", str(cv), "--reference-python", "/bin/false", "--out", str(out),
                        "--no-mlflow"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "cv-typo" in r.stderr and "voice_design checkpoint" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "logs" / "reference-runner.log").exists()  # no runner was started


REAL_SPEAKERS = {"vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna", "sohee"}


@pytest.mark.parametrize("name, mtype", [("real-base", "base"), ("real-customvoice", "custom_voice"),
                                         ("real-voicedesign", "voice_design")])
def test_the_real_weight_suites_name_released_checkpoints_of_their_tasks(name, mtype):
    from difftest.suites.checkpoints import TYPE_OF_TASK, checkpoint_type

    suite = load_suite(REPO / "cases" / "suites" / f"{name}.yaml")
    assert suite.model.startswith("Qwen/Qwen3-TTS-12Hz-1.7B-") and checkpoint_type(suite.model) == mtype
    assert {TYPE_OF_TASK[s.task] for s in suite.segments} == {mtype} and problems(suite, [suite.model]) == []
    assert {s.speaker.lower() for s in suite.segments if s.speaker} <= REAL_SPEAKERS
    for s in suite.segments:  # a budget a real talker stops within, not a length
        assert 256 <= s.decode["max_new_tokens"] <= 1024 and s.decode["repetition_penalty"] == 1.05
