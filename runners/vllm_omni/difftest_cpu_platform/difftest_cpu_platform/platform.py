"""The platform: vLLM's CpuPlatform for everything vLLM asks, plus the hooks vLLM-Omni asks for.

`OmniPlatform` declares its device hooks as raising stubs, and it comes first
in the MRO, so every one of them that the serve path reaches is answered here;
inheriting CpuPlatform alone would not do it.
"""

from __future__ import annotations

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

import difftest_cpu_platform as _plugin
from runners.vllm_omni.difftest_cpu_platform.difftest_cpu_platform.versions import refusal


class _NoGraphCapture:
    """Graph wrapper for a platform without graphs: vLLM-Omni only isinstance-checks it on CPU."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("difftest CPU platform: graph capture is not available on the CPU")


class DifftestCPUOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT

    # --- workers (stage 0 talker: AR; stage 1 code2wav: generation) ---
    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "difftest_cpu_platform.workers.CPUOmniARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return "difftest_cpu_platform.workers.CPUOmniGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    # --- no compilation, no graphs ---
    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        return False

    @classmethod
    def get_graph_wrapper_cls(cls) -> type:
        return _NoGraphCapture

    # --- the device is the host ---
    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    # --- diffusion pipelines are out of scope ---
    @classmethod
    def get_diffusion_worker_cls(cls) -> str:
        raise NotImplementedError("difftest CPU platform: diffusion stages are not supported (TTS stages only)")

    @classmethod
    def get_diffusion_model_runner_cls(cls) -> str:
        raise NotImplementedError("difftest CPU platform: diffusion stages are not supported (TTS stages only)")


class UnsupportedReleasePlatform(DifftestCPUOmniPlatform):
    """What detection answers on a vLLM-Omni release the plugin was not written for: it refuses to exist."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(refusal(*_plugin.installed_versions()) or "difftest CPU platform: unsupported release")
