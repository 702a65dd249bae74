"""The sampling test's false flags on a correct engine, over seeded runs (issue #31).

    python benchmarks/bench_sampling_false_flags.py [--candidate vllm-omni] [--suite cases/suites/sampled.yaml]
                                                   [--runs 20] [-n 4] [--out DIR]

One candidate server is started and serves every run; one reference runner too. Run r gives each
segment of the suite the seed 1000 r + k + 1 (all distinct) and is a whole `difftest run` (no
repeat pass): qwen-tts's reference, the candidate at N and at 1, teacher forcing, the measured
null where the candidate's numerics are not the reference's. Per run: the sampling test's verdict,
per role and site z, log E and PIT p, whether it was calibrated (qwen-tts's own samples and the
null's unflagged), and every segment that failed and why. The false-flag count is compared with
the policy's stated rate (`forced.sampling_false_flag_rate`, 1% a run).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    from difftest.engines.reference import ReferenceOptions, reference_python
    from difftest.engines.start import CandidateSpec, Setup, start_candidate
    from difftest.pipeline.starting import resolve_models, start_reference_runner
    from difftest.run import RunOptions, run
    from difftest.suites.suite import content_hash, load_suite
    from difftest.verdicts.policy import load_policy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidate", default="vllm-omni")
    ap.add_argument("--suite", default=str(REPO / "cases" / "suites" / "sampled.yaml"))
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("-n", "--concurrency", type=int, default=4)
    ap.add_argument("--out", help="keep the run folders and the store here (default: a temporary folder)")
    args = ap.parse_args(argv)
    base = load_suite(args.suite)
    policy = load_policy()
    rows = []
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        root = Path(args.out) if args.out else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ff-")))
        root.mkdir(parents=True, exist_ok=True)
        opts = RunOptions(concurrency=args.concurrency, store=root / "store", repeat=False)
        python = reference_python()
        models = resolve_models(base, opts, python)
        spec = CandidateSpec.parse(args.candidate, None)
        engine = start_candidate(spec, Setup((root / "candidate").resolve(), models, python, base, opts), stack)
        runner = start_reference_runner(python, models, ReferenceOptions(models=models), root / "reference-runner.log",
                                        base.family)
        stack.callback(runner.close)
        for r in range(args.runs):
            segs = []
            for k, s in enumerate(base.segments):
                s = replace(s, decode={**s.decode, "seed": 1000 * r + k + 1})
                segs.append(replace(s, hash=content_hash(s.fingerprint())))
            suite = replace(base, segments=segs, hash=content_hash({"base": base.hash, "run": r}))
            t = time.perf_counter()
            rep = run(suite, spec, root / f"run{r}", policy, opts, runner=runner, candidate=engine)
            smp = rep.get("sampling") or {}
            stats = {role: {site: {"z": s["z"], "log_e": (s.get("evalue") or {}).get("log_e"),
                                   "pit_p": (s.get("pit") or {}).get("p"),
                                   "temperature": (s.get("temperature") or {}).get("estimate")}
                            for site, s in st["parts"].items()} for role, st in (smp.get("statistics") or {}).items()}
            row = {"run": r, "seconds": round(time.perf_counter() - t, 1), "verdict": rep["verdict"],
                   "sampling": smp.get("verdict"), "calibrated": smp.get("calibrated"), "statistics": stats,
                   "failing": {s["id"]: s["verdict"] for s in rep["segments"] if s["id"] in rep["failing"]}}
            rows.append(row)
            print(f"[{time.perf_counter() - t0:7.1f} s] run {r}: {rep['verdict']}, sampling {row['sampling']}"
                  f"{'' if row['calibrated'] else ' (not calibrated)'}", file=sys.stderr, flush=True)
    flagged = [x["run"] for x in rows if x["sampling"] == "sampling_defect"]
    out = {"candidate": args.candidate, "suite": base.name, "concurrency": args.concurrency, "runs": len(rows),
           "sampling_flagged": len(flagged), "flagged_runs": flagged,
           "not_calibrated": [x["run"] for x in rows if x["calibrated"] is False],
           "stated_rate": policy.forced.sampling_false_flag_rate,
           "failed_for_other_reasons": {x["run"]: x["failing"] for x in rows if x["failing"]},
           "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
