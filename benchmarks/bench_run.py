"""`difftest run` end to end on CPU: where the wall time goes, and what the reference cache saves.

    python benchmarks/bench_run.py [--suite cases/suites/smoke.yaml] [-n 4]

Two runs of the suite against the CPU test engine into fresh run folders: the first with an empty
store, the second with the same store (the reference, its scores and cross-decodes cached). For
each: the wall time, the time in the model phases (every phase report.json times: building the tiny
checkpoints on first use, starting the reference runner, reference generation incl. loading, engine
start-up incl. loading, the candidate's requests at 1, at N and the repeat at 1, teacher forcing,
the measured null's decodes, cross-decodes through the reference vocoder) and the overhead ratio
wall / model phases (the tester's own work: comparison, verdicts, files, process plumbing). Before
stop 50 the repeat, teacher forcing and the null were counted as overhead. Prints one JSON object.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from difftest.run import CandidateSpec, RunOptions, run  # noqa: E402
from difftest.suites.suite import load_suite  # noqa: E402
from difftest.verdicts.policy import load_policy  # noqa: E402

MODEL_PHASES = ("checkpoints_s", "runner_start_s", "reference_s", "candidate_start_s", "candidate_c1_s",
                "candidate_repeat_s", "score_s", "null_s", "cross_decode_s")


def one(suite, store, out, n):
    t0 = time.perf_counter()
    rep = run(suite, CandidateSpec("cpu-engine"), out, load_policy(), RunOptions(concurrency=n, store=store))
    wall = time.perf_counter() - t0
    t = rep["provenance"]["timings"]
    model = sum(t.get(k, 0.0) for k in MODEL_PHASES) + t.get(f"candidate_c{n}_s", 0.0) * (n != 1)
    return {"wall_s": round(wall, 2), "model_phases_s": round(model, 2), "overhead_ratio": round(wall / model, 3),
            "timings": t, "verdict": rep["verdict"], "reference_cached_segments": rep["reference"]["cached_segments"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default=str(ROOT / "cases" / "suites" / "smoke.yaml"))
    ap.add_argument("-n", type=int, default=4)
    a = ap.parse_args()
    suite = load_suite(a.suite)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        first = one(suite, tmp / "store", tmp / "run1", a.n)
        second = one(suite, tmp / "store", tmp / "run2", a.n)
    print(json.dumps({"suite": suite.name, "concurrency": a.n, "first": first, "second_reference_cached": second,
                      "second_over_first_wall": round(second["wall_s"] / first["wall_s"], 3),
                      "target_overhead_ratio": 1.10, "target_second_over_first": 0.55}, indent=1))


if __name__ == "__main__":
    main()
