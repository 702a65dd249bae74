"""The hand-off between talker and vocoder: the reference codes and frames the vocoder got
against what the talker was prompted with and generated (capture schema v2), another
request's codes or length among them (the donor), and the prompt the engine reserved."""

from __future__ import annotations

import numpy as np

from ..engines.captured import TalkerStage
from .check import Check, Context
from .evidence import Evidence, Finding, chunk_of, ranges, same, talker_stage


def _resized(own: np.ndarray, n: int) -> np.ndarray:
    """`own` cut to its first n frames, or extended by repeating it from its start: what the no-async
    hand-off makes of a reference re-emitted at every step (so concatenated with itself) and trimmed
    to another request's `ref_code_len` (docs/handoff-probe.md, finding 3)."""
    return own[np.arange(n) % len(own)]


def _prefix_of(used: np.ndarray, rc: np.ndarray) -> bool:
    """`used` is `rc`, cut or extended by repeating it to `used`'s length: the no-async hand-off
    concatenates a reference the talker re-emits each step and trims it to the request's own
    ref_code_len, so another's reference arrives cut (a longer one) or repeated (a shorter one)."""
    return bool(len(rc)) and len(used) > 0 and same(used, _resized(rc, len(used)))


MIN_LEAD_FRAMES = 4  # a whole reference shorter than this could match a silent onset by chance


def _leads_with(used: np.ndarray, rc: np.ndarray) -> bool:
    """`used` begins with the whole of `rc` and goes on: the seed's leak hands a shorter reference at
    a longer request's length, its tail the batched encoder's padding frames (measured on vLLM-Omni
    0.30.0 with the #4373 revert, c=16: 39 frames of the donor's, then 3 that are no request's)."""
    return MIN_LEAD_FRAMES <= len(rc) < len(used) and same(used[:len(rc)], rc)


def _is_from(used: np.ndarray, rc: np.ndarray) -> bool:
    return _prefix_of(used, rc) or _leads_with(used, rc)


def code_donors(used: np.ndarray, ev: Evidence, own: np.ndarray) -> tuple[list[str], bool]:
    """Segments whose own reference codes `used` is (co-batched ones first); whether co-batched.
    None where `used` is the segment's own reference, whole, cut or continued: a segment of the same
    voice has the same codes, and naming it would blame it for a cut (the length check's business)."""
    if _is_from(used, own):
        return [], False
    batch = [p for p, rc in sorted(ev.peer_ref_codes.items()) if _is_from(used, rc)]
    if batch:
        return batch, True
    return [p for p, rc in sorted(ev.history_ref_codes.items()) if p != ev.segment_id and _is_from(used, rc)], False


def handoff_findings(ev: Evidence, comps: dict, notes: list, voc: list) -> list[Finding]:
    """Reference codes handed to the vocoder that belong to another request, or are the segment's
    own at another request's length, or are not what the talker was prompted with. `voc`: the
    vocoder findings, for where the audio shows it."""
    cand = ev.candidate
    talker = talker_stage(cand)
    if talker is not None:
        own, own_from = talker.ref_codes, "talker"
    else:
        own_src = ev.control if ev.control is not None and ev.control.has_codes else ev.reference
        own, own_from = own_src.ref_codes, ("control" if own_src is ev.control else "reference")
    if same(cand.ref_codes, own):
        return []
    donors, co_batched = code_donors(cand.ref_codes, ev, own)
    n, m = len(cand.ref_codes), len(own)
    resized = bool(n and m and n != m and same(cand.ref_codes, _resized(own, n)))
    by_length = [p for p, rc in sorted(ev.peer_ref_codes.items()) if len(rc) == n] if resized else []
    comps["ref_codes"] = {"own_frames": m, "candidate_frames": n,
                          "matches_peer": donors[0] if donors else None,
                          "peer_co_batched": co_batched if donors else None,
                          "own_from": own_from,
                          "own_resized": ("cut" if n < m else "extended") if resized else None,
                          "peers_of_that_length": by_length}
    frame, chunk, audio = 0, 0, ""
    if voc and voc[0].kind in ("vocoder_defect", "contamination") and "donor_search" in comps:
        frame, chunk = voc[0].frame, voc[0].chunk
        audio = (f"; its audio leaves the decode with its own reference in chunks "
                 f"{ranges(comps['donor_search']['chunks'])}")
    if donors:
        alike = f" (as are {', '.join(donors[1:])}'s: the same voice)" if len(donors) > 1 else ""
        whose = donors[0] if co_batched else f"{donors[0]} (served earlier, not in its batch)"
        donor_codes = (ev.peer_ref_codes | ev.history_ref_codes)[donors[0]]
        theirs, repeated = len(donor_codes), _prefix_of(cand.ref_codes, donor_codes)
        cut = (f", cut to {n}" if n < theirs else "" if n == theirs else
               f", {theirs} repeated to {n}" if repeated else f", all {theirs} of theirs, then {n - theirs} that are no one's")
        return [Finding("contamination",
                         f"the candidate used {whose}'s reference codes ({n} frames{cut}) "
                         f"instead of its own ({m} frames){alike}{audio}",
                         frame=frame, chunk=chunk, stage="handoff", donor=donors[0], donor_kind="codes")]
    if resized:
        verb, how = (("cut", f"instead of {m}: its last {m - n} dropped") if n < m else
                     ("extended", f"instead of {m}: {n - m} more repeating it from its start"))
        if len(by_length) == 1:
            donor = by_length[0]
            return [Finding("contamination",
                             f"{ev.segment_id}'s vocoder got its own reference codes {verb} to {donor}'s length "
                             f"({n} frames {how}), as if handed {donor}'s ref_code_len (the #4421 family){audio}",
                             frame=frame, chunk=chunk, stage="handoff", donor=donor, donor_kind="length")]
        if by_length:  # the #4421 family still, its donor one of several of that length
            peers = f"{', '.join(by_length[:-1])} or {by_length[-1]}"
            return [Finding("handoff_defect",
                             f"{ev.segment_id}'s vocoder got its own reference codes {verb} to {n} frames ({how}), "
                             f"as if handed the ref_code_len of {peers}, whose reference codes all have that length "
                             f"(the #4421 family; no single donor){audio}",
                             frame=frame, chunk=chunk, stage="handoff")]
        notes.append(f"the vocoder got its own reference codes {verb} to {n} frames ({how}), a length no "
                     f"co-batched request's reference codes have")
    if own_from == "talker":
        if n < m and len(cand.codes) >= m - n and same(np.concatenate([cand.ref_codes, cand.codes[:m - n]]), own):
            # the reference (or its rest) arrived as generated frames: no trim, so its audio stays in
            # the output (#4421)
            return [Finding("handoff_defect",
                             f"the vocoder got {m - n} of the talker's {m} reference frames as generated frames, "
                             f"not as the reference prefix: nothing trims them, the reference audio stays at the "
                             f"start of the output{audio}", frame=0, chunk=0, stage="handoff")]
        what = ("none of the talker's reference codes" if n == 0 else
                f"{n} reference frames that are not the {m} the talker was prompted with"
                + (f" (first differing frame {_first_diff(cand.ref_codes, own)})" if n and m else ""))
        return [Finding("handoff_defect", f"the vocoder got {what}{audio}",
                         frame=frame, chunk=chunk, stage="handoff")]
    if own_from == "control":
        return [Finding("concurrency_defect",
                         f"reference codes at concurrency N differ from those at 1 "
                         f"({n} against {m} frames) and match no co-batched request",
                         frame=0, chunk=0, stage="handoff")]
    return []  # against the reference engine's encoder, a difference is the headline's business


def _first_diff(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    bad = np.flatnonzero((a[:n] != b[:n]).any(axis=1))
    return int(bad[0]) if len(bad) else n


def resume_frames(made: np.ndarray, got: np.ndarray, preempted_at: list[int]) -> tuple[list[int], list[int]] | None:
    """(frames lost, frames altered) where every difference between the talker's tokens and the
    vocoder's codes is the frame of the last token generated before a preemption (k tokens: frame
    k - 1), missing or not the talker's; None when anything else differs."""
    at = sorted({int(k) - 1 for k in preempted_at if 0 < int(k) <= len(made)})[:8]
    for mask in range(1 << len(at)):
        lost = [f for i, f in enumerate(at) if mask >> i & 1]
        kept = np.delete(np.arange(len(made)), lost)
        if len(kept) != len(got):
            continue
        altered = [int(kept[i]) for i in np.flatnonzero(made[kept] != got)]
        if set(altered) <= set(at) - set(lost) and (lost or altered):
            return lost, altered
    return None


def resume_summary(lost: list[int], altered: list[int], preempted_at: list[int], talker_frames: int) -> str:
    at = ", ".join(str(k) for k in preempted_at)
    what = "; ".join(x for x in (
        f"frame {', '.join(map(str, lost))} of {talker_frames} never reached the vocoder" if lost else "",
        f"frame {', '.join(map(str, altered))} reached it with codes the talker did not make" if altered else "") if x)
    return (f"the talker was preempted after {at} generated tokens and resumed; at the frame of the last token before "
            f"the preemption, {what}: the resume recomputes that token as part of a replay, not as a decode step "
            f"whose code predictor makes its codebooks 1-15 (the scheduler's record, capture `talker_preemptions`)")


def resume_history(tokens: np.ndarray, control: TalkerStage | None, preempted_at: list[int]) -> str:
    """Where a preempted request's talker tokens leave its own at concurrency 1 (greedy, served
    alone, never preempted): "" unless every token before the first preemption is the same and they
    part at or after it, the first token sampled from the resumed KV."""
    if control is None or not preempted_at:
        return ""
    k, own = min(int(x) for x in preempted_at), control.tokens
    n = min(len(own), len(tokens))
    diff = np.flatnonzero(own[:n] != tokens[:n])
    if not len(diff) or diff[0] < k:
        return ""
    return (f"; from token {int(diff[0])}, the first it sampled after resuming, its tokens leave its own at concurrency "
            f"1 ({len(diff)} of the {n - k} after the preemption differ, none before): the KV it resumed from is not "
            f"the one it built before the preemption")


BORROWED_RUN = 3  # frames in a row of a peer's generated codes, past where the hand-off parts, to name it


def _contains(seq: np.ndarray, run: np.ndarray) -> bool:
    n = len(run)
    return any(np.array_equal(seq[k:k + n], run) for k in range(len(seq) - n + 1))


def borrowed_run(got: np.ndarray, f: int, peers: dict, own=()) -> tuple[str, int, int, int] | None:
    """(peer, where in the handed frames, its frame, how many): the longest run of the handed codebook 0,
    from frame `f` on, that is a run of a co-batched peer's own generated frames. A wave's requests enter
    the talker steps apart and the batch changes as they finish, so another's frames arrive at another
    offset, and from more than one peer; the longest run names the donor. At least BORROWED_RUN in a row,
    and never a run the request's own sequences (`own`: its talker's frames, its reference codes, each
    codebook 0) hold as well: requests of one voice begin alike, and a reference left in the output is
    the request's own."""
    best = None
    for peer, tokens in sorted(peers.items()):
        theirs = np.asarray(tokens)[:-1]
        where: dict[int, list[int]] = {}
        for j, t in enumerate(theirs.tolist()):
            where.setdefault(t, []).append(j)
        for i in range(f, len(got)):
            for j in where.get(int(got[i]), ()):
                if i > f and j > 0 and got[i - 1] == theirs[j - 1]:
                    continue  # inside a run already counted from its start
                n = 0
                while i + n < len(got) and j + n < len(theirs) and got[i + n] == theirs[j + n]:
                    n += 1
                if n >= BORROWED_RUN and (best is None or n > best[3]) \
                        and not any(_contains(np.asarray(o), got[i:i + n]) for o in own):
                    best = (peer, i, j, n)
    return best


def stage_findings(ev: Evidence, comps: dict) -> list[Finding]:
    """The talker's side of the capture against what the hand-off delivered (frames) and against
    what the engine reserved (prompt). Nothing without capture schema v2."""
    cand = ev.candidate
    talker = talker_stage(cand)
    if talker is None:
        return []
    out, resumed = [], False
    tokens = talker.tokens
    made = tokens[:-1] if len(tokens) else tokens  # the last sampled token (EOS, or the cap's) never becomes a frame
    got = cand.codes[:, 0]
    comps["talker_stage"] = {"talker_frames": len(made), "handed_frames": len(got),
                             "prompt_reserved": talker.reserved, "prompt_built": talker.built,
                             "ref_code_len": talker.ref_code_len, "talker_ref_frames": len(talker.ref_codes)}
    if len(made) != len(got) or not np.array_equal(made, got):
        n = min(len(made), len(got))
        diff = np.flatnonzero(made[:n] != got[:n])
        f = int(diff[0]) if len(diff) else n
        donors = [p for p, t in sorted(ev.peer_tokens.items())
                  if len(t) and len(t) - 1 == len(got) and np.array_equal(t[:-1], got)]
        chunk = chunk_of(f, max(len(made), len(got)), ev)
        own = (made, talker.ref_codes[:, 0], cand.ref_codes[:, 0])
        borrowed = None if donors else borrowed_run(got, f, ev.peer_tokens, own)
        if donors:
            out.append(Finding("contamination",
                                f"the vocoder got {donors[0]}'s generated codes ({len(got)} frames) instead of "
                                f"the {len(made)} this request's talker generated",
                                frame=0, chunk=0, stage="handoff", donor=donors[0], donor_kind="generated"))
        elif borrowed is not None:
            donor, i, j, n = borrowed
            out.append(Finding("contamination",
                                f"the vocoder got other frames than this request's talker made from frame {f}, among "
                                f"them {donor}'s generated codes: frames {i}-{i + n - 1} are its frames "
                                f"{j}-{j + n - 1}", frame=f, chunk=chunk, stage="handoff", donor=donor,
                                donor_kind="generated"))
        elif (resume := resume_frames(made, got, cand.meta.get("preempted_at") or [])):
            resumed, first = True, min(resume[0] + resume[1])
            out.append(Finding("talker_defect", resume_summary(*resume, cand.meta["preempted_at"], len(made))
                                + resume_history(tokens, talker_stage(ev.control), cand.meta["preempted_at"]),
                                frame=first, chunk=chunk_of(first, len(made), ev), stage="talker"))
        else:
            what = (f"{len(got)} frames where the talker generated {len(made)}" if len(got) != len(made)
                    else f"{len(got)} frames as the talker generated, but not the same ones")
            out.append(Finding("handoff_defect",
                                f"the vocoder got {what}: they part at frame {f} "
                                f"(codebook-0 {int(got[f]) if f < len(got) else '-'} against "
                                f"{int(made[f]) if f < len(made) else '-'})",
                                frame=f, chunk=chunk, stage="handoff"))
    if not resumed and (history := resume_history(tokens, talker_stage(ev.control), cand.meta.get("preempted_at") or [])):
        k = min(int(x) for x in cand.meta["preempted_at"])
        out.append(Finding("talker_defect", f"the talker was preempted after {k} generated tokens and resumed"
                            + history, frame=k, chunk=chunk_of(k, len(made), ev), stage="talker"))
    if talker.reserved and talker.reserved != talker.built:
        r, b = talker.reserved, talker.built
        how = (f"{r - b} positions filled with padding" if r > b else f"{b - r} prompt rows cut off")
        out.append(Finding("talker_defect",
                            f"the engine reserved {r} prompt positions for a prompt of {b} rows: {how} "
                            f"(the talker is conditioned on another prompt than the request's)",
                            frame=0, chunk=0, stage="talker"))
    ctrl = talker_stage(ev.control)
    if ctrl is not None and not same(ctrl.ref_codes, talker.ref_codes):
        donors, _ = code_donors(talker.ref_codes, ev, ctrl.ref_codes)
        if donors:
            out.append(Finding("contamination",
                                f"the talker was prompted with {donors[0]}'s reference codes at concurrency N "
                                f"(its own at 1)", frame=0, chunk=0, stage="reference_encoder",
                                donor=donors[0], donor_kind="codes"))
        else:
            out.append(Finding("concurrency_defect",
                                f"the talker's reference codes at concurrency N ({len(talker['ref_codes'])} frames) "
                                f"differ from those at 1 ({len(ctrl['ref_codes'])} frames)",
                                frame=0, chunk=0, stage="reference_encoder"))
    return out


def _handoff(ev: Evidence, ctx: Context) -> list[Finding]:
    out = handoff_findings(ev, ctx.comps, ctx.notes, ctx.of("vocoder"))
    if talker_stage(ev.candidate) is None:
        ctx.notes.append("no talker stage in the capture: the hand-off judged against the reference codes "
                         "found at the vocoder")
    return out


def _has_codes(ev: Evidence) -> bool:
    return ev.candidate.has_codes


HANDOFF = Check("handoff", gives=("handoff_defect", "concurrency_defect", "contamination"), judge=_handoff,
                applies=_has_codes)
STAGES = Check("stages", gives=("contamination", "talker_defect", "handoff_defect", "concurrency_defect"),
               judge=lambda ev, ctx: stage_findings(ev, ctx.comps), applies=_has_codes)
