"""Shared pieces of the vLLM-Omni server tests (tests/test_vllm_omni*.py).

These tests start the real vLLM-Omni in `.venv-vllm-omni`; without it they fail, and say how
to create it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from reference_support import build_checkpoints

REPO = Path(__file__).resolve().parents[1]
OMNI_PYTHON = REPO / ".venv-vllm-omni" / "bin" / "python"
EOS_BIAS = "3"  # vLLM-Omni refuses (HTTP 500) a voice clone that reaches max_new_tokens without EOS
FRAME = 1920
Q16 = 1 / 32768  # one step of the 16-bit WAV the server returns


def omni_python() -> Path:
    if not OMNI_PYTHON.exists():
        pytest.fail(f"{OMNI_PYTHON} is missing: run runners/vllm_omni/make_env.sh first "
                    f"(these tests start the real vLLM-Omni server in that environment)", pytrace=False)
    return OMNI_PYTHON


def run_in_env(args: list[str], timeout: float = 300) -> dict:
    """Run the environment's interpreter; its last stdout line that is a JSON object is the answer
    (vLLM logs to stdout too)."""
    r = subprocess.run([str(omni_python()), *args], cwd=REPO, capture_output=True, text=True, check=False,
                       timeout=timeout, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="session")
def voice_clone_checkpoint(tmp_path_factory) -> Path:
    """The seed-0 tiny Base checkpoint with an EOS bias (stops after 2-14 frames on the smoke suite).
    The builder keeps an intact build, so a second module's call costs a hash check."""
    out = tmp_path_factory.getbasetemp() / f"tiny-base-eos{EOS_BIAS}"
    r = build_checkpoints(out, "--type", "base", "--eos-bias", EOS_BIAS)
    assert r.returncode == 0, r.stderr[-3000:]
    return out
