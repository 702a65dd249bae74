"""The candidate a run tests: what it is (`--candidate`), what identifies its results, how to start it.

    spec = CandidateSpec.parse("vllm-omni")             # or a URL, vllm-omni-offline[:async], cpu-engine[:DEFECT]
    engine = engine_identity(spec, setup)              # before any model work: reuse checks, provenance
    client, capture, info = start_candidate(spec, setup, stack)

`setup` carries what every kind needs (the run folder, the checkpoints, the
reference environment, the suite and the run's options). The three kinds a user
names are started here; a caller that starts an engine itself (selfcheck's CPU
engines, bisect's builds) passes its URL with `declared`, the identity of what
it started.
"""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import BadInput, InfraError
from ..suites.suite import Suite
from . import identity as ident
from .launcher import ServerProcess, free_port
from .runner_client import RunnerProcess
from .speech_client import SpeechClient

CPU_ENGINE = "cpu-engine"
VLLM_OMNI = "vllm-omni"
VLLM_OMNI_OFFLINE = "vllm-omni-offline"
URL = "url"
REPO = Path(__file__).resolve().parents[2]
CPU_ENGINE_CODE = ("runners/cpu_engine", "runners/reference", "runners/protocol.py")
VLLM_OMNI_PLUGINS = ("runners/vllm_omni", "runners/vllm_omni_offline")


@dataclass
class CandidateSpec:
    """What to test: a server URL (with an optional capture dir), vLLM-Omni started here (its server or its
    offline API), or the CPU test engine started here."""

    kind: str  # URL, CPU_ENGINE, VLLM_OMNI or VLLM_OMNI_OFFLINE
    url: str | None = None
    defect: str | None = None
    capture_dir: Path | None = None
    api: str = "batch"  # vllm-omni-offline: "batch" (Omni.generate) or "async" (AsyncOmni, a request each)
    declared: dict | None = None  # a URL engine the caller started: its identity (e.g. selfcheck's defect)

    @classmethod
    def parse(cls, text: str, capture_dir: str | None = None) -> "CandidateSpec":
        if text == CPU_ENGINE or text.startswith(CPU_ENGINE + ":"):
            defect = text.split(":", 1)[1] if ":" in text else None
            return cls(CPU_ENGINE, defect=defect or None)
        if text == VLLM_OMNI:
            return cls(text)
        if text == VLLM_OMNI_OFFLINE or text.startswith(VLLM_OMNI_OFFLINE + ":"):
            api = text.split(":", 1)[1] if ":" in text else "batch"
            if api not in ("batch", "async"):
                raise BadInput(f"--candidate {text!r}: the offline API is batch (vllm_omni.Omni) or async "
                               f"(vllm_omni.AsyncOmni)")
            return cls(VLLM_OMNI_OFFLINE, api=api)
        if text.startswith(("http://", "https://")):
            check_url(text, "--candidate")
            return cls(URL, url=text.rstrip("/"), capture_dir=Path(capture_dir) if capture_dir else None)
        raise BadInput(f"--candidate {text!r}: expected a server URL (http://host:port), {VLLM_OMNI} "
                       f"(vLLM-Omni's server started here), {VLLM_OMNI_OFFLINE}[:async] (its offline API, float32 "
                       f"audio) or {CPU_ENGINE}[:DEFECT] (the CPU test engine, not vLLM-Omni)")

    @property
    def label(self) -> str:
        if self.kind == VLLM_OMNI:
            return self.kind
        if self.kind == VLLM_OMNI_OFFLINE:
            return self.kind + (":async" if self.api == "async" else "")
        if self.kind == CPU_ENGINE:
            return "difftest-cpu-engine" + (f":{self.defect}" if self.defect else "")
        return self.url


def check_url(text: str, what: str) -> None:
    """BadInput for a URL that cannot name a server (no host, a port out of range)."""
    try:
        u = urlsplit(text)
        port = u.port
    except ValueError as e:
        raise BadInput(f"{what} {text!r}: {e}") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise BadInput(f"{what} {text!r}: expected http://host:port")
    if port == 0:
        raise BadInput(f"{what} {text!r}: port 0 names no server")


@dataclass
class Setup:
    """What starting a candidate needs from the run."""

    out: Path
    models: list[str]
    python: Path  # the reference environment's interpreter (the CPU test engine runs there too)
    suite: Suite
    opts: object  # difftest.run.RunOptions
    reference_fingerprint: dict = field(default_factory=dict)


def cpu_engine_defects(python: Path) -> list[str]:
    """The defects the CPU test engine can plant, asked of the engine itself (a torch-free import)."""
    code = "import json; from runners.cpu_engine.defects import DEFECTS; print(json.dumps(sorted(DEFECTS)))"
    try:
        r = subprocess.run([str(python), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
        return json.loads(r.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        raise InfraError(f"cannot list the CPU test engine's defects with {python}: {e}") from None


def _vllm_omni_options(setup: Setup):
    from .vllm_omni import VllmOmniOptions, decode_settings

    opts = setup.opts
    decode, warnings = decode_settings(setup.suite.segments)
    settings = {"request_timeout": opts.request_timeout, "vocoder_dtype": opts.reference.dtype,
                # the seeded tiny checkpoints never emit EOS: let a length-capped voice clone answer
                "accept_length_finish": setup.suite.model == "tiny", **opts.vllm_omni}
    return VllmOmniOptions.for_decode(decode, opts.concurrency, **settings), warnings


def engine_identity(spec: CandidateSpec, setup: Setup) -> dict:
    """Everything about the engine that decides its results, known before it starts. BadInput for a
    candidate that cannot be (an unknown planted defect, a missing environment)."""
    checkpoints = setup.reference_fingerprint.get("checkpoints")
    if spec.kind == CPU_ENGINE:
        known = cpu_engine_defects(setup.python)
        if spec.defect is not None and spec.defect not in known:
            raise BadInput(f"--candidate {spec.label}: the CPU test engine has no defect {spec.defect!r} "
                           f"(known: {', '.join(known)})")
        return {"kind": CPU_ENGINE, "defect": spec.defect, "code": ident.code_hash(*CPU_ENGINE_CODE),
                "versions": setup.reference_fingerprint.get("versions"), "checkpoints": checkpoints,
                "device": "cpu", "dtype": "float32"}
    if spec.kind in (VLLM_OMNI, VLLM_OMNI_OFFLINE):
        from .vllm_omni import describe

        opts, _ = _vllm_omni_options(setup)
        tasks = {s.task for s in setup.suite.segments}
        api = "server" if spec.kind == VLLM_OMNI else f"offline-{spec.api}"
        return {**describe(setup.models, opts, tasks, api), "plugins": ident.code_hash(*VLLM_OMNI_PLUGINS),
                "checkpoints": checkpoints}
    if spec.declared is not None:  # the caller started it and says what it is; its port is incidental
        return {"kind": URL, "declared": spec.declared, "capture": spec.capture_dir is not None,
                "checkpoints": checkpoints}
    client = SpeechClient(spec.url, connect_retries=1)
    if not client.health():
        raise InfraError(f"candidate {spec.url} is not healthy (GET /health)")
    # What the server says of itself. A server replaced behind the same URL with the same
    # version cannot be told apart (docs/verdicts.md).
    return {"kind": URL, "url": spec.url, "server": client.server_info(), "capture": spec.capture_dir is not None}


def start_candidate(spec: CandidateSpec, setup: Setup, stack: ExitStack) -> tuple:
    """Start (or reach) the candidate; it stops when `stack` closes.

    Returns (client, capture dir or None, provenance): the client is a SpeechClient, or for the
    offline API a RunnerProcess speaking the runner protocol."""
    out, opts = setup.out, setup.opts
    if spec.kind in (VLLM_OMNI, VLLM_OMNI_OFFLINE):
        from .vllm_omni import start_vllm_omni, start_vllm_omni_offline

        vo_opts, warnings = _vllm_omni_options(setup)
        tasks = {s.task for s in setup.suite.segments}
        if spec.kind == VLLM_OMNI_OFFLINE:
            runner, info = start_vllm_omni_offline(out, setup.models, vo_opts, stack, tasks=tasks, api=spec.api)
            return runner, None, {**info, "warnings": warnings}
        client, capture, info = start_vllm_omni(out, setup.models, vo_opts, stack, tasks=tasks)
        return client, capture, {**info, "warnings": warnings}
    if spec.kind == URL:
        client = SpeechClient(spec.url, timeout=opts.request_timeout)
        if not client.health():
            raise InfraError(f"candidate {spec.url} is not healthy (GET /health)")
        info = {"label": spec.label, "url": spec.url}
        if spec.declared:
            info.update({k: v for k, v in spec.declared.items() if k in ("label", "engine", "defect", "versions")})
        return client, spec.capture_dir, info
    capture = out / "capture"
    capture.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [str(setup.python), "-m", "runners.cpu_engine", "--port", str(port)]
    for m in setup.models:
        argv += ["--model", m]
    if spec.defect:
        argv += ["--defect", spec.defect]
    env = dict(os.environ, DIFFTEST_CAPTURE_DIR=str(capture), HF_HUB_OFFLINE="1")
    srv = ServerProcess(argv, f"http://127.0.0.1:{port}", out / "logs" / "cpu-engine.log", env=env, cwd=REPO,
                        health_timeout=opts.engine_health_timeout, name="the CPU test engine (not vLLM-Omni)")
    stack.enter_context(srv)
    client = SpeechClient(srv.url, timeout=opts.request_timeout)
    info = {"label": spec.label, "engine": "difftest CPU test engine (not vLLM-Omni)", "defect": spec.defect,
            "start_seconds": round(srv.started_s or 0.0, 2)}
    return client, capture, info


def is_runner(client) -> bool:
    return isinstance(client, RunnerProcess)
