"""Reference results for a suite: qwen-tts at concurrency 1, through its runner.

`run_reference` starts the reference runner (runners/reference, in its own
environment), learns from its announcement which configuration it is, and asks
it only for the segments the store does not already hold for that
configuration. Runners write the result files; this side reads them back.

    difftest reference SUITE --store DIR [--model M ...] [--python PATH]
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..checkout import REPO
from ..errors import EXIT_BAD_INPUT, EXIT_INFRA, EXIT_PASS, BadInput, InfraError
from ..family import FAMILIES, FAMILY, QWEN3_TTS, ModelFamily
from ..process import zygote
from ..process.placement import gpu_env, parse_device
from ..process.runner_client import RunnerDied, RunnerProcess
from ..progress import Progress
from ..results import CorruptResult, Result, ResultStore, read_result
from ..suites.checkpoints import MANIFEST
from ..suites.suite import TINY_HAZARD, Suite
from .base import Outcome

DEFAULT_PYTHON = REPO / ".venv-reference" / "bin" / "python"
PYTHON_ENV_VAR = "DIFFTEST_REFERENCE_PYTHON"
LABELS = {f.reference_label: f for f in FAMILIES.values()}  # what a reference runner may announce
TINY_SEED = 0
# The builder's listening scale (runners/reference/tiny_checkpoint.py LISTEN), passed explicitly and
# part of the folder name: a store holding an earlier build keeps it, the new one goes beside it.
TINY_LISTEN = 3


@dataclass
class ReferenceOptions:
    models: list[str] = field(default_factory=list)  # empty: taken from the suite's `model`
    python: str | None = None  # the reference environment's interpreter
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 1
    log_path: Path | None = None  # the runner's stderr; default <store>/logs/qwen-tts-runner.log
    timeout: float = 900.0  # longest silence from the runner (a first model load included)


@dataclass
class ReferenceRun(Outcome):
    """The reference's outcome, with the configuration it came from: the runner's fingerprint
    (the cache key's engine half) and provenance, and the store folder of its results."""

    config_dir: Path | None = None
    fingerprint: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)


def reference_python(explicit: str | None = None) -> Path:
    """The interpreter of the reference environment; BadInput with the fix when absent."""
    path = Path(explicit or os.environ.get(PYTHON_ENV_VAR) or DEFAULT_PYTHON)
    if not path.exists():
        raise BadInput(f"reference environment not found: {path} (create it with runners/reference/make_env.sh, "
                       f"or pass --python / set {PYTHON_ENV_VAR})")
    return path


def tiny_folder(seed: int = TINY_SEED, hazard: bool = False) -> str:
    return f"tiny-seed{seed}-listen{TINY_LISTEN}" + ("-hazard" if hazard else "")


def tiny_checkpoints(store_root: Path, python: Path, seed: int = TINY_SEED, hazard: bool = False) -> list[str]:
    """The tiny checkpoint set under the store (built once); returns its three folders.

    A store without it gets a copy of the set from difftest's cache (kind `tiny-checkpoint`), built
    there once per builder source and reference environment: building imports qwen-tts and draws
    every tensor (about 7 s), copying takes a tenth of that. The builder then checks the folders it
    would have built against their manifests (every file's sha256), as for a store built in place."""
    out = Path(store_root).resolve() / "checkpoints" / tiny_folder(seed, hazard)
    if not all((out / t / MANIFEST).is_file() for t in TINY_TYPES):
        _copy_cached_set(out, python, seed, hazard)
    _tiny_builder(python, out, seed, hazard)
    return [str(out / t) for t in TINY_TYPES]


TINY_TYPES = tuple(FAMILY.checkpoint_types.values())  # the set the builder makes: one of each
# What a build depends on in this repository: the builder and what it imports from here.
_BUILDER_SOURCES = tuple(f"runners/reference/{name}" for name in (
    "tiny_checkpoint.py", "checkpoint.py", "environment.py", "torchaudio_stub.py")) + ("difftest/family.py",)


def _tiny_builder(python: Path, out: Path, seed: int, hazard: bool = False) -> None:
    cmd = [str(python), "-m", "runners.reference.tiny_checkpoint", str(out), "--seed", str(seed),
           "--listen", str(TINY_LISTEN)] + ["--hazard"] * hazard
    # offline as the builder makes itself (import_qwen_tts), set here so a zygote can stand for it
    r = zygote.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        raise InfraError(f"building the tiny checkpoint failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")


def tiny_cache_key(python: Path, seed: int = TINY_SEED, hazard: bool = False) -> str:
    """Everything a build comes from: seed and listening scale, the builder's source, and the
    reference environment's interpreter and every installed distribution with its version."""
    probe = ("import importlib.metadata as m, json, sys; print(json.dumps([sys.version, sorted("
             "f\"{d.metadata['Name']}=={d.version}\" for d in m.distributions())]))")
    r = subprocess.run([str(python), "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise InfraError(f"{python}: could not list its packages: {r.stderr.strip()[-1500:]}")
    h = hashlib.sha256(r.stdout.encode())
    for name in _BUILDER_SOURCES:
        h.update(name.encode() + b"\0" + (REPO / name).read_bytes())
    return f"seed{seed}-listen{TINY_LISTEN}{'-hazard' if hazard else ''}-{h.hexdigest()[:16]}"


def _copy_cached_set(out: Path, python: Path, seed: int, hazard: bool = False) -> None:
    from ..cache import Cache
    from ..suites.checkpoints import hash_files

    def intact(root: Path) -> bool:  # every file as its manifest says (a damaged entry is built again)
        for t in TINY_TYPES:
            try:
                files = json.loads((root / t / MANIFEST).read_text(encoding="utf-8"))["files"]
            except (OSError, ValueError, KeyError, TypeError):
                return False
            if files != hash_files(root / t):
                return False
        return True

    with Cache().use("tiny-checkpoint", tiny_cache_key(python, seed, hazard), valid=intact,
                     build=lambda root: (shutil.rmtree(root, ignore_errors=True),
                                         _tiny_builder(python, root, seed, hazard))
                     ) as lease:
        out.mkdir(parents=True, exist_ok=True)
        for t in TINY_TYPES:
            # the builder's own lock for out/t, and its rule: a folder that is there is not replaced here
            with open(out / f".{t}.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if (out / t).exists():
                    continue
                tmp = Path(tempfile.mkdtemp(dir=out, prefix=f".{t}.", suffix=".tmp"))
                try:
                    shutil.copytree(lease.path / t, tmp, dirs_exist_ok=True)
                    os.chmod(tmp, 0o755)
                    os.replace(tmp, out / t)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)


TINY_FORMAT = "difftest.checkpoint/1"


def tiny_build(model: str) -> dict | None:
    """The builder's manifest when `model` is a folder holding a difftest tiny checkpoint, else None."""
    try:
        manifest = json.loads((Path(model) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == TINY_FORMAT else None


def never_stops(models: list[str]) -> bool:
    """True when the voice-clone checkpoint among `models` is a tiny build without an EOS bias: its
    random talker never emits codec EOS, so every request runs to max_new_tokens."""
    for m in models:
        manifest = tiny_build(m)
        if manifest is not None and manifest.get("type") == "base":
            return not manifest.get("eos_bias")
    return False


def family_tiny(store_root: Path, python: Path, family: ModelFamily, seed: int = TINY_SEED) -> list[str]:
    """A family's seeded tiny checkpoint under the store, built there once by its builder (one folder,
    rebuilt in place when the builder's parameters or version changed: the results keyed by its
    content hash are then another configuration's)."""
    out = Path(store_root).resolve() / "checkpoints" / f"{family.tiny[0]}-seed{seed}"
    cmd = [str(python), "-m", family.checkpoint_builder, str(out), "--seed", str(seed), "--force"]
    r = zygote.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        raise InfraError(f"building the tiny {family.display} checkpoint failed ({' '.join(cmd)}):\n{r.stderr[-3000:]}")
    return [str(out)]


def suite_models(suite: Suite, store_root: Path, python: Path) -> list[str]:
    """The checkpoints a suite's `model:` names: the seeded tiny builds (built once), else the model itself."""
    if suite.model in QWEN3_TTS.tiny:
        return tiny_checkpoints(store_root, python, hazard=suite.model == TINY_HAZARD)
    if suite.model in suite.family.tiny:
        return family_tiny(store_root, python, suite.family)
    return [suite.model]


def runner_argv(python: Path, models: list[str], options: ReferenceOptions,
                family: ModelFamily = QWEN3_TTS) -> list[str]:
    """The runner's command line. It runs in the repository root: local paths are made absolute."""
    argv = [str(python), "-m", family.reference_runner]
    for m in models:
        argv += ["--model", str(Path(m).resolve()) if Path(m).exists() else m]
    device = parse_device(options.device, "reference device")  # cuda:N: the runner sees only GPU N, as cuda
    return argv + ["--device", device.kind, "--dtype", options.dtype, "--threads", str(options.threads)]


def runner_env(options: ReferenceOptions, base: dict | None = None) -> dict:
    """The runner's environment: offline, and on a GPU host confined to its own GPU."""
    env = dict(os.environ if base is None else base, HF_HUB_OFFLINE="1")
    device = parse_device(options.device, "reference device")
    if device.kind == "cuda":
        env.update(gpu_env([device.index]))
    return env


def start_runner(runner: RunnerProcess) -> dict:
    """Start a reference runner; its refusal of checkpoints or options (exit 2) is BadInput."""
    try:
        hello = runner.start()
    except RunnerDied as e:
        code = runner.proc.returncode if runner.proc else None
        if code == EXIT_BAD_INPUT:  # the runner's verdict on its checkpoints or options
            raise BadInput(f"the reference runner refused to start: {e.tail or e}") from None
        raise InfraError(f"the reference runner did not start: {e}") from None
    _check_hello(runner)
    return hello


def _check_hello(runner: RunnerProcess) -> None:
    hello = runner.hello
    if hello.get("label") not in LABELS or not isinstance(hello.get("fingerprint"), dict):
        runner.kill()
        raise InfraError(f"not a reference runner ({', '.join(LABELS)}): {json.dumps(hello)[:300]}")


class ReferenceEngine:
    """The reference at concurrency 1 (qwen-tts, or a family's own: `label`, as its runner announces)
    behind a running reference runner, with the result store as its cache: the Engine surface
    (engines/base.py) of the reference side."""

    def __init__(self, runner: RunnerProcess, store_root: str | Path, timeout: float = 900.0):
        if runner.proc is None:
            start_runner(runner)
        else:
            _check_hello(runner)
        self.runner, self.timeout = runner, timeout
        self.store = ResultStore(Path(store_root).resolve())  # the runner writes there from another folder
        self.fingerprint = runner.hello["fingerprint"]
        self.info = runner.hello.get("provenance", {})
        self.label = runner.hello["label"]

    def generate(self, segments: list, *, concurrency: int = 1, out_dir: Path | None = None,
                 identity_key: str | None = None, progress: Progress | None = None,
                 dtype: str | None = None, codes_only: bool = False) -> ReferenceRun:
        """Cached results from the store, the rest computed. A runner that dies mid-suite does not
        raise: the segments it did not answer are infrastructure errors naming its exit status and
        log tail, and the results it wrote stay in the store. `dtype`: qwen-tts in another dtype
        than the runner's own, and `codes_only`: no vocoder (the measured null,
        difftest/verdicts/null.py), each stored under that configuration's own key."""
        if concurrency != 1:
            raise BadInput(f"the reference runs at concurrency 1, not {concurrency}")
        fingerprint, info, dtype = self._configuration(dtype, codes_only)
        config_dir = self.store.config_dir(self.label, fingerprint)
        run = ReferenceRun(config_dir=config_dir, fingerprint=fingerprint, provenance=info)
        label = "reference" if dtype is None and not codes_only else f"null ({dtype or fingerprint['dtype']})"
        progress = progress or Progress(len(segments), label=label)
        try:
            todo = self._cached(segments, config_dir, run, progress)
            if todo:
                self._generate(todo, config_dir, run, progress, {**({"dtype": dtype} if dtype else {}),
                                                                  **({"codes_only": True} if codes_only else {})})
        finally:
            progress.close()
        run.batches = [[s.id] for s in segments]  # one at a time
        return run

    def generate_waves(self, waves: list[list], dtype: str | None = None) -> ReferenceRun:
        """qwen-tts's codes for each wave of segments decoded as one batch (its own batched
        generation; the runner's `waves`): the measured null at concurrency N. A wave's segments must
        share a task and decode parameters and be greedy (difftest/verdicts/null.py groups them).
        Each wave is stored under its own key (the configuration, codes only, and the wave's segment
        hashes in order: its mates decide its codes); a wave of one is the codes-only decode at 1."""
        fingerprint, info, dtype = self._configuration(dtype, True)
        run = ReferenceRun(fingerprint=fingerprint, provenance=info)
        progress = Progress(sum(len(w) for w in waves), label=f"null at N ({dtype or fingerprint['dtype']}, batched)")
        opts = {**({"dtype": dtype} if dtype else {}), "codes_only": True}
        try:
            for wave in waves:
                alone = len(wave) == 1  # a wave of one is the codes-only decode at 1, under that key
                config_dir = self.store.config_dir(self.label, fingerprint if alone else
                                                   {**fingerprint, "batch": [s.hash for s in wave]})
                if not alone and any(self.store.get(config_dir, s.id, s.hash) is None for s in wave):
                    todo = list(wave)  # one missing: the whole wave again (its mates decide its codes)
                else:
                    todo = self._cached(wave, config_dir, run, progress)
                if todo:
                    self._generate(todo, config_dir, run, progress,
                                   opts if alone else {**opts, "waves": [[s.id for s in wave]]})
        finally:
            progress.close()
        run.batches = [[s.id for s in w] for w in waves]
        return run

    def _configuration(self, dtype: str | None, codes_only: bool) -> tuple[dict, dict, str | None]:
        """The fingerprint and provenance of qwen-tts in `dtype` (None: the runner's own), codes only or
        not; and `dtype` as the runner's job takes it (None for its own)."""
        fingerprint, info = self.fingerprint, self.info
        if dtype is not None and dtype != fingerprint.get("dtype"):
            if dtype not in self.runner.hello.get("generate_dtypes", ()):
                raise InfraError(f"the reference runner cannot decode in {dtype} (an older runner?): restart it "
                                 f"from this checkout")
            fingerprint, info = {**fingerprint, "dtype": dtype}, {**info, "dtype": dtype}
        else:
            dtype = None
        if codes_only:
            if not self.runner.hello.get("generate_codes_only"):
                raise InfraError("the reference runner cannot decode codes only (an older runner?): restart it "
                                 "from this checkout")
            fingerprint = {**fingerprint, "output": "codes"}
        return fingerprint, info, dtype

    def _cached(self, segments: list, config_dir: Path, run: ReferenceRun, progress: Progress) -> list:
        """The segments the store does not hold in `config_dir`; those it holds go into `run`."""
        todo = []
        for seg in segments:
            hit = self.store.get(config_dir, seg.id, seg.hash)
            if hit is None:
                todo.append(seg)
            else:
                run.results[seg.id] = hit
                run.cached.add(seg.id)
                progress.segment(seg.id, cached=True)
        return todo

    def _generate(self, todo: list, config_dir: Path, run: ReferenceRun, progress: Progress,
                  options: dict | None = None) -> None:
        pending = {s.id: s for s in todo}

        def fail(sid, kind, message):
            run.fail(sid, kind, message, source="reference")
            progress.segment(sid, error=message)

        try:
            for ev in self.runner.request("generate", timeout=self.timeout, segments=[s.to_job() for s in todo],
                                          out_dir=str(config_dir), concurrency=1, **(options or {})):
                sid, kind = ev.get("segment"), ev.get("event")
                if kind == "progress":
                    progress.note(f"{sid}: {ev.get('message', '')}")
                    continue
                if sid not in pending:
                    if kind in ("error", "protocol_error"):
                        progress.note(f"runner: {ev.get('message', ev)}")
                    continue
                seg = pending.pop(sid)
                if kind != "result":
                    # the segment or its voice is wrong (bad_input), or qwen-tts failed on it
                    fail(sid, "bad_input" if ev.get("kind") == "bad_input" else "infrastructure",
                         ev.get("message", "error without a message"))
                    continue
                try:
                    r = _read(ev.get("path", ""), seg.hash)
                except CorruptResult as e:
                    fail(sid, "infrastructure", str(e))
                    continue
                run.results[sid] = r
                if ev.get("cached"):
                    run.cached.add(sid)
                progress.segment(sid, cached=bool(ev.get("cached")), seconds=float(ev.get("seconds") or 0.0),
                                 audio_seconds=r.seconds)
        except RunnerDied as e:
            for sid in pending:
                run.fail(sid, "infrastructure", f"no answer: {e}", source="reference")
                progress.segment(sid, error=f"no answer: {str(e).splitlines()[0]}")
            return
        for sid in pending:  # `done` came early: a runner bug, reported per segment all the same
            fail(sid, "infrastructure", "the runner finished the job without answering this segment")


def run_reference(suite: Suite, store_root: str | Path, options: ReferenceOptions | None = None, *,
                  progress: Progress | None = None, runner: RunnerProcess | None = None) -> ReferenceRun:
    """Reference results for every segment of `suite` (ReferenceEngine.generate).

    `runner`: a reference runner the caller owns (started or not; it stays open, e.g. for
    cross-decodes afterwards). Without it, one is started from `options` and closed at the end.
    Raises BadInput (the runner refused its checkpoints or options) or InfraError (it could not start).
    """
    options = options or ReferenceOptions()
    store_root = Path(store_root).resolve()
    own_runner = runner is None
    if own_runner:
        python = reference_python(options.python)
        models = list(options.models) or suite_models(suite, store_root, python)
        log_path = options.log_path or store_root / "logs" / f"{suite.family.reference_label}-runner.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        runner = RunnerProcess(runner_argv(python, models, options, suite.family), env=runner_env(options),
                               log_path=log_path, cwd=REPO)
    try:
        return ReferenceEngine(runner, store_root, options.timeout).generate(suite.segments, progress=progress)
    finally:
        if own_runner:
            runner.close()


def _read(path: str, segment_hash: str) -> Result:
    try:
        r = read_result(path)
    except CorruptResult as e:
        raise CorruptResult(f"the runner's result is unreadable: {e}") from None
    if r.segment_hash != segment_hash:
        raise CorruptResult(f"{path} holds segment hash {r.segment_hash[:16]}, expected {segment_hash[:16]}")
    return r


def exit_code(run: ReferenceRun) -> int:
    kinds = {e["kind"] for e in run.errors.values()}
    if kinds - {"bad_input"}:
        return EXIT_INFRA
    return EXIT_BAD_INPUT if kinds else EXIT_PASS
