"""What one segment's verdict is judged from, and what a judgement is made of: the evidence,
a finding, the verdict, one audio comparison chunk by chunk, and the helpers every stage uses."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..compare import align
from ..compare.audio import ChunkMetrics, frame_metrics, log_mel, reduce_frames
from ..results import Result
from .policy import TIERS, Policy, chunk_tiers

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
    # how often qwen-tts in the candidate's numerics samples outside the support (null.support_noise); None: unknown
    support_noise: dict | None = None


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
class Finding:
    kind: str  # one of RANK
    summary: str
    frame: int | None = None
    chunk: int | None = None
    stage: str | None = None
    donor: str | None = None
    error_kind: str | None = None
    donor_kind: str | None = None


class Audio:
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


def talker_stage(r: Result | None) -> dict | None:
    """The talker side of a candidate's capture (capture schema v2), or None where not captured."""
    if r is None or "talker_tokens" not in r.extra:
        return None
    prompt = [int(x) for x in np.asarray(r.extra["talker_prompt"]).reshape(-1)]
    return {"ref_codes": np.asarray(r.extra["talker_ref_codes"], np.int64).reshape(-1, 16),
            "tokens": np.asarray(r.extra["talker_tokens"], np.int64).reshape(-1),
            "reserved": prompt[0], "built": prompt[1], "ref_code_len": prompt[2]}


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
