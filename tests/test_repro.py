"""`difftest repro` end to end on the CPU test engine (the negative control, not vLLM-Omni): three
planted defects found by `difftest run`, each shrunk against the engine started again, bundled, and
the bundle's repro.py run without difftest against the defective engine (exit 1) and the clean one
(exit 0). The real vLLM-Omni entries' table is docs/repro.md (minutes of server starts each)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from reference_support import reference_python

from difftest.repro.probe import write_suite
from difftest.repro.shrink import Case
from difftest.suites.suite import load_suite

# The full tier (docs/ci.md, `bash scripts/test.sh --all`): three shrinks on the CPU engine; CI
# shrinks the real 0.22.0 leak in test_handoff.py.
pytestmark = pytest.mark.heavy

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "cases" / "suites" / "smoke.yaml"
# defect -> (concurrency of the run, repro's extra arguments). The leak gets the whole search on the
# smoke suite; the others a two-request suite and the steps that decide their minimal set, to keep
# the file short.
CASES = {"ref-leak": (4, []),
         "speaker-leak": (2, ["--steps", "requests,concurrency", "--repeats", "2"]),
         "off-by-one": (2, ["--steps", "requests,concurrency,frames", "--repeats", "1"])}


def _difftest(*args, cwd):
    return subprocess.run([sys.executable, "-m", "difftest", *map(str, args)], capture_output=True, text=True,
                          timeout=1500, cwd=cwd)


@pytest.fixture(scope="module")
def repros(tmp_path_factory, mlflow_server):
    reference_python()
    w = tmp_path_factory.mktemp("repro")
    # smoke's first two requests (two voices), 16 frames: written by repro's own suite writer
    two = write_suite(load_suite(SMOKE), Case(("smoke-01", "smoke-02"), 2).with_edit("*", "max_new_tokens", 16),
                      w / "two", "smoke-two")
    out = {}
    for defect, (n, extra) in CASES.items():
        run = w / defect
        suite, more = (SMOKE, []) if defect == "ref-leak" else (two, ["--no-repeat"])
        p = _difftest("run", suite, "--candidate", f"cpu-engine:{defect}", "-n", n, "--out", run,
                      "--store", w / "store", "--no-mlflow", *more, cwd=w)
        assert p.returncode == 1, p.stdout + p.stderr[-3000:]
        if defect == "speaker-leak":  # logged before its repro: the repro adds its bundle to that MLflow run
            assert _difftest("log", run, "--tracking-uri", mlflow_server, cwd=w).returncode == 0
        report = json.loads((run / "report.json").read_text())
        target = next(s for s in report["segments"] if s["id"] in report["failing"] and
                      (s.get("donor") or defect == "off-by-one"))
        p = _difftest("repro", run, target["id"], *extra, cwd=w)
        assert p.returncode == 0, p.stdout + p.stderr[-4000:]
        row = json.loads((run / "repro" / target["id"] / "repro.json").read_text())
        out[defect] = (target, row, p)
    return w, out


def test_the_seed_like_leak_shrinks_to_target_and_donor(repros):
    _, out = repros
    target, row, p = out["ref-leak"]
    m = row["minimal"]
    assert row["reproduced"] and row["complete"] and row["finding"]["donor"] == target["donor"]
    assert sorted(m["segments"]) == sorted([target["id"], target["donor"]])  # 2 requests, from a wave of 4
    assert m["concurrency"] == 2 and m["pattern"] == "barrier"
    assert row["rate"] == {"reproduced": 3, "tries": 3}
    steps = {s["step"]: s for s in row["steps"]}
    assert list(steps) == ["requests", "concurrency", "arrival", "settings", "frames", "text", "reference"]
    edits = {(who, name): v for who, name, v in m["edits"]}
    assert edits[("*", "max_new_tokens")] < 32 and steps["frames"]["kept"]  # the frames step ran and shrank
    assert steps["text"]["tried"] >= 1 and steps["reference"]["tried"] >= 1  # the text and reference steps were probed
    assert row["validation"] == {"the candidate": 1, "the clean control": 0}
    assert f"{target['id']}: 2 request(s)" in p.stdout and "repro.py the candidate: exit 1" in p.stdout


def test_the_bundle_is_a_valid_suite_and_an_issue_text(repros):
    _, out = repros
    target, row, _ = out["ref-leak"]
    b = Path(row["bundle"])
    suite = load_suite(b / "suite.yaml")  # `difftest run` and `difftest bisect --suite` take it
    assert sorted(s.id for s in suite.segments) == sorted(row["minimal"]["segments"])
    assert all(s.voice.wav.is_relative_to(b) for s in suite.segments)
    bundle = json.loads((b / "bundle.json").read_text())
    assert bundle["against"] == "own_c1" and bundle["concurrency"] == 2 and bundle["donor"] == target["donor"]
    assert all((b / r["expected"]).is_file() and (b / r["ref_audio_file"]).is_file() for r in bundle["requests"])
    assert "import difftest" not in (b / "repro.py").read_text() and "numpy" not in (b / "repro.py").read_text()
    issue = (b / "ISSUE.md").read_text()
    for part in ("## Symptom", "## Environment", "## Minimal reproduction", "## Diagnosis", "`repro.py` against "
                 "the candidate: exit 1", "difftest CPU test engine (not vLLM-Omni)"):
        assert part in issue, part
    # the diagnosis is the bundled try's: the leak as the run saw it, or the other way round in that try
    assert f"donor: `{target['donor']}`" in issue or f"donor: `{target['id']}`" in issue
    assert (b / "specdiff.png").stat().st_size > 10_000
    log = (Path(row["run"]) / "repro" / target["id"] / "logs" / "repro-py-candidate.log").read_text()
    assert "the defect SHOWS" in log and "chunk 0 differs from sample 0" in log


def test_a_second_repro_reads_every_probe_from_its_cache(repros):
    w, out = repros
    target, row, _ = out["ref-leak"]
    p = _difftest("repro", row["run"], target["id"], cwd=w)
    assert p.returncode == 0, p.stderr[-3000:]
    again = json.loads((Path(row["run"]) / "repro" / target["id"] / "repro.json").read_text())
    assert again["probes_run"] == 0 and again["probes"] == row["probes"]
    assert again["minimal"] == row["minimal"] and again["validation"] == row["validation"]


def test_a_talker_input_leak_keeps_its_donor_and_stage(repros):
    _, out = repros
    target, row, _ = out["speaker-leak"]
    assert row["finding"]["stage"] == "talker_input" and row["finding"]["verdict"] == "contamination"
    assert sorted(row["minimal"]["segments"]) == sorted([target["id"], target["donor"]])
    assert row["minimal"]["concurrency"] == 2 and row["rate"]["reproduced"] >= 1
    assert row["validation"] == {"the candidate": 1, "the clean control": 0}


def test_a_defect_without_concurrency_ends_with_one_request_at_one(repros):
    _, out = repros
    target, row, _ = out["off-by-one"]
    assert row["minimal"]["segments"] == [target["id"]] and row["minimal"]["concurrency"] == 1
    bundle = json.loads((Path(row["bundle"]) / "bundle.json").read_text())
    assert bundle["against"] == "qwen_tts"  # the engine is float32: qwen-tts's own audio is what it must give
    assert row["validation"] == {"the candidate": 1, "the clean control": 0}
    log = (Path(row["run"]) / "repro" / target["id"] / "logs" / "repro-py-candidate.log").read_text()
    assert "expected" in log and "frames of 80 ms" in log  # the lost frame, said as such


def test_repro_refuses_what_it_cannot_reproduce(repros, tmp_path):
    w, out = repros
    run = Path(out["ref-leak"][1]["run"])
    report = json.loads((run / "report.json").read_text())
    passing = next(s["id"] for s in report["segments"] if s["id"] not in report["failing"])
    p = _difftest("repro", run, passing, cwd=w)
    assert p.returncode == 2 and f"segment {passing!r}" in p.stderr and "not a failure to reproduce" in p.stderr
    p = _difftest("repro", run, "nope", cwd=w)
    assert p.returncode == 2 and "segment 'nope': not in the run" in p.stderr
    p = _difftest("repro", tmp_path, "x", cwd=w)
    assert p.returncode == 2 and "not a finished run folder" in p.stderr


def test_bundles_reach_mlflow_and_the_dashboard_links_them(repros, mlflow_server, tmp_path):
    """One run logged after its repro (the bundle goes up with it), one before (the repro adds it)."""
    from mlflow import MlflowClient

    w, out = repros
    leak_run = Path(out["ref-leak"][1]["run"])
    assert _difftest("log", leak_run, "--tracking-uri", mlflow_server, cwd=w).returncode == 0
    client = MlflowClient(mlflow_server)
    for defect in ("ref-leak", "speaker-leak"):
        target, row, _ = out[defect]
        state = json.loads((Path(row["run"]) / "mlflow.json").read_text())
        run_id = next(r["run_id"] for r in state["runs"] if r["tracking_uri"] == mlflow_server)
        assert client.get_run(run_id).data.tags["difftest.repro"] == target["id"]
        files = {f.path for f in client.list_artifacts(run_id, f"repro/{target['id']}")}
        assert {f"repro/{target['id']}/{f}" for f in ("ISSUE.md", "repro.py", "bundle.json", "suite.yaml")} <= files
    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "dashboards", "--out", str(site), "--tracking-uri", mlflow_server],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    for defect in ("ref-leak", "speaker-leak"):
        target, row, _ = out[defect]
        issue = next(site.glob(f"runs/*/media/repro/{target['id']}/ISSUE.md"), None)
        assert issue is not None and (issue.parent / "repro.py").is_file() and (issue.parent / "voices").is_dir()
        pages = [h for h in site.glob("runs/*/*.html") if f'href="media/repro/{target["id"]}/ISSUE.md"' in h.read_text()]
        assert pages, f"no segment page links {target['id']}'s bundle"
        assert "Minimal reproduction" in pages[0].read_text() and "repro.py" in pages[0].read_text()


def test_all_reproduces_every_failing_segment_of_a_run(repros):
    """`--all`, kept short: the requests step only, one try each (both segments of the off-by-one run
    fail alone at concurrency 1)."""
    w, out = repros
    run = Path(out["off-by-one"][1]["run"])
    failing = json.loads((run / "report.json").read_text())["failing"]
    p = _difftest("repro", run, "--all", "--steps", "requests", "--repeats", "1", cwd=w)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    for sid in failing:
        row = json.loads((run / "repro" / sid / "repro.json").read_text())
        assert row["reproduced"] and row["minimal"]["segments"] == [sid] and row["minimal"]["concurrency"] == 1
        assert row["validation"] == {"the candidate": 1, "the clean control": 0}
        assert f"{sid}: 1 request(s)" in p.stdout
