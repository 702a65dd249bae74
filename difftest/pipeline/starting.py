"""Starting what a run needs: the checkpoints, the reference runner (here or as Ray actors),
the candidate in a Ray actor, and the line that says what the candidate is."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkout import REPO
from ..engines.reference import ReferenceOptions, runner_argv, runner_env, suite_models
from ..engines.start import CandidateSpec, Setup
from ..errors import BadInput, InfraError
from ..family import ModelFamily
from ..process.runner_client import RunnerDied, RunnerProcess
from ..results import ResultStore
from ..suites.suite import TINY_MODELS, Suite, hf_cached

if TYPE_CHECKING:
    from .options import RunOptions


def start_reference_runner(python: Path, models: list[str], ref_opts: ReferenceOptions, log: Path,
                           family: ModelFamily) -> RunnerProcess:
    """The reference runner of `family` (its own module and environment's interpreter), started."""
    runner = RunnerProcess(runner_argv(python, models, ref_opts, family), env=runner_env(ref_opts),
                           log_path=log, cwd=REPO)
    try:
        runner.start()
    except RunnerDied as e:
        raise InfraError(f"the reference runner did not start: {e}") from None
    return runner


def start_ray_pool(python: Path, models: list[str], ref_opts: ReferenceOptions, ray: dict):
    """Reference runners as Ray actors (difftest.scale.ray_pool), behind the RunnerProcess surface."""
    from ..scale.ray_pool import RayRunnerPool

    options = {k: v for k, v in ref_opts.__dict__.items() if k in ("device", "dtype", "threads")}
    pool = RayRunnerPool(python, models, options, workers=int(ray.get("workers") or 2), address=ray.get("address"))
    print(f"reference: {pool.workers} qwen-tts runners on Ray ({ray.get('address') or 'a local cluster'})",
          file=sys.stderr, flush=True)
    pool.start()
    return pool


def start_ray_candidate(spec: CandidateSpec, setup: Setup, ray: dict, run_tag: str):
    """The candidate in a Ray actor (difftest.scale.ray_candidate): its engine on whichever node has room."""
    from ..scale.ray_candidate import RayCandidate

    if not spec.is_.started_here:
        raise BadInput("--ray-candidate: a URL candidate is already served elsewhere; start vllm-omni, "
                       "vllm-omni-offline or cpu-engine in the actor instead")
    gpus = float(ray.get("candidate_gpus") or 0)
    print(f"candidate: {spec.label} in a Ray actor ({gpus:g} GPU)", file=sys.stderr, flush=True)
    return RayCandidate(spec, setup, address=ray.get("address"), gpus=gpus, run_tag=run_tag)


def resolve_models(suite: Suite, opts: RunOptions, python: Path) -> list[str]:
    if opts.reference.models:
        return list(opts.reference.models)
    if suite.model in TINY_MODELS:
        return suite_models(suite, ResultStore(opts.store).root, python)
    if not Path(suite.model).expanduser().is_dir() and not hf_cached(suite.model):
        raise BadInput(f"{suite.path}: model: {suite.model!r} is no folder and not in the local Hugging Face cache "
                       f"(nothing is downloaded: fetch it first, or pass --reference-model FOLDER)")
    return [suite.model]


def announce(info: dict, stream=sys.stderr) -> None:
    """Say what the candidate is, in the words a reader must not mistake."""
    what = info.get("engine") or info.get("label") or "candidate"
    print(f"candidate: {what}", file=stream, flush=True)
