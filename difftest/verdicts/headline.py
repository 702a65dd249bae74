"""The headline comparison: the reference at concurrency 1 against the candidate at N, codes first
(the encoder's reference codes, then the generated ones), then audio chunk by chunk; where nothing
else was found, whether the segment is identical or drifts within what the numerics allow."""

from __future__ import annotations

from ..compare.chunks import TIERS
from ..compare.codes import diff_codes
from ..engines.captured import captured
from ..family import SAMPLES_PER_FRAME
from .check import Check
from .encoder import encoder_finding
from .evidence import Evidence, Finding, chunk_of, code_json, compared, same, talker_stage
from .policy import Policy
from .vocoder import null_excused


def headline_findings(ev: Evidence, policy: Policy, comps: dict, mels: dict) -> list[Finding]:
    ref, cand = ev.reference, ev.candidate
    out = []
    codes_known = ref.has_codes and cand.has_codes
    if codes_known:
        d = diff_codes(ref.codes, cand.codes, ev.initial_frames, ev.chunk_frames)
        comps["codes"] = code_json(d)
        talker = talker_stage(cand)
        encoded = talker.ref_codes if talker is not None else cand.ref_codes  # the encoder's, before the hand-off
        comps["codes"]["ref_codes_equal"] = same(ref.ref_codes, encoded)
        if not same(ref.ref_codes, encoded):
            out.append(encoder_finding(ref.ref_codes, encoded, policy, comps, talker is not None,
                                        captured(ref).ref_codes_bf16))
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
    audio = compared(ref, cand, ev, policy, mels)
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
    frame, chunk = audio.first_bad(allowed, excused)
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


HEADLINE = Check("headline", gives=("length_mismatch", "code_divergence", "reference_encoder_defect", "vocoder_defect",
                                    "audio_divergence", "identical", "numeric_drift"),
                 judge=lambda ev, ctx: headline_findings(ev, ctx.policy, ctx.comps, ctx.mels))
