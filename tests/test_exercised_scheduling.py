"""The talker's scheduling, as the run reports it: prompts prefilled over several steps and requests
preempted and resumed are named; a path the run was required to take and did not is an error."""

from toy import toy_codes, toy_result

from difftest.engines.capture import schedule_meta
from difftest.verdicts import exercised

import numpy as np


def result(sid, prefill, preemptions=()):
    sched = {"prefill": np.array(prefill, np.int64).reshape(-1, 3),
             "preemptions": np.array(preemptions, np.int64).reshape(-1, 2)}
    return toy_result(sid, toy_codes(4, 1), toy_codes(2, 2), meta=schedule_meta(sched))


def test_schedule_meta_counts_prompt_steps_apart_from_a_resumes_replay():
    # ab-01 in 0.30.0 with two requests' worth of talker KV: prefilled in one step (49 tokens),
    # preempted after 84 generated tokens (132 computed), resumed by one 133-token replay.
    m = schedule_meta({"prefill": np.array([[0, 49, 0], [0, 133, 84]]), "preemptions": np.array([[84, 132]])})
    assert m == {"prefill_steps": 1, "prefill_tokens": [49], "preempted_at": [84], "resume_steps": [[0, 133, 84]]}
    chunked = schedule_meta({"prefill": np.array([[0, 32, 0], [32, 17, 0]]), "preemptions": np.zeros((0, 2))})
    assert (chunked["prefill_steps"], chunked["prefill_tokens"], chunked["preempted_at"]) == (2, [32, 17], [])


def test_paths_taken_are_named_per_request():
    passes = {"c=4": {"a": result("a", [[0, 32, 0], [32, 17, 0]]), "b": result("b", [[0, 49, 0], [0, 133, 84]], [[84, 132]])},
              "c=1": {"a": result("a", [[0, 49, 0]]), "b": result("b", [[0, 49, 0]])}}
    f = exercised.scheduling(passes, required=("chunked_prefill", "preemption"))
    assert f["verdict"] == "pass"
    assert f["chunked_prefill"] == {"c=4:a": [32, 17]}
    assert f["preempted"] == {"c=4:b": [84]}
    assert f["summary"] == ("chunked prefill: 1 prompts over 2 or more steps (up to 2); "
                            "preemption: 1 requests preempted and resumed (c=4:b after 84 tokens)")


def test_a_required_path_no_request_took_is_an_error_naming_it():
    passes = {"c=4": {"a": result("a", [[0, 49, 0]])}}
    f = exercised.scheduling(passes, required=("preemption",))
    assert f["verdict"] == "error"
    assert f["summary"].startswith("configuration not exercised: preemption required, but no request took that path "
                                   "(every prompt prefilled in one step; no request preempted)")
    # and where the capture says nothing of scheduling, the requirement cannot be met either
    blind = {"c=4": {"a": toy_result("a", toy_codes(4, 1), toy_codes(2, 2))}}
    f = exercised.scheduling(blind, required=("chunked_prefill",))
    assert f["verdict"] == "error" and "the capture does not say how the talker scheduled any request" in f["summary"]
    assert exercised.scheduling(blind) is None  # nothing said, nothing required: nothing to report


def test_the_run_level_finding_carries_it():
    passes = {"c=4": {"a": result("a", [[0, 49, 0]])}}
    f = exercised.finding({}, passes, {}, required=("chunked_prefill",))
    assert f["verdict"] == "error" and f["checks"]["scheduling"]["verdict"] == "error"


def test_preemptions_the_server_counted_and_the_capture_did_not_name_are_an_error():
    passes = {"c=4": {"a": result("a", [[0, 49, 0], [0, 133, 84]], [[84, 132]]), "b": result("b", [[0, 49, 0]])}}
    ok = exercised.scheduling(passes, counters={"0": {"preemptions": 1}, "1": {"preemptions": 0}})
    assert ok["verdict"] == "pass" and ok["server_counted_preemptions"] == 1
    f = exercised.scheduling(passes, counters={"0": {"preemptions": 2}})
    assert f["verdict"] == "error"
    assert f["summary"].startswith("the talker's server counted 2 preemptions, the capture names 1")
    unread = exercised.scheduling(passes, counters={"error": "http://127.0.0.1:9/metrics: refused"})
    assert unread["verdict"] == "pass" and "refused" in unread["server_counted_preemptions"]
    # a stage that died mid-request leaves its preemption unnamed: said, not an error
    died = exercised.scheduling(passes, counters={"0": {"preemptions": 2}}, unanswered=3)
    assert died["verdict"] == "pass" and died["summary"].endswith(
        "1 of the server's 2 preemptions in the 3 requests that got no answer")


def test_the_plugin_files_scheduler_records_per_request_and_hands_them_over_once(tmp_path):
    from runners.vllm_omni.difftest_capture.difftest_capture.store import CaptureStore

    store = CaptureStore(tmp_path)
    store.file_schedule("r1", "prefill", (0, 49, 0))
    store.file_schedule("r1", "preempt", (84, 132))
    store.file_schedule("r1", "prefill", (0, 133, 84))
    store.file_schedule("r2", "prefill", (0, 32, 0))
    got = store.schedule(["engine-id-unknown", "r1"])  # the first id that has records
    assert got["talker_prefill"].tolist() == [[0, 49, 0], [0, 133, 84]]
    assert got["talker_preemptions"].tolist() == [[84, 132]]
    assert store.schedule(["r1"], consume=True)["talker_preemptions"].tolist() == [[84, 132]]
    empty = store.schedule(["r1"])  # used up: a request served in one step, never preempted, reads so
    assert empty["talker_prefill"].shape == (0, 3) and empty["talker_preemptions"].shape == (0, 2)
    assert store.schedule(["r2"])["talker_prefill"].tolist() == [[0, 32, 0]]
    # a half-written last record (a crash mid-append) is dropped, the whole ones kept
    with open(store._talker_path("r2").with_suffix(".sched"), "ab") as f:
        f.write(b"\x01\x00\x00")
    assert store.schedule(["r2"])["talker_prefill"].tolist() == [[0, 32, 0]]


def test_a_capture_files_schedule_arrays_are_checked():
    from pathlib import Path

    import pytest

    from difftest.engines.capture import CaptureError, validate

    base = {"codes": np.zeros((3, 16), np.int64)}
    ok = validate({**base, "talker_prefill": np.array([[0, 49, 0]]), "talker_preemptions": np.zeros((0, 2), np.int64)},
                  Path("x.npz"))
    assert ok.schedule["prefill"].tolist() == [[0, 49, 0]] and ok.schedule["preemptions"].shape == (0, 2)
    assert validate(base, Path("x.npz")).schedule is None  # not said: a writer without the scheduler wrapper
    with pytest.raises(CaptureError, match="come together"):
        validate({**base, "talker_prefill": np.array([[0, 49, 0]])}, Path("x.npz"))
    with pytest.raises(CaptureError, match=r"talker_preemptions must be \(P, 2\) integers >= 0"):
        validate({**base, "talker_prefill": np.array([[0, 49, 0]]), "talker_preemptions": np.array([[-1, 3]])},
                 Path("x.npz"))
