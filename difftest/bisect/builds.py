"""How to start a build: one commit of the repository under test made into a running candidate.

    worktrees = Worktrees(repo)                                # builds in difftest's cache (or a root of their own)
    with ExitStack() as hold:
        build = prepare(recipe, worktrees, sha, hold)          # cached per commit, held; BuildFailed: skip it
        with recipe.launcher(build, LaunchContext(...)) as launcher:
            spec, engine = launcher.candidate(repeat)          # started with start_candidate; `run(..., candidate=engine)`

A commit becomes a candidate in three steps, each cached or scoped:

1. **Source**: a git worktree of the commit (`<cache>/bisect-build/<sha>/src`, detached), made with real git.
2. **Environment**: a per-commit venv *overlaid* on a shared base environment
   (`<cache>/bisect-build/<sha>/env`): `python -m venv --without-pip`, then a `.pth` that adds the
   base environment's site directories after the overlay's own, then
   `pip install --no-deps --no-build-isolation -e <worktree>` in compat mode (a plain path
   entry, which wins over a copy of the same package in the base environment; setuptools'
   default finder would lose to it). The import location of the recipe's module is
   checked to be inside the worktree. About 2 s and a few kB per commit; the heavy
   packages (torch, vllm) stay in the base. A stamp makes a second use free. The build is an
   entry of difftest's cache (docs/caches.md): built under a lock (a second process building
   the same commit waits and reuses it), held while its probe runs, removed least recently
   used first when the cache is over its bound.
3. **Launch**: the recipe's launcher, a context manager that starts the server(s) with the
   overlay's interpreter through difftest.engines.start.start_candidate (the settings `difftest
   run` uses: the vocoder's dtype, the request timeout, the deploy overlay) and stops them (whole
   process tree) on the way out.

Recipes (`RECIPES`):

- `vllm-omni`: a vLLM-Omni source checkout over a vLLM-Omni base environment (on a GPU
  host the one that already holds vllm, torch and difftest's capture plugin); served by
  `vllm serve --omni` with the overlay's interpreter.
- `cpu-engine`: for tests and CPU machines. The repository under test is a small package
  (the tests' `fakeomni`) that declares, at each commit, which defect the CPU test engine
  should plant: `MODULE:FUNCTION` (default `fakeomni:planted_defect`) is called in the
  commit's environment before each run and answers a defect name or None. The engine
  (runners/cpu_engine, not vLLM-Omni) runs under the commit's interpreter. A package that
  answers differently from call to call makes a flaky candidate; one engine per answer
  is started and kept for the probe's runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from ..cache import Cache
from ..engines.base import Engine
from ..engines.engine_args import parse as parse_engine_args
from ..engines.reference import reference_python
from ..engines.start import CPU_ENGINE, VLLM_OMNI, CandidateSpec, Setup, start_candidate
from ..errors import BadInput, InfraError
from ..process.zygote import BASE_PTH
from ..results import atomic_write
from ..run import RunOptions
from ..suites.suite import Suite

KIND = "bisect-build"  # its entries in difftest's cache
STAMP = ".difftest-build.json"
STAMP_FORMAT = "difftest.build/1"
# Compat editable mode: a path entry in a .pth, so the worktree's package comes before a copy
# of the same package in the base environment (setuptools' default finder comes after it).
DEFAULT_PIP_ARGS = ("--no-deps", "--no-build-isolation", "--config-settings", "editable_mode=compat")


class BuildFailed(InfraError):
    """This commit cannot become a candidate (no checkout, no install, no import): skip it."""


class GitError(BadInput):
    pass


# -- git ----------------------------------------------------------------------------------------

def git(repo: str | Path, *args: str, check: bool = True) -> str:
    try:
        p = subprocess.run(["git", "-C", str(repo), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    except OSError as e:
        raise GitError(f"cannot run git: {e}") from None
    if check and p.returncode != 0:
        raise GitError(f"git {' '.join(args)} (in {repo}) failed: {p.stderr.strip() or p.returncode}")
    return p.stdout.strip()


def resolve(repo: str | Path, rev: str) -> str:
    """The full commit id of `rev` in `repo`."""
    if not Path(repo).is_dir():
        raise BadInput(f"--repo {repo}: not a directory")
    p = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise GitError(f"{rev!r} is not a commit in {repo}" + (f" ({p.stderr.strip()})" if p.stderr.strip() else ""))
    return p.stdout.strip()


def commit_info(repo: str | Path, sha: str) -> dict:
    subject, date, author = git(repo, "log", "-1", "--format=%s%x00%cI%x00%an", sha).split("\0")
    return {"commit": sha, "subject": subject, "date": date, "author": author}


def first_parent_range(repo: str | Path, good: str, bad: str) -> list[str]:
    """[good, ..., bad]: the commits after `good` on `bad`'s first-parent line, oldest first.

    A merge on that line stands for its whole side branch: name it the culprit, and bisect
    the branch (or use `git bisect run difftest probe`, which walks the whole graph)."""
    if good == bad:
        raise BadInput("--good and --bad are the same commit")
    p = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", good, bad])
    if p.returncode != 0:
        raise BadInput(f"--good {good[:12]} is not an ancestor of --bad {bad[:12]}")
    shas = git(repo, "rev-list", "--first-parent", "--reverse", bad, f"^{good}").split()
    if not shas or shas[-1] != bad:
        raise BadInput(f"no first-parent line from {good[:12]} to {bad[:12]}")
    return [good, *shas]


class Worktrees:
    """One detached git worktree per commit under `<cache>/bisect-build/<sha>/src`, kept for reuse.

    `root`: a cache root of its own (`--builds`); default difftest's cache (docs/caches.md)."""

    def __init__(self, repo: str | Path, root: str | Path | None = None):
        self.repo = Path(repo).resolve()
        self.cache = Cache(Path(root).resolve() if root is not None else None)

    def dir(self, sha: str) -> Path:
        return self.cache.path(KIND, sha)

    def checkout(self, sha: str) -> Path:
        src = self.dir(sha) / "src"
        if (src / ".git").exists() and git(src, "rev-parse", "HEAD", check=False) == sha:
            return src
        if src.exists():
            git(self.repo, "worktree", "remove", "--force", str(src), check=False)
            shutil.rmtree(src, ignore_errors=True)
        src.parent.mkdir(parents=True, exist_ok=True)
        # One git worktree operation at a time per repository: parallel probes (bisect --workers) are
        # separate processes, and one's `prune` must not see another's half-added worktree.
        lock = self.cache.root / KIND / f".{hashlib.sha256(str(self.repo).encode()).hexdigest()[:16]}.git.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            git(self.repo, "worktree", "prune")
            try:
                git(self.repo, "worktree", "add", "--detach", "--force", str(src), sha)
            except GitError as e:
                raise BuildFailed(f"cannot check out {sha[:12]}: {e}") from None
        return src


# -- environments -----------------------------------------------------------------------------------

_SITE_DIRS = ("import json, site, sys, sysconfig; p = sysconfig.get_paths(); "
              "d = [p['purelib'], p['platlib']] + list(site.getsitepackages()); "
              "print(json.dumps({'dirs': list(dict.fromkeys(d)), 'version': list(sys.version_info[:2])}))")


def _python_info(python: Path) -> dict:
    try:
        p = subprocess.run([str(python), "-c", _SITE_DIRS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BadInput(f"cannot run the base environment's interpreter {python}: {e}") from None
    if p.returncode != 0:
        raise BadInput(f"the base environment's interpreter {python} fails: {p.stderr.strip()[-500:]}")
    return json.loads(p.stdout)


def make_overlay(base_python: Path, env: Path, log) -> Path:
    """A venv at `env` that sees the base environment's packages after its own; its interpreter."""
    base = _python_info(base_python)
    if env.exists():
        shutil.rmtree(env)
    _step([str(base_python), "-m", "venv", "--without-pip", str(env)], log, "creating the overlay venv")
    python = env / "bin" / "python"
    own = _python_info(python)
    site_dir = Path(own["dirs"][0])
    site_dir.mkdir(parents=True, exist_ok=True)
    dirs = [d for d in base["dirs"] if d not in own["dirs"]]
    # One line: .pth files run lines that start with "import". addsitedir also reads the base's
    # own .pth files (its editable installs, distutils-precedence), which a bare path would not.
    (site_dir / BASE_PTH).write_text(f"import site; list(map(site.addsitedir, {dirs!r}))\n")
    return python


def _step(argv: list[str], log, what: str, cwd: Path | None = None, env: dict | None = None) -> None:
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    start = log.tell()
    try:
        p = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildFailed(f"{what}: {e} (log {log.name})") from None
    if p.returncode != 0:
        log.flush()
        with open(log.name, errors="replace") as f:
            f.seek(start)
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        said = next((ln for ln in reversed(lines) if "error" in ln.lower() and not ln.lower().startswith("note")),
                    lines[-1] if lines else "")
        raise BuildFailed(f"{what} failed (exit {p.returncode}): {said[:300]} (log {log.name})")


MODULE_FILE = "difftest-module-file="  # a marker: importing a package may print anything (vLLM does)
_WHERE = f"import importlib, sys; m = importlib.import_module(sys.argv[1]); print('\\n{MODULE_FILE}' + m.__file__)"


@dataclass
class Build:
    """One commit, checked out and installed."""

    commit: str
    src: Path
    python: Path  # the overlay's interpreter
    log: Path
    module_file: str = ""
    cached: bool = False
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"commit": self.commit, "src": str(self.src), "python": str(self.python), "log": str(self.log),
                "module_file": self.module_file, "cached": self.cached, "seconds": round(self.seconds, 2)}


def prepare(recipe: Recipe, worktrees: Worktrees, sha: str, hold: ExitStack | None = None) -> Build:
    """The commit's worktree and installed environment, made once and reused (BuildFailed: skip).

    With `hold`, the build stays in use (the cache does not remove it) until that stack closes."""
    t0 = time.perf_counter()
    want = {"format": STAMP_FORMAT, "commit": sha, "recipe": recipe.identity()}

    def intact(home: Path) -> bool:
        try:
            stamp = json.loads((home / "env" / STAMP).read_text())
        except (OSError, ValueError):
            return False
        return ({k: stamp.get(k) for k in want} == want and (home / "env" / "bin" / "python").exists()
                and git(home / "src", "rev-parse", "HEAD", check=False) == sha)

    with ExitStack() as own:
        lease = (hold or own).enter_context(
            worktrees.cache.use(KIND, sha, valid=intact, build=lambda home: _build(recipe, worktrees, sha, home, want)))
        home = lease.path
        stamp = json.loads((home / "env" / STAMP).read_text())
    return Build(sha, home / "src", home / "env" / "bin" / "python", home / "build.log", stamp.get("module_file", ""),
                 not lease.built, time.perf_counter() - t0)


def _build(recipe: Recipe, worktrees: Worktrees, sha: str, home: Path, want: dict) -> None:
    env = home / "env"
    log_path = home / "build.log"
    src = worktrees.checkout(sha)
    home.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write(f"# difftest bisect: build of {sha} with recipe {recipe.name}\n")
        python = make_overlay(recipe.base_python, env, log)
        pip_env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
        pip_env.pop("PYTHONPATH", None)
        _step([str(python), "-m", "pip", "install", *recipe.pip_args, "-e", str(src)], log,
              f"pip install -e {src.name} ({sha[:12]})", cwd=home, env=pip_env)
        log.flush()
        try:
            where = subprocess.run([str(python), "-c", _WHERE, recipe.module], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=home, env=pip_env, timeout=900)
        except subprocess.TimeoutExpired:
            raise BuildFailed(f"`import {recipe.module}` did not finish in 900 s (log {log_path})") from None
        log.write(where.stdout + where.stderr)
    if where.returncode != 0:
        raise BuildFailed(f"installed, but `import {recipe.module}` fails: "
                          f"{(where.stderr.strip().splitlines() or ['?'])[-1]} (log {log_path})")
    module_file = next((ln[len(MODULE_FILE):] for ln in where.stdout.splitlines() if ln.startswith(MODULE_FILE)), "")
    if not Path(module_file).resolve().is_relative_to(src.resolve()):
        raise BuildFailed(f"`import {recipe.module}` finds {module_file}, not the worktree {src}: another copy "
                          f"shadows it (log {log_path})")
    atomic_write(env / STAMP, (json.dumps({**want, "module_file": module_file}, indent=1) + "\n").encode())


# -- recipes and launchers -----------------------------------------------------------------------------

@dataclass
class LaunchContext:
    """What a launcher needs from the probe: where to write, which checkpoints, the suite and options."""

    out: Path
    models: list[str]
    suite: Suite
    opts: RunOptions


class Launcher:
    """Starts the candidate of one build; `candidate(repeat)` is called before each run of the probe."""

    def __init__(self, build: Build, ctx: LaunchContext):
        self.build, self.ctx = build, ctx
        self.stack = ExitStack()
        self.info: dict = {}  # the last candidate's facts, for the probe's record

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stack.close()

    def candidate(self, repeat: int) -> tuple[CandidateSpec, Engine]:
        """The build's candidate for one run: what it is, and the engine, started (start_candidate)."""
        raise NotImplementedError

    def setup(self) -> Setup:
        c = self.ctx
        return Setup(c.out, c.models, reference_python(c.opts.reference.python), c.suite, c.opts)


class Recipe:
    name = "recipe"
    module = ""

    def __init__(self, base_python: str | Path, module: str | None = None, pip_args=DEFAULT_PIP_ARGS):
        self.base_python = Path(base_python)
        if not self.base_python.exists():
            raise BadInput(f"base environment interpreter not found: {self.base_python}")
        self.module = module or self.module
        self.pip_args = tuple(pip_args)

    def identity(self) -> dict:
        """What makes a cached build reusable (and a persisted decision comparable)."""
        return {"name": self.name, "base_python": str(self.base_python.absolute()), "module": self.module,
                "pip_args": list(self.pip_args)}

    def launcher(self, build: Build, ctx: LaunchContext) -> Launcher:
        raise NotImplementedError

    @classmethod
    def from_args(cls, args, pip_args) -> Recipe:
        """The recipe `difftest bisect|probe --recipe NAME` asks for, from its arguments."""
        raise NotImplementedError


class CpuEngineRecipe(Recipe):
    """The CPU test engine (not vLLM-Omni), planting the defect the commit's package declares."""

    name = CPU_ENGINE
    module = "fakeomni"

    def __init__(self, base_python, declared_by: str = "fakeomni:planted_defect", engine_args=(), **kw):
        mod, sep, func = declared_by.partition(":")
        if not sep or not mod or not func:
            raise BadInput(f"--declared-by {declared_by!r}: expected MODULE:FUNCTION")
        kw.setdefault("module", mod.split(".")[0])
        super().__init__(base_python, **kw)
        self.declared_by, self.engine_args = declared_by, list(engine_args)

    def identity(self) -> dict:
        return {**super().identity(), "declared_by": self.declared_by, "engine_args": self.engine_args}

    def launcher(self, build, ctx):
        return CpuEngineLauncher(build, ctx, self)

    @classmethod
    def from_args(cls, args, pip_args) -> Recipe:
        base = args.base_python or str(reference_python(args.reference_python))
        kw = {"module": args.module} if args.module else {}
        return cls(base, declared_by=args.declared_by, engine_args=args.cpu_engine_arg, pip_args=pip_args, **kw)


_DECLARED = ("import importlib, json, sys; m, f = sys.argv[1].split(':'); "
             "print(json.dumps(getattr(importlib.import_module(m), f)()))")


class CpuEngineLauncher(Launcher):
    def __init__(self, build, ctx, recipe: CpuEngineRecipe):
        super().__init__(build, ctx)
        self.recipe = recipe
        self.started: dict[str | None, tuple[CandidateSpec, Engine]] = {}

    def declared_defect(self) -> str | None:
        p = subprocess.run([str(self.build.python), "-c", _DECLARED, self.recipe.declared_by], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=self.ctx.out, timeout=120)
        if p.returncode != 0:
            raise BuildFailed(f"{self.recipe.declared_by}() fails in {self.build.commit[:12]}'s environment: "
                              f"{(p.stderr.strip().splitlines() or ['?'])[-1]}")
        defect = json.loads(p.stdout.strip().splitlines()[-1])
        if defect is not None and not isinstance(defect, str):
            raise BuildFailed(f"{self.recipe.declared_by}() answered {defect!r}: expected a defect name or None")
        return defect or None

    def candidate(self, repeat: int) -> tuple[CandidateSpec, Engine]:
        defect = self.declared_defect()
        if defect not in self.started:
            spec = CandidateSpec(CPU_ENGINE, defect=defect, python=str(self.build.python),
                                 engine_args=tuple(self.recipe.engine_args),
                                 declared={"commit": self.build.commit, "recipe": self.recipe.identity()})
            self.started[defect] = spec, start_candidate(spec, self.setup(), self.stack)
        spec, engine = self.started[defect]
        self.info = {"engine": engine.info["engine"], "defect": defect, "url": engine.client.base_url,
                     "start_seconds": engine.info.get("start_seconds")}
        return spec, engine


class VllmOmniRecipe(Recipe):
    """A vLLM-Omni source checkout, editable over a vLLM-Omni base environment, served by `vllm serve --omni`."""

    name = VLLM_OMNI
    module = "vllm_omni"

    def __init__(self, base_python, device: str = "cuda", options: dict | None = None, **kw):
        super().__init__(base_python, **kw)
        self.device, self.options = device, dict(options or {})

    def identity(self) -> dict:
        return {**super().identity(), "device": self.device, "options": self.options}

    def launcher(self, build, ctx):
        return VllmOmniLauncher(build, ctx, self)

    @classmethod
    def from_args(cls, args, pip_args) -> Recipe:
        if args.base_python:
            base = args.base_python
        else:
            from ..engines.vllm_omni import omni_python

            base = str(omni_python())
        top, stages = parse_engine_args(args.engine_arg)
        options = {**({"stage_overrides": stages, "deploy_overrides": top} if top or stages else {}),
                   **dict(args.omni_option)}
        return cls(base, device=args.omni_device, options=options, pip_args=pip_args,
                   **({"module": args.module} if args.module else {}))


class VllmOmniLauncher(Launcher):
    """One server for the whole probe (starting vLLM-Omni costs minutes): every run reuses it."""

    def __init__(self, build, ctx, recipe: VllmOmniRecipe):
        super().__init__(build, ctx)
        self.recipe = recipe
        self.started: tuple[CandidateSpec, Engine] | None = None

    def candidate(self, repeat: int) -> tuple[CandidateSpec, Engine]:
        if self.started is None:
            spec = CandidateSpec(VLLM_OMNI, python=str(self.build.python),
                                 options={"device": self.recipe.device, **self.recipe.options},
                                 declared={"commit": self.build.commit, "recipe": self.recipe.identity()})
            engine = start_candidate(spec, self.setup(), self.stack)
            servers = engine.info.get("servers") or []
            if len(servers) != 1:
                raise BadInput("bisect serves one vLLM-Omni server per commit: use a suite whose segments need one "
                               f"checkpoint type (this one needs {len(servers)})")
            for w in engine.info.get("warnings") or []:
                print(f"difftest bisect: warning: {w}", file=sys.stderr)
            self.info = {k: engine.info.get(k) for k in ("label", "engine", "versions", "device", "start_seconds")}
            self.started = spec, engine
        return self.started


RECIPES = {r.name: r for r in (VllmOmniRecipe, CpuEngineRecipe)}  # by the candidate kind each builds

