"""What difftest records in MLflow for one report.json: tags, params and metrics, as plain
values (no mlflow import here), and MLflow's batch limits.

Parent run tags come from the report; each canonical tag is taken from the first place that
has it. `difftest run` puts the candidate's facts directly under `candidate` (versions, device,
deploy_overlay) and qwen-tts's under `reference.provenance`; `difftest compare` copies each
result set's sidecar provenance to `candidate.provenance` / `reference.provenance`.

    candidate.label      candidate.label
    candidate.version    candidate.version, provenance.candidate.version, candidate.provenance.version,
                         then the candidate's vllm-omni package version
    candidate.commit     candidate.commit, provenance.candidate.commit, candidate.provenance.commit
    vllm_omni.version    provenance.vllm_omni.version, then package versions (below)
    vllm.version, qwen_tts.version, torch.version
                         package versions (`-` and `_` alike): provenance.versions, candidate.versions,
                         candidate.provenance.versions, reference.provenance.versions (qwen-tts: the
                         reference's first)
    device               candidate.device, provenance.device, candidate.provenance.device,
                         reference.provenance.device
    checkpoint.sha256    provenance.checkpoint.sha256, candidate/reference provenance checkpoint_sha256,
                         reference.provenance.models.*.sha256
    deploy_config        candidate.deploy_config, provenance.deploy_config, candidate.provenance.deploy_config,
                         candidate.deploy_overlay (its path)
    suite.name/.hash     suite.name, suite.hash;  concurrency, verdict, difftest.version

Besides these, every field under provenance, candidate and reference (but the candidate's
batches) is kept as a tag of its dotted path, e.g. `reference.provenance.versions.qwen-tts`.

report.json's `configuration` (how the served deploy settings differ from the release's deploy
file, difftest.engines.deploy_diff) becomes the artifact `configuration.json`, the tag and param
`configuration.differences` (how many), and the tags `configuration.production` (the release's
file) and `configuration.keys` (the differing keys, comma-separated).
"""

from __future__ import annotations

import json
import math
import re

from ..compare.audio import SNR_CAP_DB
from ..compare.chunks import TIERS
from ..verdicts.catalogue import CLEAN, VERDICTS

MAX_METRICS_PER_BATCH = 1000  # mlflow/utils/validation.py
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_KEY = 250
MAX_TAG_VALUE = 5000  # MLflow allows 8000 for tags, 6000 for params: keep under both
MAX_FLAT_TAGS = 300  # provenance leaves kept as tags; the rest is in report.json
METRIC_CAP = 1e30  # a stand-in for infinity in anything but SNR (MLflow stores inf as 1.8e308)

KIND = "difftest.kind"
# Parent tag: which segments have a child run. "not_clean": only those whose verdict is not in CLEAN
# (a clean segment's numbers are in the parent's report.json and segments.json); runs logged before
# it was set have one child run per segment.
SEGMENT_RUNS = "difftest.segment_runs"
NOT_CLEAN = "not_clean"
REPORT_SHA = "difftest.report_sha256"
PARENT = "mlflow.parentRunId"
CHILD_INHERITS = ("candidate.label", "candidate.version", "candidate.commit", "suite.name", "suite.hash",
                  "device", "concurrency")


def _at(d, path: str):
    for k in path.split("."):
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _first(report: dict, *paths: str):
    for p in paths:
        v = _at(report, p)
        if v is not None and v != "" and v != {}:
            return v
    return None


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


VERSION_PLACES = ("provenance", "candidate", "candidate.provenance", "reference.provenance")


def package_version(report: dict, package: str, order=VERSION_PLACES):
    for where in order:
        versions = _at(report, where + ".versions")
        if isinstance(versions, dict):
            for k, v in versions.items():
                if _norm(k) == _norm(package) and v:
                    return v
    return None


def _checkpoint(report: dict):
    v = _first(report, "provenance.checkpoint.sha256", "provenance.checkpoint_sha256",
               "candidate.provenance.checkpoint_sha256", "reference.provenance.checkpoint_sha256")
    if v is not None:
        return v
    models = _at(report, "reference.provenance.models")
    if isinstance(models, dict):
        hashes = {k: m["sha256"] for k, m in models.items() if isinstance(m, dict) and m.get("sha256")}
        if len(hashes) == 1:
            return next(iter(hashes.values()))
        if hashes:
            return ",".join(f"{k}:{h}" for k, h in sorted(hashes.items()))
    return None


def _text(v) -> str:
    if isinstance(v, (dict, list)):
        v = json.dumps(v, sort_keys=True, separators=(",", ":"))
    s = str(v)
    return s if len(s) <= MAX_TAG_VALUE else s[: MAX_TAG_VALUE - 3] + "..."


def _key(k: str) -> str:
    """MLflow keys allow alphanumerics, _ - . space : / ; anything else becomes _."""
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", k)[:MAX_KEY]


def canonical_tags(report: dict) -> dict[str, str]:
    """The tags a gate or a dashboard searches on; missing ones are left out."""
    raw = {
        "candidate.label": _first(report, "candidate.label"),
        "candidate.version": _first(report, "candidate.version", "provenance.candidate.version",
                                    "candidate.provenance.version")
        or package_version(report, "vllm-omni", ("candidate", "candidate.provenance", "provenance")),
        "candidate.commit": _first(report, "candidate.commit", "provenance.candidate.commit",
                                   "candidate.provenance.commit"),
        # a bug-corpus mutant (difftest.bugs): a control, never the release it was made from
        "candidate.mutant": _first(report, "candidate.versions.vllm_omni_mutant.bug"),
        "vllm_omni.version": _first(report, "provenance.vllm_omni.version") or package_version(report, "vllm-omni"),
        "vllm.version": _first(report, "provenance.vllm.version") or package_version(report, "vllm"),
        "qwen_tts.version": _first(report, "provenance.qwen_tts.version")
        or package_version(report, "qwen-tts", ("reference.provenance", "provenance")),
        "torch.version": package_version(report, "torch"),
        "device": _first(report, "candidate.device", "provenance.device", "candidate.provenance.device",
                         "reference.provenance.device"),
        "checkpoint.sha256": _checkpoint(report),
        "deploy_config": _first(report, "candidate.deploy_config", "provenance.deploy_config",
                                "candidate.provenance.deploy_config", "candidate.deploy_overlay"),
        "suite.name": _first(report, "suite.name"),
        "suite.hash": _first(report, "suite.hash"),
        "concurrency": report.get("concurrency"),
        "verdict": report.get("verdict"),
        "difftest.version": report.get("difftest_version"),
    }
    return {k: _text(v) for k, v in raw.items() if v is not None}


FLAT_SKIP = ("candidate.batches",)  # which requests shared a batch: data, not provenance


def _flatten(prefix: str, d, out: dict) -> None:
    if prefix in FLAT_SKIP:
        return
    if isinstance(d, dict):
        for k, v in d.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif d is not None and d != [] and len(out) < MAX_FLAT_TAGS:
        out[_key(prefix)] = _text(d)


def parent_tags(report: dict, report_sha256: str, extra: dict | None = None) -> dict[str, str]:
    tags: dict[str, str] = {}
    for where in ("provenance", "candidate", "reference"):
        _flatten(where, report.get(where), tags)
    tags.update(canonical_tags(report))
    tags.update({KIND: "run", REPORT_SHA: report_sha256})
    if report.get("created"):
        tags["difftest.report_created"] = str(report["created"])
    if _at(report, "policy.source"):
        tags["policy.source"] = _text(report["policy"]["source"])
    tags.update(configuration_tags(report))
    tags.update({_key(k): _text(v) for k, v in (extra or {}).items()})
    return tags


def parent_params(report: dict) -> dict[str, str]:
    """The policy's numbers, so runs under different tolerances can be told apart in the UI."""
    pol = report.get("policy") or {}
    out = {f"policy.{k}": v for k, v in (pol.get("tiers") or {}).items()}
    out.update({f"policy.require.{k}": v for k, v in (pol.get("require") or {}).items()})
    if "fail_on" in pol:
        out["policy.fail_on"] = ",".join(pol["fail_on"])
    if isinstance(report.get("configuration"), dict):
        out["configuration.differences"] = len(report["configuration"].get("differences") or [])
    return {k: _text(v) for k, v in out.items()}


def configuration_tags(report: dict) -> dict[str, str]:
    """The served configuration against the release's deploy file: how many settings differ, which."""
    c = report.get("configuration")
    if not isinstance(c, dict):
        return {}
    diffs = c.get("differences") or []
    tags = {"configuration.differences": len(diffs), "configuration.production": c.get("production"),
            "configuration.keys": ",".join(str(d.get("key")) for d in diffs) or None}
    return {k: _text(v) for k, v in tags.items() if v is not None}


def parent_metrics(report: dict) -> dict[str, float]:
    counts = report.get("counts") or {}
    out = {f"count.{v}": float(counts.get(v, 0)) for v in VERDICTS}
    out["segments"] = float(len(report.get("segments") or []))
    out["failing"] = float(len(report.get("failing") or []))
    out["pass"] = 1.0 if report.get("verdict") == "pass" else 0.0
    for k, v in (_at(report, "provenance.timings") or {}).items():  # what `difftest run` measured
        if (x := finite(k, v)) is not None:
            out[_key(f"timing.{k}")] = x
    for key, prefix in (("measured_null", "null"), ("measured_null_at_n", "null_n")):
        null = report.get(key) or {}
        for site, e in (null.get("sites") or {}).items():  # the candidate beside the measured null
            out[f"{prefix}.{site}.p_value"] = float(e["p_value"])
            out[f"{prefix}.{site}.candidate_rate"] = float(e["candidate"]["rate"])
            if "null" in e:
                out[f"{prefix}.{site}.null_rate"] = float(e["null"]["rate"])
        flips = null.get("flips") or {}
        if flips.get("null") is not None:  # segments whose codes part between 1 and N: the candidate's, the null's
            out.update({f"{prefix}.flips.candidate": float(flips["candidate"]), f"{prefix}.flips.null": float(flips["null"]),
                        f"{prefix}.flips.p_value": float(flips["p_value"])})
            if "width_p_value" in flips:
                out[f"{prefix}.flips.width_p_value"] = float(flips["width_p_value"])
        if null:
            out[f"{prefix}.pass"] = 1.0 if null.get("verdict") == "pass" else 0.0
    out.update(sampling_metrics(report.get("sampling")))
    out.update(worst_metrics(report))
    return out


def sampling_metrics(sampling: dict | None) -> dict[str, float]:
    """The sampling test per role and site (difftest/verdicts/sampling.py): `sampling.<role>.<site>.*`
    (z, log_e, pit_p, temperature and its interval, tokens) and what the suite could see
    (`sampling.power.<site>.temperature_0.1`)."""
    if not sampling:
        return {}
    out = {"sampling.pass": 1.0 if sampling.get("verdict") == "pass" else 0.0}
    for role, stat in (sampling.get("statistics") or {}).items():
        for site, s in (stat.get("parts") or {}).items():
            p = f"sampling.{role}.{site}"
            values = {"z": s.get("z"), "tokens": s.get("tokens"), "log_e": _at(s, "evalue.log_e"),
                      "pit_p": _at(s, "pit.p"), "temperature": _at(s, "temperature.estimate")}
            ci = _at(s, "temperature.ci95") or [None, None]
            values.update({"temperature_lo": ci[0], "temperature_hi": ci[1]})
            out.update({f"{p}.{k}": float(v) for k, v in values.items() if finite(k, v) is not None})
    for site, pw in (sampling.get("power") or {}).items():
        out[f"sampling.power.{site}.temperature_0.1"] = float(pw["temperature_0.1"])
    return out


def has_child_run(seg: dict) -> bool:
    """A child run for what a maintainer opens: a segment that is not identical or numeric drift.
    Three store writes per run are most of an upload's time; the clean segments' per-chunk numbers
    are in report.json, their worst values in segments.json."""
    return seg.get("verdict") not in CLEAN


def _worst(seg: dict) -> dict:
    """Per comparison, the worst chunk: largest max_abs and log-mel distance, lowest SNR and code
    agreement, highest tier."""
    out = {}
    for comp, body in sorted((seg.get("comparisons") or {}).items()):
        if not isinstance(body, dict):
            continue
        chunks = body.get("chunks") if isinstance(body.get("chunks"), dict) else {}
        for metric, pick in (("max_abs", max), ("logmel", max), ("snr_db", min)):
            vals = [v for x in chunks.get(metric) or [] if (v := finite(metric, x)) is not None]
            if vals:
                out[f"{comp}.{metric}"] = pick(vals)
        agree = [v for x in body.get("chunk_agreement") or [] if (v := finite("agreement", x)) is not None]
        if agree:
            out[f"{comp}.chunk_agreement"] = min(agree)
        tiers = [TIERS.index(t) for t in body.get("tiers") or [] if t in TIERS]
        if tiers:
            out[f"{comp}.tier"] = max(tiers)
    return out


def segment_rows(report: dict) -> list[dict]:
    """One row per segment, clean ones too (the `segments.json` table): its verdict, where it
    parted, and its worst chunk per comparison (None where it has no such comparison)."""
    failing = set(report.get("failing") or [])
    worst = [_worst(s) for s in report.get("segments") or []]
    columns = sorted({k for w in worst for k in w})
    return [{"segment": s["id"], "verdict": s.get("verdict"), "failing": s["id"] in failing,
             "child_run": has_child_run(s), "first_divergent_chunk": s.get("first_divergent_chunk"),
             "stage": s.get("stage"), **{c: w.get(c) for c in columns}}
            for s, w in zip(report.get("segments") or [], worst)]


def worst_metrics(report: dict) -> dict[str, float]:
    """`worst.<comparison>.<metric>`: the worst chunk of the whole run, so drift that stays within
    tolerance can still be followed across versions on the parent run."""
    out: dict[str, float] = {}
    for seg in report.get("segments") or []:
        for k, v in _worst(seg).items():
            key = f"worst.{k}"
            low = k.endswith(("snr_db", "chunk_agreement"))
            if key not in out or (v < out[key] if low else v > out[key]):
                out[key] = v
    return out


def segment_tags(seg: dict, report: dict, parent_run_id: str, inherited: dict) -> dict[str, str]:
    raw = {
        KIND: "segment", PARENT: parent_run_id, "segment.id": seg["id"], "verdict": seg.get("verdict"),
        "stage": seg.get("stage"), "donor": seg.get("donor"), "donor_kind": seg.get("donor_kind"),
        "error_kind": seg.get("error_kind"), "first_divergent_chunk": seg.get("first_divergent_chunk"),
        "first_divergent_frame": seg.get("first_divergent_frame"),
        "failing": "true" if seg["id"] in (report.get("failing") or []) else "false",
        "summary": seg.get("summary"),
    }
    if seg.get("notes"):
        raw["notes"] = "; ".join(seg["notes"])
    tags = {k: inherited[k] for k in CHILD_INHERITS if k in inherited}
    tags.update({k: _text(v) for k, v in raw.items() if v is not None})
    return tags


def finite(name: str, value) -> float | None:
    """A value MLflow stores faithfully: NaN dropped, infinity capped (SNR at its report cap)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    if math.isnan(v):
        return None
    cap = SNR_CAP_DB if name.endswith("snr_db") else METRIC_CAP
    return max(-cap, min(cap, v))


def segment_metrics(seg: dict) -> list[tuple[str, float, int]]:
    """(name, value, step) with step = chunk index: `<comparison>.<metric>` for every per-chunk
    list in the segment's comparisons (max_abs, rms, snr_db, logmel, chunk_agreement) and the tier
    index per chunk as `<comparison>.tier`; and with step = frame, the teacher-forced trace
    (`forced.rank_codebook0`, `forced.gap_codebook0`, ...)."""
    out = []
    for comp, body in sorted((seg.get("comparisons") or {}).items()):
        if not isinstance(body, dict):
            continue
        chunks = body.get("chunks")  # donor_search has a list of chunk indices here, not series
        series = dict(chunks) if isinstance(chunks, dict) else {}
        if isinstance(body.get("chunk_agreement"), list):
            series["chunk_agreement"] = body["chunk_agreement"]
        if isinstance(body.get("tiers"), list):
            series["tier"] = [TIERS.index(t) if t in TIERS else None for t in body["tiers"]]
        offset = 0
        if comp == "forced" and isinstance(body.get("trace"), dict):  # per frame, not per chunk: step = frame
            series = {k: v for k, v in body["trace"].items() if isinstance(v, list)}
            offset = int(body["trace"].get("start") or 0)
        for metric, values in sorted(series.items()):
            if not isinstance(values, list):
                continue
            name = _key(f"{comp}.{metric}")
            for step, x in enumerate(values, start=offset):
                v = finite(name, x)
                if v is not None:
                    out.append((name, v, step))
    return out


def batches(metrics: list, tags: list, params: list = ()):
    """Split into (metrics, params, tags) batches within MLflow's log_batch limits."""
    metrics, keyed = list(metrics), [("p", p) for p in params] + [("t", t) for t in tags]
    while metrics or keyed:
        head, keyed = keyed[:MAX_PARAMS_TAGS_PER_BATCH], keyed[MAX_PARAMS_TAGS_PER_BATCH:]
        room = MAX_METRICS_PER_BATCH - len(head)  # the 1000 entities per batch include params and tags
        part, metrics = metrics[:room], metrics[room:]
        yield part, [x for k, x in head if k == "p"], [x for k, x in head if k == "t"]


def divergence_rows(report: dict) -> list[dict]:
    """One row per segment that is not clean: what a maintainer scans first."""
    failing = set(report.get("failing") or [])
    return [{"segment": s["id"], "verdict": s["verdict"], "failing": s["id"] in failing,
             "first_divergent_chunk": s.get("first_divergent_chunk"),
             "first_divergent_frame": s.get("first_divergent_frame"),
             "stage": s.get("stage"), "donor": s.get("donor"), "donor_kind": s.get("donor_kind"),
             "error_kind": s.get("error_kind"),
             "summary": s.get("summary", "")}
            for s in report.get("segments") or [] if s.get("verdict") not in CLEAN]


def experiment_name(report: dict) -> str:
    return f"difftest/{_first(report, 'suite.name') or 'adhoc'}"
