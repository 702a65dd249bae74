"""Model runner v2 (vLLM-Omni 0.30's default for Qwen3-TTS on CUDA): the talker's path, captured.

What MRV2 does with the talker, read in vLLM-Omni 0.30.0 and vLLM 0.30.0:

- The prompt. Each step, `OmniModelState.run_preprocess` (vllm_omni/worker_v2/model_states/
  omni_model_state.py) first hands the intermediate buffers of all the batch's prefilling requests
  to the talker's `preprocess_batch_mrv2`, which calls the prompt builder's `preprocess_infos_batch`.
  That call builds no prompt: it tokenizes the texts and encodes reference audio in batches and leaves
  the results in the buffers (`_qwen3_tts_text_ids` and the rest). Then `run_preprocess` calls the
  talker's `preprocess` once per prefilling request, as v1 does, with the buffer as keyword arguments.
  The request is named `req_id` (v1: `request_id`, the same engine id) and `_omni_prompt_len` comes
  from v2's RequestState. A request's first prefill builds its prompt there (`build_prompt_embeds`,
  which pops the precomputed ids). Decode steps go to `preprocess_decode_batch_mrv2` instead, where
  no prompt is built. So hooks.py's `preprocess` wrapper and prompt_inputs.py's builder observer,
  which reads the precomputed text ids, file the talker's input and prompt rows under v2 unchanged,
  and nothing here wraps the batched pass. tests/test_capture_v2.py drives v2's `run_preprocess`
  to show they do.
- The assembled prompt (`input_prompt_embeds`, hooks.PromptRows). v2 calls the talker's
  `preprocess(ids_slice, emb_slice, **info)` once per prefilling request and step, positionally
  where v1 passes keywords, with `_omni_num_computed_tokens` and `_omni_prompt_len` from its
  RequestState and `_omni_is_prefill`; it writes the rows `preprocess` returned into the batch's
  `inputs_embeds` at the request's span (`embeds[start:start + n] = new_emb[:n]`), as v1 does. The
  prompt buffer stays on the device (`_use_v2_model_runner`: not moved to the CPU as under v1) and
  each step slices it as under v1, so the preprocess wrapper reads the same rows under both runners,
  chunk by chunk, from the result it already observes. Unlike v1, v2 drops a preempted request's
  buffer (`OmniModelRunner.finish_requests` removes preempted requests from the model state), so
  the resume builds the prompt again; the capture files a request's input and rows once, from its
  first prefill, and a rebuild is not filed again (tests/test_capture_v2.py shows both).
- The rows. v1 names the logits rows by the talker's `_batch_req_ids`. v2 sets them only inside
  `mrv2_sampling_context`, which it enters only when the silence ban is on, so under v2 they are
  empty or stale and the v1 naming files nothing. v2's `GPUModelRunner.sample` (vllm/v1/worker/gpu/
  model_runner.py) computes `logits = model.compute_logits(hidden[input_batch.logits_indices])`
  and hands that same tensor to `self.sampler(logits, input_batch)`. `input_batch.req_ids` names
  its rows in order: one row per request, since the talker does no speculative decoding.
- The distribution. v2 samples with its own `Sampler` (vllm/v1/worker/gpu/sample/sampler.py), not
  v1's `Sampler.apply_logits_processors`. Its `apply_sampling_params` copies the logits to float32
  and works on the copy in place: logit bias (allowed ids, min-tokens' stop-token mask), penalties,
  bad words and the thinking budget, then temperature (`SamplingStates.apply_temperature`), then
  min-p. When no request in the batch needs any of this, it returns the logits untouched.

Wrapped here, so that v2 files the same step records as v1 (store.file_steps, one per talker row
and step, under its request id):

1. `Qwen3TTSTalkerForConditionalGeneration.compute_logits` (around hooks.py's wrapper) keeps the
   tensor it returned, so a sampler call can tell that its logits are the talker's.
2. v2's `Sampler.__call__`: when its logits are that tensor, it names the rows from
   `input_batch.req_ids`. Only requests that v2's RequestState holds are filed, which leaves out the
   memory-profiling run's dummy batch. Each row's output position is seq_len - prompt_len, the index
   in `output_token_ids` of the token sampled now; a prefill chunk that samples nothing gets a
   negative position and is not filed. Nothing is filed while a CUDA graph records. After the
   call, if temperature was never reached (the batch's logits were sampled untouched), it files
   those logits' top-k.
3. v2's `SamplingStates.apply_temperature`: during a talker's sampling, it files the top-k
   log-probabilities of the logits it is handed. That is v1's point: after the codec mask,
   penalties and min-tokens, before temperature. This is the one wrapper that reads before the
   call, because temperature rescales these logits in place and after the call they are gone. It
   only reads them (log_softmax and topk into new tensors) and writes nothing, then calls the
   original with the same arguments and returns its result.

Each wrapper calls the original with the arguments it got and returns exactly its result. Capture
runs in `try`, and a failure is logged once per kind. Every wrapper carries MARK, so `install` is
idempotent. `install` wraps (2) only if (3) is in place: without (3), the fallback in (2) would
file raw logits for a batch that was processed. Not covered: a talker under tensor parallelism
(v2's batch sharder computes `compute_logits_local`, so nothing is named and nothing is filed),
and logits expanded for speculative decoding (rows != requests: not filed).
"""

from __future__ import annotations

import functools
import importlib
import logging

import numpy as np

from runners.vllm_omni.difftest_capture.difftest_capture.cost import COST
from runners.vllm_omni.difftest_capture.difftest_capture.store import TOP_K

logger = logging.getLogger("vllm.difftest_capture")

MARK = "__difftest_capture_v2__"
TALKER_MODULE = "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker"
SAMPLER_MODULE = "vllm.v1.worker.gpu.sample.sampler"  # model runner v2's sampler
STATES_MODULE = "vllm.v1.worker.gpu.sample.states"

_warned: set[str] = set()


def _warn_once(kind: str, msg: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        logger.warning("difftest capture: " + msg, exc_info=True)


class _Sampling:
    """One talker sampler call: whose rows, at which output positions, and whether temperature was reached."""

    __slots__ = ("sampler", "input_batch", "rows", "reached")

    def __init__(self, sampler, input_batch, rows: list[str]):
        self.sampler, self.input_batch, self.rows, self.reached = sampler, input_batch, rows, False


class V2Steps:
    """Per-process state of the v2 wrappers; files through the v1 capture's store."""

    def __init__(self, capture):
        self.capture = capture
        self.talker_logits = None  # the tensor the talker's compute_logits returned last
        self.current: _Sampling | None = None  # the talker's sampler call in progress

    def begin(self, sampler, logits, input_batch) -> _Sampling | None:
        """A sampler call begins: a _Sampling when its logits are the talker's, else None."""
        talker, self.talker_logits = self.talker_logits, None
        if talker is None or logits is not talker or _capturing():
            return None
        n = int(getattr(input_batch, "num_reqs", 0) or 0)
        rows = [str(r) for r in list(getattr(input_batch, "req_ids", None) or [])[:n]]
        if not rows or int(logits.shape[0]) != len(rows):  # expanded (speculative) rows: not named
            return None
        known = sampler.req_states.req_id_to_index
        if not any(r in known for r in rows):  # the profiling run's dummy batch: no request of the engine's
            return None
        return _Sampling(sampler, input_batch, rows)

    def file(self, s: _Sampling, logits) -> None:
        """File each talker row's top-k log-probabilities of `logits`, at its output position."""
        import torch

        if logits is None or int(logits.shape[0]) != len(s.rows):
            return
        with torch.no_grad():
            lp = torch.log_softmax(logits.detach().float(), dim=-1)
            values, ids = lp.topk(min(TOP_K, lp.shape[-1]), dim=-1)
        b = s.input_batch
        seq_lens = np.asarray(b.seq_lens[:len(s.rows)].detach().to("cpu").numpy(), np.int64)
        prompt = np.asarray(s.sampler.req_states.prompt_len.np[np.asarray(b.idx_mapping_np)[:len(s.rows)]], np.int64)
        positions = seq_lens - prompt  # the index of the token sampled now; < 0: a prefill chunk, discarded
        known = s.sampler.req_states.req_id_to_index
        keep = np.flatnonzero((positions >= 0) & np.array([r in known for r in s.rows]))
        if not len(keep):
            return
        ids_np = ids.detach().to("cpu").numpy().astype(np.int64)[keep]
        values_np = values.detach().to("cpu").numpy().astype(np.float32)[keep]
        self.capture.store.file_steps([s.rows[i] for i in keep], positions[keep], ids_np, values_np)


_steps: V2Steps | None = None


def _capturing() -> bool:
    """True while a CUDA graph records (a host copy there would break it)."""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _marked(fn):
    setattr(fn, MARK, True)
    return fn


def wrap_compute_logits(original, steps: V2Steps):
    @functools.wraps(original)
    def compute_logits(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            steps.talker_logits = result
        except Exception:
            _warn_once("v2-logits", "could not mark the talker's logits (model runner v2)")
        return result

    return _marked(compute_logits)


def wrap_sampler_call(original, steps: V2Steps):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        s = None
        try:
            logits = args[0] if args else kwargs.get("logits")
            batch = args[1] if len(args) > 1 else kwargs.get("input_batch")
            s = steps.begin(self, logits, batch)
        except Exception:
            _warn_once("v2-rows", "could not name the talker's rows (model runner v2)")
        steps.current = s
        try:
            result = original(self, *args, **kwargs)
        finally:
            steps.current = None
        if s is not None and not s.reached:
            try:
                with COST.timed():  # sampled as computed: nothing processed the logits
                    steps.file(s, logits)
            except Exception:
                _warn_once("v2-topk", "could not capture the talker's top-k log-probabilities (model runner v2)")
        return result

    return _marked(__call__)


def wrap_apply_temperature(original, steps: V2Steps):
    @functools.wraps(original)
    def apply_temperature(self, *args, **kwargs):
        s = steps.current
        if s is not None and not s.reached:
            s.reached = True
            try:
                with COST.timed():  # before the call: temperature rescales these logits in place
                    steps.file(s, args[0] if args else kwargs.get("logits"))
            except Exception:
                _warn_once("v2-topk", "could not capture the talker's top-k log-probabilities (model runner v2)")
        return original(self, *args, **kwargs)

    return _marked(apply_temperature)


def install(capture) -> list[str]:
    """Wrap model runner v2's talker path in this process (idempotent), filing through `capture`
    (hooks.Capture); returns what was wrapped now."""
    global _steps
    if _steps is None:
        _steps = V2Steps(capture)
    _steps.capture = capture  # the wrappers already in place file through the capture given last
    steps = _steps
    done = []
    talker = importlib.import_module(TALKER_MODULE).Qwen3TTSTalkerForConditionalGeneration
    if not getattr(talker.compute_logits, MARK, False):
        talker.compute_logits = wrap_compute_logits(talker.compute_logits, steps)
        done.append("Qwen3TTSTalkerForConditionalGeneration.compute_logits (v2)")
    states = importlib.import_module(STATES_MODULE).SamplingStates
    if not getattr(states.apply_temperature, MARK, False):
        states.apply_temperature = wrap_apply_temperature(states.apply_temperature, steps)
        done.append("SamplingStates.apply_temperature (v2)")
    sampler = importlib.import_module(SAMPLER_MODULE).Sampler
    if getattr(states.apply_temperature, MARK, False) and not getattr(sampler.__call__, MARK, False):
        sampler.__call__ = wrap_sampler_call(sampler.__call__, steps)
        done.append("Sampler.__call__ (v2)")
    return done
