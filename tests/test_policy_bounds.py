"""A policy can still fail a run (issue 56, items 4 and 12): every number lies in a range that keeps a
failing verdict reachable, one parser reads every number alike, a fail_on that lets defects pass is
said loudly, and `difftest gate` names the policy it judged with.

Reproduced against the landing before: `tiers.close_max_abs: 1e9` was accepted and a cross-request
leak passed `difftest compare` and `difftest gate`; `forced.max_gap: 2e0` was refused while
`tiers.close_max_abs: 1e-3` was read; `fail_on: []` passed a leaking run without a word."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from mlflow_support import make_report

from difftest.cli import main as difftest_main
from difftest.errors import BadInput
from difftest.verdicts.policy import BOUNDS, DEFAULT_POLICY, DEFECTS, INTEGERS, _in_range, load_policy

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "cases" / "suites" / "smoke.yaml"
DEFAULT = yaml.safe_load(DEFAULT_POLICY.read_text())

# Per field, a value that makes its tolerance accept anything (or its test never flag).
ABSURD = {
    "tiers.quantisation_max_abs": "1", "tiers.close_max_abs": "1e9", "tiers.close_snr_db": "-1e9",
    "tiers.close_logmel": "1e9", "donor.max_ratio": "1", "forced.max_rank": "4096", "forced.near_tie_top_k": "4096",
    "forced.max_gap": "1e9", "forced.near_tie_max_gap": "1e3", "forced.near_tie_gross_gap": "100",
    "forced.exact_tie_gap": "0.01",
    "forced.support_max_gap": "50", "forced.support_gross_gap": "1e9", "forced.min_top1_share": "0",
    "forced.min_sub_top1_share": "0.01", "forced.sampling_max_z": "1e9", "forced.sampling_false_flag_rate": "1e-300",
    "reference_encoder.min_agreement": "0", "measured_null.false_flag_rate": "1e-12",
    "measured_null.rate_margin": "1e9",
    "measured_null.segment_false_flag_rate": "1", "measured_null.noise_scale": "100",
    "baseline.numerics_false_flag_rate": "0.0", "baseline.numerics_rate_margin": "1000", "vocoder_null.margin": "1e9",
    "talker_input.prompt_bf16_max_rel": "1e9",
}


def policy_with(tmp_path: Path, field: str, text: str, name: str = "p.yaml") -> Path:
    """The default policy with `field` set to `text`, written as YAML reads it (unquoted)."""
    section, key = field.split(".")
    raw = json.loads(json.dumps(DEFAULT))
    raw[section][key] = "@@"
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw).replace("'@@'", text))
    return path


def gate(*args) -> int:
    return difftest_main(["gate", *map(str, args)])


def test_every_number_of_a_policy_has_one_range_that_holds_its_default():
    d = load_policy().as_dict()
    numbers = {f"{s}.{k}": v for s, sec in d.items() if isinstance(sec, dict) for k, v in sec.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert set(numbers) == set(BOUNDS) and INTEGERS == {"forced.max_rank", "forced.near_tie_top_k"}
    assert [f for f, v in numbers.items() if not _in_range(v, BOUNDS[f][0])] == []
    assert set(ABSURD) == set(BOUNDS)
    doc = (ROOT / "docs" / "verdicts.md").read_text()  # the docs' table is this one
    assert [f for f, (allowed, _) in BOUNDS.items() if f"| `{f}` | {allowed} |" not in doc] == []


@pytest.mark.parametrize("field", sorted(BOUNDS))
def test_a_tolerance_that_accepts_anything_is_refused_naming_the_field_and_range(tmp_path, field):
    path = policy_with(tmp_path, field, ABSURD[field])
    with pytest.raises(BadInput) as e:
        load_policy(path)
    assert str(e.value).startswith(f"{path}: {field}: out of range: ")
    assert f", allowed {BOUNDS[field][0]}: " in str(e.value)
    lo, hi = (float(t) for t in BOUNDS[field][0][1:-1].split(","))  # a closed end is itself allowed
    for end, closed in ((lo, BOUNDS[field][0][0] == "["), (hi, BOUNDS[field][0][-1] == "]")):
        if closed:
            section, key = field.split(".")
            got = load_policy(policy_with(tmp_path, field, repr(int(end) if field in INTEGERS else end))).as_dict()
            assert got[section][key] == end


def test_absurd_policies_exit_2_from_compare_run_and_gate(tmp_path, capsys):
    leak = make_report(tmp_path, "leak", leak_into=("s0",))
    base = leak.parent
    for field in ("tiers.close_max_abs", "tiers.close_snr_db", "forced.max_gap", "forced.min_top1_share"):
        bad = policy_with(tmp_path, field, ABSURD[field], f"{field}.yaml")
        capsys.readouterr()
        assert difftest_main(["compare", str(base / "ref"), str(base / "cand"), "--control", str(base / "ctrl"),
                              "--out", str(tmp_path / "o"), "--policy", str(bad)]) == 2
        assert gate(leak, "--policy", bad) == 2
        err = capsys.readouterr().err
        assert f"{bad}: {field}: out of range: " in err and f"allowed {BOUNDS[field][0]}: " in err
    assert not (tmp_path / "o").exists()
    p = subprocess.run([sys.executable, "-m", "difftest", "run", str(SMOKE), "--candidate", "cpu-engine:ref-leak",
                        "--out", str(tmp_path / "r"), "--store", str(tmp_path / "s"), "--no-mlflow",
                        "--policy", str(bad)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 2 and "forced.min_top1_share: out of range: 0, allowed [0.5, 1]" in p.stderr
    assert not (tmp_path / "r").exists()


# (text as written in YAML, what every field reads it as): exponents without a dot are strings to YAML 1.1
SPELLINGS = (("2e0", 2.0), ("5e-1", 0.5), ("6e-5", 6e-5), ("0", 0.0), ("1e1", 10.0), ("3E-2", 0.03), ("'0.2'", 0.2),
             ("1", 1.0), ("1.0", 1.0))


@pytest.mark.parametrize("field", sorted(BOUNDS))
def test_one_number_parser_for_every_section(tmp_path, field):
    section, key = field.split(".")
    read = 0
    for text, value in SPELLINGS:
        if not _in_range(value, BOUNDS[field][0]) or (field in INTEGERS and value != int(value)):
            continue
        got = load_policy(policy_with(tmp_path, field, text)).as_dict()[section][key]
        assert got == value and type(got) is (int if field in INTEGERS else float), (text, got)
        read += 1
    assert read >= 1
    for text, problem in (("true", "expected a"), ("no", "expected a"), (".nan", "expected a finite number"),
                          (".inf", "expected a finite number"), ("-.inf", "expected a finite number"),
                          ("'nan'", "expected a finite number"), ("1e999", "expected a finite number"),
                          ("big", "expected a"), ("[1]", "expected a"), ("''", "expected a")):
        with pytest.raises(BadInput, match=f"{field}: {problem}"):
            load_policy(policy_with(tmp_path, field, text))
    if field in INTEGERS:
        with pytest.raises(BadInput, match=f"{field}: expected an integer, got '25e-1'"):
            load_policy(policy_with(tmp_path, field, "25e-1"))


def test_the_defects_are_what_the_default_policy_fails_on(tmp_path):
    assert set(DEFECTS) == set(DEFAULT["fail_on"]) and load_policy().warnings() == []
    for fail_on, left_out in (([], list(DEFECTS)), ([v for v in DEFECTS if v != "error"], ["error"])):
        path = tmp_path / "f.yaml"
        path.write_text(yaml.safe_dump({**DEFAULT, "fail_on": fail_on}))
        which = "one of these verdicts" if len(left_out) > 1 else "this verdict"
        assert load_policy(path).warnings() == [
            f"POLICY: fail_on of {path} leaves out {', '.join(left_out)}: a segment with {which} PASSES"]


def test_the_gate_names_the_policy_it_judged_with_and_warns_of_a_fail_on_that_passes_defects(tmp_path, capsys):
    leak = make_report(tmp_path, "leak", leak_into=("s0",))
    default = load_policy()
    capsys.readouterr()
    assert gate(leak) == 1
    line = f"policy: {DEFAULT_POLICY} (sha256 {default.sha256})"
    assert line in capsys.readouterr().out and f"{line}  \n" in (leak / "gate.md").read_text()
    assert "another policy" not in (leak / "gate.md").read_text()
    none = tmp_path / "none.yaml"
    none.write_text(yaml.safe_dump({**DEFAULT, "fail_on": []}))
    judged = load_policy(none)
    assert judged.sha256 != default.sha256
    capsys.readouterr()
    assert gate(leak, "--policy", none) == 0  # allowed, loudly
    out, md = capsys.readouterr().out, (leak / "gate.md").read_text()
    warning = (f"WARNING: POLICY: fail_on of {none} leaves out {', '.join(DEFECTS)}: "
               "a segment with one of these verdicts PASSES")
    for text in (out, md):
        assert f"policy: {none} (sha256 {judged.sha256})" in text and warning in text
        assert (f"the run judged its segments under another policy: {DEFAULT_POLICY} (sha256 {default.sha256}); "
                "this gate applied its own fail_on and baseline sections only") in text
        assert str(DEFAULT_POLICY) not in text.split("another policy")[0]  # the gate's own is the one given
    props = {p.get("name"): p.get("value") for p in ET.parse(leak / "junit.xml").getroot().iter("property")}
    assert (props["gate.policy"], props["gate.policy.sha256"]) == (str(none), judged.sha256)


def test_the_gate_refuses_a_run_judged_under_a_policy_out_of_bounds(tmp_path, capsys):
    leak = make_report(tmp_path, "leak", leak_into=("s0",))
    report = json.loads((leak / "report.json").read_text())
    report["policy"]["tiers"]["close_max_abs"] = 1e9  # what a run under such a policy recorded
    report["policy"]["forced"]["min_top1_share"] = 0
    (leak / "report.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert gate(leak) == 2
    err = capsys.readouterr().err
    assert (f"{leak / 'report.json'}: the run was judged under a policy out of bounds: "
            "tiers.close_max_abs: out of range: 1000000000.0, allowed [0, 0.1]") in err
    assert "; forced.min_top1_share: out of range: 0, allowed [0.5, 1]" in err
    assert not (leak / "gate.md").exists()


def test_a_run_under_a_fail_on_that_passes_defects_says_so_in_its_report(tmp_path):
    from reference_support import reference_python

    reference_python()
    none = tmp_path / "none.yaml"
    none.write_text(yaml.safe_dump({**DEFAULT, "fail_on": []}))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "difftest", "run", str(SMOKE), "--candidate", "cpu-engine:ref-leak",
                        "-n", "4", "--out", str(out), "--store", str(tmp_path / "s"), "--no-mlflow",
                        "--policy", str(none)], capture_output=True, text=True, cwd=tmp_path, timeout=1200)
    report = json.loads((out / "report.json").read_text())
    assert p.returncode == 0 and report["verdict"] == "pass", p.stderr
    assert "contamination" in report["counts"]  # the leak is found, and passes
    warning = f"POLICY: fail_on of {none} leaves out {', '.join(DEFECTS)}: a segment with one of these verdicts PASSES"
    assert report["warnings"][0] == warning and f"  warning: {warning}" in p.stdout
