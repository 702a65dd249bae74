"""Numerics against the last release, measured on a release against itself (issue #30 item 4).

    python benchmarks/bench_numerics_self.py [--runs 10] [--suite smoke] [-n 4] [--engine vllm-omni|cpu-bf16] [--out DIR]

One real vLLM-Omni server (the release in .venv-vllm-omni, the tiny checkpoint, capture on), or the
CPU test engine with its talker in bf16 (`--engine cpu-bf16`: qwen-tts batched by its own scheduler
as requests arrive, so its codes at N move with the batches), and `--runs` whole `difftest run`s of
one suite at concurrency N against it (no repeat pass), each with another request order and
arrival pattern, so the waves and the batches the engine forms differ from run to run. Every run is then held against every earlier one as `difftest gate
--baseline-version` holds a release against the last (difftest/verdicts/numerics.py): a
`numerics_regression` between two runs of the same release is a false flag. Prints one JSON object:
per run its counts, per pair the decision and the smallest p-value, and the false flags against the
policy's stated rate (1% per comparison).
"""

import argparse
import itertools
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from difftest.engines import vllm_omni as vo  # noqa: E402
from difftest.engines.reference import reference_python  # noqa: E402
from difftest.engines.start import CPU_ENGINE, CandidateSpec  # noqa: E402
from difftest.pipeline.starting import resolve_models  # noqa: E402
from difftest.run import RunOptions, run  # noqa: E402
from difftest.suites.suite import load_suite  # noqa: E402
from difftest.verdicts.numerics import compare  # noqa: E402
from difftest.verdicts.policy import load_policy  # noqa: E402

ARRIVALS = list(itertools.product(("suite", "permuted", "mixed", "long-first"), ("barrier", "pool", "staggered")))


def counts(rep: dict) -> dict:
    out = {}
    for key in ("measured_null", "measured_null_at_n"):
        f = rep.get(key) or {}
        out[key] = {site: [e["candidate"].get("off_top1", e["candidate"].get("outside_support")), e["candidate"]["tokens"]]
                    for site, e in (f.get("sites") or {}).items()}
        if f.get("flips"):
            out[key]["flips"] = [f["flips"]["candidate"], f["flips"].get("segments")]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--suite", default="smoke")
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--engine", choices=("vllm-omni", "cpu-bf16"), default="vllm-omni")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-numerics-self-"))
    suite = load_suite(ROOT / "cases" / "suites" / f"{args.suite}.yaml")
    policy = load_policy()
    store = out / "store"
    models = resolve_models(suite, RunOptions(store=store), reference_python(None))
    opts = vo.VllmOmniOptions.for_decode(suite.segments[0].decode, args.n, python=str(vo.omni_python()),
                                         accept_length_finish=True)
    reports, rows = [], []
    t0 = time.perf_counter()
    with ExitStack() as stack:
        if args.engine == "vllm-omni":
            tasks = {s.task for s in suite.segments}
            client, capture, info = vo.start_vllm_omni(out / "server", models, opts, stack, tasks=tasks)
            spec = CandidateSpec.parse(info["url"], capture_dir=str(capture))
        else:
            spec = CandidateSpec(CPU_ENGINE, engine_args=("--talker-dtype", "bfloat16"))
        for i in range(args.runs):
            order, pattern = ARRIVALS[i % len(ARRIVALS)]
            t = time.perf_counter()
            rep = run(suite, spec, out / f"run-{i}", policy,
                      RunOptions(concurrency=args.n, pattern=pattern, order=order, store=store, repeat=False))
            reports.append(rep)
            rows.append({"run": i, "order": order, "pattern": pattern, "verdict": rep["verdict"],
                         "seconds": round(time.perf_counter() - t, 1), "counts": counts(rep)})
            print(f"run {i + 1}/{args.runs} ({order}, {pattern}): {rep['verdict']} in {rows[-1]['seconds']} s",
                  file=sys.stderr, flush=True)
    pairs, flags = [], 0
    for j, i in itertools.combinations(range(len(reports)), 2):  # run i against the earlier run j as its baseline
        f = compare(reports[i], reports[j], policy.numerics, f"run {j}")
        flags += f["verdict"] == "numerics_regression"
        pairs.append({"run": i, "baseline": j, "verdict": f["verdict"], "tests": len(f["tests"]),
                      "min_p": min((t["p_value"] for t in f["tests"]), default=None)})
    print(json.dumps({"engine": args.engine, "suite": suite.name, "concurrency": args.n, "runs": rows, "pairs": pairs,
                      "false_flags": flags, "comparisons": len(pairs),
                      "stated_rate": policy.numerics.false_flag_rate,
                      "seconds": round(time.perf_counter() - t0, 1), "out": str(out)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
