"""Probes side by side: `difftest bisect --workers K` probes up to K commits per round.

Each probe of a round is its own `difftest probe` process, with the bisect's own arguments and a
`--out` of its own (`OUT/parallel/<sha12>`), no MLflow of its own: its own reference runner and
candidate, the shared result store and build cache (both safe under concurrent processes; git
worktree operations take a per-repository lock). The bisect's session records each decision as it
comes, with its round, and logs it to MLflow as a serial bisect does (search.kary_bisect decides
which commits a round probes). Ctrl-C or SIGTERM stops every probe process first (each unwinds
its own engines), then the bisect unwinds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from ..errors import InfraError
from ..process import lifeline
from ..process.launcher import interrupt_groups, log_tail
from .probe import ProbeRecord

GOOD_EXIT, BAD_EXIT, SKIP_EXIT, ABORT_EXIT = 0, 1, 125, 128
SKIP_DESTS = {"rev", "out", "tracking_uri", "experiment", "no_mlflow", "help", "func", "good", "bad", "workers",
              "verbose"}


def common_argv(args: argparse.Namespace, probe_parser: argparse.ArgumentParser) -> list[str]:
    """The options of `args` that a `difftest probe` of the same bisect takes (`probe_parser`, its
    parser), as command-line text."""
    parser = probe_parser
    out: list[str] = []
    for action in parser._actions:
        if action.dest in SKIP_DESTS or not action.option_strings or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        opt = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        if isinstance(action, argparse._StoreTrueAction):
            out += [opt] if value else []
        elif isinstance(action, argparse._AppendAction):  # OPT=VALUE: a value may itself start with "--"
            out += [f"{opt}={_text(item)}" for item in value]
        else:
            out.append(f"{opt}={_text(value)}")
    return out


def _text(value) -> str:
    if isinstance(value, tuple) and len(value) == 2:  # --omni-option KEY=VALUE, the value read as JSON
        return f"{value[0]}={json.dumps(value[1])}"
    return str(value)


class ProcessProber:
    """Decides commits in `difftest probe` processes, several at once."""

    def __init__(self, common: list[str], out: str | Path, stream=None, python: str = sys.executable):
        self.common, self.out, self.python = list(common), Path(out).resolve(), python
        self.stream = stream or sys.stderr

    def folder(self, sha: str) -> Path:
        return self.out / "parallel" / sha[:12]

    def argv(self, sha: str) -> list[str]:
        return [self.python, "-m", "difftest", "probe", "--rev", sha, "--out", str(self.folder(sha)), "--no-mlflow",
                *self.common]

    def probe(self, sha: str) -> ProbeRecord:
        return self.probe_many([sha])[sha]

    def probe_many(self, shas: list[str], on_done=None) -> dict[str, ProbeRecord]:
        """Every commit's record; `on_done(record)` as each one finishes. InfraError when a probe aborts
        (bad input, or a failure that is no commit's fault), after the others were stopped."""
        procs, lines = {}, {}
        try:
            for sha in shas:
                d = self.folder(sha)
                d.mkdir(parents=True, exist_ok=True)
                log = open(d / "probe.log", "ab")
                procs[sha] = (subprocess.Popen(self.argv(sha), stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True, env=lifeline.child_env(None)), log)
                lines[sha] = lifeline.guard(procs[sha][0])  # each probe ends with the bisect
            done: dict[str, ProbeRecord] = {}
            while len(done) < len(procs):
                for sha, (proc, log) in procs.items():
                    if sha in done or proc.poll() is None:
                        continue
                    log.close()
                    lifeline.release(lines.pop(sha, None))
                    done[sha] = self._record(sha, proc.returncode)
                    if on_done is not None:
                        on_done(done[sha])
                time.sleep(0.2)
            return done
        except BaseException:
            interrupt_groups([p for p, _ in procs.values()])
            raise
        finally:
            for _, log in procs.values():
                log.close()
            for fd in lines.values():
                lifeline.release(fd)

    def _record(self, sha: str, code: int) -> ProbeRecord:
        state = self.folder(sha) / "probes.json"
        if code in (GOOD_EXIT, BAD_EXIT, SKIP_EXIT):
            try:
                return ProbeRecord.from_json(json.loads(state.read_text(encoding="utf-8"))["decisions"][sha])
            except (OSError, ValueError, KeyError) as e:
                raise InfraError(f"the probe of {sha[:12]} answered {code} but left no decision in {state}: {e}") from None
        tail = log_tail(self.folder(sha) / "probe.log", 20)
        raise InfraError(f"the probe of {sha[:12]} aborted (exit {code}); its log ({self.folder(sha)}/probe.log):\n{tail}")
