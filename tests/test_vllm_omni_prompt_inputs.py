"""The vLLM-Omni capture's talker input (issue #29): vLLM-Omni 0.30's real prompt builder, wrapped
by difftest's observer, on every task and layout (tests/vllm_omni_prompt_inputs_check.py runs in
`.venv-vllm-omni`). The observer must change nothing the builder returns and must report what the
builder used: here, what it must have used, from the tokenizer and the config; with a defect
planted in the builder's config, the defect."""

import pytest
from reference_support import tiny  # noqa: F401
from vllm_omni_support import REPO, run_in_env

CASES = ("custom_voice", "custom_voice_streaming_instruct", "voice_design", "xvector_auto", "icl_streaming",
         "icl_non_streaming_batched", "icl_streaming_planted")


@pytest.fixture(scope="module")
def checked(tiny):  # noqa: F811
    return run_in_env([str(REPO / "tests" / "vllm_omni_prompt_inputs_check.py"), str(tiny)], timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_the_observed_prompt_inputs_are_what_the_builder_used(checked, case):
    c = checked[case]
    assert c["same_output"], "the observer changed what build_prompt_embeds returned"
    assert isinstance(c["observed"], dict), f"not captured: {c['observed']}"
    for field, want in c["expect"].items():
        assert c["observed"][field] == want, (field, c["observed"][field], want)


def test_the_batched_path_and_the_planted_defect_are_what_they_claim(checked):
    assert checked["icl_non_streaming_batched"]["precomputed"]  # the ids came from preprocess_infos_batch
    assert not checked["icl_streaming"]["precomputed"]  # ... and here from the builder's own tokenizer call
    planted = checked["icl_streaming_planted"]
    assert planted["observed"]["input_codec_prefill"][2] != planted["english_id"]  # what was used, not what is right
    assert checked["icl_streaming"]["observed"]["input_codec_prefill"][2] == planted["english_id"]
    # streaming and non-streaming in-context prompts, and a custom voice's streaming layout, told apart
    assert [checked[c]["observed"]["input_non_streaming"] for c in
            ("icl_streaming", "icl_non_streaming_batched", "custom_voice", "custom_voice_streaming_instruct")] == [0, 1, 1, 0]
