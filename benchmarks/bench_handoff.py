"""Seconds per release for the whole generated hand-off matrix, environments cached.

    .venv/bin/python benchmarks/bench_handoff.py [RELEASE ...]     (default: 0.22.0 0.24.0)

Builds (or reuses) each release's environment first, outside the timing, then times one full
`difftest handoff` probe of the release: probe start (importing vllm_omni), every generated batch
with its batch-of-one baselines, and the shrinking of every finding. Prints JSON. Target: under
60 s a release.
"""

from __future__ import annotations

import json
import sys
import time

from difftest.handoff import envs
from difftest.handoff.generate import generate
from difftest.handoff.run import probe_source


def main(argv: list[str]) -> int:
    releases = argv or ["0.22.0", "0.24.0"]
    cases = generate(seed=0)
    rows = []
    for v in releases:
        src = envs.release_source(v)
        t0 = time.monotonic()
        with envs.open_env(src) as env:
            env_s = time.monotonic() - t0
        t1 = time.monotonic()
        res = probe_source(src, cases, log=lambda m: None)
        rows.append({"release": v, "seconds": round(time.monotonic() - t1, 2), "env_s": round(env_s, 2),
                     "env_built_now": {"base_s": env.base_built_s, "target_s": env.target_built_s},
                     "timings": res.timings, "findings": len(res.findings), "infra": res.infra})
    print(json.dumps({"benchmark": "handoff", "cases_per_release": len(cases),
                      "requests_per_release": sum(len(c.requests) for c in cases), "releases": rows,
                      "target_s_per_release": 60}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
