"""Which of vLLM-Omni's stages died, and of what, from the server's own log.

A stage engine that raises is evicted and every request in flight fails with HTTP 500 ("EngineCore
encountered an issue. See stack trace (above) for the root cause"): the answer names no stage and no
cause, so a crash would read as a request error anywhere in the server. The log says both: the
stage's engine-core process (`StageEngineCoreProc_stage<N>`) logs its traceback, and the
orchestrator logs "Stage-<N> replica-<R> is dead". The finding names the stage, the exception and
the last frame of the traceback (the crash site), so a maintainer reads where to look.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..family import FAMILY

STAGE_NAMES = dict(enumerate(FAMILY.serving_stages))  # stage id -> name

_DEAD = re.compile(r"Stage-(\d+) replica-(\d+) is dead")
_PROC = re.compile(r"StageEngineCoreProc_stage(\d+)_replica\d+")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_EXC = re.compile(r"\]\s+((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt)): (.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _site(path: str) -> str:
    """A frame's file from the package root (vllm_omni/..., vllm/...), not this machine's paths."""
    m = re.search(r"/site-packages/(.*)$", path)
    return m.group(1) if m else path


def deaths(log_path: str | Path) -> list[dict]:
    """Each stage the log says died: {"stage_id", "stage", "cause", "site"} in the order they died;
    [] when none did or the log cannot be read."""
    try:
        lines = [_ANSI.sub("", ln) for ln in Path(log_path).read_text(encoding="utf-8", errors="replace").splitlines()]
    except OSError:
        return []
    out, last = [], {}  # stage -> (cause, site) of its latest traceback
    site: dict[int, str] = {}
    for ln in lines:
        proc = _PROC.search(ln)
        if proc and "ERROR" in ln:
            stage = int(proc.group(1))
            if (f := _FRAME.search(ln)) and "difftest_capture" not in f.group(1):  # the plugin's frames observe only
                site[stage] = f"{_site(f.group(1))}:{f.group(2)} in {f.group(3)}"
            elif e := _EXC.search(ln):
                last[stage] = (f"{e.group(1)}: {e.group(2).strip()}"[:300], site.get(stage))
        if d := _DEAD.search(ln):
            stage = int(d.group(1))
            if stage not in {x["stage_id"] for x in out}:
                cause, where = last.get(stage, (None, None))
                out.append({"stage_id": stage, "stage": STAGE_NAMES.get(stage), "cause": cause, "site": where})
    return out


def attribute(errors: dict, logs: list) -> int:
    """Name the dead stage in each candidate error (segment -> error dict, changed in place) that the
    death explains: an HTTP 500 from a server whose log says a stage died. Returns how many."""
    found = [d for log in logs for d in deaths(log)]
    if not found:
        return 0
    first = found[0]
    what = f"the {first['stage'] or 'stage ' + str(first['stage_id'])}'s engine died"
    if first["cause"]:
        what += f" of {first['cause']}" + (f" at {first['site']}" if first["site"] else "")
    n = 0
    for err in errors.values():
        if err.get("kind") == "candidate" and "HTTP 500" in str(err.get("message", "")) and "stage" not in err:
            err["stage"] = first["stage"]
            err["message"] = f"{err['message']} ({what}; the server's log)"
            n += 1
    return n
