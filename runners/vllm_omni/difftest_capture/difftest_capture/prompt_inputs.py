"""What vLLM-Omni's talker prompt is made of, per request: capture schema v3's `input_*` arrays
(difftest/engines/capture.py), observed while `Qwen3TTSPromptEmbedsBuilder.build_prompt_embeds`
runs, from what it really uses, never re-derived from the request:

- the assistant text ids: the batched path's precomputed ids (`_qwen3_tts_text_ids`, copied before
  the builder pops them), else the builder's own tokenizer call on the assistant template;
- the instruction ids and, for in-context clones, the reference text ids: its tokenizer calls on
  the user and reference templates, or the precomputed reference ids it popped;
- the codec prefill (think / no-think, language id) and a custom voice's speaker id: the first
  and, for CustomVoice, third call of its codec embedding (the order of its prompt code);
- the clone's speaker embedding: the row it concatenates between the prefill's and the
  pad/bos codec embeddings (a view of the module's `torch.cat` spots it by identity), in its dtype;
- the reference codes and the streaming mode of an in-context prompt: the arguments of its
  `_generate_icl_prompt`; outside in-context mode, non-streaming is the codec-pad row the
  builder embeds for the whole text (streaming embeds none).

`observe_builder(cls)` wraps the class's method once; the talker's `preprocess` observer takes the
latest recording with `take()` and files it with the request (hooks.Capture.talker_input). A build
that could not be read is a string (the capture's `input_missing`), never a guess.
"""

from __future__ import annotations

import functools
import threading
import time

import numpy as np

from difftest.family import CODEBOOKS
from runners.vllm_omni.difftest_capture.difftest_capture.cost import COST

MARK = "_difftest_inputs"
TEXT_KEY = "_qwen3_tts_text_ids"  # prompt_embeds_builder.PRECOMPUTED_TEXT_IDS_KEY
REF_IDS_KEY = "_qwen3_tts_ref_ids"  # prompt_embeds_builder.PRECOMPUTED_REF_IDS_KEY
ASSISTANT, USER, END = "<|im_start|>assistant\n", "<|im_start|>user\n", "<|im_end|>\n"

_state = threading.local()  # .rec: the build in progress; .done: the last finished build's arrays (or why not)


def _ids(t) -> np.ndarray | None:
    if t is None:
        return None
    if hasattr(t, "detach"):
        t = t.detach().to("cpu").numpy()
    a = np.asarray(t)
    return a.reshape(-1).astype(np.int64) if a.dtype.kind in "iu" else None


class _Recording:
    def __init__(self, info: dict, task_type: str, pad_id: int):
        self.task_type, self.pad_id = task_type, pad_id
        self.text_pre = _ids(info.get(TEXT_KEY))
        self.ref_pre = _ids(info.get(REF_IDS_KEY))
        self.tokenized: list[tuple[str, np.ndarray]] = []
        self.codec: list[tuple[np.ndarray, object, int]] = []  # (ids, the embedding returned, ids' ndim)
        self.speaker = None
        self.icl: dict | None = None

    def cat(self, tensors, out) -> None:
        if len(self.codec) >= 2 and isinstance(tensors, (list, tuple)) and len(tensors) == 3 \
                and tensors[0] is self.codec[0][1] and tensors[2] is self.codec[1][1] and self.speaker is None:
            self.speaker = tensors[1]

    def arrays(self, info: dict) -> dict:
        def template(start: str, end: str):
            return next((ids for text, ids in self.tokenized if text.startswith(start) and text.endswith(end)), None)

        # the builder tokenizes only where the precomputed ids were absent or unusable: its call wins
        text = template(ASSISTANT, ASSISTANT)
        text = self.text_pre if text is None else text
        if text is None or not len(text):
            raise _Unread("no assistant text ids were seen (neither precomputed nor tokenized)")
        if len(self.codec) < 2 or len(self.codec[0][0]) not in (3, 4):
            raise _Unread(f"the codec prefill was not the first codec-embedding call ({len(self.codec)} calls)")
        instruct = template(USER, END)
        out = {"input_text_ids": text, "input_instruct_ids": _empty() if instruct is None else instruct,
               "input_codec_prefill": self.codec[0][0], "input_speaker_id": _empty(),
               "input_ref_text_ids": _empty(), "input_ref_codes": np.zeros((0, CODEBOOKS), np.int64),
               "input_speaker_embedding": np.zeros(0, np.float32), "input_speaker_dtype": np.array("")}
        if self.task_type == "CustomVoice":
            if len(self.codec) < 3 or len(self.codec[2][0]) != 1:
                raise _Unread("the custom voice's speaker id was not the third codec-embedding call")
            out["input_speaker_id"] = self.codec[2][0]
        if self.task_type == "Base":
            if self.speaker is None:
                raise _Unread("the clone's speaker embedding was not seen between the codec prefill and pad/bos")
            out["input_speaker_embedding"] = self.speaker.detach().to("cpu").float().reshape(-1).numpy()
            out["input_speaker_dtype"] = np.array(str(self.speaker.dtype).removeprefix("torch."))
        if self.icl is not None:
            ref = template(ASSISTANT, END)
            ref = self.ref_pre if ref is None and REF_IDS_KEY not in info else ref  # popped: used
            if ref is None:
                raise _Unread("an in-context prompt was built from reference text ids that were not seen")
            out["input_ref_text_ids"], out["input_ref_codes"] = ref, self.icl["ref_codes"]
            out["input_non_streaming"] = np.array(int(self.icl["non_streaming"]), np.int64)
        else:  # the whole text's codec-pad row: embedded by the non-streaming layout only
            whole_pad = any(ndim == 2 and ids.size and (ids == self.pad_id).all() for ids, _, ndim in self.codec[2:])
            out["input_non_streaming"] = np.array(int(whole_pad), np.int64)
        return out


class _Unread(RuntimeError):
    pass


def _empty() -> np.ndarray:
    return np.zeros(0, np.int64)


class _TorchView:
    """The builder module's `torch`: everything is torch's, `cat` also tells the build in progress."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def cat(self, tensors, *args, **kwargs):
        out = self._torch.cat(tensors, *args, **kwargs)
        rec = getattr(_state, "rec", None)
        if rec is not None:
            rec.cat(tensors, out)
        return out


class _Tokenizer:
    def __init__(self, tok, rec: _Recording):
        self._tok, self._rec = tok, rec

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, text, *args, **kwargs):
        out = self._tok(text, *args, **kwargs)
        if isinstance(text, str):
            ids = _ids(out["input_ids"])
            if ids is not None:
                self._rec.tokenized.append((text, ids))
        return out


def observe_builder(cls, module) -> bool:
    """Wrap `cls.build_prompt_embeds` (idempotent); `module` is the builder's module, whose `torch`
    gets the view. Returns whether it wrapped now."""
    original = cls.build_prompt_embeds
    if getattr(original, MARK, False):
        return False
    if not isinstance(module.torch, _TorchView):
        module.torch = _TorchView(module.torch)

    @functools.wraps(original)
    def build_prompt_embeds(self, *args, **kwargs):
        began = time.perf_counter()
        info, task = kwargs.get("info_dict") or {}, kwargs.get("task_type")
        try:
            rec = _Recording(info, task, int(self._talker_config.codec_pad_id))
        except Exception as e:  # noqa: BLE001 - a capture problem is the capture's error, never the request's
            _state.done = f"could not read the builder's state: {type(e).__name__}: {e}"
            return original(self, *args, **kwargs)
        names = ("get_text_tokenizer", "_codec_embed", "_generate_icl_prompt")
        inner = {n: getattr(self, n) for n in names}
        own = {n: self.__dict__[n] for n in names if n in self.__dict__}  # instance attributes, put back as they were

        def codec_embed(ids, *a, **kw):
            out = inner["_codec_embed"](ids, *a, **kw)
            rec.codec.append((_ids(ids), out, getattr(ids, "ndim", 1)))
            return out

        def icl_prompt(*a, **kw):
            rec.icl = {"ref_codes": _ids(kw["ref_code"]).reshape(-1, CODEBOOKS), "non_streaming": bool(kw["non_streaming_mode"])}
            return inner["_generate_icl_prompt"](*a, **kw)

        self.get_text_tokenizer = lambda: _Tokenizer(inner["get_text_tokenizer"](), rec)
        self._codec_embed, self._generate_icl_prompt = codec_embed, icl_prompt
        _state.rec, _state.done = rec, None
        t = time.perf_counter()
        try:
            result = original(self, *args, **kwargs)
        finally:
            building = time.perf_counter() - t
            _state.rec = None
            for n in names:
                if n in own:
                    setattr(self, n, own[n])
                else:
                    delattr(self, n)  # the class's method again
        try:
            _state.done = rec.arrays(info)
        except Exception as e:  # noqa: BLE001
            _state.done = f"{type(e).__name__}: {e}" if not isinstance(e, _Unread) else str(e)
        COST.add(time.perf_counter() - began - building)  # the observer's own time, not the build's
        return result

    setattr(build_prompt_embeds, MARK, True)
    cls.build_prompt_embeds = build_prompt_embeds
    return True


def take() -> dict | str | None:
    """The last build's input_* arrays, or why they could not be read; None when no build ran
    since the last take."""
    done = getattr(_state, "done", None)
    _state.done = None
    return done
