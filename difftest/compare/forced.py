"""Reading teacher-forced scores (difftest/scores.py): is a code stream one qwen-tts could have decoded?

Greedy decoding: a stream is plausible when its tokens are qwen-tts's top-1 in
most frames and never far from it (a bf16 talker flips near-ties; a talker
conditioned on the wrong prompt picks tokens qwen-tts ranks far down). A code
difference is a near-tie when, at the first differing position, both sides'
tokens lie in qwen-tts's top-k and within a small log-probability of each other,
judged in the same context (the streams agree up to there).

Sampled decoding: every token must lie inside qwen-tts's sampling support
(temperature, top-k, top-p as asked); the likelihood of the whole suite is
compared run-level (difftest.verdicts.sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..scores import ScoreFile


@dataclass(frozen=True)
class ForcedPolicy:
    near_tie_top_k: int = 3
    near_tie_max_gap: float = 0.05  # where no null at N is measured
    near_tie_gross_gap: float = 0.5  # where the null at N parts too: its run-level tests judge the rest
    sampling_max_z: float = 4.0
    sampling_false_flag_rate: float = 0.01  # the sampling test's e-value and PIT, over roles and sites
    support_max_gap: float = 0.15  # where no null covered the sampled sites
    support_gross_gap: float = 1.5  # where the null samples outside the support too: its count test judges the rest
    min_top1_share: float = 0.8
    min_sub_top1_share: float = 0.9
    max_rank: int = 10
    max_gap: float = 1.5
    # qwen-tts's own numerics (float32): a greedy token off its top-1 by more than this is no tie
    exact_tie_gap: float = 5e-5


def sampled(sf: ScoreFile) -> bool:
    return bool(sf.settings.get("do_sample")) or bool(sf.settings.get("subtalker_dosample"))


def summary(sf: ScoreFile) -> dict:
    """Per-stream statistics, the report's `forced` entry."""
    rank, gap = sf.arrays["rank"], sf.gap
    worst = np.unravel_index(int(np.argmax(gap)), gap.shape) if gap.size else (0, 0)
    out = {
        "frames": sf.frames,
        "decoding": "sampled" if sampled(sf) else "greedy",
        "top1_share": round(float(np.mean(rank[:, 0] == 0)), 4),
        "sub_top1_share": round(float(np.mean(rank[:, 1:] == 0)), 4),
        "worst_rank": int(rank.max()),
        "worst_rank_codebook0": int(rank[:, 0].max()),
        "worst_gap": round(float(gap.max()), 4),
        "worst_gap_at": [int(worst[0]), int(worst[1])],
        "mean_logprob": round(float(np.mean(sf.arrays["logprob"])), 4),
        "out_of_support": int((~sf.arrays["in_support"]).sum()) if sampled(sf) else None,
        "worst_support_gap": round(float(sf.arrays["support_gap"].max()), 4) if sampled(sf) else None,
        "conditioning": sf.conditioning.get("ref_codes"),
    }
    if sf.eos is not None:
        out["eos"] = {"rank": int(sf.eos["rank"]), "gap": round(float(sf.eos["top1_logprob"] - sf.eos["logprob"]), 4)}
    return out


@dataclass
class Implausible:
    frame: int
    codebook: int
    reason: str
    why: str = ""  # what makes it implausible beyond the policy's lines (the numerics it was judged in)


def implausible(sf: ScoreFile, p: ForcedPolicy, gap_lines: tuple[float, float] | None = None) -> Implausible | None:
    """Why this stream is not one qwen-tts could have decoded as asked, or None when it could. Each
    model's part is judged by its own decoding: the talker's codebook 0 and the code predictor's
    codebooks 1-15 may be sampled (every token inside the support) or greedy (rank, gap, top-1 share).
    `gap_lines` (codebook 0, codebooks 1-15): the greedy gap lines where not `p.max_gap` (widened to
    what the candidate's numerics are measured to move, difftest/verdicts/talker.py)."""
    rank, gap, support = sf.arrays["rank"], sf.gap, sf.arrays["in_support"]
    g0, g1 = gap_lines or (p.max_gap, p.max_gap)
    line = np.array([g0] + [g1] * (rank.shape[1] - 1))
    talker_sampled = bool(sf.settings.get("do_sample"))
    sub_sampled = bool(sf.settings.get("subtalker_dosample"))
    greedy_cols = np.array([not talker_sampled] + [not sub_sampled] * (rank.shape[1] - 1))
    # outside the support by more than a boundary near-tie (a bf16 engine's k-th token differs)
    out = ~support & ~greedy_cols & (sf.arrays["support_gap"] > p.support_max_gap)
    bad = np.argwhere(out)
    if len(bad):
        f, c = (int(x) for x in bad[0])
        return Implausible(f, c, f"{len(bad)} tokens outside qwen-tts's sampling support, the first at frame {f} "
                                 f"codebook {c} (rank {int(rank[f, c])}, {float(sf.arrays['support_gap'][f, c]):.3g} "
                                 f"nats below the support's last token; policy: {p.support_max_gap})")
    far = np.argwhere(((rank > p.max_rank) | (gap > line)) & greedy_cols)
    if len(far):
        f, c = (int(x) for x in far[0])
        return Implausible(f, c, f"frame {f} codebook {c}: the token is qwen-tts's rank {int(rank[f, c])}, "
                                 f"{float(gap[f, c]):.3g} nats below its top-1 (policy: rank <= {p.max_rank}, "
                                 f"gap <= {float(line[c]):.3g}); {len(far)} such positions")
    s0 = float(np.mean(rank[:, 0] == 0)) if not talker_sampled else 1.0
    s1 = float(np.mean(rank[:, 1:] == 0)) if not sub_sampled else 1.0
    if s0 < p.min_top1_share or s1 < p.min_sub_top1_share:
        miss = np.argwhere((rank > 0) & greedy_cols)
        f, c = (int(x) for x in miss[0])
        return Implausible(f, c, f"only {s0:.0%} of frames take qwen-tts's top-1 codebook-0 token and {s1:.0%} of "
                                 f"the other codebooks' (policy: {p.min_top1_share:.0%}, {p.min_sub_top1_share:.0%})")
    if sf.eos is not None:
        eos_gap = sf.eos["top1_logprob"] - sf.eos["logprob"]
        off = (not sf.eos["in_support"]) if talker_sampled else (sf.eos["rank"] > p.max_rank or eos_gap > g0)
        if off:
            return Implausible(sf.frames, 0, f"the stream stops after {sf.frames} frames where qwen-tts ranks the "
                                             f"stop {int(sf.eos['rank'])} ({eos_gap:.3g} nats below its top-1)")
    return None


def off_exact(sf: ScoreFile, tie: float) -> Implausible | None:
    """In qwen-tts's own numerics, the first greedy token (or stop) off its top-1 by more than a float32
    tie: no implementation in those numerics decodes it (issue 57). None where there is none."""
    rank, gap = sf.arrays["rank"], sf.gap
    greedy_cols = np.array([not sf.settings.get("do_sample")] + [not sf.settings.get("subtalker_dosample")]
                           * (rank.shape[1] - 1))
    off = np.argwhere((rank > 0) & (gap > tie) & greedy_cols)
    if len(off):
        f, c = (int(x) for x in off[0])
        return Implausible(f, c, f"{len(off)} greedy tokens off qwen-tts's top-1 by more than a float32 tie "
                                 f"({tie:g} nats), the first at frame {f} codebook {c} (rank {int(rank[f, c])}, "
                                 f"{float(gap[f, c]):.3g} nats below its top-1)")
    if sf.eos is not None and greedy_cols[0] and sf.eos["rank"] > 0 and sf.eos["top1_logprob"] - sf.eos["logprob"] > tie:
        return Implausible(sf.frames, 0, f"the stream stops after {sf.frames} frames where qwen-tts's top-1 is "
                                         f"another token, {sf.eos['top1_logprob'] - sf.eos['logprob']:.3g} nats "
                                         f"above the stop (a float32 tie: {tie:g})")
    return None


def on_ties(sf: ScoreFile) -> list[tuple[int, int, float]]:
    """The greedy positions off qwen-tts's top-1 (frame, codebook, gap), first first: in its own
    numerics, where `off_exact` found none past the line, each lies on a float32 tie."""
    greedy_cols = np.array([not sf.settings.get("do_sample")] + [not sf.settings.get("subtalker_dosample")]
                           * (sf.arrays["rank"].shape[1] - 1))
    return [(int(f), int(c), float(sf.gap[f, c])) for f, c in np.argwhere((sf.arrays["rank"] > 0) & greedy_cols)]


def first_difference(a: np.ndarray, b: np.ndarray) -> tuple[int, int] | None:
    """(frame, codebook) of the first position where two streams differ (None: equal where both exist)."""
    n = min(len(a), len(b))
    diff = np.argwhere(a[:n] != b[:n])
    return (int(diff[0][0]), int(diff[0][1])) if len(diff) else None


def near_tie(sf_a: ScoreFile, sf_b: ScoreFile, at: tuple[int, int], p: ForcedPolicy) -> tuple[bool, dict]:
    """Whether two streams that agree before `at` part there on a near-tie: both tokens in qwen-tts's
    top-k, each within `near_tie_max_gap` nats of the top-1 (so of each other)."""
    f, c = at
    detail = {"frame": f, "codebook": c}
    if f >= min(sf_a.frames, sf_b.frames):
        return False, {**detail, "why": "one stream ends there"}
    ranks = [int(s.arrays["rank"][f, c]) for s in (sf_a, sf_b)]
    gaps = [float(s.gap[f, c]) for s in (sf_a, sf_b)]
    detail.update(ranks=ranks, gaps=[round(g, 5) for g in gaps],
                  margin=round(float(sf_a.arrays["margin"][f, c]), 5))
    ok = max(ranks) < p.near_tie_top_k and max(gaps) <= p.near_tie_max_gap
    return ok, detail


TRACE_BEFORE, TRACE_AFTER, TRACE_WHOLE = 20, 40, 80


def trace(sf: ScoreFile, center: int | None) -> dict:
    """Per-frame series for the report, MLflow (step = frame) and the segment page: the whole stream when
    it is short, else a window around `center` (the first implausible or divergent frame)."""
    T = sf.frames
    if T <= TRACE_WHOLE or center is None:
        start, end = 0, min(T, TRACE_WHOLE)
    else:
        start = max(0, min(center - TRACE_BEFORE, T - TRACE_BEFORE - TRACE_AFTER))
        end = min(T, start + TRACE_BEFORE + TRACE_AFTER)
    rank, gap = sf.arrays["rank"][start:end], sf.gap[start:end]
    out = {"start": start, "end": end,
           "rank_codebook0": [int(x) for x in rank[:, 0]],
           "gap_codebook0": [round(float(x), 4) for x in gap[:, 0]],
           "rank_codebooks_1_15": [int(x) for x in rank[:, 1:].max(axis=1)],
           "gap_codebooks_1_15": [round(float(x), 4) for x in gap[:, 1:].max(axis=1)]}
    if sampled(sf):
        out["outside_support"] = [int(x) for x in (~sf.arrays["in_support"][start:end]).sum(axis=1)]
    return out
