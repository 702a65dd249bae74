"""The verdict classifier over the design's comparison matrix.

Per segment, up to five comparisons (each chunk by chunk):

- headline:     reference@1 against candidate@N
- concurrency:  candidate@1 against candidate@N
- stages:       where the capture has the talker's side (schema v2), the
                hand-off against it: the vocoder's reference prefix must be the
                reference codes the talker was prompted with, its frames the
                frames the talker generated; the talker's prompt must fill what
                the engine reserved for it
- vocoder:      the reference vocoder on the candidate's codes and own reference
                codes, against the candidate's audio
- donor:        the same with each co-batched request's reference codes

Each comparison is a check of the registry (verdicts/checks.py; the interface in
verdicts/check.py); each that finds something adds a finding, the rules after them
explain some away, and the verdict is the most serious finding left (the table's
rank, verdicts/catalogue.py). Missing inputs only narrow what can be said; the
segment's `notes` say which comparisons were not possible."""

from __future__ import annotations

from ..compare import align
from .check import Context, Registry
from .checks import REGISTRY
from .evidence import STAGES, Evidence, SegmentVerdict, chunk_of, talker_stage
from .policy import Policy

__all__ = ["STAGES", "Evidence", "SegmentVerdict", "classify", "talker_stage"]


def _chunk(f, ev: Evidence) -> int | None:
    return chunk_of(f.frame, f.frame + 1, ev) if f.chunk is None and f.frame is not None else f.chunk


def classify(ev: Evidence, policy: Policy, registry: Registry = REGISTRY) -> SegmentVerdict:
    ctx = Context(ev, policy, registry)
    stopped = False
    for check in registry.checks:
        if check.applies(ev):
            stopped = bool(ctx.of(check.name)) and check.stops
        elif note := check.skipped(ev):
            ctx.notes.append(note)
        if stopped:
            break
    found = {c.name: ctx.found[c.name] for c in registry.checks if c.name in ctx.found}  # the registry's order
    if not stopped:
        for rule in registry.rules:
            found = rule.apply(ev, found, ctx)
            registry.judged(rule, found.get(rule.name, []))
        if abs(len(ev.reference.grid_wav) - len(ev.candidate.grid_wav)) == align.TRAILING_SAMPLES:
            ctx.notes.append("one trailing sample of difference in length")
    findings, comps, notes = [f for fs in found.values() for f in fs], ctx.comps, ctx.notes
    top = min(findings, key=lambda f: registry.rank(f.kind))
    verdict = registry.reported(top.kind)
    others = sorted({registry.reported(f.kind) for f in findings if f is not top} - {verdict})
    if others:
        notes.append("also: " + ", ".join(others))
    chunk = _chunk(top, ev)
    artifacts = {role: str(r.source) for role in ("reference", "candidate", "control", "cross_own", "vocoder_null")
                 if (r := getattr(ev, role)) is not None and r.source is not None}
    artifacts.update({f"cross_donor:{p}": str(r.source) for p, r in ev.cross_donors.items() if r.source is not None})
    also = [{"verdict": registry.reported(f.kind), "summary": f.summary, "first_divergent_frame": f.frame,
             "first_divergent_chunk": _chunk(f, ev), "stage": f.stage, "donor": f.donor, "donor_kind": f.donor_kind}
            for f in sorted((f for f in findings if f is not top), key=lambda f: registry.rank(f.kind))]
    return SegmentVerdict(ev.segment_id, verdict, top.summary, top.frame, chunk, top.stage, top.donor,
                          top.error_kind, comps, notes, artifacts, top.donor_kind, also)
