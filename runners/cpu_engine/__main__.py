"""Start the difftest CPU test engine (not vLLM-Omni): vLLM-Omni's speech API over qwen-tts.

    .venv-reference/bin/python -m runners.cpu_engine --model DIR [--model DIR ...] --port P
        [--host 127.0.0.1] [--defect NAME] [--max-batch 8] [--batch-window-ms 50]
        [--subtalker-sampling JSON]

Each --model is a qwen-tts checkpoint folder (runners.reference.tiny_checkpoint
builds tiny ones); its tts_model_type says which task_type it serves. With
DIFFTEST_CAPTURE_DIR set, every request tagged `extra_params.difftest_tag`
leaves `<dir>/<tag>.npz` (codes, ref_codes, wav) before its answer is sent.
The models are loaded before the port opens: a healthy /health means ready.
Exit status 2: bad arguments or an unusable checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from runners.cpu_engine import ENGINE_NAME, LABEL, TALKER_CAPTURE, defects
from runners.cpu_engine.app import CAPTURE_ENV, build_server, subtalker_from_json
from runners.reference.checkpoint import CheckpointError, open_checkpoints


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m runners.cpu_engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, help="checkpoint folder; repeat for other model types")
    ap.add_argument("--port", type=int, required=True, help="TCP port (0: any free port, printed in the log)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--defect", default=None, choices=[*defects.DEFECTS, "none"],
                    help="plant a known defect (docs/cpu-engine.md); default: none, the clean engine")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--batch-window-ms", type=float, default=50.0)
    ap.add_argument("--talker-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the talker's and the encoders' dtype (the vocoder stays float32, as difftest serves "
                         "vLLM-Omni here): bfloat16 makes a correct engine with bf16 numerics, the measured "
                         "null's calibration (benchmarks/bench_null_false_flags.py)")
    ap.add_argument("--talker-capture", default="full", choices=TALKER_CAPTURE,
                    help="what the capture holds of the talker's side: full (its input and output), no-input (its "
                         "output only), none (codes, reference codes and audio only, as a URL candidate without "
                         "the talker's side): what difftest can judge with less evidence (issue 57)")
    ap.add_argument("--subtalker-sampling", default='{"do_sample": false}',
                    help='deploy-level sub-talker sampling, JSON: {"do_sample", "temperature", "top_k", "top_p"}')
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    from runners.cpu_engine.server import log

    if args.max_batch < 1:
        print("runners.cpu_engine: --max-batch must be at least 1", file=sys.stderr)
        return 2
    if args.batch_window_ms < 0:
        print("runners.cpu_engine: --batch-window-ms must be >= 0", file=sys.stderr)
        return 2
    defect = defects.check(args.defect)
    try:
        checkpoints = open_checkpoints(args.model)
    except CheckpointError as e:
        print(f"runners.cpu_engine: {e}", file=sys.stderr)
        return 2
    subtalker = subtalker_from_json(args.subtalker_sampling)
    capture_dir = os.environ.get(CAPTURE_ENV) or None
    log(f"starting: {LABEL}; defect: {defect or 'none (clean engine)'}; models: "
        + ", ".join(f"{c.model_type} from {c.path}" for c in checkpoints.values()))
    t0 = time.perf_counter()
    try:
        server, _ = build_server(checkpoints, defect, host_name=args.host, port=args.port, max_batch=args.max_batch,
                                 batch_window_ms=args.batch_window_ms, subtalker=subtalker, capture_dir=capture_dir,
                                 talker_dtype=args.talker_dtype, talker_capture=args.talker_capture)
    except OSError as e:
        print(f"runners.cpu_engine: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2

    def _stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _stop)
    log(f"models loaded in {time.perf_counter() - t0:.1f} s; max batch {args.max_batch}, batch window "
        f"{args.batch_window_ms:g} ms; capture: {capture_dir or 'off'}")
    log(f"listening on {server.url} (engine {ENGINE_NAME}, defect {defect or 'none'})")
    try:
        server.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    log("stopped")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written (captures are fsynced before their answers); skip the interpreter's
    # teardown, whose garbage collection over transformers' module graph takes seconds.
    os._exit(code)
