"""Helpers for the MLflow tests: a real `mlflow server` on loopback, a migrated empty sqlite
store to copy (creating one costs about 9 s), and report folders made by `difftest compare`
from toy result sets."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from toy import toy_codes, toy_decode, toy_result

from difftest.cli import main as difftest_main
from difftest.results import write_result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_uri() -> str:
    """An HTTP URI on loopback where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"


@contextlib.contextmanager
def serve(folder: Path, timeout_s: float = 120.0, store: Path | None = None):
    """`mlflow server` with a sqlite backend and artifacts in `folder`; yields its URI. The
    server runs in its own process group, which is ended on the way out, whatever happened.
    `store`: an empty migrated database to start from (saves the server creating one).

    A free port can be taken between asking for it and binding it (another test's engine): the
    server then exits with "address already in use" and is started again on another port, up to
    three times. It is ready when MLflow's own API answers, not any /health on that port."""
    if store is not None:
        shutil.copyfile(store, folder / "server.db")
    log_path = folder / "server.log"
    # No job runner: it starts eight more mlflow processes (genai jobs) that difftest never uses.
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = None
    try:
        for attempt in range(3):
            port = free_port()
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                     "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
                     "--artifacts-destination", str(folder / "artifacts"), "--workers", "1"],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=folder,
                    start_new_session=True)
            uri = f"http://127.0.0.1:{port}"
            if _wait_ready(proc, uri, log_path, timeout_s, last=attempt == 2):
                break
        yield uri
    finally:
        if proc is not None:
            _stop(proc)


def _wait_ready(proc, uri: str, log_path: Path, timeout_s: float, last: bool) -> bool:
    """True once the server's experiments API answers; False when it lost its port (try another)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            if "address already in use" in tail and not last:
                return False
            pytest.fail(f"mlflow server exited with {proc.returncode}; its log ends:\n{tail}")
        try:
            with urllib.request.urlopen(uri + "/api/2.0/mlflow/experiments/search?max_results=1", timeout=2) as r:
                if r.status == 200 and b"experiments" in r.read() and proc.poll() is None:
                    return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-3000:]
            pytest.fail(f"mlflow server: no answer in {timeout_s:.0f} s; its log ends:\n{tail}")
        time.sleep(0.25)


def _stop(proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def make_empty_store(folder: Path) -> Path:
    """A migrated, empty MLflow sqlite database."""
    from difftest.records.tracking import mlflow_client

    db = folder / "mlflow.db"
    with mlflow_client(f"sqlite:///{db}") as client:
        client.search_experiments()
    return db


REFERENCE_PROVENANCE = {"engine": "qwen-tts", "versions": {"qwen-tts": "0.1.1", "torch": "2.9.0"},
                        "device": "cpu", "models": {"base": {"sha256": "ab" * 32, "path": "/ckpt"}}}


def candidate_provenance(version: str, device: str) -> dict:
    return {"engine": "vllm-omni", "versions": {"vllm-omni": version, "vllm": "0.30.1", "torch": "2.10.0"},
            "device": device, "commit": "c0ffee" + version.replace(".", ""), "deploy_config": {"greedy": True}}


def make_report(root: Path, name: str, *, leak_into=(), length_into=(), version: str = "0.30.0", device: str = "cpu",
                suite: dict | None = None, nan_reference: bool = False, segments: int = 3,
                measured_null: dict | None = None) -> Path:
    """A difftest output folder made by `difftest compare` on toy results: segments s0..s{n-1};
    those in `leak_into` decoded with the last segment's reference codes (the seed's leak), those in
    `length_into` with their own extended to its length (the no-async hand-off's ref_code_len leak).
    `suite` (and `measured_null`) are put into report.json as `difftest run` writes them (compare
    knows no suite and decodes no null)."""
    base = root / name
    ref, cand, ctrl = base / "ref", base / "cand", base / "ctrl"
    refs = {f"s{i}": toy_codes(10 + i, 50 + i) for i in range(segments)}
    donor = f"s{segments - 1}"
    cprov = candidate_provenance(version, device)
    for i in range(segments):
        sid, codes = f"s{i}", toy_codes(30, i)
        own = refs[sid]
        wav = toy_decode(codes, own)
        if nan_reference and i == 0:
            wav = wav * float("nan")
        write_result(ref / sid, toy_result(sid, codes, own, wav=wav, provenance=REFERENCE_PROVENANCE,
                                           meta={"runner": "reference", "concurrency": 1}))
        write_result(ctrl / sid, toy_result(sid, codes, own, provenance=cprov, meta={"runner": "cand", "concurrency": 1}))
        used = refs[donor] if sid in leak_into else own
        if sid in length_into:
            used = own[np.arange(len(refs[donor])) % len(own)]
        write_result(cand / sid, toy_result(sid, codes, used, provenance=cprov, meta={"runner": "cand", "concurrency": 3}))
    out = base / "out"
    difftest_main(["compare", str(ref), str(cand), "--control", str(ctrl), "--out", str(out)])
    if suite is not None or measured_null is not None:
        path = out / "report.json"
        report = json.loads(path.read_text())
        if suite is not None:
            report["suite"] = suite
        if measured_null is not None:
            report["measured_null"] = measured_null
        path.write_text(json.dumps(report, indent=1, sort_keys=True))
    return out


def copy_store(template: Path, folder: Path) -> None:
    shutil.copyfile(template, folder / "mlflow.db")
