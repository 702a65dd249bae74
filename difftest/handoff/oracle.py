"""The oracle: one invariant, over every field a request hands to the vocoder stage.

For each request of a batch and each field it hands on (the per-step payload the runner builds
for it, every chunk the async processor emits, the full payload the no-async path sends):

  the field is derived from that request alone, and equals what the same request gives in a
  batch of one.

Two ways to break it, both read off the data, nothing release-specific:

- a code value marks another request (generate.tag_of): that request is the donor;
- the value differs from the request's own batch-of-one value: the donor is the co-batched
  request whose batch-of-one value it equals, if exactly one does; else no donor is named
  (the field depends on the batch, not on one other request).

Fields are compared by exact JSON equality (tensors as dtype, shape and values).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from .generate import Case, tag_of

_STEP = re.compile(r"^(step|chunk)(\d+)\.")


def family(path: str) -> str:
    """A field's name without its step or chunk index: step3.payload.codes.ref -> payload.codes.ref."""
    m = _STEP.match(path)
    if not m:
        return path
    return ("" if m.group(1) == "step" else "chunk.") + path[m.end():]


def _ints(value) -> list[int]:
    if isinstance(value, dict) and "values" in value:
        return [v for v in value["values"] if isinstance(v, int) and not isinstance(v, bool)]
    if isinstance(value, list):
        out = []
        for v in value:
            out.extend(_ints(v))
        return out
    if isinstance(value, dict):
        out = []
        for v in value.values():
            out.extend(_ints(v))
        return out
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return []


def _short(value, limit: int = 120) -> str:
    if isinstance(value, dict) and "values" in value:
        vals = value["values"]
        body = ", ".join(str(v) for v in vals[:8]) + (", ..." if len(vals) > 8 else "")
        return f"{value['tensor']}{value['shape']} [{body}]"
    s = repr(value)
    return s if len(s) <= limit else s[:limit] + "..."


@dataclass
class Violation:
    request: str
    path: str
    problem: str  # foreign_codes | differs | missing | unexpected
    donor: str | None
    expected: object = None  # batch-of-one value (None when absent)
    got: object = None
    foreign: dict = field(default_factory=dict)  # donor id -> number of its marker values in the field

    @property
    def family(self) -> str:
        return family(self.path)

    def describe(self) -> str:
        if self.problem == "foreign_codes":
            who = ", ".join(f"{d} ({n} values)" for d, n in self.foreign.items())
            return f"{self.request} {self.path} carries codes of {who}: got {_short(self.got)}, alone {_short(self.expected)}"
        if self.problem == "missing":
            return f"{self.request} {self.path} missing in the batch (alone: {_short(self.expected)})"
        if self.problem == "unexpected":
            return f"{self.request} {self.path} present only in the batch: {_short(self.got)}"
        donor = f", equal to {self.donor}'s own value" if self.donor else ""
        return f"{self.request} {self.path} = {_short(self.got)} in the batch, {_short(self.expected)} alone{donor}"

    def to_json(self) -> dict:
        return {"request": self.request, "field": self.path, "family": self.family, "problem": self.problem,
                "donor": self.donor, "foreign": self.foreign, "expected": self.expected, "got": self.got}


def check(case: Case, batch: dict[str, dict], solo: dict[str, dict]) -> list[Violation]:
    """Violations of the invariant in one case.

    batch: request id -> {path: value} from the case; solo: request id -> {path: value} from
    that request alone (same mode, same steps)."""
    tags = {r.tag: r.id for r in case.requests}
    out: list[Violation] = []
    for r in case.requests:
        got_all, own = batch.get(r.id, {}), solo.get(r.id, {})
        for path in sorted(set(got_all) | set(own)):
            if path in got_all and path in own and got_all[path] == own[path]:
                continue
            got, exp = got_all.get(path), own.get(path)
            foreign = Counter(tags[t] for v in _ints(got) if (t := tag_of(v)) is not None and t in tags and t != r.tag)
            if foreign:
                donor = foreign.most_common(1)[0][0]
                out.append(Violation(r.id, path, "foreign_codes", donor, exp, got, dict(foreign)))
                continue
            if path not in got_all:
                out.append(Violation(r.id, path, "missing", None, exp, None))
                continue
            if path not in own:
                out.append(Violation(r.id, path, "unexpected", _donor_by_value(case, r.id, path, got, solo), None, got))
                continue
            out.append(Violation(r.id, path, "differs", _donor_by_value(case, r.id, path, got, solo), exp, got))
    return out


def _donor_by_value(case: Case, rid: str, path: str, got, solo: dict[str, dict]) -> str | None:
    """The one co-batched request whose own batch-of-one value of this field equals `got`."""
    hits = [o.id for o in case.requests if o.id != rid and solo.get(o.id, {}).get(path) == got]
    return hits[0] if len(hits) == 1 else None
