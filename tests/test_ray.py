"""The reference side on a real local multi-node Ray cluster (`ray.cluster_utils.Cluster`: a head
without CPUs and raylets of one CPU each, on this machine), against the local single-runner path.

Each raylet's reference runner works in its own temporary folder: the files a chunk needs travel
with it, and the files the runner writes come back through Ray."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from difftest.engines import reference
from difftest.errors import InfraError
from difftest.progress import Progress
from difftest.results import read_result
from difftest.scale.ray_pool import RayRunnerPool, _Paths, inputs_of, localise
from difftest.suites.suite import load_suite
from reference_support import all_models, reference_python, tiny  # noqa: F401  (tiny: a fixture)

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "cases" / "suites" / "smoke.yaml"
try:
    import ray
except ImportError:  # a missing dependency fails, it is not skipped
    pytest.fail("ray is missing: pip install -e '.[test]' (the test extra holds difftest[ray])", pytrace=False)


def _cluster(nodes: int = 2):
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(nodes):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    return c


@pytest.fixture(scope="module", autouse=True)
def _ray_workers_zygote(tmp_path_factory):
    """Ray starts its workers with OMP_NUM_THREADS=1, which the session's zygote cannot stand for
    (OpenMP reads it when torch loads): the runners on Ray are forked from one of their own. Set
    before any cluster of this module starts, so its workers inherit the name."""
    from zygote_support import zygote_of_the_reference

    with zygote_of_the_reference(tmp_path_factory.getbasetemp() / "zygote-ray.log", OMP_NUM_THREADS="1") as sock:
        yield sock


@pytest.fixture(scope="module")
def _module_cluster(_ray_workers_zygote):
    """One cluster for the module's tests (its start is about 25 s on two cores)."""
    c = _cluster()
    ray.init(address=c.address, log_to_driver=False, include_dashboard=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def cluster(_module_cluster):
    """The module's cluster as each test expects it: a head without CPUs and two one-CPU worker
    raylets. A test may remove a node (a lost node) or add one (the candidate's own); the next
    test gets two again."""
    c = _module_cluster
    for node in list(c.worker_nodes)[2:]:
        c.remove_node(node)
    while len(c.worker_nodes) < 2:
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    return c


# --- the paths a chunk carries (no Ray) ---

def test_a_job_is_moved_to_node_local_paths_and_its_files_back(tmp_path):
    wav, src = tmp_path / "voices" / "a.wav", tmp_path / "store" / "cross" / "s1.abc.in.npz"
    seg = {"id": "s1", "voice": {"wav": str(wav), "id": "a"}}
    job = {"items": [{"name": "s1", "segment": seg, "input": str(src), "out": str(tmp_path / "store" / "cross" / "s1.abc")}]}
    assert inputs_of("score", job) == sorted([str(wav), str(src)])
    paths = _Paths(tmp_path / "node")
    local = localise("score", job, {str(wav): b"RIFF", str(src): b"NPZ"}, paths)
    it = local["items"][0]
    assert Path(it["segment"]["voice"]["wav"]).read_bytes() == b"RIFF" and Path(it["input"]).read_bytes() == b"NPZ"
    assert str(tmp_path / "node") in it["out"] and job["items"][0]["input"] == str(src)  # the caller's job untouched
    side = json.dumps({"voice": it["segment"]["voice"]["wav"], "out": it["out"]}, indent=1, sort_keys=True)
    assert json.loads(paths.back(side)) == {"voice": str(wav), "out": str(tmp_path / "store" / "cross" / "s1.abc")}
    assert paths.driver_of(it["out"] + ".json") == str(tmp_path / "store" / "cross" / "s1.abc.json")
    with pytest.raises(InfraError, match="outside the folders"):
        paths.driver_of("/elsewhere/x.json")


def test_without_the_flag_ray_is_not_imported():
    code = "import sys, difftest.cli, difftest.run; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


# --- the whole run, local and on the cluster ---

def _run(out: Path, store: Path, *extra, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "difftest", "run", str(SMOKE), "--candidate", "cpu-engine:ref-leak",
                           "-n", "4", "--out", str(out), "--store", str(store), "--no-mlflow", "--no-repeat", *extra],
                          capture_output=True, text=True, timeout=1800, cwd=out.parent, env=env)


def _files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file() and "checkpoints" not in p.parts}


def _same_result_file(a: Path, b: Path, folders: tuple[str, str] = ("", "")) -> None:
    """Byte for byte, but for a sidecar's wall-clock timings (and `folders`: b's run folder named as a's)."""
    if a.suffix == ".json":
        ja, jb = json.loads(a.read_text()), json.loads(b.read_text().replace(folders[1], folders[0]))
        ja.pop("timings", None), jb.pop("timings", None)
        assert ja == jb, a
    else:
        assert a.read_bytes() == b.read_bytes(), a


@pytest.fixture
def ray_head(tmp_path):
    """docs/scale-out.md's one-machine head, started exactly as documented, with Ray 2.60's default
    authentication on: a token exists (RAY_AUTH_TOKEN_PATH here, ~/.ray/auth_token for a user), so
    `ray start` requires it. Before #34 a driver given the address failed with InvalidAuthToken."""
    import secrets
    import socket

    token = tmp_path / "ray-auth-token"
    token.write_text(secrets.token_hex(32))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_AUTH_TOKEN_PATH": str(token), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_AUTH_MODE", None)
    ray_cli = str(Path(sys.executable).with_name("ray"))
    import tempfile

    temp = Path(tempfile.mkdtemp(prefix="dt-ray-", dir="/tmp"))  # its own session folder; short: Ray's sockets live there
    up = subprocess.run([ray_cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                         "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
                         "--temp-dir", str(temp)], env=env, capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    assert "Token authentication is enabled" in up.stdout + up.stderr
    try:
        yield f"127.0.0.1:{port}", env
    finally:  # this head's processes only (`ray stop` would end every Ray process on the machine)
        for pid in _pids_naming(str(temp)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert not _pids_naming(str(temp)) or time.sleep(2) or not _pids_naming(str(temp))
        shutil.rmtree(temp, ignore_errors=True)


def _pids_naming(text: str) -> list[int]:
    """Processes whose command line holds `text` (the head's session folder, passed to each)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            pass
    return [p for p in found if p != os.getpid()]


@pytest.mark.heavy
def test_the_documented_ray_commands_give_the_local_report_and_result_files(ray_head, tmp_path):
    """The seed's leak planted in the CPU test engine, through the CLI as docs/scale-out.md gives it:
    `ray start --head` + `--ray 127.0.0.1:PORT`, and `--ray` alone (a cluster of difftest's own, which
    died with "Failed to connect to GCS within 60 seconds" before #34): the same verdicts, donors and
    first divergent frames as a run without Ray, and the same store files. The planted leak's donor
    is whichever request arrives first (a race, as in the real bug), so every run judges one set of
    candidate results: the Ray runs reuse the local run's candidate folders (same engine, same
    identity) and recompute the rest (generation, teacher forcing, cross-decodes) on Ray."""
    address, env = ray_head
    work = tmp_path / "w"
    work.mkdir()
    local = _run(work / "local", work / "store")
    assert local.returncode == 1, local.stderr[-3000:]
    (work / "store").rename(work / "store-local")  # each run's store at one path: the paths inside agree
    ra = json.loads((work / "local" / "report.json").read_text())
    view = lambda r: [(s["id"], s["verdict"], s["stage"], s["donor"], s["first_divergent_frame"]) for s in r["segments"]]  # noqa: E731
    assert any(s["donor"] for s in ra["segments"])
    for name, flags in (("head", ("--ray", address)), ("own", ("--ray",))):
        shutil.copytree(work / "local" / "results", work / name / "results",
                        ignore=lambda d, names: ["cross"] if Path(d).name == "results" else [])
        on_ray = _run(work / name, work / "store", *flags, "--ray-workers", "2", env=env)
        assert on_ray.returncode == 1, on_ray.stderr[-3000:]
        (work / "store").rename(work / f"store-{name}")
        assert "2 qwen-tts runners on Ray" in on_ray.stderr and "candidate c=4: 4/4 segments, 4 cached" in on_ray.stderr
        for bad in ("Traceback", "InvalidAuthToken", "Error"):  # a reader takes any of these for a failure
            at = on_ray.stderr.find(bad)
            assert at < 0, on_ray.stderr[max(0, at - 1500):at + 1500]
        a, b = _files(work / "store-local"), _files(work / f"store-{name}")
        assert sorted(a) == sorted(b) and any(k.startswith("qwen-tts-") for k in a) and any(k.startswith("scores-") for k in a)
        for k in a:
            _same_result_file(a[k], b[k])
        cross_a, cross_b = _files(work / "local" / "results" / "cross"), _files(work / name / "results" / "cross")
        assert sorted(cross_a) == sorted(cross_b) and cross_a
        for k in cross_a:  # in each run's own folder
            _same_result_file(cross_a[k], cross_b[k], (str(work / "local"), str(work / name)))
        rb = json.loads((work / name / "report.json").read_text())
        assert view(ra) == view(rb) and (ra["verdict"], ra["counts"]) == (rb["verdict"], rb["counts"])
        assert rb["reference"]["fingerprint"] == ra["reference"]["fingerprint"]
        assert rb["reference"]["provenance"]["ray"]["workers"] == 2
    # everything on the loopback: the one node registered at 127.0.0.1, and the head listens there only
    probe = ("import ray; ray.init(address=%r, log_to_driver=False, include_dashboard=False); "
             "print(sorted({n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']}))" % address)
    got = subprocess.run([sys.executable, "-c", probe], env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True,
                         text=True, timeout=180)
    assert got.stdout.strip().splitlines()[-1] == "['127.0.0.1']", got.stderr[-2000:]


@pytest.mark.heavy
def test_a_cluster_that_asks_for_a_token_none_at_hand_can_give_is_an_infrastructure_error(ray_head, tmp_path):
    """The head requires Ray's token; this machine has none (no RAY_AUTH_TOKEN, no token file, a
    HOME without ~/.ray): exit 3 saying where to get it, before any model work (not Ray's
    InvalidAuthToken traceback)."""
    address, env = ray_head
    env = {k: v for k, v in env.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    (tmp_path / "home").mkdir()
    env["HOME"] = str(tmp_path / "home")
    (tmp_path / "w").mkdir()
    p = _run(tmp_path / "w" / "out", tmp_path / "w" / "store", "--ray", address, env=env)
    assert p.returncode == 3, p.stderr[-3000:]
    assert (f"--ray {address}: the cluster requires Ray's token authentication and no token is at hand: copy "
            f"the head's ~/.ray/auth_token here") in p.stderr
    assert "Traceback" not in p.stderr and "loading the base model" not in p.stderr


# --- faults ---

class KillANodeMidChunk(Progress):
    """After the first result, remove the raylet of a worker that is in the middle of a chunk."""

    def __init__(self, total, pool, cluster):
        super().__init__(total, label="reference", stream=io.StringIO())
        self.pool, self.cluster, self.killed = pool, cluster, None

    def segment(self, segment_id, **kw):
        super().segment(segment_id, **kw)
        if self.killed is None and self.pool.running:
            actor = next(iter(self.pool.running.values()))[0]
            node_id = self.pool.node_of[actor]
            node = next(n for n in self.cluster.worker_nodes if n.node_id == node_id)
            self.cluster.remove_node(node)
            self.killed = node_id


@pytest.mark.heavy
def test_a_lost_node_costs_only_its_chunk(cluster, tiny, tmp_path):
    suite = load_suite(REPO / "cases" / "suites" / "voice-clone-concurrency.yaml")
    segments = [s for s in suite.segments if s.task == "voice_clone"][:6]
    pool = RayRunnerPool(reference_python(), all_models(tiny), {"device": "cpu", "dtype": "float32", "threads": 1},
                         workers=2)
    try:
        engine = reference.ReferenceEngine(pool, tmp_path / "store")
        progress = KillANodeMidChunk(len(segments), pool, cluster)
        run = engine.generate(segments, progress=progress)
    finally:
        pool.close()
    assert progress.killed is not None
    assert run.errors == {} and sorted(run.results) == sorted(s.id for s in segments)  # nothing lost
    assert pool.stats["lost_actors"] == 1 and pool.stats["resent"] == 1
    assert pool.stats["chunks"] == len(segments) + 1  # the lost chunk once more, nothing else twice
    for s in segments:  # what the survivor wrote reads back whole
        r = read_result(_sidecar(run.config_dir, s))
        assert r.segment_hash == s.hash and len(r.codes) > 0 and np.isfinite(r.wav).all()


def _sidecar(config_dir: Path, seg) -> Path:
    stem = reference.ResultStore.stem(config_dir, seg.id, seg.hash)
    return stem.with_name(stem.name + ".json")


@pytest.mark.heavy
def test_a_worker_without_the_runner_environment_is_named(cluster, tiny):
    pool = RayRunnerPool(Path("/nonexistent/venv/bin/python"), all_models(tiny), {}, workers=1)
    with pytest.raises(InfraError, match="no reference environment at /nonexistent/venv/bin/python"):
        pool.start()


@pytest.mark.heavy
def test_a_cluster_without_room_is_refused_in_bounded_time(cluster, tiny):
    # no node has 4 CPUs: the worker can never start, on any machine, so a short bound is enough
    pool = RayRunnerPool(reference_python(), all_models(tiny), {}, workers=1, cpus_per_worker=4, start_timeout=3)
    with pytest.raises(InfraError, match=r"did not start in 3 s \(each needs 4 CPU"):
        pool.start()


def test_an_unreachable_head_is_an_infrastructure_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "difftest", "run", str(SMOKE), "--candidate", "cpu-engine",
                        "--ray", "127.0.0.1:9", "--out", str(tmp_path / "o"), "--store", str(tmp_path / "s"),
                        "--no-mlflow"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "--ray 127.0.0.1:9: no Ray head answers there" in r.stderr and "Traceback" not in r.stderr
    shutil.rmtree(tmp_path / "o", ignore_errors=True)


@pytest.mark.heavy
def test_the_candidate_in_a_ray_actor_gives_the_local_verdicts(cluster, tmp_path):
    """--ray-candidate: the CPU test engine with the seed's leak, started in an actor on a raylet of
    its own, its passes sent from there; its result and capture files come back through Ray into
    the run folder. The leak is caught as locally: contamination at the hand-off, chunk 0, a donor."""
    from ray.cluster_utils import Cluster  # noqa: F401  (the fixture's cluster gets a third raylet)

    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    work = tmp_path / "w"
    work.mkdir()
    r = _run(work / "run", work / "store", "--ray", cluster.address, "--ray-workers", "1", "--ray-candidate")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "in a Ray actor" in r.stderr
    rep = json.loads((work / "run" / "report.json").read_text())
    assert rep["candidate"]["ray_node"] and rep["candidate"]["engine"].startswith("difftest CPU test engine")
    leaked = [s for s in rep["segments"] if s["verdict"] == "contamination"]
    assert leaked and all(s["stage"] == "handoff" and s["donor"] and s["first_divergent_chunk"] == 0 for s in leaked)
    assert rep["at_concurrency_1"]["verdict"] == "pass"
    for folder in ("candidate-c1", "candidate-c4"):  # the actor's files, under the run folder, paths its own
        sidecars = sorted((work / "run" / "results" / folder).glob("smoke-*.json"))
        assert len(sidecars) == 4
        for side in sidecars:
            assert "difftest-ray-candidate-" not in side.read_text()  # no node-local path left inside
            assert read_result(side).segment_hash


@pytest.mark.heavy
def test_an_interrupted_run_on_ray_resumes_from_the_store(cluster, tmp_path):
    """Ctrl-C on the driver while the reference side is being generated on the cluster: the run
    stops (exit 3), the store keeps every result the driver had written, and the same command
    finishes the run, generating only the segments that were missing: none twice."""
    N = 5  # two workers: when the first result is in, at most the other's chunk is done too
    suites, work = tmp_path / "suites", tmp_path / "w"
    suites.mkdir(), work.mkdir()
    (tmp_path / "voices").symlink_to(REPO / "cases" / "voices")
    suite = suites / f"ab{N}.yaml"
    subprocess.run([sys.executable, str(REPO / "cases" / "make_audiobook_suite.py"), "--segments", str(N),
                    "--voices", "3", "--out", str(suite)], check=True, capture_output=True, timeout=120)
    argv = [sys.executable, "-m", "difftest", "run", str(suite), "--candidate", "cpu-engine:ref-leak", "-n", "4",
            "--out", str(work / "run"), "--store", str(work / "store"), "--no-mlflow", "--no-repeat",
            "--ray", cluster.address, "--ray-workers", "2"]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work,
                             start_new_session=True)
    sidecars = lambda: sorted((work / "store").glob("qwen-tts-*/ab*.json"))  # noqa: E731
    try:
        deadline = time.monotonic() + 900
        while not sidecars():  # the first reference result is in the store: interrupt now
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGINT)
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 3 and "interrupted" in err, err[-3000:]
    kept = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sidecars()}
    assert 1 <= len(kept) < N, sorted(kept)  # interrupted in the middle, not before or after
    assert not (work / "run" / "report.json").exists()

    second = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=work)
    assert second.returncode == 1, second.stderr[-3000:]  # the planted leak
    assert f"reference: {N}/{N} segments, {len(kept)} cached" in second.stderr, second.stderr[-3000:]
    for p in sidecars():
        if p.name in kept:  # not computed again: the same file, untouched
            assert (p.stat().st_mtime_ns, p.read_bytes()) == kept[p.name], p.name
    assert len(sidecars()) == N
    rep = json.loads((work / "run" / "report.json").read_text())
    assert rep["suite"]["segments"] == N and any(s["verdict"] == "contamination" and s["donor"] for s in rep["segments"])
