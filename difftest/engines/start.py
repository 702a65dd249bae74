"""The candidate a run tests: what it is (`--candidate`), what identifies its results, how to start it.

    spec = CandidateSpec.parse("vllm-omni")        # or a URL, vllm-omni-offline[:async], cpu-engine[:DEFECT]
    identity = engine_identity(spec, setup)       # before any model work: reuse checks, provenance
    engine = start_candidate(spec, setup, stack)  # an Engine (engines/base.py), stopped when `stack` closes
    outcome = engine.generate(segments, concurrency=4, out_dir=folder, identity_key=key)

`setup` carries what every kind needs (the run folder, the checkpoints, the reference
environment, the suite and the run's options). `difftest run`, bisect and selfcheck all start
their candidates here; a spec may name another interpreter (bisect's builds), extra engine
arguments, and `declared` facts for the identity (bisect's commit).
"""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from ..checkout import REPO
from ..errors import BadInput, InfraError
from ..process.launcher import ServerProcess, free_port, free_ports
from ..suites.suite import Suite
from . import identity as ident
from .base import Engine
from .http import HttpCandidate
from .runner_candidate import RunnerCandidate
from .speech_client import SpeechClient

CPU_ENGINE = "cpu-engine"
VLLM_OMNI = "vllm-omni"
VLLM_OMNI_OFFLINE = "vllm-omni-offline"
URL = "url"
CPU_ENGINE_CODE = ("runners/cpu_engine", "runners/reference", "runners/protocol.py")
VLLM_OMNI_PLUGINS = ("runners/vllm_omni", "runners/vllm_omni_offline")
CPU_ENGINE_LABEL = "difftest CPU test engine (not vLLM-Omni)"


@dataclass(frozen=True)
class CandidateKind:
    """What a kind of candidate is and does: the commands ask these, never the kind's name (issue 59:
    one place for each fact). A new kind is one record in KINDS (below) and its four functions."""

    name: str
    started_here: bool  # difftest starts (and stops) it; else a server elsewhere, re-checked before reuse
    deploy_file: bool  # serves a vLLM-Omni deploy file: --engine-arg, --matrix, a cell's `production:`
    one_batch_per_wave: bool  # each wave of N is one batch with its voices inline (no arrival patterns)
    planted_defects: bool  # takes a planted defect (`:DEFECT`); its clean control is the same without it
    parse: Callable  # (text, capture_dir) -> CandidateSpec of this kind, or None: not this kind's text
    label: Callable  # (spec) -> str: how reports and logs name it
    identity: Callable  # (spec, setup) -> dict: what decides its results, known before it starts
    start: Callable  # (spec, setup, stack, http options) -> Engine, stopped when `stack` closes
    usage: str  # how --candidate names it


@dataclass
class CandidateSpec:
    """What to test: a server URL (with an optional capture dir), vLLM-Omni started here (its server or its
    offline API), or the CPU test engine started here."""

    kind: str  # URL, CPU_ENGINE, VLLM_OMNI or VLLM_OMNI_OFFLINE
    url: str | None = None
    defect: str | None = None
    capture_dir: Path | None = None
    api: str = "batch"  # vllm-omni-offline: "batch" (Omni.generate) or "async" (AsyncOmni, a request each)
    declared: dict | None = None  # what a caller says the engine is, beyond the rest (bisect: the commit)
    python: str | None = None  # the engine's interpreter, when not the default environment's (bisect's builds)
    engine_args: tuple = ()  # more arguments for the engine's command line
    options: dict = field(default_factory=dict)  # vLLM-Omni: VllmOmniOptions fields over the run's
    # a URL candidate served by one server per checkpoint type (as vLLM-Omni is): API task_type -> URL;
    # each request goes to its task's server (`url` is the first)
    routes: dict | None = None

    @property
    def is_(self) -> CandidateKind:
        """The kind's facts: `spec.is_.started_here`, `spec.is_.deploy_file`, ..."""
        return KINDS[self.kind]

    @classmethod
    def parse(cls, text: str, capture_dir: str | None = None) -> "CandidateSpec":
        for kind in KINDS.values():
            if (spec := kind.parse(text, capture_dir)) is not None:
                return spec
        usage = [KINDS[URL].usage, *(k.usage for k in KINDS.values() if k.name != URL)]
        raise BadInput(f"--candidate {text!r}: expected {', '.join(usage[:-1])} or {usage[-1]}")

    @property
    def label(self) -> str:
        return self.is_.label(self)

    def to_json(self) -> dict:
        """What starting this candidate again takes (run.json's `replay.spec`: `difftest repro` serves
        its probes to the same engine)."""
        return {"kind": self.kind, "url": self.url, "defect": self.defect, "api": self.api,
                "capture_dir": str(self.capture_dir) if self.capture_dir else None, "declared": self.declared,
                "python": self.python, "engine_args": [str(a) for a in self.engine_args], "options": self.options,
                "routes": self.routes}

    @classmethod
    def from_json(cls, d: dict) -> "CandidateSpec":
        """The spec `to_json` wrote (a run.json from before `routes` was kept reads as one server)."""
        return cls(d["kind"], url=d["url"], defect=d["defect"],
                   capture_dir=Path(d["capture_dir"]) if d["capture_dir"] else None, api=d["api"],
                   declared=d["declared"], python=d["python"], engine_args=tuple(d["engine_args"]),
                   options=dict(d["options"] or {}), routes=d.get("routes"))


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
    if u.query or u.fragment:  # a path is kept (a server behind a reverse proxy); these would be dropped
        raise BadInput(f"{what} {text!r}: a query or fragment names no server (expected http://host:port[/path])")


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


def _vllm_omni_options(spec: CandidateSpec, setup: Setup):
    """The vLLM-Omni settings of a run: one place, so `difftest run`, bisect and selfcheck serve
    vLLM-Omni alike (the vocoder's dtype and the request timeout included)."""
    from .reference import never_stops
    from .vllm_omni import VllmOmniOptions, decode_settings

    opts = setup.opts
    decode, warnings = decode_settings(setup.suite.segments)
    settings = {"request_timeout": opts.request_timeout, "vocoder_dtype": opts.reference.dtype,
                # a seeded tiny checkpoint that never emits EOS: let a length-capped voice clone answer
                "accept_length_finish": never_stops(setup.models), **opts.vllm_omni, **spec.options}
    if settings.get("device") == "cuda":
        settings.update(_gpu_placement(settings, setup))
    if spec.python:
        settings["python"] = spec.python
    if spec.engine_args:
        settings["extra_args"] = list(spec.engine_args)
    top = dict(settings.get("deploy_overrides") or {})
    if "async_chunk" in top:  # one place for it: the option, which the runners read
        settings["async_chunk"] = bool(top.pop("async_chunk"))
    settings["deploy_overrides"] = top
    vo = VllmOmniOptions.for_decode(decode, opts.concurrency, **settings)
    if vo.deploy_overrides or vo.stage_overrides:
        from .engine_args import check
        from .vllm_omni import omni_python

        check(omni_python(vo.python), vo.deploy_overrides, vo.stage_overrides)
    return vo, warnings


def _gpu_placement(settings: dict, setup: Setup) -> dict:
    """The candidate's GPUs (default: the reference's) and each stage's memory fraction, leaving
    room for the reference models where they share a GPU (difftest.process.placement)."""
    from ..process import placement
    from .vllm_omni import models_for_tasks

    ref = placement.parse_device(setup.opts.reference.device, "reference device")
    gpus = placement.candidate_gpus(tuple(settings.get("gpus") or ()), ref)
    out = {"gpus": gpus}
    if settings.get("memory_fractions"):
        return out
    servers = len(models_for_tasks(setup.models, {s.task for s in setup.suite.segments}))
    ref_gpu = ref.index if ref.kind == "cuda" else None
    shared = ref_gpu is not None and ref_gpu in gpus
    need = placement.reference_bytes(setup.models) if shared else 0
    total = placement.gpu_total_bytes(ref_gpu) if shared else None
    out["memory_fractions"] = placement.stage_memory_fractions(gpus, servers, ref_gpu, need, total)
    return out


def engine_identity(spec: CandidateSpec, setup: Setup) -> dict:
    """Everything about the engine that decides its results, known before it starts. BadInput for a
    candidate that cannot be (an unknown planted defect, a missing environment)."""
    return spec.is_.identity(spec, setup)


def _declared(spec: CandidateSpec) -> dict:
    return {"declared": spec.declared} if spec.declared is not None else {}


def _cpu_engine_identity(spec: CandidateSpec, setup: Setup) -> dict:
    vo = getattr(setup.opts, "vllm_omni", None) or {}
    stages = {0: "talker.", 1: "vocoder."}
    given = [f"--engine-arg {stages.get(stage, '')}{k}" for stage, kv in
             [(None, vo.get("deploy_overrides") or {}), *(vo.get("stage_overrides") or {}).items()] for k in kv]
    given += ["--deploy-config"] * bool(vo.get("deploy_base")) + ["--async-chunk"] * bool(vo.get("async_chunk"))
    if given:  # ignored, the run would pass as if that configuration had been tested
        raise BadInput(f"{', '.join(given)}: vLLM-Omni settings; the CPU test engine ({spec.label}) has none "
                       f"(use --candidate vllm-omni)")
    known = cpu_engine_defects(Path(spec.python or setup.python))
    if spec.defect is not None and spec.defect not in known:
        raise BadInput(f"--candidate {spec.label}: the CPU test engine has no defect {spec.defect!r} "
                       f"(known: {', '.join(known)})")
    return {"kind": CPU_ENGINE, "defect": spec.defect, "code": ident.code_hash(*CPU_ENGINE_CODE),
            "versions": setup.reference_fingerprint.get("versions"),
            "checkpoints": setup.reference_fingerprint.get("checkpoints"),
            "device": "cpu", "dtype": _option(spec.engine_args, "--talker-dtype") or "float32",
            "engine_args": list(spec.engine_args),
            "subtalker_sampling": _subtalker_sampling(setup.suite), **_declared(spec)}


def _vllm_omni_identity(spec: CandidateSpec, setup: Setup) -> dict:
    from .vllm_omni import describe

    opts, _ = _vllm_omni_options(spec, setup)
    tasks = {s.task for s in setup.suite.segments}
    api = "server" if spec.kind == VLLM_OMNI else f"offline-{spec.api}"
    return {**describe(setup.models, opts, tasks, api), "plugins": ident.code_hash(*VLLM_OMNI_PLUGINS),
            "checkpoints": setup.reference_fingerprint.get("checkpoints"), **_declared(spec)}


def _url_identity(spec: CandidateSpec, setup: Setup) -> dict:
    if spec.declared is not None:  # the caller started it and says what it is; its port is incidental
        return {"kind": URL, "capture": spec.capture_dir is not None,
                "checkpoints": setup.reference_fingerprint.get("checkpoints"), **_declared(spec)}
    servers = {}
    for task, url in (spec.routes or {"": spec.url}).items():
        client = SpeechClient(url, connect_retries=1)
        if not client.health():
            raise InfraError(f"candidate {url} is not healthy (GET /health)")
        servers[task] = client.server_info()
    # What the server says of itself. A server replaced behind the same URL with the same
    # version cannot be told apart (docs/verdicts.md).
    routed = {"routes": dict(spec.routes), "servers": servers} if spec.routes else {"server": servers[""]}
    return {"kind": URL, "url": spec.url, **routed, "capture": spec.capture_dir is not None}


def _option(argv, name: str) -> str | None:
    """The value of `name` on an engine's extra command line (`--name V` or `--name=V`), else None."""
    argv = [str(a) for a in argv]
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def start_candidate(spec: CandidateSpec, setup: Setup, stack: ExitStack, run_tag: str = "") -> Engine:
    """Start (or reach) the candidate; it stops when `stack` closes. The one way every command
    (run, bisect, selfcheck) starts one. Returns it behind the Engine surface (engines/base.py)."""
    opts = setup.opts
    http = {"pattern": opts.pattern, "order": opts.order, "voice_mode": opts.voice_mode, "run_tag": run_tag}
    return spec.is_.start(spec, setup, stack, http)


def _start_vllm_omni(spec: CandidateSpec, setup: Setup, stack: ExitStack, http: dict) -> Engine:
    from .vllm_omni import start_vllm_omni, start_vllm_omni_offline

    vo_opts, warnings = _vllm_omni_options(spec, setup)
    tasks = {s.task for s in setup.suite.segments}
    if spec.kind == VLLM_OMNI_OFFLINE:
        runner, info = start_vllm_omni_offline(setup.out, setup.models, vo_opts, stack, tasks=tasks, api=spec.api)
        return RunnerCandidate(runner, spec.label, {**info, "warnings": warnings}, order=setup.opts.order,
                               timeout=vo_opts.health_timeout)
    client, capture, info = start_vllm_omni(setup.out, setup.models, vo_opts, stack, tasks=tasks)
    return HttpCandidate(client, capture, spec.label, {**info, "warnings": warnings}, **http)


def _start_url(spec: CandidateSpec, setup: Setup, stack: ExitStack, http: dict) -> Engine:
    timeout = setup.opts.request_timeout
    client = SpeechClient(spec.url, timeout=timeout)
    if spec.routes:
        from .vllm_omni import RoutingSpeechClient

        client = RoutingSpeechClient({task: SpeechClient(url, timeout=timeout) for task, url in spec.routes.items()})
    if not client.health():
        raise InfraError(f"candidate {spec.url} is not healthy (GET /health)")
    info = {"label": spec.label, "url": spec.url}
    if spec.declared:
        info.update({k: v for k, v in spec.declared.items() if k in ("label", "engine", "defect", "versions")})
    return HttpCandidate(client, spec.capture_dir, spec.label, info, **http)


def _start_cpu_engine(spec: CandidateSpec, setup: Setup, stack: ExitStack, http: dict) -> Engine:
    urls, capture, srv = _cpu_engines(setup, stack, {spec.defect: None}, python=spec.python,
                                      engine_args=spec.engine_args, name=f"cpu-engine-{spec.defect or 'clean'}")
    info = {"label": spec.label, "engine": CPU_ENGINE_LABEL, "defect": spec.defect,
            "start_seconds": round(srv.started_s or 0.0, 2)}
    return HttpCandidate(SpeechClient(urls[spec.defect], timeout=setup.opts.request_timeout), capture, spec.label,
                         info, **http)


def _parse_vllm_omni(text: str, capture_dir) -> CandidateSpec | None:
    return CandidateSpec(VLLM_OMNI) if text == VLLM_OMNI else None


def _parse_offline(text: str, capture_dir) -> CandidateSpec | None:
    if text != VLLM_OMNI_OFFLINE and not text.startswith(VLLM_OMNI_OFFLINE + ":"):
        return None
    api = text.split(":", 1)[1] if ":" in text else "batch"
    if api not in ("batch", "async"):
        raise BadInput(f"--candidate {text!r}: the offline API is batch (vllm_omni.Omni) or async "
                       f"(vllm_omni.AsyncOmni)")
    return CandidateSpec(VLLM_OMNI_OFFLINE, api=api)


def _parse_cpu_engine(text: str, capture_dir) -> CandidateSpec | None:
    if text != CPU_ENGINE and not text.startswith(CPU_ENGINE + ":"):
        return None
    defect = text.split(":", 1)[1] if ":" in text else None
    return CandidateSpec(CPU_ENGINE, defect=defect or None)


def _parse_url(text: str, capture_dir) -> CandidateSpec | None:
    if not text.startswith(("http://", "https://")):
        return None
    check_url(text, "--candidate")
    return CandidateSpec(URL, url=text.rstrip("/"), capture_dir=Path(capture_dir) if capture_dir else None)


def _cpu_engine_label(spec: CandidateSpec) -> str:
    return "difftest-cpu-engine" + (f":{spec.defect}" if spec.defect else "")


KINDS = {k.name: k for k in (
    CandidateKind(VLLM_OMNI, started_here=True, deploy_file=True, one_batch_per_wave=False, planted_defects=False,
                  parse=_parse_vllm_omni, label=lambda spec: VLLM_OMNI, identity=_vllm_omni_identity,
                  start=_start_vllm_omni, usage=f"{VLLM_OMNI} (vLLM-Omni's server started here)"),
    CandidateKind(VLLM_OMNI_OFFLINE, started_here=True, deploy_file=True, one_batch_per_wave=True,
                  planted_defects=False, parse=_parse_offline,
                  label=lambda spec: VLLM_OMNI_OFFLINE + (":async" if spec.api == "async" else ""),
                  identity=_vllm_omni_identity, start=_start_vllm_omni,
                  usage=f"{VLLM_OMNI_OFFLINE}[:async] (its offline API, float32 audio)"),
    CandidateKind(CPU_ENGINE, started_here=True, deploy_file=False, one_batch_per_wave=False, planted_defects=True,
                  parse=_parse_cpu_engine, label=_cpu_engine_label, identity=_cpu_engine_identity,
                  start=_start_cpu_engine, usage=f"{CPU_ENGINE}[:DEFECT] (the CPU test engine, not vLLM-Omni)"),
    CandidateKind(URL, started_here=False, deploy_file=False, one_batch_per_wave=False, planted_defects=False,
                  parse=_parse_url, label=lambda spec: spec.url, identity=_url_identity, start=_start_url,
                  usage="a server URL (http://host:port)"),
)}
DEPLOY_FILE_KINDS = tuple(k for k, v in KINDS.items() if v.deploy_file)


def start_cpu_engines(defects: list[str | None], setup: Setup, stack: ExitStack) -> dict:
    """Several CPU test engines in one process (`difftest selfcheck`: one model load for all):
    defect (None: clean) -> a URL CandidateSpec declaring what it serves."""
    ports = dict(zip(defects, free_ports(len(defects))))
    urls, capture, _ = _cpu_engines(setup, stack, ports, name="cpu-engines")
    return {d: CandidateSpec(URL, url=urls[d], capture_dir=capture,
                             declared={"label": "difftest-cpu-engine" + (f":{d}" if d else ""),
                                       "engine": CPU_ENGINE_LABEL, "defect": d,
                                       "code": ident.code_hash(*CPU_ENGINE_CODE)})
            for d in defects}


def _subtalker_sampling(suite) -> dict:
    """The sub-talker's sampling for the suite: deploy-level in the CPU engine as in vLLM-Omni (one
    setting per server, the first segment's; difftest.engines.vllm_omni.decode_settings warns)."""
    d = suite.segments[0].decode if suite is not None and suite.segments else {}
    sub = {"do_sample": bool(d.get("subtalker_dosample", False))}
    if sub["do_sample"]:
        sub.update({k: d[f"subtalker_{k}"] for k in ("temperature", "top_k", "top_p") if f"subtalker_{k}" in d})
    return sub


def _cpu_engines(setup: Setup, stack: ExitStack, ports: dict, *, python: str | None = None, engine_args=(),
                 name: str) -> tuple[dict, Path, ServerProcess]:
    """Start the CPU test engine (one defect: runners.cpu_engine; several: runners.cpu_engine.multi)
    under ServerProcess, healthy before it returns; defect -> URL, the capture folder, the server."""
    capture = setup.out / "capture"
    capture.mkdir(parents=True, exist_ok=True)
    if len(ports) == 1:
        (defect,) = ports
        port = free_port()
        argv = [str(python or setup.python), "-m", "runners.cpu_engine", "--port", str(port)]
        argv += ["--defect", defect] if defect else []
        urls = {defect: f"http://127.0.0.1:{port}"}
    else:
        argv = [str(python or setup.python), "-m", "runners.cpu_engine.multi"]
        for d, port in ports.items():
            argv += ["--serve", f"{d or 'none'}={port}"]
        urls = {d: f"http://127.0.0.1:{port}" for d, port in ports.items()}
    for m in setup.models:
        argv += ["--model", m]
    argv += ["--subtalker-sampling", json.dumps(_subtalker_sampling(setup.suite))]
    argv += [str(a) for a in engine_args]
    env = dict(os.environ, DIFFTEST_CAPTURE_DIR=str(capture), HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)  # the engine's own environment and this checkout, nothing else
    srv = ServerProcess(argv, next(iter(urls.values())), setup.out / "logs" / f"{name}.log", env=env, cwd=REPO,
                        health_timeout=setup.opts.engine_health_timeout, name=f"the {CPU_ENGINE_LABEL}")
    stack.enter_context(srv)
    for d, url in urls.items():
        if not SpeechClient(url, connect_retries=5).health():
            raise InfraError(f"the CPU test engine for {d or 'clean'} did not come up at {url}")
    return urls, capture, srv
