"""`difftest gate`: exit codes, JUnit XML and Markdown, and the baseline read back from a real
MLflow (sqlite in the working folder, and a real server)."""

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from mlflow_support import closed_uri, make_report

from difftest.cli import main as difftest_main
from difftest.errors import BadInput
from difftest.verdicts.policy import DEFAULT_POLICY, load_policy


def gate(*args) -> int:
    return difftest_main(["gate", *map(str, args)])


def junit_cases(path):
    """segment id -> (outcome, type, message) where outcome is pass, failure, error or skipped."""
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    out = {}
    for case in root.iter("testcase"):
        kids = [k for k in case if k.tag in ("failure", "error", "skipped")]
        assert len(kids) <= 1
        k = kids[0] if kids else None
        out[case.get("name")] = ("pass", None, None) if k is None else (k.tag, k.get("type"), k.get("message"))
    return root, out


def policy_file(tmp_path, **baseline) -> str:
    lines = DEFAULT_POLICY.read_text().split("\nbaseline:")[0]
    body = "".join(f"  {k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in baseline.items())
    path = tmp_path / "policy.yaml"
    path.write_text(lines + "\nbaseline:\n" + body)
    return str(path)


def test_policy_baseline_section(tmp_path):
    p = load_policy()
    assert p.known_failures_fail is False and p.baseline_verdicts == {"pass", "fail"}
    assert p.as_dict()["baseline"] == {"verdicts": ["fail", "pass"], "known_failures_fail": False,
                                       "numerics_false_flag_rate": 0.01, "numerics_rate_margin": 1.0, "numerics_fail": True}
    p = load_policy(policy_file(tmp_path, verdicts="[pass]", known_failures_fail=True))
    assert p.known_failures_fail is True and p.baseline_verdicts == {"pass"}
    without = tmp_path / "old.yaml"  # a policy written before the section existed still loads
    without.write_text(DEFAULT_POLICY.read_text().split("\nbaseline:")[0])
    assert load_policy(without).known_failures_fail is False
    for bad in ({"verdicts": "[passed]"}, {"verdicts": "[]"}, {"known_failures_fail": "'yes'"},
                {"numerics_rate_margin": 0.5}, {"numerics_false_flag_rate": 1.5}, {"numerics_fail": "'no'"}):
        with pytest.raises(BadInput, match="baseline"):
            load_policy(policy_file(tmp_path, **bad))


def test_gate_pass_and_fail_without_baseline(tmp_path, capsys):
    clean = make_report(tmp_path, "clean")
    assert gate(clean) == 0
    root, cases = junit_cases(clean / "junit.xml")
    assert cases == {f"s{i}": ("pass", None, None) for i in range(3)}
    assert root.get("tests") == "3" and root.get("failures") == "0"
    assert (clean / "gate.md").read_text().startswith("## ✅ difftest gate: pass")
    assert f"policy: {DEFAULT_POLICY} (sha256 {load_policy().sha256})  \n" in (clean / "gate.md").read_text()

    leak = make_report(tmp_path, "leak", leak_into=("s0", "s1"))
    junit, md = tmp_path / "ci" / "j.xml", tmp_path / "ci" / "summary.md"
    capsys.readouterr()
    assert gate(leak, "--junit", junit, "--markdown", md) == 1
    assert capsys.readouterr().out.startswith("GATE FAIL: 3 segments of suite adhoc: 2 failing, 1 passing")
    root, cases = junit_cases(junit)
    assert root.get("failures") == "2" and root.find("testsuite").get("failures") == "2"
    assert cases["s2"] == ("pass", None, None)
    for sid in ("s0", "s1"):
        outcome, kind, message = cases[sid]
        assert (outcome, kind) == ("failure", "contamination")
        assert message.startswith("contamination at chunk 0, stage handoff, donor s2: the candidate used s2's")
    text = root.find(".//testcase[@name='s0']/failure").text
    assert "first divergent chunk: 0 (frame 0)" in text and "donor: s2" in text
    assert "donor_kind: codes" in text
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["gate.verdict"] == "fail" and props["candidate.version"] == "0.30.0" and props["device"] == "cpu"
    summary = md.read_text()
    assert summary.startswith("## ❌ difftest gate: fail") and "| s0 | **failing** | contamination | 0 | handoff | s2 |" in summary
    assert not (leak / "junit.xml").exists()


def test_gate_shows_a_length_donor(tmp_path, capsys):
    out = make_report(tmp_path, "length", length_into=("s0",))
    assert gate(out) == 1
    _, cases = junit_cases(out / "junit.xml")
    outcome, kind, message = cases["s0"]
    assert (outcome, kind) == ("failure", "contamination")
    assert message.startswith("contamination at chunk 0, stage handoff, donor s2 (length): s0's vocoder got its own "
                              "reference codes extended to s2's length (12 frames instead of 10: 2 more repeating")
    assert "donor_kind: length" in ET.parse(out / "junit.xml").getroot().find(".//testcase[@name='s0']/failure").text
    assert "| s0 | **failing** | contamination | 0 | handoff | s2 (length) |" in (out / "gate.md").read_text()
    assert "| s0 | contamination | 0 | handoff | s2 (length) |" in (out / "summary.md").read_text()


def test_gate_infrastructure_error_exits_3_and_bad_input_2(tmp_path, capsys):
    broken = make_report(tmp_path, "broken", nan_reference=True)
    assert gate(broken) == 3
    _, cases = junit_cases(broken / "junit.xml")
    assert cases["s0"][0] == "error" and "NaN" in cases["s0"][2]
    assert (broken / "gate.md").read_text().startswith("## ⚠️ difftest gate: error")
    assert gate(tmp_path / "nowhere") == 2
    assert "no report.json" in capsys.readouterr().err
    assert gate(broken, "--policy", tmp_path / "missing.yaml") == 2


def test_regression_known_and_fixed_against_a_logged_baseline(mlflow_cwd, tmp_path, capsys):
    from difftest.records.tracking import log_run

    assert log_run(make_report(tmp_path, "base", leak_into=("s0",), version="0.30.0"))
    now = make_report(tmp_path, "now", leak_into=("s0", "s1"), version="0.31.0")
    assert gate(now, "--baseline-version", "0.30.0") == 1
    root, cases = junit_cases(now / "junit.xml")
    assert cases["s0"][0] == "skipped" and "known failure (contamination in baseline 0.30.0)" in cases["s0"][2]
    assert cases["s1"][:2] == ("failure", "contamination") and cases["s1"][2].startswith("regression: contamination at chunk 0")
    assert "(identical in baseline 0.30.0)" in cases["s1"][2]
    assert cases["s2"] == ("pass", None, None)
    assert (root.get("failures"), root.get("skipped")) == ("1", "1")
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["baseline.version"] == "0.30.0" and props["baseline.run_id"]
    md = (now / "gate.md").read_text()
    assert md.index("| s1 | **regression** |") < md.index("| s0 | known failure |")
    assert "baseline: candidate 0.30.0, run " in md

    # a known failure alone passes, unless the policy says known failures fail
    same = make_report(tmp_path, "same", leak_into=("s0",), version="0.31.0")
    assert gate(same, "--baseline-version", "0.30.0") == 0
    assert gate(same, "--baseline-version", "0.30.0", "--policy", policy_file(tmp_path, known_failures_fail=True)) == 1
    _, cases = junit_cases(same / "junit.xml")
    assert cases["s0"][:2] == ("failure", "contamination") and cases["s0"][2].startswith("known failure: ")

    fixed = make_report(tmp_path, "fixed", version="0.31.0")
    assert gate(fixed, "--baseline-version", "0.30.0") == 0
    assert "| s0 | fixed | identical |" in (fixed / "gate.md").read_text()


def test_baseline_is_the_latest_matching_run(mlflow_cwd, tmp_path, capsys):
    from difftest.records.tracking import log_run

    suite = {"name": "toy", "hash": "5017e" * 8}
    log_run(make_report(tmp_path, "b-pass", suite=suite))  # older: all clean
    log_run(make_report(tmp_path, "b-fail", leak_into=("s0",), suite=suite))  # latest: s0 failed
    log_run(make_report(tmp_path, "gpu", leak_into=("s0", "s1"), suite=suite, device="cuda:H200"))
    log_run(make_report(tmp_path, "other-suite", suite={"name": "toy", "hash": "0" * 40}))
    now = make_report(tmp_path, "now", leak_into=("s0",), version="0.31.0", suite=suite)
    assert gate(now, "--baseline-version", "0.30.0") == 0  # against b-fail: s0 is known
    _, cases = junit_cases(now / "junit.xml")
    assert cases["s0"][0] == "skipped"

    # only runs that passed, when the policy asks for that: against b-pass, s0 is a regression
    assert gate(now, "--baseline-version", "0.30.0", "--policy", policy_file(tmp_path, verdicts="[pass]")) == 1
    _, cases = junit_cases(now / "junit.xml")
    assert cases["s0"][2].startswith("regression:")

    # a missing baseline (no run on this device) is bad input, and nothing is written
    on_gpu = make_report(tmp_path, "now-gpu", leak_into=("s0",), version="0.31.0", suite=suite, device="cuda:H100")
    capsys.readouterr()
    assert gate(on_gpu, "--baseline-version", "0.30.0") == 2
    err = capsys.readouterr().err
    assert "no baseline" in err and "'0.30.0'" in err and "cuda:H100" in err
    assert not (on_gpu / "junit.xml").exists()
    assert gate(now, "--baseline-version", "9.9") == 2


def _off_top1(per_segment: int, segments: int = 3) -> dict:
    """report.json's measured null at concurrency 1 as the gate reads it: per segment, the code
    predictor's tokens off qwen-tts's top-1 (`per_segment` of 600) and the talker's (1 of 40)."""
    return {"verdict": "pass", "segments": {f"s{i}": {"talker": [1, None, 40], "code_predictor": [per_segment, None, 600]}
                                            for i in range(segments)}}


def test_numerics_worse_than_the_baseline_fail_the_gate_at_the_code_predictor(mlflow_cwd, tmp_path, capsys):
    """The teacher-forced counts of the baseline's report (its MLflow artifact) against this run's:
    every segment clean in both, but twice as many code-predictor tokens off qwen-tts's top-1."""
    from difftest.records.tracking import log_run

    assert log_run(make_report(tmp_path, "base", version="0.30.0", measured_null=_off_top1(20)))
    worse = make_report(tmp_path, "worse", version="0.31.0", measured_null=_off_top1(40))
    assert gate(worse, "--baseline-version", "0.30.0") == 1
    out = capsys.readouterr().out
    assert "GATE FAIL" in out and "numerics: numerics_regression at the talker (code predictor)" in out
    assert "120/1800 (6.67%) against 60/1800 (3.33%), 2.0x" in out
    root, cases = junit_cases(worse / "junit.xml")
    assert cases["numerics against 0.30.0"][:2] == ("failure", "numerics_regression")
    assert {k: v[0] for k, v in cases.items() if k.startswith("s")} == {"s0": "pass", "s1": "pass", "s2": "pass"}
    assert (root.get("tests"), root.get("failures")) == ("4", "1")
    assert "numerics: numerics_regression" in (worse / "gate.md").read_text()
    # the policy may report it without failing
    assert gate(worse, "--baseline-version", "0.30.0", "--policy", policy_file(tmp_path, numerics_fail=False)) == 0
    _, cases = junit_cases(worse / "junit.xml")
    assert cases["numerics against 0.30.0"][0] == "pass"

    same = make_report(tmp_path, "same", version="0.31.0", measured_null=_off_top1(21))
    assert gate(same, "--baseline-version", "0.30.0") == 0
    assert "numerics: pass: as close to qwen-tts as baseline 0.30.0" in capsys.readouterr().out
    # a run without teacher-forced counts is not compared, and says so
    bare = make_report(tmp_path, "bare", version="0.31.0")
    assert gate(bare, "--baseline-version", "0.30.0") == 0
    assert "numerics: not_compared: no teacher-forced counts" in capsys.readouterr().out
    # a baseline whose report.json artifact is unreadable decides nothing and says so; the segments still gate
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{mlflow_cwd / 'mlflow.db'}")  # its artifacts: a local folder
    base_run = next(r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
                    if r.data.tags.get("candidate.version") == "0.30.0" and "segment.id" not in r.data.tags)
    artifact = Path(base_run.info.artifact_uri.removeprefix("file://")) / "report.json"
    artifact.write_text("{ not json")
    assert gate(same, "--baseline-version", "0.30.0") == 0
    assert f"numerics: not_compared: baseline run {base_run.info.run_id} has no readable report.json" in capsys.readouterr().out
    # ... and the verdicts come from its child runs: none, every segment was clean (segment_runs tag),
    # so a leak now is a regression from `clean`, not a new failure
    leak = make_report(tmp_path, "leak", leak_into=("s1",), version="0.31.0", measured_null=_off_top1(21))
    assert gate(leak, "--baseline-version", "0.30.0") == 1
    assert "1 regression" in capsys.readouterr().out
    _, cases = junit_cases(leak / "junit.xml")
    assert cases["s1"][0] == "failure" and cases["s1"][2].startswith("regression: contamination"), cases["s1"]
    assert "clean" in cases["s1"][2]


def test_gate_against_a_server_baseline(tmp_path, mlflow_server, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from difftest.records.tracking import log_run

    assert log_run(make_report(tmp_path, "base", version="0.29.0"), mlflow_server)
    now = make_report(tmp_path, "now", leak_into=("s1",), version="0.31.0")
    p = subprocess.run([sys.executable, "-m", "difftest", "gate", str(now), "--baseline-version", "0.29.0",
                        "--tracking-uri", mlflow_server], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "1 regression" in p.stdout
    _, cases = junit_cases(now / "junit.xml")
    assert cases["s1"][0] == "failure" and cases["s1"][2].startswith("regression:")


def test_gate_with_mlflow_down_is_infrastructure(tmp_path, capsys):
    now = make_report(tmp_path, "now")
    assert gate(now, "--baseline-version", "0.30.0", "--tracking-uri", closed_uri()) == 3
    assert "cannot read the baseline" in capsys.readouterr().err


def test_core_and_gate_work_without_mlflow(tmp_path):
    leak = make_report(tmp_path, "leak", leak_into=("s0",))
    code = ("import sys; import difftest.cli, difftest.records.tracking, difftest.records.gate;"
            "assert 'mlflow' not in sys.modules and 'matplotlib' not in sys.modules, 'imported eagerly';"
            "sys.modules['mlflow'] = None;"  # as if not installed
            "sys.exit(difftest.cli.main(['gate', *sys.argv[1:]]))")
    p = subprocess.run([sys.executable, "-c", code, str(leak)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert p.stdout.startswith("GATE FAIL") and (leak / "junit.xml").is_file()


def test_the_headline_names_the_version_once():
    from difftest.records.gate import GateResult
    from difftest.records.gate_output import headline

    report = {"candidate": {"label": "vllm-omni 0.30.0", "versions": {"vllm_omni": "0.30.0"}, "device": "cpu"},
              "concurrency": 4, "suite": {"name": "smoke", "hash": "ab" * 32}, "segments": []}
    what = headline(report, GateResult("pass", 0, [], None, False))[1]
    assert what == "candidate vllm-omni 0.30.0 at concurrency 4 on cpu"
    report["candidate"]["label"] = "vllm-omni"  # a label without it still gets it
    assert headline(report, GateResult("pass", 0, [], None, False))[1].startswith("candidate vllm-omni 0.30.0 at")


def test_a_matrix_cell_is_gated_against_the_same_cell_of_the_baseline_release(mlflow_cwd, tmp_path):
    """`difftest matrix --baseline-version V`: each cell against V's run of the cell of the same name
    (logged by V's matrix), segments and numerics as `difftest gate` judges them; a cell V did not
    run is an error naming it, never a pass."""
    import xml.etree.ElementTree as ET

    from difftest.records.tracking import log_run
    from difftest.commands.matrix import _judge, junit

    policy = load_policy()
    cell = {"cell": "smoke__vllm-omni__c4__default", "suite": "smoke", "candidate": "vllm-omni", "label": "vllm-omni",
            "concurrency": 4, "config": "default", "engine_args": []}
    for name in (cell["cell"], "smoke__vllm-omni__c8__default"):  # 0.30.0's matrix: this cell and another
        assert log_run(make_report(tmp_path, f"base-{name}", version="0.30.0", measured_null=_off_top1(20)),
                       tags={"difftest.commands.run_matrix": "release", "difftest.commands.run_matrix.cell": name})
    log_run(make_report(tmp_path, "other-release", version="0.29.0", measured_null=_off_top1(60)),
            tags={"difftest.commands.run_matrix": "release", "difftest.commands.run_matrix.cell": cell["cell"]})
    now = make_report(tmp_path, "now", leak_into=("s1",), version="0.31.0", measured_null=_off_top1(40))
    baselines = {}
    row = _judge(cell, now, 1, policy, "0.30.0", None, baselines)
    assert row["verdict"] == "fail" and row["baseline"]["version"] == "0.30.0"
    assert row["baseline"]["regressions"] == ["s1"]
    assert (row["baseline"]["numerics"]["verdict"], row["baseline"]["numerics"]["site"]) == (
        "numerics_regression", "code_predictor")
    suite = ET.fromstring(junit([row], policy, baselines))[0]
    assert {c.get("name") for c in suite.iter("testcase")} >= {"s1", "numerics against 0.30.0"}
    # against 0.29.0, noisier: the numerics pass and only the leak is a regression
    assert _judge(cell, now, 1, policy, "0.29.0", None)["baseline"]["numerics"]["verdict"] == "pass"
    missing = _judge({**cell, "cell": "smoke__vllm-omni__c2__default"}, now, 1, policy, "0.30.0", None)
    assert missing["verdict"] == "error" and "no baseline" in missing["error"]
    assert "difftest.commands.run_matrix.cell smoke__vllm-omni__c2__default" in missing["error"]
