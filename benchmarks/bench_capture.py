"""What difftest's capture costs the real vLLM-Omni server: the same waves with capture on and off.

    python benchmarks/bench_capture.py [--rounds 6] [--concurrency 4] [--max-new-tokens 32] [--checkpoint DIR]

Starts two `vllm serve --omni` servers on the tiny voice-clone checkpoint through
difftest.engines.vllm_omni, identical but for the capture plugin (`DIFFTEST_CAPTURE_DIR` set on
one, unset on the other, so the other has nothing imported and nothing patched; both keep the
vocoder eager and answer length-capped clones, as a difftest run does). Both stay up; waves of N
simultaneous voice clones (in-context and x-vector, greedy, seeded) go to one, then the other, in
ABBA order, so a machine that slows down over the run weighs on both alike. Every wave on the
capturing server must leave a capture file per request holding the talker's input (schema v3),
and none on the other: the code path measured is the one a run uses.

The wall-time ratio of two servers on two cores is noisy (waves of about a second, batches formed
by timing, two idle servers polling): the capture's own cost is therefore also counted where it is
spent. The plugin adds up, per process, the seconds its code runs outside the functions it wraps
(runners/vllm_omni/difftest_capture/difftest_capture/cost.py); their sum over the timed waves,
against those waves' wall time, is `capture_share`, an upper bound on what the capture adds to a
wave (it counts the talker's and the vocoder's processes, which run side by side, as if in series).

Prints one JSON object: per-round wall seconds on each server, the median of the per-pair ratios
(capture on / off), the capture's own seconds and `capture_share`, and `within_budget` (the share
against #29's 5%). One run; these machines are noisy.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from difftest.engines import capture as capture_files  # noqa: E402
from difftest.engines import vllm_omni as vo  # noqa: E402
from difftest.engines.speech_client import SpeechClient  # noqa: E402

TEXTS = ["Good morning, how are you today?", "The weather is lovely this afternoon.",
         "Guten Morgen, wie geht es dir?", "Thank you, see you tomorrow."]
VOICES = ["alba", "bruno", "chloe", "dario"]
BUDGET = 0.05


def body(i: int, tag: str, max_new_tokens: int) -> dict:
    """Request i of a wave: alternately an in-context and an x-vector clone of one of four voices."""
    v = VOICES[i % len(VOICES)]
    wav = (REPO / "cases" / "voices" / f"{v}.wav").read_bytes()
    b = {"input": TEXTS[i % len(TEXTS)], "task_type": "Base", "language": "English", "seed": i,
         "max_new_tokens": max_new_tokens, "response_format": "wav",
         "ref_audio": "data:audio/wav;base64," + base64.b64encode(wav).decode(),
         "extra_params": {"difftest_tag": tag, "temperature": 0.0, "repetition_penalty": 1.0}}
    if i % 2:
        b["x_vector_only_mode"] = True
    else:
        b["ref_text"] = (REPO / "cases" / "voices" / f"{v}.txt").read_text().strip()
    return b


def wave(client: SpeechClient, n: int, label: str, max_new_tokens: int) -> float:
    """Wall seconds for n simultaneous requests; raises on any that failed."""
    errors: list[str] = []
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait()
        try:
            client.speech(body(i, f"{label}-{i}", max_new_tokens))
        except Exception as e:  # noqa: BLE001 - reported below with the wave
            errors.append(f"{label}-{i}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"bench_capture: wave {label} failed: {errors[:3]}")
    return wall


def check_captured(capture: Path, label: str, n: int) -> None:
    """Each request of the wave left a capture with the talker's input: the path measured ran."""
    for i in range(n):
        path = capture_files.wait_for(capture, f"{label}-{i}", 30.0)
        if path is None:
            raise SystemExit(f"bench_capture: {capture}/{label}-{i}.npz was not written")
        if capture_files.load(path).inputs is None:
            raise SystemExit(f"bench_capture: {path} holds no talker input")


def capture_seconds(client: SpeechClient, capture: Path, max_new_tokens: int, label: str) -> dict[str, float]:
    """The capture's own seconds so far, per process: one request first, so that every process's
    count is flushed (cost.py rewrites it at most every 0.25 s, on a call)."""
    time.sleep(0.3)
    wave(client, 1, label, max_new_tokens)
    time.sleep(0.3)
    return {p.stem: json.loads(p.read_text())["seconds"] for p in (capture / ".difftest-capture" / "cost").glob("*.json")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="waves per server (even: ABBA order)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--checkpoint", help="a tiny base checkpoint (default: built with the reference env)")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    ckpt = a.checkpoint
    if ckpt is None:
        ckpt = str(work / "tiny-base")
        subprocess.run([str(REPO / ".venv-reference" / "bin" / "python"), "-m", "runners.reference.tiny_checkpoint",
                        ckpt, "--type", "base"], cwd=REPO, check=True, capture_output=True)
    n = a.concurrency
    base = dict(max_num_seqs=max(n, 4), repetition_penalty=1.0, accept_length_finish=True,
                talker_kv_cache_bytes=64 << 20, vocoder_kv_cache_bytes=16 << 20)
    result: dict = {"checkpoint": ckpt, "concurrency": n, "max_new_tokens": a.max_new_tokens, "cpus": os.cpu_count()}
    with ExitStack() as stack:
        servers = {}
        for side, on in (("on", True), ("off", False)):
            t0 = time.perf_counter()
            client, capture, info = vo.start_vllm_omni(work / side, [ckpt], vo.VllmOmniOptions(capture=on, **base),
                                                       stack, tasks={"voice_clone"})
            servers[side] = (client, capture)
            result[f"start_{side}_s"] = round(time.perf_counter() - t0, 1)
            result.setdefault("versions", info["versions"])
            print(f"bench_capture: server with capture {side} up in {result[f'start_{side}_s']} s", file=sys.stderr)
        assert servers["off"][1] is None
        for side in servers:  # a first wave each: warm-up, not timed
            wave(servers[side][0], n, f"warm-{side}", a.max_new_tokens)
        check_captured(servers["on"][1], "warm-on", n)
        spent_before = capture_seconds(servers["on"][0], servers["on"][1], a.max_new_tokens, "flush-before")
        walls: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(a.rounds):
            for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
                walls[side].append(round(wave(servers[side][0], n, f"r{r}-{side}", a.max_new_tokens), 3))
            check_captured(servers["on"][1], f"r{r}-on", n)
            print(f"bench_capture: round {r + 1}/{a.rounds}: on {walls['on'][-1]} s, off {walls['off'][-1]} s",
                  file=sys.stderr)
        after = capture_seconds(servers["on"][0], servers["on"][1], a.max_new_tokens, "flush-after")
        per_process = {pid: round(v - spent_before.get(pid, 0.0), 3) for pid, v in after.items()}
        spent = sum(per_process.values())
        written = sorted(p.name for p in servers["on"][1].glob("*.npz"))
    ratios = [on / off for on, off in zip(walls["on"], walls["off"])]
    cost = statistics.median(ratios) - 1.0
    result |= {"wall_on_s": walls["on"], "wall_off_s": walls["off"], "ratios": [round(x, 4) for x in ratios],
               "median_on_s": round(statistics.median(walls["on"]), 3),
               "median_off_s": round(statistics.median(walls["off"]), 3),
               "wall_ratio_median": round(cost + 1.0, 4), "capture_s": round(spent, 3),
               "capture_s_per_process": per_process,
               "capture_share_busiest_process": round(max(per_process.values(), default=0.0) / sum(walls["on"]), 4),
               "capture_share": round(spent / sum(walls["on"]), 4), "budget": BUDGET,
               "within_budget": spent / sum(walls["on"]) <= BUDGET, "capture_files": len(written)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
