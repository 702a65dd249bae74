"""Run by the vLLM-Omni environment's interpreter (tests/test_vllm_omni.py): the capture wrappers'
check and the CPU platform plugin's check in one process, which imports vLLM-Omni once (about
10 s of CPU) instead of twice. Each stays runnable alone.

    .venv-vllm-omni/bin/python tests/vllm_omni_env_checks.py WORKDIR   -> one JSON line on stdout
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_omni_capture_check  # noqa: E402
import vllm_omni_platform_check  # noqa: E402

if __name__ == "__main__":
    out = {"capture": vllm_omni_capture_check.checks(Path(sys.argv[1]))}
    out["platform"] = vllm_omni_platform_check.checks()  # last: it leaves the platform unresolvable
    print(json.dumps(out))
