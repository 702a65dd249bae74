"""Generated batches for the hand-off probe (no hand-listed cases).

A case is a talker batch over a few scheduler steps: requests that join and finish at different
steps, voice clones with reference codes (in-context, `icl`) and without them (speaker embedding
only, `xvec`), reference lengths that differ, one arrival order (the batch order of every step),
and talker async chunking on or off.

Every code a request carries is a marker of that request: value = 200 * tag + offset, where
offset < 100 marks its generated audio codes and 100 <= offset < 200 its reference codes (offsets
also vary with the frame and the codebook, so a transposed or shifted layout shows). Tags run from
1 to 9, so every value stays below 2048 (Qwen3-TTS's codebook size) and no row is all zeros (the
stage processors drop those). `tag_of` reads a value back to its request.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from ..family import CODEBOOKS as NUM_CODE_GROUPS

MARK = 200
MAX_BATCH = 8


def audio_row(tag: int, step: int) -> list[int]:
    return [MARK * tag + (step % 6) * NUM_CODE_GROUPS + q for q in range(NUM_CODE_GROUPS)]


def ref_frame(tag: int, frame: int) -> list[int]:
    return [MARK * tag + 100 + (frame % 6) * NUM_CODE_GROUPS + q for q in range(NUM_CODE_GROUPS)]


def tag_of(value) -> int | None:
    """The request tag a code value marks, or None for a value that is not a marker."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if MARK <= value < MARK * 10:
        return value // MARK
    return None


@dataclass(frozen=True)
class RequestSpec:
    id: str
    tag: int
    kind: str  # icl | xvec
    ref_len: int  # 0 for xvec
    join: int  # scheduler step of its (first) prefill
    decode_steps: int  # decode steps after the prefill; it finishes on the last

    @property
    def prefill_len(self) -> int:  # prompt rows the talker schedules at prefill (zero codec rows)
        return 3 + self.ref_len

    def to_probe(self) -> dict:
        return {"id": self.id, "tag": self.tag, "kind": self.kind, "join": self.join,
                "decode_steps": self.decode_steps, "prefill_len": self.prefill_len,
                "ref": [ref_frame(self.tag, f) for f in range(self.ref_len)],
                "audio": [audio_row(self.tag, k) for k in range(1, self.decode_steps + 1)]}

    def short(self) -> str:
        what = f"icl ref {self.ref_len}" if self.kind == "icl" else "xvec (no ref)"
        return f"{self.id}: {what}, joins step {self.join}, {self.decode_steps} decode steps"

    def alone(self) -> "RequestSpec":
        """The same request in a batch of one: same steps relative to its own start."""
        return RequestSpec(self.id, self.tag, self.kind, self.ref_len, 0, self.decode_steps)


@dataclass(frozen=True)
class Case:
    requests: tuple[RequestSpec, ...]
    order: tuple[str, ...]  # arrival order = batch order of every step
    async_chunk: bool

    @property
    def mode(self) -> str:
        return "async" if self.async_chunk else "full"

    def by_id(self, rid: str) -> RequestSpec:
        return next(r for r in self.requests if r.id == rid)

    def to_probe(self) -> dict:
        return {"async_chunk": self.async_chunk, "order": list(self.order),
                "requests": [r.to_probe() for r in self.requests]}

    def to_json(self) -> dict:
        return {"mode": self.mode, "order": list(self.order),
                "requests": [{"id": r.id, "kind": r.kind, "ref_len": r.ref_len, "join": r.join,
                              "decode_steps": r.decode_steps} for r in self.requests]}

    def describe(self) -> str:
        ordered = [self.by_id(rid) for rid in self.order]
        return f"{self.mode}, order {' '.join(self.order)}: " + "; ".join(r.short() for r in ordered)

    def size(self) -> tuple:
        """Shrink order: fewer requests, then fewer steps, then shorter refs, then earlier joins."""
        return (len(self.requests), sum(r.decode_steps for r in self.requests),
                sum(r.ref_len for r in self.requests), sum(r.join for r in self.requests))


def solo_case(r: RequestSpec, async_chunk: bool) -> Case:
    a = r.alone()
    return Case((a,), (a.id,), async_chunk)


def _random_request(rng: random.Random, i: int) -> RequestSpec:
    if rng.random() < 0.65:
        return RequestSpec(f"r{i}", i + 1, "icl", rng.randint(1, 6), rng.randint(0, 2), rng.randint(1, 4))
    return RequestSpec(f"r{i}", i + 1, "xvec", 0, rng.randint(0, 2), rng.randint(1, 4))


def _simultaneous(n: int) -> tuple[RequestSpec, ...]:
    """All arrive together (the most sensitive design: research §6a), kinds alternate, ref lengths differ."""
    return tuple(RequestSpec(f"r{i}", i + 1, "icl", 2 + i, 0, 2) if i % 2 == 0
                 else RequestSpec(f"r{i}", i + 1, "xvec", 0, 0, 2) for i in range(n))


def _orders(ids: list[str], rng: random.Random, limit: int) -> list[tuple[str, ...]]:
    """Every arrival order when there are at most `limit`; else `limit` distinct seeded samples."""
    n = len(ids)
    total = 1
    for k in range(2, n + 1):
        total *= k
    if total <= limit:
        return [tuple(p) for p in itertools.permutations(ids)]
    seen: list[tuple[str, ...]] = [tuple(ids), tuple(reversed(ids))]
    while len(seen) < limit:
        p = ids[:]
        rng.shuffle(p)
        if tuple(p) not in seen:
            seen.append(tuple(p))
    return seen


def generate(seed: int = 0, max_batch: int = MAX_BATCH, compositions: int = 5, orders: int = 6,
             modes: tuple[bool, ...] = (False, True)) -> list[Case]:
    """The matrix: batch sizes 1..max_batch, `compositions` request mixes per size (one of them
    simultaneous), every arrival order up to `orders` (seeded samples beyond), async off and on."""
    rng = random.Random(seed)
    cases: list[Case] = []
    for n in range(1, max_batch + 1):
        mixes = [_simultaneous(n)]
        tries = 0
        while len(mixes) < compositions and tries < 50 * compositions:
            tries += 1
            mix = tuple(_random_request(rng, i) for i in range(n))
            key = lambda r: (r.kind, r.ref_len, r.join, r.decode_steps)  # noqa: E731
            if n == 1 and any(key(m[0]) == key(mix[0]) for m in mixes):
                continue
            mixes.append(mix)
        for mix in mixes:
            for order in _orders([r.id for r in mix], rng, orders):
                for a in modes:
                    cases.append(Case(mix, order, a))
    return cases
