"""The measured null: qwen-tts in the candidate talker's numerics, alone and batched as the
candidate's waves, teacher-forced; the run-level findings at 1 and at N (difftest/verdicts/null.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..engines.reference import ReferenceEngine
from ..engines.scorer import Scorer
from ..suites.suite import Suite
from ..verdicts import null as measured_null
from ..verdicts.policy import Policy
from .scoring import score_streams


def null_finding(suite: Suite, scorer: Scorer, ref_engine: ReferenceEngine, ref_run, control: dict,
                 numerics: dict, policy: Policy, share: float = 1.0) -> tuple[dict | None, list[str], tuple | None]:
    """The measured null's run-level test of the candidate's streams at concurrency 1 (`control`:
    segment -> ScoreFile), warnings for the segments it could not decode or score, and the null
    itself (`_null_alone`'s answer, for the run at N; None when not decoded). The null is qwen-tts
    in the candidate talker's dtype (`numerics`): the reference itself when that is the reference's
    own, else decoded (codes only, cached in the store) now; none at all when no greedy token needs
    explaining. `share`: the part of the run's false-flag rate it spends."""
    if not measured_null.needed(control):
        return measured_null.judge(control, None, policy.null, numerics, share=share), [], None, None
    alone = _null_alone(suite, scorer, ref_engine, ref_run, numerics, [s for s in suite.segments if s.id in control])
    finding = measured_null.judge(control, alone[1], policy.null, numerics, share=share)
    model, warnings = _noise_model(suite, scorer, alone, numerics, policy, len(control))
    if finding is not None and model is not None:
        finding["noise_model"] = model.to_json()
    return finding, alone[2] + warnings, alone, model


def _noise_model(suite: Suite, scorer: Scorer, alone, numerics: dict, policy: Policy, segments: int):
    """The null's streams scored by qwen-tts in their own numerics too: how far those numerics move each
    margin (null.NoiseModel), for each segment's own flips. None in the reference's own numerics (the
    float32 tie rule judges there) or where nothing could be scored."""
    if numerics["exact"] or not alone[1]:
        return None, []
    own = Scorer(scorer.runner, scorer.store_root, scorer.timeout, dtype=numerics["dtype"])
    got, errors = score_streams(own, suite, {"null": alone[0]}, set(alone[1]))
    warnings = [f"{sid}: measured null's noise model, scoring in {numerics['dtype']}: {m}"
                for sid, m in errors["null"].items()]
    p = policy.null
    return measured_null.noise_model(alone[1], got["null"], numerics["dtype"], p.noise_scale,
                                     p.segment_false_flag_rate, segments), warnings


def _null_alone(suite: Suite, scorer: Scorer, ref_engine: ReferenceEngine, ref_run, numerics: dict, segments: list):
    """qwen-tts in the null's dtype, each segment alone (the reference itself where that is its own
    dtype), teacher-forced: (its run, segment -> ScoreFile, warnings, what it is). Sets numerics["null"]."""
    dtype = numerics["dtype"]
    own = dtype == ref_run.fingerprint.get("dtype")
    null_run = ref_run if own else ref_engine.generate(segments, dtype=dtype, codes_only=True)
    numerics["null"] = ("the reference itself" if own
                        else f"{suite.family.reference_name} in {dtype}, cached at {null_run.config_dir}")
    got, errors = score_streams(scorer, suite, {"null": null_run}, {s.id for s in segments})
    wanted = {s.id for s in segments}
    warnings = [f"{sid}: measured null: {e['message']}" for sid, e in null_run.errors.items() if sid in wanted]
    warnings += [f"{sid}: measured null, teacher forcing: {m}" for sid, m in errors["null"].items()]
    return null_run, got["null"], warnings, numerics["null"]


def null_at_n_finding(suite: Suite, scorer: Scorer, ref_engine: ReferenceEngine, ref_run, cand, ctrl,
                      scores_1: dict, scores_n: dict, numerics: dict, policy: Policy, at_one: str | None,
                      alone: tuple | None = None) -> tuple[dict | None, dict | None, list[str]]:
    """The run at concurrency N against the null batched as its waves (difftest/verdicts/null.py):
    (the run-level finding, the null's batch noise for the near-tie rule, warnings). Nothing is
    decoded where nothing needs explaining: no greedy segment's codes part between 1 and N, and
    every greedy token at N is qwen-tts's top-1. `alone`: the null at 1, where already decoded."""
    ok = lambda s: all(s.id in o.results and o.results[s.id].has_codes for o in (cand, ctrl))  # noqa: E731
    groups = [kept for g in measured_null.batch_groups(suite.segments, cand.batches)
              if (kept := [s for s in g if ok(s)])]
    ids = [s.id for g in groups for s in g]
    flips = {}  # segment -> where its greedy codes at N part from those at 1, and the width of that tie
    for sid in ids:
        if (at := measured_null.flip_at(ctrl.results[sid].codes, cand.results[sid].codes)) is not None:
            gap = measured_null.flip_gap(scores_1.get(sid), scores_n.get(sid), at)
            flips[sid] = {"frame": at[0], "codebook": at[1], "gap": gap}
    scored = {sid: sf for sid, sf in scores_n.items() if sid in set(ids)}
    numerics = dict(numerics)
    if not flips and not measured_null.needed(scored):
        return measured_null.judge_at_n(scored, None, None, {}, policy.null, numerics, at_one), None, []
    if alone is None or not set(ids) <= set(alone[0].results) | set(alone[0].errors):
        alone = _null_alone(suite, scorer, ref_engine, ref_run, numerics, [s for g in groups for s in g])
        warnings = alone[2]
    else:
        warnings = []  # said already, at 1
        numerics["null"] = alone[3]
    alone, alone_scores = alone[0], alone[1]
    if not ref_engine.runner.hello.get("generate_waves", True):
        # a reference that decodes one request at a time (transformers' Qwen3-Omni): the tokens at N are
        # counted against the null alone, and a flip between 1 and N is judged by the per-token near-tie
        # rule only, with no batch noise to widen it
        numerics["null_n"] = f"none: {suite.family.display}'s reference cannot batch; the null alone stands for it"
        warnings.append(f"measured null at N: not measured ({suite.family.display}'s reference decodes one request "
                        f"at a time); the tokens at N are judged against the null alone, and a flip between 1 and "
                        f"N by the per-token near-tie rule")
        finding = measured_null.judge_at_n(scored, {s: sf for s, sf in alone_scores.items() if s in set(ids)}, None,
                                           flips, policy.null, numerics, at_one)
        return finding, None, warnings
    batched = ref_engine.generate_waves(groups, dtype=numerics["dtype"])
    got, errors = score_streams(scorer, suite, {"null_n": batched}, set(ids))
    warnings += [f"{sid}: measured null at N: {e['message']}" for sid, e in batched.errors.items()]
    warnings += [f"{sid}: measured null at N, teacher forcing: {m}" for sid, m in errors["null_n"].items()]
    both = [sid for sid in ids if sid in alone.results and sid in batched.results]
    noise = measured_null.batch_noise(alone.results, batched.results, alone_scores, got["null_n"], both, numerics)
    numerics["null_n"] = (f"{suite.family.reference_name} in {numerics['dtype']}, the candidate's waves as "
                          f"{len(groups)} batches")
    finding = measured_null.judge_at_n(scored, got["null_n"], noise, {s: a for s, a in flips.items() if s in both},
                                       policy.null, numerics, at_one)
    missing = sorted(set(ids) - set(both))
    if missing and finding["verdict"] == "pass":  # never a pass on a null that is not there
        finding.update(verdict="error", summary=f"the measured null at N ({suite.family.reference_name} in {numerics['dtype']}, batched) "
                                                f"has no stream for {', '.join(missing)}: the run's warnings say why")
    return finding, noise, warnings


@dataclass
class MeasuredNull:
    """What the null phase measured, for the verdicts and the report."""
    numerics: dict  # the candidate talker's: dtype, where it was read, exact (the reference's own), the null's source
    at_one: dict | None  # the run-level finding at concurrency 1 (report.json `null`)
    at_n: dict | None  # at N (`null_n`)
    warnings: list[str]
    alone: tuple | None  # _null_alone's answer, where decoded
    noise_model: object | None  # null.NoiseModel: how far the numerics move qwen-tts's margins
    batch_noise: dict | None  # what batching does to qwen-tts in those numerics (the near-tie rule)
    support: dict | None  # how often qwen-tts in them samples outside the support

    def sampling_roles(self, scores: dict) -> dict:
        """The streams that calibrate the sampling test: qwen-tts's samples in the candidate's numerics
        too, where those are not the reference's own (the reference's samples say it already)."""
        return {**scores, **({"null": self.alone[1]} if self.alone and not self.numerics["exact"] else {})}


def unmeasured(engine: dict, declared_dtype, ctrl, ref_run, why: str, reference: str) -> MeasuredNull:
    """No null: the reference cannot teacher-force (Qwen3-Omni's runner, issue 60). The candidate's
    numerics are still read and stated; where they are not the reference's nothing excuses a drift."""
    dtype, source = measured_null.talker_dtype(engine, declared_dtype, ctrl.results)
    numerics = {"dtype": dtype, "from": source, "exact": dtype == ref_run.fingerprint.get("dtype"), "null": None,
                "reference": reference}
    return MeasuredNull(numerics, None, None, [f"measured null: not measured ({why})"], None, None, None, None)


def measure(suite: Suite, scorer: Scorer, ref_engine: ReferenceEngine, ref_run, engine: dict, declared_dtype,
            concurrency: int, cand, ctrl, scores: dict, policy: Policy) -> MeasuredNull:
    """The null at 1 and, for a run at N, at N. `scores`: role -> segment -> ScoreFile of the candidate's
    streams; `declared_dtype`: the candidate talker's dtype as the user declared it (else read)."""
    dtype, source = measured_null.talker_dtype(engine, declared_dtype, ctrl.results)
    # exact: the reference's own numerics, where the null's counts of zero are structure, not chance
    numerics = {"dtype": dtype, "from": source, "exact": dtype == ref_run.fingerprint.get("dtype"),
                "reference": suite.family.reference_name}
    at_n = concurrency > 1  # the run at N spends half the false-flag rate (null.judge_at_n)
    null, warnings, alone, noise_model = null_finding(suite, scorer, ref_engine, ref_run, scores["control"], numerics,
                                                      policy, share=0.5 if at_n else 1.0)
    null_n, noise, warnings_n = (null_at_n_finding(suite, scorer, ref_engine, ref_run, cand, ctrl, scores["control"],
                                                   scores["candidate"], numerics, policy, null and null["verdict"],
                                                   alone)
                                 if at_n else (None, None, []))
    return MeasuredNull(numerics, null, null_n, warnings + warnings_n, alone, noise_model, noise,
                        measured_null.support_noise(null))
