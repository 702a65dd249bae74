"""The GPU host check's helpers (scripts/gpu-check.sh): find the GPU, sample each process's GPU
memory while the run goes, and fold report.json and the samples into one JSON summary.

    python -m difftest.commands.gpucheck gpus                       the GPUs, or exit 3 naming why there are none
    python -m difftest.commands.gpucheck sample FILE [--interval S] one JSON line per process and sample, until killed
    python -m difftest.commands.gpucheck summary RUN_DIR --samples FILE [--installs FILE] [--wall S]
                                                           exit 3 naming why when the run gave no
                                                           verdict or, on a GPU or under model runner
                                                           v2, its capture files lack the talker's
                                                           input, prompt rows or top-k

Every nvidia-smi call has a timeout: a host with a wedged driver answers "no GPU", it never hangs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from ..errors import EXIT_INFRA

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


# The talker's capture a run must hold in every capture file, by what it is (docs/verdicts.md):
# its input (the reference codes and token ids its prompt was built from), its prompt rows, and
# its own top-k per sampled token (an empty array means "could not be lined up": not captured).
TALKER_CAPTURE = {"talker_ref_codes": "the talker's input", "input_text_ids": "the talker's input",
                  "talker_prompt": "the talker's prompt rows", "talker_topk_ids": "the talker's top-k",
                  "talker_topk_logprobs": "the talker's top-k", "input_prompt_embeds": "the talker's assembled prompt"}


def model_runner(deploy_file: Path, device: str | None) -> str | None:
    """The model runner a deploy file selects, as vLLM-Omni 0.30 reads it: the file's own
    `model_runner`, else its `base_config`'s (and so on), then the device's `platforms:` section
    over it. None when no file in the chain names one."""
    import yaml

    top = platform = None
    path, seen = Path(deploy_file), set()
    while path is not None and path not in seen and len(seen) < 8:
        seen.add(path)
        try:
            cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            break
        if not isinstance(cfg, dict):
            break
        if top is None and cfg.get("model_runner") is not None:
            top = str(cfg["model_runner"])
        section = (cfg.get("platforms") or {}).get(device or "") if isinstance(cfg.get("platforms"), dict) else None
        if platform is None and isinstance(section, dict) and section.get("model_runner") is not None:
            platform = str(section["model_runner"])
        base = cfg.get("base_config")
        path = (path.parent / base).resolve() if base else None
    return platform or top


def capture_fields(run_dir: Path, report: dict | None = None) -> dict:
    """Which capture fields the engine wrote, over the run's capture files, and which of the
    talker's (TALKER_CAPTURE) each file lacks; `problem` says what is missing. `required`: the
    candidate ran on a GPU or under model runner v2 (vLLM-Omni 0.30's default on CUDA, which
    reaches the talker through other functions than v1: difftest_capture/v2.py), where the summary
    fails on a problem. A CPU run (v1) only records it."""
    import numpy as np

    report = report or {}
    cand = report.get("candidate") or {}
    files = sorted((run_dir / "capture").glob("*.npz"))
    fields: dict[str, int] = {}
    missing: dict[str, int] = {}
    why: dict[str, str] = {}  # the first reason a writer gave (talker_missing, input_missing)
    for f in files:
        try:
            with np.load(f, allow_pickle=False) as z:
                for k in z.files:
                    fields[k] = fields.get(k, 0) + 1
                for k in TALKER_CAPTURE:
                    if k not in z.files or (k.startswith("talker_topk") and z[k].shape[:1] == (0,)):
                        missing[k] = missing.get(k, 0) + 1
                for k in ("talker_missing", "input_missing"):
                    if k in z.files and k not in why:
                        why[k] = str(z[k])
        except (OSError, ValueError):
            fields["(unreadable)"] = fields.get("(unreadable)", 0) + 1
    overlay = cand.get("deploy_overlay") or run_dir / "vllm-omni" / "deploy-overlay.yaml"
    runner = model_runner(Path(overlay), cand.get("device")) if Path(overlay).exists() else None
    out = {"files": len(files), "fields": dict(sorted(fields.items())), "model_runner": runner,
           "missing": dict(sorted(missing.items())), "required": cand.get("device") == "cuda" or runner == "v2"}
    if why:
        out["why"] = why
    under = f"model runner {runner}" if runner else "an unnamed model runner"
    if cand.get("capture") and not files:
        out["problem"] = f"capture was on ({under}) and no capture file was written"
    elif missing:
        named = "; ".join(f"{k} ({TALKER_CAPTURE[k]}) missing from {n} of {len(files)} capture files"
                          for k, n in sorted(missing.items()))
        reasons = "".join(f"; {k}: {v}" for k, v in why.items())
        out["problem"] = f"capture incomplete under {under}: {named}{reasons}"
    return out


def numerics(report: dict) -> dict:
    """What the GPU's numerics did to the per-segment allowances measured on the CPU (issue 57): the
    assembled prompt's worst row against float32 qwen-tts's (allowed 0.05 for bf16), and the measured
    null's noise model (how far bf16 moved qwen-tts's margins)."""
    prompt = [c for s in report.get("segments") or [] if (c := (s.get("comparisons") or {}).get("talker_prompt"))]
    worst = max((c for c in prompt if c.get("worst_rel") is not None), key=lambda c: c["worst_rel"], default=None)
    return {"prompt_compared": len(prompt), "prompt_equal": sum(1 for c in prompt if c.get("equal")),
            "prompt_worst_rel": worst["worst_rel"] if worst else None,
            "prompt_allowed_rel": worst["allowed_rel"] if worst else None,
            "noise_model": (report.get("measured_null") or {}).get("noise_model")}


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
    out = {
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
        "capture": capture_fields(run_dir, report),
        "numerics": numerics(report),
    }
    if out["capture"].get("problem") and out["capture"]["required"]:  # judged without the talker's capture: fail
        out["ok"] = False
        out["error"] = out["capture"]["problem"]
    return out


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
    ap = argparse.ArgumentParser(prog="python -m difftest.commands.gpucheck", description=__doc__.split("\n\n")[0])
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
    if not result["ok"]:
        print(f"gpu-check: {result.get('error') or 'the run gave no verdict'}", file=sys.stderr)
    return 0 if result["ok"] else EXIT_INFRA


if __name__ == "__main__":
    sys.exit(main())
