"""difftest.handoff without a vLLM-Omni environment: generation, the oracle, shrinking, the report,
against a pure-Python stand-in for the probe that has (or lacks) the seed's last-writer-wins leak."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from difftest.errors import BadInput
from difftest.handoff import envs
from difftest.handoff.generate import Case, RequestSpec, audio_row, generate, ref_frame, tag_of
from difftest.handoff.oracle import check, family
from difftest.handoff.probe import Evaluator
from difftest.handoff.run import SourceResult, _collect, verdicts_for
from difftest.handoff.shrink import shrink
from difftest.records.report import build_report


class FakeProbe:
    """Each request hands on its audio rows prefixed by 'the' reference codes; with leak=True the
    reference is the last in-context request's of the batch (vllm-omni 0.22's codes.ref)."""

    def __init__(self, leak: bool):
        self.leak = leak

    def run(self, cases):
        out = []
        for c in cases:
            by_id = {r["id"]: r for r in c["requests"]}
            ordered = [by_id[i] for i in c["order"]]
            last_ref = next((r["ref"] for r in reversed(ordered) if r["ref"]), [])
            obs = {}
            for r in c["requests"]:
                ref = last_ref if self.leak else r["ref"]
                flat = [v for row in ref + r["audio"] for v in row]
                obs[r["id"]] = {"code2wav.codes.audio": {"tensor": "int64", "shape": [len(flat)], "values": flat},
                                "code2wav.meta.left_context_size": len(ref)}
            out.append({"requests": obs, "error": None})
        return out


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
    code = ("import sys, difftest.handoff.cli, difftest.handoff.run, difftest.handoff.envs; "
            "bad = [m for m in ('torch', 'vllm', 'vllm_omni') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
