"""The wrappers: vLLM-Omni's Qwen3-TTS talker input, hand-off and vocoder, observed, never changed.

Each wrapper calls the original with the arguments it got and returns exactly
what the original returned (the same object). Capture runs after the call, on
copies, inside `try`: an error is logged (once per kind) and the request goes
on. `functools.wraps` keeps `__name__`, `__module__` and `__wrapped__`, so
vLLM-Omni's signature check on connector hooks and its lookup of a
`<name>_batch` peer see the original.

What is written, per tagged request (`<dir>/<tag>.npz`, difftest/engines/capture.py):
- `talker_ref_codes`, `talker_prompt`: the talker's input, from its first
  prefill (`preprocess`): the reference codes its prompt was built from, the
  prompt positions the scheduler reserved, the rows built, `ref_code_len`.
  The talker's worker knows the request only by id: it files them under
  `talker/<id>` and the hand-off, which knows the tag, takes them;
- `input_prompt_embeds` (P, H) float32, `input_prompt_dtype`, `input_prompt_cached`: the
  talker's prompt as its forward got it (PromptRows below): the rows `preprocess` returned
  for each prefill position, over every chunk of a chunked prefill, recorded once per request
  (a resume after preemption is not recorded again), cast from their dtype (`input_prompt_dtype`,
  written as `input_speaker_dtype` is) to float32; P is the positions the scheduler reserved
  (`talker_prompt[0]`), so rows past those built (`talker_prompt[1]`) are the pad rows
  `preprocess` appended. `input_prompt_missing` (a string) says why where they could not be read;
- `talker_tokens`: the talker's output, the request's `output_token_ids`
  (codebook 0 of every frame, and the final token) as the hand-off saw them;
- `talker_topk_ids`, `talker_topk_logprobs` (len(talker_tokens), k): the
  talker's own top-k at each of those steps, from the logits vLLM's sampler
  samples from (after the codec mask, penalties, min-tokens and the other
  logits processors, before temperature), log-softmaxed. The worker files one
  record per step (`Sampler.apply_logits_processors`, rows named by the ids
  the runner hands the model in logits order); absent where they could not be
  lined up with the tokens;
- `codes` (T, 16) int64: the generated frames as handed to the vocoder
  (after vLLM-Omni's filtering and cropping, without the reference prefix);
- `ref_codes` (R, 16) int64: the reference frames prepended for the vocoder
  (full-payload mode: the whole reference; async-chunk mode: the context
  shipped with the first chunk, at most `ref_code_context_frames`);
- `wav` float32: the vocoder's output, chunks concatenated, before the HTTP
  layer quantises it;
- `chunk_frames` int64: frames per hand-off (one entry in full-payload mode);
- `handoff`: "full_payload" or "async_chunk".
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from difftest.family import CODEBOOKS as NUM_CODE_GROUPS
from difftest.family import SAMPLE_RATE
from runners.vllm_omni.difftest_capture.difftest_capture import TAG_KEY, UNTAGGED_ENV, prompt_inputs, request_id_tag
from runners.vllm_omni.difftest_capture.difftest_capture.cost import COST
from runners.vllm_omni.difftest_capture.difftest_capture.store import TOP_K, CaptureStore, valid_tag

logger = logging.getLogger("vllm.difftest_capture")

OPEN_REQUESTS = 512  # per-request state kept at most (a request that never says "finished" is dropped last-used)
PROMPTS_FILED = 8192  # request ids whose prompt rows were filed: a resume of one of these is not filed again
MARK = "__difftest_capture__"
PROC_MODULE = "vllm_omni.model_executor.stage_input_processors.qwen3_tts"
CODE2WAV_MODULE = "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav"
SAMPLER_MODULE = "vllm.v1.sample.sampler"
TALKER_MODULE = "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker"
BUILDER_MODULE = "vllm_omni.model_executor.models.qwen3_tts.prompt_embeds_builder"

_warned: set[str] = set()


def _warn_once(kind: str, msg: str, *args) -> None:
    if kind not in _warned:
        _warned.add(kind)
        logger.warning("difftest capture: " + msg, *args, exc_info=True)


def _get(obj, *path):
    """obj["a"]["b"] or obj.a.b, whichever the payload is (dict or msgspec struct); None when absent."""
    for name in path:
        if obj is None:
            return None
        obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return obj


def _int(value, default: int = 0) -> int:
    if value is None:
        return default
    if isinstance(value, (list, tuple)):
        return _int(value[0], default) if value else default
    if hasattr(value, "reshape") and hasattr(value, "numel"):  # a tensor
        return int(value.reshape(-1)[0].item()) if value.numel() else default
    return int(value)


def _numpy(t, dtype) -> np.ndarray:
    return np.array(t.detach().to("cpu").numpy() if hasattr(t, "detach") else t, dtype=dtype, copy=True)


def request_tag(request) -> str | None:
    extra = _get(request, "sampling_params", "extra_args")
    tag = extra.get(TAG_KEY) if isinstance(extra, dict) else None
    if tag is None:
        # Offline `Omni.generate` shares one SamplingParams per stage across a batch, so no per-request
        # tag can travel: the offline runner asks for files named after the request id instead.
        if os.environ.get(UNTAGGED_ENV, "").strip() != "request-id":
            return None
        tag = request_id_tag(request_id(request))
        if tag is None:
            return None
    if not valid_tag(tag):
        _warn_once("bad-tag", "ignoring unusable tag %r", tag)
        return None
    return tag


def request_ids(request) -> list[str]:
    """Every id a request is known by (API, engine core, worker), for matching the talker's side."""
    ids = [_get(request, n) for n in ("request_id", "req_id", "external_req_id")]
    return [str(i) for i in dict.fromkeys(ids) if i]


def request_id(request) -> str:
    # engine-core Request: external_req_id / request_id; the worker's CachedRequestState: req_id
    return str(_get(request, "external_req_id") or _get(request, "request_id") or _get(request, "req_id") or "")


def frames_of(flat: np.ndarray, groups: int = NUM_CODE_GROUPS) -> np.ndarray:
    """Codebook-major flat codes [Q*F] -> (F, Q)."""
    if flat.size % groups:
        raise ValueError(f"{flat.size} codes do not make whole frames of {groups}")
    return flat.reshape(groups, -1).T.copy()


def align_steps(steps: np.ndarray | None, n_tokens: int) -> dict:
    """The step records that sampled each of a request's n tokens, as capture arrays; empty (0, k)
    arrays, meaning "not captured", when they cannot be lined up (a later chunk's update replaces
    an earlier one's arrays, so a stale, shorter pair is never left beside the tokens). By position
    where the worker knew it (a prefill chunk's discarded sample, a recomputed step: the last record
    of each position wins), else the last n records."""
    none = {"talker_topk_ids": np.zeros((0, TOP_K), np.int64),
            "talker_topk_logprobs": np.zeros((0, TOP_K), np.float32)}
    if steps is None or n_tokens == 0 or len(steps) < n_tokens:
        return none
    if (steps["pos"] >= 0).all():
        last = {int(p): i for i, p in enumerate(steps["pos"])}
        if any(j not in last for j in range(n_tokens)):
            return none
        picked = steps[[last[j] for j in range(n_tokens)]]
    else:
        picked = steps[-n_tokens:]
    return {"talker_topk_ids": picked["ids"].astype(np.int64),
            "talker_topk_logprobs": picked["logprobs"].astype(np.float32)}


class PromptRows:
    """One request's talker prompt as its prefill hands it to the forward, position by position.

    `preprocess` returns, for each prefill step, the embeddings of the positions the scheduler gave
    the request in that step (`_omni_num_computed_tokens` on, as many as it scheduled): its first
    step builds the whole prompt (`build_prompt_embeds`) and every step slices it, padded with the
    pad embedding past the rows built, in the talker's embedding dtype. The rows are kept as they
    came, by position; the first time a position is handed over counts. Once the positions reach
    the request's prompt length (`_omni_prompt_len`) the prompt is whole and filed, once.

    A first step that starts past position 0 (a prefix-cache hit: those positions' KV were
    computed for an earlier request with the same cache salt, and this request's forward never
    gets their rows) takes them from the prompt the same step built, cast as `preprocess` casts
    a slice, and says how many (`input_prompt_cached`). A step that skips positions, a step
    without embeddings, or a runner that does not say the positions: `input_prompt_missing`,
    never rows that were not handed over."""

    __slots__ = ("length", "parts", "owned", "next", "dtype", "cached")

    def __init__(self, length: int):
        self.length, self.parts, self.owned, self.next, self.dtype, self.cached = length, [], 0, 0, None, 0

    def add(self, start: int, rows) -> None:
        if start > self.next:
            raise _NoRows(f"the prefill step at position {start} follows position {self.next - 1}: "
                          f"positions {self.next}-{start - 1} never reached the talker's preprocess")
        n = int(rows.shape[0])
        if start + n <= self.next:  # positions already handed over (a resume's replay): the first counts
            return
        new = rows[self.next - start:]
        if self.dtype is None:
            self.dtype = new.dtype
        elif new.dtype != self.dtype:
            raise _NoRows(f"the prompt's steps came in {self.dtype} and {new.dtype}")
        self.parts.append(new.detach())  # a view, read in this step; kept() copies it for a later one
        self.next = start + n

    def kept(self) -> None:
        """The rows not yet copied, copied to the host: the prompt goes on in a later step."""
        for i in range(self.owned, len(self.parts)):
            self.parts[i] = self.parts[i].to("cpu", copy=True)
        self.owned = len(self.parts)

    def whole(self) -> bool:
        return self.next >= self.length

    def arrays(self) -> dict:
        import torch

        rows = (self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts))[:self.length]
        out = rows.to("cpu", torch.float32)  # one conversion, from the rows handed over ...
        rows = out.numpy().copy() if out is rows else out.numpy()  # ... never a view of the engine's tensor
        return {"input_prompt_embeds": rows, "input_prompt_dtype": np.array(str(self.dtype).removeprefix("torch.")),
                "input_prompt_cached": np.array(self.cached, np.int64)}


class _NoRows(RuntimeError):
    pass


def _step(info: dict) -> tuple[int | None, int | None, bool | None]:
    """(positions computed before this step, the prompt's length, whether the step is a prefill),
    as the runner told `preprocess` (v1 and v2 both set all three); None where it did not."""
    def num(key):
        v = info.get(key)
        return None if v is None or isinstance(v, bool) else int(v)

    computed, length = num("_omni_num_computed_tokens"), num("_omni_prompt_len")
    flag = info.get("_omni_is_prefill")
    prefill = flag if isinstance(flag, bool) else (computed < length if None not in (computed, length) else None)
    return computed, length, prefill


class Capture:
    """Per-process capture state; one instance per server process."""

    def __init__(self, root: str | Path):
        self.store = CaptureStore(root)
        self.lock = threading.Lock()
        self.streams: OrderedDict[str, dict] = OrderedDict()  # async chunking: request id -> handed over so far
        self.wavs: OrderedDict[str, list[np.ndarray]] = OrderedDict()  # tag -> the vocoder's chunks so far
        self.logit_rows: list[str] | None = None  # the talker worker: request ids of the logits about to be sampled
        self.prompts: OrderedDict[str, PromptRows] = OrderedDict()  # the talker worker: prompts being prefilled
        self.prompts_filed: OrderedDict[str, None] = OrderedDict()  # ... and those filed (PROMPTS_FILED)

    @staticmethod
    def _bound(d: OrderedDict) -> None:
        while len(d) > OPEN_REQUESTS:
            d.popitem(last=False)

    # --- the talker's input ---
    def talker_input(self, info: dict, result) -> None:
        """After `preprocess`: on a request's first prefill (the one that builds the prompt), file
        what the talker was prompted with under the request's id; on each prefill step, the
        prompt rows it handed over, filed once the prompt is whole (prompt_rows)."""
        update = result[2] if isinstance(result, tuple) and len(result) == 3 else None
        prefill = _get(update, "embed", "prefill")
        # model runner v1 names the request `request_id`; v2 hands `preprocess` its intermediate buffer, `req_id`
        rid = info.get("request_id") or info.get("req_id")
        inputs = prompt_inputs.take()  # what the prompt builder used in this call (prompt_inputs.py)
        if not rid:
            return
        rid = str(rid)
        if prefill is not None and rid in self.prompts_filed:
            return  # a resume after preemption building the prompt again (v2): filed from the first prefill
        rows = self.prompt_rows(rid, info, result, prefill)
        if prefill is None:
            if rows is not None:  # a chunked prefill's last step: the rows beside the input filed at its first
                self.store.file_prompt(rid, **rows)
            return
        if not isinstance(inputs, dict):
            inputs = {"input_missing": np.array(inputs or "the prompt builder was not seen building this prompt")}
        ref = _get(update, "codes", "ref")
        ref = (_numpy(ref, np.int64).reshape(-1, NUM_CODE_GROUPS) if ref is not None and ref.numel()
               else np.zeros((0, NUM_CODE_GROUPS), np.int64))
        ref_len = _get(update, "meta", "ref_code_len")
        prompt = [_int(info.get("_omni_prompt_len")), int(prefill.shape[0]), -1 if ref_len is None else _int(ref_len)]
        self.store.file_talker(rid, talker_ref_codes=ref, talker_prompt=np.array(prompt, np.int64), **inputs,
                               **(rows or {}))  # a prefill in one step: its rows in the same file

    def prompt_rows(self, rid: str, info: dict, result, built) -> dict | None:
        """The request's prompt rows (PromptRows.arrays) once this step completes them, or why they
        cannot be read (`input_prompt_missing`); None while its prefill goes on, outside a prefill,
        and for a request whose rows were filed already (a resume after preemption recomputes its
        prompt: not recorded again). `built` is the prompt this step built (its first prefill)."""
        if rid in self.prompts_filed:
            return None
        state = self.prompts.get(rid)
        computed, length, prefill = _step(info)
        if state is None and built is None:
            return None  # not a prefill this capture saw begin (a decode step, a span of replayed tokens)
        try:
            if computed is None or length is None:
                raise _NoRows("the talker's preprocess was not told the step's position and the prompt's length "
                              "(_omni_num_computed_tokens, _omni_prompt_len)")
            if not prefill:
                raise _NoRows(f"a step past the prompt (at position {computed}) came before positions "
                              f"{state.next if state else 0}-{length - 1} of its prompt were handed over")
            rows = result[1] if isinstance(result, tuple) and len(result) == 3 else None
            if getattr(rows, "ndim", 0) != 2:
                raise _NoRows(f"the talker's preprocess returned no prompt rows ({type(rows).__name__})")
            if state is None:
                state = PromptRows(length)
                if computed > 0:  # a prefix-cache hit: the positions before it, as this step built them
                    if getattr(built, "ndim", 0) != 2 or computed > int(built.shape[0]):
                        raise _NoRows(f"the prefill began at position {computed} (a prefix-cache hit) and the "
                                      f"prompt built holds {getattr(built, 'shape', ['no'])[0]} rows")
                    state.add(0, built[:computed].to(dtype=rows.dtype))
                    state.cached = computed
                self.prompts[rid] = state
                self.prompts.move_to_end(rid)
                self._bound(self.prompts)
            state.add(computed, rows)
            if not state.whole():
                state.kept()
                return None
            out = state.arrays()
        except Exception as e:  # noqa: BLE001 - said in the capture, never guessed
            out = {"input_prompt_missing": np.array(str(e) if isinstance(e, _NoRows) else f"{type(e).__name__}: {e}")}
        self.prompts.pop(rid, None)
        self.prompts_filed[rid] = None
        while len(self.prompts_filed) > PROMPTS_FILED:
            self.prompts_filed.popitem(last=False)
        return out

    def _talker_side(self, request, finished: bool = True) -> dict:
        """The talker's side of a request for its capture file: its input (filed by the worker)
        and its output tokens; `talker_missing` says why when the input was never filed."""
        ids = request_ids(request)
        found = self.store.take_talker(ids)
        if found is None:
            return {"talker_missing": np.array(f"no talker input filed for request {' / '.join(ids) or '?'}"),
                    **self.store.schedule(ids, consume=finished)}
        return {**found, **self._talker_output(request, finished)}

    def _talker_output(self, request, finished: bool = True) -> dict:
        """The talker's tokens so far and, where its worker filed them, its own top-k per token."""
        tokens = np.array(list(_get(request, "output_token_ids") or []), np.int64)
        steps = self.store.talker_steps(request_ids(request), consume=finished)
        return {"talker_tokens": tokens, **align_steps(steps, len(tokens)),
                **self.store.schedule(request_ids(request), consume=finished)}

    # --- the talker's own distribution (its worker) ---
    def logits_rows(self, model, logits) -> None:
        """After the talker's `compute_logits`: which request each row is (the runner hands the
        model its batch's ids in logits order, without speculative decoding)."""
        ids = list(getattr(model, "_batch_req_ids", None) or [])
        self.logit_rows = ids if logits is not None and len(ids) == int(logits.shape[0]) else None

    def sampled_from(self, logits, sampling_metadata) -> None:
        """After the sampler's logits processors, on the rows the talker named: file each row's
        top-k log-probabilities under its request id. Any other model's sampling (none named
        its rows) is left alone."""
        rows, self.logit_rows = self.logit_rows, None
        if not rows or logits is None or int(logits.shape[0]) != len(rows):
            return
        import torch

        with torch.no_grad():
            lp = torch.log_softmax(logits.detach().float(), dim=-1)
            values, ids = lp.topk(min(TOP_K, lp.shape[-1]), dim=-1)
        outs = getattr(sampling_metadata, "output_token_ids", None)
        positions = ([len(o) for o in outs] if isinstance(outs, list) and len(outs) == len(rows)
                     else [-1] * len(rows))
        self.store.file_steps(rows, positions, _numpy(ids, np.int64), _numpy(values, np.float32))

    # --- talker -> code2wav ---
    def full_payload(self, request, pooling_output, payload) -> None:
        tag = request_tag(request)
        if tag is None:
            return
        flat = _numpy(_get(payload, "codes", "audio"), np.int64).reshape(-1)
        audio_in = (pooling_output.get("codes.audio") if isinstance(pooling_output, dict) else None)
        groups = int(audio_in.shape[1]) if getattr(audio_in, "ndim", 0) == 2 and audio_in.shape[1] else NUM_CODE_GROUPS
        frames = frames_of(flat, groups)
        ref_frames = _int(_get(payload, "meta", "left_context_size"))
        self.store.file_handoff(flat, tag, request_id(request))
        self.store.update(tag, replace=True, codes=frames[ref_frames:], ref_codes=frames[:ref_frames],
                          chunk_frames=np.array([len(frames) - ref_frames], np.int64),
                          handoff=np.array("full_payload"), **self._talker_side(request))

    def async_chunk(self, request, payload) -> None:
        rid = request_id(request)
        finished = bool(_int(_get(payload, "meta", "finished")))
        with self.lock:
            state = self.streams.get(rid)
            if state is None:
                tag = request_tag(request)
                if tag is None:
                    return
                state = self.streams[rid] = {"tag": tag, "codes": [], "ref": None, "chunks": [],
                                             "talker": self._talker_side(request, finished)}
                self._bound(self.streams)
        flat = _numpy(_get(payload, "codes", "audio"), np.int64).reshape(-1)
        first = not state["chunks"]
        if flat.size:
            frames = frames_of(flat)
            ref_frames = _int(_get(payload, "meta", "left_context_size"))
            if ref_frames and state["ref"] is None:
                state["ref"] = frames[:ref_frames]
            state["codes"].append(frames[ref_frames:])
            state["chunks"].append(len(frames) - ref_frames)
            self.store.file_handoff(flat, state["tag"], rid, chunk=len(state["chunks"]) - 1, last=finished)
        if flat.size or finished:
            codes = np.concatenate(state["codes"]) if state["codes"] else np.zeros((0, NUM_CODE_GROUPS), np.int64)
            ref = state["ref"] if state["ref"] is not None else np.zeros((0, NUM_CODE_GROUPS), np.int64)
            talker = dict(state["talker"])
            if "talker_tokens" in talker:  # the tokens so far: the last chunk's hand-off sees them all
                talker.update(self._talker_output(request, finished=finished))
            self.store.update(state["tag"], replace=first, codes=codes, ref_codes=ref,
                              chunk_frames=np.array(state["chunks"], np.int64), handoff=np.array("async_chunk"),
                              **talker)
        if finished:
            with self.lock:
                self.streams.pop(rid, None)

    # --- code2wav ---
    def vocoder(self, model, bound: inspect.BoundArguments, output) -> None:
        import sys

        args = bound.arguments
        extra = dict(args.get("kwargs") or {})
        input_ids = args.get("input_ids")
        if input_ids is None or input_ids.numel() == 0:
            return
        infos = args.get("runtime_additional_information") or args.get("model_intermediate_buffer") or []
        mod = sys.modules[CODE2WAV_MODULE]
        per_request = model._split_request_ids(input_ids.reshape(-1).to(dtype=_long()),
                                               extra.get("seq_token_counts"))
        internal_ids = list(extra.get("request_ids") or [])
        wavs = _get(output, "multimodal_outputs")
        wavs = wavs.get("model_outputs") if isinstance(wavs, dict) else None
        if wavs is None:
            return
        for i, ids in enumerate(per_request):
            info = infos[i] if i < len(infos) else None
            flat = _numpy(mod._codec_ids_from_payload_or_input(ids, info), np.int64).reshape(-1)
            if flat.size == 0 or i >= len(wavs):
                continue
            candidates = [_get(info, "meta", "request_id")] + ([internal_ids[i]] if i < len(internal_ids) else [])
            if isinstance(candidates[0], (list, tuple)):
                candidates[0] = candidates[0][0] if candidates[0] else None
            found = self.store.take_handoff(flat, candidates)
            if found is None:
                continue
            tag, chunk, last = found  # the talker side knows the chunk's place; the vocoder's metadata varies
            wav = _numpy(wavs[i], np.float32).reshape(-1)
            with self.lock:
                if chunk == 0:  # a new request under this tag: forget any earlier one's audio
                    self.wavs.pop(tag, None)
                chunks = self.wavs.setdefault(tag, [])
                self.wavs.move_to_end(tag)
                self._bound(self.wavs)
                chunks.append(wav)
                whole = np.concatenate(chunks)
                if last:
                    self.wavs.pop(tag, None)
            self.store.update(tag, wav=whole, sample_rate=np.array(int(getattr(model, "_output_sample_rate", SAMPLE_RATE))))


def _in_graph() -> bool:
    """True while torch records a CUDA graph or traces for torch.compile."""
    import torch

    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if compiling is not None and compiling():
        return True
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _long():
    import torch

    return torch.long


_capture: Capture | None = None


def _wrap_handoff(original, observe):
    sig = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        try:
            with COST.timed():
                if result is not None:
                    observe(sig.bind(*args, **kwargs).arguments, result)
        except Exception:
            _warn_once(f"handoff-{original.__name__}", "could not capture %s", original.__name__)
        return result

    setattr(wrapper, MARK, True)
    return wrapper


def _wrap_forward(original, capture: Capture):
    sig = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _in_graph():
            # Copying to the host is not allowed while a CUDA graph records, and a replay or a compiled
            # graph never runs this Python: capturing here would be wrong or silently absent. difftest
            # keeps the vocoder stage eager (enforce_eager) so this is never reached; say so if it is.
            _warn_once("vocoder-graph", "vocoder output not captured: the vocoder runs under a CUDA graph or "
                       "torch.compile (set the vocoder stage's enforce_eager: true)")
            return result
        try:
            with COST.timed():
                capture.vocoder(self, sig.bind(self, *args, **kwargs), result)
        except Exception:
            _warn_once("vocoder", "could not capture the vocoder output")
        return result

    setattr(forward, MARK, True)
    return forward


def _observe_method(original, observe, kind: str, what: str):
    """`original` (a method), then `observe(self, args, kwargs, result)` on its result; a failure to
    observe is logged once per kind and never reaches the engine."""
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            with COST.timed():
                observe(self, args, kwargs, result)
        except Exception:
            _warn_once(kind, what)
        return result

    setattr(method, MARK, True)
    return method


def _name_rows(capture: Capture):
    def observe(model, args, kwargs, logits):
        capture.logit_rows = None  # stays None if naming fails: no row is filed under a wrong id
        capture.logits_rows(model, logits)
    return observe


def _sampled(capture: Capture):
    def observe(sampler, args, kwargs, out):
        capture.sampled_from(out, args[1] if len(args) > 1 else kwargs.get("sampling_metadata"))
    return observe


def wrap_stage_functions(module, capture: Capture) -> list[str]:
    """Wrap the hand-off functions in `module` (the real one, or a test's); returns what was wrapped."""
    done = []
    for name, observe in (
        ("talker2code2wav_full_payload",
         lambda a, r: capture.full_payload(a.get("request"), a.get("pooling_output"), r)),
        ("talker2code2wav_async_chunk", lambda a, r: capture.async_chunk(a.get("request"), r)),
    ):
        fn = getattr(module, name, None)
        if fn is None or getattr(fn, MARK, False):
            continue
        setattr(module, name, _wrap_handoff(fn, observe))
        done.append(name)
    return done


def install(root: str | Path) -> Capture:
    """Patch vLLM-Omni in this process (idempotent) and return the capture state."""
    global _capture
    if _capture is None:
        _capture = Capture(root)
        COST.configure(_capture.store.side)
    import importlib

    proc = importlib.import_module(PROC_MODULE)
    wrapped = wrap_stage_functions(proc, _capture)
    c2w = importlib.import_module(CODE2WAV_MODULE)
    cls = c2w.Qwen3TTSCode2Wav
    if not getattr(cls.forward, MARK, False):
        cls.forward = _wrap_forward(cls.forward, _capture)
        wrapped.append("Qwen3TTSCode2Wav.forward")
    talker = importlib.import_module(TALKER_MODULE).Qwen3TTSTalkerForConditionalGeneration
    if not getattr(talker.preprocess, MARK, False):
        talker.preprocess = _observe_method(talker.preprocess, lambda m, a, kw, r: _capture.talker_input(kw, r),
                                            "talker", "could not capture the talker's input")
        wrapped.append("Qwen3TTSTalkerForConditionalGeneration.preprocess")
    if not getattr(talker.compute_logits, MARK, False):
        talker.compute_logits = _observe_method(talker.compute_logits, _name_rows(_capture), "logits",
                                                "could not name the talker's logits rows")
        wrapped.append("Qwen3TTSTalkerForConditionalGeneration.compute_logits")
    builder = importlib.import_module(BUILDER_MODULE)
    if prompt_inputs.observe_builder(builder.Qwen3TTSPromptEmbedsBuilder, builder):
        wrapped.append("Qwen3TTSPromptEmbedsBuilder.build_prompt_embeds")
    sampler = importlib.import_module(SAMPLER_MODULE).Sampler
    if not getattr(sampler.apply_logits_processors, MARK, False):
        sampler.apply_logits_processors = _observe_method(sampler.apply_logits_processors, _sampled(_capture), "topk",
                                                          "could not capture the talker's top-k log-probabilities")
        wrapped.append("Sampler.apply_logits_processors")
    try:  # model runner v2's talker path (v2.py): its rows and sampler; the input needs no more than the above
        from runners.vllm_omni.difftest_capture.difftest_capture import v2

        wrapped += v2.install(_capture)
    except Exception:
        _warn_once("v2", "model runner v2's talker sampling is not wrapped (v1's capture is unaffected)")
    try:  # Qwen3-Omni's hand-off (omni_hooks.py), for a server of that family
        from runners.vllm_omni.difftest_capture.difftest_capture import omni_hooks

        omni = omni_hooks.OmniCapture(_capture.store)
        wrapped += omni_hooks.wrap(importlib.import_module(omni_hooks.MODULE), omni)
        wrapped += omni_hooks.wrap_model(importlib.import_module(omni_hooks.MODEL_MODULE).Qwen3OmniMoeForConditionalGeneration,
                                         omni)
    except Exception:
        _warn_once("omni", "Qwen3-Omni's hand-off is not wrapped (Qwen3-TTS's capture is unaffected)")
    if wrapped:
        logger.info("difftest capture: writing to %s (wrapped %s)", root, ", ".join(wrapped))
    return _capture
