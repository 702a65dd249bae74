"""Starting one vLLM-Omni server per checkpoint type: one after another, and side by side.

    python benchmarks/bench_server_starts.py [--out DIR]

A suite that mixes voice clones, custom voices and designed voices needs three servers (base,
custom_voice, voice_design checkpoints). Each start runs three processes that import vLLM one after
the other (the API server, then stage 0, then stage 1), so a start leaves the second core mostly
idle. Here, in one run on the tiny checkpoints: the three servers started one after another, each
waited healthy before the next (as difftest did before), then all three spawned at once and waited
together (difftest.engines.vllm_omni.start_vllm_omni). Prints one JSON object with both wall
times and their ratio.
"""

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from difftest.engines import vllm_omni as vo  # noqa: E402
from difftest.engines.reference import reference_python  # noqa: E402
from difftest.pipeline.starting import resolve_models  # noqa: E402
from difftest.process.launcher import ServerProcess, free_port  # noqa: E402
from difftest.run import RunOptions  # noqa: E402
from difftest.suites.suite import load_suite  # noqa: E402

TASKS = {"voice_clone", "custom_voice", "voice_design"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-server-starts-"))
    suite = load_suite(ROOT / "cases" / "suites" / "voice-clone-concurrency.yaml")
    models = resolve_models(suite, RunOptions(store=out / "store"), reference_python(None))
    opts = vo.VllmOmniOptions.for_decode(suite.segments[0].decode, 4, python=str(vo.omni_python()),
                                         accept_length_finish=True)

    # one after another: each server healthy before the next starts
    python, _, to_serve, overlay, _, env = vo._prepare(out / "sequential", models, opts, TASKS)
    t0 = time.perf_counter()
    each = {}
    with ExitStack() as stack:
        for ctype, model in to_serve.items():
            port = free_port()
            srv = ServerProcess(vo.server_argv(python, model, overlay, port, opts), f"http://127.0.0.1:{port}",
                                out / "sequential" / "logs" / f"{ctype}.log", env=env, cwd=out,
                                health_timeout=opts.health_timeout, name=ctype)
            stack.enter_context(srv)
            each[ctype] = round(srv.started_s, 1)
        sequential = time.perf_counter() - t0
    # side by side, as difftest starts them
    t0 = time.perf_counter()
    with ExitStack() as stack:
        _, _, info = vo.start_vllm_omni(out / "side-by-side", models, opts, stack, tasks=TASKS)
        side = time.perf_counter() - t0
    print(json.dumps({"servers": len(to_serve), "sequential_s": round(sequential, 1), "each_s": each,
                      "side_by_side_s": round(side, 1), "ratio": round(side / sequential, 3),
                      "side_by_side_each_s": {s["type"]: s["start_seconds"] for s in info["servers"]}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
