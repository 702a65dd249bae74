"""What the reference runner costs over calling qwen-tts directly.

    python benchmarks/bench_reference.py [--segments 8] [--rounds 3] [--max-new-tokens 24]

Builds the tiny checkpoint, then times the same N voice-clone segments two ways,
each with its model already loaded and warmed up:
- through the runner protocol (`generate` job: validation, per-utterance prompt,
  capture, result files written with fsync), and
- in one plain process calling `create_voice_clone_prompt` + `generate_voice_clone`.
Rounds alternate between the two so that machine load hits both alike; the
figure per side is its best round. Prints one JSON object; the target is an
overhead ratio of at most 1.05.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET = 1.05
TEXTS = ["The quick brown fox jumps over the lazy dog.", "A second sentence to say.", "Numbers: one, two, three.",
         "How are you today?", "Testing the reference runner.", "Short one.", "Yet another line of text here.",
         "The last of the benchmark sentences."]


# -- the direct side: runs in the reference environment ---------------------
def direct(model: str, segments_file: str) -> None:
    """Serve rounds on stdin ("go" -> one JSON line with the round's seconds)."""
    from runners.reference.environment import import_qwen_tts

    answer = os.fdopen(os.dup(1), "w", buffering=1)  # qwen-tts prints banners: keep them off the answers
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import_qwen_tts()
    import torch
    from qwen_tts import Qwen3TTSModel

    torch.set_num_threads(1)
    tts = Qwen3TTSModel.from_pretrained(model, dtype=torch.float32, device_map="cpu")
    segments = json.loads(Path(segments_file).read_text())

    def one(seg):
        v = seg["voice"]
        prompt = tts.create_voice_clone_prompt(ref_audio=v["wav"], ref_text=v["transcript"])
        d = seg["decode"]
        torch.manual_seed(d["seed"])
        wavs, sr = tts.generate_voice_clone(text=seg["text"], language=seg["language"], voice_clone_prompt=prompt,
                                            do_sample=d["do_sample"], subtalker_dosample=d["subtalker_dosample"],
                                            repetition_penalty=d["repetition_penalty"],
                                            max_new_tokens=d["max_new_tokens"])
        return len(wavs[0]) / sr

    one(segments[0])  # warm-up
    print(json.dumps({"ready": True}), file=answer, flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t0, c0 = time.perf_counter(), time.process_time()
        audio = sum(one(s) for s in segments)
        print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                          "audio_seconds": audio}), file=answer, flush=True)


# -- the driver: runs anywhere difftest imports --------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--python", default=str(REPO / ".venv-reference" / "bin" / "python"))
    ap.add_argument("--direct", nargs=2, metavar=("MODEL", "SEGMENTS_JSON"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.direct:
        direct(*a.direct)
        return 0

    from dataclasses import replace

    import numpy as np

    from difftest.process.runner_client import RunnerProcess
    from difftest.suites import wavio
    from difftest.suites.suite import DECODE_DEFAULTS, Segment, Voice, content_hash

    work = Path(tempfile.mkdtemp(prefix="bench-reference-"))
    build = subprocess.run([a.python, "-m", "runners.reference.tiny_checkpoint", str(work / "tiny"), "--type", "base"],
                           cwd=REPO, capture_output=True, text=True)
    if build.returncode:
        print(build.stderr, file=sys.stderr)
        return 3
    model = str(work / "tiny")

    sr = 24000
    t = np.arange(int(1.7 * sr)) / sr
    wav_path = work / "voice.wav"
    wavio.write(wav_path, (0.4 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), sr, "pcm16")
    v = Voice("v", wav_path, "A reference sentence.", "icl", hashlib.sha256(wav_path.read_bytes()).hexdigest(), len(t))
    decode = {**DECODE_DEFAULTS, "repetition_penalty": 1.0, "max_new_tokens": a.max_new_tokens, "seed": 0}
    segs = []
    for i in range(a.segments):
        s = Segment(f"b{i}", TEXTS[i % len(TEXTS)] + f" ({i})", "English", "voice_clone", dict(decode), voice=v)
        segs.append(replace(s, hash=content_hash(s.fingerprint())))
    jobs = [s.to_job() for s in segs]
    (work / "segments.json").write_text(json.dumps(jobs))
    warm = replace(segs[0], id="warm")

    runner = RunnerProcess([a.python, "-m", "runners.reference", "--model", model, "--threads", "1"], cwd=REPO,
                           log_path=work / "runner.log")
    runner.start()
    plain = subprocess.Popen([a.python, __file__, "--direct", model, str(work / "segments.json")], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        list(runner.request("generate", segments=[warm.to_job()], out_dir=str(work / "warm"), concurrency=1))
        assert json.loads(plain.stdout.readline()).get("ready")
        runner_rounds, direct_rounds, runner_cpu, direct_cpu, audio = [], [], [], [], 0.0
        load_before = os.getloadavg()[0]
        for r in range(a.rounds):
            t0, c0 = time.perf_counter(), cpu_seconds(runner.proc.pid)
            events = list(runner.request("generate", segments=jobs, out_dir=str(work / f"round{r}"), concurrency=1))
            runner_rounds.append(time.perf_counter() - t0)
            runner_cpu.append(cpu_seconds(runner.proc.pid) - c0)
            bad = [e for e in events if e.get("event") != "result" or e.get("cached")]
            if bad:
                raise RuntimeError(f"runner round {r}: {bad[:2]}")
            audio = sum(e["audio_seconds"] for e in events)
            plain.stdin.write("go\n")
            plain.stdin.flush()
            answer = json.loads(plain.stdout.readline())
            direct_rounds.append(answer["seconds"])
            direct_cpu.append(answer["cpu_seconds"])
    finally:
        runner.close()
        plain.stdin.close()
        plain.wait(60)
        shutil.rmtree(work, ignore_errors=True)
    n = a.segments
    best_runner, best_direct = min(runner_rounds) / n, min(direct_rounds) / n
    ratio = best_runner / best_direct
    print(json.dumps({
        "segments": n, "rounds": a.rounds, "max_new_tokens": a.max_new_tokens,
        "audio_seconds_per_utterance": round(audio / n, 3),
        "runner_s_per_utterance": round(best_runner, 4),
        "direct_s_per_utterance": round(best_direct, 4),
        "runner_rounds_s": [round(x, 3) for x in runner_rounds],
        "direct_rounds_s": [round(x, 3) for x in direct_rounds],
        "median_ratio": round(statistics.median(runner_rounds) / statistics.median(direct_rounds), 4),
        # CPU time barely moves with other load on the machine; wall time does.
        "runner_cpu_s_per_utterance": round(min(runner_cpu) / n, 4),
        "direct_cpu_s_per_utterance": round(min(direct_cpu) / n, 4),
        "overhead_ratio_cpu": round(min(runner_cpu) / min(direct_cpu), 4),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "overhead_ratio": round(ratio, 4),
        "target": TARGET,
        "within_target": ratio <= TARGET,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
