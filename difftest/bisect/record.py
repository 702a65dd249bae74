"""A bisect in MLflow: one parent run, one child run per run of each probe.

Experiment `difftest/bisect/<suite name>` (or --experiment). The parent run (tag
`difftest.kind=bisect`) carries the repository, the ends, the recipe and, at the end, the
status and the first bad commit, with bisect.json and bisect-log.txt as artifacts. Each run
of each probe is a child run (`difftest.kind=bisect-probe`, `mlflow.parentRunId`):

    candidate.commit   the commit probed          bisect.subject   its subject line
    bisect.decision    the probe's decision       bisect.repeat    1, 2, ... (the run's index)
    bisect.outcome     this run's own answer      bisect.role      good end | bad end | step | probe
    bisect.reason      why                        verdict          the run's report verdict
    difftest.culprit   "true" on the first bad commit's runs
    metrics: seconds, condemned (segments);  artifacts: the run's report.json and summary.md

Neither kind is `run`, so `difftest gate --baseline-version` never takes a probe for a baseline.
MLflow being unreachable never stops a bisect: one warning, and the records wait in
bisect.json (`decisions[sha].mlflow` empty for that URI) until a later session with the same
--out uploads them.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from .state import BisectState

KIND = "difftest.kind"
CULPRIT = "difftest.culprit"
PARENT = "mlflow.parentRunId"


class Recorder:
    def __init__(self, uri: str | None, experiment: str, state: BisectState, parent_tags: dict, *,
                 enabled: bool = True, stream=None):
        self.state = state
        self.experiment = experiment
        self.parent_tags = {k: str(v) for k, v in parent_tags.items()}
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.uri = None
        if enabled:
            from ..records.tracking import resolve_tracking_uri

            self.uri = resolve_tracking_uri(uri)
        self.parent: str | None = None

    # -- plumbing -------------------------------------------------------------------------------
    def _call(self, what: str, fn):
        """fn(client) inside difftest.records.tracking.mlflow_client; on failure: warn once, go on without MLflow."""
        if not self.enabled:
            return None
        from ..records.tracking import TrackingUnavailable, mlflow_client

        try:
            with mlflow_client(self.uri) as client:
                return fn(client)
        except TrackingUnavailable as e:
            self.enabled = False
            print(f"difftest bisect: warning: MLflow unavailable at {self.uri} ({what}: {e}); the bisect goes on. "
                  f"Its records wait in {self.state.path} and are uploaded by the next session with this --out.",
                  file=self.stream)
            return None

    # -- the parent run ----------------------------------------------------------------------------
    def start(self) -> str | None:
        def go(client):
            from mlflow.exceptions import MlflowException

            saved = self.state.data.get("mlflow") or {}
            if saved.get("uri") == self.uri and saved.get("parent_run_id"):
                try:
                    run = client.get_run(saved["parent_run_id"])
                    if run.info.lifecycle_stage == "active":
                        client.update_run(run.info.run_id, status="RUNNING")
                        return run.info.run_id
                except MlflowException:
                    pass
            exp = client.get_experiment_by_name(self.experiment)
            if exp is None:
                exp_id = client.create_experiment(self.experiment, tags={KIND: "bisect"})
            else:
                if exp.lifecycle_stage == "deleted":
                    client.restore_experiment(exp.experiment_id)
                exp_id = exp.experiment_id
            good, bad = self.parent_tags.get("bisect.good", "")[:12], self.parent_tags.get("bisect.bad", "")[:12]
            name = f"bisect {good}..{bad}" if good else "git bisect run"
            run_id = client.create_run(exp_id, run_name=name, tags={KIND: "bisect", **self.parent_tags}).info.run_id
            # Records of this --out logged elsewhere before belong to that server: log them again here.
            for entry in self.state.decisions.values():
                entry.setdefault("mlflow", {}).pop(self.uri, None)
            self.state.data["mlflow"] = {"uri": self.uri, "experiment_id": exp_id, "parent_run_id": run_id}
            self.state.save()
            return run_id

        self.parent = self._call("starting the bisect's run", go)
        return self.parent

    # -- probes --------------------------------------------------------------------------------------
    def sync(self) -> None:
        """Log every decision that has no child runs at this URI yet (this probe's, and any pending)."""
        if not self.enabled or self.parent is None:
            return
        for sha in list(self.state.data["order"]):
            entry = self.state.decisions[sha]
            if self.uri in (entry.get("mlflow") or {}):
                continue
            ids = self._call(f"logging {sha[:12]}", lambda client, e=entry: self._log_probe(client, e))
            if ids is None:
                return
            entry.setdefault("mlflow", {})[self.uri] = ids
            self.state.save()

    def _log_probe(self, client, entry: dict) -> list[str]:
        from mlflow.entities import Metric, RunTag

        exp_id = self.state.data["mlflow"]["experiment_id"]
        # Idempotent: runs of this commit left by an upload that broke off (Ctrl-C between creating
        # them and saving their ids) are deleted first, so no probe is shown twice.
        query = f"tags.`{PARENT}` = '{self.parent}' and tags.`candidate.commit` = '{entry['commit']}'"
        for old in client.search_runs([exp_id], query, max_results=1000):
            client.delete_run(old.info.run_id)
        ids = []
        for r in entry.get("runs") or [{"repeat": 0, "outcome": entry["decision"], "reason": entry.get("reason")}]:
            tags = {KIND: "bisect-probe", PARENT: self.parent, "candidate.commit": entry["commit"],
                    "bisect.subject": entry.get("subject", "")[:4000], "bisect.decision": entry["decision"],
                    "bisect.repeat": str(r["repeat"] + 1), "bisect.outcome": r["outcome"],
                    "bisect.role": entry.get("role", ""), "bisect.reason": str(r.get("reason") or "")[:4000],
                    "verdict": str(r.get("verdict") or ""), CULPRIT: "false"}
            if entry.get("round") is not None:
                tags["bisect.round"] = str(entry["round"])
            for k in ("suite.name", "suite.hash", "concurrency", "bisect.recipe"):
                if k in self.parent_tags:
                    tags[k] = self.parent_tags[k]
            run_id = client.create_run(exp_id, run_name=f"{entry['commit'][:12]} r{r['repeat'] + 1} {r['outcome']}",
                                       tags=tags).info.run_id
            import time

            ts = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[Metric("seconds", float(r.get("seconds") or 0.0), ts, 0),
                                              Metric("condemned", float(len(r.get("condemned") or [])), ts, 0)],
                             tags=[RunTag("bisect.condemned", "; ".join(
                                 c["id"] + " " + str(c["verdict"]) for c in r.get("condemned") or [])[:4000])])
            report = r.get("report")
            if report and Path(report).is_file():
                client.log_artifact(run_id, report)
                summary = Path(report).with_name("summary.md")
                if summary.is_file():
                    client.log_artifact(run_id, str(summary))
            client.set_terminated(run_id, "FINISHED")
            ids.append(run_id)
        return ids

    # -- the end -------------------------------------------------------------------------------------
    def finish(self, result: dict, files: list[Path], status: str = "FINISHED") -> None:
        if not self.enabled or self.parent is None:
            return
        self.sync()
        first_bad = result.get("first_bad")

        def go(client):
            from mlflow.entities import Metric, RunTag

            tags = {"bisect.status": result.get("status", ""), "bisect.first_bad": first_bad or "",
                    "bisect.suspects": " ".join(result.get("suspects") or [])[:4000]}
            if first_bad:
                tags["bisect.first_bad_subject"] = self.state.decisions.get(first_bad, {}).get("subject", "")[:4000]
                for run_id in (self.state.decisions.get(first_bad, {}).get("mlflow") or {}).get(self.uri, []):
                    client.set_tag(run_id, CULPRIT, "true")
            import time

            ts = int(time.time() * 1000)
            client.log_batch(self.parent, metrics=[Metric(k, float(result.get(k) or 0), ts, 0)
                                                   for k in ("probes", "runs", "skipped")],
                             tags=[RunTag(k, v) for k, v in tags.items()])
            for f in files:
                if Path(f).is_file():
                    client.log_artifact(self.parent, str(f))
            client.set_terminated(self.parent, status)
            return True

        self._call("finishing the bisect's run", go)

    def pause(self) -> None:
        """End the parent run for now (`difftest probe`: git, not difftest, knows when the bisect ends)."""
        if self.enabled and self.parent is not None:
            self._call("ending the probe's run", lambda client: client.set_terminated(self.parent, "FINISHED"))

    def interrupted(self) -> None:
        if self.enabled and self.parent is not None:
            with contextlib.suppress(Exception):
                self._call("marking the bisect interrupted",
                           lambda client: client.set_terminated(self.parent, "KILLED"))
