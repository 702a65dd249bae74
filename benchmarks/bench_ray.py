"""The reference side in-process against a local Ray cluster, one run each, on one machine.

    python benchmarks/bench_ray.py [--suite cases/suites/voice-clone-concurrency.yaml] [--workers 2]

Three `difftest run --candidate cpu-engine -n 4 --no-repeat --no-mlflow` of the same suite, each
into a fresh store (so the reference side is computed every time): in-process (one reference
runner), on a local Ray cluster (`ray.cluster_utils.Cluster`: a head without CPUs and one raylet
of one CPU per worker) with 1 worker, and with `--workers` workers. The reference side is what
`--ray` moves: generation, teacher forcing and cross-decodes (report timings `reference_s`,
`score_s`, `cross_decode_s`). Prints one JSON object:

- `ratio`: the reference side on N workers over in-process; `ideal` is 1/N (it needs N free cores);
- `overhead_per_segment_s`: (Ray with 1 worker - in-process) / segments: what Ray's transport,
  the chunking and a runner per actor cost a segment;
- each run's wall time and phase timings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDE = ("reference_s", "score_s", "cross_decode_s")


def one_run(suite: str, work: Path, name: str, *extra: str) -> dict:
    out, store = work / name, work / f"store-{name}"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "difftest", "run", suite, "--candidate", "cpu-engine", "-n", "4",
                        "--no-repeat", "--no-mlflow", "--out", str(out), "--store", str(store), *extra],
                       capture_output=True, text=True, cwd=work)
    wall = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        raise SystemExit(f"{name}: difftest run exited {r.returncode}:\n{r.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    t = report["provenance"]["timings"]
    return {"wall_s": round(wall, 1), "reference_side_s": round(sum(t.get(k, 0.0) for k in SIDE), 2),
            "timings": t, "segments": report["suite"]["segments"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default=str(REPO / "cases" / "suites" / "voice-clone-concurrency.yaml"))
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    import ray
    from ray.cluster_utils import Cluster

    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        work = Path(tmp)
        local = one_run(args.suite, work, "local")
        results = {"local": local}
        for n in sorted({1, args.workers}):
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
            for _ in range(n):
                cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            try:
                results[f"ray_{n}"] = one_run(args.suite, work, f"ray{n}", "--ray", cluster.address,
                                              "--ray-workers", str(n))
            finally:
                ray.shutdown()
                cluster.shutdown()
    segs = local["segments"]
    side = {k: v["reference_side_s"] for k, v in results.items()}
    print(json.dumps({
        "suite": Path(args.suite).name, "segments": segs, "workers": args.workers,
        "ratio": round(side[f"ray_{args.workers}"] / side["local"], 3), "ideal": round(1 / args.workers, 3),
        "overhead_per_segment_s": round((side["ray_1"] - side["local"]) / segs, 3),
        "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
