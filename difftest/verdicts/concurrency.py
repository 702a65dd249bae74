"""Concurrency: the candidate at N against itself at 1, codes then audio, and when its codes part
on a near-tie, whether that is numerics: the per-token line, the candidate's own logits, and
the measured null's batch noise (verdicts/null.py)."""

from __future__ import annotations

from dataclasses import replace

from ..compare import forced, own_margins
from ..compare.chunks import TIERS
from ..compare.codes import diff_codes
from ..compare.forced import ForcedPolicy
from ..engines.captured import captured
from ..family import SAMPLES_PER_FRAME
from . import null as measured_null
from .check import Check
from .evidence import Evidence, Finding, chunk_of, code_json, compared
from .policy import Policy
from .talker import measured_lines


def concurrency_findings(ev: Evidence, policy: Policy, comps: dict, mels: dict, kind: str = "concurrency_defect",
                          later: str = "at concurrency N", first: str = "concurrency 1",
                          key: str = "concurrency") -> list[Finding]:
    """The candidate (`later`) against the control (`first`): codes, then audio, chunk by chunk."""
    cand, ctrl = ev.candidate, ev.control
    out = []
    if cand.has_codes and ctrl.has_codes:
        d = diff_codes(ctrl.codes, cand.codes, ev.initial_frames, ev.chunk_frames)
        comps[f"{key}_codes"] = code_json(d)
        if not d.equal:
            f = d.first_divergent_frame
            chunk = chunk_of(f, max(d.len_a, d.len_b), ev)
            tie = _near_tie(ev, policy, comps) if key == "concurrency" else None
            # why the flip is no near-tie: only where this check asked (the repeat check never does, and
            # comps["near_tie"] may hold the concurrency check's answer, a near-tie without a "why")
            why = comps["near_tie"].get("why") if key == "concurrency" and "near_tie" in comps else None
            if tie:
                out.append(Finding("code_divergence", f"codes {later} part from {first} at frame {f} on a near-tie "
                                                       f"under qwen-tts ({tie}), and stay plausible after it",
                                    frame=f, chunk=chunk, stage="talker"))
                return out
            out.append(Finding(kind, f"codes {later} differ from {first} from frame {f} "
                                      f"({d.len_b} against {d.len_a} frames)"
                                + (f": not a near-tie ({why})" if why else ""),
                                frame=f, chunk=chunk, stage="talker"))
            return out
    audio = compared(ctrl, cand, ev, policy, mels)
    comps[key] = audio.to_json()
    if audio.length_gap:
        out.append(Finding(kind, f"audio {later} has {audio.len_b} samples, {first} {audio.len_a}",
                            frame=min(audio.len_a, audio.len_b) // SAMPLES_PER_FRAME, stage="vocoder"))
        return out
    frame, chunk = audio.first_bad(policy.tier_index("concurrency"))
    if chunk is not None:
        stage = "vocoder" if cand.has_codes and ctrl.has_codes else None
        out.append(Finding(kind, f"audio {later} leaves {first}'s from chunk {chunk} "
                                  f"(tier {TIERS[audio.tiers[chunk]]}, log-mel {audio.chunks.logmel[chunk]:.3g})",
                            frame=frame, chunk=chunk, stage=stage))
    return out


def _near_tie(ev: Evidence, policy: Policy, comps: dict) -> str | None:
    """Where the candidate at N and at 1 part on greedy codes: a description when it is a near-tie
    (both tokens in qwen-tts's top-k, each close to its top-1, and the stream at N plausible after),
    else None with the reason in comps["near_tie"]."""
    a, b = ev.scores.get("control"), ev.scores.get("candidate")
    if a is None or b is None or forced.sampled(a) or forced.sampled(b):
        return None  # a sampled flip is a different draw: no near-tie explains it
    at = forced.first_difference(ev.control.codes, ev.candidate.codes)
    if at is None:
        return None
    # Where the null at N parts from itself, how many flips and how wide is its run-level tests' to
    # judge (a per-flip line under its widest would flag correct runs): a flip must only not be gross.
    fp = policy.forced
    if ev.batch_noise is not None and (ev.batch_noise["flips"] or not ev.batch_noise.get("exact", True)):
        fp = replace(fp, near_tie_max_gap=fp.near_tie_gross_gap)
    elif (ev.numerics or {}).get("exact"):  # qwen-tts's own numerics: a near-tie is a float32 tie (issue 57)
        fp = replace(fp, near_tie_max_gap=fp.exact_tie_gap)
    ok, detail = forced.near_tie(a, b, at, fp)
    if ok:
        later = forced.implausible(b, policy.forced, measured_lines(ev, policy.forced))
        if later is not None:
            ok, detail["why"] = False, f"the stream at N is implausible after it: {later.reason}"
    else:
        detail.setdefault("why", f"ranks {detail.get('ranks')} and gaps {detail.get('gaps')} nats under qwen-tts "
                                 f"(policy: top-{fp.near_tie_top_k}, gap <= {fp.near_tie_max_gap})")
    if ok:
        ok = _own_near_tie(ev, fp, at, detail)
    if ok and (why := measured_null.unexplained(ev.batch_noise)) is not None:
        ok, detail["why"] = False, why  # a near-tie by the line, but batching never flips in these numerics
    if ev.batch_noise is not None:
        detail["null_n"] = {k: ev.batch_noise.get(k, True) for k in ("dtype", "exact", "segments", "flips", "max_gap")}
    comps["near_tie"] = {**detail, "near_tie": ok}
    if not ok:
        return None
    return (f"codebook {at[1]}: ranks {detail['ranks'][0]} and {detail['ranks'][1]}, "
            f"{max(detail['gaps']):.2g} nats from the top-1")


def _own_near_tie(ev: Evidence, p: ForcedPolicy, at: tuple[int, int], detail: dict) -> bool:
    """The flip under the candidate's own logits, where both runs captured them (codebook 0 only):
    a near-tie for qwen-tts must be one for the candidate too. Recorded in detail["candidate_own"]."""
    own_1, own_n = captured(ev.control).own_topk, captured(ev.candidate).own_topk
    if own_1 is None or own_n is None:
        detail["candidate_own"] = "not captured"
        return True
    f, c = at
    if c != 0:
        detail["candidate_own"] = f"codebook {c}: the candidate's own margins are captured for codebook 0 only"
        return True
    for name, own, res in (("at 1", own_1, ev.control), ("at N", own_n, ev.candidate)):
        why = own_margins.consistency(own, res.codes, greedy=True)
        if why is not None:
            detail["candidate_own"] = f"unusable {name}: {why}"
            return True
    if f >= min(len(own_1.ids), len(own_n.ids)):
        detail["candidate_own"] = "a run ends there"
        return True
    ok, own = own_margins.near_tie(own_1, own_n, f, p.near_tie_top_k, p.near_tie_max_gap)
    detail["candidate_own"] = own
    if not ok:
        detail["why"] = (f"a near-tie under qwen-tts, not under the candidate's own logits (ranks and gaps "
                         f"{_own_brief(own)}; policy: top-{p.near_tie_top_k}, gap <= {p.near_tie_max_gap})")
    return ok


def _own_brief(own: dict) -> str:
    def one(t: dict) -> str:
        rank = ">k" if t["rank"] is None else t["rank"]
        return f"{t['token']} rank {rank}" + ("" if t["gap"] is None else f" gap {t['gap']:.3g}")
    return "; ".join(f"{run}: " + ", ".join(one(t) for t in toks.values()) for run, toks in own.items())


CONCURRENCY = Check("concurrency", gives=("code_divergence", "concurrency_defect"),
                    judge=lambda ev, ctx: concurrency_findings(ev, ctx.policy, ctx.comps, ctx.mels),
                    applies=lambda ev: ev.control is not None,
                    skipped=lambda ev: "no concurrency-1 control: concurrency invariance not checked")
