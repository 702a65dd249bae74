"""scripts/gpu-check.sh and difftest.commands.gpucheck on this CPU machine: the "no GPU" answer (no nvidia-smi,
a failing one, a hung one), the memory sampler and the summary. Where an nvidia-smi must answer,
a test double of that name is put first on PATH (it prints what the real one prints for the query).
The summary of a real run is checked in tests/test_vllm_omni_offline.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from difftest.commands import gpucheck

REPO = Path(__file__).resolve().parents[1]


def _fake_smi(tmp_path: Path, body: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n# test double for nvidia-smi\n" + body)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin"}


def _script(env: dict, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), str(out)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)


def test_without_nvidia_smi_the_check_says_no_gpu_and_exits_3(tmp_path):
    r = _script({**os.environ, "PATH": "/usr/bin:/bin"}, tmp_path / "out")
    assert r.returncode == 3, r.stderr
    got = json.loads(r.stdout)  # exactly one JSON line on stdout
    assert got == {"ok": False, "error": "no NVIDIA GPU: nvidia-smi is not on PATH (this script needs a GPU host)"}
    assert not (tmp_path / "out").exists()  # nothing installed, nothing written


def test_a_driver_without_devices_is_no_gpu(tmp_path):
    env = _fake_smi(tmp_path, 'echo "No devices were found"; exit 6\n')
    r = _script(env, tmp_path / "out")
    assert r.returncode == 3 and json.loads(r.stdout)["error"].startswith("no NVIDIA GPU: No devices were found")


def test_a_hung_nvidia_smi_is_no_gpu_not_a_hang(tmp_path, monkeypatch):
    env = _fake_smi(tmp_path, "sleep 60\n")
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setattr(gpucheck, "SMI_TIMEOUT", 1)
    found, why = gpucheck.gpus()
    assert found == [] and why == "no NVIDIA GPU: nvidia-smi did not answer in 1 s"


def test_gpus_are_listed(tmp_path, monkeypatch):
    env = _fake_smi(tmp_path, 'echo "GPU 0: NVIDIA H200 (UUID: GPU-1)"; echo "GPU 1: NVIDIA H200 (UUID: GPU-2)"\n')
    monkeypatch.setenv("PATH", env["PATH"])
    assert gpucheck.gpus() == (["GPU 0: NVIDIA H200 (UUID: GPU-1)", "GPU 1: NVIDIA H200 (UUID: GPU-2)"], None)


def test_memory_is_sampled_per_process_and_its_peak_kept(tmp_path, monkeypatch):
    ref = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "runners.reference"])
    try:
        other = os.getpid()
        env = _fake_smi(tmp_path, f'n=$(cat "{tmp_path}/n" 2>/dev/null || echo 0); echo $((n+1)) > "{tmp_path}/n"\n'
                                  f'echo "{ref.pid}, $(( n == 1 ? 3000 : 1000 ))"; echo "{other}, 20480"\n')
        monkeypatch.setenv("PATH", env["PATH"])
        samples = tmp_path / "mem.jsonl"
        gpucheck.sample(samples, interval=0.0, rounds=3)
    finally:
        ref.kill()
        ref.wait()
    with open(samples, "a") as f:
        f.write('{"t": 1, "pid": 12')  # cut short when the sampler was stopped
    peaks = gpucheck.memory_peaks(samples)
    assert int((tmp_path / "n").read_text()) == 3
    assert peaks[f"reference runner (qwen-tts) [{ref.pid}]"] == 3000  # of 1000, 3000, 1000: the peak
    assert [v for k, v in peaks.items() if k.startswith(f"pid {other}:")] == [20480.0]


def test_a_run_without_a_report_is_not_ok(tmp_path):
    got = gpucheck.summary(tmp_path / "missing", installs={"installs": 300})
    assert got["ok"] is False and "report.json" in got["error"] and got["installs_s"] == {"installs": 300}


@pytest.mark.parametrize("exit_code, ok", [(0, True), (1, True), (3, False)])
def test_the_summary_reads_the_verdicts_at_1_and_n(tmp_path, exit_code, ok):
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text(json.dumps({
        "exit_code": exit_code, "verdict": "fail" if exit_code else "pass", "concurrency": 4, "difftest_version": "0.1.0",
        "counts": {"contamination": 2, "identical": 2}, "failing": ["s1", "s2"], "suite": {"name": "smoke"},
        "reference": {"fingerprint": {"device": "cuda:NVIDIA H200"},
                      "provenance": {"versions": {"qwen-tts": "0.1.1", "torch": "2.13.0"}}},
        "candidate": {"device": "cuda", "gpus": [0], "talker_dtype": "bfloat16", "vocoder_dtype": "float32",
                      "enforce_eager": {"0": None, "1": True}, "batch_invariant": False,
                      "versions": {"vllm_omni": "0.30.0", "vllm": "0.30.0", "torch": "2.13.0"}},
        "at_concurrency_1": {"verdict": "pass", "segments": [{"id": f"s{i}", "verdict": "identical"} for i in range(4)]},
        "segments": [{"id": "s0", "comparisons": {"talker_prompt": {"worst_rel": 0.004, "allowed_rel": 0.05, "equal": True}}},
                     {"id": "s1", "comparisons": {"talker_prompt": {"worst_rel": 0.009, "allowed_rel": 0.05, "equal": True}}},
                     {"id": "s2", "comparisons": {}}],
        "measured_null": {"noise_model": {"dtype": "bfloat16", "scale": 1.5}},
        "provenance": {"timings": {"total_s": 99.5, "reference_s": 12.0}}}))
    got = gpucheck.summary(run, installs={"installs": 321}, wall_s=101.24, gpu_list=["GPU 0: NVIDIA H200"])
    assert got["ok"] is ok and got["exit_code"] == exit_code
    assert got["verdicts"] == {"c1": {"verdict": "pass", "counts": {"identical": 4}},
                               "c4": {"verdict": "fail" if exit_code else "pass",
                                      "counts": {"contamination": 2, "identical": 2}}}
    assert got["devices"] == {"reference": "cuda:NVIDIA H200", "candidate": "cuda", "candidate_gpus": [0]}
    assert got["settings"]["enforce_eager"] == {"0": None, "1": True}
    assert got["timings_s"] == {"total_s": 99.5, "reference_s": 12.0, "wall_s": 101.2}
    assert got["versions"]["qwen_tts"] == "0.1.1" and got["versions"]["vllm_omni"] == "0.30.0"
    # the CPU-measured allowances as the GPU's numerics meet them: the worst prompt row, the noise model
    assert got["numerics"] == {"prompt_compared": 2, "prompt_equal": 2, "prompt_worst_rel": 0.009,
                               "prompt_allowed_rel": 0.05, "noise_model": {"dtype": "bfloat16", "scale": 1.5}}
