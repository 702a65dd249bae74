"""`difftest log`: reports into a real MLflow (sqlite store in the working folder, and a real
`mlflow server`), checked by reading back what MLflow stored."""

import hashlib
import itertools
import json
import math
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
from mlflow import MlflowClient  # noqa: E402  (installed by the test extra; scripts/test.sh)
from mlflow_support import closed_uri, make_report  # noqa: E402

from difftest.cli import main as difftest_main  # noqa: E402
from difftest.records import mlflow_records as rec  # noqa: E402
from difftest.records import tracking  # noqa: E402
from difftest.records.tracking import STATE, log_run  # noqa: E402
from difftest.results import read_result  # noqa: E402
from difftest.suites import wavio  # noqa: E402


def difftest_log(*args) -> int:
    return difftest_main(["log", *map(str, args)])


def parent_runs(client, experiment="difftest/adhoc"):
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], f"tags.`{rec.KIND}` = 'run'")


def children(client, run):
    return client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")


def history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def check_logged(client, run_id, out, tmp_path):
    """Everything `difftest log` promises for the leak report, read back from MLflow."""
    report = json.loads((out / "report.json").read_text())
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "difftest/adhoc"
    tags = run.data.tags
    assert {k: tags.get(k) for k in ("difftest.kind", "candidate.label", "candidate.version", "candidate.commit",
                                     "vllm_omni.version", "vllm.version", "qwen_tts.version", "torch.version",
                                     "device", "checkpoint.sha256", "concurrency", "verdict", "difftest.version")} == {
        "difftest.kind": "run", "candidate.label": "cand", "candidate.version": "0.30.0",
        "candidate.commit": "c0ffee0300", "vllm_omni.version": "0.30.0", "vllm.version": "0.30.1",
        "qwen_tts.version": "0.1.1", "torch.version": "2.10.0", "device": "cpu", "checkpoint.sha256": "ab" * 32,
        "concurrency": "3", "verdict": "fail", "difftest.version": report["difftest_version"]}
    assert tags["deploy_config"] == '{"greedy":true}'
    assert tags["reference.provenance.versions.qwen-tts"] == "0.1.1"  # the full provenance, flattened
    assert tags[rec.REPORT_SHA] == hashlib.sha256((out / "report.json").read_bytes()).hexdigest()
    m = run.data.metrics
    assert (m["count.contamination"], m["count.identical"], m["count.error"], m["failing"], m["pass"], m["segments"]) \
        == (2, 1, 0, 2, 0, 3)
    assert tags[rec.SEGMENT_RUNS] == rec.NOT_CLEAN
    # the run's worst chunk per comparison, over every segment (the clean one included)
    for comp in {c for s in report["segments"] for c, body in s["comparisons"].items() if "chunks" in body}:
        chunks = [c for s in report["segments"] for c in s["comparisons"].get(comp, {}).get("chunks", {}).get("max_abs", [])]
        assert m[f"worst.{comp}.max_abs"] == pytest.approx(max(chunks), rel=1e-12), comp
    assert m["worst.codes.chunk_agreement"] == min(
        a for s in report["segments"] for a in s["comparisons"]["codes"]["chunk_agreement"])

    # a child run for each segment that is not clean (s2, identical, has none)
    kids = {c.info.run_name: c for c in children(client, run)}
    assert sorted(kids) == ["s0", "s1"]
    for seg in report["segments"]:
        if seg["id"] not in kids:
            assert seg["verdict"] in rec.CLEAN
            continue
        kid = kids[seg["id"]]
        assert kid.info.status == "FINISHED"
        t = kid.data.tags
        assert (t["segment.id"], t["verdict"], t.get("stage"), t.get("donor"), t.get("first_divergent_chunk")) == (
            seg["id"], seg["verdict"], seg["stage"], seg["donor"],
            None if seg["first_divergent_chunk"] is None else str(seg["first_divergent_chunk"]))
        assert t["candidate.version"] == "0.30.0" and t["device"] == "cpu"
        # every per-chunk list in the report is a metric history with step = chunk index
        n_series = 0
        for comp, body in seg["comparisons"].items():
            series = dict(body.get("chunks") or {})
            if "chunk_agreement" in body:
                series["chunk_agreement"] = body["chunk_agreement"]
            for name, values in series.items():
                got = history(client, kid.info.run_id, f"{comp}.{name}")
                assert [s for s, _ in got] == list(range(len(values)))
                assert np.allclose([v for _, v in got], values, rtol=1e-12, atol=0)
                n_series += 1
            if "tiers" in body:
                assert [v for _, v in history(client, kid.info.run_id, f"{comp}.tier")] == [
                    float(["identical", "within_quantisation", "close", "diverged"].index(x)) for x in body["tiers"]]
        assert n_series >= 6  # codes, concurrency codes, concurrency audio at least
    assert [v for _, v in history(client, kids["s0"].info.run_id, "codes.chunk_agreement")] == [1.0, 1.0, 1.0]

    # artifacts: the report, and audio plus a spectrogram difference for each diverged segment only
    top = {f.path for f in client.list_artifacts(run_id)}
    assert {"report.json", "summary.md", "audio", "specdiff", "divergences.json", "segments.json"} <= top
    assert {f.path for f in client.list_artifacts(run_id, "audio")} == {"audio/s0", "audio/s1"}
    assert {f.path for f in client.list_artifacts(run_id, "specdiff")} == {"specdiff/s0.png", "specdiff/s1.png"}
    local = tmp_path / "downloaded"
    local.mkdir()
    client.download_artifacts(run_id, "audio/s0", str(local))
    client.download_artifacts(run_id, "specdiff/s0.png", str(local))
    client.download_artifacts(run_id, "report.json", str(local))
    client.download_artifacts(run_id, "divergences.json", str(local))
    client.download_artifacts(run_id, "segments.json", str(local))
    assert (local / "report.json").read_bytes() == (out / "report.json").read_bytes()
    assert (local / "s0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wavs = {p.stem: wavio.read(p) for p in (local / "s0").glob("*.wav")}
    assert sorted(wavs) == ["candidate", "control", "difference", "reference"]
    s0 = next(s for s in report["segments"] if s["id"] == "s0")
    ref, cand = (read_result(s0["artifacts"][r]) for r in ("reference", "candidate"))
    assert len(wavs["reference"][0]) == len(ref.wav) and len(wavs["candidate"][0]) == len(cand.wav)
    assert wavs["candidate"][1].format == "float" and wavs["candidate"][1].sample_rate == 24000
    assert np.array_equal(wavs["candidate"][0], cand.wav)
    n = min(len(ref.wav), len(cand.wav))
    assert np.array_equal(wavs["difference"][0], cand.wav[:n] - ref.wav[:n]) and np.abs(wavs["difference"][0]).max() > 0
    table = json.loads((local / "divergences.json").read_text())
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert sorted((r["segment"], r["verdict"], r["donor"], r["first_divergent_chunk"]) for r in rows) == [
        ("s0", "contamination", "s2", 0), ("s1", "contamination", "s2", 0)]
    table = json.loads((local / "segments.json").read_text())  # every segment, the clean one too
    rows = {r[0]: dict(zip(table["columns"], r)) for r in table["data"]}
    assert sorted(rows) == ["s0", "s1", "s2"]
    for seg in report["segments"]:
        row = rows[seg["id"]]
        assert (row["verdict"], row["child_run"]) == (seg["verdict"], seg["id"] in kids)
        assert row["concurrency.max_abs"] == pytest.approx(max(seg["comparisons"]["concurrency"]["chunks"]["max_abs"]),
                                                          rel=1e-9)  # the table keeps 10 digits
    return run


@pytest.mark.parametrize("store", ["default_sqlite", "server"])
def test_log_writes_what_the_report_says(store, tmp_path, monkeypatch, request):
    out = make_report(tmp_path, "leak", leak_into=("s0", "s1"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if store == "server":
        uri = request.getfixturevalue("mlflow_server")
    else:  # a fresh working folder: no store yet, no setup
        cwd = tmp_path / "fresh"
        cwd.mkdir()
        monkeypatch.chdir(cwd)
        uri = None
    run_id = log_run(out, uri)
    assert run_id
    if store == "default_sqlite":
        assert (cwd / "mlflow.db").is_file() and any((cwd / "mlruns").rglob("report.json"))
        uri = f"sqlite:///{cwd / 'mlflow.db'}"
    check_logged(MlflowClient(uri), run_id, out, tmp_path)
    state = json.loads((out / STATE).read_text())
    assert [(r["tracking_uri"], r["run_id"], r["experiment"]) for r in state["runs"]] == [(uri, run_id, "difftest/adhoc")]
    assert "pending" not in state


def test_logging_twice_reuses_the_run(mlflow_cwd, tmp_path):
    out = make_report(tmp_path, "leak", leak_into=("s0",))
    client = MlflowClient(f"sqlite:///{mlflow_cwd / 'mlflow.db'}")
    first = log_run(out)
    assert difftest_log(out) == 0
    (out / STATE).unlink()  # without its note, the run is found by the report's hash
    assert log_run(out) == first
    runs = parent_runs(client)
    assert [r.info.run_id for r in runs] == [first] and len(children(client, runs[0])) == 1

    # an upload that broke off (parent never finished) is replaced, not kept beside the new one
    (out / STATE).unlink()
    client.set_terminated(first, "FAILED")
    second = log_run(out)
    assert second != first
    assert [r.info.run_id for r in parent_runs(client)] == [second]
    assert client.get_run(first).info.lifecycle_stage == "deleted"
    assert len(children(client, client.get_run(second))) == 1


def test_suite_experiment_extra_tags_and_clean_run(mlflow_cwd, tmp_path):
    out = make_report(tmp_path, "clean", suite={"name": "toy", "hash": "f00d" * 16})
    run_id = log_run(out, tags={"gate": "nightly", "candidate.version": "0.30.0-rc1"})
    client = MlflowClient(f"sqlite:///{mlflow_cwd / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "difftest/toy"
    t = run.data.tags
    assert (t["suite.name"], t["suite.hash"], t["gate"], t["candidate.version"], t["verdict"]) == (
        "toy", "f00d" * 16, "nightly", "0.30.0-rc1", "pass")
    assert run.data.metrics["pass"] == 1.0 and run.data.metrics["count.identical"] == 3
    assert children(client, run) == []  # every segment clean: no child runs, all in segments.json
    top = {f.path for f in client.list_artifacts(run_id)}
    assert "audio" not in top and "divergences.json" not in top and {"report.json", "segments.json"} <= top


def test_infinities_are_capped_and_long_segments_batched(mlflow_cwd, tmp_path):
    out = make_report(tmp_path, "clean")
    path = out / "report.json"
    report = json.loads(path.read_text())
    seg = report["segments"][0]
    seg["verdict"] = "vocoder_defect"  # a child run holds its per-chunk metrics (a clean segment has none)
    seg["comparisons"]["audio"]["chunks"]["snr_db"][0] = math.inf
    k = 300  # 300 chunks x (4 metrics + tier) = 1500 metrics: more than one log_batch may carry
    long = {"max_abs": [i * 1e-3 for i in range(k)], "rms": [1.0] * k, "snr_db": [-math.inf] + [50.0] * (k - 1),
            "logmel": [0.5] * k}
    long["rms"][1] = math.nan
    seg["comparisons"]["long"] = {"chunks": long, "tiers": ["close"] * k}
    path.write_text(json.dumps(report))  # Infinity and NaN, as a careless writer would leave them
    run_id = log_run(out)
    client = MlflowClient(f"sqlite:///{mlflow_cwd / 'mlflow.db'}")
    kid = next(c for c in children(client, client.get_run(run_id)) if c.info.run_name == seg["id"])
    assert history(client, kid.info.run_id, "audio.snr_db")[0] == (0, 100.0)
    maxabs = history(client, kid.info.run_id, "long.max_abs")
    assert len(maxabs) == k and maxabs[-1] == (k - 1, (k - 1) * 1e-3)
    assert history(client, kid.info.run_id, "long.snr_db")[0] == (0, -100.0)
    assert [s for s, _ in history(client, kid.info.run_id, "long.rms")] == [0] + list(range(2, k))  # NaN dropped
    assert len(history(client, kid.info.run_id, "long.tier")) == k


def test_unreachable_server_leaves_a_pending_note_then_uploads(tmp_path, mlflow_server, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = make_report(tmp_path, "leak", leak_into=("s0",))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    stat = (out / "report.json").stat()
    down = closed_uri()
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "difftest", "log", str(out), "--tracking-uri", down],
                       capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert p.returncode == 3, p.stderr
    warnings = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("difftest: warning:") and down in warnings[0]
    assert "difftest log" in warnings[0]
    assert elapsed < 30  # mostly importing mlflow; no retries against a closed port
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after.pop(STATE) and after == before
    assert (out / "report.json").stat().st_mtime_ns == stat.st_mtime_ns
    pending = json.loads((out / STATE).read_text())["pending"]
    assert pending["tracking_uri"] == down and "no MLflow server answers" in pending["reason"]

    # `difftest log OUT` alone retries where the upload was meant to go: still down, still fast
    t0 = time.monotonic()
    assert difftest_log(out) == 3
    assert time.monotonic() - t0 < 10

    assert difftest_log(out, "--tracking-uri", mlflow_server) == 0
    state = json.loads((out / STATE).read_text())
    assert "pending" not in state and state["runs"][0]["tracking_uri"] == mlflow_server
    client = MlflowClient(mlflow_server)
    run = client.get_run(state["runs"][0]["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["verdict"] == "fail"
    assert (out / "report.json").read_bytes() == before["report.json"]


def test_without_mlflow_installed_the_upload_is_pending(tmp_path, monkeypatch, capsys):
    out = make_report(tmp_path, "clean")
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now fails
    assert log_run(out, "sqlite:///" + str(tmp_path / "x.db")) is None
    assert "mlflow is not installed" in capsys.readouterr().err
    assert json.loads((out / STATE).read_text())["pending"]["reason"].startswith("mlflow is not installed")
    assert not (tmp_path / "x.db").exists()


def test_bad_output_folder_is_bad_input(tmp_path, capsys):
    assert difftest_log(tmp_path) == 2
    assert "no report.json" in capsys.readouterr().err
    (tmp_path / "report.json").write_text("{}")
    assert difftest_log(tmp_path) == 2
    assert not (tmp_path / STATE).exists()


def test_an_explicit_sqlite_store_keeps_its_artifacts_beside_it(tmp_path, monkeypatch):
    """`--tracking-uri sqlite:///elsewhere/m.db` used to write the artifacts into ./mlruns of
    whatever folder difftest ran in."""
    out = make_report(tmp_path, "leak", leak_into=("s0",))
    cwd, store = tmp_path / "cwd", tmp_path / "elsewhere"
    cwd.mkdir()
    store.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{store / 'm.db'}"
    run_id = log_run(out, uri)
    assert run_id and not (cwd / "mlruns").exists()
    art = MlflowClient(uri).get_run(run_id).info.artifact_uri
    assert art.startswith((store / "mlruns").as_uri()), art
    assert list((store / "mlruns").rglob("report.json"))


def test_a_store_that_can_never_work_is_bad_input_with_no_pending_note(tmp_path, capsys):
    """#34 item 15, each reproduced first: a corrupt sqlite store ("internal error ... a bug in
    difftest", exit 3), a missing file:// store (exit 3, MLflow's deprecation text), `nosuch://x`
    (exit 3 and a pending note that later uploads would retry forever)."""
    out = make_report(tmp_path, "clean")
    logged = tmp_path / "real.db"
    assert log_run(out, f"sqlite:///{logged}")
    (out / STATE).unlink()
    blob = logged.read_bytes()
    (tmp_path / "half.db").write_bytes(blob[: len(blob) // 2])  # a copy cut short
    (tmp_path / "noise.db").write_bytes(np.random.default_rng(0).bytes(4096))
    from dashboards.cli import main_dashboard  # noqa: F401  (the dashboard command, through the CLI below)

    cases = {f"sqlite:///{tmp_path / 'half.db'}": "half.db: not an MLflow database (SQLite says: database disk image is malformed)",
             f"sqlite:///{tmp_path / 'noise.db'}": "noise.db: not an MLflow database (not an SQLite file)",
             f"file://{tmp_path / 'no-such-store'}": "a file store, which MLflow 3 refuses",
             "nosuch://x": "--tracking-uri nosuch://x: unknown scheme 'nosuch'"}
    for uri, words in cases.items():
        assert difftest_log(out, "--tracking-uri", uri) == 2, uri
        err = capsys.readouterr().err
        assert words in err and "internal error" not in err, (uri, err)
        assert not (out / STATE).exists(), uri  # no pending note: nothing a later upload could retry
        assert difftest_main(["dashboard", "--out", str(tmp_path / "site"), "--tracking-uri", uri]) == 2, uri
        err = capsys.readouterr().err
        if uri.startswith("file:"):
            words = f"no MLflow store at {tmp_path / 'no-such-store'}"
        assert words in err, (uri, err)


@pytest.mark.heavy
def test_a_test_mlflow_server_whose_port_was_taken_starts_on_another(tmp_path, monkeypatch):
    """The port race CI met (2026-12-05: 'address already in use', three tests lost): the port handed
    out is taken by another HTTP server answering /health before MLflow binds it; the helper must
    not take that server for MLflow, and must start MLflow again on a free port."""
    import http.server
    import threading

    import mlflow_support

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    squatter = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    ports = iter([squatter.server_port])
    real = mlflow_support.free_port
    monkeypatch.setattr(mlflow_support, "free_port", lambda: next(ports, None) or real())
    try:
        with mlflow_support.serve(tmp_path) as uri:
            assert uri != f"http://127.0.0.1:{squatter.server_port}"
            assert MlflowClient(uri).search_experiments()  # MLflow itself answers there
    finally:
        squatter.shutdown()


def test_a_spectrogram_picture_carries_nothing_of_the_one_before(tmp_path):
    """The pictures share one figure (redrawn per segment, difftest/records/segment_media.py): a
    segment's picture is the same whether another, longer one with its own onset came before it."""
    from difftest.records.segment_media import spectrogram_difference

    rng = np.random.default_rng(3)
    ref = (0.3 * rng.standard_normal(48000)).astype(np.float32)
    a = {"id": "a", "verdict": "vocoder_defect", "first_divergent_frame": 7, "stage": "vocoder",
         "first_divergent_chunk": 0}
    b = {"id": "b", "verdict": "length_mismatch", "first_divergent_frame": None}
    assert spectrogram_difference(ref, ref + 0.01, 24000, tmp_path / "a1.png", a)
    long = (0.3 * rng.standard_normal(96000)).astype(np.float32)
    assert spectrogram_difference(long, long[:30000], 24000, tmp_path / "b.png", b)
    assert spectrogram_difference(ref, ref + 0.01, 24000, tmp_path / "a2.png", a)
    assert (tmp_path / "a1.png").read_bytes() == (tmp_path / "a2.png").read_bytes()
    assert (tmp_path / "a1.png").read_bytes() != (tmp_path / "b.png").read_bytes()


# Eight segments, five of them diverged: enough for the media worker processes (tracking.MEDIA_POOL_MIN).
MANY = {"leak_into": ("s0", "s1", "s2", "s3", "s4"), "segments": 8}


def records(client, run_id, folder):
    """All an upload wrote, less what differs from one upload to the next (run ids, times): the
    parent's and each child's name, status, tags, params and metric histories (children in
    start-time order, their parent's id replaced by "parent"), and every artifact's bytes."""
    def run_record(run):
        tags = {k: ("parent" if k == rec.PARENT else v) for k, v in run.data.tags.items()}
        return (run.info.run_name, run.info.status, tags, run.data.params,
                {k: history(client, run.info.run_id, k) for k in run.data.metrics})

    run = client.get_run(run_id)
    kids = sorted(children(client, run), key=lambda k: k.info.start_time)
    folder.mkdir(parents=True)
    client.download_artifacts(run_id, "", str(folder))
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    return {"parent": run_record(run), "children": [run_record(k) for k in kids], "artifacts": files}


@pytest.mark.parametrize("store", ["sqlite", "server"])
def test_the_parallel_upload_writes_what_the_one_by_one_upload_did(store, tmp_path, monkeypatch, request):
    """Media made in worker processes, child runs written by threads (over HTTP): the same runs,
    tags, params, metric histories and artifact bytes as one thing after another in this process."""
    out = make_report(tmp_path, "many", **MANY)
    report = json.loads((out / "report.json").read_text())
    if store == "server":
        uri = request.getfixturevalue("mlflow_server")
    else:
        uri = f"sqlite:///{request.getfixturevalue('mlflow_cwd') / 'mlflow.db'}"
    with monkeypatch.context() as m:
        m.setattr(tracking, "HTTP_SEGMENT_THREADS", 1)
        m.setattr(tracking, "MEDIA_POOL_MIN", 10**6)
        one_by_one = log_run(out, uri, experiment=f"one-by-one-{tmp_path.name}")
    (out / STATE).unlink()  # or the second upload would find the first

    pools, writers = [], set()
    make_pool, create_run = tracking._media_pool, MlflowClient.create_run
    monkeypatch.setattr(tracking, "_media_pool", lambda n: pools.append(make_pool(n)) or pools[-1])

    def noting_the_thread(self, *a, **kw):
        writers.add(threading.current_thread().name)
        return create_run(self, *a, **kw)

    monkeypatch.setattr(MlflowClient, "create_run", noting_the_thread)
    parallel = log_run(out, uri, experiment=f"parallel-{tmp_path.name}")
    assert [type(p) for p in pools] == [ProcessPoolExecutor]
    writers.remove("MainThread")  # the parent's
    assert len(writers) > 1 if store == "server" else writers == {"difftest-mlflow_0"}  # sqlite: one writer

    client = MlflowClient(uri)
    want = records(client, one_by_one, tmp_path / "one-by-one")
    got = records(client, parallel, tmp_path / "parallel")
    assert [c[0] for c in got["children"]] == [s["id"] for s in report["segments"] if rec.has_child_run(s)]  # report order
    assert len(got["children"]) == 5
    assert sorted(f for f in got["artifacts"] if f.startswith(("audio/", "specdiff/"))) == sorted(
        [f"audio/s{i}/{r}.wav" for i in range(5) for r in ("candidate", "control", "difference", "reference")]
        + [f"specdiff/s{i}.png" for i in range(5)])
    assert got["parent"][:2] == (f"cand c3 {report['verdict']}", "FINISHED")
    assert got == want


def _one_failing(real, when):
    """`real`, but raising what `when(call number)` returns (None: no failure)."""
    calls = itertools.count()

    def call(*a, **kw):
        if (e := when(next(calls))) is not None:
            raise e
        return real(*a, **kw)

    return call


def test_a_failure_in_a_writer_thread_marks_the_parent_failed_and_the_next_upload_replaces_it(
        tmp_path, mlflow_server, monkeypatch):
    from mlflow.exceptions import MlflowException

    out = make_report(tmp_path, "many", **MANY)
    exp = f"broken-{tmp_path.name}"
    monkeypatch.setattr(tracking, "HTTP_SEGMENT_THREADS", 2)
    real = MlflowClient.log_batch
    monkeypatch.setattr(MlflowClient, "log_batch", _one_failing(
        real, lambda n: MlflowException("the server went away") if n == 1 else None))  # 0: the parent's
    assert log_run(out, mlflow_server, experiment=exp) is None
    assert "the server went away" in json.loads((out / STATE).read_text())["pending"]["reason"]
    client = MlflowClient(mlflow_server)
    [broken] = parent_runs(client, exp)
    assert broken.info.status == "FAILED"
    kids = children(client, broken)
    # the failed one never finished (how many others began before the failure reached the main thread
    # depends on how busy the machine is; those not begun by then were dropped)
    assert sum(k.info.status == "FINISHED" for k in kids) < len(kids)

    monkeypatch.setattr(MlflowClient, "log_batch", real)
    run_id = log_run(out, experiment=exp)  # to the server the pending note names
    assert [r.info.run_id for r in parent_runs(client, exp)] == [run_id]
    assert client.get_run(broken.info.run_id).info.lifecycle_stage == "deleted"
    assert all(client.get_run(k.info.run_id).info.lifecycle_stage == "deleted" for k in kids)
    kids = children(client, client.get_run(run_id))
    assert sorted(k.info.run_name for k in kids) == [f"s{i}" for i in range(5)]  # the five not clean
    assert {k.info.status for k in kids} == {"FINISHED"}


def test_an_interrupted_upload_loses_nothing(mlflow_cwd, tmp_path, monkeypatch):
    """Ctrl-C while the child runs are written and the media workers draw: the parent is marked
    FAILED, no more child runs come, and `difftest log` again writes all of it, as an upload that
    was never interrupted does."""
    out = make_report(tmp_path, "many", **MANY)
    client = MlflowClient(f"sqlite:///{mlflow_cwd / 'mlflow.db'}")
    whole = log_run(out, experiment="whole")
    (out / STATE).unlink()

    monkeypatch.setattr(tracking, "MEDIA_POOL_MIN", 1)
    real = tracking._log_segment
    monkeypatch.setattr(tracking, "_log_segment", _one_failing(real, lambda n: KeyboardInterrupt() if n == 3 else None))
    with pytest.raises(KeyboardInterrupt):
        log_run(out, experiment="interrupted")
    [broken] = parent_runs(client, "interrupted")
    assert broken.info.status == "FAILED"
    # the writer thread may have begun later segments before the interrupt reached the main thread
    # (how many depends on how busy the machine is), but never the interrupted one
    names = {k.info.run_name for k in children(client, broken)}
    assert {"s0", "s1", "s2"} <= names and "s3" not in names, names
    state = json.loads((out / STATE).read_text())  # nothing claims it was logged; the upload is pending
    assert not state.get("runs") and state["pending"]["reason"] == "interrupted (SIGINT)", state

    monkeypatch.setattr(tracking, "_log_segment", real)
    again = log_run(out, experiment="interrupted")
    assert [r.info.run_id for r in parent_runs(client, "interrupted")] == [again]
    assert records(client, again, tmp_path / "again") == records(client, whole, tmp_path / "whole")
