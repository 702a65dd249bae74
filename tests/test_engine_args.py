"""`--engine-arg`: deploy settings for the candidate, checked against the environment's own vLLM-Omni
config classes, landing in the overlay (and so in the candidate's identity)."""

import pytest
from vllm_omni_support import omni_python

from difftest.cli import main
from difftest.engines.engine_args import check, parse
from difftest.engines.vllm_omni import VllmOmniOptions, deploy_overlay
from difftest.errors import BadInput


def test_stage_and_top_level_settings_are_read_as_yaml():
    top, stages = parse(["talker.enable_prefix_caching=true", "vocoder.max_num_seqs=8", "async_chunk=false",
                         "0.max_model_len=4096", "talker.default_sampling_params={seed: 7}", "1.dtype=float32"])
    assert top == {"async_chunk": False}
    assert stages == {0: {"enable_prefix_caching": True, "max_model_len": 4096,
                          "default_sampling_params": {"seed": 7}},
                      1: {"max_num_seqs": 8, "dtype": "float32"}}


@pytest.mark.parametrize("text, words", [
    ("enable_prefix_caching", "expected KEY=VALUE"),
    ("=3", "expected KEY=VALUE"),
    ("thinker.max_num_seqs=2", "stage 'thinker': expected talker, vocoder, 0 or 1"),
    ("talker.a.b=2", "with one key"),
    ("stages=[]", "stages is built by difftest"),
    ("talker.max_model_len=[1", "the value is not YAML"),
])
def test_malformed_settings_are_named(text, words):
    with pytest.raises(BadInput, match=words):
        parse([text])


def test_settings_override_difftests_own_in_the_overlay():
    top, stages = parse(["talker.enable_prefix_caching=true", "talker.max_model_len=4096", "model_runner=v1"])
    overlay = deploy_overlay("base.yaml", VllmOmniOptions(stage_overrides=stages, deploy_overrides=top))
    talker, vocoder = overlay["stages"]
    assert talker["enable_prefix_caching"] is True and talker["max_model_len"] == 4096
    assert talker["dtype"] == "bfloat16" and "enable_prefix_caching" not in vocoder
    assert overlay["model_runner"] == "v1"


def test_keys_are_checked_against_the_environments_vllm_omni():
    python = omni_python()
    top, stages = parse(["talker.enable_prefix_caching=true", "talker.seed=3", "vocoder.max_num_seqs=2",
                         "async_chunk=true"])
    check(python, top, stages)  # StageDeployConfig, EngineArgs and DeployConfig fields: accepted
    with pytest.raises(BadInput, match=r"talker.enable_prefix_cachng: 'enable_prefix_cachng' is no setting .*"
                                       r"did you mean enable_prefix_caching"):
        check(python, {}, parse(["talker.enable_prefix_cachng=true"])[1])
    with pytest.raises(BadInput, match="'async_chunks' is no setting this vLLM-Omni knows"):
        check(python, {"async_chunks": True}, {})


def test_an_unknown_key_exits_2_before_any_model_work(tmp_path, capsys):
    code = main(["run", "cases/suites/smoke.yaml", "--candidate", "vllm-omni", "-n", "2", "--out", str(tmp_path / "o"),
                 "--store", str(tmp_path / "store"), "--no-mlflow", "--vllm-omni-python", str(omni_python()),
                 "--engine-arg", "talker.max_modle_len=4096"])
    err = capsys.readouterr().err
    assert code == 2 and "max_modle_len" in err and "did you mean max_model_len" in err and "Traceback" not in err
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.npz"))
