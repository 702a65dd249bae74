"""Where each process runs on a GPU host: the reference runner and the vLLM-Omni stages.

    --reference-device cpu | cuda | cuda:N   the reference runner (cuda means cuda:0; N is the host's index)
    --candidate-devices N[,M]                the candidate's GPUs: one for both stages, or talker,vocoder;
                                             default: the reference's GPU (the mission: one shared GPU)

Each process sees only its own GPUs (CUDA_VISIBLE_DEVICES), so inside it the
device is always cuda:0, and vLLM-Omni's stage `devices` are indices into that
list. On a shared GPU the vLLM stages' memory fractions leave room for the
reference models, which stay resident for scoring and cross-decodes: vLLM takes
its `gpu_memory_utilization` of the whole device, not of what is free.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput, InfraError

GiB = 1 << 30
CEILING = 0.85  # of a GPU's memory, for everything difftest puts on it; the rest is the driver's and torch's
REFERENCE_OVERHEAD = 2 * GiB  # CUDA context, the tokenizer's activations, a decode's workspace
REFERENCE_UNKNOWN = 10 * GiB  # a checkpoint not on this disk (a hub id): a 1.7B model in float32 and its tokenizer
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
MIN_STAGE_BYTES = 2 * GiB  # a vLLM stage's CUDA context, a tiny model's weights and some KV cache


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" or "cuda"
    index: int | None = None  # the host's GPU index (what nvidia-smi and CUDA_VISIBLE_DEVICES say)

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def parse_device(text: str, what: str = "--reference-device") -> Device:
    t = (text or "").strip().lower()
    if t == "cpu":
        return Device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", t)
    if not m:
        raise BadInput(f"{what} {text!r}: expected cpu, cuda or cuda:N")
    return Device("cuda", int(m.group(1) or 0))


def parse_gpus(text: str | None, what: str = "--candidate-devices") -> tuple[int, ...]:
    """'1' or '1,2' -> (1,) or (1, 2): one GPU for both stages, or the talker's and the vocoder's."""
    if text is None or str(text).strip() == "":
        return ()
    parts = [p.strip() for p in str(text).split(",")]
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 2:
        raise BadInput(f"{what} {text!r}: expected one GPU index (both stages) or two (talker,vocoder), e.g. 1 or 1,2")
    return tuple(int(p) for p in parts)


def candidate_gpus(explicit: tuple[int, ...], reference: Device) -> tuple[int, ...]:
    """The candidate's GPUs: as given, else the reference's GPU, else GPU 0."""
    if explicit:
        return tuple(explicit)
    return (reference.index if reference.kind == "cuda" and reference.index is not None else 0,)


def visible_devices(gpus) -> str:
    return ",".join(str(g) for g in gpus)


def stage_devices(gpus: tuple[int, ...]) -> tuple[str, str]:
    """The deploy's `devices` for (talker, vocoder): indices into the server's CUDA_VISIBLE_DEVICES."""
    return ("0", "1") if len(gpus) == 2 else ("0", "0")


def reference_bytes(models: list[str]) -> int:
    """What the reference runner keeps on its GPU: its checkpoints' weight files (speech tokenizer
    included) and a fixed overhead; a model not on this disk counts as REFERENCE_UNKNOWN."""
    total = REFERENCE_OVERHEAD
    for m in models:
        folder = Path(m)
        if not folder.is_dir():
            total += REFERENCE_UNKNOWN
            continue
        total += sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    return total


def stage_memory_fractions(gpus: tuple[int, ...], servers: int, reference_gpu: int | None,
                           reference_need: int, gpu_total: int | None) -> tuple[float, float]:
    """gpu_memory_utilization for (talker, vocoder) of each of `servers` servers on `gpus`.

    Every stage on a GPU gets an equal share of CEILING, less what the reference holds there when
    it shares that GPU. BadInput when the reference leaves no room (the user can move the candidate)."""
    talker_gpu, vocoder_gpu = gpus[0], gpus[-1]
    fractions = []
    for gpu in (talker_gpu, vocoder_gpu):
        stages = servers * (2 if talker_gpu == vocoder_gpu else 1)
        room = CEILING
        if reference_gpu is not None and gpu == reference_gpu:
            if not gpu_total:
                raise InfraError(f"cannot read GPU {gpu}'s memory (nvidia-smi), needed to leave room for the "
                                 f"reference beside the candidate")
            room -= reference_need / gpu_total
        share = room / stages
        if gpu_total and share * gpu_total < MIN_STAGE_BYTES:
            raise BadInput(f"GPU {gpu}: the reference needs {reference_need / GiB:.1f} GiB of {gpu_total / GiB:.1f} "
                           f"GiB, leaving {max(share, 0) * gpu_total / GiB:.1f} GiB per vLLM stage; put the candidate on another GPU "
                           f"(--candidate-devices) or the reference elsewhere (--reference-device)")
        fractions.append(round(share, 3))
    return fractions[0], fractions[1]


def nvidia_smi(query: str, gpu) -> str | None:
    """One nvidia-smi field of the host's GPU `gpu` (an index or UUID), or None where there is none."""
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", str(gpu)],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = r.stdout.strip().splitlines() if r.returncode == 0 else []
    return lines[0].strip() if lines else None


def gpu_total_bytes(gpu: int) -> int | None:
    mib = nvidia_smi("memory.total", gpu)
    try:
        return int(float(mib)) << 20 if mib else None
    except ValueError:
        return None


def gpu_env(gpus) -> dict:
    """The environment that confines a process to these GPUs."""
    return {"CUDA_VISIBLE_DEVICES": visible_devices(gpus)}


def device_arg(text: str) -> str:
    """argparse type for --reference-device: 'cpu' or 'cuda:N' (a bad one is a usage error, exit 2)."""
    try:
        return str(parse_device(text))
    except BadInput as e:
        raise argparse.ArgumentTypeError(str(e)) from None
