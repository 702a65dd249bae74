"""vLLM-Omni candidate glue without an engine: the deploy overlay, option checks, the plugins'
pure parts (version refusal, capture files), and the launcher's failure paths with a fake
interpreter. The real server is tests/test_vllm_omni.py."""

from __future__ import annotations

import json
import os
import stat
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import yaml

from difftest.engines import capture
from difftest.engines import vllm_omni as vo
from difftest.errors import BadInput, InfraError
from difftest.suites.suite import load_suite

REPO = Path(__file__).resolve().parents[1]
for pkg in ("difftest_cpu_platform", "difftest_capture"):  # the plugins' numpy-only parts import anywhere
    sys.path.insert(0, str(REPO / "runners" / "vllm_omni" / pkg))

from difftest_capture.store import CaptureStore, valid_tag  # noqa: E402
from difftest_cpu_platform import versions  # noqa: E402

# --- the deploy overlay ---

def test_cpu_overlay_has_what_exact_comparison_and_the_cpu_need(tmp_path):
    opts = vo.VllmOmniOptions(max_num_seqs=6, repetition_penalty=1.0, talker_kv_cache_bytes=64 << 20)
    ov = vo.deploy_overlay(tmp_path / "qwen3_tts.yaml", opts)
    assert ov["base_config"] == str(tmp_path / "qwen3_tts.yaml")
    assert ov["model_runner"] == "v1" and ov["async_chunk"] is False
    talker, vocoder = ov["stages"]
    assert (talker["stage_id"], vocoder["stage_id"]) == (0, 1)
    assert talker["subtalker_sampling_params"]["do_sample"] is False
    shared = vo.deploy_overlay("/x/qwen3_tts.yaml", vo.VllmOmniOptions(device="cuda"), servers=3)
    assert [st["gpu_memory_utilization"] for st in shared["stages"]] == [0.142, 0.142]  # 6 stages on one GPU
    sp = talker["default_sampling_params"]
    assert sp["repetition_penalty"] == 1.0 and sp["temperature"] == 0.0 and sp["min_tokens"] == 2
    for stage in (talker, vocoder):
        assert stage["max_num_seqs"] == 6
        assert stage["enforce_eager"] is True and stage["async_scheduling"] is False
        assert stage["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    assert talker["max_num_batched_tokens"] == 512  # production's step budget: longer prompts prefill in chunks
    assert vocoder["max_num_batched_tokens"] >= vocoder["max_model_len"]
    assert talker["dtype"] == "bfloat16" and talker["kv_cache_memory_bytes"] == 64 << 20
    assert vocoder["dtype"] == "float32"
    assert ov["distributed_executor_backend"] == "uni"  # each stage's worker in its stage process, as on a GPU


def test_the_cpu_executor_is_in_the_overlay_and_the_server_env_lets_it_stand(tmp_path, monkeypatch):
    """vllm-cpu turns "uni" into "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING is 0: the env says so for
    "uni" only, and a stale value from the caller never reaches an "mp" server."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    uni = vo.VllmOmniOptions()
    mp = vo.VllmOmniOptions(cpu_executor="mp")
    assert vo.deploy_overlay("/x/a.yaml", mp)["distributed_executor_backend"] == "mp"
    assert vo.server_env(uni, None, tmp_path)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vo.server_env(mp, None, tmp_path)
    by_arg = vo.VllmOmniOptions(deploy_overrides={"distributed_executor_backend": "mp"})  # --engine-arg
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vo.server_env(by_arg, None, tmp_path)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vo.server_env(vo.VllmOmniOptions(device="cuda"), None, tmp_path)
    assert "distributed_executor_backend" not in vo.deploy_overlay("/x/a.yaml", vo.VllmOmniOptions(device="cuda"))
    for bad in (vo.VllmOmniOptions(cpu_executor="ray"),
                vo.VllmOmniOptions(deploy_overrides={"distributed_executor_backend": "ray"})):
        with pytest.raises(BadInput, match="uni or mp"):
            vo.deploy_overlay("/x/a.yaml", bad)


def test_overlay_options_async_chunk_binding_and_overrides(tmp_path):
    opts = vo.VllmOmniOptions(async_chunk=True, threads_bind="0|1", omp_threads=None,
                              stage_overrides={1: {"max_num_seqs": 2}})
    ov = vo.deploy_overlay("/x/qwen3_tts.yaml", opts)
    assert ov["async_chunk"] is True
    assert [s["env"] for s in ov["stages"]] == [{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}]
    assert ov["stages"][1]["max_num_seqs"] == 2
    path = vo.write_overlay(tmp_path / "o" / "deploy.yaml", ov)
    assert yaml.safe_load(path.read_text()) == ov


def test_gpu_overlay_sets_both_dtypes_the_devices_and_keeps_the_capture_out_of_cuda_graphs():
    ov = vo.deploy_overlay("/x/qwen3_tts.yaml", vo.VllmOmniOptions(device="cuda", vocoder_dtype="float32"))
    assert "model_runner" not in ov  # the deploy's own (MRV2 on CUDA)
    talker, vocoder = ov["stages"]
    assert (talker["dtype"], vocoder["dtype"]) == ("bfloat16", "float32")  # was unset on CUDA
    assert (talker["devices"], vocoder["devices"]) == ("0", "0")
    assert talker["gpu_memory_utilization"] == vocoder["gpu_memory_utilization"] == 0.425
    assert "enforce_eager" not in talker  # the talker keeps its CUDA graphs unless asked
    assert vocoder["enforce_eager"] is True  # the capture hook copies to the host inside forward
    for key in ("kv_cache_memory_bytes", "env"):
        assert key not in talker
    assert talker["subtalker_sampling_params"]["do_sample"] is False

    eager = vo.deploy_overlay("/x/a.yaml", vo.VllmOmniOptions(device="cuda", enforce_eager=True, capture=False))
    assert [s["enforce_eager"] for s in eager["stages"]] == [True, True]
    plain = vo.deploy_overlay("/x/a.yaml", vo.VllmOmniOptions(device="cuda", capture=False))
    assert plain["stages"][1]["enforce_eager"] is False  # nothing hooks the vocoder: its CUDA graph may run

    split = vo.deploy_overlay("/x/a.yaml", vo.VllmOmniOptions(device="cuda", gpus=(1, 2),
                                                              memory_fractions=(0.6, 0.85)))
    assert [(s["devices"], s["gpu_memory_utilization"]) for s in split["stages"]] == [("0", 0.6), ("1", 0.85)]


def test_capture_refuses_a_vocoder_under_cuda_graphs():
    opts = vo.VllmOmniOptions(device="cuda", stage_overrides={1: {"enforce_eager": False}})
    with pytest.raises(BadInput, match="vocoder.enforce_eager=false.*capture"):
        vo.deploy_overlay("/x/qwen3_tts.yaml", opts)
    ov = vo.deploy_overlay("/x/a.yaml", vo.VllmOmniOptions(device="cuda", capture=False,
                                                           stage_overrides={1: {"enforce_eager": False}}))
    assert ov["stages"][1]["enforce_eager"] is False


def test_gpu_server_env_confines_the_server_and_says_batch_invariance(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # inherited from the shell: not what this run asked
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    env = vo.server_env(vo.VllmOmniOptions(device="cuda", gpus=(1, 2)), None, tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2" and "VLLM_BATCH_INVARIANT" not in env
    env = vo.server_env(vo.VllmOmniOptions(device="cuda", batch_invariant=True), None, tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["VLLM_BATCH_INVARIANT"] == "1"


def test_gpu_provenance_records_dtypes_eagerness_and_gpus(tmp_path):
    opts = vo.VllmOmniOptions(device="cuda", gpus=(3,), vocoder_dtype="bfloat16", batch_invariant=True)
    path = vo.write_overlay(tmp_path / "overlay.yaml", vo.deploy_overlay("/x/a.yaml", opts))
    env_info = {"vllm_omni": "0.30.0", "vllm": "0.30.0"}
    info = vo._provenance(env_info, opts, path, tmp_path)
    assert (info["talker_dtype"], info["vocoder_dtype"]) == ("bfloat16", "bfloat16")  # was None on CUDA
    assert info["gpus"] == [3] and info["batch_invariant"] is True
    assert info["enforce_eager"] == {0: None, 1: True}  # talker: the deploy's default (CUDA graphs)


@pytest.mark.parametrize("opts, words", [
    (vo.VllmOmniOptions(model_runner="v2"), "hang"),
    (vo.VllmOmniOptions(threads_bind="0|1|2"), "threads_bind"),
    (vo.VllmOmniOptions(device="tpu"), "device"),
])
def test_overlay_refuses_what_cannot_run(opts, words):
    with pytest.raises(BadInput, match=words):
        vo.deploy_overlay("/x/qwen3_tts.yaml", opts)


def test_options_from_a_suite_decode():
    suite = load_suite(REPO / "cases" / "suites" / "smoke.yaml")
    decode, warnings = vo.decode_settings(suite.segments)
    assert warnings == []
    opts = vo.VllmOmniOptions.for_decode(decode, concurrency=4)
    assert opts.max_num_seqs == 4 and opts.repetition_penalty == 1.0 and opts.subtalker == {"do_sample": False}
    sampled = vo.VllmOmniOptions.for_decode({"repetition_penalty": 1.05, "subtalker_dosample": True,
                                             "subtalker_top_k": 20}, concurrency=1)
    assert sampled.subtalker == {"do_sample": True, "top_k": 20}


def test_decode_settings_warn_when_segments_disagree():
    class S:
        def __init__(self, rp):
            self.decode = {"repetition_penalty": rp, "subtalker_dosample": False}

    _, warnings = vo.decode_settings([S(1.0), S(1.05)])
    assert len(warnings) == 1 and "repetition_penalty" in warnings[0]


# --- environment and checkpoints ---

def test_missing_environment_names_the_script(tmp_path, monkeypatch):
    monkeypatch.delenv(vo.PYTHON_ENV_VAR, raising=False)
    with pytest.raises(BadInput, match="runners/vllm_omni/make_env.sh"):
        vo.omni_python(str(tmp_path / "nope" / "python"))


def _checkpoint(path: Path, kind: str) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"tts_model_type": kind}))
    return str(path)


def test_models_for_tasks_picks_one_checkpoint_per_type(tmp_path):
    models = [_checkpoint(tmp_path / t, t) for t in ("base", "custom_voice", "voice_design")]
    assert vo.models_for_tasks(models, {"voice_clone"}) == {"base": models[0]}
    assert vo.models_for_tasks(models, {"voice_clone", "custom_voice"}) == {"base": models[0],
                                                                           "custom_voice": models[1]}
    with pytest.raises(BadInput, match="voice_design"):
        vo.models_for_tasks(models[:2], {"voice_design"})
    hub = ["Qwen/Qwen3-TTS-12Hz-1.7B-Base", "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"]
    assert vo.models_for_tasks(hub, {"voice_clone", "custom_voice"}) == {"base": hub[0], "custom_voice": hub[1]}
    assert vo.models_for_tasks(["org/some-tts"], {"voice_clone"}) == {"base": "org/some-tts"}  # untyped: trusted


def test_routing_client_sends_each_task_to_its_server():
    class Fake:
        def __init__(self, name):
            self.name, self.base_url, self.timeout, self.bodies = name, f"http://{name}:1", 5.0, []

        def speech(self, body, extra_headers=None):
            self.bodies.append(body)
            return self.name

        def health(self, timeout=5.0):
            return True

        def register_voice(self, voice):
            return f"{self.name}:{voice}"

    base, custom = Fake("base"), Fake("custom")
    client = vo.RoutingSpeechClient({"Base": base, "CustomVoice": custom})
    assert client.speech({"task_type": "CustomVoice"}) == "custom"
    assert client.speech({"task_type": "Base"}) == "base"
    assert client.register_voice("v") == "base:v" and client.health()
    with pytest.raises(BadInput, match="VoiceDesign"):
        client.speech({"task_type": "VoiceDesign"})



def test_a_url_candidate_with_routes_sends_each_task_to_its_server_and_names_each_in_its_identity(tmp_path):
    """One server per checkpoint type behind URLs (as vLLM-Omni serves them): the identity records
    what each says of itself, and the client routes by task_type."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from difftest.engines.start import URL, CandidateSpec, engine_identity, start_candidate

    def server(version):
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps({"version": version} if self.path == "/version" else {"data": []}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass
        srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"

    (a, url_a), (b, url_b) = server("base-1"), server("custom-2")
    try:
        spec = CandidateSpec(URL, url=url_a, routes={"Base": url_a, "CustomVoice": url_b})
        setup = SimpleNamespace(reference_fingerprint={}, out=tmp_path,
                                opts=SimpleNamespace(pattern="barrier", order="suite", voice_mode="inline",
                                                     request_timeout=5))
        ident = engine_identity(spec, setup)
        assert ident["routes"] == {"Base": url_a, "CustomVoice": url_b}
        assert ident["servers"]["Base"]["version"] == {"version": "base-1"}
        assert ident["servers"]["CustomVoice"]["version"] == {"version": "custom-2"}
        with ExitStack() as stack:
            engine = start_candidate(spec, setup, stack)
        assert isinstance(engine.client, vo.RoutingSpeechClient)
        assert engine.client._for("CustomVoice").base_url == url_b and engine.client._for("Base").base_url == url_a
        plain = engine_identity(CandidateSpec(URL, url=url_b), setup)
        assert plain["server"]["version"] == {"version": "custom-2"} and "routes" not in plain
    finally:
        a.shutdown()
        b.shutdown()


# --- the CPU platform's version check ---

def test_supported_release_passes():
    assert versions.refusal("0.30.0", "0.30.0") is None
    assert versions.refusal("0.30.0", "0.30.1+cpu") is None


@pytest.mark.parametrize("omni, vllm, words", [
    ("0.28.0", "0.28.0", ["0.28.0 is not supported", "0.30.0", "make_env.sh", "force"]),
    ("0.22.0", "0.30.0", ["0.22.0 is not supported"]),
    ("0.30.0", "0.28.0", ["needs vLLM 0.30", "found vllm 0.28.0"]),
    (None, "0.30.0", ["not installed"]),
])
def test_unsupported_release_is_refused_with_a_clear_message(omni, vllm, words):
    msg = versions.refusal(omni, vllm)
    assert msg is not None
    for w in words:
        assert w in msg


# --- capture files (numpy only) ---

def test_capture_store_merges_stages_and_replaces_a_reused_tag(tmp_path):
    store = CaptureStore(tmp_path)
    codes, ref = np.arange(32).reshape(2, 16), np.ones((3, 16), np.int64)
    store.update("t-1", replace=True, codes=codes, ref_codes=ref)
    store.update("t-1", wav=np.zeros(3840, np.float32))  # the vocoder's process
    with np.load(tmp_path / "t-1.npz", allow_pickle=False) as z:
        assert sorted(z.files) == ["codes", "ref_codes", "schema_version", "wav"] and int(z["schema_version"]) == capture.SCHEMA_VERSION
        assert z["codes"].shape == (2, 16) and z["ref_codes"].shape == (3, 16) and z["wav"].dtype == np.float32
    store.update("t-1", replace=True, codes=codes[:1], ref_codes=ref)  # the tag's next request
    with np.load(tmp_path / "t-1.npz", allow_pickle=False) as z:
        assert "wav" not in z.files and z["codes"].shape == (1, 16)
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".t-1.*"))


def test_the_talkers_input_is_filed_by_request_id_and_used_up(tmp_path):
    store = CaptureStore(tmp_path)
    ref = np.full((4, 16), 7, np.int64)
    store.file_talker("req-9", talker_ref_codes=ref, talker_prompt=np.array([30, 30, 4]))
    assert store.take_talker(["chatcmpl-x", "req-1"]) is None  # another request's ids
    got = store.take_talker(["chatcmpl-x", "req-9"])
    assert np.array_equal(got["talker_ref_codes"], ref) and got["talker_prompt"].tolist() == [30, 30, 4]
    assert store.take_talker(["req-9"]) is None  # used up: a later request reusing the id gets its own


def test_the_talkers_own_top_k_is_filed_per_step_and_lined_up_with_its_tokens(tmp_path):
    """The worker appends one record per sampled row; the hand-off lines them up with the tokens
    by position (a discarded prefill-chunk sample and a recomputed step lose to the last record of
    their position), falls back to the last records where positions are unknown, and reports
    "not captured" (zero rows) where they cannot be lined up."""
    from difftest_capture.hooks import align_steps

    store = CaptureStore(tmp_path)
    k = 5
    ids = lambda t: np.array([[t, t + 1, t + 2, t + 3, t + 4]])  # noqa: E731
    lp = np.array([[-0.1, -1.0, -2.0, -3.0, -4.0]], np.float32)
    store.file_steps(["r1"], [0], ids(90), lp)  # a prefill chunk's sample, discarded by the scheduler
    for pos, tok in enumerate([5, 6, 7]):
        store.file_steps(["r1", "r2"], [pos, -1], np.concatenate([ids(tok), ids(50 + pos)]), np.repeat(lp, 2, 0))
    store.file_steps(["r1"], [2], ids(8), lp)  # step 2 recomputed (preemption): the later record wins
    with open(store._steps_path("r1"), "ab") as f:
        f.write(b"\x01\x02")  # a record still being written when the hand-off reads
    steps = store.talker_steps(["x", "r1"])
    assert len(steps) == 5 and steps["ids"].shape == (5, k)
    got = align_steps(steps, 3)
    assert got["talker_topk_ids"][:, 0].tolist() == [5, 6, 8]
    assert got["talker_topk_logprobs"].dtype == np.float32 and got["talker_topk_logprobs"][0, 1] == np.float32(-1.0)
    assert align_steps(steps, 4)["talker_topk_ids"].shape == (0, k)  # no record for the 4th token
    r2 = store.talker_steps(["r2"], consume=True)
    assert align_steps(r2, 2)["talker_topk_ids"][:, 0].tolist() == [51, 52]  # positions unknown: the last two
    assert store.talker_steps(["r2"]) is None  # used up with the request


def test_capture_store_rejects_tags_that_are_not_file_names(tmp_path):
    for tag in ("../x", "a/b", ".hidden", "", "x" * 201, None):
        assert not valid_tag(tag)
    with pytest.raises(ValueError):
        CaptureStore(tmp_path).update("../escape", codes=np.zeros((0, 16)))
    assert valid_tag("c4-smoke-01-c4")


def test_handoff_entries_are_used_up_and_prefer_the_request_id(tmp_path):
    store = CaptureStore(tmp_path)
    flat = np.arange(48)
    store.file_handoff(flat, "c1-seg-c1", "speech-aaa")
    store.file_handoff(flat, "c4-seg-c4", "speech-bbb", chunk=2, last=False)
    assert store.take_handoff(flat, ["speech-bbb-1234abcd"]) == ("c4-seg-c4", 2, False)  # an engine's internal id
    assert store.take_handoff(flat, []) == ("c1-seg-c1", 0, True)
    assert store.take_handoff(flat, []) is None
    assert store.take_handoff(np.arange(16), []) is None


# --- start_vllm_omni's failure paths, with a fake interpreter ---

FAKE_PYTHON = """#!/bin/sh
# A stand-in for the vLLM-Omni environment's interpreter.
if [ "$1" = "-c" ]; then
  echo '{"python": "3.11", "vllm_omni": "0.30.0", "vllm": "0.30.0", "vllm_distribution": "vllm-cpu",
         "torch": "2.13.0+cpu", "transformers": "5.14.1", "difftest_capture": "0.1.0",
         "difftest_cpu_platform": "0.1.0", "deploy_dir": "DEPLOY"}' | tr -d '\\n'; echo
  exit 0
fi
MODE
"""


def _fake_env(tmp_path: Path, mode: str) -> Path:
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    (deploy / "qwen3_tts.yaml").write_text("stages: []\n")
    py = tmp_path / "python"
    py.write_text(FAKE_PYTHON.replace("DEPLOY", str(deploy)).replace("MODE", mode))
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    return py


def test_a_server_that_exits_early_is_an_infrastructure_error_with_its_log(tmp_path):
    py = _fake_env(tmp_path, 'echo "RuntimeError: difftest CPU platform cannot run this stage"; exit 1')
    model = _checkpoint(tmp_path / "base", "base")
    with ExitStack() as stack, pytest.raises(InfraError) as e:
        vo.start_vllm_omni(tmp_path / "run", [model], vo.VllmOmniOptions(python=str(py), health_timeout=30),
                           stack, tasks={"voice_clone"})
    assert "exited with status 1" in str(e.value) and "cannot run this stage" in str(e.value)
    assert e.value.exit_code == 3
    overlay = yaml.safe_load((tmp_path / "run" / "vllm-omni" / "deploy-overlay.yaml").read_text())
    assert overlay["base_config"] == str((tmp_path / "deploy" / "qwen3_tts.yaml").resolve())
    assert (tmp_path / "run" / "logs" / "vllm-omni-base.log").exists()


def test_a_server_that_never_becomes_healthy_is_stopped_and_reported(tmp_path):
    py = _fake_env(tmp_path, 'echo "loading forever"; exec sleep 60')
    model = _checkpoint(tmp_path / "base", "base")
    with ExitStack() as stack, pytest.raises(InfraError, match="not healthy after"):
        vo.start_vllm_omni(tmp_path / "run", [model], vo.VllmOmniOptions(python=str(py), health_timeout=2),
                           stack, tasks={"voice_clone"})


def test_each_model_source_keeps_its_own_vllm_cache(tmp_path, monkeypatch):
    """vLLM's model-class cache is one file per class name: the release and a mutant of its talker
    sharing ~/.cache/vllm evict each other's entry. Servers get a cache per Qwen3-TTS model source:
    a mutant that leaves the model files as they are shares the release's; one the user set stays."""
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    def env_with(talker: str, where: str) -> dict:
        pkg = tmp_path / where / "vllm_omni"
        (pkg / "deploy").mkdir(parents=True)
        (pkg / "model_executor" / "models" / "qwen3_tts").mkdir(parents=True)
        (pkg / "model_executor" / "models" / "qwen3_tts" / "qwen3_tts_talker.py").write_text(talker)
        return {"deploy_dir": str(pkg / "deploy")}

    release, same, mutant = env_with("fixed", "release"), env_with("fixed", "b"), env_with("reverted", "c")
    keys = [vo.model_source_key(e) for e in (release, same, mutant)]
    assert keys[0] == keys[1] != keys[2]
    root = vo.server_env(vo.VllmOmniOptions(), None, tmp_path, keys[0])["VLLM_CACHE_ROOT"]
    assert root == str(tmp_path / "xdg" / "vllm" / "difftest-model-source" / keys[0])
    assert vo.server_env(vo.VllmOmniOptions(), None, tmp_path, keys[2])["VLLM_CACHE_ROOT"] != root
    assert vo.model_source_key({"deploy_dir": str(tmp_path / "none" / "deploy")}) is None
    assert "VLLM_CACHE_ROOT" not in vo.server_env(vo.VllmOmniOptions(), None, tmp_path)
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/mine")
    assert vo.server_env(vo.VllmOmniOptions(), None, tmp_path, keys[0])["VLLM_CACHE_ROOT"] == "/mine"


def test_the_server_gets_the_capture_dir_and_no_stale_one(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTEST_CAPTURE_DIR", "/somewhere/else")
    monkeypatch.setenv("DIFFTEST_ACCEPT_LENGTH_FINISH", "1")
    env = vo.server_env(vo.VllmOmniOptions(), tmp_path / "cap", tmp_path / "spk")
    assert env["DIFFTEST_CAPTURE_DIR"] == str(tmp_path / "cap") and env["HF_HUB_OFFLINE"] == "1"
    assert "DIFFTEST_ACCEPT_LENGTH_FINISH" not in env  # only when the options say so
    env = vo.server_env(vo.VllmOmniOptions(accept_length_finish=True), None, tmp_path / "spk")
    assert env["DIFFTEST_ACCEPT_LENGTH_FINISH"] == "1"
    assert "DIFFTEST_CAPTURE_DIR" not in vo.server_env(vo.VllmOmniOptions(capture=False), None, tmp_path)
    argv = vo.server_argv(Path("/env/bin/python"), "Qwen/X", Path("/o.yaml"), 8123, vo.VllmOmniOptions())
    assert argv[:6] == ["/env/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", "Qwen/X", "--omni"]
    assert "--deploy-config" in argv and "8123" in argv and os.path.basename(argv[0]) == "python"


def test_untagged_requests_are_named_by_request_id_only_when_asked(monkeypatch):
    """The offline batch API cannot tag requests: with DIFFTEST_CAPTURE_UNTAGGED=request-id the
    capture names them after their request id (the engine core's Request or the worker's
    CachedRequestState); otherwise an untagged request is not captured."""
    from types import SimpleNamespace

    from difftest_capture import request_id_tag
    from difftest_capture.hooks import request_tag

    worker_state = SimpleNamespace(req_id="0_ab/c d", sampling_params=SimpleNamespace(extra_args=None))
    tagged = SimpleNamespace(request_id="speech-1", sampling_params=SimpleNamespace(extra_args={"difftest_tag": "t1"}))
    monkeypatch.delenv("DIFFTEST_CAPTURE_UNTAGGED", raising=False)
    assert request_tag(worker_state) is None and request_tag(tagged) == "t1"
    monkeypatch.setenv("DIFFTEST_CAPTURE_UNTAGGED", "request-id")
    assert request_tag(worker_state) == "rid-0_ab_c_d" == request_id_tag("0_ab/c d")
    assert request_tag(tagged) == "t1"  # a tag still wins
    assert request_id_tag("") is None and valid_tag(request_id_tag("é" * 300))


CAPTURE_UNDER_COMPILE = r"""
import json, sys, torch
from runners.vllm_omni.difftest_capture.difftest_capture import hooks

class Vocoder:
    def forward(self, codes):
        return codes * 2

calls = []
class Recorder:  # stands in for hooks.Capture: records what the wrapper hands it
    def vocoder(self, model, bound, output):
        calls.append(bound.arguments["codes"].shape[0])

Vocoder.forward = hooks._wrap_forward(Vocoder.forward, Recorder())
v = Vocoder()
eager = v.forward(torch.ones(3))
compiled = torch.compile(lambda x: v.forward(x), backend="eager")(torch.ones(5))
print(json.dumps({"calls": calls, "eager": eager.tolist(), "compiled": compiled.tolist()}))
"""


def test_the_vocoder_capture_stays_out_of_compiled_graphs(tmp_path):
    """Under torch.compile the wrapper must neither copy to the host nor change the output: it
    returns the result untouched and captures nothing (difftest keeps the vocoder eager)."""
    from reference_support import reference_python

    r = __import__("subprocess").run([str(reference_python()), "-c", CAPTURE_UNDER_COMPILE], cwd=REPO,
                                     capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["calls"] == [3]  # the eager call only
    assert got["eager"] == [2.0] * 3 and got["compiled"] == [2.0] * 5
    assert "torch.compile" in r.stderr  # said once, in the engine's log
