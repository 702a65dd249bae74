"""The candidate kinds (issue 59, item 3): what each kind is lives in one record
(difftest.engines.start.KINDS); commands ask it, never compare a kind's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from difftest.engines.start import CPU_ENGINE, KINDS, URL, VLLM_OMNI, VLLM_OMNI_OFFLINE, CandidateSpec
from difftest.errors import BadInput

REPO = Path(__file__).resolve().parents[1]
HOME = REPO / "difftest" / "engines" / "start.py"


def test_each_kind_says_what_it_is():
    assert set(KINDS) == {VLLM_OMNI, VLLM_OMNI_OFFLINE, CPU_ENGINE, URL}
    assert [k for k, v in KINDS.items() if v.deploy_file] == [VLLM_OMNI, VLLM_OMNI_OFFLINE]
    assert [k for k, v in KINDS.items() if not v.started_here] == [URL]
    assert [k for k, v in KINDS.items() if v.one_batch_per_wave] == [VLLM_OMNI_OFFLINE]
    assert [k for k, v in KINDS.items() if v.planted_defects] == [CPU_ENGINE]
    assert CandidateSpec.parse("cpu-engine:ref-leak").is_.planted_defects
    assert not CandidateSpec.parse("http://127.0.0.1:8000").is_.started_here
    assert CandidateSpec.parse("vllm-omni-offline:async").is_.one_batch_per_wave


def test_the_matrix_refuses_a_kind_without_a_deploy_file_by_what_it_is():
    from types import SimpleNamespace

    from difftest.commands.run_matrix import run_matrix

    with pytest.raises(BadInput, match="--candidate vllm-omni or vllm-omni-offline"):
        run_matrix(SimpleNamespace(matrix=["talker.max_num_seqs=2,4"]), None, None,
                   CandidateSpec.parse("cpu-engine"), None, None)


def test_no_command_compares_a_kinds_name_outside_its_record():
    # a spec's kind compared (spec.kind == ..., CandidateSpec.parse(...).kind in (...)), or a kind's name
    # (args.recipe == "cpu-engine"; a package named vllm-omni is no kind)
    names = "|".join(re.escape(k) for k in KINDS)
    compare = re.compile(r"(\bspec|CandidateSpec\.parse\(.*\))\.kind\s*(==|!=|\bin\b|\bnot in\b)"
                         r"|(==|!=|\bin \()\s*(CPU_ENGINE|VLLM_OMNI|VLLM_OMNI_OFFLINE|URL)\b"
                         rf"|(kind|recipe|candidate)\w*\)?\s*(==|!=|\bin \()\s*[\"']({names})[\"']")
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
             for p in sorted((REPO / "difftest").rglob("*.py")) if p != HOME
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if compare.search(line)]
    assert found == []


def test_the_commands_treat_each_kind_by_what_it_is(tmp_path):
    """The places that asked a kind's name now ask its record; each still does what it did."""
    from contextlib import ExitStack
    from types import SimpleNamespace

    from difftest.pipeline.starting import start_ray_candidate
    from difftest.repro.probe import Live, opts_for
    from difftest.run import RunOptions, run
    from difftest.suites.suite import load_suite
    from difftest.verdicts.policy import load_policy

    def origin(text, pattern="pool"):
        return SimpleNamespace(spec=CandidateSpec.parse(text), mutant=None, report={},
                               run_options=lambda store: RunOptions(pattern=pattern))

    with ExitStack() as stack:
        # repro's clean control: the CPU engine without its defect; a URL has none
        assert Live(origin("cpu-engine:ref-leak"), stack, tmp_path).spec((), clean=True).defect is None
        assert Live(origin("http://127.0.0.1:9"), stack, tmp_path).spec((), clean=True) is None
    # repro's probes of the offline API go as one batch per wave; the server keeps its arrivals
    assert opts_for(origin("vllm-omni-offline"), None).pattern == "barrier"
    assert opts_for(origin("vllm-omni"), None).pattern == "pool"
    with pytest.raises(BadInput, match="already served elsewhere"):
        start_ray_candidate(CandidateSpec.parse("http://127.0.0.1:9"), None, {}, "t")
    smoke = load_suite(REPO / "cases" / "suites" / "smoke.yaml")
    with pytest.raises(BadInput, match="one batch with its voices inline"):
        run(smoke, CandidateSpec.parse("vllm-omni-offline"), tmp_path / "o", load_policy(),
            RunOptions(pattern="pool", store=tmp_path / "s"))


def test_bisect_builds_each_kind_it_can_by_the_kinds_name():
    from types import SimpleNamespace

    from difftest.bisect.builds import RECIPES
    from difftest.commands.bisect import _setup

    assert set(RECIPES) == {VLLM_OMNI, CPU_ENGINE} and all(r.name == k for k, r in RECIPES.items())
    with pytest.raises(BadInput, match=r"--recipe 'cpu_engine': no such recipe \(known: vllm-omni, cpu-engine\)"):
        _setup(SimpleNamespace(suite=str(REPO / "cases" / "suites" / "smoke.yaml"), policy=None, concurrency=1,
                               bad_on=None, pattern="pool", order="suite", voices="inline", store=".",
                               reference_model=None, reference_python=None, device="cpu", dtype="float32",
                               repeats=1, agree=None, pip_args=None, recipe="cpu_engine"))


def test_a_spec_replays_as_it_was(tmp_path):
    """run.json's `replay.spec` is the spec, whole: `difftest repro` starts the same candidate, a URL
    candidate served by one server per checkpoint type included (its routes were once left out)."""
    import json

    routed = CandidateSpec(URL, url="http://127.0.0.1:8001", capture_dir=tmp_path, declared={"commit": "abc"},
                           routes={"Base": "http://127.0.0.1:8001", "CustomVoice": "http://127.0.0.1:8002"})
    for spec in (CandidateSpec.parse("cpu-engine:ref-leak"), CandidateSpec.parse("vllm-omni-offline:async"),
                 CandidateSpec(VLLM_OMNI, python="/x/bin/python", engine_args=("--enforce-eager",),
                               options={"device": "cpu"}), routed):
        assert CandidateSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    old = {k: v for k, v in routed.to_json().items() if k != "routes"}  # a run.json from before
    assert CandidateSpec.from_json(old).routes is None
