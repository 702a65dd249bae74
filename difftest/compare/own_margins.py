"""The candidate's own talker margins: its top-k log-probabilities per codebook-0 step, as the
capture recorded them (`talker_topk_ids` / `talker_topk_logprobs`, difftest/engines/capture.py).

qwen-tts's teacher-forced scores say whether a token is plausible for the model; these say what
the candidate's own logits thought at the step it chose. A flip between concurrency 1 and N is a
near-tie for the candidate only if, at the first divergent frame, each run's logits hold both
tokens within the policy's top-k and epsilon of their top-1: the test vLLM's
`check_logprobs_close` makes, on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class OwnTopK:
    ids: np.ndarray  # (tokens, k) int64, best first
    logprobs: np.ndarray  # (tokens, k) float32
    tokens: np.ndarray  # the talker's codebook-0 tokens (the last one never becomes a frame)

    def at(self, step: int, token: int) -> tuple[int | None, float | None]:
        """(rank, gap to the top-1 in nats) of `token` at `step`; (None, None) when outside the
        captured top-k (its gap is then at least the last kept one's)."""
        hit = np.flatnonzero(self.ids[step] == token)
        if not hit.size:
            return None, None
        r = int(hit[0])
        return r, float(self.logprobs[step, 0] - self.logprobs[step, r])


def consistency(own: OwnTopK, codes: np.ndarray, greedy: bool) -> str | None:
    """Why these margins cannot be read against these codes (None: they can): each frame's
    codebook-0 code must be the token of its step, and under greedy decoding each token the top-1."""
    n = min(len(codes), len(own.tokens))
    if len(own.ids) != len(own.tokens):
        return f"{len(own.ids)} top-k rows for {len(own.tokens)} talker tokens"
    if not np.array_equal(codes[:n, 0], own.tokens[:n]):
        f = int(np.flatnonzero(codes[:n, 0] != own.tokens[:n])[0])
        return f"frame {f}'s codebook-0 code is not the talker's token at that step"
    if greedy:
        for s, tok in enumerate(own.tokens):
            rank, gap = own.at(s, int(tok))
            if rank is None or gap > 0:  # bf16 logits tie often: argmax takes the lowest id, top-k either
                return f"greedy, yet the talker's token at step {s} is not its own top-1"
    return None


def near_tie(own_1: OwnTopK, own_n: OwnTopK, frame: int, top_k: int, max_gap: float) -> tuple[bool, dict]:
    """At a codebook-0 flip at `frame`: both tokens within each run's own top-`top_k` and `max_gap`
    nats of its top-1. Detail: per run, the rank and gap of each token (None: outside its top-k)."""
    t1, tn = int(own_1.tokens[frame]), int(own_n.tokens[frame])
    detail = {}
    ok = True
    for name, own in (("at_1", own_1), ("at_n", own_n)):
        rows = {}
        for label, tok in (("token_at_1", t1), ("token_at_n", tn)):
            rank, gap = own.at(frame, tok)
            rows[label] = {"token": tok, "rank": rank, "gap": None if gap is None else round(gap, 5)}
            ok = ok and rank is not None and rank < top_k and gap <= max_gap
        detail[name] = rows
    return ok, detail


def logprob_agreement(own: OwnTopK, qwen_logprob: np.ndarray) -> float | None:
    """Worst |candidate's own log-probability of its token - qwen-tts's teacher-forced one| over
    the frames where the candidate's token is in its own top-k (codebook 0): how closely the two
    talkers' distributions agree (bf16 against float32 on the CPU: about 1e-2)."""
    n = min(len(own.tokens), len(qwen_logprob))
    diffs = []
    for s in range(n):
        rank, _ = own.at(s, int(own.tokens[s]))
        if rank is not None:
            diffs.append(abs(float(own.logprobs[s, rank]) - float(qwen_logprob[s])))
    return max(diffs) if diffs else None


def margins(own: OwnTopK, start: int, end: int) -> list[float]:
    """The candidate's own top-1/top-2 log-probability margin at steps [start, end): small where
    its greedy choice was a near-tie (0 for an exact bf16 tie)."""
    lp = own.logprobs[start:min(end, len(own.logprobs))]
    return [round(float(x), 4) for x in lp[:, 0] - lp[:, 1]]
