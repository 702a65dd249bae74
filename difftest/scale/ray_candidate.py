"""The candidate as a Ray actor: its engine and its HTTP client on one node, results carried back.

`difftest run ... --ray ADDRESS --ray-candidate [--ray-candidate-gpus 1]` starts the candidate
(`vllm-omni`, `vllm-omni-offline` or `cpu-engine[:DEFECT]`) inside an actor, on whichever node
has the resources (`num_gpus` on a GPU cluster, one CPU here). The actor sends each pass (c=1, c=N,
the repeat) to its own engine with the run's arrival settings, so a wave of one run stays on one
server, and returns the files that pass wrote: the result files, the capture files, the engine's
logs. `RayCandidate` writes them into the run folder under the same relative paths (npz before
sidecar, atomically), paths inside the sidecars translated back from the node's folder to the
run's, and hands the run an `Outcome`, as every engine does (engines/base.py).

The suite's voice wavs travel to the node with the actor; tiny checkpoints are rebuilt there
(deterministic), any other checkpoint must be at the same path on the node or in its Hugging
Face cache. Results in the run folder made by the same engine (its identity key) are reused and
not sent. Progress is per pass (each segment reported when its pass comes back).
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from ..engines.base import Outcome
from ..engines.http import recorded_waves
from ..errors import InfraError
from ..results import ResultStore, atomic_write, reusable_together
from .ray_pool import _cause, _ray, connect


class CandidateActorImpl:
    """One candidate engine on this node (wrapped by `ray.remote` in `RayCandidate`)."""

    def __init__(self, spec, suite, opts, models: list[dict], wavs: dict[str, bytes], reference_python: str,
                 run_tag: str):
        from ..engines.reference import tiny_checkpoints
        from ..engines.start import Setup, start_candidate

        self.node = f"{socket.gethostname()} (Ray node {_ray().get_runtime_context().get_node_id()[:12]})"
        self.root = Path(tempfile.mkdtemp(prefix="difftest-ray-candidate-"))
        self.aliases: dict[str, str] = {}  # local path -> driver path
        voices = {}
        for vid, v in suite.voices.items():
            local = self.root / "voices" / vid / Path(v.wav).name
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(wavs[str(v.wav)])
            voices[vid] = replace(v, wav=local)
            self.aliases[str(local)] = str(v.wav)
        segments = [replace(s, voice=voices[s.voice.id]) if s.voice else s for s in suite.segments]
        self.suite = replace(suite, voices=voices, segments=segments)
        local_models, tiny = [], None
        for m in models:
            if m.get("tiny"):
                if tiny is None:
                    tiny = tiny_checkpoints(self.root / "store", Path(reference_python), seed=int(m["tiny"]["seed"]),
                                            hazard=bool(m["tiny"].get("hazard")))
                local = next(p for p in tiny if Path(p).name == Path(m["path"]).name)
                self.aliases[local] = m["path"]
                local_models.append(local)
            else:
                local_models.append(m["path"])
        self.out = self.root / "run"
        self.out.mkdir()
        self.stack = ExitStack()
        setup = Setup(self.out, local_models, Path(reference_python), self.suite, opts)
        self.engine = start_candidate(spec, setup, self.stack, run_tag=run_tag)

    def info(self) -> dict:
        return {"info": json.loads(self._back(json.dumps(self.engine.info))), "node": self.node,
                "label": self.engine.label}

    def generate(self, segment_ids: list[str], concurrency: int, folder: str, identity_key: str) -> dict:
        """One pass: its outcome and every file it wrote under the node's run folder (relative path -> bytes)."""
        before = {p: p.stat().st_mtime_ns for p in self.out.rglob("*") if p.is_file()}
        wanted = [s for s in self.suite.segments if s.id in set(segment_ids)]
        order = {sid: i for i, sid in enumerate(segment_ids)}
        wanted.sort(key=lambda s: order[s.id])
        o = self.engine.generate(wanted, concurrency=concurrency, out_dir=self.out / folder, identity_key=identity_key)
        files = {}
        for p in sorted(self.out.rglob("*")):
            if p.is_file() and before.get(p) != p.stat().st_mtime_ns:
                data = p.read_bytes()
                if p.suffix == ".json":
                    data = self._back(data.decode("utf-8")).encode("utf-8")
                files[str(p.relative_to(self.out))] = data
        return {"results": sorted(o.results), "errors": o.errors, "batches": o.batches, "files": files}

    def _back(self, text: str) -> str:
        """Node paths inside JSON text replaced by the driver's (the run folder is `@RUN@` here)."""
        pairs = [(str(self.out), "@RUN@"), *self.aliases.items()]
        for local, driver in sorted(pairs, key=lambda kv: -len(kv[0])):
            text = text.replace(json.dumps(local)[1:-1], json.dumps(driver)[1:-1])
        return text

    def close(self) -> None:
        self.stack.close()
        shutil.rmtree(self.root, ignore_errors=True)


class RayCandidate:
    """The Engine surface of a candidate running in a Ray actor."""

    def __init__(self, spec, setup, *, address: str | None, gpus: float = 0.0, cpus: float = 1.0,
                 run_tag: str = "", start_timeout: float = 1800.0):
        from ..engines.reference import tiny_build

        self._started_ray = connect(address)  # first: it sets what Ray reads when imported
        ray = _ray()
        self.out = Path(setup.out)
        wavs = {str(v.wav): Path(v.wav).read_bytes() for v in setup.suite.voices.values()}
        models = [{"path": str(Path(m).resolve()) if Path(m).exists() else m, "tiny": tiny_build(m)} for m in setup.models]
        actor_cls = ray.remote(num_cpus=cpus, num_gpus=gpus, max_restarts=0)(CandidateActorImpl)
        self.actor = actor_cls.remote(spec, setup.suite, setup.opts, models, wavs, str(setup.python), run_tag)
        ready, _ = ray.wait([ref := self.actor.info.remote()], timeout=start_timeout)
        if not ready:
            self.close()
            raise InfraError(f"--ray-candidate: the candidate actor did not start in {start_timeout:.0f} s "
                             f"(it needs {cpus:g} CPU, {gpus:g} GPU; free: {ray.available_resources()})")
        try:
            got = ray.get(ref)
        except Exception as e:
            self.close()
            raise InfraError(f"--ray-candidate: the candidate did not start on its node: {_cause(e)}") from None
        self.label, self.node = got["label"], got["node"]
        self.info = {**json.loads(json.dumps(got["info"]).replace("@RUN@", str(self.out))), "ray_node": self.node}

    def generate(self, segments, *, concurrency: int, out_dir: Path | None = None, identity_key: str | None = None,
                 progress=None) -> Outcome:
        ray = _ray()
        out_dir = Path(out_dir)
        store = ResultStore(out_dir)
        outcome = Outcome()
        found = {}
        for s in segments:  # reuse what this engine made here already, as a local engine does
            hit = store.get(out_dir, s.id, s.hash) if out_dir.exists() else None
            if hit is not None and hit.meta.get("identity") == identity_key:
                found[s.id] = hit
        outcome.results = reusable_together(found)  # never a wave reused without a changed member
        outcome.cached = set(outcome.results)
        outcome.batches = recorded_waves(outcome.results.values(), set(outcome.results))
        todo = [s for s in segments if s.id not in outcome.results]
        if not todo:
            return outcome
        folder = str(out_dir.resolve().relative_to(self.out.resolve()))
        try:
            got = ray.get(self.actor.generate.remote([s.id for s in todo], concurrency, folder, identity_key))
        except Exception as e:
            for s in todo:
                outcome.fail(s.id, "infrastructure", f"the candidate's Ray actor on {self.node} was lost: {_cause(e)}")
            return outcome
        for rel, data in sorted(got["files"].items(), key=lambda kv: kv[0].endswith(".json")):
            path = self.out / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix == ".json":
                data = data.decode("utf-8").replace("@RUN@", json.dumps(str(self.out))[1:-1]).encode("utf-8")
            atomic_write(path, data)
        for s in todo:
            if s.id in got["results"]:
                r = store.get(out_dir, s.id, s.hash)
                if r is None:
                    outcome.fail(s.id, "infrastructure", f"the candidate's result for {s.id} did not come back whole")
                    continue
                outcome.results[s.id] = r
                if progress is not None:
                    progress.segment(s.id, audio_seconds=r.seconds, seconds=r.timings.get("request_seconds", 0.0))
            elif s.id in got["errors"]:
                outcome.errors[s.id] = got["errors"][s.id]
        outcome.batches += got["batches"]
        return outcome

    def close(self) -> None:
        ray = _ray()
        try:
            ray.get(self.actor.close.remote(), timeout=60)
        except Exception:
            pass
        try:
            ray.kill(self.actor)
        except Exception:
            pass
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
