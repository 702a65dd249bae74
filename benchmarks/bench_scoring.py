"""Teacher-forced scoring against generation, for the same segments, in one run.

    python benchmarks/bench_scoring.py [--suite cases/suites/voice-clone-concurrency.yaml] [--frames 0]

Starts one reference runner (tiny checkpoints, one thread), generates every segment of the suite
into a fresh store (qwen-tts's own timing of its generate call, `generate_s`), then scores each
segment's own codes through the `score` job (the runner's `score_s`: prompt capture, one talker
pass, one batched code-predictor pass, the processors). Both sides run in the same process, on the
same loaded model, one after the other. `--frames N` overrides max_new_tokens (longer streams).
Prints one JSON object; the target is a ratio of at most 0.3.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET = 0.3


def main(argv=None) -> int:
    from difftest.engines.reference import ReferenceOptions, reference_python, runner_argv, tiny_checkpoints
    from difftest.process.runner_client import RunnerProcess
    from difftest.results import read_result
    from difftest.scores import read_scores
    from difftest.suites.suite import content_hash, load_suite

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default=str(REPO / "cases" / "suites" / "voice-clone-concurrency.yaml"))
    ap.add_argument("--frames", type=int, default=0, help="max_new_tokens for every segment (0: the suite's)")
    args = ap.parse_args(argv)
    suite = load_suite(args.suite)
    segments = suite.segments
    if args.frames:
        segments = [replace(s, decode={**s.decode, "max_new_tokens": args.frames}) for s in segments]
        segments = [replace(s, hash=content_hash(s.fingerprint())) for s in segments]
    python = reference_python()
    with tempfile.TemporaryDirectory(prefix="bench-scoring-") as tmp:
        tmp = Path(tmp)
        models = tiny_checkpoints(REPO / "difftest-store", python)
        runner = RunnerProcess(runner_argv(python, models, ReferenceOptions()), log_path=tmp / "runner.log", cwd=REPO)
        runner.start()
        try:
            gen = {e["segment"]: e for e in runner.request("generate", timeout=1800, segments=[s.to_job() for s in segments],
                                                           out_dir=str(tmp / "gen"), concurrency=1)
                   if e.get("event") == "result"}
            items = []
            for s in segments:
                r = read_result(gen[s.id]["path"])
                src = tmp / f"{s.id}.in.npz"
                np.savez(src, codes=r.codes, ref_codes=r.ref_codes)
                items.append({"name": s.id, "segment": s.to_job(), "input": str(src), "out": str(tmp / "scores" / s.id),
                              "condition": "given" if len(r.ref_codes) else "voice", "ended_by_eos": False})
            scored = {e["item"]: e for e in runner.request("score", timeout=1800, items=items)
                      if e.get("event") == "result"}
        finally:
            runner.close()
        generate_s = score_s = 0.0
        frames = 0
        for s in segments:
            r = read_result(gen[s.id]["path"])
            generate_s += float(r.timings["generate_s"])
            sf = read_scores(scored[s.id]["path"])
            score_s += float(sf.timings["score_s"])
            frames += sf.frames
    ratio = score_s / generate_s
    print(json.dumps({"suite": suite.name, "segments": len(segments), "frames": frames,
                      "generate_s": round(generate_s, 3), "score_s": round(score_s, 3),
                      "score_ms_per_frame": round(1000 * score_s / frames, 3), "ratio": round(ratio, 4),
                      "target": TARGET, "ok": ratio <= TARGET}, indent=1))
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
