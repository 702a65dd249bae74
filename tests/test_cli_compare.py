"""`difftest compare` end to end, as a user runs it: files in, report.json and exit code out."""

import json
import subprocess
import sys

import numpy as np
from toy import toy_codes, toy_decode, toy_result

from difftest.results import write_result


def run(*args):
    p = subprocess.run([sys.executable, "-m", "difftest", *map(str, args)], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def make_sets(tmp_path, leak=False):
    ref, cand, ctrl = (tmp_path / n for n in ("ref", "cand", "ctrl"))
    refs = {f"s{i}": toy_codes(10 + i, 50 + i) for i in range(3)}
    for i in range(3):
        sid, codes = f"s{i}", toy_codes(30, i)
        own = refs[sid]
        write_result(ref / sid, toy_result(sid, codes, own, meta={"runner": "reference", "concurrency": 1}))
        write_result(ctrl / sid, toy_result(sid, codes, own, meta={"runner": "cand", "concurrency": 1}))
        used = refs["s2"] if leak else own  # the seed's bug: last writer's ref codes for everyone
        write_result(cand / sid, toy_result(sid, codes, used, wav=toy_decode(codes, used),
                                            meta={"runner": "cand", "concurrency": 3}))
    return ref, cand, ctrl


def test_clean_sets_pass(tmp_path):
    ref, cand, ctrl = make_sets(tmp_path)
    code, out, err = run("compare", ref, cand, "--control", ctrl, "--out", tmp_path / "o")
    assert code == 0, err
    assert out.startswith("PASS: 3 segments (3 identical)")
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rep["format"] == "difftest.report/1" and rep["verdict"] == "pass" and rep["exit_code"] == 0
    assert rep["concurrency"] == 3 and rep["candidate"]["label"] == "cand"
    assert (tmp_path / "o" / "summary.md").read_text().startswith("## difftest: pass")


def test_leak_fails_with_donor(tmp_path):
    ref, cand, ctrl = make_sets(tmp_path, leak=True)
    code, out, _ = run("compare", ref, cand, "--control", ctrl, "--out", tmp_path / "o")
    assert code == 1
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    by_id = {s["id"]: s for s in rep["segments"]}
    # Without cross-decodes, compare still sees from the captured ref codes that s0 and s1
    # decoded with s2's; s2 itself is clean.
    assert {k: (v["verdict"], v["donor"], v["stage"], v["first_divergent_chunk"]) for k, v in by_id.items()} == {
        "s0": ("contamination", "s2", "handoff", 0),
        "s1": ("contamination", "s2", "handoff", 0),
        "s2": ("identical", None, None, None)}
    assert "s0: contamination [chunk 0, handoff, donor s2]" in out


def test_missing_segment_and_bad_dirs(tmp_path):
    ref, cand, ctrl = make_sets(tmp_path)
    for p in cand.glob("s1.*"):
        p.unlink()
    code, out, _ = run("compare", ref, cand, "--out", tmp_path / "o")
    assert code == 2
    assert "s1: error" in out and "segment s1 has no candidate result" in out
    code, _, err = run("compare", ref, tmp_path / "nope", "--out", tmp_path / "o")
    assert code == 2 and "candidate set" in err and "not a directory" in err
    code, _, err = run("compare", ref, cand, "--out", tmp_path / "o", "--chunks", "0,25")
    assert code == 2 and "INITIAL,FRAMES" in err


def test_nan_candidate_is_an_error_verdict(tmp_path):
    ref, cand, ctrl = make_sets(tmp_path)
    r = toy_result("s0", toy_codes(30, 0), toy_codes(10, 50), wav=np.full(30 * 1920, np.nan, np.float32))
    for p in cand.glob("s0.*"):
        p.unlink()
    write_result(cand / "s0", r)
    code, out, _ = run("compare", ref, cand, "--out", tmp_path / "o")
    assert code == 1  # a candidate that returns NaN fails the gate
    assert "NaN" in out


def test_an_audio_only_candidate_set_that_diverges_is_no_pass(tmp_path):
    """Candidate results without codes (a URL server without capture) whose audio is not the
    reference's: `audio_divergence`, which fails nothing by itself; no PASS rests on it (issue 56)."""
    ref, cand = tmp_path / "ref", tmp_path / "cand"
    empty = np.zeros((0, 16), np.int64)
    for i in range(2):
        sid, codes, own = f"s{i}", toy_codes(30, i), toy_codes(10 + i, 50 + i)
        write_result(ref / sid, toy_result(sid, codes, own, meta={"runner": "reference", "concurrency": 1}))
        silence = np.zeros_like(toy_decode(codes, own))  # as long as the right answer
        write_result(cand / sid, toy_result(sid, empty, empty, wav=silence, has_codes=False,
                                            meta={"runner": "url", "concurrency": 2}))
    code, out, _ = run("compare", ref, cand, "--out", tmp_path / "o")
    assert code == 3, out
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert {s["verdict"] for s in rep["segments"]} == {"audio_divergence"}
    codes = rep["configuration_exercised"]["checks"]["codes"]
    assert codes["verdict"] == "error" and codes["segments"] == ["s0", "s1"] and "nothing judged on codes" in out
