"""What produced a set of candidate results, and whether a run folder's results may be reused.

A run folder keeps each concurrency's candidate results in its own folder
(`results/candidate-c<N>`), with `identity.json` beside them: the engine (kind,
version or commit, plugins, deploy configuration and engine arguments, device,
dtypes, checkpoint hashes, planted defect) and the load (concurrency, arrival
pattern, order, voice mode). A later `difftest run` with the same --out reuses
those results only when its identity is the same; otherwise it refuses (exit 2)
and names what differs, or, with --replace, discards them first. Each result
also records the identity's key in `meta.identity`, so a result that strays into
another folder is never taken for one of its own.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from ..checkout import REPO
from ..errors import BadInput
from ..results import FORMAT as RESULT_FORMAT
from ..results import atomic_write
from ..suites.suite import content_hash

FORMAT = "difftest.identity/1"
FILE = "identity.json"


def code_hash(*folders: str | Path) -> str:
    """sha256 over the Python sources under these folders (paths relative to the repository):
    the engines difftest ships (the CPU test engine, the vLLM-Omni plugins) change with its code."""
    h = hashlib.sha256()
    for folder in folders:
        root = REPO / folder
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            h.update(str(path.relative_to(REPO)).encode() + b"\0")
            h.update(path.read_bytes())
    return h.hexdigest()


def file_hash(path: str | Path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def folder_identity(engine: dict, load: dict) -> dict:
    """The record kept beside a folder's results, in its JSON form (tuples as lists, paths as text),
    so a record read back compares equal to a fresh one."""
    record = {"format": FORMAT, "result_format": RESULT_FORMAT, "engine": engine, "load": load}
    return json.loads(json.dumps(record, sort_keys=True, default=str))


def key(identity: dict) -> str:
    return content_hash(identity)[:16]


def differences(old, new, prefix: str = "") -> list[str]:
    """Human-readable differences between two identities, one per leaf."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += differences(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    if old == new:
        return []
    return [f"{prefix or '(identity)'}: {_short(old)} -> {_short(new)}"]


def _short(v) -> str:
    text = json.dumps(v, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _has_results(folder: Path) -> bool:
    return folder.is_dir() and any(p.suffix in (".npz", ".json") for p in folder.iterdir() if p.name != FILE)


def check(folder: Path, identity: dict) -> None:
    """BadInput when `folder` holds results that another engine or configuration produced."""
    folder = Path(folder)
    path = folder / FILE
    if not path.exists():
        if _has_results(folder):
            raise BadInput(f"{folder} holds candidate results with no record of what produced them (an older "
                           f"difftest?); they cannot be reused: choose a fresh --out, or pass --replace to discard them")
        return
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: unreadable ({e}); choose a fresh --out, or pass --replace") from None
    if recorded == identity:
        return
    diff = differences(recorded, identity) if isinstance(recorded, dict) else ["(not an identity record)"]
    shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
    raise BadInput(f"{folder} holds results of another candidate or configuration ({shown}); "
                   f"they are not reused: choose a fresh --out, or pass --replace to discard them")


def claim(folder: Path, identity: dict) -> None:
    """Record `identity` as what produces the results in `folder` (after `check`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / FILE, (json.dumps(identity, indent=1, sort_keys=True) + "\n").encode())


def discard(folder: Path) -> None:
    """--replace: remove a folder of results that another configuration produced."""
    if Path(folder).exists():
        shutil.rmtree(folder)
