"""What one segment's verdict is judged from, and what a judgement is made of: the evidence,
a finding, the verdict, and the helpers every stage uses (one audio comparison: compare/chunks.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..compare import align
from ..compare.chunks import Audio
from ..engines.captured import TalkerStage, captured
from ..family import FAMILY, REFERENCE_NAMES
from ..results import Result
from .policy import Policy

STAGES = FAMILY.stages


@dataclass(kw_only=True)
class Evidence:
    """Everything known about one segment: named, never by position (its fields are many and alike)."""

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
    # how often qwen-tts in the candidate's numerics samples outside the support (null.support_noise); None: unknown
    support_noise: dict | None = None
    # qwen-tts's vocoder in the candidate's vocoder dtype on the candidate's codes (vocoder_null.py); None:
    # the candidate's vocoder runs in the reference's dtype (or no null was decoded)
    vocoder_null: Result | None = None
    vocoder_dtype: str | None = None
    # the candidate talker's numerics ({"dtype", "from", "exact"}, run.py); exact: qwen-tts's own, where a
    # greedy token off its top-1 by more than a float32 tie is a defect (talker.forced_findings)
    numerics: dict | None = None
    # how far the candidate's numerics move qwen-tts's margins per token (null.NoiseModel); None: not measured
    noise_model: object | None = None


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
    also: list = field(default_factory=list)  # the segment's other findings, most serious first, each with
    # the keys above from verdict to donor_kind: a defect under a more serious one (the release's own) is named

    def to_json(self) -> dict:
        return {
            "id": self.id, "verdict": self.verdict, "summary": self.summary,
            "first_divergent_frame": self.first_divergent_frame,
            "first_divergent_chunk": self.first_divergent_chunk,
            "stage": self.stage, "donor": self.donor, "donor_kind": self.donor_kind, "error_kind": self.error_kind,
            "notes": self.notes, "comparisons": self.comparisons, "artifacts": self.artifacts, "also": self.also,
        }


@dataclass
class Finding:
    kind: str  # one of catalogue.RANK
    summary: str
    frame: int | None = None
    chunk: int | None = None
    stage: str | None = None
    donor: str | None = None
    error_kind: str | None = None
    donor_kind: str | None = None


def compared(a: Result, b: Result, ev: Evidence, policy: Policy, mels: dict | None = None) -> Audio:
    """b's audio against a's, chunk by chunk on the segment's chunks, at the policy's thresholds."""
    return Audio(a, b, policy.thresholds, (ev.initial_frames, ev.chunk_frames), mels)


def code_json(d) -> dict:
    return {"frames": [d.len_a, d.len_b], "first_divergent_frame": d.first_divergent_frame,
            "codes_at_divergence": [d.a_at_divergence, d.b_at_divergence],
            "frames_differing": d.frames_differing, "codebooks_differing": d.codebooks_differing,
            "chunk_agreement": d.chunk_agreement}


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))


def chunk_of(frame, n_frames, ev) -> int | None:
    bounds = align.chunk_frame_bounds(max(n_frames, (frame or 0) + 1), ev.initial_frames, ev.chunk_frames)
    return align.chunk_of_frame(frame, bounds)


def reference_name(r: Result | None) -> str:
    """The reference that made `r`, as a finding names it (its runner's label, else qwen-tts)."""
    label = ((r.provenance or {}).get("engine") if r is not None else None) or "qwen-tts"
    return REFERENCE_NAMES.get(label, "qwen-tts")


def talker_stage(r: Result | None) -> TalkerStage | None:
    """The talker side of a candidate's capture (capture schema v2), or None where not captured."""
    return captured(r).talker


def talker_frames(r: Result) -> tuple[np.ndarray, bool]:
    """The frames `r`'s talker generated, as the hand-off carried them, and True: the vocoder's codes
    where the captured talker tokens are their codebook 0, else the one run of them that is (a hand-off
    that added or dropped frames around them whole: Qwen3-Omni 0.30.0's full payload puts an all-zero
    frame first). The vocoder's codes and False where the talker's side was not captured or its frames
    are not there whole (teacher forcing then judges what the vocoder got)."""
    talker, codes = talker_stage(r), r.codes
    n = len(talker.tokens) - 1 if talker is not None else 0  # the last token (EOS, the cap's) is no frame
    if n <= 0 or len(codes) < n:
        return codes, False
    gen, c0 = talker.tokens[:n], codes[:, 0]
    for o in range(len(codes) - n + 1):
        if np.array_equal(c0[o:o + n], gen):
            return (codes, True) if len(codes) == n else (codes[o:o + n], True)
    return codes, False


def ranges(idx) -> str:
    idx = [int(i) for i in idx]
    parts, start = [], None
    for i, v in enumerate(idx):
        if start is None:
            start = v
        if i + 1 == len(idx) or idx[i + 1] != v + 1:
            parts.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ",".join(parts)
