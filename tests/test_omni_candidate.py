"""vLLM-Omni 0.30.0 serving the tiny Qwen3-Omni on this CPU (issue 60), driven by difftest's own
pieces: the deploy overlay (difftest/engines/omni_chat.py), the chat body and answer, the capture
plugin's greedy sub-talker. The real server, the real reference; heavy (a three-stage start takes
about two minutes on two cores).

What it measures against transformers' Qwen3-Omni (the reference, float32): the audio's length per
segment, and that a batch of four answers as long."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from reference_support import REPO, reference_python

from difftest.engines import apis, omni_chat
from difftest.engines.reference import ReferenceOptions, family_tiny, run_reference
from difftest.engines.speech_client import SpeechClient
from difftest.engines.vllm_omni import VllmOmniOptions, omni_python, server_argv, server_env, write_overlay
from difftest.family import QWEN3_OMNI
from difftest.process.launcher import ServerProcess, free_port
from difftest.suites import wavio
from difftest.suites.suite import load_suite

pytestmark = pytest.mark.heavy
SUITE = REPO / "cases" / "suites" / "omni-smoke.yaml"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("omni-candidate-store")


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    python = omni_python(None)
    model = family_tiny(store, reference_python(), QWEN3_OMNI)[0]
    out = tmp_path_factory.mktemp("omni-server")
    base = python.parents[1] / "lib" / "python3.11" / "site-packages" / "vllm_omni" / "deploy" / "qwen3_omni_moe.yaml"
    overlay = write_overlay(out / "deploy-overlay.yaml",
                            omni_chat.deploy_overlay(str(base), max_num_seqs=4, async_chunk=True))
    opts = VllmOmniOptions()
    port = free_port()
    env = {**server_env(opts, None, out / "speakers"), omni_chat.GREEDY_ENV: "1"}
    srv = ServerProcess(server_argv(python, model, overlay, port, opts), f"http://127.0.0.1:{port}",
                        out / "server.log", env=env, cwd=REPO, health_timeout=900, name="vLLM-Omni (Qwen3-Omni)")
    srv.start()
    try:
        yield SpeechClient(f"http://127.0.0.1:{port}"), model, out
    finally:
        srv.stop()


def ask(client, seg):
    """(float32 samples, sample rate): the segment asked as a run asks it (engines/apis.py)."""
    _, wav = apis.ChatApi().ask(client, seg, f"t-{seg.id}", "inline", None)
    x, info = wavio.read(wav)
    return x, info.sample_rate


def test_the_tiny_qwen3_omni_answers_in_each_speaker_as_long_as_the_reference(server, store):
    client, _, out = server
    suite = load_suite(SUITE)
    ref = run_reference(suite, store, ReferenceOptions(python=str(reference_python())))
    assert ref.errors == {}
    alone = {seg.id: ask(client, seg) for seg in suite.segments}
    with ThreadPoolExecutor(4) as pool:  # the four at once: one batch at every stage
        together = dict(zip([s.id for s in suite.segments], pool.map(lambda s: ask(client, s), suite.segments)))
    for seg in suite.segments:
        wav, sr = alone[seg.id]
        r = ref.results[seg.id]
        assert sr == QWEN3_OMNI.sample_rate
        # async_chunk (the release's path): a frame per talker token but the last, as transformers decodes
        assert len(wav) == len(r.wav), (seg.id, len(wav), len(r.wav))
        # the batch answers as long; byte equality with one at a time held on an idle machine, but which
        # steps the requests share depends on timing, and bf16 batches of other shapes may part late
        assert len(together[seg.id][0]) == len(wav) and np.isfinite(together[seg.id][0]).all(), seg.id
        assert 0.01 < np.abs(wav).max() <= 1.0
    # the speakers reach the audio: Ethan's and Chelsie's first 12 frames differ
    n = 12 * QWEN3_OMNI.samples_per_frame
    assert not np.array_equal(alone["omni-01"][0][:n], alone["omni-02"][0][:n])
    log = (out / "server.log").read_text(errors="replace")
    assert "DIFFTEST_OMNI_SUBTALKER_GREEDY set" in log


def test_difftest_run_finds_the_full_payload_handoff_defect_of_0_30(store, tmp_path):
    """`difftest run` on omni-smoke at 4 through the full-payload hand-off (async_chunk off): vLLM-Omni
    0.30.0 hands code2wav the talker's zero prefill placeholder as a first frame, one frame more than the
    talker generated; every segment is handoff_defect at frame 0, exit 1. Its talker is prompted right."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "difftest", "run", str(SUITE), "--candidate", "vllm-omni", "-n", "4",
                        "--out", str(out), "--store", str(store), "--no-mlflow"],
                       cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 1, r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "fail"
    for seg in report["segments"]:
        assert (seg["verdict"], seg["stage"], seg["first_divergent_frame"]) == ("handoff_defect", "handoff", 0), seg
        assert "where the talker generated" in seg["summary"] and "(codebook-0 0 against" in seg["summary"]
        # the talker was prompted as transformers' was (the chat turn, the speaker's id: captured on both sides),
        # and teacher forcing of the frames the hand-off changed is not held against the talker
        assert seg["comparisons"]["talker_input"] == {"differ": []}, seg["comparisons"].get("talker_input")
        assert not any(f["verdict"] == "talker_defect" for f in seg["also"]), seg["also"]
        assert [f["verdict"] for f in seg["also"]] == ["code_divergence"]  # the zero frame shifts every frame
    # teacher forcing and the measured null in bf16 judged the codes (transformers' Qwen3-Omni, alone)
    assert report["measured_null"]["numerics"]["dtype"] == "bfloat16" and report["measured_null"]["null_decoded"]
    # the talker's own frames forced (the zero frame before them is the hand-off's): as plausible as bf16's
    assert report["measured_null"]["verdict"] == "pass", report["measured_null"]["summary"]
    assert "cannot batch" in report["measured_null_at_n"]["numerics"]["null_n"]
    assert report["reference"]["label"] == QWEN3_OMNI.reference_label
