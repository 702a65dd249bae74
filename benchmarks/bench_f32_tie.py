"""How far float32 reordering moves qwen-tts's own token scores: the float32 tie width (issue 57, item 1).

    python benchmarks/bench_f32_tie.py [--suite smoke --suite voice-clone-concurrency ...] [--out FILE]
        [--against threads|bfloat16]

A candidate in qwen-tts's own numerics (float32, the measured null the reference itself) can put a
greedy token off qwen-tts's top-1 only where the top-1 and that token lie closer than the rounding
its kernels' other reduction order makes. This measures that rounding on qwen-tts itself, per token:

- the same streams teacher-forced by a runner with 1 thread and by one with 2 (another reduction
  order in every matmul), and forced again cut to their first half (other GEMM shapes);
- every suite's greedy segments decoded again in batches of up to 4 (qwen-tts's own batched
  generation, with padding: the CPU test engine's path at concurrency N) against alone.

Per token (all 16 codebooks, greedy positions) the change in qwen-tts's top-1/top-2 margin and in
the forced token's log-probability gap to the top-1 between the two evaluations. The widest is the
tie width: the policy's `forced.exact_tie_gap` must be no narrower. Prints one JSON object.

`--against bfloat16`: the second runner is qwen-tts in bf16 (one thread) instead: how far bf16
numerics move qwen-tts's own margins per token (issue 57, item 2's noise model), on float32
qwen-tts's streams and on bf16 qwen-tts's own (the measured null's), with the gaps at which the bf16
streams leave float32's top-1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SUITES = ("smoke", "voice-clone-concurrency", "handoff-mix")
BATCH = 4


def _generate(runner, segments, out: Path, waves=None) -> dict:
    from difftest.results import read_result

    kw = {"waves": waves} if waves else {}
    got = {}
    for e in runner.request("generate", timeout=3600, segments=[s.to_job() for s in segments], out_dir=str(out),
                            concurrency=1, codes_only=True, **kw):
        if e.get("event") == "result":
            got[e["segment"]] = read_result(e["path"])
        elif e.get("event") == "error":
            raise RuntimeError(f"{e.get('segment')}: {e.get('message')}")
    return got


def _score(runner, segments, results: dict, tmp: Path, tag: str, frames: dict | None = None) -> dict:
    from difftest.scores import read_scores

    items = []
    for s in segments:
        r = results[s.id]
        codes = r.codes[: frames[s.id]] if frames else r.codes
        src = tmp / f"{tag}-{s.id}.in.npz"
        np.savez(src, codes=codes, ref_codes=r.ref_codes)
        items.append({"name": s.id, "segment": s.to_job(), "input": str(src), "out": str(tmp / tag / s.id),
                      "condition": "given" if len(r.ref_codes) else "voice", "ended_by_eos": False})
    out = {}
    for e in runner.request("score", timeout=3600, items=items):
        if e.get("event") == "result":
            out[e["item"]] = read_scores(e["path"])
        elif e.get("event") == "error":
            raise RuntimeError(f"score {e.get('item')}: {e.get('message')}")
    return out


def _moved(a, b, frames: int | None = None) -> dict:
    """Per-token change between two scorings of one stream (its first `frames` frames)."""
    n = frames or min(a.frames, b.frames)
    da = np.abs(a.arrays["margin"][:n].astype(np.float64) - b.arrays["margin"][:n])
    dg = np.abs(a.gap[:n].astype(np.float64) - b.gap[:n])
    dt = np.abs(a.arrays["top1_logprob"][:n].astype(np.float64) - b.arrays["top1_logprob"][:n])
    return {"tokens": int(da.size), "margin": da, "gap": dg, "top1_logprob": dt,
            "top1_changed": int((a.arrays["top1"][:n] != b.arrays["top1"][:n]).sum())}


def _summary(parts: list[dict]) -> dict:
    if not parts:
        return {"tokens": 0}
    out = {"tokens": sum(p["tokens"] for p in parts), "top1_changed": sum(p["top1_changed"] for p in parts)}
    for k in ("margin", "gap", "top1_logprob"):
        v = np.concatenate([p[k].ravel() for p in parts])
        out[k] = {"max": float(v.max()), "p99": float(np.quantile(v, 0.99)), "median": float(np.median(v)),
                  "zero_share": round(float(np.mean(v == 0)), 4)}
    return out


def main(argv=None) -> int:
    from difftest.engines.reference import ReferenceOptions, reference_python, runner_argv, tiny_checkpoints
    from difftest.process.runner_client import RunnerProcess
    from difftest.suites.suite import load_suite
    from difftest.verdicts.null import greedy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", action="append", default=None, help=f"suite name or path (default: {', '.join(SUITES)})")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--against", default="threads", choices=("threads", "bfloat16"))
    args = ap.parse_args(argv)
    suites = [load_suite(s if s.endswith(".yaml") else REPO / "cases" / "suites" / f"{s}.yaml")
              for s in (args.suite or SUITES)]
    python = reference_python()
    per_suite, threads, cut, batched, smallest = {}, [], [], [], []
    on_null, flip_gaps, null_tokens = [], [], [0]
    with tempfile.TemporaryDirectory(prefix="bench-f32-tie-") as tmp:
        tmp = Path(tmp)
        models = tiny_checkpoints(REPO / "difftest-store", python)
        one = RunnerProcess(runner_argv(python, models, ReferenceOptions(threads=1)), log_path=tmp / "r1.log", cwd=REPO)
        other = ReferenceOptions(threads=2) if args.against == "threads" else ReferenceOptions(dtype="bfloat16")
        two = RunnerProcess(runner_argv(python, models, other), log_path=tmp / "r2.log", cwd=REPO)
        one.start()
        two.start()
        try:
            for suite in suites:
                segs = [s for s in suite.segments if greedy(s)]
                alone = _generate(one, segs, tmp / suite.name / "alone")
                by_task: dict = {}
                for s in segs:
                    by_task.setdefault((s.task, tuple(sorted((k, str(v)) for k, v in s.decode.items()
                                                             if k != "seed"))), []).append(s.id)
                waves = [ids[i:i + BATCH] for ids in by_task.values() for i in range(0, len(ids), BATCH)]
                together = _generate(one, segs, tmp / suite.name / "batched", waves=waves)
                s1 = _score(one, segs, alone, tmp, f"{suite.name}-t1")
                s2 = _score(two, segs, alone, tmp, f"{suite.name}-t2")
                if args.against == "bfloat16":  # the null's own streams, scored both ways, and where they flip
                    null = _generate(two, segs, tmp / suite.name / "null")
                    n1 = _score(one, segs, null, tmp, f"{suite.name}-n1")
                    n2 = _score(two, segs, null, tmp, f"{suite.name}-n2")
                    for s in segs:
                        on_null.append(_moved(n1[s.id], n2[s.id]))
                        r, g = n1[s.id].arrays["rank"], n1[s.id].gap
                        flip_gaps.extend(float(x) for x in g[r > 0])
                        null_tokens[0] += int(r.size)
                half = {s.id: max(1, len(alone[s.id].codes) // 2) for s in segs}
                sh = _score(one, segs, alone, tmp, f"{suite.name}-half", frames=half)
                flips = {}
                for s in segs:
                    a, b = alone[s.id].codes, together[s.id].codes
                    if a.shape != b.shape or (a != b).any():
                        n = min(len(a), len(b))
                        d = np.argwhere(a[:n] != b[:n])
                        flips[s.id] = [int(d[0][0]), int(d[0][1])] if len(d) else [n, 0]
                    threads.append(_moved(s1[s.id], s2[s.id]))
                    cut.append(_moved(s1[s.id], sh[s.id], half[s.id]))
                    smallest.append(float(s1[s.id].arrays["margin"].min()))
                batched.append({"suite": suite.name, "segments": len(segs), "waves": len(waves), "parted": flips})
                per_suite[suite.name] = {"segments": len(segs), "frames": int(sum(len(alone[s.id].codes) for s in segs))}
                print(f"{suite.name}: {len(segs)} segments done", file=sys.stderr, flush=True)
        finally:
            one.close()
            two.close()
    t, c = _summary(threads), _summary(cut)
    width = max(t["margin"]["max"], t["gap"]["max"], c["margin"]["max"], c["gap"]["max"])
    report = {"suites": per_suite, "threads_1_vs_2": t, "whole_vs_first_half": c, "batched_vs_alone": batched,
              "smallest_own_margin": min(smallest) if smallest else None, "tie_width": width}
    if args.against == "bfloat16":
        report = {"suites": per_suite, "float32_streams_bf16_vs_f32": t, "bf16_streams_bf16_vs_f32": _summary(on_null),
                  "null_flips": {"tokens": null_tokens[0], "off_top1": len(flip_gaps),
                                 "gaps": sorted(round(g, 5) for g in flip_gaps)},
                  "float32_streams_whole_vs_first_half": c}
    if args.against == "bfloat16" and args.out:  # every |delta|, per site, for a tail model's fit
        cols = {"talker": slice(0, 1), "code_predictor": slice(1, None)}
        np.savez(Path(args.out).with_suffix(".npz"), **{
            f"{name}_{site}": np.concatenate([p["margin"][:, c].ravel() for p in parts])
            for name, parts in (("float32_streams", threads), ("bf16_streams", on_null)) for site, c in cols.items()})
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
