"""A reference runner started fresh against one forked from the qwen-tts zygote: seconds until it
answers its first generate request (a tiny checkpoint, one short segment), in one run.

    python benchmarks/bench_zygote.py [--repeats 3]

Starts its own zygote (runners/zygote.py) in .venv-reference, times `--repeats` runners of each
kind alternately, and prints one JSON object with the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from difftest.engines import reference  # noqa: E402
from difftest.process import zygote  # noqa: E402
from difftest.process.runner_client import RunnerProcess  # noqa: E402
from difftest.suites.suite import load_suite  # noqa: E402

SUITE = """\
name: bench-zygote
model: tiny
decode: {repetition_penalty: 1.0, max_new_tokens: 8, seed: 3}
segments:
  - {id: d1, text: "Hello.", task: voice_design, instructions: "Calm."}
"""


def one(python: Path, models: list[str], env: dict, out: Path, seg) -> float:
    t0 = time.perf_counter()
    runner = RunnerProcess(reference.runner_argv(python, models, reference.ReferenceOptions()), env=env,
                           log_path=out / "runner.log")
    runner.start()
    try:
        events = list(runner.request("generate", segments=[seg.to_job()], out_dir=str(out)))
        assert any(e.get("event") == "result" for e in events), events
    finally:
        runner.close()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    python = reference.reference_python(None)
    work = Path(tempfile.mkdtemp(prefix="bench-zygote-"))
    models = [str(p) for p in reference.tiny_checkpoints(work / "store", python)]
    (work / "suite.yaml").write_text(SUITE)
    seg = load_suite(work / "suite.yaml").segments[0]
    sock = work / "z.sock"
    base = dict(os.environ, HF_HUB_OFFLINE="1")
    base.pop(zygote.ENV, None)
    z = subprocess.Popen([str(python), "-m", "runners.zygote", "--socket", str(sock)], cwd=ROOT, env=base,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.perf_counter()
    while not Path(str(sock) + ".env.json").exists():
        if z.poll() is not None:
            raise SystemExit("the zygote exited before it listened")
        time.sleep(0.1)
    zygote_start = time.perf_counter() - t0
    forked_env = dict(base, **{zygote.ENV: f"{python}={sock}"})
    times: dict[str, list[float]] = {"fresh": [], "forked": []}
    try:
        for i in range(args.repeats):
            for kind, env in (("fresh", base), ("forked", forked_env)):
                times[kind].append(one(python, models, env, work / f"{kind}{i}", seg))
                print(f"{kind} {i + 1}/{args.repeats}: {times[kind][-1]:.2f} s", file=sys.stderr, flush=True)
        forks = zygote.stats(str(sock))["forks"]
    finally:
        z.terminate()
        z.wait(10)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"repeats": args.repeats, "zygote_start_s": round(zygote_start, 2), "forks": forks,
                      "fresh_s": [round(x, 2) for x in times["fresh"]],
                      "forked_s": [round(x, 2) for x in times["forked"]],
                      "median_fresh_s": round(med["fresh"], 2), "median_forked_s": round(med["forked"], 2),
                      "forked_over_fresh": round(med["forked"] / med["fresh"], 3)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
