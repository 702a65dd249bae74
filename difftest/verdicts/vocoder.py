"""The vocoder: the candidate's audio against the reference vocoder on the candidate's own codes,
and where it parts, against the same with each co-batched request's reference codes."""

from __future__ import annotations

import numpy as np

from ..compare.chunks import Audio
from ..family import SAMPLES_PER_FRAME
from . import vocoder_null
from .check import Check
from .evidence import Evidence, Finding, compared, ranges
from .policy import Policy


def null_excused(ev: Evidence, audio: Audio, a, policy: Policy, comps: dict, mels: dict) -> np.ndarray | None:
    """Per chunk, whether `audio` (`a` against the candidate) stays within the vocoder's measured
    null (`a` against qwen-tts's vocoder in the candidate's dtype); None where no null was decoded."""
    if ev.vocoder_null is None:
        return None
    null = compared(a, ev.vocoder_null, ev, policy, mels)
    ok = vocoder_null.excused(audio, null, policy.vocoder_null_margin)
    comps.setdefault("vocoder_null", vocoder_null.to_json(audio, null, ev.vocoder_dtype, policy.vocoder_null_margin,
                                                          ok))
    return ok


def vocoder_findings(ev: Evidence, policy: Policy, comps: dict, mels: dict) -> list[Finding]:
    cand, cross = ev.candidate, ev.cross_own
    audio = compared(cross, cand, ev, policy, mels)
    comps["vocoder"] = audio.to_json()
    allowed = policy.tier_index("vocoder")
    excused = null_excused(ev, audio, cross, policy, comps, mels)
    frame, chunk = audio.first_bad(allowed, excused)
    if audio.length_gap:
        frames = audio.length_gap / SAMPLES_PER_FRAME
        extra = (f"; the extra {frames:.0f} frames equal the reference codes' length: reference audio left in the output?"
                 if len(cand.ref_codes) and round(frames) == len(cand.ref_codes) and cand.codes.size else "")
        if frame is None:  # the common part agrees: the difference starts where one side ends
            frame = min(audio.len_a, audio.len_b) // SAMPLES_PER_FRAME
        return [Finding("vocoder_length",
                         f"candidate audio has {audio.len_b} samples, its codes decode to {audio.len_a}{extra}",
                         frame=frame, chunk=chunk, stage="vocoder")]
    if chunk is None:
        return []
    bad = audio.bad_chunks(allowed, excused)
    own = float(audio.chunks.logmel[bad].mean())
    scores = {}
    for peer, x in sorted(ev.cross_donors.items()):
        if len(x.grid_wav) != len(cross.grid_wav):
            continue
        alt = compared(x, cand, ev, policy, mels)
        scores[peer] = float(alt.chunks.logmel[bad].mean())
    comps["donor_search"] = {"own_logmel": own, "peers_logmel": scores, "chunks": bad.tolist()}
    if scores:
        donor = min(scores, key=scores.get)
        if scores[donor] <= policy.donor_max_ratio * own:
            ties = [p for p in scores if p != donor and scores[p] == scores[donor]]
            same = f" (as well with {', '.join(ties)}'s: the same voice)" if ties else ""
            return [Finding("contamination",
                             f"chunks {ranges(bad)} decode as if with {donor}'s reference codes "
                             f"(log-mel distance {scores[donor]:.3g} against {own:.3g} with its own){same}",
                             frame=frame, chunk=chunk, stage="handoff", donor=donor, donor_kind="codes")]
    beyond = ""
    if excused is not None and "ratio" in comps.get("vocoder_null", {}):
        r = comps["vocoder_null"]["ratio"]
        worst = {m: max((r[m][i] if r[m][i] is not None else float("inf")) for i in bad) for m in r}
        beyond = (f", beyond {policy.vocoder_null_margin:g}x what qwen-tts's own {ev.vocoder_dtype} vocoder moves from "
                  "the reference's decode: " + ", ".join(f"{m} {v:.3g}x" for m, v in worst.items()))
    return [Finding("vocoder_defect",
                     f"candidate audio leaves the reference vocoder's output on its own codes from chunk {chunk} "
                     f"(chunks {ranges(bad)}, worst log-mel distance {audio.chunks.logmel[bad].max():.3g}{beyond})",
                     frame=frame, chunk=chunk, stage="vocoder")]


VOCODER = Check("vocoder", gives=("vocoder_length", "contamination", "vocoder_defect"),
                judge=lambda ev, ctx: vocoder_findings(ev, ctx.policy, ctx.comps, ctx.mels),
                applies=lambda ev: ev.cross_own is not None and ev.candidate.has_codes,
                skipped=lambda ev: "no cross-decode: vocoder stage not checked" if ev.candidate.has_codes else None)
