"""What the vLLM-Omni candidate costs on this machine: start, memory, latency, concurrency held.

    python benchmarks/bench_vllm_omni.py [--levels 1,2,4,8,16] [--max-num-seqs 16] [--max-new-tokens 32]
                                         [--checkpoint DIR] [--serve-seconds 0]

Starts `vllm serve --omni` on the tiny voice-clone checkpoint through difftest.engines.vllm_omni (the CPU
platform, capture on, length-capped voice clones answered), then sends waves of N simultaneous
voice-clone requests for each level. A level is "held" when every request of the wave answered
200 with a capture file. Prints one JSON object: start seconds, the server's process-tree RSS
(idle and after the largest wave), per-level wall time, per-request latency and frames per second.
With --serve-seconds S it then keeps serving for S seconds (prints the URL and capture folder
first), e.g. for a `difftest run --candidate URL --capture-dir DIR` from another shell.
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

from difftest.engines import vllm_omni as vo  # noqa: E402
from difftest.engines.speech_client import SpeechClient, SpeechError  # noqa: E402

TEXTS = ["Good morning, how are you today?", "The weather is lovely this afternoon.",
         "Guten Morgen, wie geht es dir?", "Thank you, see you tomorrow."]
VOICES = ["alba", "bruno"]


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def tree_rss_mb(pid: int) -> float:
    """RSS of a process and all its descendants, from /proc (MB)."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return round(total / 1024, 1)


def body(i: int, tag: str, max_new_tokens: int) -> dict:
    v = VOICES[i % len(VOICES)]
    wav = (REPO / "cases" / "voices" / f"{v}.wav").read_bytes()
    return {"input": TEXTS[i % len(TEXTS)], "task_type": "Base", "language": "English", "seed": 0,
            "max_new_tokens": max_new_tokens, "response_format": "wav",
            "ref_audio": "data:audio/wav;base64," + base64.b64encode(wav).decode(),
            "ref_text": (REPO / "cases" / "voices" / f"{v}.txt").read_text().strip(),
            "extra_params": {"difftest_tag": tag, "temperature": 0.0, "repetition_penalty": 1.0}}


def wave(client: SpeechClient, n: int, capture: Path, max_new_tokens: int, label: str) -> dict:
    out: dict[int, tuple] = {}
    barrier = threading.Barrier(n)

    def one(i):
        tag = f"{label}-{i}"
        barrier.wait()
        t = time.perf_counter()
        try:
            ans = client.speech(body(i, tag, max_new_tokens))
            out[i] = (200, time.perf_counter() - t, (capture / f"{tag}.npz").exists(), len(ans.audio))
        except SpeechError as e:
            out[i] = (e.status, time.perf_counter() - t, False, 0)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    lat = sorted(v[1] for v in out.values())
    ok = all(v[0] == 200 and v[2] for v in out.values())
    frames = sum((v[3] - 44) // 2 // 1920 for v in out.values() if v[0] == 200)
    return {"n": n, "held": ok, "wall_s": round(wall, 2), "latency_median_s": round(statistics.median(lat), 2),
            "latency_max_s": round(lat[-1], 2), "frames_per_s": round(frames / wall, 1),
            "statuses": sorted({v[0] for v in out.values()})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--checkpoint", help="a tiny base checkpoint (default: built with the reference env)")
    ap.add_argument("--async-chunk", action="store_true")
    ap.add_argument("--serve-seconds", type=float, default=0.0)
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-omni-"))
    ckpt = a.checkpoint
    if ckpt is None:
        ckpt = str(work / "tiny-base")
        subprocess.run([str(REPO / ".venv-reference" / "bin" / "python"), "-m", "runners.reference.tiny_checkpoint",
                        ckpt, "--type", "base"], cwd=REPO, check=True, capture_output=True)
    opts = vo.VllmOmniOptions(max_num_seqs=a.max_num_seqs, repetition_penalty=1.0, async_chunk=a.async_chunk,
                              accept_length_finish=True, talker_kv_cache_bytes=64 << 20,
                              vocoder_kv_cache_bytes=16 << 20)
    result: dict = {"checkpoint": ckpt, "max_num_seqs": a.max_num_seqs, "max_new_tokens": a.max_new_tokens,
                    "async_chunk": a.async_chunk, "cpus": os.cpu_count()}
    with ExitStack() as stack:
        t0 = time.perf_counter()
        client, capture, info = vo.start_vllm_omni(work / "run", [ckpt], opts, stack, tasks={"voice_clone"})
        result["start_s"] = round(time.perf_counter() - t0, 1)
        result["versions"] = info["versions"]
        server_pid = _server_pid(info["servers"][0]["url"])
        result["rss_idle_mb"] = tree_rss_mb(server_pid) if server_pid else None
        wave(client, 1, capture, a.max_new_tokens, "warm")
        result["levels"] = []
        for n in (int(x) for x in a.levels.split(",")):
            r = wave(client, n, capture, a.max_new_tokens, f"c{n}")
            result["levels"].append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
        result["rss_after_mb"] = tree_rss_mb(server_pid) if server_pid else None
        held = [r["n"] for r in result["levels"] if r["held"]]
        result["largest_held"] = max(held) if held else 0
        print(json.dumps(result, indent=1), flush=True)
        if a.serve_seconds > 0:
            print(json.dumps({"url": info["url"], "capture": str(capture)}), flush=True)
            time.sleep(a.serve_seconds)
    return 0


def _server_pid(url: str) -> int | None:
    """The pid listening on the server's port (the `vllm serve` process), from /proc/net/tcp."""
    port = int(url.rsplit(":", 1)[1])
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port and f[3] == "0A":
            inodes.add(f[9])
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                if os.readlink(fd).startswith("socket:[") and os.readlink(fd)[8:-1] in inodes:
                    return int(d.name)
        except OSError:
            continue
    return None


if __name__ == "__main__":
    sys.exit(main())
