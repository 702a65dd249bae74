"""A corpus entry's mutant: the release's vLLM-Omni with the entry's patch, as an overlay environment.

The overlay (difftest.bisect.builds.make_overlay, as bisect builds commits) sees the
release environment's packages after its own, and holds its own copy of the
`vllm_omni` package: hard links to the release's files, so a copy takes about a
second, and `git apply` writes each patched file anew, which breaks only that
file's link (the release is never changed). Before patching, every file the entry
names is checked against the sha256 the release ships: a patch written for other
sources is refused instead of half-applied.

`<env>/difftest-vllm-omni-mutant.json` says what the environment is (entry, patch
sha256, release); the vLLM-Omni probe reads it into the provenance and the result
identity, so a mutant's results are never taken for the release's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..bisect.builds import _python_info, make_overlay
from ..cache import Cache
from ..errors import BadInput, InfraError
from ..results import atomic_write
from .corpus import Entry

RECORD = "difftest-vllm-omni-mutant.json"  # read by difftest.engines.vllm_omni's probe


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def release_site(base_python: Path) -> tuple[Path, str]:
    """The site-packages folder holding the release's `vllm_omni`, and the release's version."""
    from ..engines.vllm_omni import environment_info

    info = environment_info(Path(base_python))  # BadInput when it has no vllm-omni, InfraError when broken
    return Path(info["deploy_dir"]).parent.parent, info["vllm_omni"]


def check_source(entry: Entry, site: Path, version: str) -> None:
    """BadInput naming the file when the release's sources are not those the patch was written for."""
    if str(entry.release) != version:
        raise BadInput(f"bug {entry.id}: written for vLLM-Omni {entry.release}, the environment has {version}")
    for rel, want in sorted(entry.source_sha256.items()):
        path = site / rel
        if not path.is_file():
            raise BadInput(f"bug {entry.id}: {rel} is not in the release ({site})")
        got = _sha256(path)
        if got != want:
            raise BadInput(f"bug {entry.id}: the release's {rel} does not match the source the patch was written "
                           f"for (sha256 {got[:12]}, expected {want[:12]})")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def _apply(patch: Path, site: Path, entry: Entry, check: bool) -> None:
    argv = ["git", "apply", "-p1", "--whitespace=nowarn", *(["--check"] if check else []), str(patch.resolve())]
    # Inside a git work tree (difftest's cache under a checkout) `git apply` takes paths from the
    # repository's top and silently skips those outside the current folder: stop the repository
    # search at `site`, so it patches there as it would anywhere else.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(site).resolve().parent)}
    p = subprocess.run(argv, cwd=site, capture_output=True, text=True, check=False, env=env)
    if p.returncode != 0:
        raise BadInput(f"bug {entry.id}: {patch.name} does not apply to vLLM-Omni {entry.release}: "
                       f"{p.stderr.strip()[-800:]}")


def _check_patched(entry: Entry, site: Path) -> None:
    """Every file the entry names was changed: a patch that applied to nothing is no mutant."""
    same = [rel for rel, sha in sorted(entry.source_sha256.items()) if _sha256(site / rel) == sha]
    if same:
        raise InfraError(f"bug {entry.id}: after applying {entry.patch.name}, {', '.join(same)} is unchanged")


def _compile(python: Path, files: list[Path], log_path: Path, entry: Entry) -> None:
    """Bytecode for the patched files, written anew beside them (their linked .pyc is the release's,
    stale now: Python would compile the source on every import, as it should, but each time). A
    patched file that does not compile is the entry's patch at fault: bad input, named."""
    p = subprocess.run([str(python), "-m", "py_compile", *map(str, files)], capture_output=True, text=True,
                       check=False)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(p.stdout + p.stderr)
    if p.returncode != 0:
        raise BadInput(f"bug {entry.id}: {entry.patch.name} applies but the patched source does not compile: "
                       f"{p.stderr.strip()[-800:]}")


@contextmanager
def mutant_env(entry: Entry, base_python: Path, log_path: Path) -> Iterator[Path]:
    """The interpreter of the entry's mutant environment, held in difftest's cache while in use;
    built on first use (about two seconds) and reused while the entry's patch and the release
    environment are unchanged."""
    base_python = Path(base_python)
    site, version = release_site(base_python)
    check_source(entry, site, version)
    patch_sha = _sha256(entry.patch)
    key = hashlib.sha256(json.dumps([entry.id, entry.release, patch_sha, str(base_python.resolve()),
                                     str(site)]).encode()).hexdigest()[:12]

    def build(env: Path) -> None:
        shutil.rmtree(env, ignore_errors=True)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as log:
            python = make_overlay(base_python, env, log)
        own_site = Path(_python_info(python)["dirs"][0])
        # The release's bytecode comes along (linked): a .pyc is checked against its source's mtime
        # and size, which a link shares, so every unpatched module loads compiled, as in the release.
        # Without it each process of the mutant's server compiled vllm_omni again (CI runs with
        # PYTHONDONTWRITEBYTECODE=1, so nothing was ever saved).
        shutil.copytree(site / "vllm_omni", own_site / "vllm_omni", copy_function=_link_or_copy)
        _apply(entry.patch, own_site, entry, check=True)
        _apply(entry.patch, own_site, entry, check=False)
        _check_patched(entry, own_site)
        _compile(python, [own_site / rel for rel in sorted(entry.source_sha256)], log_path, entry)
        record = {"bug": entry.id, "upstream": entry.upstream, "release": entry.release,
                  "patch_sha256": patch_sha, "base_python": str(base_python), "site": str(own_site),
                  "patched_sha256": {rel: _sha256(own_site / rel) for rel in sorted(entry.source_sha256)}}
        atomic_write(env / RECORD, json.dumps(record, indent=1, sort_keys=True).encode())

    def valid(env: Path) -> bool:  # built whole, and its patched files still as the build left them
        try:
            record = json.loads((env / RECORD).read_text())
            return all(_sha256(Path(record["site"]) / rel) == sha != entry.source_sha256[rel]
                       for rel, sha in record["patched_sha256"].items())
        except (OSError, ValueError, KeyError, TypeError):
            return False

    with Cache().use("bug-mutant", f"{entry.id}-{key}", valid=valid, build=build) as lease:
        yield lease.path / "bin" / "python"
