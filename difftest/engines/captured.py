"""What a result's capture holds, read once into types (issue 59, item 4): the talker's side
(capture schema v2), the talker's input and assembled prompt (v3), the talker's own top-k, and
the reference's bf16 twins. Results keep these as named arrays in `Result.extra` (the file's
layout, engines/capture.py); every consumer reads them here, by attribute."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..compare.own_margins import OwnTopK
from ..family import CODEBOOKS
from ..results import Result
from .capture import INPUT, PROMPT, PROMPT_CACHED, PROMPT_LABELS

SPEAKER_BF16 = "speaker_embedding_bf16"  # the reference's x-vector in bf16 (qwen-tts's runner)
REF_CODES_BF16 = "ref_codes_bf16"  # the reference's encoding of the voice in bf16


@dataclass(frozen=True)
class TalkerStage:
    """The talker's side of a candidate's capture."""
    ref_codes: np.ndarray  # (frames, CODEBOOKS): the reference codes the talker was prompted with
    tokens: np.ndarray  # its codebook-0 tokens; the last (EOS, or the cap's) never becomes a frame
    reserved: int  # prompt positions the engine reserved
    built: int  # prompt rows the builder made
    ref_code_len: int  # the request's ref_code_len, which the hand-off trims to


@dataclass(frozen=True)
class Captured:
    talker: TalkerStage | None  # None: not captured (schema v1, or no capture)
    inputs: dict | None  # the talker's input, field -> array (a capture's, or the reference's); None: not recorded
    own_topk: OwnTopK | None  # the talker's own top-k per step; None: not captured
    ref_codes_bf16: np.ndarray | None


def _talker(extra: dict) -> TalkerStage | None:
    if "talker_tokens" not in extra:
        return None
    prompt = [int(x) for x in np.asarray(extra["talker_prompt"]).reshape(-1)]
    return TalkerStage(np.asarray(extra["talker_ref_codes"], np.int64).reshape(-1, CODEBOOKS),
                       np.asarray(extra["talker_tokens"], np.int64).reshape(-1), prompt[0], prompt[1], prompt[2])


def _inputs(extra: dict) -> dict | None:
    if any(n not in extra for n in INPUT):
        return None
    out = {n: np.asarray(extra[n]) for n in INPUT}
    if SPEAKER_BF16 in extra:
        out[SPEAKER_BF16] = np.asarray(extra[SPEAKER_BF16], np.float32)
    if all(n in extra for n in PROMPT):  # the assembled prompt (optional)
        out |= {n: np.asarray(extra[n]) for n in (*PROMPT, PROMPT_LABELS, PROMPT_CACHED) if n in extra}
    return out


def _own_topk(extra: dict) -> OwnTopK | None:
    if extra.get("talker_topk_ids") is None or extra.get("talker_tokens") is None:
        return None
    ids = np.asarray(extra["talker_topk_ids"], np.int64)
    if ids.ndim != 2 or not len(ids):
        return None
    return OwnTopK(ids, np.asarray(extra["talker_topk_logprobs"], np.float32),
                   np.asarray(extra["talker_tokens"], np.int64).reshape(-1))


NOTHING = Captured(None, None, None, None)


def captured(r: Result | None) -> Captured:
    """`r`'s capture, typed; read from `r.extra` the first time and kept on the result (a result's
    arrays are not changed once read)."""
    if r is None:
        return NOTHING
    view = r.__dict__.get("_captured")
    if view is None:
        x = r.extra
        view = Captured(_talker(x), _inputs(x), _own_topk(x), x.get(REF_CODES_BF16))
        r.__dict__["_captured"] = view
    return view
