"""What the pages show, computed from report.json-shaped dicts and run tags: per-chunk cells of
the heatmap, a run's rates and onset quality, and each run's change against the run before it.
Pure: no MLflow, no files (gather.py fetches, pages.py renders)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from difftest.policy import TIERS

CLEAN = ("identical", "numeric_drift")
DEFAULT_FAIL_ON = ("concurrency_defect", "vocoder_defect", "contamination", "length_mismatch", "error")
# report.json `comparisons` with per-chunk audio tiers and metrics; with per-chunk code agreement
AUDIO_COMPARISONS = ("audio", "concurrency", "vocoder")
CODE_COMPARISONS = ("codes", "concurrency_codes")
COMPARISON_TITLES = {
    "audio": "candidate@N vs reference (audio)",
    "concurrency": "candidate@N vs candidate@1 (audio)",
    "vocoder": "candidate vs reference vocoder on its own codes",
    "codes": "candidate@N vs reference (codes)",
    "concurrency_codes": "candidate@N vs candidate@1 (codes)",
}
DIVERGED = TIERS.index("diverged")


def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


@dataclass
class Cell:
    """One chunk of one segment: each comparison's tier index (0 identical .. 3 diverged) and
    metrics where that comparison was made."""

    chunk: int
    tiers: dict = field(default_factory=dict)  # comparison -> tier index
    logmel: dict = field(default_factory=dict)  # audio comparison -> mean log-mel distance
    snr_db: dict = field(default_factory=dict)
    max_abs: dict = field(default_factory=dict)
    agreement: dict = field(default_factory=dict)  # code comparison -> fraction of frames equal

    @property
    def worst(self) -> int | None:
        return max(self.tiers.values()) if self.tiers else None

    @property
    def worst_logmel(self) -> float | None:
        vals = [v for v in self.logmel.values() if v is not None]
        return max(vals) if vals else None

    @property
    def codes_agreement(self) -> float | None:
        vals = [v for v in self.agreement.values() if v is not None]
        return min(vals) if vals else None


def segment_cells(seg: dict) -> list[Cell]:
    """The chunks of a segment as far as any comparison reaches. A code comparison's chunk is
    `identical` when every frame agrees, else `diverged`."""
    comps = seg.get("comparisons") or {}
    n = 0
    for name in AUDIO_COMPARISONS:
        body = comps.get(name)
        if isinstance(body, dict):
            n = max(n, len(body.get("tiers") or []),
                    *(len(v) for v in (body.get("chunks") or {}).values() if isinstance(v, list)))
    for name in CODE_COMPARISONS:
        body = comps.get(name)
        if isinstance(body, dict) and isinstance(body.get("chunk_agreement"), list):
            n = max(n, len(body["chunk_agreement"]))
    cells = [Cell(i) for i in range(n)]
    for name in AUDIO_COMPARISONS:
        body = comps.get(name)
        if not isinstance(body, dict):
            continue
        for i, t in enumerate(body.get("tiers") or []):
            if t in TIERS:
                cells[i].tiers[name] = TIERS.index(t)
        chunks = body.get("chunks") or {}
        for metric, target in (("logmel", "logmel"), ("snr_db", "snr_db"), ("max_abs", "max_abs")):
            for i, v in enumerate(chunks.get(metric) or []):
                if (x := _num(v)) is not None:
                    getattr(cells[i], target)[name] = x
    for name in CODE_COMPARISONS:
        body = comps.get(name)
        if not isinstance(body, dict):
            continue
        for i, v in enumerate(body.get("chunk_agreement") or []):
            if (x := _num(v)) is not None:
                cells[i].agreement[name] = x
                cells[i].tiers[name] = 0 if x >= 1.0 else DIVERGED
    return cells


def chunk0_logmel(seg: dict) -> float | None:
    """The worst log-mel distance any audio comparison measured on the segment's first chunk: how
    badly the onset (the first 80 ms on the default schedule) is off."""
    cells = segment_cells(seg)
    return cells[0].worst_logmel if cells else None


def fail_on(report: dict) -> tuple[str, ...]:
    return tuple((report.get("policy") or {}).get("fail_on") or DEFAULT_FAIL_ON)


def failing_ids(report: dict) -> list[str]:
    if isinstance(report.get("failing"), list):
        return list(report["failing"])
    bad = set(fail_on(report))
    return [s["id"] for s in report.get("segments") or [] if s.get("verdict") in bad]


@dataclass
class RunStats:
    segments: int
    counts: dict
    diverged: int  # not identical or numeric drift
    failing: int
    chunk0_logmel: float | None  # worst over segments
    chunk0_worst_segment: str | None
    onsets: Counter  # first divergent chunk -> segments (non-clean ones)

    @property
    def diverged_rate(self) -> float | None:
        return self.diverged / self.segments if self.segments else None

    @property
    def failing_rate(self) -> float | None:
        return self.failing / self.segments if self.segments else None


def run_stats(report: dict) -> RunStats:
    segs = report.get("segments") or []
    counts = Counter(s.get("verdict") for s in segs)
    worst, worst_id = None, None
    onsets: Counter = Counter()
    for s in segs:
        v = chunk0_logmel(s)
        if v is not None and (worst is None or v > worst):
            worst, worst_id = v, s["id"]
        if s.get("verdict") not in CLEAN and s.get("first_divergent_chunk") is not None:
            onsets[int(s["first_divergent_chunk"])] += 1
    return RunStats(len(segs), dict(counts), sum(n for v, n in counts.items() if v not in CLEAN),
                    len(failing_ids(report)), worst, worst_id, onsets)


def logmel_bucket(x: float | None, close: float = 0.1) -> int | None:
    """0 exactly equal, then 1..6 by multiples of the policy's close_logmel: <= c/10, c/3, c, 3c, 10c, more."""
    if x is None:
        return None
    if x <= 0:
        return 0
    for i, bound in enumerate((close / 10, close / 3, close, 3 * close, 10 * close), start=1):
        if x <= bound:
            return i
    return 6


def logmel_bounds(close: float = 0.1) -> list[float]:
    return [close / 10, close / 3, close, 3 * close, 10 * close]


def close_logmel(report: dict) -> float:
    v = _num(((report.get("policy") or {}).get("tiers") or {}).get("close_logmel"))
    return v if v and v > 0 else 0.1


@dataclass
class Change:
    """A run against the run before it in the same experiment on the same device."""

    previous: str | None  # its run id
    kind: str | None  # "regressed" (pass -> fail/error), "fixed" (fail/error -> pass), None
    new_failures: list[str]  # failing now, not failing then
    gone_failures: list[str]


def changes(runs: list) -> dict[str, Change]:
    """run id -> Change, for objects with .run_id, .experiment_id, .device, .start_ms, .verdict, .failing."""
    out: dict[str, Change] = {}
    groups: dict[tuple, list] = {}
    for r in runs:
        groups.setdefault((r.experiment_id, r.device), []).append(r)
    for group in groups.values():
        group.sort(key=lambda r: (r.start_ms, r.run_id))
        prev = None
        for r in group:
            if prev is None:
                out[r.run_id] = Change(None, None, sorted(r.failing), [])
            else:
                kind = None
                if prev.verdict == "pass" and r.verdict in ("fail", "error"):
                    kind = "regressed"
                elif prev.verdict in ("fail", "error") and r.verdict == "pass":
                    kind = "fixed"
                now, then = set(r.failing), set(prev.failing)
                out[r.run_id] = Change(prev.run_id, kind, sorted(now - then), sorted(then - now))
            prev = r
    return out
