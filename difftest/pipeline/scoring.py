"""Teacher forcing: every candidate stream with codes scored under the reference's talker and code
predictor, in the context the candidate's talker was prompted with: the frames its talker generated
where the capture shows them (verdicts/evidence.py talker_frames), else what the vocoder got."""

from __future__ import annotations

import numpy as np

from ..engines.scorer import ScoreItem, Scorer
from ..results import Result
from ..suites.suite import Suite
from ..verdicts.evidence import talker_frames, talker_stage


def _conditioning(seg, r: Result) -> np.ndarray | None:
    """The reference codes a candidate's talker was prompted with (the capture's talker stage, else
    what reached the vocoder), to teacher-force its codes in the same context; None where the
    segment has no in-context reference (the voice's own prompt is then the whole context)."""
    if seg.task != "voice_clone" or seg.voice is None or seg.voice.mode != "icl":
        return None
    talker = talker_stage(r)
    rc = talker.ref_codes if talker is not None else r.ref_codes
    return rc if len(rc) else None


def score_streams(scorer: Scorer, suite: Suite, outcomes: dict, only: set | None = None) -> tuple[dict, dict]:
    """Teacher-forced scores of every candidate stream with codes: (role -> sid -> ScoreFile,
    role -> sid -> error message). `outcomes`: role -> the candidate's outcome at that role;
    `only`: these segments' streams alone."""
    items = {}
    for role, o in outcomes.items():
        for seg in suite.segments:
            r = o.results.get(seg.id)
            if only is not None and seg.id not in only:
                continue
            if r is None or not r.has_codes or not len(r.codes):
                continue
            codes = talker_frames(r)[0]  # the talker's own, where the hand-off added or dropped frames around them
            # qwen-tts yields max_new_tokens - 1 frames when no EOS came (the last token never becomes one)
            eos = len(codes) < int(seg.decode["max_new_tokens"]) - 1
            items[f"{role}:{seg.id}"] = ScoreItem(seg, codes, _conditioning(seg, r), eos)
    got = scorer.score(items) if items else {}
    scores: dict = {role: {} for role in outcomes}
    errors: dict = {role: {} for role in outcomes}
    for name, sf in got.items():
        role, sid = name.split(":", 1)
        (errors if isinstance(sf, str) else scores)[role][sid] = sf
    return scores, errors


def shared_seeds(suite: Suite) -> list[str]:
    """A warning for sampled segments that share a seed: they draw the same random numbers, so their
    tokens are not independent and the sampling test's false-flag rate is not what it states."""
    by_seed: dict = {}
    for s in suite.segments:
        if s.decode.get("do_sample") or s.decode.get("subtalker_dosample"):
            by_seed.setdefault(s.decode.get("seed"), []).append(s.id)
    return [f"sampled segments {', '.join(ids)} share seed {seed}: their draws are not independent, and the "
            f"sampling test's false-flag rate holds only for segments with seeds of their own"
            for seed, ids in by_seed.items() if len(ids) > 1]
