"""Whether a segment can be judged at all (errors, missing results, audio at another rate, NaN or
empty audio), and the notes on how the candidate served it: the first two checks classify walks."""

from __future__ import annotations

from ..compare.audio import non_finite
from ..engines.capture import OverLength
from ..family import SAMPLE_RATE, SAMPLES_PER_FRAME
from .check import Check, Context
from .evidence import Evidence, Finding


def unusable(ev: Evidence) -> Finding | None:
    if ev.errors:
        e = ev.errors[0]
        more = f" (+{len(ev.errors) - 1} more)" if len(ev.errors) > 1 else ""
        if e.get("defect"):  # judged, not an error: the engine did something the request forbade (OverLength)
            return Finding(e["defect"], f"{e['source']}: {e['message']}{more}", frame=0, chunk=0, stage=e.get("stage"))
        return Finding("error", f"{e['source']}: {e['message']}{more}", error_kind=e.get("kind", "infrastructure"),
                       stage=e.get("stage"))
    for name in ("reference", "candidate"):
        if getattr(ev, name) is None:
            return Finding("error", f"no {name} result", error_kind="infrastructure")
    for name in ("reference", "candidate", "control", "cross_own"):
        r = getattr(ev, name)
        if r is None:
            continue
        kind = "candidate" if name in ("candidate", "control") else "infrastructure"
        if r.sample_rate != SAMPLE_RATE:
            return Finding("error", f"{name} audio is at {r.sample_rate} Hz, not {SAMPLE_RATE}", error_kind=kind)
        i = non_finite(r.wav)
        if i is not None:
            return Finding("error", f"{name} audio holds NaN or infinity at sample {i} (frame {i // SAMPLES_PER_FRAME})",
                            frame=i // SAMPLES_PER_FRAME, error_kind=kind)
        if len(r.wav) == 0 and (len(r.codes) or not r.has_codes):
            return Finding("error", f"{name} audio is empty", error_kind=kind)
    return None


def served_notes(ev: Evidence, ctx: Context) -> list[Finding]:
    cand = ev.candidate
    if not cand.has_codes:
        ctx.notes.append("candidate returned no codes (no capture): audio-only comparison")
    if cand.meta.get("preempted_at"):
        ctx.notes.append("the talker preempted this request after " + ", ".join(map(str, cand.meta["preempted_at"]))
                         + " generated tokens and resumed it (recomputing its prompt and tokens): every frame from "
                         "then on rests on the resumed KV")
    return []


USABLE = Check("usable", gives=("error", OverLength.verdict), judge=lambda ev, ctx: [f] if (f := unusable(ev)) else [],
               stops=True)
SERVED = Check("served", gives=(), judge=served_notes)
