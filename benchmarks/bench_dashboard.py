"""The dashboard's size and speed on a store shaped like the seed's scale run (docs/scale-out.md:
two runs of cases/suites/audiobook-278.yaml, every segment diverged, each with five float32 WAVs
of 3.12 s at 24 kHz and a spectrogram in MLflow).

    python benchmarks/bench_dashboard.py [--segments 278] [--runs 2] [--audio-source model|speechlike|noise]
                                         [--formats wav,flac,opus] [--baseline REV] [--store DIR]

1. A synthetic report per run (bench_mlflow's comparisons; verdicts as the scale run's: the release's
   273 code_divergence and 5 concurrency_defect, the leak's 181 contamination, 94 code_divergence and
   3 concurrency_defect) with result files for every segment, logged with `log_run` to a local
   sqlite store (audio, difference and spectrogram written by difftest's own segment_media). The
   reference audio is the same in every run (the scale run's second run reused the reference).
2. `python -m dashboards --audio F` for each format (the default format, Opus, without --audio: the site
   a plain `difftest dashboard` makes), and the dashboards/ of REV (default: the commit before the
   FLAC copies, the old code path: float32 WAVs, PNGs as MLflow has them, preload=metadata).
3. For each site: size, files, bytes by kind, build time; headless Chromium's time to open a run
   page (278 heatmap rows) and a segment page, browser start included, and which audio the segment
   page fetched by itself (none wanted).

Audio content (--audio-source), since it decides what FLAC can do:
  model       the model output under MLFLOW_ARTIFACTS (default ./mlruns): the WAVs earlier real
              runs logged (the tiny random checkpoints: loud, noise-like; the candidates' 16-bit
              PCM from HTTP), cycled over the segments; falls back to speechlike when there are none
  speechlike  synthetic voiced syllables (a pulse train through three formant resonators) with pauses
  noise       Gaussian noise, as bench_mlflow uses (the worst case: nothing to predict)
Prints one JSON object. --store DIR keeps the store (and reuses it when the parameters match).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy.signal import lfilter

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_mlflow import audio_comparison  # noqa: E402

from dashboards.media import DEFAULT_AUDIO  # noqa: E402
from difftest.records import tracking  # noqa: E402
from difftest.records.report import write_report  # noqa: E402
from difftest.results import Result, write_result  # noqa: E402
from difftest.suites import wavio  # noqa: E402
from difftest.verdicts.policy import load_policy  # noqa: E402

RATE = 24000
ROLES = ("reference", "candidate", "control", "cross_own")  # difference.wav is written by segment_media
# The scale run's verdicts (docs/scale-out.md), run by run; every segment diverged.
MIXES = ({"code_divergence": 273, "concurrency_defect": 5},
         {"contamination": 181, "code_divergence": 94, "concurrency_defect": 3})
STAGES = {"code_divergence": "talker", "concurrency_defect": "talker", "contamination": "handoff"}


# -- audio ------------------------------------------------------------------------------------------------
def speechlike(rng, n: int, f0: float, formants) -> np.ndarray:
    """Voiced syllables (a jittered pulse train through three formant resonators) between pauses."""
    out = np.zeros(n)
    t = int(rng.integers(1200, 4800))
    while t < n:
        length = int(rng.integers(2400, 6000))  # 100-250 ms
        seg = np.zeros(min(length, n - t))
        period = RATE / (f0 * rng.uniform(0.9, 1.1))
        seg[np.arange(0, len(seg), period).astype(int)] = 1.0
        for f, bw in formants:
            r = np.exp(-np.pi * bw / RATE)
            seg = lfilter([1.0], [1.0, -2 * r * np.cos(2 * np.pi * f * rng.uniform(0.95, 1.05) / RATE), r * r], seg)
        out[t:t + len(seg)] = seg * np.hanning(len(seg))
        t += len(seg) + int(rng.integers(0, 3600))  # up to 150 ms of pause
    out = 0.5 * out / (np.abs(out).max() or 1.0)
    return (out + rng.normal(0, 3e-4, n)).astype(np.float32)  # a floor, as a vocoder leaves one


def model_segments(root: Path) -> list[dict]:
    """Segment folders of real runs' audio artifacts: role -> samples."""
    found = []
    for folder in sorted({p.parent for p in root.glob("**/artifacts/audio/*/reference.wav")}):
        wavs = {r: wavio.read(folder / f"{r}.wav")[0] for r in ROLES if (folder / f"{r}.wav").is_file()}
        if "candidate" in wavs and all(w.ndim == 1 for w in wavs.values()):
            found.append(wavs)
    return found


def audio_maker(source: str, n: int, model_root: Path):
    """(run, segment index) -> role -> float32 samples, and what the source turned out to be."""
    if source == "model":
        real = model_segments(model_root)
        if real:
            def model(run, i):
                ref = real[i % len(real)]["reference"]
                cand = real[(i + 7 * run) % len(real)]  # another segment's candidate side in each run
                return {"reference": ref, **{r: cand.get(r, cand["candidate"]) for r in ROLES[1:]}}

            return model, f"model output from {len(real)} segment folders under {model_root}"
        source = "speechlike"
    if source == "noise":
        def noise(run, i):
            rng = np.random.default_rng([run, i])
            ref = (0.3 * np.random.default_rng(i).standard_normal(n)).astype(np.float32)
            return {"reference": ref, **{r: ref + (0.05 * rng.standard_normal(n)).astype(np.float32) for r in ROLES[1:]}}

        return noise, "Gaussian noise, std 0.3 (candidates: plus std 0.05)"

    def speech(run, i):
        voice = np.random.default_rng(i % 6)  # 6 voices, as audiobook-278's
        f0, formants = voice.uniform(100, 220), [(voice.uniform(*r), 80) for r in ((500, 800), (1200, 1800), (2400, 3000))]
        ref = speechlike(np.random.default_rng(i), n, f0, formants)
        cand = speechlike(np.random.default_rng([i, run + 1]), n, f0 * 1.02, formants)  # diverged: other syllables
        rng = np.random.default_rng([run, i, 2])
        return {"reference": ref, "candidate": cand,
                "control": cand + rng.normal(0, 1e-5, n).astype(np.float32),  # float drift at concurrency 1
                "cross_own": cand + rng.normal(0, 1e-5, n).astype(np.float32)}

    return speech, "synthetic speech-like: pulse train through 3 formants, syllables and pauses, peak 0.5"


# -- the store ----------------------------------------------------------------------------------------------
def make_run(out: Path, run: int, n_seg: int, k: int, seconds: float, audio) -> None:
    rng = np.random.default_rng(run)
    mix = MIXES[run % len(MIXES)]
    verdicts = [v for v, c in mix.items() for _ in range(c)]
    verdicts = (verdicts * (n_seg // len(verdicts) + 1))[:n_seg]
    segments = []
    for i, verdict in enumerate(verdicts):
        sid = f"ab{i:03d}"
        first = 0 if verdict == "contamination" else int(rng.integers(0, k))
        seg = {"id": sid, "verdict": verdict, "summary": "synthetic", "first_divergent_frame": first * 25,
               "first_divergent_chunk": first, "stage": STAGES[verdict],
               "donor": f"ab{(i + 1) % n_seg:03d}" if verdict == "contamination" else None, "error_kind": None,
               "notes": [], "artifacts": {},
               "comparisons": {"codes": {"chunk_agreement": [1.0] * first + [0.4] * (k - first)},
                               "concurrency_codes": {"chunk_agreement": [1.0] * k},
                               **{c: audio_comparison(rng, k, first) for c in ("audio", "concurrency", "vocoder")}}}
        for role, w in audio(run, i).items():
            w = w[:int(seconds * RATE)]
            seg["artifacts"][role] = str(write_result(out / "results" / role / sid, Result(sid, "h" * 64, w, RATE)))
        segments.append(seg)
    failing = [s["id"] for s in segments if s["verdict"] != "code_divergence"]
    counts: dict = {}
    for s in segments:
        counts[s["verdict"]] = counts.get(s["verdict"], 0) + 1
    write_report(out, {
        "format": "difftest.report/1", "difftest_version": "bench", "created": f"2026-01-0{run + 1}T00:00:00+00:00",
        "suite": {"name": "audiobook-278", "hash": "b" * 64}, "reference": {"label": "reference", "provenance": {}},
        "candidate": {"label": "vllm-omni", "provenance": {"versions": {"vllm-omni": f"0.30.{run}"}, "device": "cpu"}},
        "concurrency": 16, "provenance": {}, "policy": load_policy().as_dict(), "verdict": "fail", "exit_code": 1,
        "counts": counts, "failing": failing, "segments": segments, "warnings": []})


def make_store(store: Path, args) -> dict:
    params = {"segments": args.segments, "runs": args.runs, "source": args.audio_source, "seconds": args.seconds,
              "chunks": args.chunks}
    marker = store / "bench.json"
    if marker.is_file() and json.loads(marker.read_text()).get("params") == params:
        return json.loads(marker.read_text())
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    audio, described = audio_maker(args.audio_source, int(args.seconds * RATE), Path(args.model_audio).resolve())
    uri = f"sqlite:///{store / 'mlflow.db'}"
    cwd = os.getcwd()
    os.chdir(store)  # artifacts into ./mlruns, as difftest's default URI puts them
    try:
        t0 = time.perf_counter()
        for run in range(args.runs):
            out = store / f"run{run}"
            make_run(out, run, args.segments, args.chunks, args.seconds, audio)
            assert tracking.log_run(out, uri, experiment="difftest/audiobook-278")
            shutil.rmtree(out / "results")  # MLflow has what the site needs
        logged = time.perf_counter() - t0
    finally:
        os.chdir(cwd)
    artifacts = [p for p in (store / "mlruns").rglob("*") if p.is_file()]
    info = {"params": params, "uri": uri, "audio": described, "log_s": round(logged, 1),
            "mlflow_artifacts_mib": round(sum(p.stat().st_size for p in artifacts) / 2 ** 20, 1),
            "mlflow_wavs": sum(p.suffix == ".wav" for p in artifacts)}
    marker.write_text(json.dumps(info, indent=1))
    return info


# -- the sites ------------------------------------------------------------------------------------------------
def baseline_rev() -> str:
    """The commit before dashboards/media.py (the FLAC copies) was added."""
    first = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "dashboards/media.py"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    return f"{first[-1]}^" if first else "HEAD"


def build(site: Path, uri: str, work: Path, fmt: str | None, old: Path | None) -> float:
    """Time one `python -m dashboards` from an empty folder: this tree's with --audio fmt (none for the
    default), or `old`'s."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (old, REPO) if p)}
    cmd = [sys.executable, "-m", "dashboards", "--out", str(site), "--tracking-uri", uri]
    t0 = time.perf_counter()
    p = subprocess.run(cmd + (["--audio", fmt] if fmt else []), cwd=work, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout}{p.stderr[-3000:]}")
    return took


def measure(site: Path) -> dict:
    kinds: dict = {}
    for p in site.rglob("*"):
        if p.is_file():
            k = kinds.setdefault(p.suffix.lstrip(".") or p.name, [0, 0])
            k[0] += 1
            k[1] += p.stat().st_size
    total = sum(b for _, b in kinds.values())
    return {"mib": round(total / 2 ** 20, 1), "files": sum(n for n, _ in kinds.values()),
            "by_kind": {k: {"files": n, "mib": round(b / 2 ** 20, 2)} for k, (n, b) in sorted(kinds.items())}}


def open_times(site: Path) -> dict:
    """Chromium: start and open a run page; then a segment page, and the audio it fetched by itself."""
    from dashboards.browser import Chromium

    run_page = min((site / "runs").glob("*/index.html"))
    seg_page = min(run_page.parent.glob("seg-*.html"))
    t0 = time.perf_counter()
    with Chromium(width=1400, height=900) as b:
        page = b.open(run_page.resolve().as_uri())
        rows = page.evaluate("document.querySelectorAll('table.heat tbody tr').length")
        run_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        seg = b.open(seg_page.resolve().as_uri())
        seg.front()
        seg_s = time.perf_counter() - t1
        seg.evaluate("new Promise(r => setTimeout(r, 1000))")  # what a page fetches on its own comes by then
        media = [ev["params"]["request"]["url"] for ev in seg.network
                 if ev["method"] == "Network.requestWillBeSent" and "/media/audio/" in ev["params"]["request"]["url"]]
    return {"run_page_with_browser_start_s": round(run_s, 2), "heatmap_rows": rows,
            "segment_page_s": round(seg_s, 2), "audio_fetched_on_open": len(media)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", type=int, default=278)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=2, help="chunks per segment (39 frames on the 1,25 schedule: 2)")
    ap.add_argument("--seconds", type=float, default=3.12)
    ap.add_argument("--audio-source", choices=("model", "speechlike", "noise"), default="model")
    ap.add_argument("--model-audio", default="mlruns", help="where --audio-source model looks for real runs' WAVs")
    ap.add_argument("--formats", default="wav,flac,opus")
    ap.add_argument("--baseline", default=None, help="the old dashboards/ to measure (default: before the FLAC copies; "
                                                     "'none' to skip)")
    ap.add_argument("--store", help="keep the MLflow store here (reused when its parameters match)")
    ap.add_argument("--keep-sites", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    store = Path(a.store).resolve() if a.store else work / "store"
    try:
        info = make_store(store, a)
        sites = []
        if a.baseline != "none":
            rev = a.baseline or baseline_rev()
            old = work / "old"
            old.mkdir()
            tar = subprocess.run(["git", "archive", rev, "dashboards"], cwd=REPO, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=tar, check=True)
            sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True).stdout
            sites.append((f"before ({sha.strip()}: float32 WAV copies)", None, old))
        sites += [(f"default (--audio {f})", None, None) if f == DEFAULT_AUDIO else (f"--audio {f}", f, None)
                  for f in a.formats.split(",") if f]
        results = []
        for name, fmt, old in sites:
            site = work / f"site-{len(results)}"
            took = build(site, info["uri"], work, fmt, old)
            results.append({"site": name, "build_s": round(took, 1), **measure(site), **open_times(site)})
            if not a.keep_sites:
                shutil.rmtree(site)
        print(json.dumps({"segments": a.segments, "runs": a.runs, "seconds": a.seconds, "audio": info["audio"],
                          "store": {k: info[k] for k in ("log_s", "mlflow_artifacts_mib", "mlflow_wavs")},
                          "cpus": os.cpu_count(), "sites": results}, indent=1))
    finally:
        if not a.keep_sites:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"sites kept in {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
