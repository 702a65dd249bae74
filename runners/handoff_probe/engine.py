"""One probed case: a few scheduler steps of a talker batch, through the release's hand-off code.

Per step, for the requests active in it (in the case's arrival order):

1. each request's persistent intermediate buffer is updated as the talker's preprocess does
   (first prefill: `codes.ref` and `meta.ref_code_len` for an in-context voice clone,
   `meta.codec_streaming`, zero codec rows for the prompt; decode: one codec row),
2. the REAL `make_omni_output` runs on a talker built via `__new__` (async_chunk set through
   `vllm_config.model_config`, as upstream's test does),
3. the adapter splits its output per request (release code: flatten, build_mm_cpu,
   to_payload_element or build_omni_mm_payload),
4. the REAL stage processors run: `talker2code2wav_async_chunk` per request per step (async), or
   the release's accumulator then its full-payload builder when the request finishes.

Everything each request hands on is recorded as flat `path -> JSON value` observations.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

# the repository is the probe's working folder: difftest.family is standard library only
from difftest.family import CODEBOOKS as NUM_CODE_GROUPS
from runners.handoff_probe.adapters import TALKER, Adapter, resolve

HIDDEN = 8


def to_json(value: Any) -> Any:
    """Tensors, msgspec structs, dicts, lists -> plain JSON values."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        if t.dtype == torch.bool:
            vals = t.reshape(-1).tolist()
        elif t.is_floating_point():
            vals = [float(x) for x in t.reshape(-1).tolist()]
        else:
            vals = [int(x) for x in t.reshape(-1).tolist()]
        return {"tensor": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "values": vals}
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if hasattr(value, "__struct_fields__"):  # msgspec.Struct
        return {f: to_json(getattr(value, f)) for f in value.__struct_fields__ if getattr(value, f) is not None}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def flatten(prefix: str, value: Any, out: dict) -> None:
    if isinstance(value, dict) and "tensor" not in value:
        if not value:
            out[prefix] = {}
        for k, v in value.items():
            flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out[prefix] = value


class Talker:
    def __init__(self):
        self.cls = resolve(TALKER)
        self.plain = self.cls.__new__(self.cls)
        self.async_ = self.cls.__new__(self.cls)
        object.__setattr__(self.async_, "vllm_config",
                           SimpleNamespace(model_config=SimpleNamespace(async_chunk=True)))

    def get(self, async_chunk: bool):
        return self.async_ if async_chunk else self.plain


class Request:
    """The attributes the stage processors read from a request."""

    def __init__(self, rid: str, n_tokens: int):
        self.external_req_id = self.request_id = rid
        self.additional_information = None
        self.output_token_ids = [1] * n_tokens
        self.prompt_token_ids = [1]
        self._finished = False

    def is_finished(self) -> bool:
        return self._finished


def run_case(case: dict, adapter: Adapter, talker: Talker, deploy: dict) -> dict:
    """-> {"requests": {rid: {path: value}}, "raised": None | {"where", "type", "message"}}."""
    reqs = {r["id"]: r for r in case["requests"]}
    order = list(case["order"])
    async_chunk = bool(case["async_chunk"])
    obs: dict[str, dict] = {rid: {} for rid in reqs}
    buffers: dict[str, dict] = {rid: {} for rid in reqs}
    requests = {rid: Request(rid, r["decode_steps"] + 1) for rid, r in reqs.items()}
    chunks = {rid: 0 for rid in reqs}
    model = talker.get(async_chunk)
    where = "setup"
    try:
        if async_chunk:
            tm = adapter.transfer_manager(deploy["connector_extra"], deploy["max_num_seqs"])
        else:
            state = adapter.full_payload_state()
        last = max(r["join"] + r["decode_steps"] for r in reqs.values())
        for step in range(last + 1):
            active = [rid for rid in order if reqs[rid]["join"] <= step <= reqs[rid]["join"] + reqs[rid]["decode_steps"]]
            if not active:
                continue
            infos, spans = [], []
            for rid in active:
                r, buf = reqs[rid], buffers[rid]
                local = step - r["join"]
                if local == 0:
                    codes = buf.setdefault("codes", {})
                    meta = buf.setdefault("meta", {})
                    meta["codec_streaming"] = True
                    if r.get("ref"):
                        codes["ref"] = torch.tensor(r["ref"], dtype=torch.long)
                        meta["ref_code_len"] = len(r["ref"])
                    codes["audio"] = torch.zeros((r["prefill_len"], NUM_CODE_GROUPS), dtype=torch.long)
                else:
                    buf["codes"]["audio"] = torch.tensor([r["audio"][local - 1]], dtype=torch.long)
                infos.append(buf)
                spans.append(int(buf["codes"]["audio"].shape[0]))
            where = "make_omni_output"
            hidden = torch.zeros((sum(spans), HIDDEN), dtype=torch.float32)
            out = model.make_omni_output(hidden, model_intermediate_buffer=infos)
            where = f"split ({adapter.name})"
            payloads = adapter.split(out, active, spans)
            for rid in active:
                local = step - reqs[rid]["join"]
                flatten(f"step{local}.payload", to_json(payloads[rid]), obs[rid])
            for rid in active:
                local = step - reqs[rid]["join"]
                finished = local == reqs[rid]["decode_steps"]
                req = requests[rid]
                req._finished = finished
                if async_chunk:
                    where = "talker2code2wav_async_chunk"
                    res = adapter.async_step(tm, rid, payloads[rid], req, finished)
                    if res is not None:
                        n = chunks[rid]
                        chunks[rid] += 1
                        obs[rid][f"chunk{n}.at_step"] = local
                        flatten(f"chunk{n}", to_json(res), obs[rid])
                else:
                    where = "full-payload accumulate"
                    adapter.accumulate(state, rid, payloads[rid], req)
                    if finished:
                        where = "full-payload builder"
                        res = adapter.finish(state, rid, req)
                        flatten("code2wav", to_json(res), obs[rid])
        return {"requests": obs, "raised": None}
    except Exception as e:  # a release function raised on this batch: a result, not a probe crash
        return {"requests": obs, "raised": {"where": where, "type": type(e).__name__, "message": str(e)[:500]}}
