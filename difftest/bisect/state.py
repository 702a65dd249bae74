"""OUT/bisect.json: every decision, written atomically after each probe, so a bisect that is
interrupted and started again with the same --out probes no decided commit twice.

    {"format": "difftest.bisect/1", "identity": {...}, "created": ..., "commits": [...],
     "decisions": {sha: ProbeRecord.to_json() + {"role", "mlflow": {uri: [run ids]}}},
     "order": [sha, ...], "mlflow": {"uri", "experiment_id", "parent_run_id"}, "result": {...} | null}

`identity` is what the decisions depend on (repository, ends, recipe, suite hash, policy,
concurrency, repeats ...). A file made by another bisect is refused (BadInput), never mixed in.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from ..errors import BadInput
from ..results import atomic_write
from .probe import ProbeRecord
from .search import Vote

FORMAT = "difftest.bisect/1"
FILE = "bisect.json"


def _normal(obj):
    return json.loads(json.dumps(obj, sort_keys=True))


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(a) | set(b))
    out = []
    for k in keys:
        if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            out += _diff(a[k], b[k], f"{prefix}{k}.")
        elif a.get(k) != b.get(k):
            out.append(f"{prefix}{k}")
    return out


class BisectState:
    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data

    @classmethod
    def open(cls, out: str | Path, identity: dict, file: str = FILE) -> BisectState:
        out = Path(out)
        path = out / file
        identity = _normal(identity)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            data = None
        except (ValueError, UnicodeDecodeError) as e:
            raise BadInput(f"{path}: not valid JSON ({e}); move it away to start afresh") from None
        if data is None:
            now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
            data = {"format": FORMAT, "identity": identity, "created": now, "decisions": {}, "order": [],
                    "mlflow": {}, "result": None}
        elif not isinstance(data, dict) or data.get("format") != FORMAT:
            raise BadInput(f"{path}: not a difftest bisect state ({FORMAT})")
        elif data.get("identity") != identity:
            differs = ", ".join(_diff(data.get("identity") or {}, identity)) or "?"
            raise BadInput(f"{path} belongs to another bisect (differs in: {differs}); use another --out, "
                           f"or remove it to start afresh")
        out.mkdir(parents=True, exist_ok=True)
        return cls(path, data)

    @property
    def decisions(self) -> dict[str, dict]:
        return self.data["decisions"]

    def known(self) -> dict[str, Vote]:
        return {sha: ProbeRecord.from_json(d).vote for sha, d in self.decisions.items()}

    def record(self, rec: ProbeRecord, role: str, round: int | None = None) -> dict:
        entry = {**rec.to_json(), "role": role, "mlflow": self.decisions.get(rec.commit, {}).get("mlflow", {})}
        if round is not None:
            entry["round"] = round
        self.decisions[rec.commit] = entry
        if rec.commit not in self.data["order"]:
            self.data["order"].append(rec.commit)
        self.save()
        return entry

    def save(self) -> None:
        atomic_write(self.path, (json.dumps(self.data, indent=1, sort_keys=True) + "\n").encode())
