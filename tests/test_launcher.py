"""The launcher against real processes: healthy, never healthy, exiting at once; teardown of the tree."""

import os
import sys
import textwrap
import time
from contextlib import ExitStack

import pytest

from difftest.errors import InfraError
from difftest.process.launcher import ServerProcess, free_port, free_ports, start_together

HEALTHY = textwrap.dedent("""
    import subprocess, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split()[2] != "Z"


def gone_soon(pid, guard_s=60.0):
    """True once `pid` is gone (a guard against a hang, not a timing: a dead child goes in milliseconds)."""
    deadline = time.monotonic() + guard_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_healthy_server_and_whole_tree_stopped(tmp_path):
    port = free_port()
    srv = ServerProcess([sys.executable, "-c", HEALTHY, str(port)], f"http://127.0.0.1:{port}",
                        tmp_path / "s.log", health_timeout=300)
    with srv:
        assert srv.started_s is not None and srv.started_s > 0
        # the server printed its child's pid (flushed) before it began to answer /health
        child = int((tmp_path / "s.log").read_text().split()[1])
        assert alive(srv.proc.pid) and alive(child)
    assert srv.proc.poll() is not None
    assert gone_soon(child)  # the grandchild went with its process group


def test_exits_at_once(tmp_path):
    srv = ServerProcess([sys.executable, "-c", "print('model not found: /x'); raise SystemExit(4)"],
                        f"http://127.0.0.1:{free_port()}", tmp_path / "s.log", health_timeout=300, name="vllm serve")
    with pytest.raises(InfraError) as e:
        srv.start()
    assert e.value.exit_code == 3
    assert "vllm serve exited with status 4 before becoming healthy" in str(e.value)
    assert "model not found: /x" in str(e.value)


def test_never_healthy(tmp_path):
    srv = ServerProcess([sys.executable, "-c", "import time; print('loading...', flush=True); time.sleep(600)"],
                        f"http://127.0.0.1:{free_port()}", tmp_path / "s.log", health_timeout=2)
    t0 = time.monotonic()
    with pytest.raises(InfraError, match=r"not healthy after 2 s[\s\S]*loading\.\.\."):
        srv.start()
    assert time.monotonic() - t0 < 300  # gave up long before the process's own 600 s were over
    assert srv.proc.poll() is not None  # and it was stopped


def test_free_ports_lie_below_the_kernels_ephemeral_range():
    """Ports the kernel hands to outgoing connections are not offered to servers: on a busy machine
    a client socket took one between free_port() and the server's bind (EADDRINUSE)."""
    from difftest.process.launcher import _ephemeral_range

    lo, _ = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(10000 <= p < lo for p in ports) and len(ports) > 1


def test_ports_drawn_together_are_distinct_even_when_the_draw_repeats(monkeypatch):
    """Twenty listeners of one process, each its own port: a draw that repeats an earlier port is
    drawn again (forced here: the generator offers the same two ports over and over)."""
    import random

    from difftest.process import launcher

    offers = iter([11111, 11111, 11111, 12222] * 10)
    monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(offers))
    assert launcher.free_ports(2) == [11111, 12222]
    monkeypatch.undo()
    got = launcher.free_ports(20)
    assert len(set(got)) == 20


# A server that answers /health only once the file argv[2] exists, and creates argv[3] when it starts.
WAITS_FOR = HEALTHY.replace("class H(", """import os, time
open(sys.argv[3], "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
class H(""")


def test_servers_started_together_are_all_spawned_before_any_is_waited_for(tmp_path):
    """Each of the two becomes healthy only after the other has started: one after the other, the
    first would never be healthy; side by side both are."""
    a, b = tmp_path / "a-started", tmp_path / "b-started"
    ports = free_ports(2)
    servers = [ServerProcess([sys.executable, "-c", WAITS_FOR, str(port), str(other), str(mine)], f"http://127.0.0.1:{port}",
                             tmp_path / f"{name}.log", health_timeout=300, name=name)
               for name, port, mine, other in (("a", ports[0], a, b), ("b", ports[1], b, a))]
    with ExitStack() as stack:
        start_together(servers, stack)
        assert all(s.started_s > 0 and s.proc.poll() is None for s in servers)
    assert all(s.proc.poll() is not None for s in servers)  # both stopped with the stack


def test_one_server_that_fails_to_start_stops_the_others(tmp_path):
    port = free_port(exclude=set())
    good = ServerProcess([sys.executable, "-c", HEALTHY, str(port)], f"http://127.0.0.1:{port}", tmp_path / "good.log",
                         health_timeout=300, name="good")
    bad = ServerProcess([sys.executable, "-c", "raise SystemExit(4)"], f"http://127.0.0.1:{free_port(exclude={port})}",
                        tmp_path / "bad.log", health_timeout=300, name="bad")
    with ExitStack() as stack, pytest.raises(InfraError, match="bad exited with status 4"):
        start_together([good, bad], stack)
    assert good.proc.poll() is not None  # stopped at once, not left for the stack
    child = int((tmp_path / "good.log").read_text().split()[1])
    assert gone_soon(child)

