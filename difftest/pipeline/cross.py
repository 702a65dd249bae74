"""Cross-decodes: the candidate's codes through qwen-tts's vocoder (on its own reference codes,
on a co-batched request's, or in the candidate vocoder's dtype: the vocoder's measured null)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import BadInput, InfraError
from ..process.runner_client import RunnerProcess, item_answers
from ..results import CorruptResult, Result, ResultStore, _ext, atomic_write, read_result
from ..suites.suite import content_hash
from ..verdicts import vocoder_null

if TYPE_CHECKING:
    from .options import RunOptions


class Vocoder:
    """Cross-decodes through the reference runner's `decode` job. Each is kept in the store (a
    later run of the same codes through the same reference vocoder loads no model for it) and
    copied into the run's own folder, which the report names."""

    def __init__(self, runner: RunnerProcess, out: Path, timeout: float, store_root: Path, dtype: str | None = None):
        self.runner, self.out, self.timeout = runner, out, timeout
        # A decode is reused only from the same reference vocoder (checkpoint, dtype, device, threads,
        # runner version: the fingerprint) and the same input codes (the key). `dtype`: qwen-tts's
        # vocoder in another dtype than the runner's own (the vocoder's null), under that fingerprint.
        fingerprint = runner.hello.get("fingerprint") or {}
        self.dtype = dtype if dtype != fingerprint.get("dtype") else None
        if self.dtype is not None:
            if self.dtype not in runner.hello.get("decode_dtypes", ()):
                raise InfraError(f"the reference runner cannot decode in {self.dtype} (an older runner?): restart it "
                                 f"from this checkout")
            fingerprint = {**fingerprint, "dtype": self.dtype}
        self.salt = content_hash(fingerprint)
        self.kept = ResultStore(store_root).config_dir("cross", fingerprint)
        self.out.mkdir(parents=True, exist_ok=True)

    def _copy(self, name: str, key: str) -> Result:
        """The kept decode, copied into the run folder and read from there."""
        src, dst = self.kept / f"{name}.{key}", self.out / f"{name}.{key}"
        for ext in (".npz", ".json"):  # the sidecar last: it commits to the npz
            atomic_write(_ext(dst, ext), _ext(src, ext).read_bytes())
        return read_result(_ext(dst, ".json"))

    def decode(self, items: dict[str, tuple[str, np.ndarray, np.ndarray]]) -> dict[str, Result | str]:
        """name -> (segment id, codes, ref codes); returns name -> Result, or an error message.

        Outputs are named by the content of their inputs, so a re-run reuses them
        and changed codes never reuse a stale decode."""
        done: dict[str, Result | str] = {}
        todo, keys = [], {}
        for name, (sid, codes, ref) in items.items():
            key = keys[name] = _codes_key(codes, ref, self.salt)[:16]
            for read in (lambda: read_result(_ext(self.out / f"{name}.{key}", ".json")), lambda: self._copy(name, key)):
                try:
                    done[name] = read()
                    break
                except (CorruptResult, FileNotFoundError):
                    pass
            if name in done:
                continue
            stem = self.kept / f"{name}.{key}"
            src = _ext(stem, ".in.npz")
            buf = io.BytesIO()
            np.savez(buf, codes=codes, ref_codes=ref)
            atomic_write(src, buf.getvalue())
            todo.append({"name": name, "input": str(src), "out": str(stem), "segment_id": sid,
                         **({"dtype": self.dtype} if self.dtype else {})})
        if not todo:
            return done
        answers = item_answers(self.runner, "decode", todo, self.timeout, read_result, "during cross-decode")
        for name, got in answers.items():
            if isinstance(got, Result):
                got = self._copy(name, keys[name])
            done[name] = got
        return done


def _codes_key(codes: np.ndarray, ref: np.ndarray, salt: str = "") -> str:
    h = hashlib.sha256(salt.encode())
    for a in (codes, ref):
        a = np.ascontiguousarray(a, dtype=np.int64)
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def vocoder_numerics(engine: dict, opts: RunOptions, runner, out: Path,
                      store_root: Path) -> tuple[dict, Vocoder | None]:
    """The candidate vocoder's dtype (report.json `vocoder_numerics`), and qwen-tts's vocoder in it
    where that is not the reference's: the vocoder's measured null (difftest/verdicts/vocoder_null.py)."""
    ref_dtype = (runner.hello.get("fingerprint") or {}).get("dtype")
    dtype, source = vocoder_null.vocoder_dtype(engine, opts.candidate_vocoder_dtype, ref_dtype)
    info = {"dtype": dtype, "from": source, "reference_dtype": ref_dtype, "null": None}
    if dtype == ref_dtype:
        return info, None
    if dtype not in runner.hello.get("decode_dtypes", ()):
        raise BadInput(f"the candidate's vocoder runs in {dtype} ({source}): qwen-tts's vocoder cannot decode in it, "
                       f"so no measured allowance exists; serve the vocoder in {ref_dtype} or bfloat16")
    info["null"] = f"qwen-tts's vocoder in {dtype} on the candidate's codes"
    return info, Vocoder(runner, out / "results" / "cross", opts.reference.timeout, store_root, dtype=dtype)


def null_for(null: Result | None, ctrl: Result | None, numerics: dict) -> dict:
    """The vocoder's null for the candidate at 1 judged alone: the decode of the candidate's codes at
    N, where the codes at 1 are the same."""
    if null is None or ctrl is None or not ctrl.has_codes or not (np.array_equal(null.codes, ctrl.codes)
                                                                  and np.array_equal(null.ref_codes, ctrl.ref_codes)):
        return {}
    return {"vocoder_null": null, "vocoder_dtype": numerics["dtype"]}
