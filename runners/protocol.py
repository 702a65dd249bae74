"""The runner side of the runner protocol (docs/runner-protocol.md).

`serve(handlers, hello)` moves fd 1 aside as the protocol channel (so library
prints cannot corrupt it), announces `hello`, then reads one JSON job a line
from stdin and dispatches it by `op`. A handler gets the job and an `emit`
function and answers with events; `done` is sent for it.

A runner that prints while it gets ready (imports that log) calls `channel()`
first; one that cannot serve at all answers `refuse(...)` instead of serving.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Callable

Emit = Callable[..., None]
EXIT_REFUSED = 3

_send: Callable[[dict], None] | None = None


def channel() -> Callable[[dict], None]:
    """Move fd 1 aside as the protocol channel (once) and return the function that sends on it."""
    global _send
    if _send is None:
        proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
        os.dup2(2, 1)  # whatever the libraries print now lands in stderr, the runner's log
        sys.stdout = sys.stderr

        def send(msg: dict) -> None:
            proto.write(json.dumps(msg, allow_nan=False) + "\n")
            proto.flush()

        _send = send
    return _send


def refuse(kind: str, message: str, **fields) -> int:
    """Answer `refused` instead of `ready`: the runner cannot serve at all. Returns the exit status."""
    channel()({"event": "refused", "kind": kind, "message": message, **fields})
    return EXIT_REFUSED


def serve(handlers: dict[str, Callable[[dict, Emit], None]], hello: dict) -> int:
    send = channel()
    send({"event": "ready", **hello})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            job = json.loads(line)
            jid, op = job["id"], job["op"]
        except (ValueError, KeyError, TypeError):
            send({"event": "protocol_error", "message": f"not a job: {line[:200]}"})
            continue

        def emit(event: str, _jid=jid, **fields) -> None:
            send({"id": _jid, "event": event, **fields})

        if op == "shutdown":
            emit("done")
            return 0
        handler = handlers.get(op)
        if handler is None:
            emit("error", kind="bad_input", message=f"unknown op {op!r} (known: {', '.join(sorted(handlers))})")
        else:
            try:
                handler(job, emit)
            except Exception as e:  # a handler bug: report it for this job, keep serving
                traceback.print_exc()
                emit("error", kind="engine", message=f"{type(e).__name__}: {e}")
        emit("done")
    return 0
