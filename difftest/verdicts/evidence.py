"""What one segment's verdict is judged from, and what a judgement is made of: the evidence,
a finding, the verdict, one audio comparison chunk by chunk, and the helpers every stage uses."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..compare import align
from ..compare.audio import ChunkMetrics, FrameMetrics, add_log_mel, frame_metrics, log_mel, reduce_frames
from ..family import CODEBOOKS, FAMILY
from ..results import Result
from .policy import TIERS, Policy, chunk_tiers

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
    kind: str  # one of catalogue.RANK
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
        # id(result) -> log-mel, and the comparisons made: shared across one segment's comparisons
        mels = {} if mels is None else mels
        self.fm, self.bounds, self.chunks = _compared(a, b, ev, policy, mels)
        self.logmel_computed = _needs_logmel(self.fm, policy)
        self.quantised = a.quantised or b.quantised
        self.tiers = chunk_tiers(self.chunks, policy, self.quantised)
        self.len_a, self.len_b = len(a.grid_wav), len(b.grid_wav)

    @property
    def worst(self) -> int:
        return int(self.tiers.max()) if len(self.tiers) else 0

    def bad_chunks(self, allowed_tier: int, excused: np.ndarray | None = None) -> np.ndarray:
        """Chunks above the allowed tier; `excused` (bool per chunk): those a measured null allows."""
        over = self.tiers > allowed_tier
        return np.flatnonzero(over & ~excused if excused is not None else over)

    def first_bad(self, allowed_tier: int, policy: Policy,
                  excused: np.ndarray | None = None) -> tuple[int | None, int | None]:
        """(frame, chunk) where the comparison first leaves the allowed tier."""
        bad = self.bad_chunks(allowed_tier, excused)
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


def _needs_logmel(fm: FrameMetrics, policy: Policy) -> bool:
    """The log-mel decides a chunk's tier only where its max |diff| is above close_max_abs (chunk_tiers):
    where no frame's is (identical or quantisation-level audio, the common case) it is not computed,
    and its chunk values read 0 with `logmel_computed: false`."""
    return bool(len(fm.max_abs)) and float(fm.max_abs.max()) > policy.close_max_abs


def _compared(a: Result, b: Result, ev: Evidence, policy: Policy,
              mels: dict) -> tuple[FrameMetrics, np.ndarray, ChunkMetrics]:
    """b's audio against a's: per-frame metrics (the log-mel only where _needs_logmel), chunk bounds,
    per-chunk metrics. A comparison already made for this segment between the same audio (bit for
    bit: the control often equals the candidate, the reference vocoder on the reference's own codes
    decodes the reference's audio) is not made again: the same inputs give the same numbers."""
    # Both sides from their frame 0: qwen-tts's cut can leave one sample in front (difftest.compare.align).
    wa, wb = a.grid_wav, b.grid_wav
    key = (a.sample_rate, policy.close_max_abs, ev.initial_frames, ev.chunk_frames)
    made = mels.setdefault("compared", [])
    for x, y, k, out in made:
        if k == key and _same_audio(y, wb) and _same_audio(x, wa):
            return out
    fm = frame_metrics(wa, wb, a.sample_rate, with_mel=False, energy_if_equal=False)
    if _needs_logmel(fm, policy):
        for r in (a, b):
            if id(r) not in mels:
                mels[id(r)] = log_mel(r.grid_wav, r.sample_rate)
        fm = add_log_mel(fm, wa, wb, a.sample_rate, mel_a=mels[id(a)], mel_b=mels[id(b)])
    bounds = align.chunk_frame_bounds(len(fm.max_abs), ev.initial_frames, ev.chunk_frames)
    out = (fm, bounds, reduce_frames(fm, bounds))
    for arr in (*fm.__dict__.values(), bounds, *out[2].__dict__.values()):
        if arr is not None:
            arr.flags.writeable = False  # shared by every Audio that reuses it
    made.append((wa, wb, key, out))
    return out


def _same_audio(x: np.ndarray, y: np.ndarray) -> bool:
    """The same samples bit for bit: the same memory, or equal bits (compared as unsigned integers,
    so NaN and -0.0 are no exceptions)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.__array_interface__["data"][0] == y.__array_interface__["data"][0] and x.strides == y.strides:
        return True
    if x.dtype.kind != "f" or x.dtype.itemsize not in (2, 4, 8):
        return bool(np.array_equal(x, y))
    bits = np.dtype(f"u{x.dtype.itemsize}")
    return bool(np.array_equal(x.view(bits), y.view(bits)))


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
    return {"ref_codes": np.asarray(r.extra["talker_ref_codes"], np.int64).reshape(-1, CODEBOOKS),
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
