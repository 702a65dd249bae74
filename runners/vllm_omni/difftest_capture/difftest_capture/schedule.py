"""The talker's scheduler, observed: how each request's prompt was prefilled, and when it was preempted.

Production's talker runs with a 512-token step budget and a KV cache sized under load, so a long
prompt is prefilled over several steps (chunked prefill) and a request may be preempted when the
cache fills, then resumed by recomputing its prompt and every token it generated. Neither shows in
a request's output, and neither ran in a run whose budget held every prompt and whose cache never
filled: the capture records what the scheduler did (difftest.verdicts.exercised judges it).

`OmniARScheduler` (the autoregressive stages' scheduler: the talker's) is wrapped twice:

- `schedule`: after each step, for every request given more than one token, or still inside its
  prompt, one record [tokens computed before the step, tokens scheduled, tokens generated so far];
  a prompt prefilled in two steps leaves two records, a resume's replay of generated tokens a record
  past the prompt;
- `_preempt_request`: before the scheduler drops the request's KV, one record [tokens generated,
  tokens computed] (the generated tokens are what the resume must rebuild).

Records are filed by request id (store.file_schedule); the hand-off takes them with the talker's
tokens (hooks.Capture._talker_output) as `talker_prefill` (K, 3) and `talker_preemptions` (P, 2).
"""

from __future__ import annotations

import functools
import importlib

from runners.vllm_omni.difftest_capture.difftest_capture.cost import COST
from runners.vllm_omni.difftest_capture.difftest_capture.hooks import _warn_once

SCHEDULER_MODULE = "vllm_omni.core.sched.omni_ar_scheduler"
MARK = "__difftest_schedule__"


def steps_of(scheduler, output) -> list[tuple[str, int, int, int]]:
    """(request id, computed before, scheduled, generated) for the step's prefill and replay spans."""
    out = []
    for rid, n in (getattr(output, "num_scheduled_tokens", None) or {}).items():
        req = scheduler.requests.get(rid)
        if req is None:
            continue
        before = int(req.num_computed_tokens) - int(n)  # _update_after_schedule has advanced it by n
        if int(n) > 1 or before < int(req.num_prompt_tokens):
            out.append((str(rid), before, int(n), int(req.num_output_tokens)))
    return out


def install(capture) -> list[str]:
    """Wrap the talker's scheduler in this process (the stage's engine core); idempotent."""
    cls = importlib.import_module(SCHEDULER_MODULE).OmniARScheduler
    store, wrapped = capture.store, []
    if not getattr(cls.schedule, MARK, False):
        original = cls.schedule

        @functools.wraps(original)
        def schedule(self, *args, **kwargs):
            output = original(self, *args, **kwargs)
            try:
                with COST.timed():
                    for rid, before, n, generated in steps_of(self, output):
                        store.file_schedule(rid, "prefill", (before, n, generated))
            except Exception:
                _warn_once("schedule", "could not record the talker's prefill steps")
            return output

        setattr(schedule, MARK, True)
        cls.schedule = schedule
        wrapped.append("OmniARScheduler.schedule")
    if not getattr(cls._preempt_request, MARK, False):
        preempt = cls._preempt_request  # vLLM's own: the Omni scheduler does not override it

        @functools.wraps(preempt)
        def _preempt_request(self, request, *args, **kwargs):
            try:  # before the call: it resets num_computed_tokens to 0
                with COST.timed():
                    store.file_schedule(str(request.request_id), "preempt",
                                        (int(request.num_output_tokens), int(request.num_computed_tokens)))
            except Exception:
                _warn_once("preempt", "could not record a talker preemption")
            return preempt(self, request, *args, **kwargs)

        setattr(_preempt_request, MARK, True)
        cls._preempt_request = _preempt_request
        wrapped.append("OmniARScheduler._preempt_request")
    return wrapped
