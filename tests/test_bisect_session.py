"""The bisect's bookkeeping (difftest/bisect/session.py, state.py, record.py) with a real git repository,
real MLflow (sqlite) and a stand-in prober: no build, no engine, seconds."""

import io
import json
import shutil

import pytest
from bisect_support import BROKEN, FLAKY, K, make_fakeomni_repo
from mlflow_support import closed_uri

from difftest.bisect.probe import ProbeRecord
from difftest.bisect.search import BAD, GOOD, SKIP, Vote
from difftest.bisect.session import Tracking, run_bisect, run_probe
from difftest.errors import BadInput

IDENTITY = {"recipe": {"name": "stand-in"}, "suite_hash": "abc", "repeats": 1}


class StandIn:
    """Decides by position in the fakeomni history: bad from K on, BROKEN skipped."""

    def __init__(self, shas, bad_from=K, skips=(BROKEN,), fail_at=None):
        self.index = {s: i for i, s in enumerate(shas)}
        self.bad_from, self.skips, self.fail_at = bad_from, set(skips), fail_at
        self.probed = []

    def probe(self, sha):
        i = self.index[sha]
        if self.fail_at is not None and len(self.probed) == self.fail_at:
            raise KeyboardInterrupt
        self.probed.append(i)
        d = SKIP if i in self.skips else BAD if i >= self.bad_from else GOOD
        runs = [{"repeat": 0, "outcome": d, "reason": "stand-in", "verdict": {GOOD: "pass", BAD: "fail"}.get(d),
                 "exit_code": None, "report": None, "seconds": 0.1,
                 "condemned": [{"id": "s1", "verdict": "contamination", "first_divergent_chunk": 0,
                                "stage": "handoff", "donor": "s2", "summary": ""}] if d == BAD else []}]
        return ProbeRecord(sha, f"subject {i}", "2024-01-01", Vote(d, (d,), "1 run: " + d), runs, {}, 0.1, "now")


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    path = tmp_path_factory.mktemp("session") / "repo"
    return path, make_fakeomni_repo(path)


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a sqlite store keeps its artifacts in ./mlruns


@pytest.fixture
def sqlite_uri(tmp_path, _empty_mlflow_store):
    db = tmp_path / "mlflow.db"
    shutil.copyfile(_empty_mlflow_store, db)
    return f"sqlite:///{db}"


def bisect(history, out, prober, uri, **kw):
    path, shas = history
    so, se = io.StringIO(), io.StringIO()
    code = run_bisect(path, shas[0], shas[-1], prober, out, identity=IDENTITY, suite_name="tiny",
                      tracking=Tracking(uri), stdout=so, stderr=se, **kw)
    return code, so.getvalue(), se.getvalue()


def runs_of(uri):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("difftest/bisect/tiny")
    return client.search_runs([exp.experiment_id], max_results=1000)


def test_bisect_records_every_probe_and_tags_the_culprit(history, tmp_path, sqlite_uri):
    _, shas = history
    prober = StandIn(shas)
    code, out, err = bisect(history, tmp_path / "out", prober, sqlite_uri)
    assert code == 0, err
    assert prober.probed == [0, 9, 4, 5, 7, 6]
    assert f"first bad commit: {shas[K]}  subject {K}" in out
    assert "condemned by run 1: fail: s1 contamination (chunk 0, stage handoff, donor s2)" in out
    assert f"last good: {shas[5]}" in out
    state = json.loads((tmp_path / "out" / "bisect.json").read_text())
    assert state["result"]["first_bad"] == shas[K] and state["result"]["probes"] == 6
    assert state["order"] == [shas[i] for i in (0, 9, 4, 5, 7, 6)]
    log = (tmp_path / "out" / "bisect-log.txt").read_text()
    assert f"git bisect skip {shas[BROKEN]}" in log and f"# first bad commit: [{shas[K]}]" in log

    runs = runs_of(sqlite_uri)
    parents = [r for r in runs if r.data.tags["difftest.kind"] == "bisect"]
    children = [r for r in runs if r.data.tags["difftest.kind"] == "bisect-probe"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    p = parents[0]
    assert p.data.tags["bisect.first_bad"] == shas[K] and p.data.tags["bisect.status"] == "found"
    assert p.data.metrics["probes"] == 6
    assert sorted(r.data.tags["candidate.commit"] for r in children) == sorted(state["order"])
    for r in children:
        t = r.data.tags
        assert t["mlflow.parentRunId"] == p.info.run_id and t["bisect.repeat"] == "1"
        assert t["bisect.decision"] == state["decisions"][t["candidate.commit"]]["decision"]
        assert t["difftest.culprit"] == ("true" if t["candidate.commit"] == shas[K] else "false")
        assert t["bisect.subject"].startswith("subject ")


def test_interrupted_then_resumed_probes_each_commit_once_under_one_parent(history, tmp_path, sqlite_uri):
    _, shas = history
    with pytest.raises(KeyboardInterrupt):
        bisect(history, tmp_path / "out", StandIn(shas, fail_at=3), sqlite_uri)
    state = json.loads((tmp_path / "out" / "bisect.json").read_text())
    assert state["order"] == [shas[0], shas[9], shas[4]] and state["result"] is None
    [parent] = [r for r in runs_of(sqlite_uri) if r.data.tags["difftest.kind"] == "bisect"]
    assert parent.info.status == "KILLED"
    again = StandIn(shas)
    code, _, err = bisect(history, tmp_path / "out", again, sqlite_uri)
    assert code == 0 and again.probed == [5, 7, 6]
    assert "3 decided earlier (reused)" in err
    runs = runs_of(sqlite_uri)
    parents = [r for r in runs if r.data.tags["difftest.kind"] == "bisect"]
    assert [p.info.run_id for p in parents] == [parent.info.run_id] and parents[0].info.status == "FINISHED"
    assert len([r for r in runs if r.data.tags["difftest.kind"] == "bisect-probe"]) == 6  # none twice
    done = StandIn(shas)
    assert bisect(history, tmp_path / "out", done, sqlite_uri)[0] == 0 and done.probed == []


def test_mlflow_down_the_bisect_goes_on_and_uploads_later(history, tmp_path, sqlite_uri):
    _, shas = history
    code, out, err = bisect(history, tmp_path / "out", StandIn(shas), closed_uri())
    assert code == 0 and f"first bad commit: {shas[K]}" in out
    assert err.count("warning: MLflow unavailable") == 1 and "the bisect goes on" in err
    state = json.loads((tmp_path / "out" / "bisect.json").read_text())
    assert all(not d["mlflow"] for d in state["decisions"].values())
    # The same --out with MLflow back: nothing probed again, every record uploaded.
    again = StandIn(shas)
    code, _, err = bisect(history, tmp_path / "out", again, sqlite_uri)
    assert code == 0 and again.probed == [] and "warning" not in err
    children = [r for r in runs_of(sqlite_uri) if r.data.tags["difftest.kind"] == "bisect-probe"]
    assert len(children) == 6
    assert [r.data.tags["candidate.commit"] for r in children if r.data.tags["difftest.culprit"] == "true"] == [shas[K]]


def test_another_bisect_in_the_same_out_is_refused(history, tmp_path):
    path, shas = history
    so = io.StringIO()
    assert run_bisect(path, shas[0], shas[-1], StandIn(shas), tmp_path / "out", identity=IDENTITY,
                      tracking=Tracking(enabled=False), stdout=so, stderr=io.StringIO()) == 0
    with pytest.raises(BadInput, match=r"belongs to another bisect \(differs in: repeats\)"):
        run_bisect(path, shas[0], shas[-1], StandIn(shas), tmp_path / "out", identity={**IDENTITY, "repeats": 3},
                   tracking=Tracking(enabled=False), stdout=so, stderr=io.StringIO())
    with pytest.raises(BadInput, match="differs in: bad"):
        run_bisect(path, shas[0], shas[-2], StandIn(shas), tmp_path / "out", identity=IDENTITY,
                   tracking=Tracking(enabled=False), stdout=so, stderr=io.StringIO())


@pytest.mark.parametrize("prober_kw, code, says", [
    ({"bad_from": 0}, 2, "cannot bisect: the good end fails"),
    ({"bad_from": 99}, 2, "cannot bisect: the bad end passes"),
    ({"skips": (0,)}, 3, "cannot bisect: an end could not be decided"),
    ({"skips": (4, 5, 6)}, 3, "no single first bad commit"),
])
def test_what_cannot_be_bisected(history, tmp_path, prober_kw, code, says):
    path, shas = history
    so = io.StringIO()
    got = run_bisect(path, shas[0], shas[-1], StandIn(shas, **prober_kw), tmp_path / "out", identity=IDENTITY,
                     tracking=Tracking(enabled=False), stdout=so, stderr=io.StringIO())
    assert got == code and says in so.getvalue()
    if "no single" in says:
        assert all(shas[i] in so.getvalue() for i in (4, 5, 6))


def test_probe_answers_in_git_exit_codes_and_remembers(history, tmp_path):
    path, shas = history
    so = io.StringIO()
    for i, want in ((0, 0), (K, 1), (BROKEN, 125), (FLAKY, 1)):
        got = run_probe(path, shas[i], StandIn(shas), tmp_path / "out", identity=IDENTITY,
                        tracking=Tracking(enabled=False), stdout=so, stderr=io.StringIO())
        assert got == want
    again = StandIn(shas)
    err = io.StringIO()
    assert run_probe(path, shas[K], again, tmp_path / "out", identity=IDENTITY, tracking=Tracking(enabled=False),
                     stdout=so, stderr=err) == 1
    assert again.probed == [] and "decided earlier" in err.getvalue()


def test_an_upload_that_broke_off_is_replaced_not_duplicated(history, tmp_path, sqlite_uri, monkeypatch):
    from difftest.bisect import record

    _, shas = history
    calls = {"n": 0}
    real = record.Recorder._log_probe

    def breaks_once(self, client, entry):
        calls["n"] += 1
        if calls["n"] == 2:  # the second probe's child run is created, then the session dies
            exp_id = self.state.data["mlflow"]["experiment_id"]
            client.create_run(exp_id, tags={"mlflow.parentRunId": self.parent, "candidate.commit": entry["commit"],
                                            "difftest.kind": "bisect-probe"})
            raise KeyboardInterrupt
        return real(self, client, entry)

    monkeypatch.setattr(record.Recorder, "_log_probe", breaks_once)
    with pytest.raises(KeyboardInterrupt):
        bisect(history, tmp_path / "out", StandIn(shas), sqlite_uri)
    monkeypatch.setattr(record.Recorder, "_log_probe", real)
    assert bisect(history, tmp_path / "out", StandIn(shas), sqlite_uri)[0] == 0
    children = [r for r in runs_of(sqlite_uri) if r.data.tags["difftest.kind"] == "bisect-probe"]
    assert sorted(r.data.tags["candidate.commit"] for r in children) == sorted(
        shas[i] for i in (0, 9, 4, 5, 7, 6))


class StandInSideBySide(StandIn):
    """The stand-in with `probe_many` (as difftest.bisect.parallel.ProcessProber): each round's
    records reported as they finish, the last asked first."""

    def __init__(self, shas, **kw):
        super().__init__(shas, **kw)
        self.rounds = []

    def probe_many(self, shas, on_done=None):
        self.rounds.append([self.index[s] for s in shas])
        recs = {s: self.probe(s) for s in shas}
        for s in reversed(shas):
            on_done(recs[s])
        return recs


def test_side_by_side_rounds_are_recorded_and_logged(history, tmp_path, sqlite_uri):
    _, shas = history
    prober = StandInSideBySide(shas)
    code, out, err = bisect(history, tmp_path / "out", prober, sqlite_uri, workers=3)
    assert code == 0, err
    # c4 does not install (skip): round 3 cuts (2, 7) without it; 3 rounds where the serial search takes 6
    assert prober.rounds == [[0, 9], [2, 4, 7], [3, 5, 6]]
    assert f"first bad commit: {shas[K]}" in out and "over 3 rounds of up to 3" in out
    assert "round 2: 3 probe(s) side by side" in err
    state = json.loads((tmp_path / "out" / "bisect.json").read_text())
    assert state["result"]["rounds"] == 3 and state["result"]["workers"] == 3 and state["result"]["probes"] == 8
    assert {shas[i]: state["decisions"][shas[i]]["round"] for i in (0, 9, 2, 4, 7, 3, 5, 6)} == {
        shas[0]: 1, shas[9]: 1, shas[2]: 2, shas[4]: 2, shas[7]: 2, shas[3]: 3, shas[5]: 3, shas[6]: 3}
    children = [r for r in runs_of(sqlite_uri) if r.data.tags["difftest.kind"] == "bisect-probe"]
    assert sorted((r.data.tags["bisect.round"], r.data.tags["candidate.commit"]) for r in children) == sorted(
        (str(state["decisions"][c]["round"]), c) for c in state["order"])


def test_a_probe_process_gets_the_bisects_own_arguments():
    import argparse

    from difftest.commands.bisect import add_bisect_parser
    from difftest.bisect.parallel import common_argv
    p = argparse.ArgumentParser()
    add_bisect_parser(p.add_subparsers())
    args = p.parse_args(["bisect", "--good", "a", "--bad", "b", "--suite", "s.yaml", "--out", "o", "--workers", "3",
                         "--recipe", "cpu-engine", "-n", "2", "--cpu-engine-arg=--max-batch=2",
                         "--omni-option", "accept_length_finish=true", "--no-mlflow", "--repeats", "3"])
    from difftest.commands.bisect import add_probe_parser

    got = common_argv(args, add_probe_parser(argparse.ArgumentParser().add_subparsers()))
    assert got == ["--suite=s.yaml", "--recipe=cpu-engine", "--cpu-engine-arg=--max-batch=2",
                   "--omni-option=accept_length_finish=true", "--concurrency=2", "--repeats=3"]
    # what the probe's own parser reads back is what the bisect was given
    q = argparse.ArgumentParser()
    add_probe_parser(q.add_subparsers())
    back = q.parse_args(["probe", "--out", "x", *got])
    for k in ("suite", "recipe", "cpu_engine_arg", "omni_option", "concurrency", "repeats"):
        assert getattr(back, k) == getattr(args, k), k
