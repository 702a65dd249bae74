"""The measured null's false-flag rate on a correct engine with bf16 numerics (issue #28).

    python benchmarks/bench_null_false_flags.py [--runs 24] [--talker-dtype bfloat16|float32] [--out DIR]

The candidate is the CPU test engine with its talker and encoders in bf16 (`--talker-dtype
bfloat16`, vocoder float32): qwen-tts itself, batched by the engine's own scheduler as requests
arrive, so a correct implementation in the numerics the null is decoded in, whose batches are not
the null's (the null batches the waves as sent; the engine batches what has arrived). Each run is
a whole `difftest run` (no repeat pass) over one combination of suite, order, arrival pattern and
concurrency, into one shared store. Per run: the overall verdict, the null's tests at 1 and at N
(p-values, flips and their widths), and which segments failed and why. `--talker-dtype float32`
runs the float32 engine instead: qwen-tts's own numerics, where no null is decoded and any greedy
token off qwen-tts's top-1 past a float32 tie fails its segment (issue 57): its false flags are that
rule's.

Prints one JSON object: per run, and the false-flag counts per test against the policy's stated
rate (1% per run, split over the tests).
"""

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from difftest.engines.start import CPU_ENGINE, CandidateSpec  # noqa: E402
from difftest.run import RunOptions, run  # noqa: E402
from difftest.suites.suite import load_suite  # noqa: E402
from difftest.verdicts.policy import load_policy  # noqa: E402

SUITES = ("smoke", "handoff-mix")
ORDERS = ("suite", "permuted", "mixed", "long-first")
PATTERNS = ("barrier", "pool", "staggered")


def engine(dtype: str) -> CandidateSpec:
    return CandidateSpec(CPU_ENGINE, engine_args=("--talker-dtype", dtype))


def one(suite, order: str, pattern: str, n: int, store: Path, out: Path, dtype: str = "bfloat16") -> dict:
    t0 = time.perf_counter()
    rep = run(suite, engine(dtype), out, load_policy(), RunOptions(concurrency=n, pattern=pattern, order=order, store=store,
                                                          repeat=False))
    at1, atn = rep.get("measured_null") or {}, rep.get("measured_null_at_n") or {}
    flips = atn.get("flips") or {}
    refused = [s["id"] for s in rep["segments"] if (s["comparisons"].get("near_tie") or {}).get("null_n")
               and not s["comparisons"]["near_tie"]["near_tie"]]
    return {"suite": suite.name, "order": order, "pattern": pattern, "n": n, "seconds": round(time.perf_counter() - t0, 1),
            "verdict": rep["verdict"], "failing": {s["id"]: s["verdict"] for s in rep["segments"] if s["id"] in rep["failing"]},
            "null_1": {"verdict": at1.get("verdict"), **{site: e["p_value"] for site, e in (at1.get("sites") or {}).items()}},
            "null_n": {"verdict": atn.get("verdict"), **{site: e["p_value"] for site, e in (atn.get("sites") or {}).items()},
                       "flips": [flips.get("candidate"), flips.get("null")], "flips_p": flips.get("p_value"),
                       "width_p": flips.get("width_p_value")},
            "near_ties_refused": refused, "batches": rep["candidate"]["batches"],
            "float32_ties": sorted(s["id"] for s in rep["segments"]
                                   if (s["comparisons"].get("forced") or {}).get("float32_ties"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=24, help="how many combinations, in a fixed order (default 24)")
    ap.add_argument("--talker-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--out", help="keep the run folders and the store here (default: a temporary folder)")
    args = ap.parse_args(argv)
    combos = list(itertools.product(SUITES, ORDERS, PATTERNS, (4,)))[:args.runs]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-null-ff-") as tmp:
        root = Path(args.out or tmp)
        suites = {name: load_suite(ROOT / "cases" / "suites" / f"{name}.yaml") for name in SUITES}
        for i, (name, order, pattern, n) in enumerate(combos):
            row = one(suites[name], order, pattern, n, root / "store", root / f"run-{i:02d}", args.talker_dtype)
            rows.append(row)
            print(f"[{i + 1}/{len(combos)}] {name} {order} {pattern} n={n}: {row['verdict']} "
                  f"(null at 1 {row['null_1']['verdict']}, at N {row['null_n']['verdict']}, "
                  f"flips {row['null_n']['flips']}, {row['seconds']} s)", file=sys.stderr, flush=True)
    flagged = lambda key: sum(1 for r in rows if r[key]["verdict"] not in (None, "pass"))  # noqa: E731
    out = {"runs": len(rows), "candidate": f"CPU test engine, talker {args.talker_dtype} (correct)", "stated_rate_per_run": 0.01,
           "false_flags": {"run": sum(1 for r in rows if r["verdict"] != "pass"), "null_at_1": flagged("null_1"),
                           "null_at_n": flagged("null_n"),
                           "near_ties_refused": sum(len(r["near_ties_refused"]) for r in rows)},
           "rows": rows}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
