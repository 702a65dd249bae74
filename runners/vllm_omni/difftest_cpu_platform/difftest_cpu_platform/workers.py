"""Stage workers: vLLM's CPUWorker (device, gloo, memory) driving vLLM-Omni's model runners.

Runner MRO, vLLM-Omni first: `_CPURunner -> GPU{AR,Generation}ModelRunner ->
OmniGPUModelRunner -> ... -> CPUModelRunner -> GPUModelRunner`. So
`load_model` and the payload hooks are vLLM-Omni's, and the buffers,
KV-cache setup and torch.cuda stand-ins are vLLM's CPU runner's.

What vLLM-Omni 0.30.0 needs on the CPU, each handled below and found by
running it (docs/vllm-omni.md):
1. the talker's attention head size must be one vLLM's CPU attention kernel
   has (32, 64, 80, ...): refused at start, not at the first request;
2. the Qwen3-TTS talker runs only in bfloat16 (its embeddings are hard-coded
   bf16; float32 crashes in the first decode step): refused at start;
3. the v1 model runner: MRv2 with a CPU worker hangs requests silently:
   refused at start;
4. `max_cudagraph_capture_size` is None on the CPU and vLLM-Omni takes
   `max()` of it: set to 0 before loading;
5. vLLM-Omni 0.30 validates that a worker class names its runner in
   `model_runner_cls`: both workers do.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

logger = init_logger(__name__)

TALKER_STAGES = ("qwen3_tts",)  # model_stage names whose talker embeddings are bf16-only


class _CPURunner:
    """Device hooks of vLLM-Omni's GPU runners, answered for the CPU."""

    def _init_device_properties(self) -> None:
        self.num_sms = None

    def _sync_device(self) -> None:
        return None

    def capture_model(self) -> int:
        return 0

    def _should_use_async_omni_output(self) -> bool:
        return False  # its copy streams are torch.cuda streams

    def load_model(self, *args, **kwargs) -> None:
        cc = self.compilation_config
        if cc.max_cudagraph_capture_size is None:
            cc.max_cudagraph_capture_size = 0  # OmniGPUModelRunner._init_talker_mtp takes max() with it
        return super().load_model(*args, **kwargs)


class CPUOmniARModelRunner(_CPURunner, GPUARModelRunner, CPUModelRunner):
    pass


class CPUOmniGenerationModelRunner(_CPURunner, GPUGenerationModelRunner, CPUModelRunner):
    pass


def cpu_attention_head_sizes() -> list[int]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def config_problems(vllm_config, *, ar_stage: bool) -> list[str]:
    """What in this stage's configuration cannot run on the CPU, each with its fix."""
    mc = vllm_config.model_config
    stage = getattr(mc, "model_stage", None)
    problems = []
    if getattr(mc, "use_v2_model_runner", False):
        problems.append(f"stage {stage!r} selects model runner v2, which hangs requests on the CPU worker: "
                        "set `model_runner: v1` in the deploy config")
    if ar_stage:
        head_dim = _head_dim(mc)
        sizes = cpu_attention_head_sizes()
        if head_dim is not None and head_dim not in sizes:
            problems.append(f"stage {stage!r}: attention head size {head_dim} is not one vLLM's CPU attention "
                            f"supports ({', '.join(map(str, sizes))}); use a checkpoint with head_dim 32 or more")
        if stage in TALKER_STAGES and str(mc.dtype) != "torch.bfloat16":
            problems.append(f"stage {stage!r} runs in {mc.dtype}, but the Qwen3-TTS talker's embeddings are "
                            "bfloat16-only in vLLM-Omni (float32 crashes at the first decode step): "
                            "set `dtype: bfloat16` for stage 0")
    return problems


def _head_dim(model_config) -> int | None:
    cfg = model_config.hf_text_config
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is None:
        heads = getattr(cfg, "num_attention_heads", None)
        hidden = getattr(cfg, "hidden_size", None)
        head_dim = hidden // heads if heads and hidden else None
    return int(head_dim) if head_dim is not None else None


class _CPUOmniWorker(OmniWorkerMixin, CPUWorker):
    model_runner_cls: type
    _ar_stage = False

    def init_device(self) -> None:
        problems = config_problems(self.vllm_config, ar_stage=self._ar_stage)
        if problems:
            raise RuntimeError("difftest CPU platform cannot run this stage:\n  - " + "\n  - ".join(problems))
        super().init_device()  # CPUWorker: cpu device, gloo group, seed (and a plain runner, replaced here)
        self.use_v2_model_runner = False
        self.model_runner = self.model_runner_cls(self.vllm_config, self.device)


class CPUOmniARWorker(_CPUOmniWorker):
    model_runner_cls = CPUOmniARModelRunner
    _ar_stage = True


class CPUOmniGenerationWorker(_CPUOmniWorker):
    model_runner_cls = CPUOmniGenerationModelRunner
