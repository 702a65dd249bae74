"""The measured null's cost against the reference's own generation (issue #28: at most 0.5x).

    python benchmarks/bench_null.py [--suite cases/suites/smoke.yaml] [--dtype bfloat16]

In a fresh store, one reference runner (float32, as `difftest run` starts it): qwen-tts's reference
generation of the suite, then the null (the same segments decoded by qwen-tts in --dtype, a second
copy of the models loaded on first use), then the null's teacher forcing under float32 qwen-tts;
each timed from the driver, loads included. Prints one JSON object with the ratio
(null decode + its scoring) / reference generation.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from difftest.engines.reference import (  # noqa: E402
    ReferenceEngine, ReferenceOptions, reference_python, tiny_checkpoints)
from difftest.engines.scorer import Scorer  # noqa: E402
from difftest.progress import Progress  # noqa: E402
from difftest.run import score_streams, start_reference_runner  # noqa: E402
from difftest.suites.suite import load_suite  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default=str(ROOT / "cases" / "suites" / "smoke.yaml"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args(argv)
    suite = load_suite(args.suite)
    quiet = lambda label: Progress(len(suite.segments), label=label, stream=sys.stderr)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench-null-") as tmp:
        store = Path(tmp) / "store"
        py = reference_python()
        models = tiny_checkpoints(store, py)
        runner = start_reference_runner(py, models, ReferenceOptions(models=models), Path(tmp) / "runner.log")
        try:
            engine = ReferenceEngine(runner, store, 900)
            t0 = time.perf_counter()
            ref = engine.generate(suite.segments, progress=quiet("reference"))
            t1 = time.perf_counter()
            null = engine.generate(suite.segments, dtype=args.dtype, progress=quiet("null"))
            t2 = time.perf_counter()
            scores, errors = score_streams(Scorer(runner, store, 900), suite, {"null": null})
            t3 = time.perf_counter()
        finally:
            runner.close()
    if ref.errors or null.errors or errors["null"]:
        print(json.dumps({"errors": {**ref.errors, **null.errors, **errors["null"]}}, default=str))
        return 3
    out = {"suite": suite.name, "segments": len(suite.segments), "null_dtype": args.dtype,
           "reference_s": round(t1 - t0, 2), "null_decode_s": round(t2 - t1, 2), "null_score_s": round(t3 - t2, 2),
           "ratio": round((t3 - t1) / (t1 - t0), 3), "goal": 0.5}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
