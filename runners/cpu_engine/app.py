"""Building one CPU test engine: its identity, its batch engine, its HTTP server.

Shared by `python -m runners.cpu_engine` (one engine a process) and
`python -m runners.cpu_engine.multi` (several engines sharing loaded models).
"""

from __future__ import annotations

import json
import os

from runners.cpu_engine import ENGINE_NAME, ENGINE_VERSION, LABEL, defects
from runners.cpu_engine.api import ModelInfo, VoiceStore
from runners.reference.environment import host, package_versions, repo_commit

FAIL_ON_ENV = "DIFFTEST_CPU_ENGINE_FAIL_ON"  # test hook: inputs containing it raise inside the engine
CAPTURE_ENV = "DIFFTEST_CAPTURE_DIR"


def subtalker_from_json(text: str):
    from runners.cpu_engine.engine import SubtalkerSampling

    try:
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("not an object")
        return SubtalkerSampling(**d)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"runners.cpu_engine: --subtalker-sampling {text!r}: {e}") from None


def model_infos(checkpoints: dict) -> dict[str, ModelInfo]:
    return {task: ModelInfo(task, frozenset(c.languages()), frozenset(c.speakers())) for task, c in checkpoints.items()}


def identity(checkpoints: dict, defect: str | None, *, max_batch: int, batch_window_ms: float,
             subtalker, capture_dir: str | None, talker_dtype: str = "float32", talker_capture: str = "full") -> dict:
    """What this engine is and where it came from (GET /v1/engine)."""
    return {
        "engine": ENGINE_NAME,
        "label": LABEL,
        "not_vllm_omni": True,
        "engine_version": ENGINE_VERSION,
        "defect": defect,
        "defect_info": defects.describe(defect),
        "serves": "qwen-tts (official package) behind vLLM-Omni's speech API, with dynamic batching "
                  "and a vLLM-Omni-like talker->vocoder hand-off",
        "models": {c.task: {"model": c.spec, "path": str(c.path), "sha256": c.sha256, "tts_model_type": c.model_type}
                   for c in checkpoints.values()},
        "versions": package_versions(),
        "device": "cpu",
        "dtype": talker_dtype,  # the talker's and the encoders'; the vocoder's is float32
        "vocoder_dtype": "float32",
        "threads": 1,
        "batching": {"max_batch": max_batch, "batch_window_ms": batch_window_ms,
                     "sampled_requests": "batched, one generator (defect)" if defect == "shared-rng"
                     else "one at a time, each seeded with its own seed"},
        "subtalker_sampling": vars(subtalker),
        "vocoder": {"chunk_frames": defects.DECODE_CHUNK_FRAMES,
                    "left_context_frames": defects.DEFECT_LEFT_CONTEXT if defect == "chunk-boundary"
                    else defects.DECODE_LEFT_CONTEXT},
        "capture_dir": capture_dir,
        "talker_capture": talker_capture,
        "commit": repo_commit(),
        "host": host(),
        "pid": os.getpid(),
    }


def build_server(checkpoints, defect, *, host_name, port, max_batch, batch_window_ms, subtalker, qwen=None,
                 capture_dir=None, talker_dtype="float32", talker_capture="full"):
    """An EngineServer (not started) for one defect; `qwen` shares already loaded models."""
    from runners.cpu_engine.engine import BatchEngine
    from runners.cpu_engine.server import EngineServer

    engine = BatchEngine(checkpoints, defect=defect, subtalker=subtalker, qwen=qwen,
                         fail_on=os.environ.get(FAIL_ON_ENV) or None, talker_dtype=talker_dtype,
                         talker_capture=talker_capture)
    engine.load()
    ident = identity(checkpoints, defect, max_batch=max_batch, batch_window_ms=batch_window_ms,
                     subtalker=subtalker, capture_dir=capture_dir, talker_dtype=talker_dtype,
                     talker_capture=talker_capture)
    server = EngineServer(engine.run_batch, model_infos(checkpoints), identity=ident, defect=defect,
                          host=host_name, port=port, max_batch=max_batch, batch_window_ms=batch_window_ms,
                          capture_dir=capture_dir, voices=VoiceStore())
    return server, engine


