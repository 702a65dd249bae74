"""A whole bisect session: the commits between the ends, the search, persistence, MLflow, the answer.

    code = run_bisect(repo, good, bad, prober, out, tracking=Tracking(...))

`prober` is what decides a commit (probe.Prober, or a test double with the same
`probe(sha) -> ProbeRecord` and `identity()`); everything else here is bookkeeping:
bisect.json after every probe, MLflow records, a `git bisect log`-like text log, and
the summary on stdout. Exit codes: 0 the first bad commit is named; 2 the ends do not
behave as stated (the good end fails or the bad end passes), or bad input; 3 no single
commit can be named (an end was skipped, or skipped commits hide the first bad one).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import EXIT_BAD_INPUT, EXIT_INFRA, EXIT_PASS
from ..results import atomic_write
from . import search
from .builds import commit_info, first_parent_range, resolve
from .probe import ProbeRecord, one_line
from .record import Recorder
from .state import BisectState

LOG_FILE = "bisect-log.txt"


class ProbesCommits(Protocol):
    def probe(self, sha: str) -> ProbeRecord: ...


@dataclass
class Tracking:
    uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db
    experiment: str | None = None  # None: difftest/bisect/<suite name>
    enabled: bool = True


STATUS_EXIT = {search.FOUND: EXIT_PASS, search.GOOD_END_IS_BAD: EXIT_BAD_INPUT,
               search.BAD_END_IS_GOOD: EXIT_BAD_INPUT, search.END_SKIPPED: EXIT_INFRA,
               search.AMBIGUOUS: EXIT_INFRA}


def _role(sha: str, commits: list[str]) -> str:
    return search.GOOD_END if sha == commits[0] else search.BAD_END if sha == commits[-1] else search.STEP


def text_log(state: BisectState, commits: list[str], result: dict | None) -> str:
    """A `git bisect log`-like account: one line per decision in the order they were made."""
    lines = [f"# difftest bisect of {commits[0]} (good) .. {commits[-1]} (bad): {len(commits)} commits"]
    for sha in state.data["order"]:
        d = state.decisions[sha]
        lines.append(f"# {d['decision']}: [{sha}] {d.get('subject', '')}  ({d.get('reason', '')})")
        lines.append(f"git bisect {'skip' if d['decision'] == 'skip' else d['decision']} {sha}")
    if result and result.get("first_bad"):
        lines.append(f"# first bad commit: [{result['first_bad']}] "
                     f"{state.decisions.get(result['first_bad'], {}).get('subject', '')}")
    elif result:
        lines.append(f"# {result['status']}: suspects {' '.join(result.get('suspects') or []) or '-'}")
    return "\n".join(lines) + "\n"


def run_bisect(repo: str | Path, good: str, bad: str, prober, out: str | Path, *, identity: dict,
               suite_name: str = "adhoc", tracking: Tracking | None = None, stdout=None, stderr=None,
               workers: int = 1) -> int:
    """`workers` > 1: up to that many commits per round, decided side by side by `prober.probe_many`
    (difftest.bisect.parallel), in search.kary_bisect's rounds; 1: the serial binary search."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    tracking = tracking or Tracking()
    out = Path(out).resolve()
    repo = Path(repo).resolve()
    good_sha, bad_sha = resolve(repo, good), resolve(repo, bad)
    commits = first_parent_range(repo, good_sha, bad_sha)
    state = BisectState.open(out, {"mode": "bisect", "repo": str(repo), "good": good_sha, "bad": bad_sha,
                                   **identity})
    state.data["commits"] = commits
    state.save()
    known = state.known()
    print(f"difftest bisect: {len(commits)} commits, {good_sha[:12]} (good) .. {bad_sha[:12]} (bad); at most "
          + (f"{search.max_probes(len(commits))} probes without skips" if workers == 1 else
             f"{search.max_rounds(len(commits), workers)} rounds of up to {workers} probes side by side, without skips")
          + (f"; {len(known)} decided earlier (reused)" if known else ""), file=stderr)
    parent_tags = {"bisect.repo": str(repo), "bisect.good": good_sha, "bisect.bad": bad_sha,
                   "bisect.commits": len(commits), "suite.name": suite_name, "bisect.mode": "bisect",
                   **{f"bisect.{k}": v for k, v in _flat(identity).items()}}
    recorder = Recorder(tracking.uri, tracking.experiment or f"difftest/bisect/{suite_name}", state, parent_tags,
                        enabled=tracking.enabled, stream=stderr)
    recorder.start()
    recorder.sync()  # decisions of an earlier session that MLflow missed
    t0 = time.perf_counter()
    count = {"n": 0}

    def probe(sha: str) -> search.Vote:
        count["n"] += 1
        role = _role(sha, commits)
        subject = commit_info(repo, sha)["subject"]
        print(f"probe {count['n']} ({role}): {sha[:12]} {subject}", file=stderr, flush=True)
        rec = prober.probe(sha)
        state.record(rec, role)
        print(f"  -> {one_line(rec)}", file=stderr, flush=True)
        recorder.sync()
        return rec.vote

    rounds = {"n": 0}

    def decided(rec) -> None:
        role = _role(rec.commit, commits)
        state.record(rec, role, round=rounds["n"])
        print(f"  round {rounds['n']}: {rec.commit[:12]} ({role}) -> {one_line(rec)}", file=stderr, flush=True)
        recorder.sync()

    def probe_many(shas: list[str]) -> dict:
        rounds["n"] += 1
        count["n"] += len(shas)
        print(f"round {rounds['n']}: {len(shas)} probe(s) side by side: "
              + ", ".join(f"{sha[:12]} {commit_info(repo, sha)['subject']}" for sha in shas), file=stderr, flush=True)
        return {sha: rec.vote for sha, rec in prober.probe_many(shas, on_done=decided).items()}

    try:
        outcome = (search.bisect(commits, probe, known) if workers == 1 else
                   search.kary_bisect(commits, probe_many, workers, known))
    except BaseException:
        recorder.interrupted()
        raise
    runs = sum(len(state.decisions[s.commit].get("runs") or []) for s in outcome.steps if s.probed)
    result = {"status": outcome.status, "first_bad": outcome.first_bad, "last_good": outcome.last_good,
              "suspects": outcome.suspects, "probes": outcome.probes, "runs": runs,
              "skipped": sum(s.vote.decision == search.SKIP for s in outcome.steps),
              "steps": [{"commit": s.commit, "role": s.role, "decision": s.vote.decision, "reused": not s.probed,
                         "round": s.round} for s in outcome.steps],
              "rounds": outcome.rounds, "workers": workers,
              "seconds": round(time.perf_counter() - t0, 1)}
    state.data["result"] = result
    state.save()
    log_path = out / LOG_FILE
    atomic_write(log_path, text_log(state, commits, result).encode())
    recorder.finish(result, [state.path, log_path])
    print("\n".join(summary(state, result)), file=stdout)
    return STATUS_EXIT[outcome.status]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (str, int, float)) else repr(v)
    return dict(list(out.items())[:60])


def _commit_line(state: BisectState, sha: str) -> str:
    d = state.decisions.get(sha, {})
    return f"{sha}  {d.get('subject', '')}" + (f"  ({d['date']})" if d.get("date") else "")


def summary(state: BisectState, result: dict) -> list[str]:
    status = result["status"]
    lines = []
    if status == search.FOUND:
        sha = result["first_bad"]
        rec = ProbeRecord.from_json(state.decisions[sha])
        lines.append(f"first bad commit: {_commit_line(state, sha)}")
        lines.append(f"  decided bad: {rec.vote.reason}")
        for line in rec.condemned_by():
            lines.append(f"  condemned by {line}")
        lines.append(f"  last good: {_commit_line(state, result['last_good'])}")
    elif status == search.AMBIGUOUS:
        lines.append("no single first bad commit: skipped commits hide it. It is one of:")
        for sha in result["suspects"]:
            d = state.decisions.get(sha, {})
            lines.append(f"  {_commit_line(state, sha)}  [{d.get('decision', 'untested')}: {d.get('reason', '')}]")
        lines.append(f"  last good: {_commit_line(state, result['last_good'])}")
    else:
        what = {search.GOOD_END_IS_BAD: "the good end fails", search.BAD_END_IS_GOOD: "the bad end passes",
                search.END_SKIPPED: "an end could not be decided"}[status]
        end = result["steps"][-1]["commit"] if result["steps"] else "?"
        d = state.decisions.get(end, {})
        lines.append(f"cannot bisect: {what}: {_commit_line(state, end)} [{d.get('decision')}: {d.get('reason', '')}]")
        rec = ProbeRecord.from_json(d) if d else None
        for line in (rec.condemned_by() if rec else []):
            lines.append(f"  condemned by {line}")
    side = f" over {result['rounds']} rounds of up to {result['workers']}" if result.get("workers", 1) > 1 else ""
    lines.append(f"probes: {result['probes']} ({result['runs']} runs, {result['skipped']} skipped){side} in "
                 f"{result['seconds']:.0f} s; decisions: {state.path}")
    return lines


# `git bisect run` exit codes: 0 good, 1-127 but 125 bad, 125 skip, anything else aborts.
GIT_EXIT = {search.GOOD: 0, search.BAD: 1, search.SKIP: 125}
GIT_ABORT = 128


def run_probe(repo: str | Path, rev: str, prober, out: str | Path, *, identity: dict, suite_name: str = "adhoc",
              tracking: Tracking | None = None, stdout=None, stderr=None) -> int:
    """Decide one commit (default HEAD: what `git bisect` checked out) and answer in git's exit codes.

    Decisions are kept in OUT/probes.json: the same commit probed again with the same --out
    is not run again."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    tracking = tracking or Tracking()
    repo = Path(repo).resolve()
    sha = resolve(repo, rev)
    state = BisectState.open(out, {"mode": "probe", "repo": str(repo), **identity}, file=PROBE_FILE)
    parent_tags = {"bisect.repo": str(repo), "suite.name": suite_name, "bisect.mode": "git-bisect-run",
                   **{f"bisect.{k}": v for k, v in _flat(identity).items()}}
    recorder = Recorder(tracking.uri, tracking.experiment or f"difftest/bisect/{suite_name}", state, parent_tags,
                        enabled=tracking.enabled, stream=stderr)
    recorder.start()
    recorder.sync()
    entry = state.decisions.get(sha)
    if entry is not None:
        rec = ProbeRecord.from_json(entry)
        print(f"difftest probe: {sha[:12]} {rec.subject}: decided earlier ({state.path})", file=stderr)
    else:
        print(f"difftest probe: {sha[:12]} {commit_info(repo, sha)['subject']}", file=stderr, flush=True)
        try:
            rec = prober.probe(sha)
        except BaseException:
            recorder.interrupted()
            raise
        state.record(rec, "probe")
        recorder.sync()
    recorder.pause()
    print(f"{rec.vote.decision} {sha}  {rec.subject}  ({one_line(rec)})", file=stdout)
    for line in rec.condemned_by():
        print(f"  condemned by {line}", file=stdout)
    return GIT_EXIT[rec.vote.decision]


PROBE_FILE = "probes.json"
