"""Where a segment parts from the reference, in words: the one formatter every output uses (the
console summary, the gate's JUnit and Markdown, MLflow's pictures, bisect's record, the dashboard)."""

from __future__ import annotations


def donor_text(seg: dict) -> str:
    """The donor as shown to people: `s2` when it lent its reference codes, `s2 (length)` when only
    their length (`donor_kind`), '' when there is none."""
    donor, kind = seg.get("donor"), seg.get("donor_kind")
    if not donor:
        return ""
    return f"{donor} ({kind})" if kind and kind != "codes" else donor


def where(seg: dict, sep: str = ", ", stage_word: bool = False) -> str:
    """`chunk 0, handoff, donor s2 (length)` (with `stage_word`: `chunk 0, stage handoff, ...`);
    '' for a segment with nowhere to show."""
    parts = []
    if seg.get("first_divergent_chunk") is not None:
        parts.append(f"chunk {seg['first_divergent_chunk']}")
    if seg.get("stage"):
        parts.append(f"stage {seg['stage']}" if stage_word else seg["stage"])
    if seg.get("donor"):
        parts.append(f"donor {donor_text(seg)}")
    return sep.join(parts)
