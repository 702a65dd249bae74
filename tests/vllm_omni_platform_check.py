"""Run by the vLLM-Omni environment's interpreter (tests/test_vllm_omni.py): the CPU platform
plugin's checks, without a server.

    .venv-vllm-omni/bin/python tests/vllm_omni_platform_check.py   -> one JSON line on stdout
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def stage_config(stage="qwen3_tts", head_dim=32, dtype="torch.bfloat16", v2=False):
    import torch

    dt = {"torch.bfloat16": torch.bfloat16, "torch.float32": torch.float32}[dtype]
    mc = SimpleNamespace(model_stage=stage, use_v2_model_runner=v2, dtype=dt,
                         hf_text_config=SimpleNamespace(head_dim=head_dim, num_attention_heads=4, hidden_size=32))
    return SimpleNamespace(model_config=mc)


def main() -> int:
    print(json.dumps(checks()))
    return 0


def checks() -> dict:
    """Leaves vLLM-Omni's platform unresolvable (its last check fakes an unsupported release): run
    it last in a process."""
    import difftest_cpu_platform as plugin
    from difftest_cpu_platform import workers
    from vllm_omni.worker.omni_connector_validation import validate_worker_omni_connector

    out = {"detected": plugin.detect()}
    import vllm_omni.platforms as platforms

    out["platform"] = type(platforms.current_omni_platform).__name__
    # Constraint 5: vLLM-Omni's own validation of the workers' runner class.
    for name in ("CPUOmniARWorker", "CPUOmniGenerationWorker"):
        validate_worker_omni_connector(f"difftest_cpu_platform.workers.{name}", True)
    out["workers_validated"] = True
    # The runner MRO: vLLM-Omni's load_model first, vLLM's CPU runner below it.
    mro = [c.__name__ for c in workers.CPUOmniARModelRunner.__mro__]
    out["mro_omni_before_cpu"] = mro.index("OmniGPUModelRunner") < mro.index("CPUModelRunner") < mro.index(
        "GPUModelRunner")
    # Constraints 1-3, refused at stage start with their fix.
    out["problems"] = {
        "ok": workers.config_problems(stage_config(), ar_stage=True),
        "head_dim_8": workers.config_problems(stage_config(head_dim=8), ar_stage=True),
        "float32_talker": workers.config_problems(stage_config(dtype="torch.float32"), ar_stage=True),
        "float32_vocoder": workers.config_problems(stage_config(stage="code2wav", dtype="torch.float32"),
                                                   ar_stage=False),
        "runner_v2": workers.config_problems(stage_config(v2=True), ar_stage=True),
    }
    # An unsupported release: resolving the platform (the first thing `vllm serve --omni` does
    # when importing vLLM-Omni) raises the plugin's message.
    plugin.installed_versions = lambda: ("0.28.0", "0.28.0")
    platforms._current_omni_platform = None
    try:
        platforms.current_omni_platform  # noqa: B018
        out["unsupported_error"] = None
    except RuntimeError as e:
        out["unsupported_error"] = str(e)
    out["unsupported_detected"] = plugin.detect()
    return out


if __name__ == "__main__":
    sys.exit(main())
