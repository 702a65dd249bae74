"""Teacher-forced scoring through the reference runner's `score` job, cached in the result store.

A score depends on the segment (text, voice, decode settings), the code stream,
the reference codes the talker is conditioned on, whether the stream ended with
EOS, the reference configuration (the runner's fingerprint: qwen-tts,
checkpoint, dtype, device) and the scoring code's version (`score_version` in
the runner's announcement). Files are named by the hash of all of it, under
`<store>/scores-<config key>/`, so the same candidate codes are scored once
across runs and changed codes never reuse a stale score.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InfraError
from ..family import CODEBOOKS
from ..process.runner_client import RunnerProcess, item_answers
from ..results import CorruptResult, ResultStore, _ext, atomic_write
from ..scores import ScoreFile, read_scores


@dataclass
class ScoreItem:
    segment: object  # difftest.suites.suite.Segment
    codes: np.ndarray  # (T, 16), the stream to score
    ref_codes: np.ndarray | None  # condition the talker on these (the candidate's own); None: the voice's own
    ended_by_eos: bool  # the stream stopped with EOS (score the stop too), not at the token cap


class Scorer:
    def __init__(self, runner: RunnerProcess, store_root: str | Path, timeout: float, dtype: str | None = None):
        """`dtype`: qwen-tts in that dtype scores instead of the runner's own (the measured null's noise
        model scores the null's streams in its own numerics too)."""
        self.runner, self.timeout, self.store_root = runner, timeout, Path(store_root)
        if "score_version" not in runner.hello:
            raise InfraError("the reference runner has no score job (an older runner?): restart it from this checkout")
        # the reference configuration and the scoring code's version both decide a score
        fingerprint = {**(runner.hello.get("fingerprint") or {}), "score_version": runner.hello["score_version"]}
        self.dtype = None if dtype in (None, fingerprint.get("dtype")) else dtype
        if self.dtype:
            fingerprint["dtype"] = self.dtype
        self.salt = ResultStore.config_key(fingerprint)
        self.dir = ResultStore(Path(store_root).resolve()).config_dir("scores", fingerprint)

    def key(self, it: ScoreItem) -> str:
        h = hashlib.sha256(f"{self.salt}|{it.segment.hash}|{it.ended_by_eos}|{it.ref_codes is not None}".encode())
        for a in (it.codes, np.zeros((0, CODEBOOKS)) if it.ref_codes is None else it.ref_codes):
            a = np.ascontiguousarray(a, dtype=np.int64)
            h.update(str(a.shape).encode())
            h.update(a.tobytes())
        return h.hexdigest()

    def score(self, items: dict[str, ScoreItem]) -> dict[str, ScoreFile | str]:
        """name -> ScoreFile, or the error message that stands for it."""
        done: dict[str, ScoreFile | str] = {}
        todo = []
        for name, it in items.items():
            stem = self.dir / f"{it.segment.id}.{self.key(it)[:16]}"
            try:
                done[name] = read_scores(_ext(stem, ".json"))
                continue
            except CorruptResult:
                pass
            src = _ext(stem, ".in.npz")
            buf = io.BytesIO()
            np.savez(buf, codes=np.asarray(it.codes, np.int64),
                     ref_codes=np.zeros((0, CODEBOOKS), np.int64) if it.ref_codes is None else np.asarray(it.ref_codes, np.int64))
            atomic_write(src, buf.getvalue())
            todo.append({"name": name, "segment": it.segment.to_job(), "input": str(src), "out": str(stem),
                         "condition": "voice" if it.ref_codes is None else "given",
                         "ended_by_eos": bool(it.ended_by_eos), **({"dtype": self.dtype} if self.dtype else {})})
        if not todo:
            return done
        return {**done, **item_answers(self.runner, "score", todo, self.timeout, read_scores, "while scoring")}
