"""MLflow logging time for one report, on a local sqlite store or a real `mlflow server`.

    python benchmarks/bench_mlflow.py [--segments 300] [--chunks 10] [--audio-fraction 0.1] [--seconds 10] [--server]

A synthetic report.json (every segment with the comparisons a full run has: codes, concurrency
codes, concurrency, vocoder and headline audio, each chunk by chunk) plus result files for the
diverged segments, whose audio and spectrogram difference are logged. Measures `log_run` end to
end (parent run, a child run with its per-chunk metrics per segment that is not clean, artifacts), with the
store created beforehand; `--server` logs to an `mlflow server` on loopback (sqlite behind it,
started by tests/mlflow_support.py, as the tests do). The audio and pictures are made during the
upload in other processes; `audio_and_pictures_s` is what making them again here, one after
another, takes, and `log_cpu_s` the CPU time this process spent on the upload. Prints one JSON
object.
"""

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from difftest.records import segment_media, tracking  # noqa: E402
from difftest.records.mlflow_records import CLEAN, has_child_run, segment_metrics  # noqa: E402
from difftest.records.report import write_report  # noqa: E402
from difftest.results import Result, write_result  # noqa: E402
from difftest.verdicts.policy import load_policy  # noqa: E402

AUDIO_COMPARISONS = ("audio", "concurrency", "vocoder")


def audio_comparison(rng, k: int, diverged_from: int | None) -> dict:
    bad = np.arange(k) >= (k if diverged_from is None else diverged_from)
    max_abs = np.where(bad, rng.uniform(0.05, 0.5, k), rng.uniform(0, 4e-5, k))
    return {"tiers": ["diverged" if b else "close" for b in bad], "worst_tier": "diverged" if bad.any() else "close",
            "samples": [0, 0], "quantised": False,
            "chunks": {"max_abs": max_abs.tolist(), "rms": (max_abs / 4).tolist(),
                       "snr_db": np.where(bad, rng.uniform(0, 10, k), 100.0).tolist(),
                       "logmel": np.where(bad, rng.uniform(0.5, 3, k), rng.uniform(0, 0.01, k)).tolist()}}


def make_run(out: Path, n: int, k: int, fraction: float, seconds: float) -> dict:
    rng = np.random.default_rng(0)
    policy = load_policy()
    n_diverged = int(round(n * fraction))
    samples = int(seconds * 24000)
    segments = []
    for i in range(n):
        sid = f"seg{i:04d}"
        diverged = i < n_diverged
        first = int(rng.integers(0, k)) if diverged else None
        seg = {"id": sid, "verdict": "vocoder_defect" if diverged else "numeric_drift",
               "summary": "synthetic", "first_divergent_frame": None if first is None else first * 25,
               "first_divergent_chunk": first, "stage": "vocoder" if diverged else None, "donor": None,
               "error_kind": None, "notes": [], "artifacts": {},
               "comparisons": {"codes": {"chunk_agreement": [1.0] * k}, "concurrency_codes": {"chunk_agreement": [1.0] * k},
                               **{c: audio_comparison(rng, k, first) for c in AUDIO_COMPARISONS}}}
        if diverged:
            wav = (0.3 * rng.standard_normal(samples)).astype(np.float32)
            for role in ("reference", "candidate", "control", "cross_own"):
                w = wav if role == "reference" else wav + (0.05 * rng.standard_normal(samples)).astype(np.float32)
                side = write_result(out / "results" / role / sid, Result(sid, "h" * 64, w, 24000))
                seg["artifacts"][role] = str(side)
        segments.append(seg)
    counts = {"vocoder_defect": n_diverged, "numeric_drift": n - n_diverged}
    report = {"format": "difftest.report/1", "difftest_version": "bench", "created": "2026-01-01T00:00:00+00:00",
              "suite": {"name": "bench", "hash": "b" * 64}, "reference": {"label": "reference", "provenance": {}},
              "candidate": {"label": "bench", "provenance": {"versions": {"vllm-omni": "0.0"}, "device": "cpu"}},
              "concurrency": 8, "provenance": {}, "policy": policy.as_dict(), "verdict": "fail" if n_diverged else "pass",
              "exit_code": 1 if n_diverged else 0, "counts": {k_: v for k_, v in counts.items() if v},
              "failing": [s["id"] for s in segments if s["verdict"] == "vocoder_defect"],
              "segments": segments, "warnings": []}
    write_report(out, report)
    return report


@contextlib.contextmanager
def store(folder: Path, server: bool):
    """The tracking URI, its store created beforehand, and the folder its artifacts go to."""
    if not server:
        uri = tracking.default_tracking_uri()
        with tracking.mlflow_client(uri) as client:
            client.search_experiments()  # creates and migrates the sqlite store
        yield uri, folder / "mlruns"
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from mlflow_support import serve

    with serve(folder) as uri:
        yield uri, folder / "artifacts"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--segments", type=int, default=300)
    ap.add_argument("--chunks", type=int, default=10)
    ap.add_argument("--audio-fraction", type=float, default=0.1)
    ap.add_argument("--seconds", type=float, default=10.0, help="audio length of a diverged segment")
    ap.add_argument("--server", action="store_true", help="log to an `mlflow server` on 127.0.0.1")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-mlflow-") as tmp:
        tmp = Path(tmp)
        os.chdir(tmp)
        report = make_run(tmp / "out", a.segments, a.chunks, a.audio_fraction, a.seconds)
        metrics = sum(len(segment_metrics(s)) for s in report["segments"])
        runs = [s for s in report["segments"] if has_child_run(s)]
        logged = sum(len(segment_metrics(s)) for s in runs)

        t0 = time.perf_counter()
        with store(tmp, a.server) as (uri, artifacts):
            store_s = time.perf_counter() - t0
            t0, cpu0 = time.perf_counter(), time.process_time()
            run_id = tracking.log_run(tmp / "out", uri)
            total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            assert run_id
            t0 = time.perf_counter()
            tracking.log_run(tmp / "out", uri)
            again = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in artifacts.rglob("*") if p.is_file())

        t0 = time.perf_counter()
        for seg in report["segments"]:
            if seg["verdict"] not in CLEAN:
                segment_media.write_segment_media(seg, tmp / "out", tmp / "media")
        media_s = time.perf_counter() - t0
    print(json.dumps({
        "store": "mlflow server (sqlite)" if a.server else "sqlite",
        "segments": a.segments, "chunks": a.chunks, "segments_with_audio": int(round(a.segments * a.audio_fraction)),
        "audio_seconds_each": a.seconds, "metric_values": metrics,
        "child_runs": len(runs), "metric_values_in_child_runs": logged,  # the clean segments' are in report.json
        "store_create_s": round(store_s, 2), "log_total_s": round(total, 2),
        "log_per_segment_ms": round(1000 * total / a.segments, 1),
        "log_cpu_s": round(cpu, 2),  # this process's (not the media workers', not the server's)
        "audio_and_pictures_s": round(media_s, 2),
        "relog_same_report_s": round(again, 2), "artifact_mb": round(size / 2**20, 1),
    }, indent=1))


if __name__ == "__main__":
    main()
