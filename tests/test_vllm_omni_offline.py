"""The vLLM-Omni offline runner (runners/vllm_omni_offline: `vllm_omni.Omni`, float32 audio).

The prompt-building units run anywhere; the rest starts the real vLLM-Omni 0.30 offline engine on the
CPU in `.venv-vllm-omni` (fails, naming runners/vllm_omni/make_env.sh, when it is missing): one
engine for the runner tests, one more for the whole `difftest run`. About 4 minutes on two cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from vllm_omni_support import FRAME, OMNI_PYTHON, Q16, REPO, omni_python, voice_clone_checkpoint  # noqa: F401

from difftest.engines import vllm_omni as vo
from difftest.engines.runner_candidate import run_candidate_runner
from difftest.process.runner_client import RunnerProcess
from difftest.suites.suite import load_suite
from runners.reference.engine import Utterance
from runners.vllm_omni_offline import prompts

FAKE = [sys.executable, str(Path(__file__).with_name("fake_runner.py"))]


@pytest.fixture(scope="module")
def smoke():
    return load_suite(REPO / "cases" / "suites" / "smoke.yaml")


# -- prompts (no engine) ---------------------------------------------------------------------

def test_voice_clone_prompt_is_what_the_speech_api_builds(smoke):
    seg = smoke.segments[0]
    samples, sr = prompts.read_voice(seg.voice.wav)
    assert sr == 24000 and samples.dtype == np.float32 and samples.ndim == 1
    utt = Utterance(text=seg.text, language=seg.language, task="voice_clone", decode=dict(seg.decode),
                    voice_wav=seg.voice.wav, transcript=seg.voice.transcript, xvector_only=False)
    info = prompts.additional_information(utt, (samples, sr))
    assert info["task_type"] == ["Base"] and info["text"] == [seg.text] and info["language"] == ["English"]
    assert info["ref_text"] == [seg.voice.transcript] and info["x_vector_only_mode"] == [False]
    (ref_samples, ref_sr), = info["ref_audio"]
    assert ref_sr == 24000 and len(ref_samples) == len(samples) and ref_samples[:5] == samples[:5].tolist()
    assert info["ref_code_length"] == [int(np.ceil(len(samples) / 1920))]  # 12.5 frames a second
    assert info["max_new_tokens"] == [seg.decode["max_new_tokens"]]
    assert all(isinstance(v, list) and len(v) == 1 for v in info.values())
    p = prompts.prompt(info, 42)
    assert p["prompt_token_ids"] == [0] * 42 and p["additional_information"] is info


def test_xvector_custom_and_design_prompts():
    decode = {"seed": 3, "max_new_tokens": 50, "repetition_penalty": 1.05}
    x = prompts.additional_information(
        Utterance("hi", "English", "voice_clone", decode, voice_wav=Path("v.wav"), xvector_only=True),
        (np.zeros(24000, np.float32), 24000))
    assert x["x_vector_only_mode"] == [True] and "ref_text" not in x and x["ref_code_length"] == [13]
    c = prompts.additional_information(Utterance("hi", "Chinese", "custom_voice", decode, speaker="vivian",
                                                 instructions="happily"))
    assert c["task_type"] == ["CustomVoice"] and c["speaker"] == ["vivian"] and c["instruct"] == ["happily"]
    d = prompts.additional_information(Utterance("hi", "English", "voice_design", decode, instructions="low"))
    assert d["task_type"] == ["VoiceDesign"] and d["non_streaming_mode"] == [True] and "speaker" not in d
    with pytest.raises(ValueError, match="reference audio"):
        prompts.additional_information(Utterance("hi", "English", "voice_clone", decode))


def test_sampling_key_groups_only_what_a_batch_can_share():
    greedy = {"seed": 0, "max_new_tokens": 40, "repetition_penalty": 1.05}
    assert prompts.sampling_key(greedy) == prompts.sampling_key(dict(greedy))
    assert prompts.sampling_key(greedy) != prompts.sampling_key({**greedy, "seed": 1})
    assert prompts.sampling_key(greedy) != prompts.sampling_key({**greedy, "max_new_tokens": 41})
    sampled = {**greedy, "do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0}
    assert prompts.sampling_fields(prompts.sampling_key(sampled)) == {
        "seed": 0, "max_tokens": 40, "repetition_penalty": 1.05, "temperature": 0.9, "top_k": 50, "top_p": 1.0}
    assert prompts.sampling_fields(prompts.sampling_key(greedy))["temperature"] == 0.0


# -- the tester side against the protocol double -----------------------------------------------

def test_waves_are_sent_and_a_dying_runner_loses_nothing_written(smoke, tmp_path):
    import os

    with RunnerProcess(FAKE, env={**os.environ, "FAKE_RUNNER_CRASH_AFTER": "3"}) as r:
        out = run_candidate_runner(smoke.segments, r, tmp_path / "c2", concurrency=2, order="permuted", seed=1)
    assert sorted(sid for wave in out.batches for sid in wave) == sorted(s.id for s in smoke.segments)
    assert [len(w) for w in out.batches] == [2, 2]
    assert len(out.results) == 3 and len(out.errors) == 1
    (lost, err), = out.errors.items()
    assert err["kind"] == "infrastructure" and "offline runner died" in err["message"]
    assert lost not in out.results


def test_batches_are_the_ones_the_engine_ran():
    from difftest.engines.base import Outcome
    from difftest.engines.runner_candidate import _batches_run

    def r(batch):
        return type("R", (), {"meta": {"batch": batch}})()

    out = Outcome(results={"a": r(["a", "c"]), "c": r(["a", "c"]), "b": r(["b"]), "d": r({})})
    out.errors = {"e": {}}
    # a wave split by the runner; an old result with no record; an error
    assert _batches_run(out, [["a", "b", "c", "e"], ["d"]]) == [["a", "c"], ["b"], ["e"], ["d"]]


def test_an_engine_started_by_a_request_is_counted_once_as_the_start():
    """The runner starts a checkpoint type's engine at its first request and stamps every result it
    computes with that start: a pass counts each engine's start once, a later pass or a result
    found cached not at all (difftest.pipeline.passes.engine_starts)."""
    from types import SimpleNamespace

    from difftest.engines.base import Outcome
    from difftest.pipeline.passes import engine_starts as _engine_starts

    def res(ckpt, start):
        return SimpleNamespace(provenance={"checkpoint": {"path": ckpt}}, timings={"seconds": 1.0, "engine_start_s": start})

    started: dict = {}
    first = Outcome(results={"a": res("base", 40.0), "b": res("base", 40.0), "c": res("design", 12.5)})
    assert _engine_starts(first, started) == 52.5
    again = Outcome(results={"a": res("base", 40.0), "d": res("custom", 3.0), "e": res("other", 9.0)}, cached={"e"})
    assert _engine_starts(again, started) == 3.0  # base counted already; e is an earlier run's
    http = Outcome(results={"a": SimpleNamespace(provenance={}, timings={"seconds": 1.0})})
    assert _engine_starts(http, {}) == 0.0  # a server's start is timed where it starts


def test_candidate_spec_names_the_offline_api():
    from difftest.errors import BadInput
    from difftest.run import CandidateSpec

    assert (CandidateSpec.parse("vllm-omni-offline").api, CandidateSpec.parse("vllm-omni-offline").label) == (
        "batch", "vllm-omni-offline")
    spec = CandidateSpec.parse("vllm-omni-offline:async")
    assert (spec.kind, spec.api, spec.label) == ("vllm-omni-offline", "async", "vllm-omni-offline:async")
    with pytest.raises(BadInput, match="batch .* or async"):
        CandidateSpec.parse("vllm-omni-offline:stream")


# -- the real offline engine -------------------------------------------------------------------

@pytest.fixture(scope="module")
def offline(tmp_path_factory, voice_clone_checkpoint):
    """(runner, info, run dir) for the tiny voice-clone checkpoint; stopped at the end of the module."""
    omni_python()
    run_dir = tmp_path_factory.mktemp("offline-run")
    opts = vo.VllmOmniOptions(python=str(OMNI_PYTHON), max_num_seqs=4, repetition_penalty=1.0,
                              talker_kv_cache_bytes=64 << 20, vocoder_kv_cache_bytes=16 << 20)
    with ExitStack() as stack:
        runner, info = vo.start_vllm_omni_offline(run_dir, [str(voice_clone_checkpoint)], opts, stack,
                                                  tasks={"voice_clone"})
        yield runner, info, run_dir


@pytest.fixture(scope="module")
def runs(offline, smoke, tmp_path_factory):
    runner, _, _ = offline
    out = tmp_path_factory.mktemp("offline-candidate")
    return {n: run_candidate_runner(smoke.segments, runner, out / f"c{n}", concurrency=n) for n in (1, 4)}


@pytest.mark.heavy
def test_offline_runner_gives_float32_audio_and_the_codes_behind_it(offline, runs, smoke):
    _, info, run_dir = offline
    assert info["api"] == "offline (vllm_omni.Omni)" and info["versions"]["vllm_omni"] == "0.30.0"
    ref_frames = {v.id: -(-v.n_samples // FRAME) for v in smoke.voices.values()}
    for n in (1, 4):
        assert runs[n].errors == {}, runs[n].errors
        for seg in smoke.segments:
            r = runs[n].results[seg.id]
            assert r.has_codes and not r.quantised and r.wav.dtype == np.float32 and r.sample_rate == 24000
            assert r.meta["runner"] == "vllm-omni-offline" and r.meta["concurrency"] == n
            assert r.ref_codes.shape == (ref_frames[seg.voice.id], 16)
            assert len(r.wav) == len(r.codes) * FRAME
            # the audio Omni returned is the vocoder output the capture plugin saw, to the bit
            assert np.array_equal(r.extra["capture_wav"], r.wav)
            # and it is not 16-bit audio: most samples lie off the 1/32768 grid
            off_grid = np.abs(r.wav * 32768 - np.round(r.wav * 32768)) > 1e-3
            assert off_grid.mean() > 0.5
    assert runs[4].batches == [[s.id for s in smoke.segments]]
    assert {runs[4].results[s.id].meta["request_id"].split("_")[0] for s in smoke.segments} == {"0", "1", "2", "3"}
    for seg in smoke.segments:  # greedy: the batch of four says what each says alone
        assert np.array_equal(runs[4].results[seg.id].codes, runs[1].results[seg.id].codes)
        assert np.max(np.abs(runs[4].results[seg.id].wav - runs[1].results[seg.id].wav)) < Q16
    captures = sorted(p.name for p in (run_dir / "capture").glob("rid-*.npz"))
    assert len(captures) == 2 * len(smoke.segments)


@pytest.mark.heavy
def test_bad_segments_are_named_and_the_rest_of_the_wave_goes_on(offline, smoke, tmp_path):
    runner, _, _ = offline
    good = smoke.segments[0].to_job()
    no_voice = {**smoke.segments[1].to_job(), "id": "no-voice"}
    no_voice["voice"] = {**no_voice["voice"], "wav": str(tmp_path / "missing.wav")}
    custom = {**good, "id": "custom", "task": "custom_voice", "speaker": "vivian", "voice": None}
    events = list(runner.request("generate", timeout=600, segments=[no_voice, custom, good], out_dir=str(tmp_path),
                                 concurrency=3))
    by = {e["segment"]: e for e in events if e.get("event") in ("result", "error")}
    assert by["no-voice"]["event"] == "error" and by["no-voice"]["kind"] == "bad_input"
    assert "missing.wav" in by["no-voice"]["message"]
    assert by["custom"]["event"] == "error" and "no custom_voice checkpoint" in by["custom"]["message"]
    assert by[good["id"]]["event"] == "result" and not by[good["id"]]["cached"]
    again = [e for e in runner.request("generate", segments=[good], out_dir=str(tmp_path), concurrency=1)
             if e.get("event") == "result"]
    assert again[0]["cached"] is True  # a re-run computes only what is missing


@pytest.mark.heavy
def test_difftest_run_with_the_offline_candidate(tmp_path):
    """The whole `difftest run --candidate vllm-omni-offline:async` on the smoke suite (AsyncOmni, a
    request each, submitted together; the batch API is the runner tests' above). The seeded tiny
    checkpoints: the offline API answers a length-capped request, so no EOS bias is needed."""
    omni_python()
    p = subprocess.run([sys.executable, "-m", "difftest", "run", str(REPO / "cases" / "suites" / "smoke.yaml"),
                        "--candidate", "vllm-omni-offline:async", "-n", "4", "--out", str(tmp_path / "run"),
                        "--store", str(tmp_path / "store"), "--no-mlflow"],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    assert rep["verdict"] == "pass" and rep["at_concurrency_1"]["verdict"] == "pass"
    assert rep["candidate"]["pattern"] == "batch" and rep["candidate"]["api"] == "offline (vllm_omni.AsyncOmni)"
    assert rep["candidate"]["label"] == "vllm-omni 0.30.0 offline async"
    assert rep["candidate"]["batches"] == [[s["id"] for s in rep["segments"]]]
    for s in rep["segments"]:
        assert s["verdict"] in ("identical", "numeric_drift", "code_divergence"), s
        assert s["comparisons"]["concurrency_codes"]["frames_differing"] == 0
        voc = s["comparisons"]["vocoder"]
        # float32 on both sides: the reference vocoder on vLLM-Omni's codes matches its audio closely,
        # with no 16-bit allowance
        assert voc["quantised"] is False and voc["worst_tier"] in ("identical", "close")
    # the GPU host check's summary (scripts/gpu-check.sh) of this real run, read on the CPU
    from difftest.commands.gpucheck import summary

    got = summary(tmp_path / "run", gpu_list=[])
    assert got["ok"] and got["versions"]["vllm_omni"] == "0.30.0" and got["versions"]["qwen_tts"] == "0.1.1"
    assert got["verdicts"] == {"c1": {"verdict": "pass", "counts": _counts(rep["at_concurrency_1"]["segments"])},
                               "c4": {"verdict": "pass", "counts": rep["counts"]}}
    assert got["devices"]["reference"] == "cpu" and got["settings"]["talker_dtype"] == "bfloat16"
    assert got["timings_s"]["total_s"] == rep["provenance"]["timings"]["total_s"] > 0
    # the engine starts with the first request (the runner's lazy start): its start is the candidate's
    # start in the timings, not part of the pass at concurrency 1
    from difftest.results import read_result

    t = rep["provenance"]["timings"]
    first = read_result(next((tmp_path / "run" / "results" / "candidate-c1").glob("smoke-*.json")))
    assert t["candidate_start_s"] >= first.timings["engine_start_s"] > t["candidate_c1_s"], t
    # every request's codes, audio and the talker's own input and top-k were captured (CPU: model runner v1)
    per_run = len(rep["segments"])
    assert got["capture"]["files"] >= per_run
    for field in ("codes", "wav", "talker_prompt", "talker_topk_ids"):
        assert got["capture"]["fields"].get(field, 0) >= per_run, got["capture"]


def _counts(segments) -> dict:
    out: dict = {}
    for s in segments:
        out[s["verdict"]] = out.get(s["verdict"], 0) + 1
    return dict(sorted(out.items()))


def test_offline_refuses_server_only_options(tmp_path):
    p = subprocess.run([sys.executable, "-m", "difftest", "run", str(REPO / "cases" / "suites" / "smoke.yaml"),
                        "--candidate", "vllm-omni-offline", "--pattern", "pool", "--out", str(tmp_path / "run"),
                        "--store", str(tmp_path / "store"), "--no-mlflow"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and "--pattern pool" in p.stderr and "offline runner" in p.stderr
