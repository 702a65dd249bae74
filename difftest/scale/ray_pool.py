"""The reference side on a Ray cluster: reference runners as Ray actors, files carried by Ray.

`RayRunnerPool` stands where one `RunnerProcess` stands: `ReferenceEngine`, the cross-decoder
and the scorer use it unchanged (`hello`, `request(op, timeout, **job)` yielding the runner
protocol's events, `close`, `kill`). Behind it, each `RunnerActor` owns one reference runner on
its node, started with that node's interpreter at the same path, in a node-local folder: nothing
is read or written through a shared filesystem.

- A job (`generate`, `decode`, `score`) is cut into chunks (one segment, a few items); a chunk
  goes to whichever actor is free, with the bytes of the files it names (voice wavs, the inputs
  of decode and score items), and comes back with the bytes of the files the runner wrote. The
  driver writes them under the paths the job named, npz before sidecar, each atomically: the
  store it fills is the one a local run fills (the runner's own file names; paths inside the
  sidecars are translated back to the driver's, see `_Paths`).
- The seeded tiny checkpoints are rebuilt on each node (the builder is deterministic; the
  checkpoint hashes in each runner's fingerprint prove it); other checkpoints must be at the same
  path on every node, or in its Hugging Face cache.
- Every actor's fingerprint must be the same: one reference configuration per run.
- An actor lost mid-chunk (its node died, its process was killed) costs that chunk only: it is
  sent to a live actor, at most `RETRIES` times. Results already written stay written; with no
  actor left, the consumer hears `RunnerDied` and reports the rest per segment, as for one runner.

Ray is imported only here, and only for `--ray`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import Iterator

from ..checkout import REPO
from ..errors import BadInput, InfraError
from ..process.runner_client import RunnerDied
from ..results import atomic_write

RETRIES = 2  # re-sends of one chunk after the actor holding it was lost
ITEMS_PER_CHUNK = {"generate": 1, "decode": 4, "score": 2}
CONNECT_TIMEOUT = 60.0  # ray.init against an address
START_TIMEOUT = 300.0  # every actor up with its runner (a first model load, a tiny build on each node)


def _ray():
    try:
        import ray
    except ImportError:
        raise BadInput("--ray needs Ray: pip install 'difftest[ray]' (ray 2.60)") from None
    return ray


class _Paths:
    """The driver's paths a chunk names and the node-local ones its runner sees, both ways."""

    def __init__(self, root: Path):
        self.root = root
        self.to_local: dict[str, str] = {}

    def input(self, driver_path: str, data: bytes) -> str:
        local = self.root / "in" / hashlib.sha256(driver_path.encode()).hexdigest()[:16] / Path(driver_path).name
        if not local.exists():
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data)
        self.to_local[driver_path] = str(local)
        return str(local)

    def folder(self, driver_dir: str) -> str:
        local = self.root / "out" / hashlib.sha256(driver_dir.encode()).hexdigest()[:16]
        local.mkdir(parents=True, exist_ok=True)
        self.to_local[driver_dir] = str(local)
        return str(local)

    def stem(self, driver_stem: str) -> str:
        return str(Path(self.folder(str(Path(driver_stem).parent))) / Path(driver_stem).name)

    def back(self, text: str) -> str:
        """A sidecar's JSON with every local path the runner saw replaced by the driver's (longest first).
        String for string inside the JSON text: the file stays byte for byte what write_result makes."""
        for driver, local in sorted(self.to_local.items(), key=lambda kv: -len(kv[1])):
            text = text.replace(json.dumps(local)[1:-1], json.dumps(driver)[1:-1])
        return text

    def driver_of(self, local_path: str) -> str:
        for driver, local in sorted(self.to_local.items(), key=lambda kv: -len(kv[1])):
            if local_path == local or local_path.startswith(local + "/"):
                return driver + local_path[len(local):]
        raise InfraError(f"the runner wrote {local_path}, outside the folders its job named")


def localise(op: str, job: dict, files: dict[str, bytes], paths: _Paths) -> dict:
    """The job with the driver's paths replaced by node-local ones (inputs written from `files`)."""
    job = json.loads(json.dumps(job))

    def voice(seg: dict | None) -> None:
        if seg and seg.get("voice") and seg["voice"].get("wav"):
            seg["voice"]["wav"] = paths.input(seg["voice"]["wav"], files[seg["voice"]["wav"]])

    if op == "generate":
        for seg in job["segments"]:
            voice(seg)
        job["out_dir"] = paths.folder(job["out_dir"])
    else:
        for it in job["items"]:
            voice(it.get("segment"))
            it["input"] = paths.input(it["input"], files[it["input"]])
            it["out"] = paths.stem(it["out"])
    return job


def inputs_of(op: str, job: dict) -> list[str]:
    """The driver-side files a job reads: what travels with its chunk."""
    out = []
    if op == "generate":
        segs = job["segments"]
    else:
        segs = [it.get("segment") for it in job["items"]]
        out += [it["input"] for it in job["items"]]
    out += [s["voice"]["wav"] for s in segs if s and s.get("voice") and s["voice"].get("wav")]
    return sorted(set(out))


class RunnerActorImpl:
    """One reference runner on this node (wrapped by `ray.remote` in `RayRunnerPool`)."""

    def __init__(self, python: str, models: list[dict], options: dict):
        from ..engines.reference import ReferenceOptions, runner_argv, runner_env, tiny_checkpoints
        from ..process.runner_client import RunnerProcess

        self.node = f"{socket.gethostname()} (Ray node {_ray().get_runtime_context().get_node_id()[:12]})"
        if not Path(python).exists():
            raise InfraError(f"{self.node}: no reference environment at {python} (build it there with "
                             f"runners/reference/make_env.sh)")
        self.root = Path(tempfile.mkdtemp(prefix="difftest-ray-"))
        self.paths = _Paths(self.root)
        local_models = []
        tiny_built = None
        for m in models:
            if m.get("tiny"):  # deterministic: the same bytes on every node, proved by the fingerprint
                if tiny_built is None:
                    tiny_built = tiny_checkpoints(self.root / "store", Path(python), seed=int(m["tiny"]["seed"]),
                                                  hazard=bool(m["tiny"].get("hazard")))
                local = next(p for p in tiny_built if Path(p).name == Path(m["path"]).name)
                self.paths.to_local[m["path"]] = local
                local_models.append(local)
            else:
                local_models.append(m["path"])
        opts = ReferenceOptions(**options)
        self.runner = RunnerProcess(runner_argv(Path(python), local_models, opts), env=runner_env(opts),
                                    log_path=self.root / "runner.log", cwd=REPO)
        self.runner.start()

    def hello(self) -> dict:
        hello = json.loads(self.paths.back(json.dumps(self.runner.hello)))
        return {"hello": hello, "node": self.node, "node_id": _ray().get_runtime_context().get_node_id()}

    def run(self, op: str, job: dict, files: dict[str, bytes], timeout: float) -> list[dict]:
        """The chunk's events, each `result` with the files it names (driver path -> bytes)."""
        local_job = localise(op, job, files, self.paths)
        events = []
        try:
            for ev in self.runner.request(op, timeout=timeout, **local_job):
                if ev.get("event") == "result" and ev.get("path"):
                    ev = {**ev, **self._files_of(ev["path"])}
                events.append(ev)
        except RunnerDied as e:
            events.append({"event": "runner_died", "message": f"{self.node}: {str(e).splitlines()[0]}",
                           "tail": self.runner.log_tail(20)})
        return events

    def _files_of(self, sidecar: str) -> dict:
        side = Path(sidecar)
        text = side.read_text(encoding="utf-8")
        npz = side.with_name(json.loads(text)["npz"])
        driver_side = self.paths.driver_of(str(side))
        return {"path": driver_side, "files": {self.paths.driver_of(str(npz)): npz.read_bytes(),
                                               driver_side: self.paths.back(text).encode()}}

    def close(self) -> None:
        self.runner.close()
        shutil.rmtree(self.root, ignore_errors=True)


LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Ray on Linux replaces a loopback node address with the machine's outward one (services.
# resolve_ip_for_localhost), so a one-machine cluster would register, and its driver dial, the
# external interface. This switch (named for Windows and macOS, where it is Ray's default) keeps
# every address on the loopback: the head's GCS, the raylet, the workers. It also stops
# `ray start --address` from adding worker nodes, so it is set only for one-machine clusters.
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_AUTH_ENV = "RAY_AUTH_MODE"


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def _prepare_env(address: str | None) -> None:
    """What Ray reads when it is imported, set before that: the loopback for a cluster on this
    machine (the address-less form, or a head at 127.0.0.1)."""
    if address in (None, "local") or _host(address) in LOOPBACK:
        os.environ.setdefault(_LOOPBACK_ENV, "0")


def _token_at_hand() -> bool:
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or path.is_file()


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for a moment (the main thread only waits meanwhile)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(null)


def _authenticate(address: str) -> None:
    """Token authentication for a driver joining `address`, when the cluster asks for it.

    Ray 2.60 turns token authentication on for every cluster it starts with a token at hand
    (`ray start --head` once ~/.ray/auth_token exists; a local `ray.init()`, which writes one), but
    a driver given an address sends no token unless RAY_AUTH_MODE=token, and fails with
    InvalidAuthToken. Sending one to a cluster without authentication is no cure either: its
    workers then cannot reach the driver (actors are cancelled). So the head is asked first
    (one GCS call, under a second); RAY_AUTH_MODE set by the user wins."""
    if os.environ.get(_AUTH_ENV) is not None:
        return
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    try:
        with _quiet_stderr():  # Ray's C++ logs the refusal as a warning a reader takes for the run's failure
            GcsClient(address=address)
        return  # it answered without a token
    except AuthenticationError:
        pass
    except Exception:  # noqa: BLE001 (anything else is ray.init's to say)
        return
    if not _token_at_hand():
        raise InfraError(f"--ray {address}: the cluster requires Ray's token authentication and no token is at "
                         f"hand: copy the head's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN "
                         f"(`ray get-auth-token` on the head prints it)")
    os.environ[_AUTH_ENV] = "token"
    from ray._raylet import Config

    Config.initialize("")  # Ray read its settings at import: read them again


def _reachable(address: str, timeout: float = 5.0) -> None:
    """A TCP connect to the head's GCS port first: an address nobody listens on fails in seconds."""
    host, _, port = address.rpartition(":")
    if address in ("auto", "local") or address.startswith("ray://") or not port.isdigit():
        return
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout).close()
    except OSError as e:
        raise InfraError(f"--ray {address}: no Ray head answers there ({e})") from None


def connect(address: str | None, timeout: float = CONNECT_TIMEOUT) -> bool:
    """Join the cluster at `address` ("local" or None: start one on this machine). Returns whether
    this call started Ray (so closing the pool shuts it down). InfraError within `timeout`."""
    local = address in (None, "local")
    _prepare_env(address)
    ray = _ray()
    if ray.is_initialized():
        return False
    if not local:
        _reachable(address)
    kw = dict(log_to_driver=False, include_dashboard=False, configure_logging=False)
    if local:
        # In this thread, not a helper: Ray starts the GCS and the raylet with a parent-death
        # signal, which Linux sends when the *thread* that started them ends. Started from a
        # helper thread they died with it, and the run 60 s later ("Failed to connect to GCS").
        try:
            # "local": a new cluster, never one found through RAY_ADDRESS or /tmp/ray (`ray start`'s)
            ray.init(address="local", _node_ip_address="127.0.0.1", **kw)
        except Exception as e:
            raise InfraError(f"--ray: a local Ray cluster did not start: {type(e).__name__}: {e}") from None
        return True
    done: dict = {}

    def init():  # a head that accepts and never answers must not hang the run: bounded by `timeout`
        try:
            _authenticate(address)
            ray.init(address=address, **kw)
            done["ok"] = True
        except InfraError as e:
            done["infra"] = e
        except Exception as e:  # ConnectionError, RuntimeError: what Ray says of the address
            done["error"] = e

    t = threading.Thread(target=init, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise InfraError(f"--ray {address}: Ray did not connect in {timeout:.0f} s")
    if "infra" in done:
        raise done["infra"]
    if "error" in done:
        raise InfraError(f"--ray {address}: {type(done['error']).__name__}: {done['error']}") from None
    return True


class RayRunnerPool:
    """Reference runners on a Ray cluster behind the RunnerProcess surface."""

    def __init__(self, python: Path, models: list[str], options: dict, *, workers: int = 2,
                 address: str | None = None, cpus_per_worker: float = 1.0, start_timeout: float = START_TIMEOUT):
        from ..engines.reference import tiny_build

        self.python, self.options, self.workers = str(python), dict(options), int(workers)
        self.address, self.cpus, self.start_timeout = address, float(cpus_per_worker), float(start_timeout)
        self.models = [{"path": str(Path(m).resolve()) if Path(m).exists() else m, "tiny": tiny_build(m)}
                       for m in models]
        self.hello: dict = {}
        self.nodes: list[str] = []
        self.actors: list = []
        self._started_ray = False
        self.node_of: dict = {}  # actor -> its Ray node id
        self.running: dict = {}  # object ref -> (actor, chunk id, chunk): what is in flight
        self.proc = None  # RunnerProcess's "not started" (ReferenceEngine starts it)
        self.stats = {"chunks": 0, "resent": 0, "lost_actors": 0}

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> dict:
        if self.workers < 1:
            raise BadInput("--ray-workers must be at least 1")
        self._started_ray = connect(self.address)  # first: it sets what Ray reads when imported
        ray = _ray()
        actor_cls = ray.remote(num_cpus=self.cpus, max_restarts=0)(RunnerActorImpl)
        self.actors = [actor_cls.remote(self.python, self.models, self.options) for _ in range(self.workers)]
        pending = {a.hello.remote(): a for a in self.actors}
        ready, not_ready = ray.wait(list(pending), num_returns=len(pending), timeout=self.start_timeout)
        if not_ready:
            self.kill()
            have = ray.available_resources() if ray.is_initialized() else {}
            raise InfraError(f"--ray: {len(not_ready)} of {self.workers} reference workers did not start in "
                             f"{self.start_timeout:.0f} s (each needs {self.cpus:g} CPU; the cluster has "
                             f"{have.get('CPU', 0):g} free of {ray.cluster_resources().get('CPU', 0):g})")
        hellos = []
        for ref in ready:
            try:
                hellos.append(ray.get(ref))
                self.node_of[pending[ref]] = hellos[-1]["node_id"]
            except Exception as e:
                self.kill()
                raise InfraError(f"--ray: a reference worker failed to start: {_cause(e)}") from None
        prints = {json.dumps(h["hello"].get("fingerprint"), sort_keys=True) for h in hellos}
        if len(prints) != 1:
            self.kill()
            raise InfraError("--ray: the workers run different reference configurations:\n  " + "\n  ".join(
                f"{h['node']}: {json.dumps(h['hello'].get('fingerprint'), sort_keys=True)[:300]}" for h in hellos))
        self.nodes = sorted({h["node"] for h in hellos})
        hello = hellos[0]["hello"]
        self.hello = {**hello, "provenance": {**(hello.get("provenance") or {}),
                                              "ray": {"workers": self.workers, "nodes": self.nodes}}}
        self.proc = self  # started
        return self.hello

    @property
    def alive(self) -> bool:
        return bool(self.actors)

    def close(self, timeout: float = 30.0) -> None:
        ray = _ray()
        if self.actors and ray.is_initialized():
            try:
                ray.get([a.close.remote() for a in self.actors], timeout=timeout)
            except Exception:
                pass
        self.kill()

    def kill(self) -> None:
        ray = _ray()
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        self.actors = []
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def log_tail(self, lines: int = 30) -> str:
        return ""

    # -- jobs ----------------------------------------------------------------
    def request(self, op: str, timeout: float = 600.0, **job) -> Iterator[dict]:
        """The job's events as its chunks finish, in no fixed order (consumers key them by item)."""
        if not self.actors:
            raise RunnerDied("no Ray reference worker is running")
        ray = _ray()
        key = "segments" if op == "generate" else "items"
        items = list(job.get(key) or [])
        # a batched wave (the measured null at N) is decoded whole: its mates decide its codes
        size = max(len(items), 1) if job.get("waves") else ITEMS_PER_CHUNK.get(op, 1)
        queue = deque((i, {**job, key: items[i:i + size]}) for i in range(0, len(items), size))
        tries: dict[int, int] = {}
        free = deque(self.actors)
        running = self.running = {}
        while queue or running:
            while queue and free:
                cid, chunk = queue.popleft()
                actor = free.popleft()
                files = {p: Path(p).read_bytes() for p in inputs_of(op, chunk)}
                running[actor.run.remote(op, chunk, files, timeout)] = (actor, cid, chunk)
                self.stats["chunks"] += 1
            if not running:
                raise RunnerDied(f"every Ray reference worker is gone ({self.stats['lost_actors']} lost)")
            done, _ = ray.wait(list(running), num_returns=1, timeout=timeout)
            if not done:
                raise RunnerDied(f"no Ray reference worker answered in {timeout:.0f} s")
            ref = done[0]
            actor, cid, chunk = running.pop(ref)
            try:
                events = ray.get(ref)
            except Exception as e:  # the actor is gone (RayActorError, its node died): resend the chunk
                self.stats["lost_actors"] += 1
                self.actors = [a for a in self.actors if a is not actor]
                tries[cid] = tries.get(cid, 0) + 1
                print(f"ray: lost a reference worker ({type(e).__name__}); {len(self.actors)} left, "
                      f"its {op} chunk {'re-sent' if tries[cid] <= RETRIES else 'given up'}", file=sys.stderr,
                      flush=True)
                if tries[cid] > RETRIES:
                    for ev in self._unanswered(op, chunk, f"lost {tries[cid]} Ray workers on it: {type(e).__name__}"):
                        yield ev
                else:
                    self.stats["resent"] += 1
                    queue.appendleft((cid, chunk))
                continue
            free.append(actor)
            answered = set()
            for ev in events:
                if ev.get("event") == "runner_died":
                    continue
                for path, data in sorted((ev.pop("files", None) or {}).items(), key=lambda kv: kv[0].endswith(".json")):
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
                    atomic_write(Path(path), data)  # npz first, then its sidecar
                answered.add(ev.get("segment") or ev.get("item"))
                yield ev
            died = next((ev for ev in events if ev.get("event") == "runner_died"), None)
            if died:  # this node's runner died on the chunk: the rest of it are infrastructure errors
                rest = {**chunk, key: [it for it in chunk[key] if _name(op, it) not in answered]}
                for ev in self._unanswered(op, rest, died["message"]):
                    yield ev

    @staticmethod
    def _unanswered(op: str, chunk: dict, why: str) -> Iterator[dict]:
        key = "segments" if op == "generate" else "items"
        for it in chunk[key]:
            field = "segment" if op == "generate" else "item"
            yield {"event": "error", field: _name(op, it), "kind": "infrastructure", "message": why}


def _cause(e: Exception) -> str:
    """What an actor's constructor raised: Ray keeps only its traceback text, the exception last."""
    text = getattr(e, "error_msg", "") or str(e)
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r"^(?:[\w.]+\.)?(\w+(?:Error|Died|Refused|Input)): (.*)$", lines[i])
        if m:
            return "\n".join([m.group(2), *lines[i + 1:i + 9]])
    return lines[-1] if lines else type(e).__name__


def _name(op: str, it: dict) -> str:
    return it["id"] if op == "generate" else it["name"]


