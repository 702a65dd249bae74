"""The Qwen3-Omni reference runner: transformers' Qwen3OmniMoeForConditionalGeneration, one chat turn at a time.

    python -m runners.reference_omni --model DIR [--dtype float32|bfloat16] [--threads 1]

It checks the checkpoint folder, announces itself (label, fingerprint, provenance) without importing
torch, loads the model at the first segment that is not cached, and speaks docs/runner-protocol.md
on stdout. Exit status 2: the checkpoint is missing or not a Qwen3-Omni one (the message names it).
"""

from __future__ import annotations

import argparse
import os
import sys

from runners.protocol import serve
from runners.reference.environment import host, log, package_versions, repo_commit
from runners.reference.scoring import VERSION as SCORE_VERSION
from runners.reference.service import DTYPES
from runners.reference_omni.engine import OmniEngine
from runners.reference_omni.service import LABEL, CheckpointError, OmniService, open_checkpoint

RUNNER_VERSION = 2  # 2: scoring, other dtypes, codes only. Bump when the runner's own behaviour changes what it writes for the same inputs
FINGERPRINT_PACKAGES = ("transformers", "torch", "tokenizers")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(prog="python -m runners.reference_omni", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Qwen3-Omni checkpoint folder")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the output depends on it)")
    args = ap.parse_args(argv)
    if args.threads < 1:
        print("runners.reference_omni: --threads must be at least 1", file=sys.stderr)
        return 2
    try:
        ckpt = open_checkpoint(args.model)
    except CheckpointError as e:
        print(f"runners.reference_omni: {e}", file=sys.stderr)
        return 2
    versions = package_versions(FINGERPRINT_PACKAGES)
    fingerprint = {"engine": LABEL, "runner_version": RUNNER_VERSION, "versions": versions,
                   "checkpoints": {ckpt.config["model_type"]: ckpt.sha256}, "dtype": args.dtype,
                   "device": args.device, "threads": args.threads}
    provenance = {"engine": LABEL, "versions": versions, "device": args.device, "dtype": args.dtype,
                  "threads": args.threads, "host": host(), "commit": repo_commit(),
                  "models": {ckpt.config["model_type"]: {"model": ckpt.spec, "path": str(ckpt.path),
                                                         "sha256": ckpt.sha256}}}
    service = OmniService(ckpt, OmniEngine(ckpt.path, args.device, args.dtype, args.threads), provenance)
    log(f"serving {ckpt.path} on {args.device} in {args.dtype}")
    return serve({"generate": service.generate, "decode": service.decode, "score": service.score},
                 {"label": LABEL, "fingerprint": fingerprint, "provenance": provenance, "score_version": SCORE_VERSION,
                  "generate_dtypes": list(DTYPES), "generate_waves": False, "generate_codes_only": True})


if __name__ == "__main__":
    sys.exit(main())
