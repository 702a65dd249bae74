"""The seed's production scenario at full size, one run each: 278 audiobook segments over 6 cloned
voices at concurrency 16, against the real vLLM-Omni and against the seed's leak planted in it.

    python benchmarks/bench_scale.py [--suite cases/suites/audiobook-278.yaml] [-n 16] [--work DIR]

1. `difftest run SUITE --candidate vllm-omni -n N` (the release in .venv-vllm-omni), logged to a
   real `mlflow server` (SQLite backend, artifacts served by it);
2. `difftest bugs --only ref-leak-4373` with the entry's run moved to SUITE at N (a copy of the
   corpus entry in WORK): the #4373 revert as an overlay on the same release, the same store, so
   the reference side is cached;
3. `difftest dashboard` over that MLflow store.

For each: wall time, the model time the report accounts for (`provenance.timings`), the peak
resident memory of the whole process tree (every process summed, sampled every 0.5 s from /proc),
and for the dashboard its build time and size. Prints one JSON object; WORK keeps every output
(default: a new folder under /tmp). Long: about 25 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")


def _tree_rss(root: int) -> int:
    """Resident bytes of `root` and all its descendants (from /proc; processes that vanish are skipped)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            children.setdefault(int(fields[1]), []).append(int(d))
            rss[int(d)] = int(Path(f"/proc/{d}/statm").read_text().split()[1]) * PAGE
        except (OSError, ValueError, IndexError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def measured(argv: list[str], log: Path, cwd: Path, env: dict | None = None) -> dict:
    """Run argv, its output to `log`; wall time, exit code and peak tree RSS."""
    t0 = time.perf_counter()
    with log.open("w") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        peak = [0]

        def sample():
            while p.poll() is None:
                peak[0] = max(peak[0], _tree_rss(p.pid))
                time.sleep(0.5)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        code = p.wait()
        t.join()
    return {"exit": code, "wall_s": round(time.perf_counter() - t0, 1), "peak_rss_gib": round(peak[0] / 2**30, 2),
            "log": str(log)}


def model_time(report: dict) -> dict:
    t = report["provenance"]["timings"]
    model = {k: v for k, v in t.items() if k.endswith("_s") and k != "total_s"}
    return {"timings": t, "model_s": round(sum(model.values()), 1)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow(work: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    p = subprocess.Popen([str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port),
                          "--backend-store-uri", f"sqlite:///{work}/mlflow.db",
                          "--artifacts-destination", str(work / "mlartifacts"), "--workers", "1"],
                         stdout=(work / "mlflow-server.log").open("w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return p, uri
        except OSError:
            if p.poll() is not None:
                raise SystemExit(f"mlflow server exited {p.returncode}: {work / 'mlflow-server.log'}")
            time.sleep(0.5)
    raise SystemExit(f"mlflow server did not listen on {port} in 120 s")


def leak_corpus(work: Path, suite: str, n: int) -> Path:
    """The seed's corpus entry with its run moved to the scale suite."""
    corpus = work / "corpus"
    src = REPO / "cases" / "bugs" / "ref-leak-4373"
    shutil.copytree(src, corpus / src.name, dirs_exist_ok=True)
    entry = yaml.safe_load((src / "bug.yaml").read_text())
    entry["run"].update(suite=suite, concurrency=n)
    (corpus / src.name / "bug.yaml").write_text(yaml.safe_dump(entry, sort_keys=False))
    return corpus


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default=str(REPO / "cases" / "suites" / "audiobook-278.yaml"))
    ap.add_argument("-n", "--concurrency", type=int, default=16)
    ap.add_argument("--work", type=Path)
    args = ap.parse_args(argv)
    work = (args.work or Path(tempfile.mkdtemp(prefix="bench-scale-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    suite = Path(args.suite).resolve()
    if suite.parent != REPO / "cases" / "suites":
        raise SystemExit("the suite must be in cases/suites/ (the bug corpus names suites from there)")
    difftest = [sys.executable, "-m", "difftest"]
    server, uri = start_mlflow(work)
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    out: dict = {"suite": suite.name, "concurrency": args.concurrency, "work": str(work), "tracking_uri": uri}
    try:
        real = measured([*difftest, "run", str(suite), "--candidate", "vllm-omni", "-n", str(args.concurrency),
                         "--out", str(work / "real"), "--store", str(work / "store"), "--tracking-uri", uri],
                        work / "real.log", REPO, env)
        report = json.loads((work / "real" / "report.json").read_text())
        out["real"] = {**real, **model_time(report), "verdict": report["verdict"], "counts": report["counts"],
                       "segments": report["suite"]["segments"],
                       "report_bytes": (work / "real" / "report.json").stat().st_size}
        print(json.dumps({"real": out["real"]["counts"], "wall_s": real["wall_s"]}), file=sys.stderr)

        corpus = leak_corpus(work, suite.stem, args.concurrency)
        leak = measured([*difftest, "bugs", "--out", str(work / "leak"), "--corpus", str(corpus),
                         "--only", "ref-leak-4373", "--store", str(work / "store"), "--tracking-uri", uri],
                        work / "leak.log", REPO, env)
        bugs = json.loads((work / "leak" / "bugs.json").read_text())
        row = bugs["entries"][0]
        report_path = next((work / "leak").rglob("report.json"))
        lr = json.loads(report_path.read_text())
        donors = [s for s in lr["segments"] if s.get("donor")]
        out["leak"] = {**leak, **model_time(lr), "bugs_json": row, "verdict": lr["verdict"], "counts": lr["counts"],
                       "segments_with_donor": len(donors),
                       "first_divergent_chunks": sorted({s.get("first_divergent_chunk") for s in donors}, key=str)}

        site = work / "site"
        dash = measured([*difftest, "dashboard", "--out", str(site), "--tracking-uri", uri],
                        work / "dashboard.log", REPO, env)
        files = [p for p in site.rglob("*") if p.is_file()]
        out["dashboard"] = {**dash, "files": len(files), "mib": round(sum(p.stat().st_size for p in files) / 2**20, 1)}
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
