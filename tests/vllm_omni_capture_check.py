"""Run by the vLLM-Omni environment's interpreter (tests/test_vllm_omni.py): the capture wrappers
around vLLM-Omni's real Qwen3-TTS hand-off functions, fed synthetic batches.

    .venv-vllm-omni/bin/python tests/vllm_omni_capture_check.py WORKDIR   -> one JSON line on stdout

(tests/test_vllm_omni.py runs it with the platform check in one process: tests/vllm_omni_env_checks.py.)

For each case it records what the wrapped function returned against what the
unwrapped one returns for the same inputs, and what the capture files hold.
Nothing here needs a model or a server.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

Q = 16


def same(a, b) -> bool:
    """Deep equality of payloads: dicts, msgspec structs, tensors, scalars."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if hasattr(a, "__struct_fields__"):
        return type(a) is type(b) and all(same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def request(rid: str, tag: str | None, n_out: int = 0, finished: bool = False):
    extra = {"difftest_tag": tag} if tag else {}
    return SimpleNamespace(request_id=rid, external_req_id=rid, output_token_ids=list(range(n_out)),
                           sampling_params=SimpleNamespace(extra_args=extra), additional_information=None,
                           is_finished=lambda: finished)


def codes(seed: int, frames: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 2048, (frames, Q), generator=g, dtype=torch.long)


NAMES = ("talker2code2wav_full_payload", "talker2code2wav_async_chunk")


def wrap(proc, hooks, root: Path):
    """Wrap both hand-off functions with a fresh capture into `root`; returns (capture, originals, wrapped names)."""
    originals = {n: getattr(proc, n) for n in NAMES}
    for n, fn in originals.items():  # undo an earlier case's wrapping
        setattr(proc, n, getattr(fn, "__wrapped__", fn) if getattr(fn, "__difftest_capture__", False) else fn)
    originals = {n: getattr(proc, n) for n in NAMES}
    cap = hooks.Capture(root)
    return cap, originals, hooks.wrap_stage_functions(proc, cap)


def restore(proc, originals: dict) -> None:
    for n, fn in originals.items():
        setattr(proc, n, fn)


def load(root: Path, tag: str) -> dict:
    with np.load(root / f"{tag}.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def full_payload_batch(proc, hooks, root: Path) -> dict:
    """Three co-batched requests (two with their own reference, one without), as the talker's split hands them."""
    cap, originals, wrapped = wrap(proc, hooks, root)
    original = originals["talker2code2wav_full_payload"]
    fn = proc.talker2code2wav_full_payload
    batch = [("r0", "full-0", codes(1, 6), codes(11, 3)), ("r1", "full-1", codes(2, 4), None),
             ("r2", "full-2", codes(3, 5), codes(13, 4))]
    out = {"wrapped": wrapped, "signature_kept": str(__import__("inspect").signature(fn))
           == str(__import__("inspect").signature(original)), "name_kept": fn.__name__ == original.__name__,
           "requests": {}}
    for rid, tag, audio, ref in batch:
        if rid != "r1":  # the talker's first prefill, as preprocess returns it; r1's is never filed
            update = {"embed": {"prefill": torch.zeros(30 + rid.count("2"), 8)}, "codes": {"ref": ref.clone()},
                      "meta": {"ref_code_len": int(ref.shape[0])}}
            key = "req_id" if rid == "r2" else "request_id"  # r2 as model runner v2 names it (worker_v2)
            cap.talker_input({key: rid, "_omni_prompt_len": 30}, (None, None, update))
        pooling = {"codes.audio": audio.clone(), "codes.ref": [ref.clone() if ref is not None else torch.empty(0)],
                   "meta.ref_code_len": torch.tensor([ref.shape[0] if ref is not None else 0])}
        req = request(rid, tag, n_out=audio.shape[0] + 1)
        got = fn(None, pooling, req)
        want = original(None, {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in pooling.items()}, req)
        f = load(root, tag)
        out["requests"][tag] = {
            "returned_identical": same(got, want),
            "codes_match": bool(np.array_equal(f["codes"], audio.numpy())),
            "ref_match": bool(np.array_equal(f["ref_codes"], ref.numpy() if ref is not None else np.zeros((0, Q)))),
            "codes_shape": list(f["codes"].shape), "ref_shape": list(f["ref_codes"].shape),
            "dtype": str(f["codes"].dtype), "has_wav": "wav" in f,
            "talker_ref_match": bool(ref is not None and "talker_ref_codes" in f
                                     and np.array_equal(f["talker_ref_codes"], ref.numpy())),
            "talker_prompt": f["talker_prompt"].tolist() if "talker_prompt" in f else None,
            "talker_tokens": f["talker_tokens"].tolist() if "talker_tokens" in f else None,
            "talker_missing": str(f["talker_missing"]) if "talker_missing" in f else None,
        }
    untagged = request("r9", None, n_out=3)
    fn(None, {"codes.audio": codes(9, 2)}, untagged)
    out["untagged_files"] = sorted(p.name for p in root.glob("*.npz") if not p.name.startswith("full-"))
    restore(proc, originals)
    return out


class TransferManager:
    """The attributes talker2code2wav_async_chunk reads, as the chunk adapter provides them."""

    def __init__(self, chunk: int = 4, initial: int = 2):
        self.code_prompt_token_ids = collections.defaultdict(list)
        self.put_req_chunk = collections.defaultdict(int)
        self.ramp_chunk_count = {}
        self.scheduler_max_num_seqs = 4
        self.connector = SimpleNamespace(config={"extra": {"codec_chunk_frames": chunk, "codec_left_context_frames": 8,
                                                           "initial_codec_chunk_frames": initial}})


def async_chunk_batch(proc, hooks, root: Path) -> dict:
    """Two requests stepped together through the real batched builder (it calls the scalar hook per request)."""
    _, originals, _ = wrap(proc, hooks, root)
    original = originals["talker2code2wav_async_chunk"]
    tm_wrapped, tm_plain = TransferManager(), TransferManager()
    steps = 9
    streams = {"a0": ("async-0", codes(21, steps), codes(31, 3)), "a1": ("async-1", codes(22, steps), codes(32, 5))}
    identical, emitted = True, collections.Counter()

    def step_inputs(step):
        outs, reqs, fins = [], [], []
        for rid, (tag, audio, ref) in streams.items():
            mm = {"codes": {"audio": audio[step:step + 1].clone()}, "meta": {"codec_frame_valid": True}}
            if step == 0:
                mm["codes"]["ref"] = ref.clone()
            outs.append(mm)
            reqs.append(request(rid, tag, finished=step == steps - 1))
            fins.append(step == steps - 1)
        return outs, reqs, fins

    for step in range(steps):
        got = proc.talker2code2wav_async_chunk_batch(tm_wrapped, *step_inputs(step))  # through the wrapper
        wrapped_fn, proc.talker2code2wav_async_chunk = proc.talker2code2wav_async_chunk, original
        try:  # the same step, unwrapped, on its own transfer manager
            want = proc.talker2code2wav_async_chunk_batch(tm_plain, *step_inputs(step))
        finally:
            proc.talker2code2wav_async_chunk = wrapped_fn
        identical = identical and same(got, want)
        for tm, res in ((tm_wrapped, got), (tm_plain, want)):
            for rid, r in zip(streams, res):
                if r is not None:
                    tm.put_req_chunk[rid] += 1
        for r in got:
            if r is not None:
                emitted[r.meta.request_id] += 1
    out = {"returned_identical": identical, "chunks": dict(emitted), "requests": {}}
    for rid, (tag, audio, ref) in streams.items():
        f = load(root, tag)
        out["requests"][tag] = {"codes_match": bool(np.array_equal(f["codes"], audio.numpy())),
                                "ref_match": bool(np.array_equal(f["ref_codes"], ref.numpy())),
                                "chunk_frames": f["chunk_frames"].tolist(), "handoff": str(f["handoff"])}
    restore(proc, originals)
    return out


def failing_write(proc, hooks, root: Path, logs: list) -> dict:
    """The capture folder vanishes (replaced by a file) after start: every write fails; the call must not."""
    _, originals, _ = wrap(proc, hooks, root)
    original = originals["talker2code2wav_full_payload"]
    hooks._warned.clear()
    shutil.rmtree(root)
    root.write_text("not a folder")
    pooling = {"codes.audio": codes(5, 3), "codes.ref": [codes(6, 2)], "meta.ref_code_len": torch.tensor([2])}
    req = request("rf", "broken", n_out=4)
    try:
        got = proc.talker2code2wav_full_payload(None, dict(pooling), req)
        raised = None
    except Exception as e:  # must not happen
        got, raised = None, repr(e)
    want = original(None, dict(pooling), req)
    restore(proc, originals)
    return {"raised": raised, "returned_identical": got is not None and same(got, want),
            "warned": any("could not capture" in m for m in logs)}


def unset_variable(proc) -> dict:
    """Without DIFFTEST_CAPTURE_DIR, register() patches nothing."""
    import difftest_capture

    os.environ.pop("DIFFTEST_CAPTURE_DIR", None)
    difftest_capture.register()
    return {"patched": any(getattr(getattr(proc, n), "__difftest_capture__", False)
                           for n in ("talker2code2wav_full_payload", "talker2code2wav_async_chunk"))}


def length_cap() -> dict:
    """DIFFTEST_ACCEPT_LENGTH_FINISH: the adapter's length-finish refusal is skipped once it is imported."""
    import difftest_capture

    os.environ["DIFFTEST_ACCEPT_LENGTH_FINISH"] = "1"
    difftest_capture.register()  # before the adapter is imported: patched on import
    from vllm_omni.entrypoints.openai.tts_adapters import qwen3_tts as adapter

    a = adapter.Qwen3TTSAdapter.__new__(adapter.Qwen3TTSAdapter)
    params = {adapter.QWEN3_TTS_EFFECTIVE_MAX_TOKENS_KEY: [32], "task_type": ["Base"]}
    patched = adapter.Qwen3TTSAdapter.validate_generation
    try:
        patched.__wrapped__(a, params, stage0_finish_reason="length", output_tokens=32)
        original_refuses = False
    except adapter.Qwen3TTSCodecLimitError:
        original_refuses = True
    return {"accepted": patched(a, params, stage0_finish_reason="length", output_tokens=32) is None,
            "original_refuses": original_refuses,
            "stop_unchanged": patched(a, params, stage0_finish_reason="stop", output_tokens=5) is None}


def omni_handoff(root: Path) -> dict:
    """Qwen3-Omni's real hand-off functions, wrapped by omni_hooks: the full payload of one request
    (its prefill row a zero placeholder, as the talker leaves it), and a request stepped through async
    chunks (initial chunk 2, then 4, left context 8). The capture holds what each returned, and the
    talker's tokens."""
    import vllm_omni.model_executor.stage_input_processors.qwen3_omni as proc
    from difftest_capture import omni_hooks

    originals = {n: getattr(proc, n) for n in NAMES}
    cap = omni_hooks.OmniCapture(__import__("difftest_capture.store", fromlist=["CaptureStore"]).CaptureStore(root))
    wrapped = omni_hooks.wrap(proc, cap)
    # the talker's prefill as vLLM-Omni's model calls it (the real class's methods and parameters, checked
    # below), on a stand-in class: request o0 prompted with speaker 2302 and the chat turn `turn`
    import inspect

    from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni import Qwen3OmniMoeForConditionalGeneration as real

    params = {n: list(inspect.signature(getattr(real, n)).parameters) for n in omni_hooks.MODEL_METHODS}
    turn = [151644, 872, 9, 10, 151645, 151644, 77091]

    class Model:
        config = SimpleNamespace(talker_config=SimpleNamespace(codec_nothink_id=2155, codec_think_bos_id=2156,
                                                               codec_think_eos_id=2157))

        def _thinker_to_talker_prefill(self, thinker_embed=None, thinker_hidden=None, multimodal_mask=None,
                                       input_ids=None, thinker_result_ids=None, speaker_id=None):
            return self._get_talker_assistant_parts(5, 7, speaker_id, None, None, None, None)

        def _get_talker_assistant_parts(self, im_start_index, segment_end_index, speaker_id, *rest):
            return speaker_id

        def talker_preprocess_prefill(self, input_ids, input_embeds, payload):
            return self._thinker_to_talker_prefill(input_ids=torch.tensor([turn]), speaker_id=2302)

    model_wrapped = omni_hooks.wrap_model(Model, cap)
    Model().talker_preprocess_prefill(None, None, {"request_id": "o0"})
    Model().talker_preprocess_prefill(None, None, {"request_id": "o0"})  # a later prefill step: filed once
    frames = codes(41, 6)
    rows = torch.cat([torch.zeros(1, Q, dtype=torch.long), frames])  # row 0: the prefill's placeholder
    tokens = frames[:, 0].tolist() + [int(frames[-1, 0]) + 1]  # the talker's ids: one per frame, and its last
    req = request("o0", "omni-full", n_out=0)
    req.output_token_ids = tokens
    got = proc.talker2code2wav_full_payload(None, {"codes.audio": rows.clone()}, req)
    want = originals["talker2code2wav_full_payload"](None, {"codes.audio": rows.clone()}, req)
    f = load(root, "omni-full")
    handed = np.asarray(got["codes"]["audio"]).reshape(Q, -1).T
    out = {"wrapped": wrapped, "full": {"returned_identical": same(got, want),
                                        "codes_are_returned": bool(np.array_equal(f["codes"], handed)),
                                        "frames": int(f["codes"].shape[0]), "tokens": f["talker_tokens"].tolist() == tokens,
                                        "first_frame_zero": bool(not f["codes"][0].any()),
                                        "prompt": f["talker_prompt"].tolist(), "handoff": str(f["handoff"]),
                                        "input": {"text": f["input_text_ids"].tolist() == turn,
                                                  "speaker": f["input_speaker_id"].tolist(),
                                                  "prefill": f["input_codec_prefill"].tolist()}},
           "model_wrapped": model_wrapped, "model_params": params}
    tm = TransferManager(chunk=4, initial=2)
    steps, stream = 9, codes(42, 9)
    payloads = 0
    for step in range(steps):
        r = request("o1", "omni-async", n_out=step + 1, finished=step == steps - 1)
        res = proc.talker2code2wav_async_chunk(tm, {"codes": {"audio": stream[step:step + 1].clone()}}, r,
                                               is_finished=step == steps - 1)
        if res is not None:
            tm.put_req_chunk["o1"] += 1
            payloads += 1
    f = load(root, "omni-async")
    out["async"] = {"codes_match": bool(np.array_equal(f["codes"], stream.numpy())), "payloads": payloads,
                    "chunk_frames": f["chunk_frames"].tolist(), "handoff": str(f["handoff"]),
                    "tokens": len(f["talker_tokens"])}
    restore(proc, originals)
    return out


def omni_greedy() -> dict:
    """DIFFTEST_OMNI_SUBTALKER_GREEDY: Qwen3-Omni's code predictor takes the first maximal logit, ties
    included; the shared wrapper (Qwen3-TTS's predictor) still samples."""
    import difftest_capture
    import torch

    os.environ["DIFFTEST_OMNI_SUBTALKER_GREEDY"] = "1"
    difftest_capture.register()
    from vllm_omni.model_executor.models.common.qwen3_code_predictor import CodePredictorWrapper
    from vllm_omni.model_executor.models.qwen3_omni import qwen3_omni_moe_code_predictor_mtp as mtp

    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0]] * 64, dtype=torch.bfloat16)
    greedy = mtp.Qwen3OmniMoeTalkerCodePredictor._sample_codes_gumbel(logits)
    shared = CodePredictorWrapper._sample_codes_gumbel(logits)
    return {"greedy": sorted(set(greedy.flatten().tolist())), "shared_samples": sorted(set(shared.flatten().tolist()))}


def main() -> int:
    print(json.dumps(checks(Path(sys.argv[1]))))
    return 0


def checks(work: Path) -> dict:
    logs: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            logs.append(record.getMessage())

    import vllm_omni.model_executor.stage_input_processors.qwen3_tts as proc
    from difftest_capture import hooks

    logging.getLogger("vllm.difftest_capture").addHandler(Keep())  # after vLLM has configured logging

    result = {"unset": unset_variable(proc)}
    result["full_payload"] = full_payload_batch(proc, hooks, work / "full")
    result["async_chunk"] = async_chunk_batch(proc, hooks, work / "async")
    result["failing_write"] = failing_write(proc, hooks, work / "broken", logs)
    result["length_cap"] = length_cap()
    result["omni_handoff"] = omni_handoff(work / "omni")
    result["omni_greedy"] = omni_greedy()
    return result


if __name__ == "__main__":
    sys.exit(main())
