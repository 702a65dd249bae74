"""Payload-layout adapters: the model-runner loop between vLLM-Omni's real hand-off functions.

vLLM-Omni's model runner cannot run here (it needs a real engine), so the few lines it runs
between the talker's output function and the stage processors are written once per payload
layout, not per release. Everything an adapter calls is the release's own code; what the adapter
itself does is listed in its `emulates`. Each adapter names the releases it serves and checks, before
it runs, that the installed release has the layout it expects. A mismatch is reported
("adapter X expects ...; found ..."), never worked around.

Layouts (a new layout gets a new adapter; a release inside a known layout needs nothing):

- orchestrator-split-v1   0.20.x: inline per-request split, `to_payload_element(..., seq_len)`;
                          no-async path accumulates on the orchestrator (`OmniRequestState`) and
                          builds code2wav's prompt with `talker2code2wav`.
- connector-split-v1      0.22.x: same split; the no-async path accumulates on the talker's worker
                          (`accumulate_full_payload_output`) and sends `talker2code2wav_full_payload`.
- connector-split-v2      0.24.x-0.26.x: split passes `scheduled_seq_len` as well.
- payload-build-v1        0.28.x-0.30.x: the per-request split is vLLM-Omni's own
                          `build_omni_mm_payload`; the accumulator lives on the mixin (0.28) or on
                          the payload-transport mixin (0.30).
"""

from __future__ import annotations

import importlib
import inspect
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Callable

STAGE_PROC = "vllm_omni.model_executor.stage_input_processors.qwen3_tts"
MM_OUTPUTS = "vllm_omni.utils.mm_outputs"
KEYS = "vllm_omni.data_entry_keys"
TALKER = "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker:Qwen3TTSTalkerForConditionalGeneration"
MIXIN_HOSTS = (
    "vllm_omni.worker.omni_connector_model_runner_mixin:OmniConnectorModelRunnerMixin",
    "vllm_omni.distributed.omni_connectors.model_runner.omni_connector_payload_transport:"
    "_OmniConnectorPayloadTransportMixin",
)
SPARSE_KEYS = frozenset({"meta.req_id", "meta.sparse_audio"})


class LayoutMismatch(Exception):
    """The installed release does not have the layout an adapter expects."""


def resolve(path: str) -> Any:
    """'pkg.mod:Attr' or 'pkg.mod' -> the object; raises ImportError/AttributeError."""
    mod, _, attr = path.partition(":")
    obj = importlib.import_module(mod)
    return getattr(obj, attr) if attr else obj


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _describe_missing(path: str) -> str:
    mod, _, attr = path.partition(":")
    try:
        m = importlib.import_module(mod)
    except ImportError as e:
        return f"module {mod} missing ({e})"
    if attr and not hasattr(m, attr):
        return f"{mod} has no {attr}"
    return "present"


class Expect:
    """One thing an adapter needs: a symbol, optionally with given parameters (or without some)."""

    def __init__(self, path: str, params: list[str] | None = None, absent_params: tuple = (), absent: bool = False):
        self.path, self.params, self.absent_params, self.absent = path, params, tuple(absent_params), absent

    def describe(self) -> str:
        name = self.path.replace(":", ".")
        if self.absent:
            return f"no {name}"
        if self.params is not None:
            return f"{name}({', '.join(self.params)})"
        if self.absent_params:
            return f"{name} without parameter {', '.join(self.absent_params)}"
        return name

    def found(self) -> str | None:
        """None when the expectation holds, else what was found instead."""
        try:
            obj = resolve(self.path)
        except (ImportError, AttributeError):
            return None if self.absent else _describe_missing(self.path)
        if self.absent:
            return f"{self.path.replace(':', '.')} is present"
        if self.params is not None or self.absent_params:
            try:
                ps = _params(obj)
            except (TypeError, ValueError):
                return f"{self.path.replace(':', '.')} has no inspectable signature"
            if self.params is not None and ps != self.params:
                return f"{self.path.replace(':', '.')}({', '.join(ps)})"
            extra = [p for p in self.absent_params if p in ps]
            if extra:
                return f"{self.path.replace(':', '.')}({', '.join(ps)})"
        return None


def _version_key(v: str) -> tuple:
    out = []
    for part in v.replace("+", ".").split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if not part.isdigit():
            break
    return tuple(out + [0] * (3 - len(out)))


class Adapter:
    name = ""
    serves = ("0", "0")  # [first, next) release versions
    summary = ""
    emulates: tuple[str, ...] = ()
    expects: tuple[Expect, ...] = ()

    def serves_version(self, version: str) -> bool:
        lo, hi = self.serves
        return _version_key(lo) <= _version_key(version) < _version_key(hi)

    def serves_text(self) -> str:
        lo, hi = self.serves
        return f">={lo},<{hi}"

    def check(self) -> None:
        problems = [(e.describe(), f) for e in self.expects if (f := e.found()) is not None]
        if problems:
            want = "; ".join(w for w, _ in problems)
            got = "; ".join(f for _, f in problems)
            raise LayoutMismatch(f"adapter {self.name} (serves vllm-omni {self.serves_text()}) expects {want}; found {got}")

    def bind(self) -> None:
        """Resolve the release functions (after check())."""
        self.flatten_payload = resolve(f"{KEYS}:flatten_payload")
        self.build_mm_cpu = resolve(f"{MM_OUTPUTS}:build_mm_cpu")
        self.to_payload_element = resolve(f"{MM_OUTPUTS}:to_payload_element")
        self.unflatten_payload = resolve(f"{KEYS}:unflatten_payload")
        self.async_proc = resolve(f"{STAGE_PROC}:talker2code2wav_async_chunk")

    def describe(self) -> dict:
        return {"name": self.name, "serves": self.serves_text(), "summary": self.summary,
                "emulates": list(self.emulates), "expects": [e.describe() for e in self.expects]}

    # ---- the per-request split (what the model runner does after make_omni_output) ----

    def mm_cpu(self, multimodal_outputs) -> dict:
        return self.build_mm_cpu(self.flatten_payload(multimodal_outputs) if multimodal_outputs else multimodal_outputs)

    def split(self, out, rids: list[str], spans: list[int]) -> dict[str, dict]:
        mm_cpu = self.mm_cpu(out.multimodal_outputs)
        hidden_seq_len = int(out.text_hidden_states.shape[0])
        scheduled = int(sum(spans))
        payloads, start = {}, 0
        for idx, (rid, span) in enumerate(zip(rids, spans)):
            end = start + span
            payload = self.split_one(mm_cpu, rid, idx, start, end, hidden_seq_len, scheduled)
            payloads[rid] = self.flatten_payload(payload)
            start = end
        return payloads

    def split_one(self, mm_cpu, rid, idx, start, end, hidden_seq_len, scheduled) -> dict:  # inline runner loop
        payload = {}
        for key, val in (mm_cpu or {}).items():
            if key in SPARSE_KEYS:
                continue
            payload[key] = self.to_payload_element(element=val, idx=idx, start=start, end=end,
                                                   pass_lists_through=False, **self.seq_kwargs(hidden_seq_len, scheduled))
        return payload

    def seq_kwargs(self, hidden_seq_len: int, scheduled: int) -> dict:
        return {"seq_len": hidden_seq_len}

    # ---- the no-async (full payload) path ----

    def full_payload_state(self) -> Any:
        raise NotImplementedError

    def accumulate(self, state, rid: str, payload: dict, request) -> None:
        raise NotImplementedError

    def finish(self, state, rid: str, request) -> Any:
        raise NotImplementedError

    # ---- the async-chunk path ----

    def transfer_manager(self, connector_extra: dict, max_num_seqs: int) -> Any:
        """A stand-in for the chunk transfer adapter: the attributes the async processor reads."""
        return SimpleNamespace(
            code_prompt_token_ids=defaultdict(list), put_req_chunk=defaultdict(int),
            ramp_chunk_count=defaultdict(int), request_payload={}, scheduler_max_num_seqs=max_num_seqs,
            connector=SimpleNamespace(config={"extra": dict(connector_extra)}))

    def async_step(self, tm, rid: str, payload: dict | None, request, finished: bool) -> Any:
        # the chunk transfer adapter unflattens the runner's flat payload before the processor
        nested = self.unflatten_payload(payload) if isinstance(payload, dict) else payload
        out = self.async_proc(tm, nested, request, is_finished=finished)
        if out is not None:  # what the transfer adapter does after a put
            tm.put_req_chunk[rid] += 1
            tm.ramp_chunk_count[rid] += 1
        return out


class _ConnectorAccumulator:
    """Full-payload accumulation on the talker's worker: the release's own
    accumulate_full_payload_output / _materialize_full_payload_entry on a host built via __new__."""

    host_paths = MIXIN_HOSTS

    def full_payload_state(self):
        host_cls = None
        for path in self.host_paths:
            try:
                cand = resolve(path)
            except (ImportError, AttributeError):
                continue
            if hasattr(cand, "accumulate_full_payload_output"):
                host_cls = cand
                break
        if host_cls is None:
            raise LayoutMismatch(f"adapter {self.name} expects accumulate_full_payload_output on one of "
                                 f"{', '.join(p.replace(':', '.') for p in self.host_paths)}; found none")
        host = host_cls.__new__(host_cls)
        host._pending_full_payload_send = {}
        host._custom_process_func = self.full_proc  # the replace-key set is read from its module
        host._stage_id = 0
        return host

    def accumulate(self, host, rid, payload, request):
        host.accumulate_full_payload_output(rid, payload, request)

    def finish(self, host, rid, request):
        entry = host._pending_full_payload_send.pop(rid, None)
        if entry is None:
            return None
        output, _req = host._materialize_full_payload_entry(entry)
        return self.full_proc(None, output, request)


class OrchestratorSplitV1(Adapter):
    name = "orchestrator-split-v1"
    serves = ("0.20.0", "0.22.0")
    summary = ("inline per-request split with to_payload_element(seq_len); no-async path: orchestrator "
               "accumulation (OmniRequestState) then talker2code2wav")
    emulates = ("the runner's per-request loop over mm_cpu calling to_payload_element (no prefix cache, no sparse audio)",
                "the chunk transfer adapter unflattening each step's payload for the async processor",
                "the engine handing each step's pooler output to OmniRequestState.add_multimodal_tensor(mm_type='latent')",
                "the orchestrator wrapping the finished request's multimodal_output for talker2code2wav",
                "the transfer adapter's put_req_chunk / ramp_chunk_count counters")
    expects = (
        Expect(f"{MM_OUTPUTS}:to_payload_element", absent_params=("scheduled_seq_len",)),
        Expect(f"{STAGE_PROC}:talker2code2wav", params=["source_outputs", "prompt", "_requires_multimodal_data"]),
        Expect(f"{STAGE_PROC}:talker2code2wav_full_payload", absent=True),
        Expect("vllm_omni.engine.output_processor:OmniRequestState"),
        Expect(f"{STAGE_PROC}:talker2code2wav_async_chunk"),
        Expect(f"{KEYS}:flatten_payload"),
        Expect(f"{KEYS}:unflatten_payload"),
    )

    def bind(self):
        super().bind()
        self.full_proc = resolve(f"{STAGE_PROC}:talker2code2wav")
        self.state_cls = resolve("vllm_omni.engine.output_processor:OmniRequestState")
        from vllm.sampling_params import RequestOutputKind

        self.output_kind = RequestOutputKind.FINAL_ONLY

    def full_payload_state(self):
        return {}

    def accumulate(self, states, rid, payload, request):
        st = states.get(rid)
        if st is None:
            st = self.state_cls.__new__(self.state_cls)
            st.mm_accumulated = {}
            st.output_kind = self.output_kind
            states[rid] = st
        st.add_multimodal_tensor(payload, "latent")

    def finish(self, states, rid, request):
        st = states.pop(rid, None)
        if st is None:
            return None
        st._consolidate_multimodal_tensors()
        output = SimpleNamespace(multimodal_output=st.mm_accumulated,
                                 cumulative_token_ids=list(request.output_token_ids))
        talker_output = SimpleNamespace(finished=True, outputs=[output], request_id=rid)
        prompts = self.full_proc([talker_output], None)
        return prompts[0] if prompts else None


class ConnectorSplitV1(_ConnectorAccumulator, Adapter):
    name = "connector-split-v1"
    serves = ("0.22.0", "0.24.0")
    summary = ("inline per-request split with to_payload_element(seq_len); no-async path: worker-side "
               "accumulate_full_payload_output then talker2code2wav_full_payload")
    emulates = ("the runner's per-request loop over mm_cpu calling to_payload_element (no prefix cache, no sparse audio)",
                "the chunk transfer adapter unflattening each step's payload for the async processor",
                "the flush at request end: _materialize_full_payload_entry then the stage's full-payload builder",
                "the transfer adapter's put_req_chunk / ramp_chunk_count counters")
    expects = (
        Expect(f"{MM_OUTPUTS}:to_payload_element", absent_params=("scheduled_seq_len",)),
        Expect(f"{STAGE_PROC}:talker2code2wav_full_payload", params=["transfer_manager", "pooling_output", "request"]),
        Expect(f"{STAGE_PROC}:talker2code2wav_async_chunk"),
        Expect("vllm_omni.worker.output.payload_build:build_omni_mm_payload", absent=True),
        Expect(f"{KEYS}:flatten_payload"),
        Expect(f"{KEYS}:unflatten_payload"),
    )

    def bind(self):
        super().bind()
        self.full_proc = resolve(f"{STAGE_PROC}:talker2code2wav_full_payload")


class ConnectorSplitV2(ConnectorSplitV1):
    name = "connector-split-v2"
    serves = ("0.24.0", "0.28.0")
    summary = ("inline per-request split with to_payload_element(seq_len, scheduled_seq_len); no-async path: "
               "worker-side accumulate_full_payload_output then talker2code2wav_full_payload")
    expects = (
        Expect(f"{MM_OUTPUTS}:to_payload_element",
               params=["element", "idx", "start", "end", "pass_lists_through", "seq_len", "scheduled_seq_len"]),
        Expect(f"{STAGE_PROC}:talker2code2wav_full_payload", params=["transfer_manager", "pooling_output", "request"]),
        Expect(f"{STAGE_PROC}:talker2code2wav_async_chunk"),
        Expect("vllm_omni.worker.output.payload_build:build_omni_mm_payload", absent=True),
        Expect(f"{KEYS}:flatten_payload"),
        Expect(f"{KEYS}:unflatten_payload"),
    )

    def seq_kwargs(self, hidden_seq_len, scheduled):
        return {"seq_len": hidden_seq_len, "scheduled_seq_len": scheduled}


class PayloadBuildV1(ConnectorSplitV1):
    name = "payload-build-v1"
    serves = ("0.28.0", "0.32.0")
    summary = ("per-request split by vLLM-Omni's build_omni_mm_payload; no-async path: accumulate_full_payload_output "
               "then talker2code2wav_full_payload")
    emulates = ("the runner's loop calling build_omni_mm_payload per request (no prefix cache, no sparse audio)",
                "the chunk transfer adapter unflattening each step's payload for the async processor",
                "the flush at request end: _materialize_full_payload_entry then the stage's full-payload builder",
                "the transfer adapter's put_req_chunk / ramp_chunk_count counters")
    expects = (
        Expect("vllm_omni.worker.output.payload_build:build_omni_mm_payload",
               params=["combined_multimodal_outputs", "mm_cpu", "rid", "idx", "start", "end", "audio_sparse_output",
                       "sparse_mm_index", "hidden_seq_len", "scheduled_seq_len"]),
        Expect(f"{STAGE_PROC}:talker2code2wav_full_payload", params=["transfer_manager", "pooling_output", "request"]),
        Expect(f"{STAGE_PROC}:talker2code2wav_async_chunk"),
        Expect(f"{KEYS}:flatten_payload"),
        Expect(f"{KEYS}:unflatten_payload"),
    )

    def bind(self):
        super().bind()
        self.build_payload = resolve("vllm_omni.worker.output.payload_build:build_omni_mm_payload")

    def split_one(self, mm_cpu, rid, idx, start, end, hidden_seq_len, scheduled):
        return self.build_payload(combined_multimodal_outputs=None, mm_cpu=mm_cpu, rid=rid, idx=idx, start=start,
                                  end=end, audio_sparse_output=False, sparse_mm_index={},
                                  hidden_seq_len=hidden_seq_len, scheduled_seq_len=scheduled)


ADAPTERS: dict[str, Callable[[], Adapter]] = {
    a.name: a for a in (OrchestratorSplitV1, ConnectorSplitV1, ConnectorSplitV2, PayloadBuildV1)
}


def for_version(version: str) -> Adapter:
    """The adapter whose release range holds `version`; LayoutMismatch when none does."""
    hits = [cls() for cls in ADAPTERS.values() if cls().serves_version(version)]
    if not hits:
        known = ", ".join(f"{cls.name} {cls().serves_text()}" for cls in ADAPTERS.values())
        raise LayoutMismatch(f"no adapter serves vllm-omni {version} (adapters: {known}); "
                             f"a new payload layout needs a new adapter in runners/handoff_probe/adapters.py")
    return hits[0]
