"""The GPU host check's helpers (scripts/gpu-check.sh): find the GPU, sample each process's GPU
memory while the run goes, and fold report.json and the samples into one JSON summary.

    python -m difftest.gpucheck gpus                       the GPUs, or exit 3 naming why there are none
    python -m difftest.gpucheck sample FILE [--interval S] one JSON line per process and sample, until killed
    python -m difftest.gpucheck summary RUN_DIR --samples FILE [--installs FILE] [--wall S]

Every nvidia-smi call has a timeout: a host with a wedged driver answers "no GPU", it never hangs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from .errors import EXIT_INFRA

SMI_TIMEOUT = 20


def _smi(*args: str) -> tuple[int, str]:
    try:
        r = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=SMI_TIMEOUT)
    except FileNotFoundError:
        return 127, "nvidia-smi is not on PATH"
    except OSError as e:
        return 126, f"nvidia-smi cannot run: {e}"
    except subprocess.TimeoutExpired:
        return 124, f"nvidia-smi did not answer in {SMI_TIMEOUT} s"
    return r.returncode, (r.stdout if r.returncode == 0 else (r.stderr or r.stdout)).strip()


def gpus() -> tuple[list[str], str | None]:
    """(the GPUs nvidia-smi lists, why there are none)."""
    code, text = _smi("-L")
    if code != 0:
        return [], f"no NVIDIA GPU: {text.splitlines()[0] if text else f'nvidia-smi -L exit {code}'}"
    found = [ln.strip() for ln in text.splitlines() if ln.startswith("GPU ")]
    return found, None if found else "no NVIDIA GPU: nvidia-smi -L lists none"


def _label(pid: int) -> str:
    """Which of difftest's processes this is, from its command line."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    if "runners.reference" in cmd:
        return "reference runner (qwen-tts)"
    if "vllm" in cmd and "serve" in cmd:
        return "vllm-omni API server"
    return f"pid {pid}: {cmd[:80] or '(gone)'}"  # vLLM's stage workers: spawned, named by their title


def sample_once() -> list[dict]:
    code, text = _smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    if code != 0:
        return []
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].replace(".", "", 1).isdigit():
            pid = int(parts[0])
            out.append({"t": round(time.time(), 1), "pid": pid, "mib": float(parts[1]), "process": _label(pid)})
    return out


def sample(path: Path, interval: float, limit: float | None = None, rounds: int | None = None) -> None:
    """Append samples to `path` every `interval` s, for `limit` s or `rounds` rounds (default: until killed)."""
    t0, done = time.monotonic(), 0
    with open(path, "a", encoding="utf-8") as f:
        while (limit is None or time.monotonic() - t0 < limit) and (rounds is None or done < rounds):
            for rec in sample_once():
                f.write(json.dumps(rec) + "\n")
            f.flush()
            done += 1
            time.sleep(interval)


def memory_peaks(samples: Path) -> dict[str, float]:
    """The largest GPU memory (MiB) each process held, keyed by its label and pid."""
    peaks: dict[str, float] = {}
    try:
        lines = samples.read_text(encoding="utf-8").splitlines()
    except OSError:
        return peaks
    for line in lines:
        try:
            rec = json.loads(line)
            key = f"{rec['process']} [{rec['pid']}]" if not str(rec["process"]).startswith("pid ") else rec["process"]
            peaks[key] = max(peaks.get(key, 0.0), float(rec["mib"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short when the sampler was stopped
    return dict(sorted(peaks.items()))


def capture_fields(run_dir: Path) -> dict:
    """Which capture fields the engine wrote, over the run's capture files: on a GPU the talker's
    hooks may not be reached (model runner v2 batches its preprocess and has its own sampler)."""
    import numpy as np

    files = sorted((run_dir / "capture").glob("*.npz"))
    fields: dict[str, int] = {}
    for f in files:
        try:
            with np.load(f, allow_pickle=False) as z:
                for k in z.files:
                    fields[k] = fields.get(k, 0) + 1
        except (OSError, ValueError):
            fields["(unreadable)"] = fields.get("(unreadable)", 0) + 1
    return {"files": len(files), "fields": dict(sorted(fields.items()))}


def summary(run_dir: Path, samples: Path | None = None, installs: dict | None = None,
            wall_s: float | None = None, gpu_list: list[str] | None = None) -> dict:
    """One JSON object: versions, devices, settings, the verdicts at 1 and N, timings, memory peaks."""
    try:
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return {"ok": False, "error": f"no readable report.json in {run_dir}: {e}", "installs_s": installs or {},
                "gpu_memory_peak_mib": memory_peaks(samples) if samples else {}}
    ref = report.get("reference") or {}
    cand = report.get("candidate") or {}
    ref_versions = (ref.get("provenance") or {}).get("versions") or {}
    cand_versions = cand.get("versions") or {}
    n = report.get("concurrency")
    at_one = report.get("at_concurrency_1") or {}
    one_counts: dict[str, int] = {}
    for seg in at_one.get("segments") or []:
        one_counts[seg["verdict"]] = one_counts.get(seg["verdict"], 0) + 1
    return {
        "ok": report.get("exit_code") in (0, 1),
        "gpus": gpu_list if gpu_list is not None else gpus()[0],
        "suite": (report.get("suite") or {}).get("name"),
        "versions": {"qwen_tts": ref_versions.get("qwen-tts"), "torch_reference": ref_versions.get("torch"),
                     "vllm_omni": cand_versions.get("vllm_omni"), "vllm": cand_versions.get("vllm"),
                     "torch_candidate": cand_versions.get("torch"), "difftest": report.get("difftest_version")},
        "devices": {"reference": (ref.get("fingerprint") or {}).get("device"), "candidate": cand.get("device"),
                    "candidate_gpus": cand.get("gpus")},
        "settings": {k: cand.get(k) for k in ("talker_dtype", "vocoder_dtype", "enforce_eager", "batch_invariant",
                                              "async_chunk", "accept_length_finish")},
        "verdicts": {"c1": {"verdict": at_one.get("verdict"), "counts": dict(sorted(one_counts.items()))},
                     f"c{n}": {"verdict": report.get("verdict"), "counts": report.get("counts") or {}}},
        "exit_code": report.get("exit_code"),
        "failing": report.get("failing") or [],
        "timings_s": {**((report.get("provenance") or {}).get("timings") or {}),
                      **({"wall_s": round(wall_s, 1)} if wall_s is not None else {})},
        "installs_s": installs or {},
        "gpu_memory_peak_mib": memory_peaks(samples) if samples else {},
        "capture": capture_fields(run_dir),
    }


def _installs(path: str | None) -> dict:
    """`name seconds` lines (scripts/gpu-check.sh writes them) -> {name: seconds}."""
    out = {}
    if path:
        try:
            for line in Path(path).read_text(encoding="utf-8").splitlines():
                name, _, secs = line.partition(" ")
                if secs.strip().isdigit():
                    out[name] = int(secs)
        except OSError:
            pass
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m difftest.gpucheck", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("gpus")
    s = sub.add_parser("sample")
    s.add_argument("file", type=Path)
    s.add_argument("--interval", type=float, default=1.0)
    s.add_argument("--limit", type=float, help="stop after this many seconds (default: until killed)")
    m = sub.add_parser("summary")
    m.add_argument("run_dir", type=Path)
    m.add_argument("--samples", type=Path)
    m.add_argument("--installs")
    m.add_argument("--wall", type=float)
    args = ap.parse_args(argv)
    if args.cmd == "gpus":
        found, why = gpus()
        if why:
            print(why, file=sys.stderr)
            return EXIT_INFRA
        print("\n".join(found))
        return 0
    if args.cmd == "sample":
        try:
            sample(args.file, args.interval, args.limit)
        except KeyboardInterrupt:
            pass
        return 0
    result = summary(args.run_dir, args.samples, _installs(args.installs), args.wall)
    print(json.dumps(result, sort_keys=True))
    return 0 if result["ok"] else EXIT_INFRA


if __name__ == "__main__":
    sys.exit(main())
