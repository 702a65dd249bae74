"""The one surface every engine shows the rest of difftest, the reference and every candidate alike
(as vLLM's HfRunner and VllmRunner do): `generate` a suite's segments at a concurrency and get back
an `Outcome`, so the comparison never asks which engine it got.

    outcome = engine.generate(segments, concurrency=4, out_dir=folder, identity_key=key, progress=p)
    outcome.results["s1"]          # a Result (difftest/results.py)
    outcome.errors["s2"]           # {"source", "kind", "message"}; kind: infrastructure, bad_input, candidate
    outcome.batches                # the waves of segment ids that shared the engine (the donor search's peers)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..progress import Progress
from ..suites.suite import Segment

ERROR_KINDS = ("infrastructure", "bad_input", "candidate")


@dataclass
class Outcome:
    """What an engine made of a suite: a result or an error for each segment."""

    results: dict = field(default_factory=dict)  # segment id -> Result
    errors: dict = field(default_factory=dict)  # segment id -> {"source", "kind", "message"}
    batches: list = field(default_factory=list)  # waves of segment ids served together
    cached: set = field(default_factory=set)  # segments found on disk, not computed now

    def fail(self, segment_id: str, kind: str, message: str, source: str = "candidate") -> None:
        assert kind in ERROR_KINDS, kind
        self.errors[segment_id] = {"source": source, "kind": kind, "message": message}


class Engine(Protocol):
    label: str  # what it is, in words a reader will not mistake
    info: dict  # its provenance, for report.json

    def generate(self, segments: list[Segment], *, concurrency: int, out_dir: Path | None = None,
                 identity_key: str | None = None, progress: Progress | None = None) -> Outcome:
        """Each segment's result (written under out_dir, or the engine's store) or error."""
        ...
