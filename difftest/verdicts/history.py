"""History: the segment served again at concurrency 1 after every other one, against its first
serving."""

from __future__ import annotations

from dataclasses import replace

from .check import Check
from .concurrency import concurrency_findings
from .evidence import Evidence, Finding, same
from .handoff import code_donors
from .policy import Policy


def history_findings(ev: Evidence, policy: Policy, comps: dict, mels: dict | None = None) -> list[Finding]:
    """The segment served again at concurrency 1 after every other one, against its first serving:
    an engine whose output depends on what it served before (a cache, a buffer, a request's state
    left behind) parts them. Reference codes first: those of a request served earlier name it."""
    rep, ctrl = ev.repeat, ev.control
    if rep.has_codes and ctrl.has_codes and not same(rep.ref_codes, ctrl.ref_codes):
        donors, _ = code_donors(rep.ref_codes, replace(ev, peer_ref_codes={}), ctrl.ref_codes)
        comps["repeat_ref_codes"] = {"first_frames": len(ctrl.ref_codes), "repeat_frames": len(rep.ref_codes),
                                     "matches": donors[0] if donors else None}
        if donors:
            return [Finding("contamination", f"served again after the other segments, its vocoder got "
                                              f"{donors[0]}'s reference codes (served earlier)",
                             frame=0, chunk=0, stage="handoff", donor=donors[0], donor_kind="codes")]
        return [Finding("history_defect", f"served again after the other segments, its reference codes "
                                           f"({len(rep.ref_codes)} frames) differ from its first serving's "
                                           f"({len(ctrl.ref_codes)})", frame=0, chunk=0, stage="handoff")]
    return concurrency_findings(replace(ev, candidate=rep), policy, comps, {} if mels is None else mels,
                                 kind="history_defect",
                                 later="served again after the other segments", first="its first serving",
                                 key="repeat")


HISTORY = Check("history", gives=("contamination", "history_defect"),
                judge=lambda ev, ctx: history_findings(ev, ctx.policy, ctx.comps, ctx.mels),
                applies=lambda ev: ev.control is not None and ev.repeat is not None)
