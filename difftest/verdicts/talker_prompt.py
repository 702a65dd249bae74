"""The talker's assembled prompt against qwen-tts's, row by row (issue 57, item 5).

difftest/verdicts/talker_input.py compares what the prompt is made of, ingredient by ingredient. A
prompt built of the right ingredients can still be assembled wrong: a row in the wrong place (a
speaker row after the codec pad), dropped, duplicated, or altered after the builder (padded, scaled,
blended with another request's). This compares the rows the talker really received
(`input_prompt_embeds`, capture schema v3's optional arrays) with the rows qwen-tts's `generate`
handed its talker for the same request, labelled with the ingredient each should hold
(`input_prompt_rows`, difftest.engines.capture.PROMPT_ROWS).

The rule, per row: max |candidate - qwen-tts| over the qwen-tts row's largest |value|. Where both
sides are in the same dtype (the CPU test engine's float32 against the float32 reference: the same
arithmetic, the same bits) the allowance is 0: one ulp anywhere is a difference. A bf16 candidate's
rows (vLLM-Omni's talker runs in bf16) against the float32 reference are allowed
`policy.prompt_bf16_max_rel` (measured: qwen-tts's own bf16 prompt against its float32 one, at most
0.0095 per row; a moved row differs by 0.89 or more; default_policy.yaml, docs/verdicts.md). Other
pairs of dtypes have no measured allowance: not compared, and the notes say so.

The row count is compared first (a row dropped, added, duplicated), then each row in order; the
first differing row is named with what qwen-tts holds there and, where the candidate's row is
another of qwen-tts's rows, which one (a moved or duplicated row). A row holding a reference frame
the engine's encoder made otherwise than qwen-tts's (a bf16 encoder's: the encoder check judges
those codes) is left out, and the whole prompt where the frame counts differ (its rows cannot line
up). The comparison is recorded in every segment where both sides have the prompt
(`comparisons.talker_prompt`), equal or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engines.capture import PROMPT_ROWS
from .evidence import Evidence, Finding
from .policy import Policy

EMBEDS, DTYPE, LABELS = "input_prompt_embeds", "input_prompt_dtype", "input_prompt_rows"
CODES_ROWS = frozenset(i for i, name in enumerate(PROMPT_ROWS) if "reference codes" in name)
DONOR_KIND = "prompt row"


def has_prompt(inputs: dict | None) -> bool:
    return inputs is not None and EMBEDS in inputs and DTYPE in inputs


def _dtype(inputs: dict) -> str:
    return str(np.asarray(inputs[DTYPE]).reshape(-1)[0])


def allowance(mine: dict, theirs: dict, policy: Policy) -> float | None:
    """How far (relative, per row) the candidate's rows may be from qwen-tts's: 0 in the same dtype, the
    measured bf16 allowance for bf16 rows against float32 ones, None where nothing is measured."""
    da, db = _dtype(mine), _dtype(theirs)
    if da == db:
        return 0.0
    if da == "bfloat16" and db == "float32":
        return policy.prompt_bf16_max_rel
    return None


def row_rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row pair: max |a - b| over b's largest |value| (0 exactly where the rows are equal)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.abs(b).max(axis=-1)
    diff = np.abs(a - b).max(axis=-1)
    return np.where(diff == 0, 0.0, diff / np.maximum(scale, np.finfo(np.float32).tiny))


def label(theirs: dict, i: int) -> str:
    rows = theirs.get(LABELS)
    return PROMPT_ROWS[int(rows[i])] if rows is not None and i < len(rows) else "unknown"


@dataclass
class PromptDiff:
    rows: int  # the candidate's
    reference_rows: int
    compared: int
    skipped: int  # rows holding reference codes that are not qwen-tts's (the encoder check's)
    allowed: float
    worst: float  # the largest per-row relative difference among the rows compared
    worst_row: int | None
    first: int | None  # the first differing row (the shorter length where one is a prefix of the other)
    holds: int | None = None  # the qwen-tts row the candidate's first differing row equals, if another

    @property
    def equal(self) -> bool:
        return self.first is None

    def record(self, dtype: str) -> dict:
        return {"rows": self.rows, "reference_rows": self.reference_rows, "compared": self.compared,
                "skipped": self.skipped, "dtype": dtype, "allowed_rel": self.allowed, "worst_rel": self.worst,
                "worst_row": self.worst_row, "equal": self.equal, "first_differing_row": self.first}


def _skipped(mine: dict, theirs: dict, n: int) -> np.ndarray:
    """Rows (of the first n) holding a reference frame that is not qwen-tts's: the k-th row holding
    reference codes holds frame k, in either layout. None differ where the codes are qwen-tts's."""
    labels = theirs.get(LABELS)
    ra, rb = mine["input_ref_codes"], theirs["input_ref_codes"]
    skip = np.zeros(n, bool)
    if labels is None or (ra.shape == rb.shape and np.array_equal(ra, rb)):
        return skip
    holds = np.flatnonzero(np.isin(np.asarray(labels[:n]), list(CODES_ROWS)))
    same = (ra == rb).all(axis=1) if ra.shape == rb.shape else np.zeros(len(rb), bool)
    for k, row in enumerate(holds):
        skip[row] = k >= len(same) or not same[k]
    return skip


def compare_prompt(mine: dict, theirs: dict, allowed: float) -> PromptDiff:
    """The candidate's rows (`mine`) against qwen-tts's (`theirs`), in order."""
    a, b = mine[EMBEDS], theirs[EMBEDS]
    n = min(len(a), len(b)) if a.shape[1:] == b.shape[1:] else 0
    rel = row_rel(a[:n], b[:n]) if n else np.zeros(0)
    skip = _skipped(mine, theirs, n)
    judged = np.flatnonzero(~skip)
    bad = judged[rel[judged] > allowed]
    first = int(bad[0]) if len(bad) else (n if len(a) != len(b) or a.shape[1:] != b.shape[1:] else None)
    worst_row = int(judged[np.argmax(rel[judged])]) if len(judged) else None
    holds = None
    if first is not None and first < len(a) and a.shape[1:] == b.shape[1:]:
        near = np.flatnonzero(row_rel(np.broadcast_to(a[first], b.shape), b) <= allowed)
        near = near[near != first]
        holds = int(near[np.argmin(np.abs(near - first))]) if len(near) else None
    return PromptDiff(len(a), len(b), len(judged), int(skip.sum()), allowed,
                      float(rel[worst_row]) if worst_row is not None else 0.0, worst_row, first, holds)


def describe(d: PromptDiff, mine: dict, theirs: dict) -> str:
    """`at row 7 of 41 (it should hold the speaker row): the row there is qwen-tts's row 8 (codec pad)`."""
    i = d.first
    should = f"the {label(theirs, i)} row" if i < d.reference_rows else "nothing: qwen-tts's prompt ends there"
    if mine[EMBEDS].shape[1:] != theirs[EMBEDS].shape[1:]:
        what = f"its rows are {mine[EMBEDS].shape[1]} wide, qwen-tts's {theirs[EMBEDS].shape[1]}"
    elif i >= d.rows:
        what = "the candidate's prompt ends there"
    elif i >= d.reference_rows:
        what = ("the row there is qwen-tts's row " + f"{d.holds} ({label(theirs, d.holds)})" if d.holds is not None
                else "a row qwen-tts's prompt does not hold")
    elif d.holds is not None:
        what = f"the row there is qwen-tts's row {d.holds} ({label(theirs, d.holds)})"
    else:
        a, b = mine[EMBEDS][i], theirs[EMBEDS][i]
        what = (f"max |diff| {float(np.abs(a - b).max()):.3g}, {float(row_rel(a, b)):.3g} of the row's largest "
                f"value (allowed {d.allowed:g})")
    count = f"; {d.rows} rows against qwen-tts's {d.reference_rows}" if d.rows != d.reference_rows else ""
    return f"at row {i} of {d.reference_rows} (it should hold {should}): {what}{count}{_shifted(d, mine, theirs)}"


def _shifted(d: PromptDiff, mine: dict, theirs: dict) -> str:
    """Where one prompt ends with the whole other (rows put in front, or the first ones lost), say so."""
    a, b, extra = mine[EMBEDS], theirs[EMBEDS], d.rows - d.reference_rows
    if not extra or a.shape[1:] != b.shape[1:] or d.skipped:
        return ""
    if extra > 0 and (row_rel(a[extra:], b) <= d.allowed).all():
        return f", and qwen-tts's whole prompt follows them: {extra} rows put in front of it"
    if extra < 0 and (row_rel(a, b[-extra:]) <= d.allowed).all():
        return f", and they are qwen-tts's without its first {-extra} rows"
    return ""


def _donor(mine: dict, theirs: dict, d: PromptDiff, others: dict[str, dict], allowed: float) -> str | None:
    """Another request whose qwen-tts prompt holds the candidate's first differing row, where the
    segment's own (right) prompt holds it nowhere: a row of that request's reached this one."""
    i = d.first
    if i is None or i >= d.rows or d.holds is not None or mine[EMBEDS].shape[1:] != theirs[EMBEDS].shape[1:]:
        return None
    row = mine[EMBEDS][i]
    for sid in sorted(others):
        o = others[sid]
        if not has_prompt(o) or o[EMBEDS].shape[1:] != row.shape or _dtype(o) != _dtype(theirs):
            continue
        if (row_rel(np.broadcast_to(row, o[EMBEDS].shape), o[EMBEDS]) <= allowed).any():
            return sid
    return None


def prompt_findings(ev: Evidence, mine: dict, theirs: dict, comps: dict, notes: list, policy: Policy,
                    fields_wrong: bool, at_one: dict | None) -> list[Finding]:
    """The assembled prompt's finding (talker_defect or contamination at talker_input), recorded in
    `comps["talker_prompt"]`; none where an ingredient already differs (`fields_wrong`: that finding is
    the more specific), a note instead."""
    if not has_prompt(mine):
        notes.append("the talker's assembled prompt was not captured: its assembly not compared (its "
                     "ingredients were)")
        return []
    if not has_prompt(theirs):
        notes.append("no assembled prompt from qwen-tts (a reference from before it was recorded): the talker's "
                     "assembly not compared")
        return []
    allowed = allowance(mine, theirs, policy)
    if allowed is None:
        notes.append(f"the talker's assembled prompt not compared: its rows are {_dtype(mine)}, qwen-tts's "
                     f"{_dtype(theirs)}, and no tolerance is measured between them")
        return []
    ra, rb = mine["input_ref_codes"], theirs["input_ref_codes"]
    if len(ra) != len(rb):
        notes.append(f"the talker's assembled prompt not compared: it holds {len(ra)} reference frames, qwen-tts's "
                     f"{len(rb)}, so its rows cannot line up with qwen-tts's")
        return []
    d = compare_prompt(mine, theirs, allowed)
    comps["talker_prompt"] = d.record(_dtype(mine))
    cached = int(mine.get("input_prompt_cached", 0))
    if cached:  # a prefix-cache hit: the writer took those rows from the prompt built in the same step
        comps["talker_prompt"]["cached"] = cached
        notes.append(f"the first {cached} rows of the talker's assembled prompt came from the prefix cache: the "
                     f"engine's capture took them from the prompt it built, not from what its forward got")
    if d.skipped:
        notes.append(f"{d.skipped} rows of the talker's assembled prompt not compared: they hold reference frames "
                     f"the engine's encoder made otherwise than qwen-tts's (the encoder check judges them)")
    if d.equal:
        return []
    where_text = describe(d, mine, theirs)
    if fields_wrong:
        notes.append(f"the talker's assembled prompt differs from qwen-tts's as well, {where_text}")
        return []
    right_at_one = None
    if (has_prompt(at_one) and allowance(at_one, theirs, policy) is not None
            and len(at_one["input_ref_codes"]) == len(theirs["input_ref_codes"])):
        right_at_one = compare_prompt(at_one, theirs, allowance(at_one, theirs, policy)).equal
    where = (" at concurrency N (right at 1)" if right_at_one else " at concurrency 1 as well"
             if right_at_one is False else "")
    donor = _donor(mine, theirs, d, ev.other_inputs, allowed)
    if donor:
        return [Finding("contamination", f"the talker's assembled prompt holds a row of {donor}'s prompt, "
                                         f"{where_text}{where}",
                        frame=0, chunk=0, stage="talker_input", donor=donor, donor_kind=DONOR_KIND)]
    return [Finding("talker_defect", f"the talker's assembled prompt differs from qwen-tts's {where_text}{where}",
                    frame=0, chunk=0, stage="talker_input")]
