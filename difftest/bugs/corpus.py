"""The bug corpus (`cases/bugs/<id>/bug.yaml`): real vLLM-Omni bugs, each re-created in a release.

An entry names the upstream issue and fix, the release its patch applies to, the
patch that reverts the fix (or `release_carries_bug: true`: the release still has
the bug, no patch), the sha256 of every file the patch touches as the release ships
it, how to expose it (candidate, suite, concurrency, vLLM-Omni settings) and what
difftest must find (verdict, stage, whether a donor is named). `cases/bugs/README.md`
documents the fields; `load_corpus` checks them and names the entry and field at fault.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .. import yamlfile
from ..checkout import REPO
from ..errors import BadInput
from ..verdicts.classify import STAGES

DEFAULT_CORPUS = REPO / "cases" / "bugs"
SUITES = REPO / "cases" / "suites"
CANDIDATES = ("vllm-omni", "vllm-omni-offline", "vllm-omni-offline:async")
PATTERNS = ("barrier", "pool", "staggered")  # difftest run --pattern
ORDERS = ("suite", "permuted", "mixed", "long-first")  # difftest run --order
_ID = re.compile(r"^[a-z0-9][a-z0-9.-]{0,63}$")


@dataclass(frozen=True)
class Entry:
    id: str
    title: str
    folder: Path
    upstream: dict
    release: str
    patch: Path | None  # None: the release carries the bug
    source_sha256: dict  # path under site-packages -> sha256 as the release ships it
    cpu: bool
    cpu_why: str | None
    candidate: str
    suite: Path
    concurrency: int
    config: dict  # VllmOmniOptions fields
    pattern: str  # arrivals, as `difftest run --pattern`
    order: str  # as `difftest run --order`
    expect: dict  # verdict, stage, donor
    known_miss: str | None = None  # why difftest misses it today (kept, never dropped)
    release_carries_bug: bool = False
    extra: dict = field(default_factory=dict)  # mechanism, symptom: for people

    @property
    def upstream_label(self) -> str:
        u = self.upstream
        return " / ".join(f"{k} #{u[k]}" for k in ("issue", "pr") if u.get(k)) or "-"


def _need(raw: dict, key: str, types, where: str):
    if key not in raw:
        raise BadInput(f"{where}: field {yamlfile.quote(key)} missing")
    value, types = raw[key], types if isinstance(types, tuple) else (types,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise BadInput(f"{where}: field {yamlfile.quote(key)} is {type(value).__name__}, expected "
                       f"{' or '.join(t.__name__ for t in types)}")
    return value


def _suite(name: str, where: str) -> Path:
    path = (SUITES / f"{name}.yaml") if "/" not in name and not name.endswith(".yaml") else (REPO / name)
    if not path.is_file():
        raise BadInput(f"{where}: run.suite {yamlfile.quote(name)}: no suite at {path}")
    return path


def load_entry(folder: Path) -> Entry:
    """One entry, checked; BadInput naming the file and field."""
    path = folder / "bug.yaml"
    where = str(path)
    try:
        raw = yamlfile.load_file(path)
    except OSError as e:
        raise BadInput(f"{where}: cannot read ({e.strerror})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise BadInput(f"{where}: not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{where}: expected a mapping of fields")
    eid = _need(raw, "id", str, where)
    if eid != folder.name or not _ID.match(eid):
        raise BadInput(f"{where}: id {yamlfile.quote(eid)} must equal its folder's name ({yamlfile.quote(folder.name)}) and be a short slug")
    carries = bool(raw.get("release_carries_bug", False))
    patch = None
    if not carries:
        patch = folder / _need(raw, "patch", str, where)
        if not patch.is_file():
            raise BadInput(f"{where}: patch {yamlfile.quote(patch.name)} not found beside it")
    sha = raw.get("source_sha256") or {}
    if not isinstance(sha, dict) or not all(isinstance(k, str) and isinstance(v, str) and len(v) == 64
                                            for k, v in sha.items()):
        raise BadInput(f"{where}: source_sha256 must map file paths to sha256 hex digests")
    if patch is not None and not sha:
        raise BadInput(f"{where}: source_sha256 missing: the files the patch touches, as the release ships them")
    run = _need(raw, "run", dict, where)
    candidate = _need(run, "candidate", str, f"{where}: run")
    if candidate not in CANDIDATES:
        raise BadInput(f"{where}: run.candidate {yamlfile.quote(candidate)}: expected one of {', '.join(CANDIDATES)}")
    concurrency = _need(run, "concurrency", int, f"{where}: run")
    if not 1 <= concurrency <= 64:
        raise BadInput(f"{where}: run.concurrency {concurrency} outside 1..64")
    config = run.get("config") or {}
    if not isinstance(config, dict):
        raise BadInput(f"{where}: run.config must be a mapping of vLLM-Omni settings")
    _check_config(config, where)
    pattern, order = run.get("pattern", "barrier"), run.get("order", "suite")
    if pattern not in PATTERNS:
        raise BadInput(f"{where}: run.pattern {yamlfile.quote(pattern)}: expected one of {', '.join(PATTERNS)}")
    if order not in ORDERS:
        raise BadInput(f"{where}: run.order {yamlfile.quote(order)}: expected one of {', '.join(ORDERS)}")
    expect = _need(raw, "expect", dict, where)
    if expect.get("stage") not in STAGES:
        raise BadInput(f"{where}: expect.stage {expect.get('stage')!r}: expected one of {', '.join(STAGES)}")
    _need(expect, "verdict", str, f"{where}: expect")
    cpu = raw.get("cpu", True)
    if not isinstance(cpu, bool):
        raise BadInput(f"{where}: cpu must be true or false")
    if not cpu and not raw.get("cpu_why"):
        raise BadInput(f"{where}: cpu is false: say why in cpu_why")
    upstream = _need(raw, "upstream", dict, where)
    return Entry(eid, str(raw.get("title", "")), folder, upstream, str(_need(raw, "release", (str, float), where)),
                 patch, sha, cpu, raw.get("cpu_why"), candidate, _suite(str(_need(run, "suite", str, where)), where),
                 concurrency, config, pattern, order, expect, raw.get("known_miss"), carries,
                 {k: raw.get(k) for k in ("mechanism", "symptom") if raw.get(k)})


def _check_config(config: dict, where: str) -> None:
    from ..engines.vllm_omni import VllmOmniOptions

    known = {f.name for f in dataclasses.fields(VllmOmniOptions)} - {"python"}
    for key in config:
        if key not in known:
            raise BadInput(f"{where}: run.config key {yamlfile.quote(key)} is no vLLM-Omni setting difftest knows "
                           f"(known: {', '.join(sorted(known))})")


def load_corpus(root: Path = DEFAULT_CORPUS, only: list[str] | None = None) -> list[Entry]:
    """Every entry under `root` (sorted by id), or those named in `only` (BadInput for an unknown id)."""
    root = Path(root)
    if not root.is_dir():
        raise BadInput(f"bug corpus not found: {root}")
    folders = sorted(p for p in root.iterdir() if (p / "bug.yaml").is_file())
    if only:
        have = {p.name for p in folders}
        missing = [o for o in only if o not in have]
        if missing:
            raise BadInput(f"no bug {', '.join(missing)} in {root} (known: {', '.join(sorted(have)) or 'none'})")
        folders = [p for p in folders if p.name in only]
    return [load_entry(p) for p in folders]
