"""Shrinking a failing batch to a minimal one: fewer requests, fewer steps, shorter refs, earlier joins.

Greedy: take the first smaller variant that still fails the same way, repeat until none does.
`still_fails(case) -> bool` is the whole interface to the probe, so this module runs without one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator

from .generate import Case


def variants(case: Case) -> Iterator[Case]:
    reqs = case.requests
    if len(reqs) > 1:
        for r in reqs:
            rest = tuple(x for x in reqs if x.id != r.id)
            yield Case(rest, tuple(i for i in case.order if i != r.id), case.async_chunk)
    for field, floor in (("decode_steps", 1), ("ref_len", 1), ("join", 0)):
        for i, r in enumerate(reqs):
            if field == "ref_len" and r.kind != "icl":
                continue
            if getattr(r, field) > floor:
                smaller = replace(r, **{field: getattr(r, field) - 1})
                yield Case(reqs[:i] + (smaller,) + reqs[i + 1:], case.order, case.async_chunk)
    if all(r.join > 0 for r in reqs):  # shift the whole batch earlier
        yield Case(tuple(replace(r, join=r.join - 1) for r in reqs), case.order, case.async_chunk)


def shrink(case: Case, still_fails: Callable[[Case], bool], max_tries: int = 400) -> tuple[Case, int]:
    """-> (minimal failing case, number of variants tried)."""
    tries = 0
    improved = True
    while improved and tries < max_tries:
        improved = False
        for v in variants(case):
            tries += 1
            if still_fails(v):
                case = v
                improved = True
                break
            if tries >= max_tries:
                break
    return case, tries
