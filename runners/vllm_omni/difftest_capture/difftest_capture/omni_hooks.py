"""Qwen3-Omni's talker -> code2wav hand-off, captured (issue 60): the codes each tagged request handed
to code2wav, in `<tag>.npz` as for Qwen3-TTS (contract 5): `codes` (F, 16), empty `ref_codes` (a
Qwen3-Omni request clones no voice), `chunk_frames`, `handoff`.

vLLM-Omni 0.30.0's `stage_input_processors/qwen3_omni.py` names the functions as Qwen3-TTS's module
does and runs them in the talker's stage process. Its async chunks carry earlier frames as left
context (`meta.left_context_size`: the initial chunk's frames, then up to 25): those are not new
frames and not a reference, so each chunk adds only the frames past its context. The tag is the
talker's `sampling_params.extra_args.difftest_tag` (difftest/engines/omni_chat.py sends it).
The talker's input (capture schema v3's `input_*`, difftest.engines.capture.chat_turn_inputs): on a
request's first prefill, `talker_preprocess_prefill` builds its prompt from the thinker's output; the
chat turn it read (`_thinker_to_talker_prefill`'s `input_ids`) and the speaker id its assistant part
was built with (`_get_talker_assistant_parts`, the method transformers' reference reads too) are filed
by request id, and the hand-off's file takes them.

Signatures and return values are unchanged; a failure to capture is logged once and the request goes on."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from difftest.engines.capture import INPUT, chat_turn_inputs
from runners.vllm_omni.difftest_capture.difftest_capture.hooks import (
    MARK,
    NUM_CODE_GROUPS,
    OPEN_REQUESTS,
    _get,
    _int,
    _numpy,
    _warn_once,
    _wrap_handoff,
    frames_of,
    request_id,
    request_ids,
    request_tag,
)

MODULE = "vllm_omni.model_executor.stage_input_processors.qwen3_omni"
MODEL_MODULE = "vllm_omni.model_executor.models.qwen3_omni.qwen3_omni"
MODEL_METHODS = ("_thinker_to_talker_prefill", "_get_talker_assistant_parts", "talker_preprocess_prefill")
_prefill = threading.local()  # .rec: what the prefill in progress on this thread used


class OmniCapture:
    def __init__(self, store):
        self.store = store
        self.lock = threading.Lock()
        self.streams: OrderedDict[str, dict] = OrderedDict()  # request id -> its chunks so far
        self.filed: OrderedDict[str, None] = OrderedDict()  # the talker worker: requests whose input is filed

    def talker_input(self, model, payload: dict, rec: dict) -> None:
        """After `talker_preprocess_prefill`: the first prefill of a request files what its prompt was
        made of (a chunked prefill's later steps and a resume build it again: not filed twice)."""
        rid = payload.get("request_id") or payload.get("req_id")
        if not rid or str(rid) in self.filed:
            return
        self.filed[str(rid)] = None
        while len(self.filed) > OPEN_REQUESTS:
            self.filed.popitem(last=False)
        if "text_ids" not in rec or "speaker_id" not in rec:
            seen = ", ".join(sorted(rec)) or "nothing"
            arrays = {"input_missing": np.array(f"the talker's prefill built no assistant part (seen: {seen})")}
        else:
            cfg = model.config.talker_config
            arrays = chat_turn_inputs(rec["text_ids"], [cfg.codec_nothink_id, cfg.codec_think_bos_id,
                                                        cfg.codec_think_eos_id], rec["speaker_id"])
        self.store.file_talker(str(rid), **arrays)

    def _inputs(self, request) -> dict:
        """The talker's input the worker filed for this request (used up), or why there is none."""
        found = self.store.take_talker(request_ids(request))
        if found is None:
            return {"input_missing": np.array(f"no talker input filed for request "
                                              f"{' / '.join(request_ids(request)) or '?'}")}
        # the assembled prompt's rows are not observed on this path: only the ingredients (no input_prompt_missing)
        return {k: v for k, v in found.items() if k in INPUT or k == "input_missing"}

    def _file(self, tag: str, request, frames: list, chunks: list, handoff: str, inputs: dict) -> None:
        """The frames handed over so far, beside the talker's own tokens (the request's output ids at the
        hand-off: codebook 0 of every frame it generated, and the last token, which never becomes one),
        so the tester compares what code2wav got with what the talker made. The prompt is not observed
        here: 0 reserved and built positions say so (no prompt check), -1 no reference."""
        codes = np.concatenate(frames) if frames else np.zeros((0, NUM_CODE_GROUPS), np.int64)
        empty = np.zeros((0, NUM_CODE_GROUPS), np.int64)
        tokens = np.array(list(_get(request, "output_token_ids") or []), np.int64)
        self.store.update(tag, replace=True, codes=codes, ref_codes=empty, chunk_frames=np.array(chunks, np.int64),
                          handoff=np.array(handoff), talker_tokens=tokens, talker_ref_codes=empty,
                          talker_prompt=np.array([0, 0, -1], np.int64), **inputs)

    def full_payload(self, request, payload) -> None:
        tag = request_tag(request)
        if tag is None:
            return
        frames = frames_of(_numpy(_get(payload, "codes", "audio"), np.int64).reshape(-1))
        self._file(tag, request, [frames], [len(frames)], "full_payload", self._inputs(request))

    def async_chunk(self, request, payload) -> None:
        rid = request_id(request)
        with self.lock:
            state = self.streams.get(rid)
            if state is None:
                tag = request_tag(request)
                if tag is None:
                    return
                state = self.streams[rid] = {"tag": tag, "frames": [], "chunks": [], "inputs": self._inputs(request)}
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
            self._file(state["tag"], request, state["frames"], state["chunks"], "async_chunk", state["inputs"])
        if finished:
            with self.lock:
                self.streams.pop(rid, None)


def _recording(original, record):
    """`original` (a method of the model), telling the prefill in progress what it was called with."""
    def method(self, *args, **kwargs):
        rec = getattr(_prefill, "rec", None)
        if rec is not None:
            try:
                record(rec, args, kwargs)
            except Exception:
                _warn_once("omni-input", "could not read the Qwen3-Omni talker's prompt input")
        return original(self, *args, **kwargs)

    setattr(method, MARK, True)
    return method


def _prefill_scope(original, capture: OmniCapture):
    def method(self, input_ids, input_embeds, payload, *args, **kwargs):
        _prefill.rec = rec = {}
        try:
            out = original(self, input_ids, input_embeds, payload, *args, **kwargs)
        finally:
            _prefill.rec = None
        try:
            capture.talker_input(self, payload, rec)
        except Exception:
            _warn_once("omni-input", "could not file the Qwen3-Omni talker's prompt input")
        return out

    setattr(method, MARK, True)
    return method


def _ids(t) -> np.ndarray:
    return np.asarray(t.detach().to("cpu") if hasattr(t, "detach") else t, np.int64).reshape(-1)


def wrap_model(cls, capture: OmniCapture) -> list[str]:
    """Wrap the talker's prefill on vLLM-Omni's Qwen3-Omni model class; returns what was wrapped."""
    done = []
    for name, make in zip(MODEL_METHODS, (
        lambda f: _recording(f, lambda rec, a, kw: rec.__setitem__(
            "text_ids", _ids(kw["input_ids"] if "input_ids" in kw else a[3]))),
        lambda f: _recording(f, lambda rec, a, kw: rec.__setitem__(
            "speaker_id", int(kw["speaker_id"] if "speaker_id" in kw else a[2]))),
        lambda f: _prefill_scope(f, capture),
    )):
        fn = getattr(cls, name, None)
        if fn is None or getattr(fn, MARK, False):
            continue
        setattr(cls, name, make(fn))
        done.append(f"{cls.__name__}.{name}")
    return done


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
