"""What to test: one commit's candidate run on the suite, and a decision: good, bad or skip.

    with Prober(repo, recipe, settings, builds_root, out) as prober:
        record = prober.probe(sha)        # a ProbeRecord; record.vote is what the search gets

For a commit: its build (builds.prepare: worktree + editable install, cached and held), its
launcher, then up to `repeats` runs of `difftest run` (difftest.run.run) against the
one shared reference runner and result store, each in `OUT/probes/<sha12>/run<i>`.
A run is

- good: report exit 0 (with --bad-on: no segment has one of those verdicts);
- bad: report exit 1 (with --bad-on: some segment has one of them);
- skip: the candidate did not start or died (InfraError, report exit 3), or the
  report has bad-input errors (exit 2: an unusable segment says nothing about the commit).

A commit that does not check out, install or import is skipped without a run. The
runs' answers are voted on (search.vote): `repeats` runs at most, `agree` alike to decide.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..engines.reference import ReferenceOptions, reference_python
from ..errors import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_PASS, BadInput, InfraError
from ..pipeline.starting import resolve_models, start_reference_runner
from ..run import RunOptions, run
from ..suites.suite import Suite
from ..verdicts.policy import Policy
from ..verdicts.where import where
from .builds import BuildFailed, LaunchContext, Recipe, Worktrees, commit_info, prepare
from .search import BAD, GOOD, SKIP, Vote, agreement, vote


@dataclass
class ProbeSettings:
    suite: Suite
    policy: Policy
    opts: RunOptions
    repeats: int = 1
    agree: int | None = None
    bad_on: frozenset | None = None  # verdicts that make a run bad; None: the policy's fail_on (report exit 1)

    def __post_init__(self):
        try:
            self.agree = agreement(self.repeats, self.agree)
        except ValueError as e:
            raise BadInput(f"--repeats/--agree: {e}") from None

    def identity(self) -> dict:
        """What must match for an earlier session's decision to count in this one."""
        o = self.opts
        return {"suite_hash": self.suite.hash, "policy_fail_on": sorted(self.policy.fail_on),
                "bad_on": sorted(self.bad_on) if self.bad_on is not None else None,
                "concurrency": o.concurrency, "pattern": o.pattern, "order": o.order, "voice_mode": o.voice_mode,
                "repeats": self.repeats, "agree": self.agree,
                "reference": {"models": list(o.reference.models), "device": o.reference.device,
                              "dtype": o.reference.dtype}}


def judge(report: dict, bad_on: frozenset | None = None) -> tuple[str, list[dict], str]:
    """A run's answer from its report: (good | bad | skip, the segments that condemn it, why)."""
    code = report.get("exit_code")
    segs = report.get("segments") or []
    if code not in (EXIT_PASS, EXIT_FAIL):
        errors = [s for s in segs if s.get("verdict") == "error"]
        what = "bad-input" if code == EXIT_BAD_INPUT else "infrastructure"
        first = f": {errors[0]['id']}: {errors[0].get('summary', '')}" if errors else ""
        return SKIP, [], f"report exit {code} ({what} errors{first})"
    if bad_on is None:
        failing = set(report.get("failing") or [])
        condemned = [s for s in segs if s["id"] in failing]
        bad = code == EXIT_FAIL
    else:
        condemned = [s for s in segs if s.get("verdict") in bad_on]
        bad = bool(condemned)
    rows = [{k: s.get(k) for k in ("id", "verdict", "first_divergent_chunk", "stage", "donor", "donor_kind", "summary")}
            for s in condemned]
    return (BAD, rows, f"{len(rows)} segment(s) condemned") if bad else (GOOD, [], "clean")


def describe(row: dict) -> str:
    at = where(row, stage_word=True)
    return f"{row['id']} {row['verdict']}" + (f" ({at})" if at else "")


class SharedReference:
    """One reference runner and one result store for every probe; started when first needed,
    started again if it died."""

    def __init__(self, suite: Suite, opts: RunOptions, log_dir: Path):
        self.suite, self.opts, self.log_dir = suite, opts, Path(log_dir)
        self._models: list[str] | None = None
        self._runner = None
        self.starts = 0

    @property
    def models(self) -> list[str]:
        if self._models is None:
            self._models = resolve_models(self.suite, self.opts, reference_python(self.opts.reference.python))
        return self._models

    @property
    def runner(self):
        if self._runner is None or not self._runner.alive:
            if self._runner is not None:
                self._runner.close()
            python = reference_python(self.opts.reference.python)
            ref_opts = ReferenceOptions(**{**self.opts.reference.__dict__, "models": self.models})
            self._runner = start_reference_runner(python, self.models, ref_opts,
                                                  self.log_dir / f"reference-runner-{self.starts}.log", self.suite.family)
            self.starts += 1
        return self._runner

    def close(self):
        if self._runner is not None:
            self._runner.close()
            self._runner = None


@dataclass
class ProbeRecord:
    """A commit's decision with everything it came from (bisect.json's `decisions[sha]`)."""

    commit: str
    subject: str
    date: str
    vote: Vote
    runs: list[dict] = field(default_factory=list)
    build: dict = field(default_factory=dict)
    seconds: float = 0.0
    decided: str = ""

    def to_json(self) -> dict:
        return {"commit": self.commit, "subject": self.subject, "date": self.date, "decision": self.vote.decision,
                "outcomes": list(self.vote.outcomes), "reason": self.vote.reason, "runs": self.runs,
                "build": self.build, "seconds": round(self.seconds, 2), "decided": self.decided}

    @classmethod
    def from_json(cls, d: dict) -> ProbeRecord:
        return cls(d["commit"], d.get("subject", ""), d.get("date", ""),
                   Vote(d["decision"], tuple(d.get("outcomes", ())), d.get("reason", "")),
                   list(d.get("runs", [])), dict(d.get("build", {})), float(d.get("seconds", 0.0)),
                   d.get("decided", ""))

    def condemned_by(self) -> list[str]:
        """One line per bad run: which segments, with which verdicts, condemned the commit."""
        return [f"run {r['repeat'] + 1}: {r.get('verdict')}: " + "; ".join(describe(c) for c in r["condemned"])
                for r in self.runs if r["outcome"] == BAD]


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class Prober:
    """Probes commits of one repository with one recipe; a context manager (owns the reference runner)."""

    def __init__(self, repo: str | Path, recipe: Recipe, settings: ProbeSettings, builds_root: str | Path | None,
                 out: str | Path, reference: SharedReference | None = None):
        self.repo = Path(repo).resolve()
        self.recipe, self.settings = recipe, settings
        self.worktrees = Worktrees(self.repo, builds_root)
        self.out = Path(out).resolve()  # absolute: the engines run in other folders
        self.reference = reference or SharedReference(settings.suite, settings.opts, self.out / "logs")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.reference.close()

    def probe_dir(self, sha: str) -> Path:
        return self.out / "probes" / sha[:12]

    def probe(self, sha: str) -> ProbeRecord:
        t0 = time.perf_counter()
        info = commit_info(self.repo, sha)
        pdir = self.probe_dir(sha)
        shutil.rmtree(pdir, ignore_errors=True)  # an undecided probe starts over: no half result is trusted
        pdir.mkdir(parents=True)
        runs: list[dict] = []

        def record(v: Vote, build: dict) -> ProbeRecord:
            return ProbeRecord(sha, info["subject"], info["date"], v, runs, build, time.perf_counter() - t0, _now())

        hold = contextlib.ExitStack()  # the build stays in use (not evictable) until the probe is done
        try:
            build = prepare(self.recipe, self.worktrees, sha, hold)
        except BuildFailed as e:
            hold.close()
            runs.append({"repeat": 0, "outcome": SKIP, "reason": f"does not build: {_first_line(e)}",
                         "verdict": None, "exit_code": None, "report": None, "condemned": [], "seconds": 0.0})
            return record(Vote(SKIP, (SKIP,), f"does not build: {_first_line(e)}"), {"error": str(e)})
        s = self.settings
        ctx = LaunchContext(pdir, self.reference.models, s.suite, s.opts)
        with hold, self.recipe.launcher(build, ctx) as launcher:
            def run_once(i: int) -> str:
                t = time.perf_counter()
                rdir = pdir / f"run{i + 1}"
                rdir.mkdir(parents=True, exist_ok=True)
                row = {"repeat": i, "report": None, "verdict": None, "exit_code": None, "condemned": []}
                runner = self.reference.runner  # outside the try: its failure is no commit's fault (abort)
                try:
                    with open(rdir / "progress.log", "w") as progress, contextlib.redirect_stderr(progress):
                        spec, engine = launcher.candidate(i)
                        row["candidate"] = dict(launcher.info)
                        report = run(s.suite, spec, rdir, s.policy, s.opts, runner=runner, candidate=engine)
                except BadInput:
                    raise
                except InfraError as e:
                    row.update(outcome=SKIP, reason=f"candidate down: {_first_line(e)}",
                               candidate=dict(launcher.info))
                else:
                    outcome, condemned, why = judge(report, s.bad_on)
                    row.update(outcome=outcome, reason=why, verdict=report.get("verdict"),
                               exit_code=report.get("exit_code"), report=str(rdir / "report.json"),
                               condemned=condemned)
                row["seconds"] = round(time.perf_counter() - t, 2)
                runs.append(row)
                return row["outcome"]

            v = vote(run_once, s.repeats, s.agree)
        return record(v, build.to_json())


def verdict_word(decision: str) -> str:
    return {GOOD: "good", BAD: "BAD", SKIP: "skip"}[decision]


def one_line(rec: ProbeRecord) -> str:
    if rec.build.get("error"):
        return f"{verdict_word(rec.vote.decision)} ({rec.vote.reason}; {rec.seconds:.0f} s)"
    runs = ", ".join(f"{r['outcome']}" + (f" [{r['reason']}]" if r["outcome"] == SKIP else "") for r in rec.runs)
    return f"{verdict_word(rec.vote.decision)} ({rec.vote.reason}; runs: {runs}; {rec.seconds:.0f} s)"

