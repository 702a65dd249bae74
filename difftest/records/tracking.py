"""`difftest log OUT`: a run's report and evidence into MLflow.

One experiment per suite (`difftest/<suite name>`, `difftest/adhoc` without one), one parent
run per report.json (tags: provenance; metrics: verdict counts and the run's worst chunk per
comparison; every segment in its report.json and segments.json), one child run per segment that
is not identical or numeric drift (tags: verdict, stage, donor, first divergent chunk; metrics per
chunk with step = chunk index), and for each of those its audio and a spectrogram difference.
What is recorded is defined in mlflow_records.py.

Only report.json and the result sidecars it names are read; OUT gets one file, mlflow.json,
which records where the report was logged, or that the upload is still pending because
MLflow could not be reached. Logging a report twice reuses its run (found by the report's
sha256), so `difftest log` is safe to repeat. mlflow is imported only here and in gate.py.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import os
import posixpath
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from pathlib import Path

from ..errors import BadInput
from ..results import atomic_write
from . import mlflow_records as rec
from .segment_media import safe_name, write_segment_media

log = logging.getLogger(__name__)

STATE = "mlflow.json"
STATE_FORMAT = "difftest.mlflow/1"
PROBE_TIMEOUT_S = 3.0
# While difftest talks to MLflow, unless the user set them: one retry and 20 s per request, so
# a server that dies mid-upload costs seconds, not MLflow's default of minutes of backoff; and
# no "View run" lines on stdout (MLflow prints two, after a get_run, for every run it ends).
MLFLOW_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                       "MLFLOW_HTTP_REQUEST_TIMEOUT": "20", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
# Sent on to the parent run's artifacts when present: what the gate and the report wrote.
PARENT_FILES = ("report.json", "summary.md", "junit.xml", "gate.md")
# A segment's child run is three requests that mostly wait on the server: over HTTP this many go at
# once. A sqlite store takes one writer at a time, and more threads only made it slower (they queue
# on its lock): one there.
HTTP_SEGMENT_THREADS = 8
# The diverged segments' audio and pictures (about 0.25 s of CPU each) are made in other processes
# while the child runs are logged; with fewer than this many, here (a worker costs about 1 s to start).
MEDIA_POOL_MIN = 4
MEDIA_WORKERS_MAX = 4


class TrackingUnavailable(Exception):
    """MLflow could not be used: not installed, not reachable, or it failed mid-upload."""


def default_tracking_uri() -> str:
    return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def resolve_tracking_uri(explicit: str | None = None, state: dict | None = None) -> str:
    """--tracking-uri, else $MLFLOW_TRACKING_URI, else the server a pending upload was meant
    for, else a sqlite store in the working folder (artifacts under ./mlruns)."""
    pending = (state or {}).get("pending") or {}
    return explicit or os.environ.get("MLFLOW_TRACKING_URI") or pending.get("tracking_uri") or default_tracking_uri()


# The stores MLflow 3 can be given by URI; anything else is a typo, not a server that is down.
SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")
_SQLITE_MAGIC = b"SQLite format 3\x00"


def check_tracking_uri(uri: str, *, must_exist: bool = False) -> None:
    """BadInput (exit 2) for a tracking URI that can never work, before MLflow is asked (whose
    answers for these are a deprecation text, an internal error, or a retry note forever): an
    unknown scheme; a local store whose folder is missing (or, with `must_exist`, the store
    itself); a sqlite file that is not an MLflow database."""
    import sqlite3

    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "file"
    if scheme not in SCHEMES:
        raise BadInput(f"--tracking-uri {uri}: unknown scheme {scheme!r} (MLflow reads {', '.join(SCHEMES[:4])}, ...)")
    if scheme not in ("sqlite", "file"):
        return
    if scheme == "sqlite":
        if not uri.startswith("sqlite:///"):
            return  # sqlite:// alone: in memory
        path = Path(uri[len("sqlite:///"):])  # sqlite:////abs/x.db is /abs/x.db, sqlite:///x.db is ./x.db
    else:
        path = Path(uri[len("file://"):] if "://" in uri else uri)
    if not path.parent.is_dir():
        raise BadInput(f"--tracking-uri {uri}: no folder {path.parent}")
    if must_exist and not path.exists():
        raise BadInput(f"no MLflow store at {path}: run `difftest run` or `difftest log OUT` first, "
                       f"or pass --tracking-uri")
    if scheme == "file":
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
            raise BadInput(f"--tracking-uri {uri}: a file store, which MLflow 3 refuses (set "
                           f"MLFLOW_ALLOW_FILE_STORE=true to use one anyway); use sqlite:///{path}.db")
        if path.exists() and not path.is_dir():
            raise BadInput(f"--tracking-uri {uri}: {path} is not a folder (an MLflow file store is one)")
        return
    if not path.exists():
        return
    if not path.is_file():
        raise BadInput(f"--tracking-uri {uri}: {path} is not a file")
    with open(path, "rb") as f:
        head = f.read(len(_SQLITE_MAGIC))
    if not head:
        return  # empty: MLflow makes its tables in it
    if head != _SQLITE_MAGIC:
        raise BadInput(f"{path}: not an MLflow database (not an SQLite file)")
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        raise BadInput(f"{path}: not an MLflow database (SQLite says: {e})") from None
    if tables and "alembic_version" not in tables:
        raise BadInput(f"{path}: not an MLflow database (an SQLite file without MLflow's tables)")


def read_report(out_dir: Path) -> tuple[dict, str]:
    path = Path(out_dir) / "report.json"
    try:
        blob = path.read_bytes()
        report = json.loads(blob)
    except FileNotFoundError:
        raise BadInput(f"{path}: no report.json (is {out_dir} a difftest output folder?)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: not valid JSON ({e})") from None
    from .report import check_report

    return check_report(report, path), hashlib.sha256(blob).hexdigest()


def read_state(out_dir: Path) -> dict:
    try:
        state = json.loads((Path(out_dir) / STATE).read_text())
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return {"format": STATE_FORMAT, "runs": []}
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        return {"format": STATE_FORMAT, "runs": []}
    return state


def _write_state(out_dir: Path, state: dict) -> None:
    atomic_write(Path(out_dir) / STATE, (json.dumps(state, indent=1, sort_keys=True) + "\n").encode())


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def _env_defaults(values: dict):
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@contextlib.contextmanager
def _quiet(*names: str):
    """Hide MLflow's and alembic's INFO chatter (database creation) around a call."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)


def _probe(uri: str) -> None:
    """Fail within seconds when nothing answers at an HTTP tracking URI. Any HTTP answer,
    even an error status, means a server is there."""
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise TrackingUnavailable(f"no MLflow server answers at {uri} ({reason})") from None


@contextlib.contextmanager
def mlflow_client(uri: str):
    """An MlflowClient for `uri`; anything that goes wrong talking to MLflow inside the block
    comes out as TrackingUnavailable."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # this tester sends nothing elsewhere
    try:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException
        from requests.exceptions import RequestException
    except ImportError:
        raise TrackingUnavailable("mlflow is not installed (pip install 'difftest[mlflow]')") from None
    if uri.startswith(("http://", "https://")):
        _probe(uri)
    with _env_defaults(MLFLOW_ENV_DEFAULTS), _quiet("mlflow.store.db.utils", "alembic"):
        try:
            yield MlflowClient(tracking_uri=uri)
        except (MlflowException, RequestException, OSError) as e:
            raise TrackingUnavailable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def _search_all(client, experiment_ids: list[str], filter_string: str, **kw) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string, max_results=1000, page_token=token, **kw)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def child_runs(client, parent) -> list:
    return _search_all(client, [parent.info.experiment_id], f"tags.`{rec.PARENT}` = '{parent.info.run_id}'")


def artifact_root(uri: str) -> str | None:
    """Where a new experiment's artifacts go for a sqlite store: `mlruns/` beside the database, not
    in whatever folder difftest runs in (MLflow's default). None for a server: it decides."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri[len("sqlite:///"):]).resolve().parent / "mlruns").as_uri()


def _experiment_id(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is None:
        root = artifact_root(client.tracking_uri)
        return client.create_experiment(name, tags={rec.KIND: "suite"},
                                        artifact_location=f"{root}/{_slug(name)}" if root else None)
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _log_batched(client, run_id: str, metrics=(), params=None, tags=None) -> None:
    from mlflow.entities import Metric, Param, RunTag

    ts = int(time.time() * 1000)
    metric_list = [Metric(k, v, ts, step) for k, v, step in metrics]
    param_list = [Param(k, str(v)) for k, v in (params or {}).items()]
    tag_list = [RunTag(k, v) for k, v in (tags or {}).items()]
    for m, p, t in rec.batches(metric_list, tag_list, param_list):
        client.log_batch(run_id, metrics=m, params=p, tags=t)


def _reusable(client, run_id: str | None, sha: str):
    """The run if it is a finished, live parent run of this very report."""
    if not run_id:
        return None
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        return None
    ok = (run.info.lifecycle_stage == "active" and run.info.status == "FINISHED"
          and run.data.tags.get(rec.REPORT_SHA) == sha)
    return run if ok else None


def _previous_upload(client, exp_id: str, sha: str, state: dict, uri: str):
    """A finished parent run of this report, from mlflow.json or by the report's hash. Leftovers
    of an upload that broke off (not FINISHED) are deleted, children included."""
    for r in state.get("runs", []):
        if r.get("tracking_uri") == uri and (run := _reusable(client, r.get("run_id"), sha)):
            return run
    found = None
    for run in _search_all(client, [exp_id], f"tags.`{rec.REPORT_SHA}` = '{sha}'"):
        if found is None and run.info.status == "FINISHED":
            found = run
        elif run.info.status != "FINISHED":
            for child in child_runs(client, run):
                client.delete_run(child.info.run_id)
            client.delete_run(run.info.run_id)
    return found


REPRO_TAG = "difftest.repro"  # the segments with a `difftest repro` bundle among the run's artifacts (repro/<segment>/)


def repro_bundles(out: Path) -> dict[str, Path]:
    """segment id -> its `difftest repro` bundle folder under OUT/repro/ (those written whole)."""
    found = {}
    for rj in sorted(Path(out).glob("repro/*/repro.json")):
        try:
            row = json.loads(rj.read_text())
        except (OSError, ValueError):
            continue
        b = rj.parent / "bundle"
        if row.get("reproduced") and (b / "ISSUE.md").is_file():
            found[row["segment"]] = b
    return found


def _stage_files(out: Path, staging: Path) -> None:
    staging.mkdir()
    for name in PARENT_FILES:
        if (out / name).is_file():
            shutil.copyfile(out / name, staging / name)
    for sid, bundle in repro_bundles(out).items():
        shutil.copytree(bundle, staging / "repro" / safe_name(sid))


class _Here(Executor):
    """Runs each call as it is submitted."""

    def submit(self, fn, /, *args, **kwargs):
        f = Future()
        f.set_result(fn(*args, **kwargs))
        return f


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _media_pool(n: int) -> Executor:
    """Where the media of `n` diverged segments are made: worker processes, one per core (the child
    runs, one per such segment, wait on the store more than they compute). They come from a fork
    server (a fresh process that imports the drawing code once, kept for later uploads), not from
    forking this one, which may hold threads and open databases."""
    if n < MEDIA_POOL_MIN:
        return _Here()
    return ProcessPoolExecutor(min(n, _cpus(), MEDIA_WORKERS_MAX), mp_context=_media_context(n))


def _media_context(n: int, start: bool = False):
    """The fork server's context, its imports named; with `start`, it is started now and imports
    them in the background (about 1 s of a 5 s upload) while MLflow's store is opened."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["difftest.records.segment_media", "matplotlib.pyplot"])  # missing: skipped
    if start and n >= MEDIA_POOL_MIN:
        from multiprocessing import forkserver

        forkserver.ensure_running()
    return ctx


@contextlib.contextmanager
def _pool(executor: Executor):
    """The executor, shut down on the way out; on an error, what has not started is dropped (not
    run to the end first), and what runs is waited for, so nothing is written after the caller
    marks the upload broken off."""
    try:
        yield executor
    except BaseException:
        executor.shutdown(wait=True, cancel_futures=True)
        raise
    executor.shutdown(wait=True)


def _log_segment(client, exp_id: str, parent: str, seg: dict, report: dict, tags: dict, start_ms: int) -> None:
    child = client.create_run(exp_id, start_time=start_ms, run_name=seg["id"],
                              tags=rec.segment_tags(seg, report, parent, tags)).info.run_id
    _log_batched(client, child, rec.segment_metrics(seg))
    client.set_terminated(child, "FINISHED")


def _log_files(client, run_id: str, folder: Path, paths: list[str]) -> None:
    for rel in paths:
        client.log_artifact(run_id, str(folder / rel), posixpath.dirname(rel))


def _log_segments(client, exp_id: str, parent: str, report: dict, tags: dict, out: Path, staging: Path,
                  media: Executor, threads: int) -> None:
    """A child run per segment that is not clean, written by `threads` threads, while `media` makes
    their audio and pictures, each sent to the parent's artifacts once made. The child runs'
    start times are a millisecond apart in the report's order, whatever order they are written in:
    the dashboard lists segments by start time. The first failure stops it all."""
    t0 = int(time.time() * 1000)
    segments = [seg for seg in report.get("segments") or [] if rec.has_child_run(seg)]
    with _pool(ThreadPoolExecutor(threads, thread_name_prefix="difftest-mlflow")) as writers:
        pending = {writers.submit(_log_segment, client, exp_id, parent, seg, report, tags, t0 + i)
                   for i, seg in enumerate(segments)}
        made = {media.submit(write_segment_media, seg, out, staging) for seg in segments}
        pending |= made
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for job in done:
                if job in made:
                    pending.add(writers.submit(_log_files, client, parent, staging, job.result()))
                else:
                    job.result()


def log_repro(out_dir: Path, stream=sys.stderr) -> list[str]:
    """Add OUT's repro bundles to every MLflow run OUT was logged as (OUT/mlflow.json), with the
    parent's `difftest.repro` tag listing them: the dashboard's segment pages link them. A run not
    logged yet gets them when it is; MLflow out of reach: one warning, the bundles stay on disk."""
    out = Path(out_dir)
    bundles = repro_bundles(out)
    done = []
    for r in read_state(out).get("runs", []):
        try:
            with mlflow_client(r["tracking_uri"]) as client:
                for sid, b in bundles.items():
                    client.log_artifacts(r["run_id"], str(b), f"repro/{safe_name(sid)}")
                client.set_tag(r["run_id"], REPRO_TAG, ",".join(sorted(bundles)))
            done.append(r["run_id"])
        except TrackingUnavailable as e:
            print(f"difftest: warning: repro bundles not added to MLflow run {r['run_id']} at {r['tracking_uri']}: "
                  f"{e} (they are in {out / 'repro'})", file=stream)
    return done


def _upload(client, out: Path, report: dict, sha: str, experiment: str, extra_tags: dict, state: dict, uri: str):
    exp_id = _experiment_id(client, experiment)
    prior = _previous_upload(client, exp_id, sha, state, uri)
    if prior is not None:
        log.info("%s is already logged as run %s", out, prior.info.run_id)
        return prior.info.run_id, prior.info.experiment_id
    repro = sorted(repro_bundles(out))
    tags = rec.parent_tags(report, sha, {"difftest.out_dir": str(out.resolve()), rec.SEGMENT_RUNS: rec.NOT_CLEAN,
                                         **({REPRO_TAG: ",".join(repro)} if repro else {}), **extra_tags})
    label = tags.get("candidate.label", "candidate")
    name = f"{label} c{report.get('concurrency') or '?'} {report.get('verdict', '?')}"
    # Born with its kind and report hash, so a broken-off upload is found and replaced next time.
    parent = client.create_run(exp_id, run_name=name, tags={rec.KIND: "run", rec.REPORT_SHA: sha}).info.run_id
    try:
        _log_batched(client, parent, [(k, v, 0) for k, v in rec.parent_metrics(report).items()],
                     rec.parent_params(report), tags)
        diverged = sum(rec.has_child_run(seg) for seg in report.get("segments") or [])
        threads = HTTP_SEGMENT_THREADS if uri.startswith(("http://", "https://")) else 1
        with tempfile.TemporaryDirectory(prefix="difftest-mlflow-") as staging:
            media, files = Path(staging, "media"), Path(staging, "files")
            with _pool(_media_pool(diverged)) as pool:
                _log_segments(client, exp_id, parent, report, tags, out, media, pool, threads)
            _stage_files(out, files)
            client.log_artifacts(parent, str(files))
        if isinstance(report.get("configuration"), dict):  # the served settings against the release's deploy file
            client.log_dict(parent, report["configuration"], "configuration.json")
        with warnings.catch_warnings():  # pandas' deprecation chatter from inside log_table
            warnings.simplefilter("ignore")
            tables = (("divergences.json", rec.divergence_rows(report)), ("segments.json", rec.segment_rows(report)))
            for name, rows in tables:
                if rows:
                    client.log_table(parent, data={k: [r[k] for r in rows] for k in rows[0]}, artifact_file=name)
        client.set_terminated(parent, "FINISHED")
    except BaseException:
        with contextlib.suppress(Exception):
            client.set_terminated(parent, "FAILED")
        raise
    return parent, exp_id


def log_run_outcome(out_dir, tracking_uri=None, *, experiment=None, tags=None) -> tuple[str | None, str]:
    out = Path(out_dir)
    report, sha = read_report(out)
    state = read_state(out)
    uri = resolve_tracking_uri(tracking_uri, state)
    check_tracking_uri(uri)  # a URI that can never work is bad input: no pending note to retry it
    if not any(r.get("tracking_uri") == uri for r in state.get("runs", [])):  # a new upload: warm the media workers
        _media_context(sum(rec.has_child_run(s) for s in report.get("segments") or []), start=True)
    experiment = experiment or rec.experiment_name(report)
    def pending(reason: str):
        print(f"difftest: warning: could not log {out} to MLflow at {uri}: {reason}. Nothing is lost: "
              f"upload later with `difftest log {out} --tracking-uri {uri}`.", file=sys.stderr)
        state["pending"] = {"tracking_uri": uri, "experiment": experiment, "report_sha256": sha,
                            "reason": reason, "since": _now()}
        _write_state(out, state)

    try:
        with mlflow_client(uri) as client:
            run_id, exp_id = _upload(client, out, report, sha, experiment, dict(tags or {}), state, uri)
    except TrackingUnavailable as e:
        pending(str(e))
        return None, uri
    except KeyboardInterrupt as e:  # the half-made upload is replaced by the next (_previous_upload)
        pending(f"interrupted ({e.args[0] if e.args else 'SIGINT'})")
        raise
    state["runs"] = [r for r in state.get("runs", []) if r.get("tracking_uri") != uri] + [
        {"tracking_uri": uri, "experiment": experiment, "experiment_id": exp_id, "run_id": run_id,
         "report_sha256": sha, "logged": _now()}]
    state.pop("pending", None)  # uploaded, if to another server than first meant
    _write_state(out, state)
    return run_id, uri


def log_run(out_dir, tracking_uri=None, *, experiment=None, tags=None) -> str | None:
    """Log OUT (report.json and what it names) to MLflow; the parent run id, or None (with one
    warning on stderr and a pending note in OUT/mlflow.json) when MLflow cannot be used.
    Raises BadInput when OUT holds no readable report.json."""
    return log_run_outcome(out_dir, tracking_uri, experiment=experiment, tags=tags)[0]
