"""Qwen3-Omni's talker -> code2wav hand-off, captured (issue 60): the codes each tagged request handed
to code2wav, in `<tag>.npz` as for Qwen3-TTS (contract 5): `codes` (F, 16), empty `ref_codes` (a
Qwen3-Omni request clones no voice), `chunk_frames`, `handoff`.

vLLM-Omni 0.30.0's `stage_input_processors/qwen3_omni.py` names the functions as Qwen3-TTS's module
does and runs them in the talker's stage process. Its async chunks carry earlier frames as left
context (`meta.left_context_size`: the initial chunk's frames, then up to 25): those are not new
frames and not a reference, so each chunk adds only the frames past its context. The tag is the
talker's `sampling_params.extra_args.difftest_tag` (difftest/engines/omni_chat.py sends it).
Signatures and return values are unchanged; a failure to capture is logged once and the request goes on."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from runners.vllm_omni.difftest_capture.difftest_capture.hooks import (
    MARK,
    NUM_CODE_GROUPS,
    OPEN_REQUESTS,
    _get,
    _int,
    _numpy,
    _wrap_handoff,
    frames_of,
    request_id,
    request_tag,
)

MODULE = "vllm_omni.model_executor.stage_input_processors.qwen3_omni"


class OmniCapture:
    def __init__(self, store):
        self.store = store
        self.lock = threading.Lock()
        self.streams: OrderedDict[str, dict] = OrderedDict()  # request id -> its chunks so far

    def _file(self, tag: str, request, frames: list, chunks: list, handoff: str) -> None:
        """The frames handed over so far, beside the talker's own tokens (the request's output ids at the
        hand-off: codebook 0 of every frame it generated, and the last token, which never becomes one),
        so the tester compares what code2wav got with what the talker made. The prompt is not observed
        here: 0 reserved and built positions say so (no prompt check), -1 no reference."""
        codes = np.concatenate(frames) if frames else np.zeros((0, NUM_CODE_GROUPS), np.int64)
        empty = np.zeros((0, NUM_CODE_GROUPS), np.int64)
        tokens = np.array(list(_get(request, "output_token_ids") or []), np.int64)
        self.store.update(tag, replace=True, codes=codes, ref_codes=empty, chunk_frames=np.array(chunks, np.int64),
                          handoff=np.array(handoff), talker_tokens=tokens, talker_ref_codes=empty,
                          talker_prompt=np.array([0, 0, -1], np.int64))

    def full_payload(self, request, payload) -> None:
        tag = request_tag(request)
        if tag is None:
            return
        frames = frames_of(_numpy(_get(payload, "codes", "audio"), np.int64).reshape(-1))
        self._file(tag, request, [frames], [len(frames)], "full_payload")

    def async_chunk(self, request, payload) -> None:
        rid = request_id(request)
        with self.lock:
            state = self.streams.get(rid)
            if state is None:
                tag = request_tag(request)
                if tag is None:
                    return
                state = self.streams[rid] = {"tag": tag, "frames": [], "chunks": []}
                while len(self.streams) > OPEN_REQUESTS:
                    self.streams.popitem(last=False)
        flat = _numpy(_get(payload, "codes", "audio"), np.int64).reshape(-1)
        if flat.size:
            frames = frames_of(flat)
            context = _int(_get(payload, "meta", "left_context_size"))
            state["frames"].append(frames[context:])
            state["chunks"].append(len(frames) - context)
        finished = bool(_int(_get(payload, "meta", "finished")))
        if flat.size or finished:
            self._file(state["tag"], request, state["frames"], state["chunks"], "async_chunk")
        if finished:
            with self.lock:
                self.streams.pop(rid, None)


def wrap(module, capture: OmniCapture) -> list[str]:
    """Wrap the Qwen3-Omni hand-off functions in `module`; returns what was wrapped."""
    done = []
    for name, observe in (
        ("talker2code2wav_full_payload", lambda a, r: capture.full_payload(a.get("request"), r)),
        ("talker2code2wav_async_chunk", lambda a, r: capture.async_chunk(a.get("request"), r)),
    ):
        fn = getattr(module, name, None)
        if fn is None or getattr(fn, MARK, False):
            continue
        setattr(module, name, _wrap_handoff(fn, observe))
        done.append(f"qwen3_omni.{name}")
    return done
