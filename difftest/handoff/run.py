"""`difftest handoff`: probe one or more vLLM-Omni sources over the generated matrix, shrink each
finding to a minimal batch, write report.json and return the exit code (contracts 6 and 7, docs/architecture.md)."""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DifftestError, InfraError
from ..records.report import build_report, write_report
from ..verdicts.classify import SegmentVerdict
from ..verdicts.policy import Policy
from .envs import Source, open_env
from .generate import Case, generate
from .probe import Evaluator, Outcome, Probe
from .shrink import shrink

SUITE = "handoff-probe"


@dataclass
class Finding:
    mode: str
    family: str
    first: Case  # the smallest generated case that showed it
    minimal: Case
    violations: list  # the minimal case's violations in this family
    failing_cases: int
    shrink_tries: int

    @property
    def lead(self):
        with_donor = [v for v in self.violations if v.donor]
        return (with_donor or self.violations)[0]


@dataclass
class SourceResult:
    source: Source
    cases: int = 0
    findings: list = field(default_factory=list)
    errors: list = field(default_factory=list)  # (mode, where, type, message, case)
    infra: str | None = None
    layout: dict | None = None
    timings: dict = field(default_factory=dict)
    clean_modes: list = field(default_factory=list)


def probe_source(source: Source, cases: list[Case], *, adapter: str | None = None, do_shrink: bool = True,
                 log=print) -> SourceResult:
    res = SourceResult(source, len(cases))
    t0 = time.monotonic()
    try:
        with open_env(source) as env:  # held until the probe is done: the cache leaves it alone
            res.timings["env_s"] = round(time.monotonic() - t0, 2)
            res.timings["env_built"] = {"base_s": env.base_built_s, "target_s": env.target_built_s}
            t1 = time.monotonic()
            with Probe(env, adapter) as probe:
                res.layout = probe.layout
                res.timings["probe_start_s"] = round(probe.start_s, 2)
                t2 = time.monotonic()
                ev = Evaluator(probe)
                outcomes = ev.evaluate(cases)
                res.timings["matrix_s"] = round(time.monotonic() - t2, 2)
                t3 = time.monotonic()
                _collect(res, ev, outcomes, do_shrink)
                res.timings["shrink_s"] = round(time.monotonic() - t3, 2)
                res.timings["probe_calls"] = ev.calls
            res.timings["probe_total_s"] = round(time.monotonic() - t1, 2)
    except DifftestError as e:
        if not isinstance(e, InfraError):
            raise
        res.infra = str(e)
    res.timings["total_s"] = round(time.monotonic() - t0, 2)
    return res


def _collect(res: SourceResult, ev: Evaluator, outcomes: list[Outcome], do_shrink: bool) -> None:
    groups: "OrderedDict[tuple, list[Outcome]]" = OrderedDict()
    for o in outcomes:
        if o.error:
            e = o.error
            res.errors.append((o.case.mode, e.get("where"), e.get("type"), e.get("message"), o.case))
        for v in o.violations:
            groups.setdefault((o.case.mode, v.family), [])
            if o not in groups[(o.case.mode, v.family)]:
                groups[(o.case.mode, v.family)].append(o)
    for mode in ("full", "async"):
        if any(o.case.mode == mode for o in outcomes) and not any(k[0] == mode for k in groups) \
                and not any(e[0] == mode for e in res.errors):
            res.clean_modes.append((mode, sum(1 for o in outcomes if o.case.mode == mode)))
    for (mode, fam), failing in groups.items():
        first = min((o.case for o in failing), key=lambda c: c.size())

        def still_fails(c: Case, fam=fam) -> bool:
            out = ev.evaluate([c])[0]
            return any(v.family == fam for v in out.violations)

        minimal, tries = shrink(first, still_fails) if do_shrink else (first, 0)
        viol = [v for v in ev.evaluate([minimal])[0].violations if v.family == fam]
        res.findings.append(Finding(mode, fam, first, minimal, viol, len(failing), tries))


def _chunk_index(path: str) -> int | None:
    m = re.match(r"chunk(\d+)\.", path)
    return int(m.group(1)) if m else None


def verdicts_for(res: SourceResult) -> list[SegmentVerdict]:
    label = res.source.label
    prov = {"source": res.source.as_dict()}
    if res.infra:
        return [SegmentVerdict(label, "error", res.infra, stage="handoff", error_kind="infrastructure",
                               comparisons=prov)]
    out = []
    for f in res.findings:
        lead = f.lead
        n = len(f.minimal.requests)
        verdict = "contamination" if lead.donor else "concurrency_defect"
        src = f"{lead.donor}'s data" if lead.donor else "a value that depends on the batch"
        summary = (f"[{f.mode}] {lead.request} hands on {src} in {lead.path} "
                   f"(minimal batch of {n}: {f.minimal.describe()}); {lead.describe()}")
        out.append(SegmentVerdict(
            f"{label}/{f.mode}/{f.family}", verdict, summary, first_divergent_chunk=_chunk_index(lead.path),
            stage="handoff", donor=lead.donor,
            comparisons={**prov, "mode": f.mode, "field": f.family, "request": lead.request, "donor": lead.donor,
                         "minimal_batch": f.minimal.to_json(), "minimal_batch_text": f.minimal.describe(),
                         "violations": [v.to_json() for v in f.violations[:20]],
                         "failing_cases": f.failing_cases, "cases": res.cases,
                         "first_failing_case": f.first.to_json(), "shrink_tries": f.shrink_tries},
            notes=[f"{f.failing_cases} of {res.cases} generated cases show it"]))
    seen = set()
    for mode, where, typ, msg, case in res.errors:
        key = (mode, where, typ)
        if key in seen:
            continue
        seen.add(key)
        count = sum(1 for e in res.errors if e[:3] == key)
        out.append(SegmentVerdict(
            f"{label}/{mode}/raised/{where}", "error", f"[{mode}] {where} raised {typ}: {msg} "
            f"({count} cases; first: {case.describe()})", stage="handoff", error_kind="candidate",
            comparisons={**prov, "mode": mode, "where": where, "type": typ, "message": msg,
                         "cases": count, "first_case": case.to_json()}))
    for mode, n in res.clean_modes:
        out.append(SegmentVerdict(f"{label}/{mode}", "identical",
                                  f"[{mode}] {n} generated batches: every field every request hands on equals "
                                  f"its batch-of-one value and carries only its own codes",
                                  stage="handoff", comparisons={**prov, "mode": mode, "cases": n}))
    return out


def matrix_line(res: SourceResult) -> str:
    label = res.source.label
    if res.infra:
        return f"{label:>10}  ERROR  {res.infra}"
    if not res.findings and not res.errors:
        return f"{label:>10}  clean  ({res.cases} batches, full and async)"
    parts = []
    for f in res.findings:
        lead = f.lead
        who = f"{lead.request}<-{lead.donor}" if lead.donor else f"{lead.request}, no single donor"
        parts.append(f"{f.mode}:{f.family} [{who}; minimal {len(f.minimal.requests)} req: {f.minimal.describe()}]")
    for mode, where, typ, _msg, _case in res.errors[:1]:
        parts.append(f"{mode}: {where} raised {typ}")
    # LEAK: another request's codes reached a request; FINDINGS: values that depend on the batch
    leak = any(v.problem == "foreign_codes" for f in res.findings for v in f.violations)
    kind = "LEAK" if leak else "FINDINGS"
    return f"{label:>10}  {kind:<8}  " + ("\n" + " " * 22).join(parts)


def run_handoff(sources: list[Source], out: Path, policy: Policy, *, seed: int = 0, max_batch: int = 8,
                compositions: int = 5, orders: int = 6, adapter: str | None = None, do_shrink: bool = True,
                log=print) -> tuple[dict, list[SourceResult]]:
    cases = generate(seed=seed, max_batch=max_batch, compositions=compositions, orders=orders)
    results, verdicts = [], []
    for s in sources:
        log(f"handoff: {s.label} ({len(cases)} generated batches)")
        r = probe_source(s, cases, adapter=adapter, do_shrink=do_shrink, log=log)
        results.append(r)
        verdicts.extend(verdicts_for(r))
        log(matrix_line(r))
    report = build_report(
        verdicts, policy,
        suite={"name": SUITE, "seed": seed, "cases": len(cases), "max_batch": max_batch,
               "compositions": compositions, "orders": orders},
        candidate={"kind": "vllm-omni hand-off (probe)", "sources": [r.source.as_dict() for r in results]},
        concurrency=max_batch,
        provenance={"handoff": [{"source": r.source.as_dict(), "layout": r.layout, "timings": r.timings,
                                 "findings": len(r.findings), "infra": r.infra} for r in results]},
        warnings=[f"{r.source.label}: {r.infra}" for r in results if r.infra])
    write_report(out, report)
    return report, results
