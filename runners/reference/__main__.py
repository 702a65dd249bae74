"""The reference runner: the official qwen-tts package, one utterance at a time.

    python -m runners.reference --model DIR [--model DIR ...] [--device cpu|cuda]
                                [--dtype float32|bfloat16] [--threads 1]

Each --model is a checkpoint folder (or, on a host with the weights cached, a
Hugging Face id); its config.json's tts_model_type says which segments it
serves. The runner checks the folders, announces itself (label, fingerprint,
provenance) without importing torch, and loads a model only when a segment
that is not cached needs it. It speaks docs/runner-protocol.md on stdout.
Exit status 2: a checkpoint is missing or incomplete (the message names it).
"""

from __future__ import annotations

import argparse
import os
import sys

from runners.protocol import serve
from runners.reference.checkpoint import CheckpointError, open_checkpoints
from runners.reference.engine import QwenTTSEngine
from runners.reference.scoring import VERSION as SCORE_VERSION
from runners.reference.environment import cuda_device_name, host, log, package_versions, repo_commit, visible_gpu
from runners.reference.service import DTYPES, LABEL, ReferenceService

# Bump when the runner's own behaviour changes what it writes for the same inputs.
RUNNER_VERSION = 6  # 2: results record meta.lead_samples; 3: and ref_codes_bf16; 4: the talker's input_*;
#                     5: speaker_embedding_bf16; 6: the talker's assembled prompt (input_prompt_*)
FINGERPRINT_PACKAGES = ("qwen-tts", "transformers", "torch", "librosa")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m runners.reference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True,
                    help="checkpoint folder or cached Hugging Face id; repeat for other model types")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the output depends on it)")
    return ap.parse_args(argv)


def describe(checkpoints: dict, device: str, dtype: str, threads: int) -> tuple[dict, dict]:
    """(fingerprint, provenance): the first is everything that determines the outputs."""
    versions = package_versions()
    device_kind = device
    if device == "cuda":
        device_kind = f"cuda:{cuda_device_name() or 'unknown'}"
    fingerprint = {
        "engine": LABEL,
        "runner_version": RUNNER_VERSION,
        "versions": {p: versions.get(p) for p in FINGERPRINT_PACKAGES},
        "checkpoints": {c.model_type: c.sha256 for c in checkpoints.values()},
        "dtype": dtype,
        "device": device_kind,
        "threads": threads,
    }
    provenance = {
        "engine": LABEL,
        "versions": versions,
        "device": device_kind,
        "dtype": dtype,
        "threads": threads,
        "models": {c.model_type: {"model": c.spec, "path": str(c.path), "sha256": c.sha256}
                   for c in checkpoints.values()},
        "host": host(),
        "commit": repo_commit(),
    }
    return fingerprint, provenance


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    if args.threads < 1:
        print("runners.reference: --threads must be at least 1", file=sys.stderr)
        return 2
    try:
        checkpoints = open_checkpoints(args.model)
    except CheckpointError as e:
        print(f"runners.reference: {e}", file=sys.stderr)
        return 2
    if args.device == "cuda" and cuda_device_name() is None:
        # Before any model loads: a GPU host whose GPU is not visible here would otherwise fail at the
        # first segment, minutes later, with torch's message.
        print(f"runners.reference: --device cuda but no NVIDIA GPU is visible (nvidia-smi -i {visible_gpu()}; "
              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})", file=sys.stderr)
        return 3
    fingerprint, provenance = describe(checkpoints, args.device, args.dtype, args.threads)
    engine = QwenTTSEngine(checkpoints, device=args.device, dtype=args.dtype, threads=args.threads)
    service = ReferenceService(checkpoints, engine, provenance)
    log("serving " + ", ".join(f"{c.model_type} from {c.path}" for c in checkpoints.values())
        + f" on {args.device} in {args.dtype}")
    return serve({"generate": service.generate, "decode": service.decode, "score": service.score},
                 {"label": LABEL, "fingerprint": fingerprint, "provenance": provenance, "score_version": SCORE_VERSION,
                  "generate_dtypes": list(DTYPES), "generate_waves": True, "generate_codes_only": True,
                  "decode_dtypes": list(DTYPES)})


if __name__ == "__main__":
    import atexit

    code = main()
    # Everything is written (results are renamed into place before they are announced). Run the exit
    # handlers, then skip the interpreter's teardown: its garbage collection over torch's and
    # transformers' module graph took 1-2 s at every runner's close (runners/cpu_engine does the same).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)
