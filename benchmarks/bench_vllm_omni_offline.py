"""What the vLLM-Omni offline candidate costs on this machine: engine start, batch wall time, memory.

    python benchmarks/bench_vllm_omni_offline.py [--levels 1,2,4,8] [--max-new-tokens 32] [--checkpoint DIR]
                                                 [--api batch|async]

Starts the offline runner (runners/vllm_omni_offline, `vllm_omni.Omni`) on the tiny Base checkpoint
through difftest.engines.vllm_omni (the CPU platform, capture on). A first `generate` job of one voice clone
starts the engine; then, for each level N, N distinct voice clones built from the smoke suite's voices
go as one wave (one batch). A level is "held" when every request came back with codes captured and
float32 audio equal, to the bit, to the capture's wav. Prints one JSON object: engine start seconds,
per-level wall time, per-request seconds, frames per second, the batching ratio
wall(N) / (N x wall(1)) measured in the same run, and the runner's process-tree RSS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_vllm_omni import tree_rss_mb  # noqa: E402

from difftest.engines import vllm_omni as vo  # noqa: E402
from difftest.engines.runner_candidate import run_candidate_runner  # noqa: E402
from difftest.suites.suite import content_hash, load_suite  # noqa: E402


def segments(smoke, n: int, label: str, max_new_tokens: int) -> list:
    """N voice clones cycling over the smoke suite's segments, each with its own id and text."""
    out = []
    for i in range(n):
        base = smoke.segments[i % len(smoke.segments)]
        text = base.text if i < len(smoke.segments) else f"{base.text} Take {i // len(smoke.segments) + 1}."
        seg = dataclasses.replace(base, id=f"{label}-{i}", text=text,
                                  decode={**base.decode, "max_new_tokens": max_new_tokens})
        out.append(dataclasses.replace(seg, hash=content_hash(seg.fingerprint())))
    return out


def wave(runner, segs: list, out_dir: Path) -> tuple[dict, float, dict]:
    """One generate job of `segs` as one batch: (level entry, wall seconds, one result's timings)."""
    t0 = time.perf_counter()
    outcome = run_candidate_runner(segs, runner, out_dir, concurrency=len(segs))
    wall = time.perf_counter() - t0
    results = list(outcome.results.values())
    held = len(results) == len(segs) and all(
        r.has_codes and r.wav.dtype == np.float32 and "capture_wav" in r.extra
        and np.array_equal(r.extra["capture_wav"], r.wav) for r in results)
    frames = sum(len(r.codes) for r in results)
    n = len(segs)
    entry = {"n": n, "held": held, "wall_s": round(wall, 2),
             "batch_s": round(max((r.timings.get("batch_seconds", 0.0) for r in results), default=0.0), 2),
             "per_request_s": round(wall / n, 3), "frames": frames, "frames_per_s": round(frames / wall, 1),
             "errors": sorted({e["message"][:200] for e in outcome.errors.values()})}
    return entry, wall, results[0].timings if results else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--checkpoint", help="a tiny base checkpoint (default: built with the reference env)")
    ap.add_argument("--api", choices=("batch", "async"), default="batch",
                    help="batch: Omni.generate, one call a wave; async: AsyncOmni, a request each, submitted together")
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.levels.split(",")]
    smoke = load_suite(REPO / "cases" / "suites" / "smoke.yaml")
    result: dict = {"api": a.api, "max_new_tokens": a.max_new_tokens, "max_num_seqs": max(levels),
                    "cpus": os.cpu_count()}
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vllm-omni-offline-")))
        ckpt = a.checkpoint
        if ckpt is None:
            ckpt = str(work / "tiny-base")
            subprocess.run([str(REPO / ".venv-reference" / "bin" / "python"), "-m",
                            "runners.reference.tiny_checkpoint", ckpt, "--type", "base"],
                           cwd=REPO, check=True, capture_output=True)
        result["checkpoint"] = ckpt if a.checkpoint else "tiny-base (built)"
        opts = vo.VllmOmniOptions(max_num_seqs=max(levels), repetition_penalty=1.0,
                                  talker_kv_cache_bytes=64 << 20, vocoder_kv_cache_bytes=16 << 20)
        t0 = time.perf_counter()
        # entered after the temporary folder, so the engine stops before its files go
        runner, info = vo.start_vllm_omni_offline(work / "run", [ckpt], opts, stack, tasks={"voice_clone"},
                                                  api=a.api)
        result["runner_start_s"] = round(time.perf_counter() - t0, 1)
        result["versions"] = info["versions"]
        first, first_wall, timings = wave(runner, segments(smoke, 1, "warm", a.max_new_tokens), work / "warm")
        if not timings:
            raise SystemExit(f"the first job failed: {first['errors']}")
        result["engine_start_s"] = timings.get("engine_start_s")
        result["first_job_s"] = round(first_wall, 2)
        result["first_batch_s"] = first["batch_s"]
        result["rss_idle_mb"] = tree_rss_mb(runner.proc.pid)
        result["levels"] = []
        walls: dict[int, float] = {}
        for n in levels:
            entry, walls[n], _ = wave(runner, segments(smoke, n, f"c{n}", a.max_new_tokens), work / f"c{n}")
            result["levels"].append(entry)
            print(json.dumps(entry), file=sys.stderr, flush=True)
        for entry in result["levels"]:
            entry["batching_ratio"] = round(walls[entry["n"]] / (entry["n"] * walls[1]), 3) if 1 in walls else None
        result["rss_after_mb"] = tree_rss_mb(runner.proc.pid)
        held = [r["n"] for r in result["levels"] if r["held"]]
        result["largest_held"] = max(held) if held else 0
        print(json.dumps(result, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
