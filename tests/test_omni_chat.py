"""Qwen3-Omni's request, answer and deploy overlay (difftest/engines/omni_chat.py, engines/apis.py),
without a server: what each sends and reads, and the refusals. tests/test_omni_candidate.py runs them
against the real vLLM-Omni (heavy)."""

from __future__ import annotations

import base64
import json
from dataclasses import replace

import numpy as np
import pytest
from reference_support import REPO

from difftest.engines import apis, omni_chat
from difftest.engines.deploy_diff import engine_arg_keys
from difftest.engines.vllm_omni import VllmOmniOptions, family_overlay, served_family
from difftest.errors import BadInput
from difftest.family import QWEN3_OMNI, QWEN3_TTS, family_of_tasks
from difftest.suites import wavio
from difftest.suites.suite import load_suite

SUITE = REPO / "cases" / "suites" / "omni-smoke.yaml"


def test_the_chat_body_carries_every_stage_setting_and_the_tag():
    seg = load_suite(SUITE).segments[2]  # omni-03: max_new_tokens 12, thinker_max_new_tokens 4, Aiden
    body = omni_chat.chat_body(seg, "run-omni-03-c4")
    thinker, talker = body["sampling_params_list"]
    assert body["messages"] == [{"role": "user", "content": seg.text}] and body["speaker"] == "Aiden"
    assert body["modalities"] == ["text", "audio"]
    assert (thinker["temperature"], thinker["max_tokens"]) == (0.0, 4)
    assert (talker["temperature"], talker["top_k"], talker["max_tokens"], talker["repetition_penalty"]) == (0.0, -1, 12, 1.0)
    assert talker["stop_token_ids"] == [QWEN3_OMNI.stop_id] and talker["extra_args"] == {"difftest_tag": "run-omni-03-c4"}
    assert "logit_bias" not in json.dumps(body)  # its string keys kill the talker's engine core (measured)
    sampled = replace(seg, decode={**seg.decode, "do_sample": True})
    with pytest.raises(BadInput, match="omni-03: a sampled Qwen3-Omni talker"):
        omni_chat.chat_body(sampled)


def test_the_answer_wav_is_read_from_the_audio_choice_and_its_absence_named():
    wav = wavio.encode(np.linspace(-0.5, 0.5, 480, dtype=np.float32), QWEN3_OMNI.sample_rate, subtype="pcm16")
    answer = {"choices": [{"message": {"role": "assistant", "content": "hi"}},
                          {"message": {"audio": {"data": base64.b64encode(wav).decode()}}}]}
    assert omni_chat.answer_wav(json.dumps(answer).encode()) == wav
    for bad in (b"not json", json.dumps({"choices": [{"message": {"content": "text only"}}]}).encode(),
                json.dumps({"choices": [{"message": {"audio": {"data": "%%%"}}}]}).encode()):
        with pytest.raises(ValueError, match="no audio in the chat completion"):
            omni_chat.answer_wav(bad)
    assert omni_chat.answer_bound(omni_chat.chat_body(load_suite(SUITE).segments[0])) > 20 * 1920 * 2


def test_each_segment_is_asked_in_its_family_api():
    assert isinstance(apis.api_for(load_suite(SUITE).segments[0]), apis.ChatApi)
    assert isinstance(apis.api_for(load_suite(REPO / "cases" / "suites" / "smoke.yaml").segments[0]), apis.SpeechApi)
    assert family_of_tasks({"chat"}) is QWEN3_OMNI and family_of_tasks(set()) is QWEN3_TTS
    with pytest.raises(BadInput, match="one model family a run"):
        served_family({"chat", "voice_clone"})


def test_the_overlay_serves_every_stage_on_the_cpu_as_measured():
    overlay = family_overlay(QWEN3_OMNI, "/base.yaml", VllmOmniOptions(max_num_seqs=4, async_chunk=True,
                                                                      stage_overrides={2: {"max_num_seqs": 8}}))
    assert (overlay["base_config"], overlay["async_chunk"], overlay["model_runner"]) == ("/base.yaml", True, "v1")
    thinker, talker, code2wav = overlay["stages"]
    assert [s["stage_id"] for s in overlay["stages"]] == [0, 1, 2]
    assert all(s["devices"] == "0" and s["enforce_eager"] for s in overlay["stages"])
    assert thinker["moe_backend"] == talker["moe_backend"] == "auto" and "moe_backend" not in code2wav
    assert (thinker["dtype"], talker["dtype"], code2wav["dtype"]) == ("bfloat16", "bfloat16", "float32")
    assert talker["default_sampling_params"]["temperature"] == 0.0 and code2wav["max_num_seqs"] == 8  # --engine-arg last
    with pytest.raises(BadInput, match="CPU platform only"):
        family_overlay(QWEN3_OMNI, "/base.yaml", VllmOmniOptions(device="cuda"))
    # the served configuration names Qwen3-Omni's stages by their own names
    names = dict(enumerate(QWEN3_OMNI.serving_stages))
    assert engine_arg_keys({}, {0: {"dtype": "x"}, 2: {"max_num_seqs": 8}}, names) == ["thinker.dtype",
                                                                                      "code2wav.max_num_seqs"]
