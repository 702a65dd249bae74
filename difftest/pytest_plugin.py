"""difftest as pytest fixtures, for tests written the way vLLM-Omni writes its own (registered as a
`pytest11` entry point: installing difftest is enough).

    def test_concurrency_changes_no_speech(difftest_compare):
        difftest_compare("cases/suites/smoke.yaml", concurrency=4)   # raises, printing what diverged

    pytest --difftest-candidate vllm-omni          # any `difftest run --candidate` value

Fixtures:
- `difftest_candidate`: the `--difftest-candidate` value (default `cpu-engine`, the CPU test engine).
- `difftest_store`: the reference store (`--difftest-store`, else one folder for the session).
- `difftest_reference`: qwen-tts runners for the session, one per set of checkpoints, started on
  first use and shared by every comparison (`difftest_reference(suite)` gives the runner).
- `difftest_suite`: `difftest_suite(path)` loads a suite file (bad input fails the test, naming it).
- `difftest_compare`: `difftest_compare(suite, candidate=None, concurrency=4, **run_options)` runs the
  whole comparison (`difftest run`: the candidate at 1 and at N against qwen-tts at 1) into the
  test's tmp_path and returns report.json's content; when the verdict is not `pass` it fails the
  test with `assert_same_speech`'s message.

`assert_same_speech(report)` is the assertion alone: for each failing segment, its verdict, chunk,
stage and donor, the summary, and the two code vectors (16 codebooks) at the first divergent frame,
qwen-tts's above the candidate's, as vLLM's `check_logprobs_close` prints the tokens where two
outputs part.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def pytest_addoption(parser):
    group = parser.getgroup("difftest", "difftest: the candidate against qwen-tts")
    group.addoption("--difftest-candidate", default=None, metavar="CANDIDATE",
                    help="what difftest_compare tests: a `difftest run --candidate` value (default cpu-engine)")
    group.addoption("--difftest-store", default=None, metavar="DIR",
                    help="qwen-tts's result store (default: a folder for the session)")


def pytest_configure(config):
    config.addinivalue_line("markers", "difftest: a comparison against qwen-tts (difftest)")


@pytest.fixture(scope="session")
def difftest_candidate(request) -> str:
    return request.config.getoption("--difftest-candidate") or "cpu-engine"


@pytest.fixture(scope="session")
def difftest_store(request, tmp_path_factory) -> Path:
    given = request.config.getoption("--difftest-store")
    return Path(given).resolve() if given else tmp_path_factory.mktemp("difftest-store")


@pytest.fixture(scope="session")
def difftest_reference(difftest_store, tmp_path_factory):
    from difftest.engines.reference import ReferenceOptions, reference_python
    from difftest.pipeline.starting import resolve_models, start_reference_runner
    from difftest.run import RunOptions

    runners: dict[tuple, object] = {}
    logs = tmp_path_factory.mktemp("difftest-runner-logs")

    def runner_for(suite):
        python = reference_python(None)
        models = resolve_models(suite, RunOptions(store=difftest_store), python)
        if tuple(models) not in runners:
            runners[tuple(models)] = start_reference_runner(python, models, ReferenceOptions(models=models),
                                                            logs / f"runner-{len(runners)}.log", suite.family)
        return runners[tuple(models)]

    yield runner_for
    for r in runners.values():
        r.close()


@pytest.fixture
def difftest_suite():
    from difftest.errors import BadInput
    from difftest.suites.suite import load_suite

    def load(path):
        try:
            return load_suite(Path(path))
        except BadInput as e:
            pytest.fail(f"difftest suite: {e}", pytrace=False)

    return load


@pytest.fixture
def difftest_compare(difftest_candidate, difftest_store, difftest_reference, difftest_suite, tmp_path):
    from dataclasses import replace

    from difftest.engines.start import CandidateSpec
    from difftest.errors import DifftestError
    from difftest.run import RunOptions, run
    from difftest.verdicts.policy import load_policy

    calls = []

    def compare(suite, candidate: str | None = None, concurrency: int = 4, policy=None, **options) -> dict:
        suite = difftest_suite(suite) if isinstance(suite, (str, Path)) else suite
        spec = CandidateSpec.parse(candidate or difftest_candidate)
        opts = replace(RunOptions(store=difftest_store, concurrency=concurrency), **options)
        out = tmp_path / f"difftest-{len(calls)}"
        calls.append(out)
        try:
            report = run(suite, spec, out, load_policy(policy), opts, runner=difftest_reference(suite))
        except DifftestError as e:
            pytest.fail(f"difftest could not compare {suite.name} on {spec.label}: {e}", pytrace=False)
        __tracebackhide__ = True
        assert_same_speech(report)
        return report

    return compare


def assert_same_speech(report: dict) -> None:
    """Fail (AssertionError) unless the run passed, saying where and how each failing segment diverged."""
    __tracebackhide__ = True  # the failure is the message, not this function's source
    if report["verdict"] == "pass":
        return
    cand = report.get("candidate") or {}
    lines = [f"difftest: {cand.get('engine') or cand.get('label') or 'the candidate'} at concurrency "
             f"{report.get('concurrency')} against qwen-tts at 1: {report['verdict']} "
             f"({len(report.get('failing') or [])} of {len(report['segments'])} segments fail)"]
    failing = set(report.get("failing") or [])
    for s in report["segments"]:
        if s["id"] not in failing and s["verdict"] != "error":
            continue
        where = ", ".join(x for x in (
            f"chunk {s['first_divergent_chunk']}" if s.get("first_divergent_chunk") is not None else "",
            f"frame {s['first_divergent_frame']}" if s.get("first_divergent_frame") is not None else "",
            f"stage {s['stage']}" if s.get("stage") else "",
            f"donor {s['donor']}" if s.get("donor") else "") if x)
        lines.append(f"  {s['id']}: {s['verdict']}" + (f" at {where}" if where else "") + f": {s['summary']}")
        lines += _codes_at(s)
    for key in ("sampling", "measured_null", "measured_null_at_n", "configuration_exercised"):
        f = report.get(key)
        if f and f.get("verdict") not in (None, "pass"):
            lines.append(f"  run-level {key}: {f['verdict']}: {f.get('summary', '')}")
    raise AssertionError("\n".join(lines))


def _codes_at(seg: dict) -> list[str]:
    """The 16 codes of each side at the segment's first divergent frame (where the files are at hand)."""
    from difftest.results import read_result

    frame, arts = seg.get("first_divergent_frame"), seg.get("artifacts") or {}
    if frame is None or "reference" not in arts or "candidate" not in arts:
        return []
    try:
        ref, cand = read_result(Path(arts["reference"])), read_result(Path(arts["candidate"]))
    except Exception as e:  # noqa: BLE001  (the message is for a person; the verdict stands)
        return [f"    (codes not shown: {type(e).__name__}: {e})"]
    out = []
    for name, a, b in (("codes", ref.codes, cand.codes),
                       ("reference prefix at the vocoder", ref.ref_codes, cand.ref_codes)):
        if len(a) == len(b) and (len(a) == 0 or np.array_equal(a, b)):
            continue
        row = frame if name == "codes" else _first_row_differing(a, b)
        out.append(f"    {name}, frame {row}:")
        for who, x in (("qwen-tts ", a), ("candidate", b)):
            out.append(f"      {who} {x[row].tolist() if row < len(x) else '(no such frame: ' + str(len(x)) + ' frames)'}")
    return out


def _first_row_differing(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero((a[:n] != b[:n]).any(axis=1)) if n else np.array([], int)
    return int(diff[0]) if len(diff) else n
