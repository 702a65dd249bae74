"""The qwen-tts zygote the tests start (tests/conftest.py; docs/ci.md)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def zygote_of_the_reference(log: Path, **env_overrides):
    """A zygote of .venv-reference under this environment (plus `env_overrides`), named first in
    $DIFFTEST_ZYGOTE while the block runs; yields its socket, or None without the environment."""
    import signal
    import subprocess
    import tempfile

    from difftest.process.zygote import ENV

    python = ROOT / ".venv-reference" / "bin" / "python"
    if not python.exists() or os.environ.get("DIFFTEST_TEST_ZYGOTE") == "0":
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="dt-zygote-", dir="/tmp"))  # short: a socket path has 107 bytes
    sock = folder / "qwen-tts.sock"
    env = dict(os.environ, HF_HUB_OFFLINE="1", **env_overrides)  # HF_HUB_OFFLINE: as runners get it
    env.pop(ENV, None)
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(python), "-m", "runners.zygote", "--socket", str(sock)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    before = os.environ.get(ENV)
    os.environ[ENV] = ":".join(filter(None, (f"{python}={sock}", before)))
    try:
        yield sock
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
