"""build(): read the MLflow store, write the static site.

    SITE/index.html                          versions × suites, runs per suite over time, bisects
    SITE/assets/style.css
    SITE/runs/<run>/index.html               a run: provenance, segments × chunks heatmap
    SITE/runs/<run>/seg-<n>-<segment>.html   a diverged segment: audio, spectrogram difference, codes, donor
    SITE/runs/<run>/report.json, media/      fetched from MLflow (kept: a second build fetches only new runs);
                                             media/ holds the audio as Opus (or --audio flac|wav) and
                                             palette PNGs, media/media.json says what (media.py)
    SITE/bisects/<run>.html                  a bisect: the commit line, the probes, the culprit
    SITE/.difftest-dashboard                 marks the folder as a dashboard: only such a folder is written over
"""

from __future__ import annotations

import datetime as _dt
import shutil
from dataclasses import dataclass
from pathlib import Path

from dashboards import model, pages
from dashboards.assets import stylesheet
from dashboards.gather import Store, gather
from dashboards.media import DEFAULT_AUDIO
from difftest.errors import BadInput
from difftest.records.segment_media import safe_name
from difftest.results import atomic_write

MARKER = ".difftest-dashboard"


@dataclass
class Built:
    index: Path
    runs: int
    segment_pages: int
    bisects: int
    notes: list


def _prepare(site: Path) -> None:
    if site.exists() and not site.is_dir():
        raise BadInput(f"--out {site}: not a folder")
    if site.is_dir() and any(site.iterdir()) and not (site / MARKER).is_file():
        raise BadInput(f"--out {site}: a non-empty folder that is not a difftest dashboard; "
                       f"give a new or empty folder (or an earlier dashboard's)")
    site.mkdir(parents=True, exist_ok=True)
    (site / MARKER).write_text("built by `difftest dashboard`; its contents are replaced on every build\n")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text.encode())


def render_site(store: Store, site: Path, ctx: pages.Context) -> Built:
    """Write every page for what gather() found (pure but for the writing)."""
    ctx.changes = model.changes(store.runs)
    ctx.runs = {r.run_id: r for r in store.runs}
    _write(site / "assets" / "style.css", stylesheet())
    n_seg = 0
    for run in store.runs:
        folder = site / "runs" / safe_name(run.run_id)
        for old in folder.glob("seg-*.html"):
            old.unlink()
        _write(folder / "index.html", pages.run_page(run, ctx))
        for i, seg in pages.diverged_segments(run.report):
            _write(folder / pages.segment_file(i, seg["id"]), pages.segment_page(run, i, seg, ctx))
            n_seg += 1
    shutil.rmtree(site / "bisects", ignore_errors=True)
    for b in store.bisects:
        _write(site / "bisects" / f"{safe_name(b.run_id)}.html", pages.bisect_page(b, ctx))
    index = site / "index.html"
    _write(index, pages.index_page(store, ctx))
    return Built(index, len(store.runs), n_seg, len(store.bisects), list(store.notes))


def build(uri: str, site: str | Path, *, ui_url: str = "http://127.0.0.1:5000", experiments: list[str] | None = None,
          title: str = "difftest dashboard", audio: str = DEFAULT_AUDIO) -> Built:
    """Gather from the MLflow store at `uri` and write the site into `site`, the audio stored as `audio`
    (media.AUDIO_FORMATS). Raises BadInput for an unusable --out or a missing local store,
    tracking.TrackingUnavailable when MLflow cannot be read."""
    from difftest.records.tracking import check_tracking_uri, mlflow_client

    site = Path(site)
    check_tracking_uri(uri, must_exist=True)  # a missing or foreign local store: exit 2, naming it
    _prepare(site)
    with mlflow_client(uri) as client:
        store = gather(client, site, experiments, audio)
    store.uri = uri
    built = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return render_site(store, site, pages.Context(ui_url=ui_url, uri=uri, built=built, title=title))
