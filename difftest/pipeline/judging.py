"""Every segment's verdict: its evidence assembled from the passes, the cross-decodes and the
scores, classified, and where the vocoder check fails, judged again with the donors' decodes."""

from __future__ import annotations

import numpy as np

from ..family import CODEBOOKS
from ..results import Result
from ..suites.suite import Suite
from ..verdicts.classify import Evidence, classify, talker_stage
from ..verdicts.policy import Policy
from ..verdicts.talker_input import inputs_of
from .cross import Vocoder, null_for
from .null_phase import MeasuredNull
from .passes import results_with_codes


def judge_segments(suite: Suite, ref_run, cand, ctrl, vocoder: Vocoder, policy: Policy, again=None,
                   scores: tuple[dict, dict] | None = None, null: MeasuredNull | None = None,
                   null_vocoder: Vocoder | None = None) -> tuple[dict, dict]:
    """Every segment's verdict: cross-decodes through the reference vocoder, the classifier, and
    where the vocoder check fails, the donor search with each co-batched request's reference.
    `null_vocoder`: qwen-tts's vocoder in the candidate's vocoder dtype, where that is not the
    reference's (difftest/verdicts/vocoder_null.py). Returns (verdicts, segment -> the null's decode)."""
    noise, support = (null.batch_noise, null.support) if null else (None, None)
    numerics, noise_model = (null.numerics, null.noise_model) if null else (None, None)

    # Each segment's own reference codes: what the candidate's talker was prompted with (the capture's
    # talker stage), else what the candidate makes of its voice alone (c=1), else what qwen-tts makes of it.
    def own_ref(sid):
        talker = talker_stage(cand.results.get(sid))
        if talker is not None:
            return talker.ref_codes
        c = ctrl.results.get(sid)
        if c is not None and c.has_codes:
            return c.ref_codes
        r = ref_run.results.get(sid)
        return r.ref_codes if r is not None else np.zeros((0, CODEBOOKS), np.int64)

    score_ok, score_errors = scores or ({}, {})
    with_codes = results_with_codes(cand.results)
    cross = vocoder.decode({f"{sid}.own": (sid, r.codes, own_ref(sid)) for sid, r in with_codes.items()})
    nulls = (null_vocoder.decode({f"{sid}.own-{null_vocoder.dtype}": (sid, r.codes, own_ref(sid))
                                  for sid, r in with_codes.items()}) if null_vocoder is not None else {})
    nulls = {k.rsplit(".own-", 1)[0]: v for k, v in nulls.items()}
    peers_of = {}
    for wave in cand.batches:
        for sid in wave:
            peers_of[sid] = [p for p in wave if p != sid]

    def evidence(sid, donors=None):
        errors = []
        for label, o in (("reference", ref_run), ("candidate", cand), ("control", ctrl), ("repeat", again)):
            if o is not None and sid in o.errors:
                errors.append({**o.errors[sid], "source": label})
        for role in ("candidate", "control"):
            if sid in score_errors.get(role, {}):
                errors.append({"source": f"teacher forcing ({role})", "kind": "infrastructure",
                               "message": score_errors[role][sid]})
        x = cross.get(f"{sid}.own")
        if isinstance(x, str):
            errors.append({"source": "cross-decode", "kind": "infrastructure", "message": x})
            x = None
        null = nulls.get(sid)
        if isinstance(null, str):  # never judged without the null it needs
            errors.append({"source": f"vocoder null ({null_vocoder.dtype}) cross-decode", "kind": "infrastructure",
                           "message": null})
            null = None
        peers = peers_of.get(sid, [])
        return Evidence(
            segment_id=sid, reference=ref_run.results.get(sid), candidate=cand.results.get(sid),
            control=ctrl.results.get(sid), cross_own=x, cross_donors=donors or {},
            peer_ref_codes={p: own_ref(p) for p in peers},
            history_ref_codes={p: own_ref(p) for p in cand.results if p != sid and talker_stage(cand.results[p])},
            peer_tokens={p: t.tokens for p in peers if (t := talker_stage(cand.results.get(p)))},
            errors=errors, initial_frames=suite.chunks["initial_frames"], chunk_frames=suite.chunks["frames"],
            repeat=again.results.get(sid) if again is not None else None,
            scores={role: got[sid] for role, got in score_ok.items() if sid in got},
            other_inputs={p: i for p, i in ref_inputs.items() if p != sid}, batch_noise=noise, support_noise=support,
            vocoder_null=null, vocoder_dtype=null_vocoder.dtype if null_vocoder is not None else None,
            numerics=numerics, noise_model=noise_model)

    ref_inputs = {sid: i for sid, r in ref_run.results.items() if (i := inputs_of(r)) is not None}
    verdicts = {s.id: classify(evidence(s.id), policy) for s in suite.segments}
    need = {}
    for sid, v in verdicts.items():
        if "vocoder" in v.comparisons and sid in with_codes and v.verdict in ("vocoder_defect", "contamination"):
            for p in peers_of.get(sid, []):
                rc = own_ref(p)
                if len(rc):
                    need[f"{sid}.donor-{p}"] = (sid, with_codes[sid].codes, rc)
    if need:
        donors = vocoder.decode(need)
        for sid in {k.split(".donor-")[0] for k in need}:
            found = {k.split(".donor-")[1]: r for k, r in donors.items()
                     if k.startswith(f"{sid}.donor-") and isinstance(r, Result)}
            verdicts[sid] = classify(evidence(sid, found), policy)
    return verdicts, {sid: r for sid, r in nulls.items() if isinstance(r, Result)}


def judge_at_one(suite: Suite, ref_run, ctrl, scores: dict, null: MeasuredNull, vocoder_nulls: dict,
                 vocoder_numerics: dict, policy: Policy) -> list:
    """The candidate at concurrency 1 judged on its own against the reference: a defect that only
    concurrency causes must leave this clean (no extra model work: every input is already here)."""
    return [classify(Evidence(segment_id=s.id, reference=ref_run.results.get(s.id), candidate=ctrl.results.get(s.id),
                              errors=[{**ctrl.errors[s.id], "source": "control"}] if s.id in ctrl.errors else [],
                              initial_frames=suite.chunks["initial_frames"], chunk_frames=suite.chunks["frames"],
                              scores={"candidate": scores["control"][s.id]} if s.id in scores["control"] else {},
                              support_noise=null.support, numerics=null.numerics, noise_model=null.noise_model,
                              **null_for(vocoder_nulls.get(s.id), ctrl.results.get(s.id), vocoder_numerics)),
                     policy) for s in suite.segments]
