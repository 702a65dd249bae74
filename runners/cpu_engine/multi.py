"""Several CPU test engines in one process, one per defect, sharing one set of loaded models.

    .venv-reference/bin/python -m runners.cpu_engine.multi --model DIR [--model DIR ...]
        --serve DEFECT=PORT [--serve DEFECT=PORT ...] [--host 127.0.0.1] [--max-batch 8]
        [--batch-window-ms 50] [--subtalker-sampling JSON]

For test suites: importing qwen-tts costs seconds a process, so the negative
controls (`--serve ref-leak=0 --serve shared-rng=0 ...`, `none` for the clean
engine) share one. Each listener is exactly the engine `python -m
runners.cpu_engine --defect DEFECT` would be (same server, scheduler, batch
engine); only the models are shared, and batches of all listeners take turns
on them. Once every listener is up it prints one line per listener on stdout:
`{"defect": ..., "url": ...}`, then `{"ready": true}`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from runners.cpu_engine import LABEL, defects
from runners.cpu_engine.app import CAPTURE_ENV, build_server, subtalker_from_json
from runners.reference.checkpoint import CheckpointError, open_checkpoints
from runners.reference.engine import QwenTTSEngine


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m runners.cpu_engine.multi", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--serve", action="append", required=True, metavar="DEFECT=PORT",
                    help=f"one listener: DEFECT is none or one of {', '.join(defects.DEFECTS)}; PORT 0 picks one")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--batch-window-ms", type=float, default=50.0)
    ap.add_argument("--subtalker-sampling", default='{"do_sample": false}')
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    from runners.cpu_engine.server import log

    listeners = []
    for spec in args.serve:
        name, sep, port = spec.partition("=")
        try:
            listeners.append((defects.check(name), int(port) if sep else 0))
        except ValueError as e:
            print(f"runners.cpu_engine.multi: --serve {spec!r}: {e}", file=sys.stderr)
            return 2
    try:
        checkpoints = open_checkpoints(args.model)
    except CheckpointError as e:
        print(f"runners.cpu_engine.multi: {e}", file=sys.stderr)
        return 2
    subtalker = subtalker_from_json(args.subtalker_sampling)
    capture_dir = os.environ.get(CAPTURE_ENV) or None
    qwen = QwenTTSEngine(checkpoints, device="cpu", dtype="float32", threads=1)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library prints go to the log, the listener lines stay clean
    sys.stdout = sys.stderr
    # Every listener binds before any serves: a port taken meanwhile fails the whole process before
    # its first health answer, never after a health check on another listener has passed.
    built = []
    for defect, port in listeners:
        try:
            built.append((defect, build_server(checkpoints, defect, host_name=args.host, port=port,
                                               max_batch=args.max_batch, batch_window_ms=args.batch_window_ms,
                                               subtalker=subtalker, qwen=qwen, capture_dir=capture_dir)[0]))
        except OSError as e:
            print(f"runners.cpu_engine.multi: cannot listen on {args.host}:{port} for {defect or 'none'}: {e}",
                  file=sys.stderr)
            return 3
    servers = []
    for defect, server in built:
        servers.append(server.start())
        log(f"listening on {server.url} (defect {defect or 'none'})")
        proto.write(json.dumps({"defect": defect, "url": server.url}) + "\n")
    proto.write(json.dumps({"ready": True, "label": LABEL}) + "\n")
    proto.flush()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    stop.wait()
    # Each server's stop waits for its listener's and its scheduler's next poll (up to 0.3 s); one
    # after the other that was seconds for a dozen defects.
    stoppers = [threading.Thread(target=s.stop) for s in servers]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written (captures are fsynced before their answers); skip the interpreter's
    # teardown, whose garbage collection over transformers' module graph takes seconds.
    os._exit(code)
