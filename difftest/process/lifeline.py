"""Children that end with difftest, however it ends, and the ones an earlier difftest left behind.

Engines and runners run in process groups of their own (so a Ctrl-C in the terminal reaches
difftest, which stops them in order). A `kill -9` of difftest, or the OOM killer, used to leave
them running under PID 1: the CPU test engine holds 680 MB, a vLLM-Omni server a GPU.

- `guard(proc)`: a small watchdog process, in a session of its own, holds the read end of a pipe
  whose write end only difftest holds. When difftest closes it (the child was stopped) or dies
  (the kernel closes it), the watchdog wakes and ends what is left of the child's process group:
  SIGTERM, then SIGKILL after GRACE_S. Unlike a parent-death signal it does not fire when the
  thread that started the child ends, and it reaches the child's own children (a vLLM server's
  engine cores).
- `child_env(env)`: each child carries DIFFTEST_OWNER, the pid and start time of the difftest
  that started it; `stale()` lists processes whose owner is gone (their watchdog was killed too),
  which a run reports when it starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

OWNER_ENV = "DIFFTEST_OWNER"
GRACE_S = 10.0

_GUARD = """
import os, signal, sys, time
pgid, fd, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
try:
    while os.read(fd, 1):
        pass
except OSError:
    pass
def alive():
    try:
        os.killpg(pgid, 0)
        return True
    except OSError:
        return False
for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
    if not alive():
        break
    try:
        os.killpg(pgid, sig)
    except OSError:
        break
    end = time.monotonic() + wait
    while alive() and time.monotonic() < end:
        time.sleep(0.1)
"""


def _start_ticks(pid: int) -> str | None:
    """A process's start time (clock ticks since boot): with its pid, it names one process."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_tag(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_start_ticks(pid)}"


def child_env(env: dict | None) -> dict:
    """`env` (or this process's environment) with this difftest named as the child's owner."""
    return {**(os.environ if env is None else env), OWNER_ENV: owner_tag()}


def guard(proc: subprocess.Popen, grace: float = GRACE_S) -> int | None:
    """Start the watchdog of `proc`'s process group (proc started with start_new_session). Returns
    the pipe's write end: `release` it once the child is stopped. None where no watchdog could
    start (the child then ends only as it did before: when difftest stops it)."""
    r, w = os.pipe()
    try:
        subprocess.Popen([sys.executable, "-I", "-c", _GUARD, str(proc.pid), str(r), str(grace)], pass_fds=(r,),
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, env={k: v for k, v in os.environ.items() if k != OWNER_ENV})
    except OSError:
        os.close(w)
        return None
    finally:
        os.close(r)
    return w


def release(fd: int | None) -> None:
    """The child is stopped: its watchdog ends (after sweeping any member of the group still there)."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def stale() -> list[tuple[int, str]]:
    """(pid, command line) of processes an earlier difftest started and that outlived it."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        tag = next((e[len(OWNER_ENV) + 1:].decode() for e in env if e.startswith(OWNER_ENV.encode() + b"=")), None)
        if tag is None:
            continue
        pid, _, ticks = tag.partition(":")
        if pid.isdigit() and _start_ticks(int(pid)) == ticks:
            continue  # its owner is alive: a run in progress, not ours to judge
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        found.append((int(d.name), cmd[:120]))
    return sorted(found)


def report_stale(stream=sys.stderr) -> list[int]:
    """Say which processes earlier difftest runs left running (they hold memory and, on a GPU, the
    device: a later run's timings and memory are not its own while they run)."""
    left = stale()
    if left:
        print(f"difftest: warning: {len(left)} process(es) an earlier difftest started outlived it "
              f"(stop them: kill {' '.join(str(p) for p, _ in left)}):", file=stream)
        for pid, cmd in left[:8]:
            print(f"  {pid}: {cmd}", file=stream)
    return [p for p, _ in left]
