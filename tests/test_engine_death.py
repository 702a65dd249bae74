"""A stage that died, named from the server's log: #4471 re-created in 0.30.0 (the talker's engine
core raising in `preprocess` on a resume's replay) answers every request in flight with HTTP 500
and no stage; the log's traceback says which stage and where."""

from difftest.engines.engine_death import attribute, deaths

P = "/x/lib/python3.11/site-packages/"
TALKER = "\x1b[0;36m(StageEngineCoreProc_stage0_replica0 pid=3428)\x1b[0;0m \x1b[31mERROR\x1b[0m 12-07 04:14:27 [stage_engine_core_proc.py:260] "
API = "(APIServer pid=3265) ERROR 12-07 04:14:27 [orchestrator.py:1290] "
LOG = "\n".join([
    "(StageEngineCoreProc_stage0_replica0 pid=3428) INFO 12-07 04:10:00 [core.py:1] started",
    TALKER + "Traceback (most recent call last):",
    TALKER + f'  File "{P}vllm_omni/worker/gpu_model_runner.py", line 1886, in _preprocess',
    TALKER + '  File "/work/main/runners/vllm_omni/difftest_capture/difftest_capture/hooks.py", line 388, in method',
    TALKER + f'  File "{P}vllm_omni/model_executor/models/qwen3_tts/qwen3_tts_talker.py", line 1038, in preprocess',
    TALKER + "    last_id_hidden = self.embed_input_ids(input_ids.reshape(1, 1).to(torch.long)",
    TALKER + "RuntimeError: shape '[1, 1]' is invalid for input of size 32",
    API + "[Orchestrator] Stage-0 replica-0 is dead; evicting it and failing its in-flight requests",
    "(APIServer pid=3265) ERROR 12-07 04:14:30 [errors.py:50] EngineDeadError: orchestrator_alive=True, error_stage_id=0",
])


def test_the_dead_stage_its_exception_and_the_crash_site_are_read_from_the_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(LOG)
    assert deaths(log) == [{"stage_id": 0, "stage": "talker",
                            "cause": "RuntimeError: shape '[1, 1]' is invalid for input of size 32",
                            "site": "vllm_omni/model_executor/models/qwen3_tts/qwen3_tts_talker.py:1038 in preprocess"}]
    healthy = tmp_path / "healthy.log"
    healthy.write_text("\n".join(LOG.splitlines()[:1]))
    assert deaths(healthy) == [] and deaths(tmp_path / "missing.log") == []


def test_a_request_error_from_a_dead_stage_names_it_and_others_are_left_alone(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(LOG)
    errors = {"a": {"source": "candidate", "kind": "candidate", "message": "HTTP 500: EngineCore encountered an issue"},
              "b": {"source": "candidate", "kind": "candidate", "message": "HTTP 400: reference too short"},
              "c": {"source": "candidate", "kind": "infrastructure", "message": "HTTP 500: timeout"}}
    assert attribute(errors, [log]) == 1
    assert errors["a"]["stage"] == "talker"
    assert errors["a"]["message"].endswith("(the talker's engine died of RuntimeError: shape '[1, 1]' is invalid for "
                                           "input of size 32 at vllm_omni/model_executor/models/qwen3_tts/"
                                           "qwen3_tts_talker.py:1038 in preprocess; the server's log)")
    assert "stage" not in errors["b"] and "stage" not in errors["c"]
    clean = tmp_path / "clean.log"
    clean.write_text("nothing died\n")
    other = {"a": {"source": "candidate", "kind": "candidate", "message": "HTTP 500: x"}}
    assert attribute(other, [clean]) == 0 and "stage" not in other["a"]
