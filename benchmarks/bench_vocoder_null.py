"""The vocoder's measured null, read from finished runs: the margin's calibration and its power.

    python benchmarks/bench_vocoder_null.py OUT [OUT ...] [--margin M]

Each OUT is a `difftest run` folder whose candidate's vocoder ran in another dtype than the
reference's (report.json `comparisons.vocoder_null`). Per chunk where the candidate is not close to
qwen-tts's float32 decode of its codes (segments placed at the hand-off left out: their audio
is the hand-off's), the chunk's ratio is the larger of its two (RMS of the
difference, log-mel distance), the candidate's over qwen-tts's own vocoder's in that dtype: the
margin a correct engine needs there. Prints, per run and over all, the chunks and the ratio's
distribution, the false flags at --margin, and for planted defects (the candidate's own audio with
a gain, an offset, added noise or a one-sample shift) how many segments the vocoder check fails.
"""

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from difftest.results import read_result  # noqa: E402
from difftest.suites.suite import load_suite  # noqa: E402
from difftest.verdicts.evidence import Evidence  # noqa: E402
from difftest.verdicts.policy import load_policy  # noqa: E402
from difftest.verdicts.vocoder import vocoder_findings  # noqa: E402


def planted(wav: np.ndarray) -> dict:
    rms = float(np.sqrt(np.mean(wav.astype(np.float64) ** 2))) or 1.0
    rng = np.random.default_rng(0)
    out = {f"gain {g}": g * wav for g in (0.98, 0.95, 0.9)}
    out.update({f"offset {o:g}": wav + o for o in (1e-3, 1e-2, 3e-2)})
    out.update({f"noise {db} dB": wav + rms * 10 ** (db / 20) * rng.standard_normal(len(wav))
                for db in (-40, -30, -20)})
    return {**out, "shift 1 sample": np.concatenate([[0.0], wav[:-1]])}


def chunk_ratios(seg: dict) -> list[float]:
    """The margin each not-close chunk needs (None where the null is float32 exactly: infinite)."""
    tiers, r = seg["comparisons"]["vocoder"]["tiers"], seg["comparisons"]["vocoder_null"]["ratio"]
    out = []
    for c, t in enumerate(tiers):
        if t == "diverged":
            vals = [r[m][c] for m in r]
            out.append(float("inf") if None in vals else max(vals))
    return out


def summary(ratios: list[float], margin: float) -> dict:
    if not ratios:
        return {"chunks": 0}
    a = np.array(ratios)
    q = lambda p: round(float(np.quantile(a, p)), 3)  # noqa: E731
    return {"chunks": len(a), "min": q(0), "median": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": q(1),
            "false_flags": int((a > margin).sum())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--margin", type=float, default=None, help="default: the policy's vocoder_null.margin")
    ap.add_argument("--policy", default=None)
    args = ap.parse_args(argv)
    policy = load_policy(args.policy)
    margin = policy.vocoder_null_margin if args.margin is None else args.margin
    policy = replace(policy, vocoder_null_margin=margin)
    out, everything, caught = {"margin": margin, "runs": {}}, [], {}
    for run in args.runs:
        report = json.loads((run / "report.json").read_text())
        suite = load_suite(report["suite"]["path"])
        # a segment whose audio the hand-off already explains (the release's ref_code_len finding) is no
        # calibration of the vocoder: counted apart
        segs = [s for s in report["segments"] if "vocoder_null" in s["comparisons"] and s["stage"] != "handoff"]
        handoff = [s["id"] for s in report["segments"]
                   if "vocoder_null" in s["comparisons"] and s["stage"] == "handoff"]
        ratios, per_seg = [], {}
        for s in segs:
            r = chunk_ratios(s)
            ratios += r
            per_seg[s["id"]] = {"verdict": s["verdict"], "worst": max(r) if r else None,
                                "chunks": len(s["comparisons"]["vocoder"]["tiers"]), "not_close": len(r)}
            art = s["artifacts"]
            cand, cross, null = (read_result(art[k]) for k in ("candidate", "cross_own", "vocoder_null"))
            for name, wav in planted(cand.wav).items():
                ev = Evidence(segment_id=s["id"], candidate=replace(cand, wav=np.asarray(wav, np.float32)),
                              cross_own=cross,
                              initial_frames=suite.chunks["initial_frames"], chunk_frames=suite.chunks["frames"],
                              vocoder_null=null, vocoder_dtype=report["vocoder_numerics"]["dtype"])
                found = vocoder_findings(ev, policy, {}, {})
                caught.setdefault(name, [0, 0])
                caught[name][0] += any(f.kind in ("vocoder_defect", "vocoder_length") for f in found)
                caught[name][1] += 1
        everything += ratios
        out["runs"][str(run)] = {"suite": report["suite"]["name"], "verdict": report["verdict"],
                                 "segments": len(segs), **summary(ratios, margin), "left_out_handoff": handoff,
                                 "per_segment": per_seg}
    out["all"] = summary(everything, margin)
    out["planted"] = {k: f"{a} of {n} segments fail" for k, (a, n) in caught.items()}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
