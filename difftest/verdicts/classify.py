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

Each comparison that finds something adds a finding; the verdict is the most
serious finding (see RANK). Missing inputs only narrow what can be said; the
segment's `notes` say which comparisons were not possible."""

from __future__ import annotations

from ..compare import align
from ..compare.audio import non_finite
from ..compare.codes import diff_codes
from ..family import SAMPLE_RATE, SAMPLES_PER_FRAME
from .catalogue import RANK, reported
from .concurrency import concurrency_findings
from .encoder import encoder_finding
from .evidence import STAGES, Audio, Evidence, Finding, SegmentVerdict, chunk_of, code_json, same, talker_stage
from .handoff import handoff_findings, stage_findings
from .history import history_findings
from .policy import TIERS, Policy
from .talker import forced_findings
from .talker_input import input_findings
from .vocoder import null_excused, vocoder_findings

__all__ = ["STAGES", "Evidence", "SegmentVerdict", "classify", "talker_stage"]


def _input_errors(ev: Evidence) -> Finding | None:
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


def headline_findings(ev: Evidence, policy: Policy, comps: dict, mels: dict) -> list[Finding]:
    ref, cand = ev.reference, ev.candidate
    out = []
    codes_known = ref.has_codes and cand.has_codes
    if codes_known:
        d = diff_codes(ref.codes, cand.codes, ev.initial_frames, ev.chunk_frames)
        comps["codes"] = code_json(d)
        talker = talker_stage(cand)
        encoded = talker["ref_codes"] if talker is not None else cand.ref_codes  # the encoder's, before the hand-off
        comps["codes"]["ref_codes_equal"] = same(ref.ref_codes, encoded)
        if not same(ref.ref_codes, encoded):
            out.append(encoder_finding(ref.ref_codes, encoded, policy, comps, talker is not None,
                                        ref.extra.get("ref_codes_bf16")))
        if d.length_only:
            out.append(Finding("length_mismatch",
                                f"same codes for {min(d.len_a, d.len_b)} frames, then the candidate has "
                                f"{d.len_b} frames and the reference {d.len_a}",
                                frame=d.first_divergent_frame,
                                chunk=chunk_of(d.first_divergent_frame, max(d.len_a, d.len_b), ev), stage="talker"))
        elif not d.equal:
            f = d.first_divergent_frame
            out.append(Finding("code_divergence",
                                f"codes differ from the reference from frame {f} "
                                f"({d.frames_differing} of {min(d.len_a, d.len_b)} common frames differ)",
                                frame=f, chunk=chunk_of(f, max(d.len_a, d.len_b), ev), stage="talker"))
        if out:
            return out
    audio = Audio(ref, cand, ev, policy, mels)
    comps["audio"] = audio.to_json()
    if audio.length_gap:
        out.append(Finding("length_mismatch",
                            f"candidate audio has {audio.len_b} samples, the reference {audio.len_a}",
                            frame=min(audio.len_a, audio.len_b) // SAMPLES_PER_FRAME,
                            stage="vocoder" if codes_known else None))
        return out
    allowed = policy.tier_index("drift")
    # the same codes through a vocoder in another dtype: allowed what qwen-tts's own vocoder in it moves
    excused = null_excused(ev, audio, ref, policy, {}, mels) if codes_known else None
    frame, chunk = audio.first_bad(allowed, policy, excused)
    if chunk is not None:
        if codes_known:
            out.append(Finding("vocoder_defect",
                                f"same codes, but the audio leaves the reference's from chunk {chunk}",
                                frame=frame, chunk=chunk, stage="vocoder"))
        else:
            out.append(Finding("audio_divergence",
                                f"audio leaves the reference's from chunk {chunk} (no codes captured to say why)",
                                frame=frame, chunk=chunk))
    elif audio.worst == 0:
        out.append(Finding("identical", "codes and audio identical" if codes_known else "audio identical"))
    else:
        within = (f"within {policy.vocoder_null_margin:g}x qwen-tts's own {ev.vocoder_dtype} vocoder's distance"
                  if audio.worst > allowed else f"within tier {TIERS[audio.worst]}")
        out.append(Finding("numeric_drift",
                            f"{'same codes; ' if codes_known else ''}audio {within} "
                            f"(max |diff| {audio.chunks.max_abs.max():.3g})"))
    return out


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


def classify(ev: Evidence, policy: Policy) -> SegmentVerdict:
    comps: dict = {}
    notes: list[str] = []
    mels: dict = {}
    bad = _input_errors(ev)
    findings = [bad] if bad else []
    if not bad:
        cand = ev.candidate
        if not cand.has_codes:
            notes.append("candidate returned no codes (no capture): audio-only comparison")
        if cand.meta.get("preempted_at"):
            notes.append("the talker preempted this request after " + ", ".join(map(str, cand.meta["preempted_at"]))
                         + " generated tokens and resumed it (recomputing its prompt and tokens): every frame from "
                         "then on rests on the resumed KV")
        voc = vocoder_findings(ev, policy, comps, mels) if ev.cross_own is not None and cand.has_codes else []
        if cand.has_codes:
            handoff = handoff_findings(ev, comps, notes, voc)
            findings += handoff + stage_findings(ev, comps) + input_findings(ev, comps, notes, policy)
            if handoff and talker_stage(cand) is not None:
                voc = []  # the audio's departure is the hand-off's wrong prefix, already placed above
            elif talker_stage(cand) is None:
                notes.append("no talker stage in the capture: the hand-off judged against the reference codes "
                             "found at the vocoder")
            if ev.cross_own is None:
                notes.append("no cross-decode: vocoder stage not checked")
        findings += voc
        if ev.control is not None:
            findings += concurrency_findings(ev, policy, comps, mels)
            if ev.repeat is not None:
                findings += history_findings(ev, policy, comps, mels)
        else:
            notes.append("no concurrency-1 control: concurrency invariance not checked")
        if cand.has_codes:
            tf = forced_findings(ev, policy, comps)
            findings += tf
            if "forced" in comps and not tf:
                f = comps["forced"]
                notes.append(f"teacher-forced under qwen-tts the candidate's codes are plausible ({f['decoding']}: "
                             f"top-1 at {f['top1_share']:.0%} of frames, worst rank {f['worst_rank']}, "
                             f"worst gap {f['worst_gap']:.2g} nats)")
            if (t := comps.get("forced", {}).get("float32_ties")) and not tf:
                notes.append(f"suspect: its codes leave qwen-tts's top-1 only on float32 ties ({t['count']}, the first at "
                             f"frame {t['first'][0]} codebook {t['first'][1]}, {t['gap']:.2g} nats): float32 reordering "
                             f"moves qwen-tts's own margins that far (the tie width, {comps['forced']['exact_tie_gap']:g} "
                             f"nats), so no verdict alone; listen where the run fails")
            if "forced" not in comps:
                notes.append("no teacher-forced scores: the talker stage not judged")
        findings += headline_findings(ev, policy, comps, mels)
        findings = talker_cleared(ev, findings, notes)
        findings = encoder_explains(findings, comps, notes)
        if abs(len(ev.reference.grid_wav) - len(cand.grid_wav)) == align.TRAILING_SAMPLES:
            notes.append("one trailing sample of difference in length")
    top = min(findings, key=lambda f: RANK.index(f.kind))
    verdict = reported(top.kind)
    others = sorted({reported(f.kind) for f in findings if f is not top} - {verdict})
    if others:
        notes.append("also: " + ", ".join(others))
    chunk = top.chunk
    if chunk is None and top.frame is not None:
        chunk = chunk_of(top.frame, top.frame + 1, ev)
    artifacts = {role: str(r.source) for role in ("reference", "candidate", "control", "cross_own", "vocoder_null")
                 if (r := getattr(ev, role)) is not None and r.source is not None}
    artifacts.update({f"cross_donor:{p}": str(r.source) for p, r in ev.cross_donors.items() if r.source is not None})
    return SegmentVerdict(ev.segment_id, verdict, top.summary, top.frame, chunk, top.stage, top.donor,
                          top.error_kind, comps, notes, artifacts, top.donor_kind)
