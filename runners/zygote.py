"""A zygote for the qwen-tts environment: import torch, transformers and qwen-tts once, then start
each runner (`python -m runners.reference`, `python -m runners.cpu_engine`, ...) as a fork of this
process instead of a fresh interpreter, which spends 6-15 s on two cores importing them again.

    python -m runners.zygote --socket PATH

The tester's side is difftest/process/zygote.py (docs/ci.md says when it is used). One request per
connection on a Unix socket: a JSON object {argv, env, cwd, new_session} sent with three file
descriptors (the child's stdin, stdout, stderr). The answer is a JSON line {"pid": N} (or
{"refused": why}), then, when the child has exited, {"exit": code} (negative: killed by that
signal), and the connection closes. {"op": "stats"} answers the number of forks.

Only third-party modules are imported here: the runners' own modules are imported in each child,
under its own arguments and environment. What a fresh interpreter would read from its environment
while importing those packages (thread counts, library paths, offline switches) is fixed here, so
the client sends a request only when those variables are the zygote's own (ZYGOTE_FIXED).

A request may name an overlay venv of this interpreter (a bisect build: difftest/bisect/builds.py,
its own site-packages first, then this environment's through a .pth): the child then becomes that
interpreter (sys.executable, sys.prefix, its site directory and .pth entries before this
environment's), as `OVERLAY/bin/python -m MODULE` would start. The client sends one only when the
overlay shadows none of the modules imported here (PATH.site.json lists them).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import selectors
import signal
import socket
import struct
import sys
import time

ROOM_ENV, ARGV_ROOM, ENV_ROOM = "DIFFTEST_ZYGOTE_ROOM", 4096, 65536
PRELOAD_NOTE = "torch, transformers, qwen_tts, numpy, soundfile, librosa"


def _preload() -> None:
    from runners.reference.environment import import_qwen_tts

    import_qwen_tts()
    # qwen-tts reads every reference voice with librosa.load (and resamples with librosa.resample).
    # `import librosa` alone loads nothing: librosa is lazy, and its audio module (with the numba
    # ufuncs of librosa.util, loaded from numba's cache) was imported by each child at its first
    # voice, about 1 s of CPU per runner and engine. Imported here, every fork has it.
    import librosa.core.audio  # noqa: F401
    import librosa.util.utils  # noqa: F401  (to_mono's numba ufuncs: lazy too)
    import numpy  # noqa: F401
    import soundfile  # noqa: F401


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(head) < 4:
        raise ConnectionError("short request")
    (size,) = struct.unpack("!I", head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("request cut short")
        body += chunk
    return json.loads(body), list(fds)


def _send(conn: socket.socket, msg: dict) -> None:
    try:
        conn.sendall((json.dumps(msg) + "\n").encode())
    except OSError:
        pass  # the client went away; the child runs on, and is reaped all the same


def _child(req: dict, fds: list[int], keep_closed: list[socket.socket], set_up: int) -> None:
    """In the forked child: become the process `python -m MODULE ARGS` would have been. Never returns."""
    code = 1
    try:
        for s in keep_closed:
            s.close()
        if req.get("new_session"):
            os.setsid()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        _retitle(req["argv"], req["env"])
        os.write(set_up, b"1")
        os.close(set_up)
        if os.environ.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
        import random

        random.seed()  # a fresh interpreter's draws, not the zygote's copy
        import numpy

        numpy.random.seed()
        if req.get("overlay"):
            _become_overlay(req["argv"][0], req["overlay"])
        module, args = req["argv"][2], req["argv"][3:]
        sys.argv = ["-m", *args]
        sys.path[0] = os.getcwd()  # as `-m` puts the working folder first
        import runpy

        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:  # as the interpreter does: die of the signal
            _finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        _finish()
    finally:
        os._exit(code & 0xFF if isinstance(code, int) else 1)


def site_dirs() -> list[str]:
    """This interpreter's site directories, as difftest's overlays name them (bisect/builds.py)."""
    import site
    import sysconfig

    p = sysconfig.get_paths()
    return list(dict.fromkeys([p["purelib"], p["platlib"], *site.getsitepackages()]))


def _become_overlay(python: str, overlay: dict) -> None:
    """sys as the overlay's interpreter has it: its prefix, and its site directory with its .pth
    path entries (the base's .pth excepted: this interpreter ran the base's already) just before
    the base's site directories, as site.addsitedir would order them there."""
    sys.executable, sys.prefix, sys.exec_prefix = python, overlay["prefix"], overlay["prefix"]
    base = set(site_dirs())
    at = next((i for i, d in enumerate(sys.path) if d in base), len(sys.path))
    sys.path[at:at] = [overlay["site"], *overlay["entries"]]
    for line in overlay.get("imports", []):  # .pth lines that run code, as site runs them
        exec(line)  # noqa: S102


def _retitle(argv: list[str], env: dict) -> None:
    """Make /proc/PID/cmdline and /proc/PID/environ say what a fresh `python -m ...` would: tools and
    difftest's own stray report (difftest.process.lifeline) read them. They show the memory the
    zygote's exec laid out (its argv and environment, padded with ROOM for this), rewritten here;
    what does not fit is cut (the owner tag first, so it is never the part cut)."""
    import ctypes

    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])
    except (OSError, ValueError, IndexError):
        return
    owner = [k for k in env if k == "DIFFTEST_OWNER"]
    for start, end, items in ((arg_start, arg_end, list(argv)),
                              (env_start, env_end, [f"{k}={env[k]}" for k in (*owner, *sorted(set(env) - set(owner)))])):
        room = end - start
        blob = b""
        for item in items:
            b = item.encode(errors="replace") + b"\0"
            if len(blob) + len(b) > room:
                break
            blob += b
        blob += b"\0" * (room - len(blob))
        ctypes.memmove(start, blob, room)


def _finish() -> None:
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass


def serve(path: str) -> None:
    env0 = dict(os.environ)  # what a fresh runner's imports would have read (they may set defaults)
    with open(path + ".starting", "w") as f:  # clients wait for a zygote that says it is starting
        f.write(str(os.getpid()))
    _preload()
    threads = len(os.listdir("/proc/self/task"))
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    with open(path + ".site.json", "w") as f:  # what an overlay must not shadow (_become_overlay)
        json.dump({"site_dirs": site_dirs(), "modules": sorted({m.split(".")[0] for m in sys.modules})}, f)
    with open(path + ".env.json.tmp", "w") as f:  # clients read it; its presence says the zygote listens
        json.dump(env0, f)
    os.replace(path + ".env.json.tmp", path + ".env.json")
    os.unlink(path + ".starting")
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    forks = 0
    print(json.dumps({"event": "ready", "pid": os.getpid(), "python": sys.executable, "threads": threads,
                      "preloaded": PRELOAD_NOTE}), flush=True)
    parent = os.getppid()
    while True:
        for key, _ in sel.select(timeout=0.1):
            conn, _ = listener.accept()
            try:
                req, fds = _recv_request(conn)
            except (OSError, ValueError) as e:
                _send(conn, {"refused": f"bad request: {e}"})
                conn.close()
                continue
            if req.get("op") == "stats":
                _send(conn, {"forks": forks, "running": len(children)})
                conn.close()
                continue
            if len(fds) != 3 or not isinstance(req.get("argv"), list) or len(req["argv"]) < 3:
                _send(conn, {"refused": "a request needs argv [python, -m, module, ...] and three descriptors"})
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            for f in (sys.stdout, sys.stderr):
                f.flush()
            r, w = os.pipe()  # the child says when it is set up: its pid is then worth giving out
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _child(req, fds, [listener, conn, *children.values()], w)
            os.close(w)
            select.select([r], [], [], 30)
            os.close(r)
            forks += 1
            print(f"[zygote] fork {pid}: -m {' '.join(req['argv'][2:4])}", file=sys.stderr, flush=True)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            _send(conn, {"pid": pid})
        while children:  # reap: tell each child's client how it ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()
        if os.getppid() != parent and not children:  # whoever started the zygote is gone
            break
    listener.close()
    for p in (path, path + ".env.json", path + ".site.json"):
        try:
            os.unlink(p)
        except OSError:
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runners.zygote", description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True, help="the Unix socket to listen on")
    ap.add_argument("--room", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.room:  # once: exec again with room in argv and environ for the children's (_retitle)
        os.execve(sys.executable, [sys.executable, "-m", "runners.zygote", "--socket", args.socket,
                                   "--room", "." * ARGV_ROOM], {**os.environ, ROOM_ENV: "." * ENV_ROOM})
    os.environ.pop(ROOM_ENV, None)
    t0 = time.monotonic()
    try:
        serve(args.socket)
    except KeyboardInterrupt:
        pass
    print(f"[zygote] done after {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
