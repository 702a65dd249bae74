"""Teacher-forced score files: what qwen-tts thought of a code stream (the reference runner's `score` job).

`<stem>.npz` holds, per FIELD, a (T, 16) array over the stream's frames and
codebooks; `<stem>.json` is the sidecar, written last, with the npz's sha256
(the commit marker, as for results), the stop row (`eos`: the same fields for
the EOS token after the last frame, or null when the stream ended at the token
cap), the decode settings the processors used and what the talker was
conditioned on. Numpy only: the runner writes these files, difftest reads them.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .engines.capture import CaptureError, member_sizes
from .results import CorruptResult, _ext, atomic_write, read_sidecar

FORMAT = "difftest.score/1"
# logprob .. in_support: the forced token under the processed logits (with the temperature when sampling).
# sample_logprob, expected_logprob, logprob_var: under the distribution decoding draws from (truncated to
# the support, renormalised): the token's log-probability, its expectation (minus the entropy) and its
# variance there; 0 at greedy positions. Their sums make the sampling test (difftest/verdicts/sampling.py).
# support_gap: how far (nats) a sampled token outside the support lies below the support's least likely
# token (0 inside, and at greedy positions): a bf16 engine's top-k boundary differs by near-ties.
FIELDS = ("logprob", "rank", "top1", "top1_logprob", "margin", "in_support",
          "sample_logprob", "expected_logprob", "logprob_var", "support_gap")
# Sampled streams only (absent where nothing was sampled; NaN at a greedy site): the sampler bank
# (difftest/sampler_bank.py), (T, 16, A) over its alternatives: alt_llr, alt_kl, alt_var, alt_outside;
# temp_loglik (T, 16, G) over the temperature grid; mass_above (T, 16). runners/reference/scoring.py says
# what each is; `ScoreFile.bank` names the alternatives, which apply per site, and the grid.
SAMPLER_FIELDS = ("alt_llr", "alt_kl", "alt_var", "alt_outside", "temp_loglik", "mass_above")
DTYPES = {"alt_llr": np.float32, "alt_kl": np.float32, "alt_var": np.float32, "alt_outside": np.float32,
          "temp_loglik": np.float32, "mass_above": np.float32,
          "logprob": np.float32, "rank": np.int64, "top1": np.int64, "top1_logprob": np.float32,
          "margin": np.float32, "in_support": np.bool_, "sample_logprob": np.float32,
          "expected_logprob": np.float32, "logprob_var": np.float32, "support_gap": np.float32}


@dataclass
class ScoreFile:
    segment_id: str
    segment_hash: str
    arrays: dict  # FIELD -> (T, 16)
    eos: dict | None = None
    settings: dict = field(default_factory=dict)
    conditioning: dict = field(default_factory=dict)  # {"ref_codes": "given" | "voice" | "none", "frames": R}
    provenance: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    source: Path | None = None
    # the sampler bank: {"alternatives": [...], "sites": {SITE: {"applicable": [...], "temperature_grid": [...]}}}
    bank: dict | None = None

    @property
    def frames(self) -> int:
        return int(self.arrays["rank"].shape[0])

    @property
    def gap(self) -> np.ndarray:
        """How much less likely the forced token is than the top-1, in nats (0 where it is the top-1)."""
        return np.maximum(self.arrays["top1_logprob"] - self.arrays["logprob"], 0.0)


def write_scores(stem: str | Path, s: ScoreFile) -> Path:
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **{f: np.asarray(s.arrays[f], DTYPES[f]) for f in FIELDS + SAMPLER_FIELDS if f in s.arrays})
    blob = buf.getvalue()
    npz = _ext(stem, ".npz")
    atomic_write(npz, blob)
    side = _ext(stem, ".json")
    atomic_write(side, json.dumps({
        "format": FORMAT, "segment_id": s.segment_id, "segment_hash": s.segment_hash, "npz": npz.name,
        "npz_sha256": hashlib.sha256(blob).hexdigest(), "frames": s.frames, "eos": s.eos, "settings": s.settings,
        "conditioning": s.conditioning, "provenance": s.provenance, "timings": s.timings, "bank": s.bank,
    }, indent=1, sort_keys=True, allow_nan=False).encode())
    return side


def read_scores(sidecar: str | Path) -> ScoreFile:
    side = Path(sidecar)
    meta, blob = read_sidecar(side, FORMAT)
    npz = side.with_name(str(meta.get("npz")))
    try:
        member_sizes(io.BytesIO(blob), npz)
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            arrays = {f: z[f] for f in FIELDS}
            arrays.update({f: z[f] for f in SAMPLER_FIELDS if f in z.files})
    except CaptureError as e:
        raise CorruptResult(str(e)) from None
    except Exception as e:
        raise CorruptResult(f"{npz}: unreadable or incomplete score npz ({e})") from None
    shapes = {arrays[f].shape for f in FIELDS}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise CorruptResult(f"{npz}: score arrays of unequal or wrong shapes {sorted(shapes)}")
    bank = meta.get("bank")
    sampler = [f for f in SAMPLER_FIELDS if f in arrays]
    if sampler and (len(sampler) != len(SAMPLER_FIELDS) or not isinstance(bank, dict)
                    or any(arrays[f].shape[:2] != next(iter(shapes)) for f in sampler)
                    or arrays["alt_llr"].shape[2:] != (len(bank.get("alternatives") or []),)):
        raise CorruptResult(f"{npz}: sampler-bank arrays incomplete or not shaped as the stream and its bank")
    return ScoreFile(meta["segment_id"], meta["segment_hash"], arrays, meta.get("eos"), meta.get("settings") or {},
                     meta.get("conditioning") or {}, meta.get("provenance") or {}, meta.get("timings") or {},
                     side.resolve(), bank if sampler else None)
