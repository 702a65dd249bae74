"""A test double for the hand-off probe runner (runners/handoff_probe): speaks the real runner
protocol (runners.protocol.serve, refuse) with the probe's hello and `run` op, and hands on what
`observe` computes: each request's audio rows prefixed by "the" reference codes; with
FAKE_PROBE_LEAK=1 that reference is the last in-context request's of the batch (vllm-omni 0.22's
codes.ref). Misbehaves on request: FAKE_PROBE_REFUSE=KIND refuses to start, FAKE_PROBE_START=exit|hang
dies or goes silent before it announces itself, FAKE_PROBE_CRASH_AFTER=k
exits hard after k cases, FAKE_PROBE_HANG_AFTER=k goes silent, FAKE_PROBE_RAISE_FROM=n answers that a
release function raised on every batch of n or more requests."""

import os
import sys
import time
from pathlib import Path


def observe(case: dict, leak: bool) -> dict:
    by_id = {r["id"]: r for r in case["requests"]}
    ordered = [by_id[i] for i in case["order"]]
    last_ref = next((r["ref"] for r in reversed(ordered) if r["ref"]), [])
    obs = {}
    for r in case["requests"]:
        ref = last_ref if leak else r["ref"]
        flat = [v for row in ref + r["audio"] for v in row]
        obs[r["id"]] = {"code2wav.codes.audio": {"tensor": "int64", "shape": [len(flat)], "values": flat},
                        "code2wav.meta.left_context_size": len(ref)}
    return obs


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from runners.protocol import channel, refuse, serve

    channel()
    print("banner: an import logging to stdout")  # must land in the log, not on the channel
    env = os.environ.get
    if env("FAKE_PROBE_START") == "exit":
        print("fake probe: dying at start", file=sys.stderr)
        return 4
    if env("FAKE_PROBE_START") == "hang":
        time.sleep(3600)
    if env("FAKE_PROBE_REFUSE"):
        return refuse(env("FAKE_PROBE_REFUSE"), "fake refusal", type="FakeError", missing="fake.symbol")
    done = 0

    def run(job, emit):
        nonlocal done
        for i, case in enumerate(job["cases"]):
            if done == int(env("FAKE_PROBE_CRASH_AFTER", -1)):
                print("fake probe: crashing now", file=sys.stderr)
                os._exit(9)
            if done == int(env("FAKE_PROBE_HANG_AFTER", -1)):
                time.sleep(3600)
            raised = None
            if len(case["requests"]) >= int(env("FAKE_PROBE_RAISE_FROM", 99)):
                raised = {"where": "full-payload builder", "type": "IndexError", "message": "fake"}
            emit("result", case=i, requests=observe(case, env("FAKE_PROBE_LEAK") == "1"), raised=raised)
            done += 1

    release = {"vllm_omni": "0.0.0", "vllm_omni_path": "/fake", "vllm": "0.0.0", "import_s": 0.0}
    return serve({"run": run}, {"label": "handoff-probe", "release": release,
                                "adapter": {"name": "fake-v1"}, "deploy": {"connector_extra": {}}})


if __name__ == "__main__":
    sys.exit(main())
