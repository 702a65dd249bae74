"""The rules classify applies after every check, in this order: where one finding explains
another away, or places it at another stage. Each is a function of the flat findings (tested so)
and a `Rule` over the findings per check."""

from __future__ import annotations

from .check import Context, Rule
from .evidence import Evidence, Finding, same, talker_frames, talker_stage


def handoff_places_audio(ev: Evidence, found: dict[str, list[Finding]], ctx: Context) -> dict[str, list[Finding]]:
    """Where the talker's side was captured and the hand-off gave the vocoder something else, the
    audio's departure from the reference vocoder is that wrong input's, already placed: the
    vocoder's findings go."""
    if found.get("handoff") and talker_stage(ev.candidate) is not None:
        return {**found, "vocoder": []}
    return found


def handoff_places_codes(ev: Evidence, found: dict[str, list[Finding]], notes: list[str]) -> dict[str, list[Finding]]:
    """Where the capture shows the vocoder got other frames than the talker generated (the stage check's
    handoff_defect or contamination) and the talker's own are not among them whole, teacher forcing
    judged the hand-off's output (pipeline/scoring.py forces the talker's frames where it can find
    them: evidence.talker_frames), not the talker's: its finding goes."""
    if (any(f.stage == "handoff" for f in found.get("stages", [])) and found.get("forced")
            and not talker_frames(ev.candidate)[1]):
        notes.append("teacher forcing judged the frames the vocoder got, which the hand-off changed, not the "
                     "talker's own (not among them whole): its finding is not the talker's")
        return {**found, "forced": []}
    return found


def talker_cleared(ev: Evidence, findings: list[Finding], notes: list[str]) -> list[Finding]:
    """Without the talker's side in the capture, teacher forcing conditions the talker on the
    reference codes found at the vocoder. Where the candidate's codes are qwen-tts's exactly, its
    talker decoded as qwen-tts's did, from qwen-tts's reference: a forcing finding against the
    vocoder's reference is that reference's, not the talker's (issue 57). The talker finding goes;
    a vocoder reference that is qwen-tts's cut or extended at either end is the hand-off's."""
    ref, cand = ev.reference, ev.candidate
    if (talker_stage(cand) is not None or not ref.has_codes or not cand.has_codes or not len(cand.codes)
            or not same(ref.codes, cand.codes) or same(ref.ref_codes, cand.ref_codes)):
        return findings
    kept = [f for f in findings if not (f.kind == "talker_defect" and f.stage == "talker")]
    if len(kept) < len(findings):
        notes.append("the candidate's codes are qwen-tts's exactly: its talker was not at fault; teacher forcing "
                     "in the reference the vocoder got (no talker stage captured) is not the talker's context")
    theirs, mine = ref.ref_codes, cand.ref_codes
    short, long_ = (mine, theirs) if len(mine) < len(theirs) else (theirs, mine)
    n = len(short)
    if len(mine) != len(theirs) and n and (same(long_[:n], short) or same(long_[-n:], short)):
        end = "end" if same(long_[:n], short) else "start"
        how = (f"{len(theirs) - len(mine)} frames short at its {end}" if len(mine) < len(theirs)
               else f"{len(mine) - len(theirs)} frames too many at its {end}")
        kept.append(Finding("handoff_defect", f"the candidate's codes are qwen-tts's exactly, but the reference the "
                                              f"vocoder got is qwen-tts's {how} ({len(mine)} frames for "
                                              f"{len(theirs)}): the hand-off's, not the talker's",
                            frame=0, chunk=0, stage="handoff"))
    return kept


def encoder_explains(findings: list[Finding], comps: dict, notes: list[str]) -> list[Finding]:
    """Teacher forcing conditions qwen-tts's talker on its own x-vector of the voice; where the engine's
    encoder made something else of the voice, a talker that departs from qwen-tts's top-1 only a
    little (past a float32 tie, or wider than the noise model expects, every token still plausible)
    may be following that encoder's speaker embedding: the encoder's finding stands, the talker's goes."""
    if (not any(f.kind == "reference_encoder_defect" for f in findings)
            or comps.get("forced", {}).get("failed_by") not in ("float32_tie", "noise_model")):
        return findings
    kept = [f for f in findings if not (f.kind == "talker_defect" and f.stage == "talker")]
    if len(kept) < len(findings):
        notes.append("the talker's departures from qwen-tts's top-1 (every token plausible) may follow the engine's "
                     "encoder, which made something else of the voice: placed at the encoder")
    return kept


def _per_check(name: str, found: dict[str, list[Finding]], kept: list[Finding]) -> dict[str, list[Finding]]:
    """`found` with only the findings in `kept`; those the rule made go under its own name, last."""
    ids = {id(f) for f in kept}
    out = {check: [f for f in fs if id(f) in ids] for check, fs in found.items()}
    before = {id(f) for fs in found.values() for f in fs}
    if made := [f for f in kept if id(f) not in before]:
        out[name] = made
    return out


def _flat(found: dict[str, list[Finding]]) -> list[Finding]:
    return [f for fs in found.values() for f in fs]


RULES = (
    Rule("handoff_places_audio", gives=(), apply=handoff_places_audio),
    Rule("handoff_places_codes", gives=(), apply=lambda ev, found, ctx: handoff_places_codes(ev, found, ctx.notes)),
    Rule("talker_cleared", gives=("handoff_defect",),
         apply=lambda ev, found, ctx: _per_check("talker_cleared", found, talker_cleared(ev, _flat(found), ctx.notes))),
    Rule("encoder_explains", gives=(),
         apply=lambda ev, found, ctx: _per_check("encoder_explains", found,
                                                 encoder_explains(_flat(found), ctx.comps, ctx.notes))),
)
