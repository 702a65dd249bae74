"""Start a speech server, wait until it is healthy, keep its log, stop it with its whole process tree.

Used for the CPU test engine and for `vllm serve MODEL --omni`. A server that
exits early or never becomes healthy is an infrastructure error (exit 3) that
carries the tail of its log.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..engines.speech_client import SpeechClient
from ..errors import InfraError
from . import lifeline, zygote

PROGRESS_EVERY_S = 15.0


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _last_line(path: Path, width: int = 100) -> str:
    line = _ANSI.sub("", log_tail(path, 1)).strip()
    return line[-width:] if line else "(no log yet)"


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(n: int) -> list[int]:
    """`n` distinct ports, each free now (see free_port): drawn one by one, two draws of one port
    would give two servers of one process the same (seen: one of 20 CPU-engine listeners dying with
    EADDRINUSE at start)."""
    out: list[int] = []
    while len(out) < n:
        out.append(free_port(exclude=set(out)))
    return out


def free_port(exclude: set[int] = frozenset()) -> int:
    """A port free now, for a server started next, drawn below the ephemeral range: a port the
    kernel picks (bind to 0) is one it also hands to outgoing connections, and on a busy machine one
    of them can take it before the server binds (seen: a CPU engine dying with EADDRINUSE, its
    health then answered by another test's server). `exclude`: ports already handed out."""
    lo, _ = _ephemeral_range()
    if lo > 12000:
        rng = random.SystemRandom()
        for _ in range(100):
            port = rng.randrange(10000, lo)
            if port in exclude:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] not in exclude:
                return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def interrupt_groups(procs: list[subprocess.Popen], grace: float = 60.0) -> None:
    """SIGINT to each child's process group (a difftest command in it stops its own engines), then
    SIGKILL what is still there after `grace` seconds. For children started with start_new_session."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


class ServerProcess:
    """`with ServerProcess(argv, url, log_path) as srv:` ... the server is healthy inside."""

    def __init__(self, argv: list[str], url: str, log_path: str | Path, *, env: dict | None = None,
                 cwd: str | Path | None = None, health_timeout: float = 300.0, name: str = "server"):
        self.argv, self.url, self.log_path = list(argv), url, Path(log_path)
        self.env, self.cwd, self.health_timeout, self.name = env, cwd, health_timeout, name
        self.proc: subprocess.Popen | None = None
        self.started_s: float | None = None

    def start(self) -> "ServerProcess":
        """Start and wait for health; on any failure or interrupt meanwhile, stop what was started."""
        try:
            self.spawn()
            return self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def spawn(self) -> "ServerProcess":
        """Start the process and return at once (`wait_healthy` waits for it): several servers can
        start side by side. The caller stops it on failure."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self._t0 = time.monotonic()
        try:
            self.proc = zygote.popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=lifeline.child_env(self.env), cwd=self.cwd, start_new_session=True)
        except OSError as e:
            raise InfraError(f"cannot start {self.name} ({self.argv[0]}): {e}") from None
        finally:
            log.close()
        self._lifeline = lifeline.guard(self.proc)  # it ends with difftest, even a kill -9 of difftest
        return self

    def wait_healthy(self) -> "ServerProcess":
        """Wait until the spawned server answers its health check; InfraError (with its log's tail)
        when it exits first or the health timeout passes. `started_s` counts from the spawn."""
        t0 = self._t0
        client = SpeechClient(self.url, connect_retries=0)
        deadline = t0 + self.health_timeout
        spoke = t0
        while time.monotonic() < deadline:
            if time.monotonic() - spoke >= PROGRESS_EVERY_S:  # a start takes minutes: say it is under way
                spoke = time.monotonic()
                print(f"  ... starting {self.name}: {spoke - t0:.0f} s so far; {_last_line(self.log_path)}",
                      file=sys.stderr, flush=True)
            code = self.proc.poll()
            if code is not None:
                raise InfraError(f"{self.name} exited with status {code} before becoming healthy; "
                                 f"log {self.log_path}:\n{log_tail(self.log_path)}")
            if client.health(timeout=2.0):
                self.started_s = time.monotonic() - t0
                return self
            time.sleep(0.25)
        raise InfraError(f"{self.name} not healthy after {self.health_timeout:.0f} s; "
                         f"log {self.log_path}:\n{log_tail(self.log_path)}")

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; members of the group may linger: check and go on killing.
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
        if self.proc.poll() is None:
            self.proc.wait(5.0)
        lifeline.release(getattr(self, "_lifeline", None))
        self._lifeline = None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_together(servers: list[ServerProcess], stack) -> None:
    """Spawn every server, then wait for each to be healthy: side by side, a start that is mostly
    one process at a time importing (vLLM-Omni's three) leaves room for the others. Each stops when
    `stack` closes; if one fails to start, all are stopped before the error goes on."""
    try:
        for srv in servers:
            stack.callback(srv.stop)
            srv.spawn()
        for srv in servers:
            srv.wait_healthy()
    except BaseException:
        for srv in servers:  # a server that died early may leave its children behind: stop each group
            srv.stop()
        raise

