"""The tester side of the runner protocol (docs/runner-protocol.md).

`RunnerProcess` starts a runner with its own interpreter, keeps its stderr as
a log, and turns a dead or silent runner into per-segment errors instead of a
crash of the whole run.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from collections import deque
from pathlib import Path
from typing import Iterator

from ..errors import InfraError
from . import lifeline, zygote

_EOF = object()


class RunnerDied(InfraError):
    """The runner exited or went silent; `tail` is the end of its log."""

    def __init__(self, message: str, tail: str = ""):
        self.tail = tail
        super().__init__(message + (f"\n--- runner log tail ---\n{tail}" if tail else ""))


class RunnerRefused(RunnerDied):
    """The runner answered `refused` instead of `ready` and exited; `event` says why (its `kind`, `message`)."""

    def __init__(self, event: dict, tail: str = ""):
        self.event = event
        super().__init__(f"runner refused to start: {event.get('kind')}: {event.get('message')}", tail)


class RunnerProcess:
    """A runner subprocess speaking JSON lines. Use as a context manager."""

    def __init__(self, argv: list[str], *, env: dict | None = None, log_path: str | Path | None = None,
                 start_timeout: float = 600.0, cwd: str | Path | None = None):
        self.argv = list(argv)
        self.env = env
        self.cwd = cwd
        self.log_path = Path(log_path) if log_path else None
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.hello: dict = {}
        self._events: queue.Queue = queue.Queue()
        self._log_tail: deque[str] = deque(maxlen=60)
        self._log_lock = threading.Lock()
        self._next_id = 0

    # -- lifecycle -----------------------------------------------------
    def start(self) -> dict:
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = lifeline.child_env(self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            self.proc = zygote.popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=env, cwd=self.cwd, text=True, bufsize=1, start_new_session=True)
        except OSError as e:
            raise RunnerDied(f"cannot start runner {self.argv[0]}: {e}") from None
        self._lifeline = lifeline.guard(self.proc)  # it ends with difftest, even a kill -9 of difftest
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self._stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_reader.start()
        msg = self._next_event(self.start_timeout)
        if msg.get("event") == "refused":
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
            raise RunnerRefused(msg, self._exit_tail())
        if msg.get("event") != "ready":
            self.kill()
            raise RunnerDied(f"runner did not announce itself: {msg}", self._exit_tail())
        self.hello = msg
        return msg

    def __enter__(self) -> "RunnerProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return lifeline.release(getattr(self, "_lifeline", None))
        try:
            self.proc.stdin.write(json.dumps({"id": -1, "op": "shutdown"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.kill()
        lifeline.release(getattr(self, "_lifeline", None))
        self._lifeline = None

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        lifeline.release(getattr(self, "_lifeline", None))
        self._lifeline = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(list(self._log_tail)[-lines:])

    def _exit_tail(self) -> str:
        """The log tail once the runner has exited: its last words on stderr may still be in the pipe
        when stdout closes, so the reader gets a moment to take them (bounded: a grandchild can
        hold the pipe open)."""
        reader = getattr(self, "_stderr_reader", None)
        if reader is not None:
            reader.join(timeout=10)
        return self.log_tail()

    # -- I/O -------------------------------------------------------------
    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if isinstance(msg, dict):
                self._events.put(msg)
            else:  # printed before the runner moved stdout aside: log, not protocol
                self._log(f"[stdout] {line}")
        self._events.put(_EOF)

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._log(line.rstrip("\n"))

    def _log(self, line: str) -> None:
        with self._log_lock:
            self._log_tail.append(line)
            if self.log_path:
                with open(self.log_path, "a", encoding="utf-8") as f:
                    f.write(line + "\n")

    def _next_event(self, timeout: float) -> dict:
        try:
            msg = self._events.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise RunnerDied(f"runner silent for {timeout:.0f} s; killed", self._exit_tail()) from None
        if msg is _EOF:
            code = self.proc.wait()
            raise RunnerDied(f"runner exited with status {code}", self._exit_tail())
        return msg

    def request(self, op: str, timeout: float = 600.0, **fields) -> Iterator[dict]:
        """Send a job; yield its events (progress, result, error) until `done`.

        `timeout` bounds the silence between two events, not the whole job.
        Raises RunnerDied if the runner exits or goes silent.
        """
        if not self.alive:
            raise RunnerDied("runner is not running", self._exit_tail())
        self._next_id += 1
        jid = self._next_id
        try:
            self.proc.stdin.write(json.dumps({"id": jid, "op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            code = self.proc.wait()
            raise RunnerDied(f"runner exited with status {code}", self._exit_tail()) from None
        while True:
            msg = self._next_event(timeout)
            if msg.get("id") not in (jid, None):
                continue  # a late answer to an earlier job
            if msg.get("event") == "done":
                return
            yield msg


def item_answers(runner, op: str, items: list[dict], timeout: float, read, what: str) -> dict:
    """Send an item job (`decode`, `score`: runner protocol) and collect name -> what `read(path)`
    gives for each `result`, or the error message that stands for the item: its `error`, an
    unreadable file (`read` raising ValueError, e.g. CorruptResult), the runner dying (`what` says
    during what), or no answer at all. Nothing answered is lost when the runner dies later."""
    names = {it["name"] for it in items}
    done: dict = {}
    try:
        for ev in runner.request(op, timeout=timeout, items=items):
            name = ev.get("item") or ev.get("segment")
            if name not in names:
                continue
            if ev.get("event") == "result":
                try:
                    done[name] = read(ev["path"])
                except ValueError as e:
                    done[name] = str(e)
            elif ev.get("event") == "error":
                done[name] = ev.get("message", f"{op} failed")
    except RunnerDied as e:
        for name in names:
            done.setdefault(name, f"reference runner died {what}: {str(e).splitlines()[0]}")
    for name in names:
        done.setdefault(name, f"the reference runner did not answer this {op} item")
    return done
