"""The talker's output: the candidate's codes teacher-forced under qwen-tts's talker, in the
context the candidate's talker had (difftest/compare/forced.py)."""

from __future__ import annotations

from dataclasses import replace

from ..compare import forced, own_margins
from ..engines.captured import captured
from . import null as measured_null
from .check import Check, Context
from .evidence import Evidence, Finding, chunk_of, reference_name
from .policy import Policy


def forced_findings(ev: Evidence, policy: Policy, comps: dict) -> list[Finding]:
    """The candidate's codes under teacher forcing: a stream qwen-tts could not have decoded as asked
    (conditioned on the candidate's own reference codes) is the talker's defect, at any concurrency."""
    sf = ev.scores.get("candidate")
    if sf is None:
        return []
    comps["forced"] = forced.summary(sf)
    fp, noise = policy.forced, ev.support_noise
    if noise is not None:  # measured: an exact sampler never leaves the support; else only a gross step fails alone
        exact = noise.get("exact", True) and not noise["outside"]
        fp = replace(fp, support_max_gap=0.0 if exact else fp.support_gross_gap)
        comps["forced"]["support_noise"] = {**noise, "allowed_gap": fp.support_max_gap}
    lines = measured_lines(ev, fp)
    if lines is not None:
        model = ev.noise_model
        comps["forced"]["measured_lines"] = {"codebook0": round(lines[0], 4), "codebooks_1_15": round(lines[1], 4),
                                             "policy": fp.max_gap, "dtype": model.dtype, "scale": model.scale}
    bad = forced.implausible(sf, fp, lines)
    if bad is None and (bad := _off_exact(ev, sf, fp, comps) or _off_noise(ev, sf, comps)) is not None:
        comps["forced"]["failed_by"] = "float32_tie" if (ev.numerics or {}).get("exact") else "noise_model"
    at = forced.first_difference(ev.reference.codes, ev.candidate.codes) if ev.reference is not None else None
    comps["forced"]["trace"] = forced.trace(sf, bad.frame if bad is not None else at[0] if at else None)
    own = captured(ev.candidate).own_topk
    if own is not None:  # how closely the candidate's own talker agrees with qwen-tts's, token by token
        greedy = not sf.settings.get("do_sample")
        why = own_margins.consistency(own, ev.candidate.codes, greedy=greedy)
        # sampled: qwen-tts's forced log-probabilities include the temperature, the capture's do not
        comps["forced"]["own_logprob_gap"] = (
            None if why or not greedy else own_margins.logprob_agreement(own, sf.arrays["logprob"][:, 0]))
        if why:
            comps["forced"]["own_unusable"] = why
        else:  # the candidate's own top-1/top-2 margin per frame, beside qwen-tts's trace (MLflow step = frame)
            t = comps["forced"]["trace"]
            comps["forced"]["trace"]["own_margin_codebook0"] = own_margins.margins(own, t["start"], t["end"])
    if bad is None:
        return []
    return [Finding("talker_defect", f"teacher-forced under {reference_name(ev.reference)}, the candidate's codes are "
                                      f"not what its talker "
                                      f"should decode: {bad.reason}" + bad.why,
                     frame=bad.frame, chunk=chunk_of(bad.frame, len(ev.candidate.codes), ev), stage="talker")]


def measured_lines(ev: Evidence, fp) -> tuple[float, float] | None:
    """The per-token gap lines (codebook 0, codebooks 1-15) are a measurement too: where qwen-tts in the
    candidate's numerics moves a site's margins further than `forced.max_gap` allows (`noise_scale` x
    the widest move its null showed: a checkpoint whose bf16 is that noisy, issue 58), the line at
    that site is that far, and the noise model judges each segment's widest flip under it. None where
    the policy's line holds."""
    model = ev.noise_model
    if model is None or (ev.numerics or {}).get("exact"):
        return None
    lines = tuple(max(fp.max_gap, model.widest(site)) for site in ("talker", "code_predictor"))
    return None if lines == (fp.max_gap, fp.max_gap) else lines


def _off_exact(ev: Evidence, sf, fp, comps: dict):
    """In qwen-tts's own numerics (the measured null is the reference itself) a greedy token off its
    top-1 by more than a float32 tie is decoded by no implementation in them (issue 57): no count
    over the run, no allowance. At N only where the stream at 1 leaves it too (a departure at N alone
    is the concurrency check's: batching in these numerics never parts, difftest/verdicts/null.py)."""
    numerics = ev.numerics or {}
    if not numerics.get("exact"):
        return None
    comps["forced"]["exact_tie_gap"] = fp.exact_tie_gap
    off = forced.off_exact(sf, fp.exact_tie_gap)
    if off is None and (ties := forced.on_ties(sf)):  # what float32 reordering can do: said, not failed
        f, c, g = ties[0]
        comps["forced"]["float32_ties"] = {"count": len(ties), "first": [f, c], "gap": g}
    at_one = ev.scores.get("control")
    if off is None or (ev.control is not None and at_one is not None and at_one is not sf
                       and forced.off_exact(at_one, fp.exact_tie_gap) is None):
        return None
    return replace(off, why=f"; the candidate's talker runs in qwen-tts's own numerics ({numerics.get('dtype')}: "
                            f"{numerics.get('from')}), where only a float32 tie moves a token")


def _off_noise(ev: Evidence, sf, comps: dict):
    """In other numerics, the segment's widest flip against the measured noise model
    (difftest/verdicts/null.py): a flip wider than those numerics make that often fails alone. At N
    only where the stream at 1 fails so too (a departure at N alone is the concurrency check's)."""
    model = ev.noise_model
    if model is None or (ev.numerics or {}).get("exact"):
        return None
    widest = measured_null.widest_flip(sf, model)
    if widest is None:
        return None
    comps["forced"]["noise"] = {**widest, "alpha": float(f"{model.alpha:.4g}")}
    if widest["p"] >= model.alpha:
        return None
    at_one = ev.scores.get("control")
    if ev.control is not None and at_one is not None and at_one is not sf:
        w1 = measured_null.widest_flip(at_one, model)
        if w1 is None or w1["p"] >= model.alpha:
            return None
    site = widest["site"].replace("_", " ")
    return forced.Implausible(
        widest["frame"], widest["codebook"],
        f"frame {widest['frame']} codebook {widest['codebook']}: {widest['gap']:.3g} nats off qwen-tts's top-1, "
        f"wider than qwen-tts in {model.dtype} moves a {site} token that often (expected flips this wide in this "
        f"stream: {widest['lambda']:.3g}, p = {widest['p']:.3g} against alpha {model.alpha:.3g}; the candidate's "
        f"kernels allowed {model.scale:g}x qwen-tts's own movement)")


def _forced(ev: Evidence, ctx: Context) -> list[Finding]:
    tf, comps, notes = forced_findings(ev, ctx.policy, ctx.comps), ctx.comps, ctx.notes
    if "forced" in comps and not tf:
        f = comps["forced"]
        notes.append(f"teacher-forced under {reference_name(ev.reference)} the candidate's codes are plausible "
                     f"({f['decoding']}: "
                     f"top-1 at {f['top1_share']:.0%} of frames, worst rank {f['worst_rank']}, "
                     f"worst gap {f['worst_gap']:.2g} nats)")
    if (t := comps.get("forced", {}).get("float32_ties")) and not tf:
        notes.append(f"suspect: its codes leave qwen-tts's top-1 only on float32 ties ({t['count']}, the first at "
                     f"frame {t['first'][0]} codebook {t['first'][1]}, {t['gap']:.2g} nats): float32 reordering "
                     f"moves qwen-tts's own margins that far (the tie width, {comps['forced']['exact_tie_gap']:g} "
                     f"nats), so no verdict alone; listen where the run fails")
    if "forced" not in comps:
        notes.append("no teacher-forced scores: the talker stage not judged")
    return tf


FORCED = Check("forced", gives=("talker_defect",), judge=_forced, applies=lambda ev: ev.candidate.has_codes)
