"""Start a runner as a fork of a zygote that has imported its packages already (runners/zygote.py).

`popen(argv, **kw)` is `subprocess.Popen(argv, **kw)`, but where $DIFFTEST_ZYGOTE names a zygote
serving `argv[0]` and the command is `PYTHON -m MODULE ...`, the process is forked from it: the
same code under the same arguments, environment, working folder and descriptors, without the 6-15 s
of importing torch, transformers and qwen-tts again (on two cores). The test session starts one per
worker (tests/conftest.py); `DIFFTEST_ZYGOTE=PYTHON=SOCKET` (several joined by ':') for anyone else.

An overlay venv of a served interpreter (a bisect build: its own site-packages, then the base's
through `_difftest_base.pth`) is served too, the child made that interpreter (runners/zygote.py),
unless the overlay holds a module the zygote has imported. A request falls back to a fresh
interpreter, silently, where the zygote cannot stand for one: another interpreter, options before -m, a zygote that does not answer, or an environment that differs from
the zygote's in a variable read while those packages import (ZYGOTE_FIXED). What the zygote cannot
give: /proc/PID/environ and cmdline show the zygote's, not the child's (lifeline.stale() does not
see a forked child that outlived its difftest), so the lifecycle tests run without it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

ENV = "DIFFTEST_ZYGOTE"
# Read by torch, OpenMP, oneDNN, numpy, numba, transformers or huggingface_hub while they import, or
# by the interpreter at its start: a child must have the zygote's values.
ZYGOTE_FIXED = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "ONEDNN_", "DNNL_", "TORCH", "PYTORCH_", "CUDA_",
                "NUMBA_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "XDG_CACHE_HOME", "PYTHON", "LD_", "MALLOC_",
                "TOKENIZERS_", "NVIDIA_")
# Read later: applied in the child (runners/zygote.py), or read when used (Ray's driver sets the
# breakpoint hook in the tester's environment, which its children inherit).
STARTING_WAIT_S = 120.0
# The .pth by which a difftest overlay venv sees its base environment (difftest/bisect/builds.py).
BASE_PTH = "_difftest_base.pth"
LATE_PYTHON = ("PYTHONUNBUFFERED", "PYTHONBREAKPOINT")


def _fixed(key: str) -> bool:
    return key.startswith(ZYGOTE_FIXED) and key not in LATE_PYTHON


def zygotes(environ=None) -> list[tuple[str, str]]:
    """(interpreter path, socket path) pairs from $DIFFTEST_ZYGOTE, in order. One interpreter may
    have several zygotes, each started under other fixed variables (Ray's workers set
    OMP_NUM_THREADS=1): a request goes to the first whose environment matches."""
    spec = (os.environ if environ is None else environ).get(ENV, "")
    out = []
    for part in filter(None, spec.split(":")):
        python, _, sock = part.rpartition("=")
        if python and sock:
            out.append((os.path.abspath(python), sock))
    return out


class ForkedProcess:
    """The part of subprocess.Popen that difftest uses, for a child of the zygote: its exit status
    comes over the zygote's connection."""

    def __init__(self, args, conn: socket.socket, pid: int, stdin=None, stdout=None, stderr=None):
        self.args, self._conn, self.pid = args, conn, pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._buf = b""

    def _read(self, timeout: float | None) -> None:
        while self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return
            try:
                chunk = self._conn.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:  # the zygote is gone without a word: the child may still run, orphaned
                if not _alive(self.pid):
                    self.returncode = -signal.SIGKILL
                elif timeout is not None:
                    time.sleep(min(timeout, 0.1))
                    return
                else:
                    while _alive(self.pid):
                        time.sleep(0.1)
                    self.returncode = -signal.SIGKILL
                break
            self._buf += chunk
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                msg = json.loads(line)
                if "exit" in msg:
                    self.returncode = int(msg["exit"])
            timeout = 0 if timeout is not None else None
        if self.returncode is not None:
            self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read(left)
        return self.returncode

    def communicate(self, timeout: float | None = None):
        """(stdout, stderr) read to their ends, then the exit awaited: subprocess.Popen's, without input."""
        import threading

        got: dict = {}
        readers = [threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f.read()), daemon=True)
                   for k, f in (("out", self.stdout), ("err", self.stderr)) if f is not None]
        for t in readers:
            t.start()
        end = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        return got.get("out"), got.get("err")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def choose(argv, env: dict) -> tuple[str | None, str | None, dict | None]:
    """(the socket of a zygote that can stand for `argv` under `env`, None, the overlay to become or
    None), or (None, why not, None)."""
    if len(argv) < 3 or argv[1] != "-m":
        return None, "not `PYTHON -m MODULE ...`", None
    python = os.path.abspath(str(argv[0]))
    why = f"no zygote serves {argv[0]} (${ENV})"
    for served, sock in zygotes(env):
        overlay = None
        if served != python and _overlay_site(python) is None:
            continue
        zenv = _hello_env(sock)
        if zenv is None:
            why = f"the zygote at {sock} does not listen yet"
            continue
        if served != python:
            overlay, not_it = _overlay(python, sock)
            if overlay is None:
                why = not_it or why
                continue
        differ = sorted(k for k in {*env, *zenv} if _fixed(k) and env.get(k) != zenv.get(k))
        if not differ:
            return sock, None, overlay
        why = f"the environment differs from the zygote's in {', '.join(differ)}"
    return None, why, None


def refusal(argv, env: dict) -> str | None:
    """Why no zygote can stand for `argv` under `env` (None: one can)."""
    return choose(argv, env)[1]


def _overlay(python: str, sock: str) -> tuple[dict | None, str | None]:
    """What the child needs to become `python` when it is an overlay venv of the zygote's
    interpreter (difftest/bisect/builds.py), or (None, why not; None when it is no overlay at all)."""
    import ast

    site = _overlay_site(python)
    if site is None:
        return None, None
    try:
        served = json.loads(Path(sock + ".site.json").read_text())
        line = (site / BASE_PTH).read_text().strip()
        base = ast.literal_eval(line[line.index("(site.addsitedir, ") + len("(site.addsitedir, "):-2])
    except (OSError, ValueError, SyntaxError):
        return None, None
    if sorted(base) != sorted(d for d in served["site_dirs"] if d != str(site)):
        return None, None  # an overlay of another interpreter
    entries, imports, names = [], [], {p.name.split(".")[0].split("-")[0] for p in site.iterdir()}
    for pth in sorted(site.glob("*.pth")):
        if pth.name == BASE_PTH:
            continue
        for raw in pth.read_text().splitlines():
            raw = raw.strip()
            if not raw or raw.startswith("#"):
                continue
            if raw.startswith(("import ", "import\t")):
                imports.append(raw)
            elif (site / raw).is_dir():
                entry = str((site / raw).resolve())
                entries.append(entry)
                names |= {p.name.split(".")[0] for p in Path(entry).iterdir()}
    shadowed = sorted(names & set(served["modules"]))
    if shadowed:
        return None, f"the overlay {site.parents[2]} holds {', '.join(shadowed)}, which the zygote has imported"
    return {"prefix": str(site.parents[2]), "site": str(site), "entries": entries, "imports": imports}, None


def _overlay_site(python: str) -> Path | None:
    """The site directory of `python`'s venv when difftest made it as an overlay, else None."""
    prefix = Path(python).parent.parent
    sites = list(prefix.glob("lib/python*/site-packages")) if (prefix / "pyvenv.cfg").is_file() else []
    return sites[0] if len(sites) == 1 and (sites[0] / BASE_PTH).is_file() else None


def _hello_env(sock: str, wait: float = STARTING_WAIT_S) -> dict | None:
    """The zygote's environment, as it started (cached per socket). A zygote still importing is
    waited for (bounded, and only while its process lives): on busy cores a fresh interpreter would
    spend that time importing the same packages beside it."""
    end = time.monotonic() + wait
    while sock not in _HELLO:
        try:
            _HELLO[sock] = json.loads(Path(sock + ".env.json").read_text())
        except (OSError, ValueError):
            try:
                starting = int(Path(sock + ".starting").read_text())
            except (OSError, ValueError):
                return None
            if not _alive(starting) or time.monotonic() > end:
                return None
            time.sleep(0.2)
    return _HELLO[sock]


_HELLO: dict[str, dict] = {}


def _fd(spec, default: int, *, write: bool, stdout_fd: int | None = None):
    """(descriptor for the child, our end if a pipe, descriptor to close after sending)."""
    if spec is None:
        return default, None, None
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_WRONLY if write else os.O_RDONLY)
        return fd, None, fd
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        return (w, r, w) if write else (r, w, r)
    if spec == subprocess.STDOUT:
        return stdout_fd, None, None
    if isinstance(spec, int):
        return spec, None, None
    return spec.fileno(), None, None


def _wrap(fd: int | None, mode: str, text: bool, bufsize: int):
    if fd is None:
        return None
    if text:
        return open(fd, mode, buffering=bufsize if bufsize != 0 else -1, encoding="utf-8", errors="strict")
    return open(fd, mode + "b", buffering=bufsize)


def popen(argv, *, stdin=None, stdout=None, stderr=None, env=None, cwd=None, start_new_session=False,
          text=False, bufsize=-1):
    """subprocess.Popen, or a fork of the zygote that serves argv[0] (see the module's doc)."""
    env = dict(os.environ if env is None else env)
    sock, _, overlay = choose(argv, env)
    if sock is None:
        return subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                start_new_session=start_new_session, text=text, bufsize=bufsize)
    proc = _fork(sock, argv, env, cwd, start_new_session, stdin, stdout, stderr, text, bufsize, overlay)
    if proc is None:  # the zygote did not take it
        return subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                start_new_session=start_new_session, text=text, bufsize=bufsize)
    return proc


def _fork(sock, argv, env, cwd, new_session, stdin, stdout, stderr, text, bufsize, overlay=None):
    ends, to_close = [], []
    try:
        in_fd, in_ours, c0 = _fd(stdin, 0, write=False)
        out_fd, out_ours, c1 = _fd(stdout, 1, write=True)
        err_fd, err_ours, c2 = _fd(stderr, 2, write=True, stdout_fd=out_fd)
        ends = [e for e in (in_ours, out_ours, err_ours) if e is not None]
        to_close = [c for c in (c0, c1, c2) if c is not None]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(sock)
            body = json.dumps({"argv": [str(a) for a in argv], "env": env, "new_session": bool(new_session),
                               "cwd": str(Path(cwd).resolve()) if cwd else os.getcwd(), "overlay": overlay}).encode()
            socket.send_fds(conn, [struct.pack("!I", len(body))], [in_fd, out_fd, err_fd])
            conn.sendall(body)
            line = b""
            while not line.endswith(b"\n"):
                ready, _, _ = select.select([conn], [], [], 120)  # the zygote answers once the child is set up
                chunk = conn.recv(4096) if ready else b""
                if not chunk:
                    raise OSError("the zygote did not answer")
                line += chunk
            msg = json.loads(line)
        except (OSError, ValueError):
            conn.close()
            for e in ends:
                os.close(e)
            return None
        if "pid" not in msg:
            conn.close()
            for e in ends:
                os.close(e)
            return None
        for c in to_close:
            os.close(c)
        to_close = []
        return ForkedProcess(list(argv), conn, int(msg["pid"]),
                             stdin=_wrap(in_ours, "w", text, bufsize),
                             stdout=_wrap(out_ours, "r", text, bufsize),
                             stderr=_wrap(err_ours, "r", text, bufsize))
    finally:
        for c in to_close:
            os.close(c)


def stats(sock: str) -> dict:
    """The zygote's count of forks (for a test that must show it was used)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with conn:
        conn.connect(sock)
        body = json.dumps({"op": "stats"}).encode()
        socket.send_fds(conn, [struct.pack("!I", len(body))], [])
        conn.sendall(body)
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                break
            line += chunk
    return json.loads(line)


def run(argv, *, capture_output=False, stdout=None, stderr=None, text=False, cwd=None, env=None,
        timeout=None) -> subprocess.CompletedProcess:
    """subprocess.run (no input), through popen: a fork of the zygote where one can stand for it."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    p = popen(argv, stdout=stdout, stderr=stderr, env=env, cwd=cwd, text=text)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    return subprocess.CompletedProcess(list(argv), p.returncode, out, err)
