"""What the pages show, computed from report.json-shaped dicts and run tags: per-chunk cells of
the heatmap, a run's rates and onset quality, and each run's change against the run before it.
Pure: no MLflow, no files (gather.py fetches, pages.py renders)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from difftest.compare.chunks import TIERS
from difftest.verdicts.catalogue import CLEAN, FAILS

DEFAULT_FAIL_ON = FAILS  # a report without its policy's fail_on (difftest's default policy)
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


# -- candidate lines --------------------------------------------------------------------------------------
# The CPU test engine as difftest records it: runners/cpu_engine's ENGINE_NAME (the label's stem, and
# the engine of its /v1/engine identity) and LABEL (difftest/run.py's `candidate.engine`).
CPU_ENGINE_NAME = "difftest-cpu-engine"
CPU_ENGINE_LABEL = "difftest CPU test engine (not vLLM-Omni)"


@dataclass(frozen=True)
class Line:
    """What a run tested, as a series that its versions or commits continue. Runs are compared
    (regressed, fixed) only within one line; a control line is never shown as a vLLM-Omni version."""

    key: str  # "vllm-omni", "vllm-omni-offline", "vllm-omni-offline:async", "url:<URL>", "cpu-engine",
    #           "cpu-engine:<defect>", "other:<label>"
    title: str
    control: bool = False  # the CPU test engine, clean or with a planted defect
    expect: str = "pass"  # the verdict a healthy tester gives: "fail" for a planted defect
    defect: str | None = None

    @property
    def rank(self) -> tuple:
        order = ("vllm-omni", "vllm-omni-offline", "vllm-omni-offline:async", "url", "other", "vllm-omni-bug",
                 "cpu-engine")
        stem = self.key if self.key in order else self.key.split(":", 1)[0]
        return order.index(stem), self.key


def _tag(tags: dict, field_name: str) -> str:
    """A candidate fact as `difftest run` logs it (candidate.X) or `difftest compare` (candidate.provenance.X)."""
    return str(tags.get(f"candidate.{field_name}") or tags.get(f"candidate.provenance.{field_name}") or "")


def candidate_line(tags: dict) -> Line:
    """The run's candidate line, from its parent run's tags (difftest/mlflow_records.py). The CPU test
    engine is recognised first (its engine, label, defect or not_vllm_omni mark), whatever else it carries."""
    label = tags.get("candidate.label") or ""
    engine = _tag(tags, "engine")
    defect = _tag(tags, "defect")
    if (CPU_ENGINE_LABEL in (engine, _tag(tags, "label")) or engine == CPU_ENGINE_NAME or defect
            or label.split(":", 1)[0] == CPU_ENGINE_NAME or _tag(tags, "not_vllm_omni").lower() == "true"):
        defect = defect or (label.split(":", 1)[1] if label.startswith(CPU_ENGINE_NAME + ":") else "")
        if defect:
            return Line(f"cpu-engine:{defect}", f"CPU test engine, planted defect {defect}", True, "fail", defect)
        return Line("cpu-engine", "CPU test engine, clean", True)
    mutant = tags.get("candidate.mutant")
    if mutant:  # difftest bugs: a release with an upstream fix reverted, a planted bug like the CPU engine's
        return Line(f"vllm-omni-bug:{mutant}", f"vLLM-Omni with bug {mutant} re-created (bug corpus)", True, "fail",
                    mutant)
    is_omni = (engine.lower().startswith("vllm-omni") or label.lower().startswith("vllm-omni")
               or any(tags.get(k) for k in ("vllm_omni.version", "candidate.versions.vllm_omni",
                                            "candidate.provenance.versions.vllm-omni",
                                            "candidate.provenance.versions.vllm_omni")))
    if is_omni:
        api = _tag(tags, "api")
        if "AsyncOmni" in api or (not api and "offline" in label and "async" in label):
            return Line("vllm-omni-offline:async", "vLLM-Omni offline API (AsyncOmni)")
        if api or "offline" in label:
            return Line("vllm-omni-offline", "vLLM-Omni offline API (Omni)")
        return Line("vllm-omni", "vLLM-Omni server")
    if label.startswith(("http://", "https://")):
        return Line(f"url:{label}", f"the server at {label}")
    return Line(f"other:{label or '?'}", label or "unnamed candidate")


def series(r) -> tuple:
    """Which runs a run is compared with: the same candidate line, suite (its content: the suite hash)
    and device. An object without a .line is grouped by experiment and device alone."""
    line = getattr(r, "line", None)
    if line is None:
        return (r.experiment_id, r.device)
    return (line.key, r.experiment_id, getattr(r, "suite_hash", ""), r.device)


@dataclass
class Change:
    """A run against the run before it in its series (same line, suite and device: series())."""

    previous: str | None  # its run id
    kind: str | None  # "regressed" (from the line's expected verdict to another), "fixed" (back), None
    new_failures: list[str]  # failing now, not failing then
    gone_failures: list[str]


def _judged(verdict: str, expect: str) -> bool | None:
    """Whether a verdict is the one the line expects (None: no verdict to judge)."""
    return verdict == expect if verdict in ("pass", "fail", "error") else None


def changes(runs: list) -> dict[str, Change]:
    """run id -> Change, for objects with .run_id, .experiment_id, .device, .start_ms, .verdict, .failing
    (and .line, .suite_hash: series()). A line expects "pass", so pass -> fail is a regression; a planted
    defect's line expects "fail", so there fail -> pass (the defect no longer caught) is one."""
    out: dict[str, Change] = {}
    groups: dict[tuple, list] = {}
    for r in runs:
        groups.setdefault(series(r), []).append(r)
    for group in groups.values():
        group.sort(key=lambda r: (r.start_ms, r.run_id))
        prev = None
        for r in group:
            if prev is None:
                out[r.run_id] = Change(None, None, sorted(r.failing), [])
            else:
                expect = getattr(getattr(r, "line", None), "expect", "pass")
                was, now_ok = _judged(prev.verdict, expect), _judged(r.verdict, expect)
                kind = "regressed" if was and now_ok is False else "fixed" if was is False and now_ok else None
                now, then = set(r.failing), set(prev.failing)
                out[r.run_id] = Change(prev.run_id, kind, sorted(now - then), sorted(then - now))
            prev = r
    return out
