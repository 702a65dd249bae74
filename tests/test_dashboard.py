"""`difftest dashboard`: a site built from runs made for real (`difftest compare` on toy result sets,
logged with `difftest log` into a sqlite store; a bisect recorded by difftest.bisect's own
session and recorder), opened in a real headless Chromium and checked after layout: verdicts,
donors, heatmap cells, audio that loads, escaping, the bisect's culprit, links into MLflow.

Screenshots: under the test's tmp folder and copied to test-artifacts/ (git-ignored).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from bisect_support import BROKEN, K, make_fakeomni_repo
from mlflow_support import REFERENCE_PROVENANCE, candidate_provenance, closed_uri, copy_store
from toy import toy_codes, toy_decode, toy_result

from difftest.cli import main as difftest_main
from difftest.records.segment_media import safe_name
from difftest.records.tracking import log_run
from difftest.results import write_result

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
UI = "http://mlflow.example:5000"
# Data that must come out as text, never as markup.
HOSTILE_ID = 'x<img src=y onerror="window.__pwned=1">&amp;'
HOSTILE_LABEL = "cand<script>window.__pwned=2</script>"
PWNED = "typeof window.__pwned === 'undefined'"


def keep_screenshot(path: Path, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)  # git-ignored (/test-artifacts/ in .gitignore)
    shutil.copyfile(path, ARTIFACTS / name)


def dashboard(*args, cwd) -> subprocess.CompletedProcess:
    """`python -m dashboards`, what `difftest dashboard` runs."""
    return subprocess.run([sys.executable, "-m", "dashboards", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def dashboard_here(*args, capsys) -> tuple[int, str, str]:
    """The same in this process (no second MLflow import): exit code, stdout, stderr."""
    from difftest.cli import main

    capsys.readouterr()
    code = main(["dashboard", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def make_run(root: Path, name: str, *, version: str, suite: str, leak=(), talker=(), frames: int = 30,
             label: str = "cand", hostile: bool = False) -> Path:
    """A difftest output folder made by `difftest compare` on toy results. Segments s0, s1, s2 (and
    HOSTILE_ID); those in `leak` decoded with s2's reference codes (the seed's leak: contamination,
    donor s2); those in `talker` with three codes changed at frame 7 at concurrency N only
    (concurrency_defect in the talker)."""
    base = root / name
    ref, cand, ctrl = base / "ref", base / "cand", base / "ctrl"
    ids = ["s0", "s1", "s2"] + ([HOSTILE_ID] if hostile else [])
    refs = {sid: toy_codes(10 + i, 50 + i) for i, sid in enumerate(ids)}
    cprov = candidate_provenance(version, "cpu")
    for i, sid in enumerate(ids):
        codes = toy_codes(frames, i)
        own = refs[sid]
        write_result(ref / sid, toy_result(sid, codes, own, provenance=REFERENCE_PROVENANCE,
                                           meta={"runner": "reference", "concurrency": 1}))
        write_result(ctrl / sid, toy_result(sid, codes, own, provenance=cprov, meta={"runner": label, "concurrency": 1}))
        at_n = codes.copy()
        if sid in talker:
            at_n[7, [0, 3, 15]] = (at_n[7, [0, 3, 15]] + 1) % 2048
        used = refs["s2"] if sid in leak else own
        write_result(cand / sid, toy_result(sid, at_n, used, wav=toy_decode(at_n, used), provenance=cprov,
                                            meta={"runner": label, "concurrency": 3}))
    out = base / "out"
    assert difftest_main(["compare", str(ref), str(cand), "--control", str(ctrl), "--out", str(out)]) in (0, 1)
    path = out / "report.json"
    report = json.loads(path.read_text())
    report["suite"] = {"name": suite, "hash": f"{suite}-hash", "segments": len(ids)}
    path.write_text(json.dumps(report, indent=1, sort_keys=True))
    return out


class FakeProber:
    """Decides the fakeomni history's commits as the real prober would (good before K, skip at
    BROKEN, bad from K on), without building anything; bad runs name a real report."""

    def __init__(self, repo: Path, shas: list[str], report: Path):
        self.repo, self.shas, self.report = repo, shas, report

    def probe(self, sha):
        from difftest.bisect.builds import commit_info
        from difftest.bisect.probe import ProbeRecord
        from difftest.bisect.search import BAD, GOOD, SKIP, Vote

        i = self.shas.index(sha)
        info = commit_info(self.repo, sha)
        if i == BROKEN:
            d, why, run = SKIP, "does not build: pip install failed", {"verdict": None, "report": None, "condemned": []}
        elif i >= K:
            d, why = BAD, "1 segment(s) condemned"
            run = {"verdict": "fail", "exit_code": 1, "report": str(self.report),
                   "condemned": [{"id": "s0", "verdict": "contamination", "first_divergent_chunk": 0,
                                  "stage": "handoff", "donor": "s2", "summary": "s2's reference codes"}]}
        else:
            d, why, run = GOOD, "clean", {"verdict": "pass", "exit_code": 0, "report": None, "condemned": []}
        runs = [{"repeat": 0, "outcome": d, "reason": why, "seconds": 0.5, **run}]
        return ProbeRecord(sha, info["subject"], info["date"], Vote(d, (d,), why), runs, {}, 0.5,
                           "2024-01-11T00:00:00+00:00")


@pytest.fixture(scope="module")
def site(tmp_path_factory, _empty_mlflow_store):
    """The store (6 runs in two suites, a bisect) and the site built from it with lossless audio
    (--audio flac: the tests below check its samples; test_the_default_site_... the default, Opus)."""
    from mlflow import MlflowClient

    from difftest.bisect.session import Tracking, run_bisect

    root = tmp_path_factory.mktemp("dashboard")
    store = root / "store"
    store.mkdir()
    copy_store(_empty_mlflow_store, store)
    uri = f"sqlite:///{store / 'mlflow.db'}"
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(store)  # artifacts go to ./mlruns, as with difftest's default URI
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        plan = [("toy", "0.29.0", {}), ("toy", "0.30.0", {"leak": ("s0", "s1"), "talker": (HOSTILE_ID,),
                                                         "hostile": True, "label": HOSTILE_LABEL}),
                ("toy-long", "0.30.0", {"leak": ("s1",), "frames": 60}), ("toy", "0.30.1", {"leak": ("s0", "s1")}),
                ("toy", "0.31.0", {}), ("toy-long", "0.31.0", {"frames": 60})]
        for suite, version, kw in plan:
            out = make_run(root, f"{suite}-{version}", version=version, suite=suite, **kw)
            runs[(suite, version)] = SimpleNamespace(out=out, run_id=log_run(out, uri),
                                                     report=json.loads((out / "report.json").read_text()))
            assert runs[(suite, version)].run_id
        repo = root / "fakeomni"
        shas = make_fakeomni_repo(repo)
        code = run_bisect(repo, shas[0], shas[-1], FakeProber(repo, shas, runs[("toy", "0.30.0")].out / "report.json"),
                          root / "bisect", identity={"recipe": {"name": "fake"}}, suite_name="toy",
                          tracking=Tracking(uri=uri), stdout=io.StringIO(), stderr=io.StringIO())
        assert code == 0
    out = root / "site"
    p = dashboard("--out", out, "--tracking-uri", uri, "--mlflow-ui-url", UI, "--audio", "flac", cwd=root)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "6 runs" in p.stdout and "1 bisects" in p.stdout
    client = MlflowClient(uri)
    bisect_exp = client.get_experiment_by_name("difftest/bisect/toy")
    bisect_run = client.search_runs([bisect_exp.experiment_id], "tags.`difftest.kind` = 'bisect'")[0]
    return SimpleNamespace(root=root, store=store, uri=uri, out=out, runs=runs, shas=shas, client=client,
                           bisect_run=bisect_run, stdout=p.stdout)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from dashboards.browser import BrowserError, Chromium, find_chromium

    if find_chromium() is None:
        pytest.fail("no Chromium: apt-get install -y chromium (scripts/test.sh does it)", pytrace=False)
    try:
        with Chromium(width=1400, height=900, log=tmp_path_factory.mktemp("chromium") / "chromium.log") as b:
            yield b
    except BrowserError as e:
        pytest.fail(f"Chromium did not start: {e}", pytrace=False)


def open_page(browser, path: Path):
    page = browser.open(path.resolve().as_uri())
    assert page.evaluate(PWNED) is True
    return page


def run_page(site, suite, version) -> Path:
    return site.out / "runs" / site.runs[(suite, version)].run_id / "index.html"


def segment_pages(site, suite, version) -> dict[str, Path]:
    """segment id -> its page: one per segment that is not identical or numeric drift."""
    from dashboards.pages import segment_file

    folder = run_page(site, suite, version).parent
    segs = site.runs[(suite, version)].report["segments"]
    return {s["id"]: folder / segment_file(i, s["id"]) for i, s in enumerate(segs)
            if s["verdict"] not in ("identical", "numeric_drift")}


INDEX_JS = """(() => {
  const rows = [...document.querySelectorAll('table.runs tbody tr')];
  return {
    title: document.title,
    text: document.body.innerText,
    runs: rows.map(r => ({id: r.dataset.run, text: r.innerText,
                          verdict: r.querySelector('.badge[class*=" r-"]').textContent,
                          ml: r.querySelector('a.mlflow').href,
                          link: r.querySelector('td a').getAttribute('href')})),
    matrix: [...document.querySelectorAll('table.matrix tbody tr')].map(r => r.innerText),
    bisects: [...document.querySelectorAll('#bisects + table tbody tr')].map(r => r.innerText),
    svgDots: document.querySelectorAll('svg.trend circle').length,
    css: getComputedStyle(document.querySelector('header.top')).backgroundColor,
  };
})()"""


def test_index_shows_versions_verdicts_and_regressions(site, browser, tmp_path):
    page = open_page(browser, site.out / "index.html")
    got = page.evaluate(INDEX_JS)
    assert got["css"] == "rgb(23, 33, 43)"  # the stylesheet loaded from file://
    assert len(got["runs"]) == 6 and got["svgDots"] == 6
    by_id = {r["id"]: r for r in got["runs"]}
    expect = {("toy", "0.29.0"): "PASS", ("toy", "0.30.0"): "FAIL", ("toy-long", "0.30.0"): "FAIL",
              ("toy", "0.30.1"): "FAIL", ("toy", "0.31.0"): "PASS", ("toy-long", "0.31.0"): "PASS"}
    for key, verdict in expect.items():
        run = site.runs[key]
        row = by_id[run.run_id]
        assert row["verdict"] == verdict
        exp_id = site.client.get_run(run.run_id).info.experiment_id
        assert row["ml"] == f"{UI}/#/experiments/{exp_id}/runs/{run.run_id}"
        assert row["link"] == f"runs/{run.run_id}/index.html"
    regressed = by_id[site.runs[("toy", "0.30.0")].run_id]["text"]
    assert "▲ regressed" in regressed and "contamination" in regressed and "donor s2" in regressed
    assert "new: s0, s1" in regressed
    assert "✓ fixed" in by_id[site.runs[("toy", "0.31.0")].run_id]["text"]
    assert "regressed" not in by_id[site.runs[("toy", "0.30.1")].run_id]["text"]  # failing before too
    # diverged and failing shares; onset quality: the worst chunk-0 log-mel, and where
    assert "75%" in regressed  # 3 of 4 segments failing
    assert by_id[site.runs[("toy", "0.29.0")].run_id]["text"].count("0%") >= 2
    # versions × suites: newest version first, one column per suite
    assert [m.split("\n")[0].split()[0] for m in got["matrix"]] == ["0.31.0", "0.30.1", "0.30.0", "0.29.0"]
    v030 = next(m for m in got["matrix"] if m.startswith("0.30.0"))
    assert v030.count("FAIL") == 2 and "▲ regressed" in v030
    assert HOSTILE_LABEL in got["text"]  # shown as text, not run
    assert len(got["bisects"]) == 1 and site.shas[K][:10] in got["bisects"][0]
    assert "handoff: keep one reference per batch" in got["bisects"][0]
    shot = page.screenshot(tmp_path / "index.png")
    keep_screenshot(shot, "dashboard.png")


HEAT_JS = """(() => {
  const rows = [...document.querySelectorAll('table.heat tbody tr')];
  return {
    cells: document.querySelectorAll('table.heat td.cell').length,
    rows: rows.map(r => ({id: r.dataset.segment, verdict: r.querySelector('.badge').textContent,
                          cells: r.querySelectorAll('td.cell').length,
                          onset: [...r.querySelectorAll('td.cell.onset')].map(c => c.dataset.chunk),
                          colours: [...r.querySelectorAll('td.cell')].map(c => getComputedStyle(c).backgroundColor),
                          link: (r.querySelector('th a') || {}).textContent || null})),
    text: document.body.innerText,
  };
})()"""


def test_run_page_heatmap(site, browser, tmp_path):
    run = site.runs[("toy", "0.30.0")]
    page = open_page(browser, run_page(site, "toy", "0.30.0"))
    got = page.evaluate(HEAT_JS)
    # 30 frames on the 1,25 schedule: chunks [0,1), [1,26), [26,30): 3 cells per segment, 4 segments
    assert got["cells"] == 12
    rows = {r["id"]: r for r in got["rows"]}
    assert list(rows) == [s["id"] for s in run.report["segments"]] == ["s0", "s1", "s2", HOSTILE_ID]
    assert {k: (r["verdict"], r["cells"], r["onset"]) for k, r in rows.items()} == {
        "s0": ("contamination", 3, ["0"]), "s1": ("contamination", 3, ["0"]), "s2": ("identical", 3, []),
        HOSTILE_ID: ("concurrency_defect", 3, ["1"])}
    red, green = "rgb(211, 47, 47)", "rgb(46, 125, 50)"
    assert rows["s2"]["colours"] == [green] * 3  # worst-tier view by default
    assert rows["s0"]["colours"][0] == red and rows[HOSTILE_ID]["colours"][1] == red
    assert rows[HOSTILE_ID]["link"] == HOSTILE_ID and rows["s2"]["link"] is None  # clean: no page
    # the log-mel view: a CSS-only switch
    page.evaluate("document.getElementById('view-logmel').click()")
    colours = page.evaluate("[...document.querySelectorAll('tr[data-segment=s2] td.cell')]"
                            ".map(c => getComputedStyle(c).backgroundColor)")
    assert colours == [green] * 3  # log-mel 0: the first bucket
    assert page.evaluate("getComputedStyle(document.querySelector('.legend-logmel')).display") == "flex"
    assert "candidate at concurrency 1 alone" not in got["text"]  # compare has no at_concurrency_1
    long_page = open_page(browser, run_page(site, "toy-long", "0.30.0"))
    assert long_page.evaluate("document.querySelectorAll('table.heat td.cell').length") == 3 * 4  # 60 frames: 4 chunks
    page.evaluate("document.getElementById('view-worst').click()")
    keep_screenshot(page.screenshot(tmp_path / "run.png"), "dashboard-run.png")


HIDDEN_JS = """document.visibilityState === 'hidden' || new Promise(resolve => document.addEventListener(
  'visibilitychange', () => resolve(document.visibilityState === 'hidden'), {once: true}))"""


def test_a_tab_hidden_behind_another_still_gives_its_screenshot(site, browser, tmp_path):
    """Headless Chromium hides a tab once another one opens and then draws no frame for it: a capture
    there never answered (what failed the heatmap test on a busy machine). screenshot() brings it forward."""
    import struct

    from dashboards.browser import BrowserError

    first = open_page(browser, site.out / "index.html")
    open_page(browser, run_page(site, "toy", "0.30.0"))
    try:
        hidden = first.evaluate(HIDDEN_JS, timeout_s=120)  # waits for the visibilitychange event
    except BrowserError as e:
        pytest.fail(f"Chromium never hid the tab behind the new one ({e}): this test needs a browser that "
                    f"hides background tabs, as headless Chromium does", pytrace=False)
    assert hidden is True
    png = first.screenshot(tmp_path / "hidden.png").read_bytes()  # the whole page, as the tests take them
    width, height = struct.unpack(">II", png[16:24])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and width == 1400 and height > 900
    assert first.evaluate("document.visibilityState") == "visible"


SEGMENT_JS = """(() => ({
  title: document.title,
  h1: document.querySelector('h1').innerText,
  text: document.body.innerText,
  players: [...document.querySelectorAll('.player')].map(p => p.dataset.role),
  img: (() => { const i = document.querySelector('img.specdiff'); return i ? [i.naturalWidth, i.complete] : null; })(),
  codes: [...document.querySelectorAll('table.codes')].map(t => [...t.querySelectorAll('tbody tr')].map(
            r => [...r.querySelectorAll('td')].map(c => [c.textContent, c.classList.contains('diff')]))),
  ml: [...document.querySelectorAll('a.mlflow')].map(a => a.href),
  codecs: [...document.querySelectorAll('.player p.codec')].map(p => p.innerText),
  originals: [...document.querySelectorAll('.player a.original')].map(a => a.href),
  preload: [...document.querySelectorAll('audio')].map(a => a.getAttribute('preload')),
}))()"""


def test_contaminated_segment_page(site, browser, tmp_path):
    from dashboards.browser import audio_state

    run = site.runs[("toy", "0.30.0")]
    pages = segment_pages(site, "toy", "0.30.0")
    assert sorted(pages) == ["s0", "s1", HOSTILE_ID] and all(p.is_file() for p in pages.values())
    assert sorted(p.name for p in pages["s0"].parent.glob("seg-*.html")) == sorted(p.name for p in pages.values())
    page = open_page(browser, pages["s0"])
    got = page.evaluate(SEGMENT_JS)
    assert got["h1"].startswith("s0") and "contamination" in got["h1"] and "fails the run" in got["h1"]
    assert "Donor: s2" in got["text"] and "decoded with s2's reference" in got["text"]
    assert "reference codes handed to the vocoder: 12 frames (s2's) instead of its own 10" in got["text"]
    # compare makes no cross-decodes: reference, candidate, the candidate at 1, and the difference
    assert got["players"] == ["reference", "candidate", "control", "difference"]
    # the candidate alone decodes as qwen-tts did: the site stores those samples once, under the reference
    stored = {"reference": "reference", "candidate": "candidate", "control": "reference", "difference": "difference"}
    assert "the same samples as the reference" in got["codecs"][got["players"].index("control")]
    audio = audio_state(page)
    assert [a["src"] for a in audio] == [f"media/audio/s0/{stored[r]}.flac" for r in got["players"]]
    for a in audio:
        assert a["error"] is None and abs(a["duration"] - 30 * 1920 / 24000) < 0.01, a
    loaded = page.loaded_urls(expect=[a["url"] for a in audio])
    for a in audio:
        assert loaded.get(a["url"]) == 200, (a["url"], sorted(loaded))
    assert (page_dir := pages["s0"].parent / "media" / "audio" / "s0" / "difference.flac").is_file(), page_dir
    assert got["img"] is not None and got["img"][0] > 0  # specdiff/<segment>.png from MLflow, decoded
    child = next(r for r in site.client.search_runs([site.client.get_run(run.run_id).info.experiment_id],
                                                    f"tags.`mlflow.parentRunId` = '{run.run_id}'")
                 if r.data.tags["segment.id"] == "s0")
    exp = child.info.experiment_id
    assert got["ml"] == [f"{UI}/#/experiments/{exp}/runs/{run.run_id}",
                         f"{UI}/#/experiments/{exp}/runs/{child.info.run_id}"]
    keep_screenshot(page.screenshot(tmp_path / "segment.png"), "dashboard-segment.png")


# Each distinct file the page's players name, decoded by Chromium's Web Audio at the file's own rate.
DECODE_JS = """(async () => {
  const out = {};
  for (const src of new Set([...document.querySelectorAll('audio')].map(a => a.getAttribute('src')))) {
    const buf = await new OfflineAudioContext(1, 1, %d).decodeAudioData(await (await fetch(src)).arrayBuffer());
    out[src] = {rate: buf.sampleRate, samples: Array.from(buf.getChannelData(0))};
  }
  return out;
})()"""


@contextlib.contextmanager
def served(folder: Path):
    """The site over HTTP, as `python -m http.server -d SITE` serves it (fetch() cannot read file://)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _open_segment_page(browser, root: Path, path: Path) -> tuple[dict, dict]:
    """A segment page served over HTTP: what SEGMENT_JS reads of it, after checking it fetched no
    audio by itself (players load when played), and its audio as Chromium decodes it."""
    with served(root) as url:
        page = browser.open(f"{url}/{path.relative_to(root).as_posix()}")
        page.front()
        got = page.evaluate(SEGMENT_JS)
        page.evaluate("new Promise(r => setTimeout(r, 500))")  # time for anything the page would fetch by itself
        asked = [ev["params"]["request"]["url"] for ev in page.network if ev["method"] == "Network.requestWillBeSent"]
        assert any(u.endswith("style.css") for u in asked) and not [u for u in asked if "/media/audio/" in u], asked
        return got, page.evaluate(DECODE_JS % 24000, timeout_s=120)


def test_segment_audio_is_flac_loaded_when_played_and_decodes_to_the_mlflow_samples(site, browser, tmp_path):
    """The site's audio is FLAC (24-bit: the toy's float32 samples are not 16-bit ones), the page fetches
    none of it until a player plays, and Chromium decodes each file to MLflow's float32 samples within
    the 24-bit step, 2^-23. The spectrogram is a palette PNG within a few levels of MLflow's."""
    import numpy as np
    import soundfile
    from PIL import Image

    from difftest.suites import wavio

    run = site.runs[("toy", "0.30.0")]
    path = segment_pages(site, "toy", "0.30.0")["s0"]
    html = path.read_text()
    assert html.count('<audio controls preload="none" src="media/audio/s0/') == 4 and 'preload="metadata"' not in html
    files = sorted((path.parent / "media" / "audio" / "s0").iterdir())
    assert [f.name for f in files] == ["candidate.flac", "difference.flac", "reference.flac"]
    for f in files:
        info = soundfile.info(f)
        assert (info.format, info.subtype, info.samplerate) == ("FLAC", "PCM_24", 24000), (f, info)
    got, decoded = _open_segment_page(browser, site.out, path)
    assert got["preload"] == ["none"] * 4
    exp = site.client.get_run(run.run_id).info.experiment_id
    assert got["originals"] == [f"{UI}/#/experiments/{exp}/runs/{run.run_id}/artifactPath/audio/s0/{r}.wav"
                                for r in got["players"]]
    assert all(c.startswith("FLAC 24-bit, the float32 samples to 1.19e-07") for c in got["codecs"]), got["codecs"]
    stored = {"reference": "reference", "candidate": "candidate", "control": "reference", "difference": "difference"}
    for role in got["players"]:
        want, info = wavio.read(site.client.download_artifacts(run.run_id, f"audio/s0/{role}.wav", str(tmp_path)))
        assert info.format == "float" and info.bits == 32  # MLflow keeps float32 WAVs
        for src, samples in ((f"Chromium: {stored[role]}", decoded[f"media/audio/s0/{stored[role]}.flac"]["samples"]),
                             ("libsndfile", soundfile.read(path.parent / "media" / "audio" / "s0" / f"{stored[role]}.flac",
                                                           dtype="float64")[0])):
            samples = np.asarray(samples, np.float64)
            assert samples.shape == want.shape, (role, src)
            err = float(np.abs(samples - want).max())
            assert err <= 2.0 ** -23, (role, src, err)
            assert np.abs(want).max() > 0.1  # real audio, not silence that any file would match
    # the spectrogram: a 256-colour PNG, smaller than MLflow's, no pixel more than 8 levels off
    mine = path.parent / "media" / "specdiff" / "s0.png"
    theirs = Path(site.client.download_artifacts(run.run_id, "specdiff/s0.png", str(tmp_path)))
    with Image.open(mine) as a, Image.open(theirs) as b:
        assert a.mode == "P" and a.size == b.size
        diff = np.abs(np.asarray(a.convert("RGB"), np.int16) - np.asarray(b.convert("RGB"), np.int16))
    assert diff.max() <= 8 and mine.stat().st_size < theirs.stat().st_size, (diff.max(), mine.stat().st_size)
    assert f"no pixel off by more than {diff.max()}/255" in got["text"]


def test_the_default_site_stores_lossy_opus_that_chromium_plays(site, browser, tmp_path, capsys):
    """Without --audio the site's audio is Opus (lossy listening copies at media.OPUS_KBPS): Ogg Opus files
    at the WAVs' rate and length, captions and the Listen note that say lossy, nothing fetched until a
    player plays, Chromium decodes each file to the WAV's duration and close to its samples, and each
    player links its float32 original in MLflow. A second build reuses the copies; the same folder built
    with --audio flac replaces them."""
    import argparse
    import inspect
    import re

    import numpy as np
    import soundfile

    from dashboards import cli, media
    from dashboards.browser import audio_state
    from dashboards.site import build
    from difftest.suites import wavio

    parser = argparse.ArgumentParser()
    cli.add_dashboard_parser(parser.add_subparsers())
    assert parser.parse_args(["dashboard", "--out", "x"]).audio == "opus" == media.DEFAULT_AUDIO
    assert inspect.signature(build).parameters["audio"].default == "opus"
    assert set(cli.AUDIO_CHOICES) == set(media.AUDIO_FORMATS) == {"opus", "flac", "wav"}

    out = tmp_path / "default"
    args = ("--out", out, "--tracking-uri", site.uri, "--experiment", "difftest/toy-long", "--mlflow-ui-url", UI)
    code, stdout, err = dashboard_here(*args, capsys=capsys)
    assert code == 0 and "1 diverged segment pages" in stdout, err
    run = site.runs[("toy-long", "0.30.0")]
    folder = out / "runs" / run.run_id
    path = folder / segment_pages(site, "toy-long", "0.30.0")["s1"].name
    files = sorted((folder / "media" / "audio" / "s1").iterdir())
    assert [f.name for f in files] == ["candidate.opus", "difference.opus", "reference.opus"]
    originals = {}
    for role in ("reference", "candidate", "control", "difference"):
        want, info = wavio.read(site.client.download_artifacts(run.run_id, f"audio/s1/{role}.wav", str(tmp_path)))
        assert info.format == "float" and info.bits == 32 and info.sample_rate == 24000
        originals[role] = want
    for f in files:
        info = soundfile.info(f)
        assert (info.format, info.subtype, info.samplerate) == ("OGG", "OPUS", 24000), (f, info)
        assert info.frames == len(originals[f.stem]) == 60 * 1920, (f, info.frames)
        assert "lossy" in soundfile.SoundFile(f).comment.split("; ")
    assert json.loads((folder / "fetched.json").read_text())["audio"] == f"opus {media.OPUS_KBPS} kbit/s"
    stored = json.loads((folder / "media" / "media.json").read_text())["audio"]["s1"]
    assert {(m["format"], m["lossless"]) for m in stored.values()} == {("opus", False)}
    html = path.read_text()
    assert html.count('<audio controls preload="none" src="media/audio/s1/') == 4 and 'preload="metadata"' not in html

    got, decoded = _open_segment_page(browser, out, path)
    assert got["players"] == ["reference", "candidate", "control", "difference"]
    assert got["preload"] == ["none"] * 4
    exp = site.client.get_run(run.run_id).info.experiment_id
    assert got["originals"] == [f"{UI}/#/experiments/{exp}/runs/{run.run_id}/artifactPath/audio/s1/{r}.wav"
                                for r in got["players"]]
    assert all("float32 original in MLflow" in c for c in got["codecs"]), got["codecs"]
    rates = [float(re.match(r"Opus, lossy, (\d+) kbit/s", c).group(1)) for c in got["codecs"]]
    # VBR about the target (libsndfile's own rate is about 40), less where there is little to code (the difference)
    assert 0.8 * media.OPUS_KBPS <= rates[0] <= 1.3 * media.OPUS_KBPS and max(rates) <= 1.3 * media.OPUS_KBPS, rates
    assert "Opus copies are lossy" in got["text"] and "--audio flac for lossless copies" in got["text"]
    stored_as = {"reference": "reference", "candidate": "candidate", "control": "reference", "difference": "difference"}
    srcs = [f"media/audio/s1/{stored_as[r]}.opus" for r in got["players"]]
    for role, src in zip(got["players"], srcs):
        # Chromium's Web Audio decodes the Ogg Opus to the WAV's samples, in place, at a listening copy's fidelity
        want, samples = originals[role], np.asarray(decoded[src]["samples"], np.float32)
        assert decoded[src]["rate"] == 24000 and abs(len(samples) - len(want)) / 24000 <= 0.1, (role, len(samples))
        n = min(len(samples), len(want))
        snr = 10 * np.log10(np.sum(want[:n] ** 2) / np.sum((samples[:n] - want[:n]) ** 2))
        assert np.abs(want).max() > 0.05 and snr >= 15, (role, snr)
    # the players, from file:// as the site is opened: each loads when asked, at the WAV's duration
    played = audio_state(open_page(browser, path))
    assert [a["src"] for a in played] == srcs
    for role, a in zip(got["players"], played):
        seconds = len(originals[role]) / 24000
        assert a["error"] is None and a["ready"] >= 1 and abs(a["duration"] - seconds) <= 0.1, (role, a, seconds)

    # built again the same way: nothing fetched or encoded again
    before = files[0].stat().st_mtime_ns
    code, _, err = dashboard_here(*args, capsys=capsys)
    assert code == 0 and files[0].stat().st_mtime_ns == before, err
    # the same folder built as FLAC: the runs are fetched again, nothing of the Opus copies stays
    code, _, err = dashboard_here(*args, "--audio", "flac", capsys=capsys)
    assert code == 0, err
    assert sorted(f.name for f in (folder / "media" / "audio" / "s1").iterdir()) == [
        "candidate.flac", "difference.flac", "reference.flac"]
    assert "Opus" not in path.read_text() and "FLAC is lossless" in path.read_text()


def test_media_copies_keep_what_the_samples_are():
    """16-bit samples stay exact in 16-bit FLAC; a peak beyond full scale is stored at a power-of-two
    fraction of its level and the page says so (FLAC and Opus); samples FLAC cannot hold are copied as
    they are; identical roles are stored once; a picture with too many colours keeps them all."""
    import tempfile

    import numpy as np
    import soundfile
    from PIL import Image

    from dashboards import media, pages
    from difftest.suites import wavio

    rng = np.random.default_rng(0)
    pcm = (np.rint(np.clip(rng.normal(0, 0.2, 4800), -1, 0.99) * 32768) / 32768).astype(np.float32)
    loud = rng.normal(0, 0.5, 4800).astype(np.float32)
    loud[7] = 1.7
    bad = loud.copy()
    bad[3] = np.nan
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "src"), Path(tmp, "dst")
        src.mkdir()
        for role, x in (("reference", pcm), ("candidate", loud), ("control", loud), ("difference", bad)):
            wavio.write(src / f"{role}.wav", x, 24000)
        stored = media.store_segment_audio(src, dst, "flac", ("reference", "candidate", "control", "difference"),
                                           comment="t")
        assert {r: (m["file"], m["bits"], m["scale"], m["exact"], m["same_as"]) for r, m in stored.items()} == {
            "reference": ("reference.flac", 16, 1, True, None), "candidate": ("candidate.flac", 24, 2, False, None),
            "control": ("candidate.flac", 24, 2, False, "candidate"), "difference": ("difference.wav", 32, 1, True, None)}
        assert sorted(p.name for p in dst.iterdir()) == ["candidate.flac", "difference.wav", "reference.flac"]
        got, _ = soundfile.read(dst / "reference.flac", dtype="float64")
        assert np.array_equal(got, pcm)
        got, _ = soundfile.read(dst / "candidate.flac", dtype="float64")
        assert np.abs(got * 2 - loud).max() <= 2 * 2.0 ** -23
        assert soundfile.SoundFile(dst / "candidate.flac").comment == "t/candidate.wav; stored at 1/2 of its level"
        assert pages.audio_label(stored["reference"]).startswith("FLAC 16-bit, the samples exactly · ")
        assert pages.audio_label(stored["candidate"]).startswith("FLAC 24-bit, the float32 samples to 2.38e-07 · ")
        assert pages.audio_label(stored["difference"]).startswith("WAV 32-bit as in MLflow · ")
        # the same as Opus: lossy, the loud file at 1/2 of its level, the NaN file copied, the control stored once
        opus = media.store_segment_audio(src, Path(tmp, "opus"), "opus",
                                         ("reference", "candidate", "control", "difference"), comment="t")
        assert {r: (m["file"], m["format"], m["scale"], m["lossless"], m["same_as"]) for r, m in opus.items()} == {
            "reference": ("reference.opus", "opus", 1, False, None),
            "candidate": ("candidate.opus", "opus", 2, False, None),
            "control": ("candidate.opus", "opus", 2, False, "candidate"),
            "difference": ("difference.wav", "wav", 1, True, None)}
        assert (soundfile.SoundFile(Path(tmp, "opus", "candidate.opus")).comment
                == "t/candidate.wav; lossy; stored at 1/2 of its level")
        assert pages.audio_label(opus["candidate"]).startswith("Opus, lossy, ")
        noisy = Path(tmp, "noisy.png")
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(noisy)
        assert media.store_picture(noisy, Path(tmp, "out.png")) == {"palette": False, "max_error": 0}
        with Image.open(Path(tmp, "out.png")) as im, Image.open(noisy) as orig:
            assert np.array_equal(np.asarray(im.convert("RGB")), np.asarray(orig.convert("RGB")))


def test_talker_divergence_shows_the_codes_side_by_side_and_escapes_ids(site, browser):
    pages = segment_pages(site, "toy", "0.30.0")
    path = pages[HOSTILE_ID]
    raw = path.read_text()
    assert "<img src=y" not in raw and "<script>window" not in raw  # escaped in the file itself
    page = open_page(browser, path)
    got = page.evaluate(SEGMENT_JS)
    assert got["h1"].split("\n")[0].startswith(HOSTILE_ID)  # literally, &amp; included
    assert "concurrency_defect" in got["h1"]
    codes = got["codes"]
    assert len(codes) == 2  # against the reference, and against the candidate at concurrency 1
    report_seg = next(s for s in site.runs[("toy", "0.30.0")].report["segments"] if s["id"] == HOSTILE_ID)
    a, b = report_seg["comparisons"]["codes"]["codes_at_divergence"]
    assert report_seg["first_divergent_frame"] == 7
    ref_row, cand_row = codes[0]
    assert [int(x) for x, _ in ref_row] == a and [int(x) for x, _ in cand_row] == b and len(a) == 16
    assert [i for i, (_, diff) in enumerate(cand_row) if diff] == [0, 3, 15]
    assert "frame 7" in got["text"]
    audio = page.evaluate("[...document.querySelectorAll('audio')].map(a => a.getAttribute('src'))")
    folder = safe_name(HOSTILE_ID)  # as difftest log named the artifacts
    assert folder == "x_img_src_y_onerror__window.__pwned_1___amp_"
    assert audio and all(s.startswith(f"media/audio/{folder}/") for s in audio)


PROBES_JS = """(() => ({
  rows: [...document.querySelectorAll('table.probes tbody tr')].map(r => ({commit: r.dataset.commit,
          culprit: r.classList.contains('culprit'), text: r.innerText})),
  line: [...document.querySelectorAll('.line span')].map(s => s.className),
  text: document.body.innerText,
}))()"""


def test_bisect_page_shows_probes_and_the_culprit(site, browser, tmp_path):
    from difftest.bisect import search

    page = open_page(browser, site.out / "bisects" / f"{site.bisect_run.info.run_id}.html")
    got = page.evaluate(PROBES_JS)
    shas = site.shas
    assert f"First bad commit: {shas[K]}" in got["text"].replace("\n", " ")
    assert "handoff: keep one reference per batch (last writer wins)" in got["text"]
    # the probes, in the order the search made them
    order = []
    search.bisect(shas, lambda c: order.append(c) or (search.SKIP if shas.index(c) == BROKEN
                                                      else search.BAD if shas.index(c) >= K else search.GOOD))
    assert [r["commit"] for r in got["rows"]] == order
    assert [r["commit"] for r in got["rows"] if r["culprit"]] == [shas[K]]
    decisions = {r["commit"]: r["text"] for r in got["rows"]}
    assert "skip" in decisions[shas[BROKEN]] and "does not build" in decisions[shas[BROKEN]]
    assert "bad" in decisions[shas[K]] and "s0 contamination" in decisions[shas[K]]
    # the commit line: every commit of the range, decided ones coloured, the culprit ringed
    assert len(got["line"]) == len(shas)
    assert got["line"][K] == "bad culprit" and got["line"][0] == "good" and got["line"][-1] == "bad"
    assert got["line"][BROKEN] == "skip" and got["line"][1] == ""  # c1 was never probed
    keep_screenshot(page.screenshot(tmp_path / "bisect.png"), "dashboard-bisect.png")


def test_a_second_build_reuses_what_it_fetched_and_refuses_foreign_folders(site, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    wav = next((site.out / "runs").glob("*/media/audio/s0/candidate.flac"))
    before = wav.stat().st_mtime_ns
    code, out, err = dashboard_here("--out", site.out, "--tracking-uri", site.uri, "--mlflow-ui-url", UI,
                                    "--audio", "flac", capsys=capsys)
    assert code == 0 and "6 runs" in out, err
    assert wav.stat().st_mtime_ns == before  # not downloaded again
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    code, _, err = dashboard_here("--out", foreign, "--tracking-uri", site.uri, capsys=capsys)
    assert code == 2 and "not a difftest dashboard" in err
    assert (foreign / "notes.txt").read_text() == "keep me"
    code, _, err = dashboard_here("--out", tmp_path / "s", capsys=capsys)  # default URI: ./mlflow.db, absent
    assert code == 2 and "no MLflow store" in err and not (tmp_path / "mlflow.db").exists()
    code, _, err = dashboard_here("--out", tmp_path / "s2", "--tracking-uri", closed_uri(), capsys=capsys)
    assert code == 3 and "could not read MLflow" in err


def test_without_report_json_the_segments_come_from_the_child_runs(site, tmp_path, capsys):
    """The fallback reads child-run tags and metric histories: the same verdicts and tiers."""
    from dashboards import model
    from dashboards.gather import _report_from_children

    run = site.runs[("toy", "0.30.0")]
    parent = site.client.get_run(run.run_id)
    kids = site.client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run.run_id}'")
    rebuilt = _report_from_children(parent, kids, site.client)
    assert rebuilt["verdict"] == "fail" and sorted(rebuilt["failing"]) == sorted(run.report["failing"])
    not_clean = [s for s in run.report["segments"] if s["verdict"] not in ("identical", "numeric_drift")]
    assert len(rebuilt["segments"]) == len(not_clean) < len(run.report["segments"])  # the clean ones have no child run
    for want, got in zip(not_clean, rebuilt["segments"]):
        assert (got["id"], got["verdict"], got["donor"], got["donor_kind"], got["first_divergent_chunk"]) == (
            want["id"], want["verdict"], want["donor"], want["donor_kind"], want["first_divergent_chunk"])
        assert [c.tiers for c in model.segment_cells(got)] == [c.tiers for c in model.segment_cells(want)]
    # and a site built from a store whose report.json is gone says so, and still draws the run
    store = tmp_path / "store"
    shutil.copytree(site.store, store)
    art = Path(parent.info.artifact_uri.replace("file://", ""))
    moved = store / art.relative_to(site.store) / "report.json"
    uri = f"sqlite:///{store / 'mlflow.db'}"
    import sqlite3

    with sqlite3.connect(store / "mlflow.db") as db:  # the copy's artifact locations point into the copy
        db.execute("UPDATE runs SET artifact_uri = replace(artifact_uri, ?, ?)", (str(site.store), str(store)))
        db.execute("UPDATE experiments SET artifact_location = replace(artifact_location, ?, ?)",
                   (str(site.store), str(store)))
    moved.unlink()
    code, out, err = dashboard_here("--out", tmp_path / "site", "--tracking-uri", uri, "--experiment", "difftest/toy",
                                    capsys=capsys)
    assert code == 0, err
    assert "segments rebuilt from its child runs (there is one only for each segment that was not" in err
    assert "4 runs" in out
    html = (tmp_path / "site" / "runs" / run.run_id / "index.html").read_text()
    assert "rebuilt from the child runs" in html and html.count('<td class="cell ') == 3 * len(not_clean)  # 3 comparisons


def test_pages_escape_what_comes_from_data():
    from markupsafe import escape

    from dashboards import pages
    from dashboards.gather import Run

    env = pages.environment()
    assert env.list_templates() and all(env.autoescape(name) for name in env.list_templates())
    assert (env.from_string('<a title="{{ t }}">{{ t }}</a>').render(t='"><b>')
            == '<a title="&#34;&gt;&lt;b&gt;">&#34;&gt;&lt;b&gt;</a>')
    assert env.from_string("{{ x }}").render(x=escape("<")) == "&lt;"  # escaped once, not twice
    seg = {"id": "<i>s</i>", "verdict": "<b>v</b>", "summary": "'<script>'", "donor": "\"><svg onload=x>",
           "donor_kind": "<k>", "first_divergent_chunk": 0, "stage": "<s>", "notes": ["<u>"], "comparisons": {}}
    report = {"verdict": "fail", "segments": [seg], "failing": [seg["id"]], "warnings": ["<w>"]}
    run = Run("r1", "1", "difftest/<e>", "n", 0, {"candidate.label": "<l>", "verdict": "fail"}, {}, report,
              "report.json", texts={seg["id"]: "<t>"})
    ctx = pages.Context(ui_url="http://x", uri="<uri>", built="now")
    store = SimpleNamespace(runs=[run], bisects=[], notes=["<n>"])
    for html_text in (pages.run_page(run, ctx), pages.segment_page(run, 0, seg, ctx), pages.index_page(store, ctx)):
        for bad in ("<i>s", "<b>v", "<script>", "<svg onload", "<k>", "<s>", "<u>", "<w>", "<l>", "<t>", "<e>", "<n>",
                    "<uri>"):
            assert bad not in html_text


def test_a_length_donor_is_shown_as_such():
    """The vocoder got the segment's own reference codes at the donor's length: the pages say so, and
    neither play the decode with the donor's reference codes nor mark it the culprit."""
    from dashboards import pages
    from dashboards.gather import Run

    seg = {"id": "a", "verdict": "contamination", "donor": "b", "donor_kind": "length", "stage": "handoff",
           "first_divergent_chunk": 0, "first_divergent_frame": 0, "notes": [],
           "summary": "a's vocoder got its own reference codes cut to b's length (15 frames instead of 20: ...)",
           "comparisons": {
               "ref_codes": {"own_frames": 20, "candidate_frames": 15, "matches_peer": None, "own_from": "control",
                             "own_resized": "cut", "peers_of_that_length": ["b"]},
               "donor_search": {"own_logmel": 1.0, "peers_logmel": {"b": 0.9, "c": 1.2}, "chunks": [0, 1]}}}
    report = {"verdict": "fail", "segments": [seg], "failing": ["a"], "warnings": []}
    media = {"a": {"audio": {r: {"src": f"media/audio/a/{r}.flac", "format": "flac", "bits": 24, "scale": 1,
                                 "bytes": 1000, "artifact": f"audio/a/{r}.wav"}
                             for r in ("candidate", "cross_own", "cross_donor")}}}
    run = Run("r1", "1", "difftest/toy", "n", 0, {"verdict": "fail"}, {}, report, "report.json", media=media)
    ctx = pages.Context(ui_url="http://x", uri="u", built="now")
    page = pages.segment_page(run, 0, seg, ctx)
    assert "<dt>donor</dt><dd>b (length)</dd>" in page
    assert "its vocoder got its own reference codes, cut to b's length" in page
    assert "15 frames instead of its own 20 (own: from the control): its own, cut to that length (b" in page
    assert 'data-role="cross_donor"' not in page and 'data-role="cross_own"' in page
    assert 'class="culprit"' not in page
    assert "donor b (length)" in pages.where_line(run, seg)
    assert "<td>b (length)</td>" in pages.run_page(run, ctx)
    seg["donor_kind"] = "codes"  # a reference-codes donor reads as before
    assert 'data-role="cross_donor"' in pages.segment_page(run, 0, seg, ctx)
    assert pages.where_line(run, seg).endswith("donor b</span>")


def test_cells_rates_and_changes():
    from dashboards import model

    seg = {"verdict": "contamination", "first_divergent_chunk": 0, "id": "a", "comparisons": {
        "codes": {"chunk_agreement": [1.0, 0.5]},
        "vocoder": {"tiers": ["diverged", "close", "identical"], "chunks": {"logmel": [0.5, 0.05, 0.0]}},
        "audio": {"tiers": ["identical"], "chunks": {"logmel": [0.0]}}}}
    cells = model.segment_cells(seg)
    assert [c.worst for c in cells] == [3, 3, 0] and [c.worst_logmel for c in cells] == [0.5, 0.05, 0.0]
    assert model.chunk0_logmel(seg) == 0.5
    assert [model.logmel_bucket(x) for x in (0, 0.005, 0.02, 0.1, 0.2, 0.9, 5)] == [0, 1, 2, 3, 4, 5, 6]
    st = model.run_stats({"segments": [seg, {"id": "b", "verdict": "identical"}], "failing": ["a"]})
    assert (st.diverged_rate, st.failing_rate, st.chunk0_worst_segment, dict(st.onsets)) == (0.5, 0.5, "a", {0: 1})
    R = lambda i, t, v, f: SimpleNamespace(run_id=i, experiment_id="1", device="cpu", start_ms=t, verdict=v,  # noqa: E731
                                           failing=f)
    ch = model.changes([R("c", 3, "pass", []), R("a", 1, "pass", []), R("b", 2, "fail", ["s0"])])
    assert (ch["a"].kind, ch["b"].kind, ch["b"].new_failures, ch["c"].kind, ch["c"].gone_failures) == (
        None, "regressed", ["s0"], "fixed", ["s0"])


def test_from_a_tracking_server(mlflow_server, tmp_path, capsys):
    """The same from a real `mlflow server`: report.json and the media come through its artifact proxy."""
    out = make_run(tmp_path, "srv", version="0.30.0", suite="dashboard-server", leak=("s0",))
    run_id = log_run(out, mlflow_server)
    assert run_id
    code, stdout, err = dashboard_here("--out", tmp_path / "site", "--tracking-uri", mlflow_server,
                                       "--experiment", "difftest/dashboard-server", "--mlflow-ui-url", mlflow_server,
                                       capsys=capsys)
    assert code == 0 and "1 runs, 1 diverged segment pages" in stdout, err
    folder = tmp_path / "site" / "runs" / run_id
    assert json.loads((folder / "report.json").read_text())["verdict"] == "fail"
    # Opus (the default); the candidate alone decoded as the reference did, so its samples are stored once,
    # as the reference's
    assert {p.name for p in (folder / "media" / "audio" / "s0").iterdir()} == {
        "reference.opus", "candidate.opus", "difference.opus"}
    page = (folder / "index.html").read_text()
    assert f'href="{mlflow_server}/#/experiments/' in page and "rebuilt from" not in page


# -- candidate lines: controls are not versions ---------------------------------------------------------
CPU_ENGINE = "difftest CPU test engine (not vLLM-Omni)"  # what difftest/run.py records as the engine


def omni_candidate(version: str, device: str = "cpu", api: str | None = None, mutant: str | None = None) -> dict:
    """report.json's `candidate` as `difftest run --candidate vllm-omni[-offline[:async]]` writes it
    (`mutant`: as `difftest bugs` runs a corpus entry's mutant)."""
    from difftest.engines.vllm_omni import VllmOmniOptions, _provenance

    env = {"vllm_omni": version, "vllm": "0.30.1", "torch": "2.10.0", "difftest_capture": "0.1.0",
           "vllm_omni_mutant": {"bug": mutant, "release": version} if mutant else None}
    info = _provenance(env, VllmOmniOptions(device=device), Path("/out/vllm-omni/deploy-overlay.yaml"), None)
    if api is not None:  # difftest/vllm_omni.py's start_vllm_omni_offline
        info.update(label=f"vllm-omni {version} offline" + (" async" if api == "async" else ""),
                    api="offline (vllm_omni.Omni)" if api == "batch" else "offline (vllm_omni.AsyncOmni)")
    return {**info, "pattern": "barrier", "order": "suite", "voice_mode": "inline", "batches": []}


def cpu_engine_candidate(defect: str | None) -> dict:
    """report.json's `candidate` as `difftest run --candidate cpu-engine[:DEFECT]` writes it."""
    from difftest.run import CandidateSpec

    spec = CandidateSpec.parse("cpu-engine" + (f":{defect}" if defect else ""))
    return {"label": spec.label, "engine": CPU_ENGINE, "defect": spec.defect, "start_seconds": 1.0,
            "pattern": "barrier", "order": "suite", "voice_mode": "inline", "batches": []}


def as_run(out: Path, candidate: dict, suite_hash: str) -> Path:
    """Make a `difftest compare` output read like a `difftest run` one: its candidate section and suite hash."""
    path = out / "report.json"
    report = json.loads(path.read_text())
    report["candidate"] = candidate
    report["suite"]["hash"] = suite_hash
    path.write_text(json.dumps(report, indent=1, sort_keys=True))
    return out


# In this order, on suite `lines` (hash h1 unless said), device cpu unless said:
LINES_PLAN = (
    ("omni-pass", omni_candidate("0.30.0"), "h1", {}),
    ("leak-control", cpu_engine_candidate("ref-leak"), "h1", {"leak": ("s0", "s1")}),  # the negative control
    ("omni-fail", omni_candidate("0.31.0"), "h1", {"leak": ("s0",)}),  # regressed against omni-pass
    ("clean-control", cpu_engine_candidate(None), "h1", {}),
    ("omni-edited-suite", omni_candidate("0.31.1"), "h2", {}),  # another suite hash: not "fixed"
    ("omni-cuda", omni_candidate("0.31.1", device="cuda"), "h1", {"leak": ("s1",)}),  # another device
    ("offline-pass", omni_candidate("0.31.0", api="batch"), "h1", {}),  # another line: not "fixed"
)


@pytest.fixture(scope="module")
def lines_site(tmp_path_factory, _empty_mlflow_store):
    root = tmp_path_factory.mktemp("dashboard-lines")
    copy_store(_empty_mlflow_store, root)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        for name, candidate, suite_hash, kw in LINES_PLAN:
            out = as_run(make_run(root, name, version="unused", suite="lines", **kw), candidate, suite_hash)
            runs[name] = log_run(out, uri)
            assert runs[name]
    site = root / "site"
    p = dashboard("--out", site, "--tracking-uri", uri, cwd=root)
    assert p.returncode == 0, p.stdout + p.stderr
    return SimpleNamespace(root=root, uri=uri, out=site, runs=runs)


LINES_JS = """(() => {
  const controls = document.getElementById('controls');
  const rest = document.body.cloneNode(true);  // the page without the controls' section
  if (controls) rest.querySelector('#controls').remove();
  return {
    runs: Object.fromEntries([...document.querySelectorAll('table.runs tbody tr')].map(r => [r.dataset.run, r.innerText])),
    versions: [...document.querySelectorAll('table.matrix')].map(t => [t.caption.innerText,
               [...t.querySelectorAll('tbody tr')].map(r => r.innerText)]),
    controls: controls && {heading: controls.querySelector('h2').innerText,
                           rows: [...controls.querySelectorAll('table.controls tbody tr')].map(r => r.innerText),
                           runs: [...controls.querySelectorAll('table.runs tbody tr')].map(r => r.dataset.run)},
    outside: {text: rest.textContent, links: [...rest.querySelectorAll('a')].map(a => a.getAttribute('href'))},
  };
})()"""


def test_controls_are_not_versions_and_changes_stay_within_a_line(lines_site, browser, tmp_path):
    from dashboards import model

    page = open_page(browser, lines_site.out / "index.html")
    got = page.evaluate(LINES_JS)
    keep_screenshot(page.screenshot(tmp_path / "controls.png"), "dashboard-controls.png")
    runs = {name: got["runs"][rid] for name, rid in lines_site.runs.items()}
    # the planted leak right after a clean vLLM-Omni run: a control doing its job, not a regression
    assert "FAIL" in runs["leak-control"] and "regressed" not in runs["leak-control"]
    # the vLLM-Omni run that fails after the one that passed: a regression, whatever ran between them
    assert "▲ regressed" in runs["omni-fail"] and "new: s0" in runs["omni-fail"]
    for name in ("omni-pass", "clean-control", "omni-edited-suite", "omni-cuda", "offline-pass"):
        assert "regressed" not in runs[name] and "fixed" not in runs[name], (name, runs[name])
    # the versions tables: vLLM-Omni only, a table per candidate line, newest version first
    assert [(caption, [row.split()[0] for row in rows]) for caption, rows in got["versions"]] == [
        ("vLLM-Omni server", ["0.31.1", "0.31.0", "0.30.0"]), ("vLLM-Omni offline API (Omni)", ["0.31.0"])]
    cells = [row for _, rows in got["versions"] for row in rows]
    assert [row.split()[0] for row in cells if "▲ regressed" in row] == ["0.31.0"]  # omni-fail's cell
    assert not any("fixed" in row for row in cells)
    # the controls: their own, labelled section, the clean engine first, and nothing of them elsewhere
    ctl = got["controls"]
    assert ctl["heading"] == "Negative controls / test engines"
    assert [row.split("\n")[0] for row in ctl["rows"]] == ["CPU test engine, clean",
                                                           "CPU test engine, planted defect ref-leak"]
    assert "difftest-cpu-engine · must pass" in ctl["rows"][0] and "PASS clean" in ctl["rows"][0]
    assert "difftest-cpu-engine:ref-leak · must fail" in ctl["rows"][1] and "FAIL caught" in ctl["rows"][1]
    assert ctl["runs"] == [lines_site.runs["clean-control"], lines_site.runs["leak-control"]]  # newest first
    assert "cpu-engine" not in got["outside"]["text"]
    control_ids = (lines_site.runs["clean-control"], lines_site.runs["leak-control"])
    assert not [a for a in got["outside"]["links"] if any(rid in a for rid in control_ids)]
    # the same from the model: each run against the one before it in its series
    ch = model.changes(gather_runs(lines_site.uri, lines_site.root))
    prev = {name: ch[rid].previous for name, rid in lines_site.runs.items()}
    assert prev == {"omni-pass": None, "leak-control": None, "omni-fail": lines_site.runs["omni-pass"],
                    "clean-control": None, "omni-edited-suite": None, "omni-cuda": None, "offline-pass": None}
    assert [n for n, rid in lines_site.runs.items() if ch[rid].kind] == ["omni-fail"]


def gather_runs(uri: str, root: Path) -> list:
    from dashboards.gather import gather
    from difftest.records.tracking import mlflow_client

    with mlflow_client(uri) as client:
        return gather(client, root / "gathered").runs


def test_candidate_lines_from_the_tags_difftest_logs():
    """Each kind of candidate, logged as `difftest run` and as `difftest compare` log it, falls into its line."""
    from dashboards import model
    from difftest.records.mlflow_records import parent_tags

    def line(candidate: dict):
        return model.candidate_line(parent_tags({"format": "difftest.report/1", "candidate": candidate}, "sha"))

    def compared(candidate: dict, runner: str):  # compare: the runner's label, the results' provenance
        return line({"label": runner, "provenance": {k: v for k, v in candidate.items() if k != "pattern"}})

    cases = {
        "vllm-omni": [omni_candidate("0.30.0"), compared(omni_candidate("0.30.0"), "vllm-omni"),
                      {"label": "cand", "provenance": candidate_provenance("0.29.0", "cpu")}],
        "vllm-omni-offline": [omni_candidate("0.30.0", api="batch"),
                              compared(omni_candidate("0.30.0", api="batch"), "vllm-omni-offline")],
        "vllm-omni-offline:async": [omni_candidate("0.30.0", api="async"),
                                    compared(omni_candidate("0.30.0", api="async"), "vllm-omni-offline:async")],
        "url:http://gpu-host:8091": [{"label": "http://gpu-host:8091", "url": "http://gpu-host:8091"}],
        "cpu-engine": [cpu_engine_candidate(None), compared(cpu_engine_candidate(None), "difftest-cpu-engine")],
        "cpu-engine:ref-leak": [cpu_engine_candidate("ref-leak"),
                                compared(cpu_engine_candidate("ref-leak"), "difftest-cpu-engine:ref-leak"),
                                {"label": "difftest-cpu-engine:ref-leak"}],
        "other:my-engine": [{"label": "my-engine"}],
        "vllm-omni-bug:ref-leak-4373": [omni_candidate("0.30.0", mutant="ref-leak-4373")],
    }
    for key, candidates in cases.items():
        for c in candidates:
            got = c if isinstance(c, model.Line) else line(c)
            assert got.key == key, (key, c)
    controls = {key: line(cands[0]) for key, cands in cases.items() if key.startswith(("cpu-engine", "vllm-omni-bug"))}
    assert {k: (v.control, v.expect, v.defect) for k, v in controls.items()} == {
        "cpu-engine": (True, "pass", None), "cpu-engine:ref-leak": (True, "fail", "ref-leak"),
        "vllm-omni-bug:ref-leak-4373": (True, "fail", "ref-leak-4373")}  # a mutant is never the release
    assert not any(line(c[0]).control for k, c in cases.items() if not k.startswith(("cpu-engine", "vllm-omni-bug")))
    # a planted defect's line expects the run to fail: a run that passes after one that failed is the regression
    R = lambda i, t, v: SimpleNamespace(run_id=i, experiment_id="1", device="cpu", start_ms=t, verdict=v,  # noqa: E731
                                        failing=[], line=controls["cpu-engine:ref-leak"], suite_hash="h")
    ch = model.changes([R("a", 1, "fail"), R("b", 2, "pass"), R("c", 3, "fail")])
    assert (ch["a"].kind, ch["b"].kind, ch["c"].kind) == (None, "regressed", "fixed")


def test_the_segment_page_plots_the_teacher_forced_trace():
    """The trace in report.json becomes a plot: one point per frame for codebook 0 and for the worst of
    codebooks 1-15, the policy's max_gap as a dashed line, the first divergent frame marked."""
    import re

    from dashboards import pages
    from dashboards.gather import Run

    trace = {"start": 10, "end": 16, "rank_codebook0": [0, 0, 3, 400, 0, 1],
             "gap_codebook0": [0, 0, 0.1, 2.5, 0, 0.01], "rank_codebooks_1_15": [0, 1, 0, 2, 0, 0],
             "gap_codebooks_1_15": [0, 0.02, 0, 0.3, 0, 0]}
    seg = {"id": "a", "verdict": "talker_defect", "stage": "talker", "first_divergent_chunk": 0,
           "first_divergent_frame": 13, "notes": [], "summary": "teacher-forced ...",
           "comparisons": {"forced": {"decoding": "greedy", "top1_share": 0.5, "trace": trace}}}
    report = {"verdict": "fail", "segments": [seg], "failing": ["a"], "warnings": [],
              "policy": {"forced": {"max_gap": 0.25}}}
    run = Run("r1", "1", "difftest/toy", "n", 0, {"verdict": "fail"}, {}, report, "report.json", media={})
    page = pages.segment_page(run, 0, seg, pages.Context(ui_url="http://x", uri="u", built="now"))
    lines = re.findall(r'<polyline points="([^"]+)"', page)
    assert len(lines) == 2 and all(len(p.split()) == 6 for p in lines)
    ys = [float(pt.split(",")[1]) for pt in lines[0].split()]
    assert ys.index(min(ys)) == 3  # the 2.5-nat frame is the highest point
    assert 'class="threshold"' in page and "policy max_gap 0.25" in page
    assert 'class="divergence"' in page and ">frame 13<" in page
    assert "codebook-0 top-1 at 50% of frames; worst codebook-0 rank shown 400" in page
    del seg["comparisons"]["forced"]
    assert "Not scored" in pages.segment_page(run, 0, seg, pages.Context(ui_url="http://x", uri="u", built="now"))


def test_the_run_and_segment_pages_show_the_candidate_beside_the_measured_null():
    """report.json's measured null (at 1 and at N) becomes a table on the run page, the segment's own
    counts and its flip's batch noise a table and a line on the segment page; a failing test is marked."""
    from dashboards import pages
    from dashboards.gather import Run

    seg = {"id": "a", "verdict": "concurrency_defect", "stage": "talker", "first_divergent_chunk": 0,
           "first_divergent_frame": 3, "notes": [], "summary": "codes at N ...",
           "comparisons": {"near_tie": {"near_tie": False, "null_n": {"dtype": "float32", "exact": True, "segments": 20,
                                                                       "flips": 0, "max_gap": None}}}}
    site = {"candidate": {"tokens": 1860, "off_top1": 55, "rate": 0.0296}, "null": {"tokens": 1860, "off_top1": 0},
            "p_value": 6.3e-13, "alpha": 0.00167}
    report = {"verdict": "fail", "segments": [seg], "failing": ["a"], "warnings": [],
              "measured_null": {"verdict": "pass", "numerics": {"dtype": "float32", "from": "the engine's identity"},
                                "sites": {"talker": {"candidate": {"tokens": 124, "off_top1": 0}, "p_value": 1.0,
                                                     "alpha": 0.0025}},
                                "segments": {"a": {"talker": [0, None, 31]}}},
              "measured_null_at_n": {"verdict": "concurrency_defect", "site": "code_predictor",
                                     "numerics": {"dtype": "float32", "from": "the engine's identity"},
                                     "summary": "the candidate's greedy code predictor tokens ...",
                                     "sites": {"code_predictor": site},
                                     "flips": {"candidate": 3, "segments": 4, "null": 0, "null_max_gap": None,
                                               "p_value": 0.216, "width_p_value": 1.0, "alpha": 0.00125,
                                               "candidate_flipped": {"a": {"frame": 3, "codebook": 0, "gap": 0.1},
                                                                     "b": {"frame": 1, "codebook": 2, "gap": 0.02}},
                                               "null_flipped": {}},
                                     "segments": {"a": {"code_predictor": [20, 0, 465]}}}}
    run = Run("r1", "1", "difftest/toy", "n", 0, {"verdict": "fail"}, {}, report, "report.json", media={})
    rows = pages.null_tests(report)
    assert [(r["where"], r["candidate"], r["null"], r["flagged"]) for r in rows] == [
        ("at concurrency 1", "0 of 124", "not decoded (nothing to explain)", False),
        ("at concurrency N", "55 of 1860", "0 of 1860", True),
        ("at concurrency N", "3 of 4", "0 of 4", False),
        ("at concurrency N", "0.02-0.1 nats", "none", False)]
    assert rows[1]["numerics"] == "float32 (the engine's identity)" and rows[2]["numerics"] is None
    ctx = pages.Context(ui_url="http://x", uri="u", built="now")
    page = pages.segment_page(run, 0, seg, ctx)
    assert "Beside the measured null" in page and "never" not in page
    assert "parts from itself alone in 0 of 20 segments" in page
    assert pages.segment_null(report, "a") == [
        {"where": "at concurrency 1", "site": "talker (codebook 0)", "candidate": 0, "null": "not decoded", "tokens": 31},
        {"where": "at concurrency N", "site": "code predictor (codebooks 1-15)", "candidate": 20, "null": 0,
         "tokens": 465}]
    del report["measured_null"], report["measured_null_at_n"], seg["comparisons"]["near_tie"]
    assert pages.null_tests(report) == [] and "Beside the measured null" not in pages.segment_page(run, 0, seg, ctx)
