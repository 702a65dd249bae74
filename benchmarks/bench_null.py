"""The measured null's cost against the reference's own generation (issue #28: at most 0.5x).

    python benchmarks/bench_null.py [--suite cases/suites/smoke.yaml] [--dtype bfloat16] [-n 4]

In a fresh store, one reference runner (float32, as `difftest run` starts it): qwen-tts's reference
generation of the suite, then the null at 1 (the same segments decoded by qwen-tts in --dtype, codes
only, a second copy of the models loaded on first use) and its teacher forcing under float32
qwen-tts, then the null at N (the suite's waves of -n as `difftest run` sends them, each decoded as
qwen-tts batches it, codes only) and its teacher forcing; each timed from the driver, loads included.
Prints one JSON object with the ratios (null decode + its scoring) / reference generation, at 1 and
in all.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from difftest.engines.reference import ReferenceEngine, ReferenceOptions, reference_python, tiny_checkpoints  # noqa: E402
from difftest.engines.scorer import Scorer  # noqa: E402
from difftest.pipeline.scoring import score_streams  # noqa: E402
from difftest.pipeline.starting import start_reference_runner  # noqa: E402
from difftest.progress import Progress  # noqa: E402
from difftest.suites.suite import load_suite  # noqa: E402
from difftest.verdicts.null import batch_groups  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default=str(ROOT / "cases" / "suites" / "smoke.yaml"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("-n", "--concurrency", type=int, default=4, help="the waves of the null at N (default 4)")
    args = ap.parse_args(argv)
    suite = load_suite(args.suite)
    quiet = lambda label: Progress(len(suite.segments), label=label, stream=sys.stderr)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench-null-") as tmp:
        store = Path(tmp) / "store"
        py = reference_python()
        models = tiny_checkpoints(store, py)
        runner = start_reference_runner(py, models, ReferenceOptions(models=models), Path(tmp) / "runner.log",
                                        suite.family)
        try:
            engine = ReferenceEngine(runner, store, 900)
            t0 = time.perf_counter()
            ref = engine.generate(suite.segments, progress=quiet("reference"))
            t1 = time.perf_counter()
            null = engine.generate(suite.segments, dtype=args.dtype, codes_only=True, progress=quiet("null"))
            t2 = time.perf_counter()
            scorer = Scorer(runner, store, 900)
            scores, errors = score_streams(scorer, suite, {"null": null})
            t3 = time.perf_counter()
            ids = [s.id for s in suite.segments]
            waves = [ids[i:i + args.concurrency] for i in range(0, len(ids), args.concurrency)]
            batched = engine.generate_waves(batch_groups(suite.segments, waves), dtype=args.dtype)
            t4 = time.perf_counter()
            scores_n, errors_n = score_streams(scorer, suite, {"null_n": batched})
            t5 = time.perf_counter()
        finally:
            runner.close()
    if ref.errors or null.errors or errors["null"] or batched.errors or errors_n["null_n"]:
        print(json.dumps({"errors": {**ref.errors, **null.errors, **errors["null"], **batched.errors,
                                     **errors_n["null_n"]}}, default=str))
        return 3
    flips = sum(1 for sid in batched.results if not (null.results[sid].codes.shape == batched.results[sid].codes.shape
                                                     and (null.results[sid].codes == batched.results[sid].codes).all()))
    out = {"suite": suite.name, "segments": len(suite.segments), "null_dtype": args.dtype, "n": args.concurrency,
           "reference_s": round(t1 - t0, 2), "null_decode_s": round(t2 - t1, 2), "null_score_s": round(t3 - t2, 2),
           "null_n_decode_s": round(t4 - t3, 2), "null_n_score_s": round(t5 - t4, 2), "null_n_flips": flips,
           "ratio_at_1": round((t3 - t1) / (t1 - t0), 3), "ratio": round((t5 - t1) / (t1 - t0), 3), "goal": 0.5}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
