"""`difftest reference SUITE`: the reference alone, computed into the store (difftest/engines/reference.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..engines.reference import DEFAULT_PYTHON, PYTHON_ENV_VAR, ReferenceOptions, exit_code, run_reference
from ..errors import BadInput
from ..process.placement import device_arg
from ..results import ResultStore
from ..suites.suite import load_suite


def add_reference_parser(subparsers) -> argparse.ArgumentParser:
    ap = subparsers.add_parser("reference", help="compute (or find cached) qwen-tts reference results for a suite",
                               description="Compute (or find cached) qwen-tts reference results for a suite; "
                                           "prints one JSON summary.")
    ap.add_argument("suite", help="suite YAML file")
    ap.add_argument("--store", required=True, help="result store root")
    ap.add_argument("--model", action="append", default=[],
                    help="checkpoint folder or cached Hugging Face id, one per model type "
                         "(default: the suite's model; 'tiny' builds the seeded tiny set in the store)")
    ap.add_argument("--python", help=f"reference environment interpreter (default {DEFAULT_PYTHON}, or ${PYTHON_ENV_VAR})")
    ap.add_argument("--device", type=device_arg, default="cpu", metavar="cpu|cuda|cuda:N")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the waveform's last bits depend on it)")
    ap.add_argument("--log", type=Path, help="runner log file (default <store>/logs/qwen-tts-runner.log)")
    ap.add_argument("--timeout", type=float, default=900.0, help="longest silence from the runner, seconds")
    ap.set_defaults(func=cmd_reference)
    return ap


def cmd_reference(args) -> int:
    if args.threads < 1:
        raise BadInput("--threads must be at least 1")
    suite = load_suite(args.suite)
    from ..results import prepare_out

    prepare_out(args.store, "--store")
    options = ReferenceOptions(models=args.model, python=args.python, device=args.device, dtype=args.dtype,
                               threads=args.threads, log_path=args.log, timeout=args.timeout)
    run = run_reference(suite, args.store, options)
    summary = {"suite": suite.name, "store": str(run.config_dir), "fingerprint": run.fingerprint, "segments": {}}
    for seg in suite.segments:
        sid = seg.id
        if sid in run.results:
            stem = ResultStore.stem(run.config_dir, sid, seg.hash)
            summary["segments"][sid] = {
                "status": "cached" if sid in run.cached else "computed",
                "path": str(stem.with_name(stem.name + ".json")),
                "audio_seconds": round(run.results[sid].seconds, 3)}
        else:
            err = run.errors[sid]
            summary["segments"][sid] = {"status": "error", "kind": err["kind"], "error": err["message"]}
    print(json.dumps(summary, indent=1))
    return exit_code(run)
