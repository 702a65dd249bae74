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
segment's `notes` say which comparisons were not possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..compare import align, forced, own_margins
from ..compare.audio import ChunkMetrics, frame_metrics, log_mel, non_finite, reduce_frames
from ..compare.codes import diff_codes
from ..results import Result
from . import null as measured_null
from .policy import TIERS, Policy, chunk_tiers
from .talker_input import DONOR_KIND, bf16_allowance, compare as compare_inputs, donor_of, inputs_of

# Most serious first; the verdict is the finding of lowest rank.
RANK = ("error", "contamination", "handoff_defect", "talker_defect", "reference_encoder_defect", "vocoder_length",
        "vocoder_defect",
        "concurrency_defect", "history_defect",
        "length_mismatch", "code_divergence", "audio_divergence", "numeric_drift", "identical")
STAGES = ("talker_input", "talker", "reference_encoder", "handoff", "vocoder")


@dataclass
class Evidence:
    """Everything known about one segment."""

    segment_id: str
    reference: Result | None = None
    candidate: Result | None = None  # at concurrency N
    control: Result | None = None  # candidate at concurrency 1
    cross_own: Result | None = None  # reference vocoder(candidate codes, own ref codes)
    cross_donors: dict = field(default_factory=dict)  # peer id -> reference vocoder(candidate codes, peer ref codes)
    peer_ref_codes: dict = field(default_factory=dict)  # co-batched segment id -> its own ref codes
    history_ref_codes: dict = field(default_factory=dict)  # any other segment the engine served -> its own ref codes
    peer_tokens: dict = field(default_factory=dict)  # co-batched segment id -> its talker's codebook-0 tokens
    errors: list = field(default_factory=list)  # {"source", "kind", "message"}
    initial_frames: int = 1
    chunk_frames: int = 25
    repeat: Result | None = None  # the candidate at 1 again, after every other segment (reverse order)
    scores: dict = field(default_factory=dict)  # "candidate" / "control" -> teacher-forced ScoreFile of its codes
    other_inputs: dict = field(default_factory=dict)  # every other segment of the run -> qwen-tts's talker input
    # what batching does to qwen-tts in the candidate's numerics (null.batch_noise); None: not measured
    batch_noise: dict | None = None


@dataclass
class SegmentVerdict:
    id: str
    verdict: str
    summary: str
    first_divergent_frame: int | None = None
    first_divergent_chunk: int | None = None
    stage: str | None = None
    donor: str | None = None
    error_kind: str | None = None
    comparisons: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    artifacts: dict = field(default_factory=dict)  # role -> result sidecar path
    donor_kind: str | None = None  # what the donor lent: "codes" (its reference codes), "length" (their
    # length) or "generated" (its generated codes)

    def to_json(self) -> dict:
        return {
            "id": self.id, "verdict": self.verdict, "summary": self.summary,
            "first_divergent_frame": self.first_divergent_frame,
            "first_divergent_chunk": self.first_divergent_chunk,
            "stage": self.stage, "donor": self.donor, "donor_kind": self.donor_kind, "error_kind": self.error_kind,
            "notes": self.notes, "comparisons": self.comparisons, "artifacts": self.artifacts,
        }


@dataclass
class _Finding:
    kind: str  # one of RANK
    summary: str
    frame: int | None = None
    chunk: int | None = None
    stage: str | None = None
    donor: str | None = None
    error_kind: str | None = None
    donor_kind: str | None = None


class _Audio:
    """One audio comparison: per-frame stats, per-chunk metrics and tiers."""

    def __init__(self, a: Result, b: Result, ev: Evidence, policy: Policy, mels: dict | None = None):
        mels = {} if mels is None else mels  # id(result) -> log-mel, shared across one segment's comparisons
        # Both sides from their frame 0: qwen-tts's cut can leave one sample in front (difftest.compare.align).
        self.fm = frame_metrics(a.grid_wav, b.grid_wav, a.sample_rate, with_mel=False)
        # The log-mel decides a chunk's tier only where its max |diff| is above close_max_abs (chunk_tiers):
        # where no frame's is (identical or quantisation-level audio, the common case) it is not computed,
        # and its chunk values read 0 with `logmel_computed: false`.
        self.logmel_computed = bool(len(self.fm.max_abs)) and float(self.fm.max_abs.max()) > policy.close_max_abs
        if self.logmel_computed:
            for r in (a, b):
                if id(r) not in mels:
                    mels[id(r)] = log_mel(r.grid_wav, r.sample_rate)
            self.fm = frame_metrics(a.grid_wav, b.grid_wav, a.sample_rate, mel_a=mels[id(a)], mel_b=mels[id(b)])
        n_frames = len(self.fm.max_abs)
        self.bounds = align.chunk_frame_bounds(n_frames, ev.initial_frames, ev.chunk_frames)
        self.chunks: ChunkMetrics = reduce_frames(self.fm, self.bounds)
        self.quantised = a.quantised or b.quantised
        self.tiers = chunk_tiers(self.chunks, policy, self.quantised)
        self.len_a, self.len_b = len(a.grid_wav), len(b.grid_wav)

    @property
    def worst(self) -> int:
        return int(self.tiers.max()) if len(self.tiers) else 0

    def bad_chunks(self, allowed_tier: int) -> np.ndarray:
        return np.flatnonzero(self.tiers > allowed_tier)

    def first_bad(self, allowed_tier: int, policy: Policy) -> tuple[int | None, int | None]:
        """(frame, chunk) where the comparison first leaves the allowed tier."""
        bad = self.bad_chunks(allowed_tier)
        if not len(bad):
            return None, None
        c = int(bad[0])
        s, e = self.bounds[c]
        thr = policy.quantisation_max_abs if allowed_tier < 2 else policy.close_max_abs
        inner = np.flatnonzero(self.fm.max_abs[s:e] > thr)
        return int(s + (inner[0] if len(inner) else 0)), c

    @property
    def length_gap(self) -> int:
        """Sample-count difference beyond the one trailing sample qwen-tts may add."""
        gap = abs(self.len_a - self.len_b)
        return 0 if gap <= align.TRAILING_SAMPLES else gap

    def to_json(self) -> dict:
        return {"tiers": [TIERS[t] for t in self.tiers], "worst_tier": TIERS[self.worst],
                "samples": [self.len_a, self.len_b], "quantised": self.quantised,
                "logmel_computed": self.logmel_computed, "chunks": self.chunks.as_lists()}


def _code_json(d) -> dict:
    return {"frames": [d.len_a, d.len_b], "first_divergent_frame": d.first_divergent_frame,
            "codes_at_divergence": [d.a_at_divergence, d.b_at_divergence],
            "frames_differing": d.frames_differing, "codebooks_differing": d.codebooks_differing,
            "chunk_agreement": d.chunk_agreement}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _chunk_of(frame, n_frames, ev) -> int | None:
    bounds = align.chunk_frame_bounds(max(n_frames, (frame or 0) + 1), ev.initial_frames, ev.chunk_frames)
    return align.chunk_of_frame(frame, bounds)


def _input_errors(ev: Evidence) -> _Finding | None:
    if ev.errors:
        e = ev.errors[0]
        more = f" (+{len(ev.errors) - 1} more)" if len(ev.errors) > 1 else ""
        return _Finding("error", f"{e['source']}: {e['message']}{more}", error_kind=e.get("kind", "infrastructure"))
    for name in ("reference", "candidate"):
        if getattr(ev, name) is None:
            return _Finding("error", f"no {name} result", error_kind="infrastructure")
    for name in ("reference", "candidate", "control", "cross_own"):
        r = getattr(ev, name)
        if r is None:
            continue
        kind = "candidate" if name in ("candidate", "control") else "infrastructure"
        if r.sample_rate != 24000:
            return _Finding("error", f"{name} audio is at {r.sample_rate} Hz, not 24000", error_kind=kind)
        i = non_finite(r.wav)
        if i is not None:
            return _Finding("error", f"{name} audio holds NaN or infinity at sample {i} (frame {i // 1920})",
                            frame=i // 1920, error_kind=kind)
        if len(r.wav) == 0 and (len(r.codes) or not r.has_codes):
            return _Finding("error", f"{name} audio is empty", error_kind=kind)
    return None


def _vocoder_findings(ev: Evidence, policy: Policy, comps: dict, mels: dict) -> list[_Finding]:
    cand, cross = ev.candidate, ev.cross_own
    audio = _Audio(cross, cand, ev, policy, mels)
    comps["vocoder"] = audio.to_json()
    allowed = policy.tier_index("vocoder")
    frame, chunk = audio.first_bad(allowed, policy)
    if audio.length_gap:
        frames = audio.length_gap / 1920
        extra = (f"; the extra {frames:.0f} frames equal the reference codes' length: reference audio left in the output?"
                 if len(cand.ref_codes) and round(frames) == len(cand.ref_codes) and cand.codes.size else "")
        if frame is None:  # the common part agrees: the difference starts where one side ends
            frame = min(audio.len_a, audio.len_b) // 1920
        return [_Finding("vocoder_length",
                         f"candidate audio has {audio.len_b} samples, its codes decode to {audio.len_a}{extra}",
                         frame=frame, chunk=chunk, stage="vocoder")]
    if chunk is None:
        return []
    bad = audio.bad_chunks(allowed)
    own = float(audio.chunks.logmel[bad].mean())
    scores = {}
    for peer, x in sorted(ev.cross_donors.items()):
        if len(x.grid_wav) != len(cross.grid_wav):
            continue
        alt = _Audio(x, cand, ev, policy, mels)
        scores[peer] = float(alt.chunks.logmel[bad].mean())
    comps["donor_search"] = {"own_logmel": own, "peers_logmel": scores, "chunks": bad.tolist()}
    if scores:
        donor = min(scores, key=scores.get)
        if scores[donor] <= policy.donor_max_ratio * own:
            ties = [p for p in scores if p != donor and scores[p] == scores[donor]]
            same = f" (as well with {', '.join(ties)}'s: the same voice)" if ties else ""
            return [_Finding("contamination",
                             f"chunks {_ranges(bad)} decode as if with {donor}'s reference codes "
                             f"(log-mel distance {scores[donor]:.3g} against {own:.3g} with its own){same}",
                             frame=frame, chunk=chunk, stage="handoff", donor=donor, donor_kind="codes")]
    return [_Finding("vocoder_defect",
                     f"candidate audio leaves the reference vocoder's output on its own codes from chunk {chunk} "
                     f"(chunks {_ranges(bad)}, worst log-mel distance {audio.chunks.logmel[bad].max():.3g})",
                     frame=frame, chunk=chunk, stage="vocoder")]


def _resized(own: np.ndarray, n: int) -> np.ndarray:
    """`own` cut to its first n frames, or extended by repeating it from its start: what the no-async
    hand-off makes of a reference re-emitted at every step (so concatenated with itself) and trimmed
    to another request's `ref_code_len` (docs/handoff-probe.md, finding 3)."""
    return own[np.arange(n) % len(own)]


def talker_stage(r: Result | None) -> dict | None:
    """The talker side of a candidate's capture (capture schema v2), or None where not captured."""
    if r is None or "talker_tokens" not in r.extra:
        return None
    prompt = [int(x) for x in np.asarray(r.extra["talker_prompt"]).reshape(-1)]
    return {"ref_codes": np.asarray(r.extra["talker_ref_codes"], np.int64).reshape(-1, 16),
            "tokens": np.asarray(r.extra["talker_tokens"], np.int64).reshape(-1),
            "reserved": prompt[0], "built": prompt[1], "ref_code_len": prompt[2]}


def _prefix_of(used: np.ndarray, rc: np.ndarray) -> bool:
    """`used` is `rc`, cut or extended by repeating it to `used`'s length: the no-async hand-off
    concatenates a reference the talker re-emits each step and trims it to the request's own
    ref_code_len, so another's reference arrives cut (a longer one) or repeated (a shorter one)."""
    return bool(len(rc)) and len(used) > 0 and _same(used, _resized(rc, len(used)))


MIN_LEAD_FRAMES = 4  # a whole reference shorter than this could match a silent onset by chance


def _leads_with(used: np.ndarray, rc: np.ndarray) -> bool:
    """`used` begins with the whole of `rc` and goes on: the seed's leak hands a shorter reference at
    a longer request's length, its tail the batched encoder's padding frames (measured on vLLM-Omni
    0.30.0 with the #4373 revert, c=16: 39 frames of the donor's, then 3 that are no request's)."""
    return MIN_LEAD_FRAMES <= len(rc) < len(used) and _same(used[:len(rc)], rc)


def _is_from(used: np.ndarray, rc: np.ndarray) -> bool:
    return _prefix_of(used, rc) or _leads_with(used, rc)


def _code_donors(used: np.ndarray, ev: Evidence, own: np.ndarray) -> tuple[list[str], bool]:
    """Segments whose own reference codes `used` is (co-batched ones first); whether co-batched.
    None where `used` is the segment's own reference, whole, cut or continued: a segment of the same
    voice has the same codes, and naming it would blame it for a cut (the length check's business)."""
    if _is_from(used, own):
        return [], False
    batch = [p for p, rc in sorted(ev.peer_ref_codes.items()) if _is_from(used, rc)]
    if batch:
        return batch, True
    return [p for p, rc in sorted(ev.history_ref_codes.items()) if p != ev.segment_id and _is_from(used, rc)], False


def _handoff_findings(ev: Evidence, comps: dict, notes: list, voc: list) -> list[_Finding]:
    """Reference codes handed to the vocoder that belong to another request, or are the segment's
    own at another request's length, or are not what the talker was prompted with. `voc`: the
    vocoder findings, for where the audio shows it."""
    cand = ev.candidate
    talker = talker_stage(cand)
    if talker is not None:
        own, own_from = talker["ref_codes"], "talker"
    else:
        own_src = ev.control if ev.control is not None and ev.control.has_codes else ev.reference
        own, own_from = own_src.ref_codes, ("control" if own_src is ev.control else "reference")
    if _same(cand.ref_codes, own):
        return []
    donors, co_batched = _code_donors(cand.ref_codes, ev, own)
    n, m = len(cand.ref_codes), len(own)
    resized = bool(n and m and n != m and _same(cand.ref_codes, _resized(own, n)))
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
                 f"{_ranges(comps['donor_search']['chunks'])}")
    if donors:
        same = f" (as are {', '.join(donors[1:])}'s: the same voice)" if len(donors) > 1 else ""
        whose = donors[0] if co_batched else f"{donors[0]} (served earlier, not in its batch)"
        donor_codes = (ev.peer_ref_codes | ev.history_ref_codes)[donors[0]]
        theirs, repeated = len(donor_codes), _prefix_of(cand.ref_codes, donor_codes)
        cut = (f", cut to {n}" if n < theirs else "" if n == theirs else
               f", {theirs} repeated to {n}" if repeated else f", all {theirs} of theirs, then {n - theirs} that are no one's")
        return [_Finding("contamination",
                         f"the candidate used {whose}'s reference codes ({n} frames{cut}) "
                         f"instead of its own ({m} frames){same}{audio}",
                         frame=frame, chunk=chunk, stage="handoff", donor=donors[0], donor_kind="codes")]
    if resized:
        verb, how = (("cut", f"instead of {m}: its last {m - n} dropped") if n < m else
                     ("extended", f"instead of {m}: {n - m} more repeating it from its start"))
        if len(by_length) == 1:
            donor = by_length[0]
            return [_Finding("contamination",
                             f"{ev.segment_id}'s vocoder got its own reference codes {verb} to {donor}'s length "
                             f"({n} frames {how}), as if handed {donor}'s ref_code_len (the #4421 family){audio}",
                             frame=frame, chunk=chunk, stage="handoff", donor=donor, donor_kind="length")]
        who = (f"the length of {', '.join(by_length[:-1])} and {by_length[-1]}'s reference codes alike: "
               "no single donor" if by_length
               else "a length no co-batched request's reference codes have")
        notes.append(f"the vocoder got its own reference codes {verb} to {n} frames ({how}), {who}")
    if own_from == "talker":
        if n < m and len(cand.codes) >= m - n and _same(np.concatenate([cand.ref_codes, cand.codes[:m - n]]), own):
            # the reference (or its rest) arrived as generated frames: no trim, so its audio stays in
            # the output (#4421)
            return [_Finding("handoff_defect",
                             f"the vocoder got {m - n} of the talker's {m} reference frames as generated frames, "
                             f"not as the reference prefix: nothing trims them, the reference audio stays at the "
                             f"start of the output{audio}", frame=0, chunk=0, stage="handoff")]
        what = ("none of the talker's reference codes" if n == 0 else
                f"{n} reference frames that are not the {m} the talker was prompted with"
                + (f" (first differing frame {_first_diff(cand.ref_codes, own)})" if n and m else ""))
        return [_Finding("handoff_defect", f"the vocoder got {what}{audio}",
                         frame=frame, chunk=chunk, stage="handoff")]
    if own_from == "control":
        return [_Finding("concurrency_defect",
                         f"reference codes at concurrency N differ from those at 1 "
                         f"({n} against {m} frames) and match no co-batched request",
                         frame=0, chunk=0, stage="handoff")]
    return []  # against the reference engine's encoder, a difference is the headline's business


def _first_diff(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    bad = np.flatnonzero((a[:n] != b[:n]).any(axis=1))
    return int(bad[0]) if len(bad) else n


def _stage_findings(ev: Evidence, comps: dict) -> list[_Finding]:
    """The talker's side of the capture against what the hand-off delivered (frames) and against
    what the engine reserved (prompt). Nothing without capture schema v2."""
    cand = ev.candidate
    talker = talker_stage(cand)
    if talker is None:
        return []
    out = []
    tokens = talker["tokens"]
    made = tokens[:-1] if len(tokens) else tokens  # the last sampled token (EOS, or the cap's) never becomes a frame
    got = cand.codes[:, 0]
    comps["talker_stage"] = {"talker_frames": len(made), "handed_frames": len(got),
                             "prompt_reserved": talker["reserved"], "prompt_built": talker["built"],
                             "ref_code_len": talker["ref_code_len"], "talker_ref_frames": len(talker["ref_codes"])}
    if len(made) != len(got) or not np.array_equal(made, got):
        n = min(len(made), len(got))
        diff = np.flatnonzero(made[:n] != got[:n])
        f = int(diff[0]) if len(diff) else n
        donors = [p for p, t in sorted(ev.peer_tokens.items())
                  if len(t) and len(t) - 1 == len(got) and np.array_equal(t[:-1], got)]
        chunk = _chunk_of(f, max(len(made), len(got)), ev)
        if donors:
            out.append(_Finding("contamination",
                                f"the vocoder got {donors[0]}'s generated codes ({len(got)} frames) instead of "
                                f"the {len(made)} this request's talker generated",
                                frame=0, chunk=0, stage="handoff", donor=donors[0], donor_kind="generated"))
        else:
            what = (f"{len(got)} frames where the talker generated {len(made)}" if len(got) != len(made)
                    else f"{len(got)} frames as the talker generated, but not the same ones")
            out.append(_Finding("handoff_defect",
                                f"the vocoder got {what}: they part at frame {f} "
                                f"(codebook-0 {int(got[f]) if f < len(got) else '-'} against "
                                f"{int(made[f]) if f < len(made) else '-'})",
                                frame=f, chunk=chunk, stage="handoff"))
    if talker["reserved"] and talker["reserved"] != talker["built"]:
        r, b = talker["reserved"], talker["built"]
        how = (f"{r - b} positions filled with padding" if r > b else f"{b - r} prompt rows cut off")
        out.append(_Finding("talker_defect",
                            f"the engine reserved {r} prompt positions for a prompt of {b} rows: {how} "
                            f"(the talker is conditioned on another prompt than the request's)",
                            frame=0, chunk=0, stage="talker"))
    ctrl = talker_stage(ev.control)
    if ctrl is not None and not _same(ctrl["ref_codes"], talker["ref_codes"]):
        donors, _ = _code_donors(talker["ref_codes"], ev, ctrl["ref_codes"])
        if donors:
            out.append(_Finding("contamination",
                                f"the talker was prompted with {donors[0]}'s reference codes at concurrency N "
                                f"(its own at 1)", frame=0, chunk=0, stage="reference_encoder",
                                donor=donors[0], donor_kind="codes"))
        else:
            out.append(_Finding("concurrency_defect",
                                f"the talker's reference codes at concurrency N ({len(talker['ref_codes'])} frames) "
                                f"differ from those at 1 ({len(ctrl['ref_codes'])} frames)",
                                frame=0, chunk=0, stage="reference_encoder"))
    return out


def _input_findings(ev: Evidence, comps: dict, notes: list, policy: Policy) -> list[_Finding]:
    """What the talker's prompt was made of against what qwen-tts made it of (verdicts/talker_input)."""
    theirs, mine = inputs_of(ev.reference), inputs_of(ev.candidate)
    if mine is None:
        notes.append("the talker's input was not captured: text, language, speaker and layout judged only "
                     "through the codes")
        return []
    if theirs is None:
        notes.append("no talker input from qwen-tts (a reference from before it was recorded): not compared")
        return []
    wrong, why = compare_inputs(mine, theirs)
    notes += why
    talker = talker_stage(ev.candidate)
    encoded = talker["ref_codes"] if talker is not None else ev.candidate.ref_codes  # the engine's encoder's
    # The prompt's reference codes being the engine's own encoder's, whether that encoder agrees with
    # qwen-tts's (within bf16's allowance) is the encoder check's to say (reference_encoder_defect).
    wrong = [m for m in wrong if not (m.field == "input_ref_codes" and _same(mine["input_ref_codes"], encoded))]
    comps["talker_input"] = {"differ": [m.field for m in wrong]}
    a, b = mine["input_speaker_embedding"], theirs["input_speaker_embedding"]
    if a.size and a.shape == b.shape:  # measured in every run: what a tolerance would rest on
        comps["talker_input"]["speaker_max_abs"] = float(np.abs(a - b).max())
    twin, allowed = theirs.get("speaker_embedding_bf16"), bf16_allowance(mine, theirs)
    if a.size and twin is not None and a.shape == twin.shape and allowed is not None:  # qwen-tts's own, in bf16
        comps["talker_input"] |= {"speaker_max_abs_bf16": float(np.abs(a - twin).max()), "speaker_allowed_bf16": allowed}
    if not wrong:
        return []
    at_one = inputs_of(ev.control)
    wrong_at_one = {m.field for m in compare_inputs(at_one, theirs)[0]} if at_one is not None else None
    m = wrong[0]
    right_at_one = wrong_at_one is not None and m.field not in wrong_at_one
    where = " at concurrency N (right at 1)" if right_at_one else " at concurrency 1 as well" if wrong_at_one else ""
    also = f"; also: {', '.join(x.name for x in wrong[1:])}" if len(wrong) > 1 else ""
    donor = donor_of(m, mine, ev.other_inputs, set(ev.peer_ref_codes), right_at_one)
    if donor:
        return [_Finding("contamination", f"the talker was prompted with {donor}'s {m.name}{where}{also}",
                         frame=0, chunk=0, stage="talker_input", donor=donor, donor_kind=DONOR_KIND[m.field])]
    theirs_ref = ev.reference.ref_codes
    if ([x.field for x in wrong] == ["input_speaker_embedding"] and len(theirs_ref)
            and _encoder_disagrees(theirs_ref, encoded, policy, ev.reference.extra.get("ref_codes_bf16"))):
        # both of the engine's encoders disagree with qwen-tts's on this voice, each beyond what the encoder
        # check allows (a bf16 encoder's codes always differ some from float32's): the audio that reached them
        return [_Finding("reference_encoder_defect",
                         f"the voice's speaker embedding and its reference codes both differ from what qwen-tts's "
                         f"encoders make of it: the reference audio reached the engine changed{where}",
                         frame=0, chunk=0, stage="reference_encoder")]
    return [_Finding("talker_defect", f"the talker's input differs from qwen-tts's in its {m.name}, at position {m.at}: "
                     f"{m.mine} against {m.theirs}{where}{also}", frame=0, chunk=0, stage="talker_input")]


def _concurrency_findings(ev: Evidence, policy: Policy, comps: dict, mels: dict, kind: str = "concurrency_defect",
                          later: str = "at concurrency N", first: str = "concurrency 1",
                          key: str = "concurrency") -> list[_Finding]:
    """The candidate (`later`) against the control (`first`): codes, then audio, chunk by chunk."""
    cand, ctrl = ev.candidate, ev.control
    out = []
    if cand.has_codes and ctrl.has_codes:
        d = diff_codes(ctrl.codes, cand.codes, ev.initial_frames, ev.chunk_frames)
        comps[f"{key}_codes"] = _code_json(d)
        if not d.equal:
            f = d.first_divergent_frame
            chunk = _chunk_of(f, max(d.len_a, d.len_b), ev)
            tie = _near_tie(ev, policy, comps) if key == "concurrency" else None
            # why the flip is no near-tie: only where this check asked (the repeat check never does, and
            # comps["near_tie"] may hold the concurrency check's answer, a near-tie without a "why")
            why = comps["near_tie"].get("why") if key == "concurrency" and "near_tie" in comps else None
            if tie:
                out.append(_Finding("code_divergence", f"codes {later} part from {first} at frame {f} on a near-tie "
                                                       f"under qwen-tts ({tie}), and stay plausible after it",
                                    frame=f, chunk=chunk, stage="talker"))
                return out
            out.append(_Finding(kind, f"codes {later} differ from {first} from frame {f} "
                                      f"({d.len_b} against {d.len_a} frames)"
                                + (f": not a near-tie ({why})" if why else ""),
                                frame=f, chunk=chunk, stage="talker"))
            return out
    audio = _Audio(ctrl, cand, ev, policy, mels)
    comps[key] = audio.to_json()
    if audio.length_gap:
        out.append(_Finding(kind, f"audio {later} has {audio.len_b} samples, {first} {audio.len_a}",
                            frame=min(audio.len_a, audio.len_b) // 1920, stage="vocoder"))
        return out
    frame, chunk = audio.first_bad(policy.tier_index("concurrency"), policy)
    if chunk is not None:
        stage = "vocoder" if cand.has_codes and ctrl.has_codes else None
        out.append(_Finding(kind, f"audio {later} leaves {first}'s from chunk {chunk} "
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
    ok, detail = forced.near_tie(a, b, at, policy.forced)
    if ok:
        later = forced.implausible(b, policy.forced)
        if later is not None:
            ok, detail["why"] = False, f"the stream at N is implausible after it: {later.reason}"
    else:
        detail.setdefault("why", f"ranks {detail.get('ranks')} and gaps {detail.get('gaps')} nats under qwen-tts "
                                 f"(policy: top-{policy.forced.near_tie_top_k}, gap <= {policy.forced.near_tie_max_gap})")
    if ok:
        ok = _own_near_tie(ev, policy, at, detail)
    if ok and (why := measured_null.unexplained(ev.batch_noise, max(detail["gaps"]))) is not None:
        ok, detail["why"] = False, why  # a near-tie by the line, but not what batching does in these numerics
    if ev.batch_noise is not None:
        detail["null_n"] = {k: ev.batch_noise[k] for k in ("dtype", "segments", "flips", "max_gap")}
    comps["near_tie"] = {**detail, "near_tie": ok}
    if not ok:
        return None
    return (f"codebook {at[1]}: ranks {detail['ranks'][0]} and {detail['ranks'][1]}, "
            f"{max(detail['gaps']):.2g} nats from the top-1")


def _own_near_tie(ev: Evidence, policy: Policy, at: tuple[int, int], detail: dict) -> bool:
    """The flip under the candidate's own logits, where both runs captured them (codebook 0 only):
    a near-tie for qwen-tts must be one for the candidate too. Recorded in detail["candidate_own"]."""
    own_1, own_n = own_margins.of(ev.control.extra), own_margins.of(ev.candidate.extra)
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
    p = policy.forced
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


def _forced_findings(ev: Evidence, policy: Policy, comps: dict) -> list[_Finding]:
    """The candidate's codes under teacher forcing: a stream qwen-tts could not have decoded as asked
    (conditioned on the candidate's own reference codes) is the talker's defect, at any concurrency."""
    sf = ev.scores.get("candidate")
    if sf is None:
        return []
    comps["forced"] = forced.summary(sf)
    bad = forced.implausible(sf, policy.forced)
    at = forced.first_difference(ev.reference.codes, ev.candidate.codes) if ev.reference is not None else None
    comps["forced"]["trace"] = forced.trace(sf, bad.frame if bad is not None else at[0] if at else None)
    own = own_margins.of(ev.candidate.extra)
    if own is not None:  # how closely the candidate's own talker agrees with qwen-tts's, token by token
        greedy = not sf.settings.get("do_sample")
        why = own_margins.consistency(own, ev.candidate.codes, greedy=greedy)
        # sampled: qwen-tts's forced log-probabilities include the temperature, the capture's do not
        comps["forced"]["own_logprob_gap"] = (
            None if why or not greedy else own_margins.logprob_agreement(own, sf.arrays["logprob"][:, 0]))
        if why:
            comps["forced"]["own_unusable"] = why
        else:  # the candidate's own top-1/top-2 margin per frame, beside qwen-tts's trace (MLflow step = frame)
            t = comps["forced"]["trace"]
            comps["forced"]["trace"]["own_margin_codebook0"] = own_margins.margins(own, t["start"], t["end"])
    if bad is None:
        return []
    return [_Finding("talker_defect", f"teacher-forced under qwen-tts, the candidate's codes are not what its talker "
                                      f"should decode: {bad.reason}",
                     frame=bad.frame, chunk=_chunk_of(bad.frame, len(ev.candidate.codes), ev), stage="talker")]


def _history_findings(ev: Evidence, policy: Policy, comps: dict) -> list[_Finding]:
    """The segment served again at concurrency 1 after every other one, against its first serving:
    an engine whose output depends on what it served before (a cache, a buffer, a request's state
    left behind) parts them. Reference codes first: those of a request served earlier name it."""
    rep, ctrl = ev.repeat, ev.control
    if rep.has_codes and ctrl.has_codes and not _same(rep.ref_codes, ctrl.ref_codes):
        donors, _ = _code_donors(rep.ref_codes, replace(ev, peer_ref_codes={}), ctrl.ref_codes)
        comps["repeat_ref_codes"] = {"first_frames": len(ctrl.ref_codes), "repeat_frames": len(rep.ref_codes),
                                     "matches": donors[0] if donors else None}
        if donors:
            return [_Finding("contamination", f"served again after the other segments, its vocoder got "
                                              f"{donors[0]}'s reference codes (served earlier)",
                             frame=0, chunk=0, stage="handoff", donor=donors[0], donor_kind="codes")]
        return [_Finding("history_defect", f"served again after the other segments, its reference codes "
                                           f"({len(rep.ref_codes)} frames) differ from its first serving's "
                                           f"({len(ctrl.ref_codes)})", frame=0, chunk=0, stage="handoff")]
    return _concurrency_findings(replace(ev, candidate=rep), policy, comps, {}, kind="history_defect",
                                 later="served again after the other segments", first="its first serving",
                                 key="repeat")


def _headline_findings(ev: Evidence, policy: Policy, comps: dict, mels: dict) -> list[_Finding]:
    ref, cand = ev.reference, ev.candidate
    out = []
    codes_known = ref.has_codes and cand.has_codes
    if codes_known:
        d = diff_codes(ref.codes, cand.codes, ev.initial_frames, ev.chunk_frames)
        comps["codes"] = _code_json(d)
        talker = talker_stage(cand)
        encoded = talker["ref_codes"] if talker is not None else cand.ref_codes  # the encoder's, before the hand-off
        comps["codes"]["ref_codes_equal"] = _same(ref.ref_codes, encoded)
        if not _same(ref.ref_codes, encoded):
            out.append(_encoder_finding(ref.ref_codes, encoded, policy, comps, talker is not None,
                                        ref.extra.get("ref_codes_bf16")))
        if d.length_only:
            out.append(_Finding("length_mismatch",
                                f"same codes for {min(d.len_a, d.len_b)} frames, then the candidate has "
                                f"{d.len_b} frames and the reference {d.len_a}",
                                frame=d.first_divergent_frame,
                                chunk=_chunk_of(d.first_divergent_frame, max(d.len_a, d.len_b), ev), stage="talker"))
        elif not d.equal:
            f = d.first_divergent_frame
            out.append(_Finding("code_divergence",
                                f"codes differ from the reference from frame {f} "
                                f"({d.frames_differing} of {min(d.len_a, d.len_b)} common frames differ)",
                                frame=f, chunk=_chunk_of(f, max(d.len_a, d.len_b), ev), stage="talker"))
        if out:
            return out
    audio = _Audio(ref, cand, ev, policy, mels)
    comps["audio"] = audio.to_json()
    if audio.length_gap:
        out.append(_Finding("length_mismatch",
                            f"candidate audio has {audio.len_b} samples, the reference {audio.len_a}",
                            frame=min(audio.len_a, audio.len_b) // 1920,
                            stage="vocoder" if codes_known else None))
        return out
    allowed = policy.tier_index("drift")
    frame, chunk = audio.first_bad(allowed, policy)
    if chunk is not None:
        if codes_known:
            out.append(_Finding("vocoder_defect",
                                f"same codes, but the audio leaves the reference's from chunk {chunk}",
                                frame=frame, chunk=chunk, stage="vocoder"))
        else:
            out.append(_Finding("audio_divergence",
                                f"audio leaves the reference's from chunk {chunk} (no codes captured to say why)",
                                frame=frame, chunk=chunk))
    elif audio.worst == 0:
        out.append(_Finding("identical", "codes and audio identical" if codes_known else "audio identical"))
    else:
        out.append(_Finding("numeric_drift",
                            f"{'same codes; ' if codes_known else ''}audio within tier {TIERS[audio.worst]} "
                            f"(max |diff| {audio.chunks.max_abs.max():.3g})"))
    return out


def _encoder_agreement(theirs: np.ndarray, mine: np.ndarray, theirs_bf16=None) -> tuple[float, float | None]:
    """The share of reference-code entries agreeing with qwen-tts's encoder's, in its dtype and in bf16."""
    def agreement(ref: np.ndarray) -> float:
        n = min(len(ref), len(mine))
        return float((ref[:n] == mine[:n]).mean()) if n else 0.0

    bf16 = agreement(np.asarray(theirs_bf16)) if theirs_bf16 is not None and len(theirs_bf16) == len(theirs) else None
    return agreement(theirs), bf16


def _encoder_disagrees(theirs: np.ndarray, mine: np.ndarray, policy: Policy, theirs_bf16=None) -> bool:
    """The encoder check's line: other length, or fewer entries agreeing (the closer dtype) than the policy allows."""
    agree, agree_bf16 = _encoder_agreement(theirs, mine, theirs_bf16)
    return len(theirs) != len(mine) or max(agree, agree_bf16 or 0.0) < policy.encoder_min_agreement


def _encoder_finding(theirs: np.ndarray, mine: np.ndarray, policy: Policy, comps: dict, at_talker: bool,
                     theirs_bf16: np.ndarray | None = None) -> _Finding:
    """The candidate's reference codes (what its talker was prompted with) against qwen-tts's encoder's
    for the same voice, in the reference's dtype and, where the reference recorded it, in bf16 (the
    dtype vLLM-Omni encodes in): numerics move some entries, another voice's or another length of
    audio moves them all. The closer of the two decides. Measured on vLLM-Omni 0.30.0's bf16 encoder,
    tiny checkpoint: against float32 78-91% agree on a CPU without AMX, 10-13% with AMX; against
    qwen-tts's own encoder in bf16, 93% with AMX; another voice's codes agree by chance (1 in 2048)."""
    agree, agree_bf16 = _encoder_agreement(theirs, mine, theirs_bf16)
    comps["codes"]["ref_codes_agreement"] = round(agree, 4)
    if agree_bf16 is not None:
        comps["codes"]["ref_codes_agreement_bf16"] = round(agree_bf16, 4)
        agree = max(agree, agree_bf16)
    if _encoder_disagrees(theirs, mine, policy, theirs_bf16):
        what = (f"{len(mine)} frames where qwen-tts's encoder makes {len(theirs)} of the same voice"
                if len(theirs) != len(mine) else
                f"only {agree:.0%} of their entries agree with qwen-tts's"
                + (" (float32 or bf16)" if theirs_bf16 is not None else "")
                + f" (policy: {policy.encoder_min_agreement:.0%})")
        whose = ("the talker's reference codes" if at_talker else
                 "the reference codes the vocoder got (no talker stage captured: the encoder or the hand-off)")
        return _Finding("reference_encoder_defect", f"{whose} are not what the voice encodes to: {what}",
                        frame=0, chunk=0, stage="reference_encoder")
    return _Finding("code_divergence", f"reference codes differ from qwen-tts's ({len(mine)} against {len(theirs)} "
                                       f"frames, {agree:.0%} of entries agree)", frame=0, chunk=0,
                    stage="reference_encoder")


def _ranges(idx) -> str:
    idx = [int(i) for i in idx]
    parts, start = [], None
    for i, v in enumerate(idx):
        if start is None:
            start = v
        if i + 1 == len(idx) or idx[i + 1] != v + 1:
            parts.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ",".join(parts)


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
        voc = _vocoder_findings(ev, policy, comps, mels) if ev.cross_own is not None and cand.has_codes else []
        if cand.has_codes:
            handoff = _handoff_findings(ev, comps, notes, voc)
            findings += handoff + _stage_findings(ev, comps) + _input_findings(ev, comps, notes, policy)
            if handoff and talker_stage(cand) is not None:
                voc = []  # the audio's departure is the hand-off's wrong prefix, already placed above
            elif talker_stage(cand) is None:
                notes.append("no talker stage in the capture: the hand-off judged against the reference codes "
                             "found at the vocoder")
            if ev.cross_own is None:
                notes.append("no cross-decode: vocoder stage not checked")
        findings += voc
        if ev.control is not None:
            findings += _concurrency_findings(ev, policy, comps, mels)
            if ev.repeat is not None:
                findings += _history_findings(ev, policy, comps)
        else:
            notes.append("no concurrency-1 control: concurrency invariance not checked")
        if cand.has_codes:
            tf = _forced_findings(ev, policy, comps)
            findings += tf
            if "forced" in comps and not tf:
                f = comps["forced"]
                notes.append(f"teacher-forced under qwen-tts the candidate's codes are plausible ({f['decoding']}: "
                             f"top-1 at {f['top1_share']:.0%} of frames, worst rank {f['worst_rank']}, "
                             f"worst gap {f['worst_gap']:.2g} nats)")
            elif "forced" not in comps:
                notes.append("no teacher-forced scores: the talker stage not judged")
        findings += _headline_findings(ev, policy, comps, mels)
        if abs(len(ev.reference.grid_wav) - len(cand.grid_wav)) == align.TRAILING_SAMPLES:
            notes.append("one trailing sample of difference in length")
    top = min(findings, key=lambda f: RANK.index(f.kind))
    verdict = "length_mismatch" if top.kind == "vocoder_length" else top.kind
    others = sorted({("length_mismatch" if f.kind == "vocoder_length" else f.kind)
                     for f in findings if f is not top} - {verdict})
    if others:
        notes.append("also: " + ", ".join(others))
    chunk = top.chunk
    if chunk is None and top.frame is not None:
        chunk = _chunk_of(top.frame, top.frame + 1, ev)
    artifacts = {role: str(r.source) for role in ("reference", "candidate", "control", "cross_own")
                 if (r := getattr(ev, role)) is not None and r.source is not None}
    artifacts.update({f"cross_donor:{p}": str(r.source) for p, r in ev.cross_donors.items() if r.source is not None})
    return SegmentVerdict(ev.segment_id, verdict, top.summary, top.frame, chunk, top.stage, top.donor,
                          top.error_kind, comps, notes, artifacts, top.donor_kind)
