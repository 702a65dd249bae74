"""The sampling test's power and false-flag rate, measured over seeded runs (issue #31).

    python benchmarks/bench_sampling_power.py [--runs 20] [--suite cases/suites/sampled-power.yaml]
                                              [--workers 2] [--extra-runs 3] [--out FILE]

Each run gives every segment of the suite a fresh seed (run r, segment k: seed 1000 r + k + 1,
all distinct) and decodes it with qwen-tts (codes only) as asked (`clean`: a correct sampler) and
as each planted sampler defect would draw (`talker-temperature-hot` / `-cold`: the talker at the
asked temperature +/- 0.1, the CPU test engine's defects of the same names; with `--extra-runs`
runs each of the bank's other alternatives: top-p 0.8, the repetition penalty dropped or squared,
raw logits, the code predictor 0.1 hotter). Every variant's codes are teacher-forced under the
asked decode settings and judged by the sampling test (difftest/verdicts/sampling.py) at the
per-test false-flag rate of a run that judges two roles. A defect is caught when any of the test's
parts flags (z, e-value, PIT) or a token falls outside the support (the per-segment check).

Prints one JSON object: per variant, how many runs flagged and by what, the temperature estimates,
and the power the test predicted before judging; `clean` gives the false-flag rate against the
stated one. Runs go to `--workers` reference runners (one thread each) in parallel.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEP = 0.1
MAIN = ("clean", "talker-temperature-hot", "talker-temperature-cold")
EXTRA = ("top-p-applied", "repetition-penalty-dropped", "repetition-penalty-twice", "unprocessed-logits",
         "subtalker-temperature-hot")


def variant_decode(d: dict, name: str) -> dict:
    """The decode settings the variant's sampler actually uses (the CPU test engine's defect of that name)."""
    d = dict(d)
    if name == "talker-temperature-hot":
        d["temperature"] = d["temperature"] + STEP
    elif name == "talker-temperature-cold":
        d["temperature"] = d["temperature"] - STEP
    elif name == "top-p-applied":
        d["top_p"] = 0.8
    elif name == "repetition-penalty-dropped":
        d["repetition_penalty"] = 1.0
    elif name == "repetition-penalty-twice":
        d["repetition_penalty"] = d["repetition_penalty"] ** 2
    elif name == "unprocessed-logits":
        d.update(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    elif name == "subtalker-temperature-hot":
        d["subtalker_temperature"] = d["subtalker_temperature"] + STEP
    elif name != "clean":
        raise ValueError(name)
    return d


def main(argv=None) -> int:
    from difftest.engines.reference import ReferenceOptions, reference_python, runner_argv, tiny_checkpoints
    from difftest.engines.scorer import ScoreItem, Scorer
    from difftest.process.runner_client import RunnerProcess
    from difftest.results import read_result
    from difftest.suites.suite import content_hash, load_suite
    from difftest.verdicts import sampling

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default=str(REPO / "cases" / "suites" / "sampled-power.yaml"))
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--extra-runs", type=int, default=3, help="runs of each of the bank's other alternatives")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--false-flag-rate", type=float, default=0.01)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    suite = load_suite(args.suite)
    alpha = args.false_flag_rate / 8  # a run judges 2 roles x 2 sites x 2 tests
    python = reference_python()
    models = tiny_checkpoints(REPO / "difftest-store", python)
    jobs = [(r, v) for r in range(args.runs) for v in MAIN] + \
           [(r, v) for r in range(args.extra_runs) for v in EXTRA]
    t_start = time.perf_counter()

    def segments(r: int, decode_of) -> list:
        out = []
        for k, s in enumerate(suite.segments):
            s = replace(s, decode=decode_of({**s.decode, "seed": 1000 * r + k + 1}))
            out.append(replace(s, hash=content_hash(s.fingerprint())))
        return out

    scorers = {}

    def scorer_of(runner, tmp: Path):  # teacher forcing as `difftest run` asks for it, cached in a store per runner
        if id(runner) not in scorers:
            scorers[id(runner)] = Scorer(runner, tmp / f"store-{len(scorers)}", 3600)
        return scorers[id(runner)]

    def one(runner, tmp: Path, r: int, variant: str) -> dict:
        asked = segments(r, lambda d: d)
        drawn = segments(r, lambda d: variant_decode(d, variant))
        where = tmp / f"r{r}-{variant}"
        gen = {e["segment"]: e for e in runner.request("generate", timeout=3600, segments=[s.to_job() for s in drawn],
                                                       out_dir=str(where / "gen"), concurrency=1, codes_only=True)
               if e.get("event") == "result"}
        scored = scorer_of(runner, tmp).score({s.id: ScoreItem(s, (res := read_result(gen[s.id]["path"])).codes,
                                                               res.ref_codes if len(res.ref_codes) else None, False)
                                               for s in asked})
        scored = {sid: sf for sid, sf in scored.items() if not isinstance(sf, str)}
        outside = sum(int((~sf.arrays["in_support"]).sum()) for sf in scored.values())
        stat = sampling.statistic(list(scored.values()), alpha, f"bench-{r}-{variant}")
        flags = sampling._flags(stat, 4.0)
        parts = {p: {"z": s["z"], "log_e": s["evalue"]["log_e"], "line": s["evalue"]["line"],
                     "leading": s["evalue"]["leading"], "pit_p": s["pit"]["p"],
                     "temperature": s["temperature"]["estimate"], "ci95": s["temperature"]["ci95"],
                     "power_temperature_0.1": sampling.power_summary(stat).get(p, {}).get("temperature_0.1")}
                 for p, s in stat["parts"].items()}
        print(f"[{time.perf_counter() - t_start:7.1f} s] run {r} {variant}: "
              f"{'flagged' if flags or outside else 'pass'} ({len(flags)} flags, {outside} outside the support)",
              file=sys.stderr, flush=True)
        return {"run": r, "variant": variant, "flags": flags, "outside_support": outside, "parts": parts}

    with tempfile.TemporaryDirectory(prefix="bench-sampling-power-") as tmp:
        tmp = Path(tmp)
        runners = [RunnerProcess(runner_argv(python, models, ReferenceOptions()), log_path=tmp / f"runner{i}.log",
                                 cwd=REPO) for i in range(args.workers)]
        for rp in runners:
            rp.start()
        try:
            todo = queue.Queue()
            for job in jobs:
                todo.put(job)

            def worker(runner) -> list:  # a runner answers one request at a time: one thread each
                done = []
                while True:
                    try:
                        r, v = todo.get_nowait()
                    except queue.Empty:
                        return done
                    done.append(one(runner, tmp, r, v))

            with ThreadPoolExecutor(args.workers) as ex:
                rows = [row for f in [ex.submit(worker, rp) for rp in runners] for row in f.result()]
            rows.sort(key=lambda x: (x["run"], x["variant"]))
        finally:
            for rp in runners:
                rp.close()
    summary = {}
    for v in MAIN + EXTRA:
        got = [x for x in rows if x["variant"] == v]
        if not got:
            continue
        caught = [x for x in got if x["flags"] or x["outside_support"]]
        talker = [x["parts"]["talker"] for x in got]
        summary[v] = {"runs": len(got), "flagged": len(caught),
                      "by": sorted({f.split(":")[0] + ": " + f.split(":")[1].split(" ")[1] for x in got for f in x["flags"]}
                                   | ({"support"} if any(x["outside_support"] for x in got) else set())),
                      "talker_temperature_estimates": [t["temperature"] for t in talker],
                      "predicted_talker_power_temperature_0.1": [t["power_temperature_0.1"] for t in talker][:3]}
    out = {"suite": suite.name, "segments": len(suite.segments), "alpha_per_test": alpha,
           "stated_false_flag_rate_per_run": args.false_flag_rate, "seconds": round(time.perf_counter() - t_start, 1),
           "summary": summary, "runs": rows}
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    clean = summary.get("clean", {})
    return 0 if clean.get("flagged", 0) <= max(1, round(2 * args.false_flag_rate * clean.get("runs", 0))) else 1


if __name__ == "__main__":
    sys.exit(main())
