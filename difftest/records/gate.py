"""`difftest gate OUT`: the CI decision on a run, with the exit codes of contract 7 (docs/architecture.md).

The policy says which segment verdicts fail. With `--baseline-version V` the run is also held
against the latest run of candidate version V logged to MLflow on the same suite hash and
device: a segment failing now that was clean there is a regression (fails the gate); one that
failed there too is a known failure (reported; fails only under `baseline.known_failures_fail`).
The run's teacher-forced statistics are held against the baseline's report too
(difftest/verdicts/numerics.py): a significant worsening is `numerics_regression`, failing the
gate under `baseline.numerics_fail` (the default). Without a baseline, MLflow is not needed at all.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..errors import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_INFRA, EXIT_PASS, BadInput, InfraError
from ..verdicts.numerics import compare as compare_numerics
from ..verdicts.policy import Policy
from . import mlflow_records as rec
from .tracking import (
    TrackingUnavailable,
    check_tracking_uri,
    child_runs,
    mlflow_client,
    read_report,
    resolve_tracking_uri,
)

# Per segment: pass, fixed (failed in the baseline, clean now), known, regression, new (failing,
# absent from the baseline), fail (failing, no baseline asked for), error (infrastructure or bad input).
FAILING = ("regression", "new", "fail")


@dataclass
class Baseline:
    run_id: str
    version: str
    verdict: str
    started: str
    tracking_uri: str
    verdicts: dict = field(default_factory=dict)  # segment id -> verdict
    report: dict | None = None  # its report.json (the run's parent artifact); None where it has none


@dataclass
class SegmentGate:
    segment: dict  # the report's segment entry
    status: str
    baseline_verdict: str | None = None

    @property
    def id(self) -> str:
        return self.segment["id"]


@dataclass
class GateResult:
    verdict: str  # pass, fail, error
    exit_code: int
    segments: list
    baseline: Baseline | None
    known_failures_fail: bool
    numerics: dict | None = None  # difftest.verdicts.numerics.compare against the baseline's report
    policy_source: str = ""  # the policy judged with: its file and the sha256 of its values
    policy_sha256: str = ""

    def count(self, status: str) -> int:
        return sum(1 for s in self.segments if s.status == status)

    def fails(self, s: SegmentGate) -> bool:
        return s.status in FAILING or (s.status == "known" and self.known_failures_fail)


def _status(seg: dict, policy: Policy, baseline: Baseline | None) -> tuple[str, str | None]:
    verdict = seg["verdict"]
    prev = baseline.verdicts.get(seg["id"]) if baseline else None
    if verdict == "error" and seg.get("error_kind") != "candidate":  # the candidate's own errors are divergences
        return "error", prev
    if not policy.fails(verdict):
        return ("fixed" if prev is not None and policy.fails(prev) else "pass"), prev
    if baseline is None:
        return "fail", None
    if prev is None:
        return "new", None
    return ("known" if policy.fails(prev) else "regression"), prev


def decide(report: dict, policy: Policy, baseline: Baseline | None = None) -> GateResult:
    rows = [SegmentGate(seg, *_status(seg, policy, baseline)) for seg in report["segments"]]
    result = GateResult("pass", EXIT_PASS, rows, baseline, policy.known_failures_fail,
                        policy_source=policy.source, policy_sha256=policy.sha256)
    kinds = {s.segment.get("error_kind") or "infrastructure" for s in rows if s.status == "error"}
    if "infrastructure" in kinds or (report.get("verdict") == "error" and not kinds):
        result.verdict, result.exit_code = "error", EXIT_INFRA
    elif kinds:
        result.verdict, result.exit_code = "error", EXIT_BAD_INPUT
    elif any(result.fails(s) for s in rows):
        result.verdict, result.exit_code = "fail", EXIT_FAIL
    if baseline is not None:
        result.numerics = (compare_numerics(report, baseline.report, policy.numerics, f"baseline {baseline.version}")
                           if baseline.report is not None else
                           {"verdict": "not_compared",
                            "summary": f"baseline run {baseline.run_id} has no readable report.json artifact"})
        result.numerics["fails"] = result.numerics["verdict"] == "numerics_regression" and policy.numerics.fail
        if result.numerics["fails"] and result.verdict == "pass":
            result.verdict, result.exit_code = "fail", EXIT_FAIL
    return result


def _download_report(client, run_id: str) -> dict | None:
    with tempfile.TemporaryDirectory(prefix="difftest-baseline-") as tmp:
        try:
            path = client.download_artifacts(run_id, "report.json", tmp)
            return json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        except Exception as e:  # MLflow's own errors: an artifact that is not there
            if type(e).__name__ in ("MlflowException", "RestException"):
                return None
            raise


def find_baseline(client, report: dict, report_sha256: str, version: str, policy: Policy, tracking_uri: str = "",
                  tags: dict | None = None):
    """The latest finished parent run of candidate `version` with the report's suite hash and
    device (both absent counts as equal), every tag in `tags` (a matrix cell's name), and a
    verdict the policy accepts; None if there is none."""
    if "'" in version:
        raise BadInput(f"--baseline-version {version!r}: quotes are not allowed")
    exps = [e.experiment_id for e in client.search_experiments(filter_string="name LIKE 'difftest/%'")]
    if not exps:
        return None
    want = rec.canonical_tags(report)
    query = f"tags.`{rec.KIND}` = 'run' and tags.`candidate.version` = '{version}' and attributes.status = 'FINISHED'"
    runs = client.search_runs(exps, query, order_by=["attributes.start_time DESC"], max_results=1000)
    for run in runs:
        t = run.data.tags
        if (t.get(rec.REPORT_SHA) != report_sha256 and t.get("verdict") in policy.baseline_verdicts
                and t.get("suite.hash") == want.get("suite.hash") and t.get("device") == want.get("device")
                and all(t.get(k) == v for k, v in (tags or {}).items())):
            baseline_report = _download_report(client, run.info.run_id)
            started = datetime.fromtimestamp(run.info.start_time / 1000, timezone.utc).isoformat(timespec="seconds")
            return Baseline(run.info.run_id, version, t.get("verdict"), started, tracking_uri,
                            _baseline_verdicts(client, run, baseline_report, report), baseline_report)
    return None


def _baseline_verdicts(client, run, baseline_report: dict | None, report: dict) -> dict:
    """segment id -> the baseline's verdict: from its report.json; where that cannot be read, from
    its child runs. A run whose child runs cover only the segments that were not clean
    (`difftest.segment_runs`) was clean on every other segment of the suite (same suite hash), which
    is all the gate needs: such a segment's verdict reads `clean` (identical or numeric drift)."""
    if isinstance(baseline_report, dict) and isinstance(baseline_report.get("segments"), list):
        return {s["id"]: s.get("verdict") for s in baseline_report["segments"] if isinstance(s, dict) and "id" in s}
    verdicts = {c.data.tags["segment.id"]: c.data.tags.get("verdict") for c in child_runs(client, run)
                if "segment.id" in c.data.tags}
    if run.data.tags.get(rec.SEGMENT_RUNS) == rec.NOT_CLEAN:
        for seg in report.get("segments") or []:
            verdicts.setdefault(seg["id"], "clean")
    return verdicts


def load_baseline(out: Path, version: str, policy: Policy, tracking_uri: str | None, tags: dict | None = None) -> Baseline:
    """The baseline of the run in `out` (find_baseline); InfraError when MLflow cannot be read,
    BadInput when it holds no such run."""
    report, sha = read_report(out)
    uri = resolve_tracking_uri(tracking_uri)
    check_tracking_uri(uri, must_exist=True)
    try:
        with mlflow_client(uri) as client:
            baseline = find_baseline(client, report, sha, version, policy, uri, tags)
    except TrackingUnavailable as e:
        raise InfraError(f"cannot read the baseline from MLflow at {uri}: {e}") from None
    if baseline is None:
        want = rec.canonical_tags(report)
        raise BadInput(f"no baseline: MLflow at {uri} has no finished run of candidate version "
                       f"{version!r} on suite hash {want.get('suite.hash', '(none)')} and device "
                       f"{want.get('device', '(none)')}" + "".join(f", {k} {v}" for k, v in (tags or {}).items())
                       + f" with verdict in {sorted(policy.baseline_verdicts)}")
    return baseline
