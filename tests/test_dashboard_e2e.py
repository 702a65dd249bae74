"""The dashboard on a real `difftest run`: qwen-tts on the tiny checkpoint against the CPU test engine
with the seed's bug planted (`cpu-engine:ref-leak`, concurrency 4), logged to MLflow by the run
itself; the site opened in headless Chromium. About 40 s, most of it the run (needs .venv-reference).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow_support import copy_store
from reference_support import reference_python
from test_dashboard import keep_screenshot, open_page

from dashboards.browser import audio_state
from dashboards.gather import MEDIA
from dashboards.pages import segment_file
from difftest.records.segment_media import safe_name
from difftest.suites import wavio

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "cases" / "suites" / "smoke.yaml"
UI = "http://127.0.0.1:5000"


@pytest.fixture(scope="module")
def real(tmp_path_factory, _empty_mlflow_store):
    reference_python()
    root = tmp_path_factory.mktemp("dashboard-e2e")
    copy_store(_empty_mlflow_store, root)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    env_cmd = [sys.executable, "-m", "difftest", "run", str(SMOKE), "--candidate", "cpu-engine:ref-leak", "-n", "4",
               "--out", str(root / "leak"), "--store", str(root / "store"), "--tracking-uri", uri]
    p = subprocess.run(env_cmd, cwd=root, capture_output=True, text=True, timeout=900)
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    report = json.loads((root / "leak" / "report.json").read_text())
    run_id = json.loads((root / "leak" / "mlflow.json").read_text())["runs"][0]["run_id"]
    sites = {}
    for name, audio in (("site", []), ("site-flac", ["--audio", "flac"])):  # the default (Opus), and lossless
        sites[name] = root / name
        b = subprocess.run([sys.executable, "-m", "dashboards", "--out", str(sites[name]), "--tracking-uri", uri,
                            *audio], cwd=root, capture_output=True, text=True, timeout=300)
        assert b.returncode == 0, b.stdout + b.stderr
    return SimpleNamespace(root=root, site=sites["site"], flac_site=sites["site-flac"], report=report, run_id=run_id,
                           uri=uri)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from dashboards.browser import Chromium, find_chromium

    if find_chromium() is None:
        pytest.fail("no Chromium: apt-get install -y chromium (scripts/test.sh does it)", pytrace=False)
    with Chromium(width=1400, height=900, log=tmp_path_factory.mktemp("chromium") / "chromium.log") as b:
        yield b


def test_real_leak_run_on_the_dashboard(real, browser, tmp_path):
    import numpy as np
    import soundfile
    from mlflow import MlflowClient

    from difftest.suites.suite import load_suite

    segs = {s["id"]: s for s in real.report["segments"]}
    # Which requests leak depends on how the engine batched them (see test_run_e2e): take the report's word.
    leaked = [k for k, s in segs.items() if s["verdict"] == "contamination"]
    assert leaked and all(segs[k]["donor"] for k in leaked)
    first = leaked[0]
    donor = segs[first]["donor"]

    index = open_page(browser, real.site / "index.html")
    row = index.evaluate("document.querySelector('table.runs tbody tr').innerText")
    assert "difftest-cpu-engine:ref-leak" in row and "FAIL" in row and "contamination" in row
    assert f"donor {donor}" in row and first in row
    # a negative control: in its own section, caught, and no vLLM-Omni version
    placed = index.evaluate("""(() => ({versions: document.querySelectorAll('table.matrix').length,
      row: document.querySelector('#controls table.runs tbody tr').dataset.run,
      control: document.querySelector('#controls table.controls tbody tr').innerText}))()""")
    assert placed["versions"] == 0 and placed["row"] == real.run_id
    assert placed["control"].startswith("CPU test engine, planted defect ref-leak\n")
    assert "FAIL caught" in placed["control"]

    run = open_page(browser, real.site / "runs" / real.run_id / "index.html")
    got = run.evaluate("""(() => ({
      cells: document.querySelectorAll('table.heat td.cell').length,
      rows: [...document.querySelectorAll('table.heat tbody tr')].map(r => [r.dataset.segment,
             r.querySelector('.badge').textContent, r.querySelectorAll('td.cell').length]),
      text: document.body.innerText}))()""")
    # 31 frames on the 1,25 schedule: 3 chunks for each of the 4 segments
    assert got["cells"] == 12
    assert got["rows"] == [[k, segs[k]["verdict"], 3] for k in ("smoke-01", "smoke-02", "smoke-03", "smoke-04")]
    assert "candidate at concurrency 1 alone" in got["text"]  # `difftest run` judged c=1 alone: pass
    assert "Negative control / test engine: CPU test engine, planted defect ref-leak, not vLLM-Omni" in got["text"]
    # the measured null beside the candidate: its codes are qwen-tts's (the leak is in the hand-off), no null needed
    nulls = run.evaluate("[...document.querySelectorAll('table.nulls tbody tr')].map(r => r.innerText)")
    assert len(nulls) == 4 and all("not decoded (nothing to explain)" in r and "within the null" in r for r in nulls), nulls
    assert [r.split("\t")[0].split("\n")[0] for r in nulls] == ["at concurrency 1"] * 2 + ["at concurrency N"] * 2

    i = list(segs).index(first)
    page = open_page(browser, real.site / "runs" / real.run_id / segment_file(i, first))
    text = page.evaluate("document.body.innerText")
    suite_text = {seg.id: seg.text for seg in load_suite(SMOKE).segments}
    assert suite_text[first] in text  # the segment's text, from the suite file
    assert f"Donor: {donor}" in text
    roles = page.evaluate("[...document.querySelectorAll('.player')].map(p => p.dataset.role)")
    assert roles == ["reference", "candidate", "cross_own", "cross_donor", "control", "difference"]
    name = safe_name(first)
    originals = Path(MlflowClient(real.uri).download_artifacts(real.run_id, f"audio/{name}", str(tmp_path)))
    # the default site: lossy Opus listening copies, loaded when played, at the WAVs' durations, each
    # player linking its float32 original in MLflow
    srcs = page.evaluate("[...document.querySelectorAll('audio')].map(a => [a.getAttribute('src'), a.preload])")
    assert srcs and all(src.endswith(".opus") and preload == "none" for src, preload in srcs), srcs
    links = page.evaluate("[...document.querySelectorAll('.player a.original')].map(a => a.href)")
    assert links == [f"{UI}/#/experiments/{MlflowClient(real.uri).get_run(real.run_id).info.experiment_id}/runs/"
                     f"{real.run_id}/artifactPath/audio/{name}/{role}.wav" for role in roles]
    assert "Opus copies are lossy" in text
    for role, a in zip(roles, audio_state(page)):
        seconds = soundfile.info(originals / f"{role}.wav").duration
        assert a["error"] is None and seconds > 2.0 and abs(a["duration"] - seconds) <= 0.1, (role, a, seconds)
    stored = json.loads((real.site / "runs" / real.run_id / "media" / MEDIA).read_text())["audio"][name]
    assert set(stored) == {p.stem for p in originals.glob("*.wav")}
    assert {(m["format"], m["lossless"]) for m in stored.values()} == {("opus", False)}
    # the --audio flac site's FLAC holds the run's float32 samples as MLflow has them, to the 24-bit step
    # (times the level it was stored at); 16-bit exactly
    media = real.flac_site / "runs" / real.run_id / "media"
    stored = json.loads((media / MEDIA).read_text())["audio"][name]
    assert set(stored) == {p.stem for p in originals.glob("*.wav")} and {m["format"] for m in stored.values()} == {"flac"}
    for role, meta in stored.items():
        want, _ = wavio.read(originals / f"{role}.wav")
        got, _ = soundfile.read(media / "audio" / name / meta["file"], dtype="float64")
        step = 0.0 if meta["bits"] == 16 else meta["scale"] * 2.0 ** -23
        assert got.shape == want.shape and np.abs(got * meta["scale"] - want).max() <= step, (role, meta)
    # the donor search: decoding with the donor's reference codes explains the audio best
    donor_rows = page.evaluate("[...document.querySelectorAll('tr.culprit td')].map(td => td.textContent)")
    assert donor_rows[0] == donor
    keep_screenshot(page.screenshot(tmp_path / "e2e-segment.png"), "dashboard-e2e-segment.png")
