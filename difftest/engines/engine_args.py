"""`--engine-arg KEY=VALUE`: one vLLM-Omni deploy setting for the candidate.

    talker.enable_prefix_caching=true   stage 0 (also `0.KEY`)
    vocoder.max_num_seqs=8              stage 1 (also `1.KEY`)
    async_chunk=true                    the deploy config's top level

VALUE is read as YAML (`true`, `4096`, `0.5`, `[1, 2]`, `{a: 1}`; anything else is
a string). A key is checked against the environment's own vLLM-Omni 0.30 config
classes, asked of its interpreter once: a stage key must be a field of
`StageDeployConfig` or of vLLM's `EngineArgs` (the deploy loader passes the latter
through to the engine), a top-level key a field of `DeployConfig`. An unknown key
is bad input (exit 2) before any model work, naming the closest known ones; a
typo must never become a setting vLLM-Omni quietly ignores.

The settings land in the deploy overlay, so they are part of the candidate's
identity (a run folder made with other settings is not reused) and of its
provenance in report.json and MLflow.
"""

from __future__ import annotations

import difflib
import functools
import json
import subprocess
from pathlib import Path

import yaml

from ..errors import BadInput, InfraError
from ..family import FAMILY

# a stage as `--engine-arg` names it (its name or its id) -> its id
STAGES = {**{name: i for i, name in enumerate(FAMILY.serving_stages)},
          **{str(i): i for i in range(len(FAMILY.serving_stages))}}
# Top-level keys difftest owns: the stage list is built by difftest (use STAGE.KEY), the rest are
# per-platform tables that the overlay does not merge.
NOT_TOP = ("stages", "platforms", "connectors", "edges", "base_config")

_PROBE = r"""
import dataclasses, json
from vllm_omni.config.stage_config import DeployConfig, StageDeployConfig
from vllm.engine.arg_utils import EngineArgs
names = lambda c: sorted(f.name for f in dataclasses.fields(c))
print(json.dumps({"top": names(DeployConfig), "stage": names(StageDeployConfig), "engine": names(EngineArgs)}))
"""


def parse(texts) -> tuple[dict, dict]:
    """(top-level settings, {stage_id: {key: value}}) from `KEY=VALUE` texts; BadInput naming the text."""
    top, stages = {}, {}
    for text in texts or ():
        key, sep, raw = str(text).partition("=")
        key = key.strip()
        if not sep or not key:
            raise BadInput(f"--engine-arg {text!r}: expected KEY=VALUE (e.g. talker.enable_prefix_caching=true)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise BadInput(f"--engine-arg {text!r}: the value is not YAML ({e})") from None
        stage, dot, name = key.partition(".")
        if dot:
            if stage not in STAGES:
                raise BadInput(f"--engine-arg {text!r}: stage {stage!r}: expected talker, vocoder, 0 or 1")
            if not name or "." in name:
                raise BadInput(f"--engine-arg {text!r}: expected STAGE.KEY=VALUE with one key")
            stages.setdefault(STAGES[stage], {})[name] = value
        else:
            if key in NOT_TOP:
                raise BadInput(f"--engine-arg {text!r}: {key} is built by difftest; set a stage's keys as STAGE.KEY")
            top[key] = value
    return top, stages


@functools.lru_cache(maxsize=8)
def known_keys(python: str) -> dict:
    """The config fields the environment's vLLM-Omni and vLLM know (one import of each, ~10 s)."""
    try:
        p = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InfraError(f"cannot ask {python} which engine settings it knows: {e}") from None
    if p.returncode != 0:
        raise InfraError(f"cannot ask {python} which engine settings it knows: {p.stderr.strip()[-600:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _unknown(key: str, where: str, known: list[str]) -> BadInput:
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return BadInput(f"--engine-arg {where}: {key!r} is no setting this vLLM-Omni knows{hint}")


def check(python: str | Path, top: dict, stages: dict) -> None:
    """BadInput for a key the environment's vLLM-Omni would not take."""
    if not top and not stages:
        return
    keys = known_keys(str(python))
    for key in top:
        if key not in keys["top"]:
            raise _unknown(key, key, [k for k in keys["top"] if k not in NOT_TOP])
    stage_keys = sorted(set(keys["stage"]) | set(keys["engine"]))
    for sid, settings in stages.items():
        for key in settings:
            if key not in stage_keys:
                raise _unknown(key, f"{('talker', 'vocoder')[int(sid)]}.{key}", stage_keys)
