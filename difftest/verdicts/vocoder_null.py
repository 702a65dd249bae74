"""The vocoder's measured null: what a correct vocoder in the candidate's dtype moves from qwen-tts's.

A candidate whose vocoder runs in another dtype than the reference's (production's vLLM-Omni
deploy: stage 1 in bf16) cannot match qwen-tts's float32 vocoder within the float tiers. The
allowance is measured, not invented: qwen-tts's own vocoder decodes the candidate's codes again
in the candidate's vocoder dtype (the reference runner's `decode` item `dtype`), and per chunk the
candidate's audio may lie at most `vocoder_null.margin` times as far from qwen-tts's float32 decode
as that null does, in RMS of the difference and in log-mel distance both. docs/verdicts.md, "The
vocoder's measured null", has the measurements behind the margin.
"""

from __future__ import annotations

import numpy as np

DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "torch.float32": "float32",
               "bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
               "float16": "float16", "fp16": "float16", "half": "float16", "torch.float16": "float16"}
METRICS = ("rms", "logmel")  # both must stay within margin x the null's


def dtype_name(value) -> str:
    return DTYPE_NAMES.get(str(value).strip().lower(), str(value))


def vocoder_dtype(identity: dict | None, declared: str | None, reference_dtype: str) -> tuple[str, str]:
    """The candidate vocoder's dtype and where that came from: declared (--candidate-vocoder-dtype);
    a vLLM-Omni overlay's last stage (the vocoder: Qwen3-TTS's stage 1, Qwen3-Omni's code2wav, stage 2);
    the engine's identity (the CPU test engine's --vocoder-dtype); else the reference's own (no null:
    judged as exact)."""
    if declared:
        return dtype_name(declared), "declared (--candidate-vocoder-dtype)"
    identity = identity or {}
    stages = [s for s in (identity.get("overlay") or {}).get("stages") or [] if isinstance(s.get("stage_id"), int)]
    last = max(stages, key=lambda s: s["stage_id"], default=None)
    if last is not None and last.get("dtype"):
        return dtype_name(last["dtype"]), f"the deploy overlay's stage {last['stage_id']}"
    if identity.get("vocoder_dtype"):
        return dtype_name(identity["vocoder_dtype"]), "the engine's identity"
    return reference_dtype, "not declared: the reference's"


def _ratio(cand: np.ndarray, null: np.ndarray) -> np.ndarray:
    """cand / null per chunk: 0 where both are 0, infinity where only the null is."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(null > 0, cand / np.where(null > 0, null, 1.0), np.where(cand > 0, np.inf, 0.0))
    return r


def ratios(cand_chunks, null_chunks) -> dict[str, np.ndarray]:
    """Per metric, the candidate's distance from the float32 decode over the null's, per chunk
    (ChunkMetrics of the float32 decode against the candidate, and against the null)."""
    return {m: _ratio(getattr(cand_chunks, m), getattr(null_chunks, m)) for m in METRICS}


def excused(cand, null, margin: float) -> np.ndarray:
    """Per chunk, whether the candidate's audio (Audio: float32 decode against the candidate) stays
    within `margin` times the null's distance (Audio: float32 decode against the null) in every
    metric. None excused where the two do not cover the same chunks, or a log-mel was not computed
    on one side only (a side all within close_max_abs has nothing to excuse or to allow)."""
    n = len(cand.tiers)
    if len(null.tiers) != n or cand.len_a != null.len_a:
        return np.zeros(n, bool)
    r = ratios(cand.chunks, null.chunks)
    if cand.logmel_computed != null.logmel_computed:
        r["logmel"] = np.full(n, np.inf if cand.logmel_computed else 0.0)
    return np.logical_and.reduce([r[m] <= margin for m in METRICS])


def to_json(cand, null, dtype: str, margin: float, ok: np.ndarray) -> dict:
    """report.json `comparisons.vocoder_null`: the null against the float32 decode, per chunk, and
    the candidate's ratio to it."""
    r = ratios(cand.chunks, null.chunks) if len(null.tiers) == len(cand.tiers) else {}
    return {**null.to_json(), "dtype": dtype, "margin": margin,
            "ratio": {m: [float(x) if np.isfinite(x) else None for x in v] for m, v in r.items()},
            "excused": [int(i) for i in np.flatnonzero(ok & (cand.tiers > 2))]}
