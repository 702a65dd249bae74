"""Everything the dashboard shows, read from MLflow (what `difftest log` and `difftest bisect` wrote;
docs/mlflow-and-gate.md, difftest/mlflow_records.py, difftest/bisect/record.py).

- runs: parent runs tagged `difftest.kind=run`, FINISHED and not deleted, in every experiment
  (or the ones asked for). Each run's report.json artifact is the source of its segments and
  per-chunk comparisons; when it cannot be had, the segments are rebuilt from the child runs
  (`difftest.kind=segment`: tags, and per-chunk metric histories `<comparison>.tier`,
  `.logmel`, `.snr_db`, `.max_abs`, `codes.chunk_agreement` with step = chunk index).
- media: each run's `audio/<segment>/*.wav` and `specdiff/<segment>.png`, downloaded and stored
  smaller in the site (SITE/runs/<run>/media/: Opus by default, or FLAC or WAV; palette PNGs; media.py),
  what was stored described in media/media.json; a run fetched before (same report sha256, audio
  stored the same way) is not fetched again.
- bisects: parent runs `difftest.kind=bisect` with their probe runs (`difftest.kind=bisect-probe`:
  candidate.commit, bisect.subject, bisect.decision, ..., `difftest.culprit=true` on the first
  bad commit's) and the parent's bisect.json artifact when present (the commit line).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dashboards import model
from dashboards.media import DEFAULT_AUDIO, audio_settings, store_picture, store_segment_audio
from difftest.compare.chunks import TIERS
from difftest.records.segment_media import safe_name
from difftest.records.tracking import _search_all

log = logging.getLogger(__name__)

KIND = "difftest.kind"
PARENT = "mlflow.parentRunId"
REPORT_SHA = "difftest.report_sha256"
SEGMENT_RUNS, NOT_CLEAN = "difftest.segment_runs", "not_clean"  # difftest/records/mlflow_records.py
# difftest/bisect/record.py's names (as found there; one place to change if they change)
BISECT_KIND, PROBE_KIND = "bisect", "bisect-probe"
CULPRIT = "difftest.culprit"
REPRO_TAG = "difftest.repro"  # difftest/records/tracking.py: segments with a repro bundle (artifacts repro/<segment>/)
BISECT_STATE = "bisect.json"

FETCHED = "fetched.json"
FETCHED_FORMAT = "difftest.dashboard.fetched/1"
MEDIA = "media.json"  # under media/: what store_segment_audio and store_picture wrote, per segment
AUDIO_ROLES = ("reference", "candidate", "control", "cross_own", "cross_donor", "difference")


@dataclass
class Run:
    run_id: str
    experiment_id: str
    experiment: str
    name: str
    start_ms: int
    tags: dict
    metrics: dict
    report: dict  # report.json, or one rebuilt from the child runs
    source: str  # "report.json" | "child runs"
    children: dict = field(default_factory=dict)  # segment id -> child run id
    media: dict = field(default_factory=dict)  # segment id -> {"audio": {role: {"src": path, ...}}, "specdiff": ...}
    texts: dict = field(default_factory=dict)  # segment id -> text, from the suite file when it is readable

    @property
    def verdict(self) -> str:
        return self.tags.get("verdict") or self.report.get("verdict") or "?"

    @property
    def device(self) -> str:
        return self.tags.get("device", "")

    @property
    def version(self) -> str:
        """What the run tested, as people name it: the candidate's version, else vLLM-Omni's, else its label."""
        return (self.tags.get("candidate.version") or self.tags.get("vllm_omni.version")
                or self.tags.get("candidate.label") or "?")

    @property
    def line(self) -> model.Line:
        """The candidate line: vLLM-Omni's server or offline API, a URL, or a control (the CPU test engine)."""
        return model.candidate_line(self.tags)

    @property
    def suite_hash(self) -> str:
        return self.tags.get("suite.hash", "")

    @property
    def failing(self) -> list[str]:
        return model.failing_ids(self.report)

    @property
    def suite(self) -> str:
        return self.tags.get("suite.name") or self.experiment.removeprefix("difftest/")


@dataclass
class Probe:
    run_id: str
    start_ms: int
    tags: dict
    metrics: dict

    def tag(self, key: str, default: str = "") -> str:
        return self.tags.get(key) or default

    @property
    def commit(self) -> str:
        return self.tag("candidate.commit")

    @property
    def culprit(self) -> bool:
        return self.tags.get(CULPRIT) == "true"


@dataclass
class Bisect:
    run_id: str
    experiment_id: str
    experiment: str
    name: str
    start_ms: int
    status: str
    tags: dict
    metrics: dict
    probes: list  # of Probe, in the order they ran
    state: dict | None  # bisect.json

    @property
    def culprit(self) -> str | None:
        return (self.tags.get("bisect.first_bad") or next((p.commit for p in self.probes if p.culprit), None)
                or None)


@dataclass
class Store:
    uri: str
    runs: list
    bisects: list
    notes: list = field(default_factory=list)  # what could not be read, for the index page


def _experiments(client, names: list[str] | None) -> dict[str, str]:
    """experiment id -> name: the named ones, or every active experiment."""
    if names:
        out = {}
        for n in names:
            exp = client.get_experiment_by_name(n)
            if exp is not None and exp.lifecycle_stage == "active":
                out[exp.experiment_id] = exp.name
        return out
    out, token = {}, None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        out.update({e.experiment_id: e.name for e in page})
        token = page.token
        if not token:
            return out


def _search(client, exp_ids: list[str], filter_string: str) -> list:
    found = []
    for i in range(0, len(exp_ids), 100):  # servers take at most 100 experiment ids per search
        found += _search_all(client, exp_ids[i:i + 100], filter_string)
    return found


def _download(client, run_id: str, path: str, dst: Path) -> Path | None:
    try:
        return Path(client.download_artifacts(run_id, path, str(dst)))
    except Exception as e:  # MlflowException, OSError, requests errors: the artifact is missing or unreachable
        log.warning("run %s: artifact %s not downloaded: %s", run_id, path, str(e).splitlines()[0] if str(e) else e)
        return None


def _root_artifacts(client, run_id: str) -> set[str]:
    try:
        return {f.path for f in client.list_artifacts(run_id)}
    except Exception as e:
        log.warning("run %s: artifacts not listed: %s", run_id, str(e).splitlines()[0] if str(e) else e)
        return set()


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _report_from_children(parent, kids: list, client) -> dict:
    """The segments as the child runs record them: tags, and the per-chunk metric histories."""
    segments = []
    for kid in sorted(kids, key=lambda k: (k.info.start_time or 0, k.info.run_name or "")):
        t = kid.data.tags
        comps: dict = {}
        for key in sorted(kid.data.metrics):
            comp, _, metric = key.partition(".")
            wanted = ((comp in model.AUDIO_COMPARISONS and metric in ("tier", "logmel", "snr_db", "max_abs"))
                      or (comp in model.CODE_COMPARISONS and metric == "chunk_agreement"))
            if not wanted:
                continue
            hist = sorted((m.step, m.value) for m in client.get_metric_history(kid.info.run_id, key))
            values = [None] * (max((s for s, _ in hist), default=-1) + 1)
            for s, v in hist:
                values[s] = v
            body = comps.setdefault(comp, {})
            if metric == "tier":
                body["tiers"] = [TIERS[int(v)] if v is not None and 0 <= int(v) < len(TIERS) else None for v in values]
            elif metric == "chunk_agreement":
                body["chunk_agreement"] = values
            else:
                body.setdefault("chunks", {})[metric] = values

        def _int(k):
            try:
                return int(t[k])
            except (KeyError, ValueError):
                return None

        segments.append({"id": t.get("segment.id") or kid.info.run_name, "verdict": t.get("verdict"),
                         "stage": t.get("stage"), "donor": t.get("donor"), "donor_kind": t.get("donor_kind"),
                         "error_kind": t.get("error_kind"),
                         "first_divergent_chunk": _int("first_divergent_chunk"),
                         "first_divergent_frame": _int("first_divergent_frame"),
                         "summary": t.get("summary", ""), "notes": [n for n in t.get("notes", "").split("; ") if n],
                         "comparisons": comps, "failing": t.get("failing") == "true"})
    tags = parent.data.tags
    return {"format": "difftest.report/1", "verdict": tags.get("verdict"), "segments": segments,
            "failing": [s["id"] for s in segments if s.pop("failing")],
            "concurrency": int(tags["concurrency"]) if tags.get("concurrency", "").isdigit() else None,
            "counts": {k[6:]: int(v) for k, v in parent.data.metrics.items() if k.startswith("count.") and v}}


def _suite_texts(report: dict) -> dict[str, str]:
    """Segment texts from the suite file the report names, when it is here and unchanged."""
    suite = report.get("suite") or {}
    path, want = suite.get("path"), suite.get("hash")
    if not path or not want or not Path(path).is_file():
        return {}
    try:
        from difftest.suites.suite import load_suite

        s = load_suite(path)
    except Exception:  # a suite that no longer loads: no texts, nothing else lost
        return {}
    return {seg.id: seg.text for seg in s.segments} if s.hash == want else {}


def _repro_bundle(folder: Path, rel: str) -> dict | None:
    """A segment's `difftest repro` bundle in the site: its title, minimal case and files."""
    bundle = _read_json(folder / "bundle.json")
    if not isinstance(bundle, dict) or not (folder / "ISSUE.md").is_file():
        return None
    files = [f for f in ("ISSUE.md", "repro.py", "bundle.json", "suite.yaml", "specdiff.png") if (folder / f).is_file()]
    return {"title": bundle.get("title", ""), "requests": [r.get("id") for r in bundle.get("requests") or []],
            "concurrency": bundle.get("concurrency"), "pattern": bundle.get("pattern"),
            "against": bundle.get("against_label", ""), "files": {f: f"{rel}/{f}" for f in files}}


def _fetch_media(client, run_id: str, listed: set, media: Path, audio: str) -> bool:
    """The run's audio and spectrograms from MLflow into media/, stored as media.py says; False when
    something could not be downloaded (the next build tries again)."""
    ok, stored = True, {"audio_format": audio, "audio": {}, "specdiff": {}}
    with tempfile.TemporaryDirectory(prefix="difftest-dashboard-") as tmp:
        for sub in ("audio", "specdiff"):
            if sub in listed:
                ok = _download(client, run_id, sub, Path(tmp)) is not None and ok
        segs = sorted(p for p in Path(tmp, "audio").glob("*") if p.is_dir())
        pngs = sorted(Path(tmp, "specdiff").glob("*.png"))
        # libsndfile, zlib and most of Pillow let go of the GIL: threads encode on every core
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            audio_jobs = {seg.name: pool.submit(store_segment_audio, seg, media / "audio" / seg.name, audio, AUDIO_ROLES,
                                                comment=f"MLflow run {run_id}: audio/{seg.name}") for seg in segs}
            picture_jobs = {png.stem: pool.submit(store_picture, png, media / "specdiff" / png.name) for png in pngs}
            stored["audio"] = {name: job.result() for name, job in audio_jobs.items()}
            stored["specdiff"] = {name: job.result() for name, job in picture_jobs.items()}
    media.mkdir(parents=True, exist_ok=True)
    (media / MEDIA).write_text(json.dumps(stored, indent=1) + "\n")
    return ok


def _segment_media(folder: Path, name: str, stored: dict) -> tuple[dict, str | None]:
    """A segment's players (role -> what media.py stored, with `src` relative to the run's folder and
    `artifact` its path in MLflow) and its spectrogram's path."""
    audio = {}
    for role, meta in ((stored.get("audio") or {}).get(name) or {}).items():
        src = f"media/audio/{name}/{meta['file']}"
        if (folder / src).is_file():
            audio[role] = {**meta, "src": src, "artifact": f"audio/{name}/{role}.wav"}
    png = f"media/specdiff/{name}.png"
    return audio, png if (folder / png).is_file() else None


def _fetch_run(client, parent, kids: list, site: Path, exp_name: str, notes: list, audio: str = DEFAULT_AUDIO) -> Run:
    run_id = parent.info.run_id
    tags = parent.data.tags
    folder = site / "runs" / safe_name(run_id)
    fetched = _read_json(folder / FETCHED) or {}
    sha = tags.get(REPORT_SHA)
    report = None
    if (fetched.get("format") == FETCHED_FORMAT and fetched.get("report_sha256") == sha and sha
            and fetched.get("source") == "report.json" and fetched.get("audio") == audio_settings(audio)):
        report = _read_json(folder / "report.json")
    media_ok = report is not None
    if report is None:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        listed = _root_artifacts(client, run_id)
        with tempfile.TemporaryDirectory(prefix="difftest-dashboard-") as tmp:
            got = _download(client, run_id, "report.json", Path(tmp)) if "report.json" in listed else None
            report = _read_json(got) if got else None
            if isinstance(report, dict):
                shutil.copyfile(got, folder / "report.json")
        media_ok = bool(listed)  # a failed listing or download is tried again by the next build
        if listed & {"audio", "specdiff"}:
            media_ok = _fetch_media(client, run_id, listed, folder / "media", audio) and media_ok
        if "repro" in listed:
            (folder / "media").mkdir(exist_ok=True)
            media_ok = _download(client, run_id, "repro", folder / "media") is not None and media_ok
    elif fetched.get("repro") != tags.get(REPRO_TAG):  # bundles added since (`difftest repro` after the run)
        shutil.rmtree(folder / "media" / "repro", ignore_errors=True)
        (folder / "media").mkdir(exist_ok=True)
        media_ok = _download(client, run_id, "repro", folder / "media") is not None
    source = "report.json"
    if not isinstance(report, dict) or not isinstance(report.get("segments"), list):
        report = _report_from_children(parent, kids, client)
        source = "child runs"
        only = (" (there is one only for each segment that was not identical or numeric drift; the others are"
                " not listed)" if tags.get(SEGMENT_RUNS) == NOT_CLEAN else "")
        notes.append(f"run {run_id} ({exp_name}): no readable report.json artifact; segments rebuilt from its "
                     f"child runs{only}")
    if media_ok:
        (folder / FETCHED).write_text(json.dumps({"format": FETCHED_FORMAT, "report_sha256": sha, "source": source,
                                                  "repro": tags.get(REPRO_TAG), "audio": audio_settings(audio)},
                                                 indent=1) + "\n")
    stored = _read_json(folder / "media" / MEDIA) or {}
    media = {}
    for seg in report.get("segments") or []:
        name = safe_name(seg["id"])
        audio_files, png = _segment_media(folder, name, stored)
        repro = _repro_bundle(folder / "media" / "repro" / name, f"media/repro/{name}")
        if audio_files or png or repro:
            media[seg["id"]] = {"audio": audio_files, "specdiff": png, "repro": repro,
                                "picture": (stored.get("specdiff") or {}).get(name) if png else None}
    children = {k.data.tags.get("segment.id") or k.info.run_name: k.info.run_id for k in kids}
    return Run(run_id, parent.info.experiment_id, exp_name, parent.info.run_name or run_id,
               parent.info.start_time or 0, dict(tags), dict(parent.data.metrics), report, source, children, media,
               _suite_texts(report))


def _fetch_bisect(client, parent, probes: list, exp_name: str) -> Bisect:
    state = None
    if BISECT_STATE in _root_artifacts(client, parent.info.run_id):
        with tempfile.TemporaryDirectory(prefix="difftest-dashboard-") as tmp:
            got = _download(client, parent.info.run_id, BISECT_STATE, Path(tmp))
            state = _read_json(got) if got else None
    rows = sorted((Probe(p.info.run_id, p.info.start_time or 0, dict(p.data.tags), dict(p.data.metrics))
                   for p in probes), key=lambda p: (p.start_ms, p.run_id))
    return Bisect(parent.info.run_id, parent.info.experiment_id, exp_name, parent.info.run_name or parent.info.run_id,
                  parent.info.start_time or 0, parent.info.status, dict(parent.data.tags), dict(parent.data.metrics),
                  rows, state if isinstance(state, dict) else None)


def gather(client, site: Path, experiments: list[str] | None = None, audio: str = DEFAULT_AUDIO) -> Store:
    """Read runs and bisects from MLflow; fetch their report.json and media into `site` (audio as
    `audio`: media.AUDIO_FORMATS)."""
    exps = _experiments(client, experiments)
    ids = sorted(exps)
    notes: list[str] = []
    parents = _search(client, ids, f"tags.`{KIND}` = 'run'") if ids else []
    unfinished = [p for p in parents if p.info.status != "FINISHED"]
    if unfinished:
        notes.append(f"{len(unfinished)} run(s) not FINISHED (an upload in progress or broken off) are left out")
    parents = [p for p in parents if p.info.status == "FINISHED"]
    kids: dict[str, list] = {}
    for k in (_search(client, ids, f"tags.`{KIND}` = 'segment'") if parents else []):
        kids.setdefault(k.data.tags.get(PARENT), []).append(k)
    runs = [_fetch_run(client, p, kids.get(p.info.run_id, []), site, exps[p.info.experiment_id], notes, audio)
            for p in parents]
    bisect_parents = _search(client, ids, f"tags.`{KIND}` = '{BISECT_KIND}'") if ids else []
    probes: dict[str, list] = {}
    for p in (_search(client, ids, f"tags.`{KIND}` = '{PROBE_KIND}'") if bisect_parents else []):
        probes.setdefault(p.data.tags.get(PARENT), []).append(p)
    bisects = [_fetch_bisect(client, b, probes.get(b.info.run_id, []), exps[b.info.experiment_id])
               for b in bisect_parents]
    runs.sort(key=lambda r: (r.start_ms, r.run_id))
    bisects.sort(key=lambda b: (b.start_ms, b.run_id))
    # Folders of runs that are gone from the store (deleted) go from the site too.
    keep = {safe_name(r.run_id) for r in runs}
    if (site / "runs").is_dir():
        for d in (site / "runs").iterdir():
            if d.is_dir() and d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
    return Store("", runs, bisects, notes)
