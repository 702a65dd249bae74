"""The talker -> vocoder hand-off, laid out like vLLM-Omni's (numpy only).

vLLM-Omni moves a batch's codes from the talker stage to the vocoder stage in
three steps (vllm_omni 0.30's Qwen3-TTS talker, utils/mm_outputs.py and
stage_input_processors/qwen3_tts.py):

1. `make_omni_output` (talker.py) builds ONE payload for the whole batch:
   `codes.audio` concatenated along dim 0, `codes.ref` as a list, `meta.*`.
2. `to_payload_element` (utils/mm_outputs.py) takes request `idx`'s part: a
   tensor is sliced by the request's rows, a list is indexed by position with
   the fallback `element[idx] if idx < len(element) else element[0]`.
3. `talker2code2wav_full_payload` (stage_input_processors/qwen3_tts.py)
   prepends the reference codes and records how much left context the
   vocoder must cut (`meta.left_context_size`, the #4421 fix).

The functions below do the same with numpy arrays, so the seed's bug
(#4370) and its relatives can be planted exactly where they lived; the clean
path keeps `codes.ref` batch-aligned, as #4373 does.
"""

from __future__ import annotations

import numpy as np

from difftest.family import CODEBOOKS


def empty_codes() -> np.ndarray:
    return np.zeros((0, CODEBOOKS), np.int64)


def make_omni_output(codes: list[np.ndarray], refs: list[np.ndarray | None], *,
                     stopped_at_max: list[bool] | None = None, ref_leak: bool = False) -> dict:
    """One payload for a batch. `refs[i]` is request i's reference codes (None or empty: none)."""
    if len(codes) != len(refs):
        raise ValueError(f"{len(codes)} code arrays for {len(refs)} references")
    rows = [int(c.shape[0]) for c in codes]
    payload = {
        "codes.audio": np.concatenate(codes, axis=0) if codes else empty_codes(),
        "meta.rows": rows,  # the per-request row counts the runner slices by
        "meta.stopped_at_max": list(stopped_at_max or [False] * len(codes)),
    }
    if ref_leak:
        # vLLM-Omni <= 0.22.0: one slot, overwritten by every request that has a ref,
        # emitted as a length-1 list (`mm["codes"]["ref"] = [ref_code_tensor]`).
        ref_code = None
        for r in refs:
            if r is not None and r.size:
                ref_code = r
        if ref_code is not None:
            payload["codes.ref"] = [ref_code]
            payload["meta.ref_code_len"] = [int(ref_code.shape[0])]
    else:
        # #4373: batch-aligned, one entry per request, an empty placeholder where there is no ref.
        aligned = [r if r is not None and r.size else empty_codes() for r in refs]
        payload["codes.ref"] = aligned
        payload["meta.ref_code_len"] = [int(r.shape[0]) for r in aligned]
    return payload


def pick(element: list, idx: int):
    """vLLM-Omni's by-position lookup, with its fallback (mm_outputs.py:241, #4355)."""
    if not element:
        return None
    return element[idx] if idx < len(element) else element[0]


def to_payload_element(payload: dict, idx: int, *, batch_mixup: bool = False) -> dict:
    """Request `idx`'s part of a batch payload."""
    rows = payload["meta.rows"]
    start = sum(rows[:idx])
    out = {}
    for key, value in payload.items():
        if key == "meta.rows":
            continue
        if key == "codes.audio":
            if batch_mixup:  # runtime_info[0] hard-coded (#1411), request 0's codes for all (#4316)
                out[key] = value[0:rows[0]]
            else:
                out[key] = value[start:start + rows[idx]]
        elif isinstance(value, list):
            out[key] = pick(value, idx)
        else:
            out[key] = value
    return out


def talker2code2wav(element: dict, *, drop_last_at_max: bool = False, trim_key: str = "meta.left_context_size") -> dict:
    """The vocoder's input for one request: reference codes prepended, the trim recorded.

    `trim_key` is where the trim travels; the vocoder reads `meta.left_context_size`
    (a different key reproduces #4421). `drop_last_at_max` plants the off-by-one crop.
    """
    codes = element.get("codes.audio")
    codes = empty_codes() if codes is None else codes
    if drop_last_at_max and element.get("meta.stopped_at_max") and codes.shape[0] > 0:
        codes = codes[:-1]
    ref = element.get("codes.ref")
    ref = empty_codes() if ref is None else ref
    return {
        "codes": np.ascontiguousarray(codes, dtype=np.int64),
        "ref_codes": np.ascontiguousarray(ref, dtype=np.int64),
        "decoder_input": np.ascontiguousarray(np.concatenate([ref, codes], axis=0), dtype=np.int64),
        trim_key: int(ref.shape[0]),  # the length of the reference the vocoder actually gets
    }


def trim_reference(wav: np.ndarray, left_context_frames: int, total_frames: int) -> np.ndarray:
    """Cut the reference part off the decoded waveform, with qwen-tts's float expression
    (`int(ref_len / total_len * len(wav))`, sometimes one sample short of ref_len*1920) so the
    clean engine matches the reference sample for sample."""
    if not left_context_frames:
        return wav
    cut = int(left_context_frames / max(total_frames, 1) * wav.shape[0])
    return wav[cut:]
