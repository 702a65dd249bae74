"""The capture plugin on model runner v2's talker path (runners/vllm_omni/difftest_capture/
difftest_capture/v2.py), MRV2 being vLLM-Omni 0.30's default for Qwen3-TTS on CUDA. It cannot run
as a whole on this CPU (the CPU platform hangs under v2), so tests/vllm_omni_capture_v2_check.py
drives vLLM-Omni's and vLLM's own v2 functions on CPU tensors in `.venv-vllm-omni`, with the plugin
installed as a server installs it, once for this file (about 30 s):

- the talker's input and its assembled prompt rows: v2's `OmniModelState.run_preprocess` with the
  talker's own `preprocess`, `preprocess_batch_mrv2` and prompt builder (tiny checkpoints), a
  chunked prefill and a resume after preemption among them;
- the talker's top-k: v2's `GPUModelRunner.sample` and `Sampler` (its Triton kernels in Triton's
  interpreter) on the talker's own `compute_logits`.

Filed values are checked against what the unwrapped functions build (the prompt rows, the
reference codes) and against a computation done without vLLM (codec mask, min-tokens, the
repetition penalty, log_softmax before temperature). Each field is also shown missing when its
wrapper is taken off. What stays uncovered is named in the check script's docstring: the Gumbel
and top-k/top-p kernels are stand-ins, vLLM's ParallelLMHead is a float32 linear, and the engine's
scheduler, InputBatch and KV cache are not run.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference_support import tiny  # noqa: F401
from vllm_omni_support import REPO, run_in_env


@pytest.fixture(scope="module")
def checked(tiny, tmp_path_factory):  # noqa: F811
    return run_in_env([str(REPO / "tests" / "vllm_omni_capture_v2_check.py"), str(tiny),
                       str(tmp_path_factory.mktemp("capture-v2"))], timeout=600)


def test_a_server_install_wraps_v2s_talker_path_once(checked):
    got = checked["install"]
    # hooks.install: v1's wrappers and v2's (the talker's compute_logits wrapped by both), marked
    assert got["marked"] == {"talker_v2": True, "talker_v1": True, "sampler": True, "temperature": True,
                             "preprocess": True}
    assert got["second_install_wrapped"] == [] and got["temperature_once"]  # idempotent: nothing wrapped twice
    assert got["sampler_name_kept"]


def test_v2s_prefill_files_the_talkers_input_and_prompt_rows(checked):
    got = checked["input"]
    assert got["returned_identical"], "the wrapped run_preprocess handed the forward other ids or embeddings"
    # v2's batched pass ran and tokenized the clone's texts ahead (Base only), as on a GPU
    assert got["precomputed"] == {"req-icl": True, "req-cv": False}
    for rid, r in got["requests"].items():
        assert r["filed"] is not None, f"{rid}: no talker input filed under v2"
        assert r["input_missing"] is None
        for field, want in r["expect"].items():
            assert r["filed"][field] == want, (rid, field, r["filed"][field], want)
    icl, cv = got["requests"]["req-icl"], got["requests"]["req-cv"]
    # [positions reserved, rows built, ref_code_len]: the clone prefilled in two chunks is filed once,
    # whole, from its first; its 7 reference frames are the talker's prompt's
    reserved, rows, ref_len = icl["filed"]["talker_prompt"]
    assert reserved == rows + 2 and rows > 7 and ref_len == 7
    assert np.array(icl["filed"]["talker_ref_codes"]).shape == (7, 16)
    assert cv["filed"]["talker_prompt"][2] == -1 and cv["filed"]["talker_ref_codes"] == []
    assert len(cv["filed"]["input_text_ids"]) > 5


def test_v2s_prefill_files_the_talkers_prompt_rows_as_the_forward_got_them(checked):
    """input_prompt_embeds: the rows every prefill step handed the forward (the clone's two chunks
    joined), the builder's prompt then the pad rows `preprocess` appends to the two positions
    reserved past it, in float32 from the talker's bf16; filed once, with the input."""
    for rid, r in checked["input"]["requests"].items():
        assert r["input_prompt_missing"] is None, (rid, r["input_prompt_missing"])
        assert r["rows_are_built_then_pad"], rid
        assert r["rows_dtype"] == "float32" and r["filed"]["input_prompt_dtype"] == "bfloat16"
        reserved = r["filed"]["talker_prompt"][0]
        assert np.array(r["filed"]["input_prompt_embeds"]).shape == (reserved, 32)


def test_a_prompt_rebuilt_on_a_resume_after_preemption_is_not_filed_again(checked):
    got = checked["input"]["resume"]
    assert got["filed_first"] and got["first_equal"]  # the first prefill's rows, as handed over
    assert got["rebuilt_same"]  # v2 drops the buffer on preemption and builds the same prompt again ...
    assert not got["filed_again"]  # ... which is not recorded a second time (rows nor input)


def test_without_the_preprocess_wrapper_v2_files_no_input(checked):
    assert checked["input"]["unwrapped_filed"] == {"req-icl": False, "req-cv": False}


def _same_topk(filed: dict, want: dict) -> None:
    assert filed["pos"] == want["pos"]
    assert filed["ids"] == want["ids"], (filed["ids"], want["ids"])
    assert np.allclose(filed["logprobs"], want["logprobs"], rtol=0, atol=2e-5), (filed["logprobs"], want["logprobs"])


def test_v2s_sampler_files_the_talkers_top_k_before_temperature(checked):
    got = checked["topk"]["sampled"]
    assert got["returned_identical"], "the wrapped v2 sampler sampled something else"
    # one record per talker row that samples: the clone's first prefill chunk samples nothing and is not filed
    for rid, want in got["expect"].items():
        filed = got["steps"][rid]
        assert [s["pos"] for s in filed] == [w["pos"] for w in want], (rid, filed)
        for f, w in zip(filed, want):
            _same_topk(f, w)
    # the penalty and min-tokens were applied where the capture reads: not the raw logits
    cv0, cv1 = got["expect"]["req-cv"]
    assert cv0["raw_ids"][0] == 2150 and 2150 not in cv0["ids"]  # EOS masked by min-tokens
    assert cv1["ids"][0] == cv1["raw_ids"][0] and cv1["logprobs"][0] < cv1["raw_logprobs"][0] - 1e-5  # penalised
    # joined with the talker's tokens as the hand-off joins them (by position)
    assert got["aligned"]["req-cv"]["topk_ids"] == [cv0["ids"], cv1["ids"]]
    assert got["aligned"]["req-icl"]["topk_ids"] == [got["expect"]["req-icl"][0]["ids"]]


def test_a_batch_sampled_untouched_is_filed_after_the_call(checked):
    got = checked["topk"]["greedy"]  # greedy, no penalty, no min-tokens: v2 never reaches temperature
    assert got["returned_identical"] and got["sampled"] == got["expect"]["ids"][0]
    assert got["expect"]["ids"] == got["expect"]["raw_ids"]
    assert len(got["steps"]) == 1
    _same_topk(got["steps"][0], got["expect"])


def test_only_the_talkers_rows_are_filed_and_none_without_the_wrappers(checked):
    got = checked["topk"]
    assert got["other_model_filed"] is False  # logits that are not the talker's compute_logits' own
    assert got["dummy_run_filed"] == 0  # v2's profiling run: the talker's logits, no request of the engine's
    assert got["unwrapped"] == {"steps": None, "aligned_rows": 0}  # the top-k stays "not captured"


# --------------------------------------------------------------------------------------------
# scripts/gpu-check.sh's check of the capture (difftest/commands/gpucheck.py), on a synthetic run folder
# --------------------------------------------------------------------------------------------

TALKER_ARRAYS = {"talker_ref_codes": np.zeros((3, 16), np.int64), "talker_prompt": np.array([40, 38, 3], np.int64),
                 "talker_tokens": np.array([5, 9, 2150], np.int64), "input_text_ids": np.arange(8, dtype=np.int64),
                 "talker_topk_ids": np.zeros((3, 5), np.int64), "talker_topk_logprobs": np.zeros((3, 5), np.float32),
                 "input_prompt_embeds": np.zeros((40, 8), np.float32)}


def _run(tmp_path, files: dict, device: str = "cuda", overlay: dict | None = None, base: dict | None = None):
    """A run folder as `difftest run` leaves it: report.json, the deploy overlay (over a base file
    like the release's qwen3_tts.yaml, whose model_runner is v2) and capture files."""
    import json

    import yaml

    run = tmp_path / "run"
    (run / "capture").mkdir(parents=True)
    (run / "vllm-omni").mkdir()
    (tmp_path / "qwen3_tts.yaml").write_text(yaml.safe_dump(base if base is not None else {
        "model_runner": "v2", "platforms": {"rocm": {"model_runner": "v1"}, "npu": {"model_runner": "v1"}}}))
    (run / "vllm-omni" / "deploy-overlay.yaml").write_text(yaml.safe_dump(
        {"base_config": str(tmp_path / "qwen3_tts.yaml"), **(overlay or {})}))
    (run / "report.json").write_text(json.dumps({
        "exit_code": 0, "verdict": "pass", "concurrency": 4, "counts": {"identical": len(files)},
        "candidate": {"device": device, "capture": True,
                      "deploy_overlay": str(run / "vllm-omni" / "deploy-overlay.yaml")}}))
    for name, arrays in files.items():
        np.savez(run / "capture" / f"{name}.npz", codes=np.zeros((2, 16), np.int64), **arrays)
    return run


def test_gpu_check_passes_a_v2_run_whose_capture_has_the_talkers_fields(tmp_path):
    from difftest.commands import gpucheck

    got = gpucheck.summary(_run(tmp_path, {"s1": TALKER_ARRAYS, "s2": TALKER_ARRAYS}), gpu_list=["GPU 0"])
    assert got["ok"] and "error" not in got
    assert got["capture"]["model_runner"] == "v2" and got["capture"]["missing"] == {} and got["capture"]["files"] == 2


@pytest.mark.parametrize("drop, named", [
    ("talker_topk_ids", "talker_topk_ids (the talker's top-k) missing from 1 of 2 capture files"),
    ("talker_prompt", "talker_prompt (the talker's prompt rows) missing from 1 of 2 capture files"),
    ("input_text_ids", "input_text_ids (the talker's input) missing from 1 of 2 capture files"),
    ("talker_ref_codes", "talker_ref_codes (the talker's input) missing from 1 of 2 capture files"),
    ("input_prompt_embeds", "input_prompt_embeds (the talker's assembled prompt) missing from 1 of 2 capture files"),
])
def test_gpu_check_fails_a_v2_run_naming_the_missing_field(tmp_path, capsys, drop, named):
    from difftest.commands import gpucheck

    lacking = {k: v for k, v in TALKER_ARRAYS.items() if k != drop}
    run = _run(tmp_path, {"s1": TALKER_ARRAYS, "s2": lacking})
    got = gpucheck.summary(run, gpu_list=["GPU 0"])
    assert got["ok"] is False and got["error"].startswith("capture incomplete under model runner v2: ")
    assert named in got["error"], got["error"]
    assert gpucheck.main(["summary", str(run)]) == 3  # scripts/gpu-check.sh exits 3 on it
    assert named in capsys.readouterr().err


def test_gpu_check_counts_an_empty_top_k_and_a_talker_never_filed_as_missing(tmp_path):
    from difftest.commands import gpucheck

    empty = {**TALKER_ARRAYS, "talker_topk_ids": np.zeros((0, 5), np.int64),
             "talker_topk_logprobs": np.zeros((0, 5), np.float32)}  # "could not be lined up": not captured
    never = {"talker_missing": np.array("no talker input filed for request r3")}
    got = gpucheck.summary(_run(tmp_path, {"s1": empty, "s2": never}), gpu_list=[])
    assert got["capture"]["missing"] == {"input_prompt_embeds": 1, "input_text_ids": 1, "talker_prompt": 1,
                                         "talker_ref_codes": 1, "talker_topk_ids": 2, "talker_topk_logprobs": 2}
    assert got["ok"] is False and "talker_missing: no talker input filed for request r3" in got["error"]


def test_gpu_check_reads_the_runner_the_deploy_selects_and_requires_the_fields_on_a_gpu(tmp_path):
    from difftest.commands import gpucheck

    lacking = {k: v for k, v in TALKER_ARRAYS.items() if not k.startswith("talker_topk")}
    # --engine-arg model_runner=v1 on a GPU: still required (v1's wrappers must have written them)
    v1 = gpucheck.summary(_run(tmp_path / "a", {"s1": lacking}, overlay={"model_runner": "v1"}), gpu_list=[])
    assert v1["capture"]["model_runner"] == "v1" and v1["ok"] is False and "model runner v1" in v1["error"]
    # a platform section for the device wins over the top level, as vLLM-Omni applies it
    cuda = gpucheck.summary(_run(tmp_path / "b", {"s1": TALKER_ARRAYS},
                                 base={"model_runner": "v2", "platforms": {"cuda": {"model_runner": "v1"}}}),
                            gpu_list=[])
    assert cuda["capture"]["model_runner"] == "v1" and cuda["ok"]
    # the CPU runs v1 and its capture is checked elsewhere: a gap is recorded, not a failed check
    cpu = gpucheck.summary(_run(tmp_path / "c", {"s1": lacking}, device="cpu", overlay={"model_runner": "v1"}),
                           gpu_list=[])
    assert cpu["ok"] and cpu["capture"]["required"] is False and "talker_topk_ids" in cpu["capture"]["problem"]
    # capture on, no file written
    none = gpucheck.summary(_run(tmp_path / "d", {}), gpu_list=[])
    assert none["ok"] is False and none["error"] == "capture was on (model runner v2) and no capture file was written"
