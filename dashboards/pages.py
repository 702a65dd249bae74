"""The dashboard's pages: what each one shows is computed here, and written out by the Jinja2
templates in templates/. Autoescaping is on for every template, so each value from MLflow or a
report is text, never markup; links are relative, so the site opens from file://."""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from functools import lru_cache

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from dashboards import model
from dashboards.assets import VERDICT_COLOURS, VIEWS
from dashboards.html import fmt_num, fmt_pct, href
from dashboards.media import STEP_24
from difftest.compare.chunks import TIERS
from difftest.records.segment_media import safe_name
from difftest.verdicts.catalogue import BY_NAME, RANK
from difftest.verdicts.null import counted
from difftest.verdicts.policy import VERDICTS
from difftest.verdicts.where import donor_text, where

SEGMENT_ROLES = (  # audio role -> (title, what it is)
    ("reference", "reference", "the official reference at concurrency 1 (qwen-tts, or transformers' Qwen3-Omni)"),
    ("candidate", "candidate", "the candidate at concurrency N"),
    ("cross_own", "cross-decoded (own)", "the reference vocoder on the candidate's codes and its own reference "
                                         "codes: what the candidate should sound like"),
    ("cross_donor", "cross-decoded (donor)", "the reference vocoder on the candidate's codes with the donor's "
                                             "reference codes: what a leak from the donor sounds like"),
    ("control", "candidate at concurrency 1", "the same candidate alone"),
    ("difference", "difference", "candidate minus reference, sample by sample"),
)
# where_groups: the most serious first
SERIOUSNESS = tuple(v for v in RANK if not BY_NAME[v].clean and not BY_NAME[v].reported_as)
TIER_CELL_COLOURS = ("#c8e6c9", "#dcedc8", "#fff9c4", "#ffcdd2")  # the per-chunk table, by tier


@dataclass
class Context:
    ui_url: str
    uri: str
    built: str
    title: str = "difftest dashboard"
    changes: dict = field(default_factory=dict)  # run id -> model.Change
    runs: dict = field(default_factory=dict)  # run id -> gather.Run


# -- small pieces, for the templates too -----------------------------------------------------------------
def when(ms: int) -> str:
    if not ms:
        return "–"
    return _dt.datetime.fromtimestamp(ms / 1000, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def short(sha: str | None, n: int = 10) -> str:
    return (sha or "")[:n]


def clip(text: str, n: int) -> str:
    """`text`, or its first n-1 characters and an ellipsis."""
    return text if len(text) <= n else text[:n - 1] + "…"


def run_dir(run_id: str) -> str:
    return href("runs", safe_name(run_id))


def run_href(run_id: str, root: str = "") -> str:
    return f"{root}{run_dir(run_id)}/index.html"


def segment_file(index: int, seg_id: str) -> str:
    return f"seg-{index:03d}-{safe_name(seg_id)}.html"


def diverged_segments(report: dict) -> list[tuple[int, dict]]:
    return [(i, s) for i, s in enumerate(report.get("segments") or []) if s.get("verdict") not in model.CLEAN]


def segment_href(run, seg_id: str, root: str = "") -> str | None:
    for i, s in diverged_segments(run.report):
        if s["id"] == seg_id:
            return f"{root}{run_dir(run.run_id)}/{href(segment_file(i, seg_id))}"
    return None


def mlflow_url(ctx: Context, exp_id: str, run_id: str) -> str:
    return f"{ctx.ui_url.rstrip('/')}/#/experiments/{href(str(exp_id))}/runs/{href(str(run_id))}"


def where_bits(seg: dict) -> str:
    """`chunk 0 · handoff · donor s2`: where a segment parts from the reference."""
    return where(seg, " · ")


@lru_cache(maxsize=1)
def environment() -> Environment:
    env = Environment(loader=PackageLoader("dashboards", "templates"),
                      autoescape=select_autoescape(("html", "svg"), default_for_string=True, default=True),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                      finalize=lambda v: "" if v is None else v)  # None shows as nothing, as a missing tag does
    env.globals.update(
        VERDICTS=VERDICTS, VERDICT_COLOURS=VERDICT_COLOURS, TIERS=TIERS, TITLES=model.COMPARISON_TITLES,
        href=href, when=when, short=short, clip=clip, safe_name=safe_name, donor_text=donor_text,
        run_href=run_href, segment_href=segment_href, segment_file=segment_file, where_bits=where_bits)
    env.filters.update(num=fmt_num, pct=fmt_pct)
    return env


def _render(template: str, **context) -> str:
    return environment().get_template(template).render(**context)


def where_line(run, seg: dict, root: str = "") -> str:
    """`s0 contamination · chunk 0 · handoff · donor s2`, the id linked to its page."""
    macros = environment().get_template("_macros.html").module
    return macros.where_line(seg, segment_href(run, seg["id"], root))


# -- the index ------------------------------------------------------------------------------------------
def trend(runs: list) -> dict:
    """The geometry of a suite's trend: diverged and failing share of segments per run, oldest to newest."""
    n = len(runs)
    step, left, top, height = 64, 46, 14, 96
    width = max(460, left + step * max(n, 1) + 20)

    def y(v):
        return top + (1 - (v or 0)) * height

    xs = [left + step * i + step / 2 for i in range(n)]
    stats = [model.run_stats(r.report) for r in runs]
    grid = [{"x1": left, "x2": width - 10, "y": f"{y(f):.1f}", "tx": left - 6, "ty": f"{y(f) + 4:.1f}",
             "label": f"{f:.0%}"} for f in (0, 0.5, 1)]
    kinds = sorted({r.line for r in runs}, key=lambda line: line.rank)
    lines = []
    for line in kinds:  # a polyline joins runs of one candidate line only
        idx = [i for i, r in enumerate(runs) if r.line == line]
        lines += [{"points": " ".join(f"{xs[i]:.1f},{y(getattr(stats[i], attr)):.1f}" for i in idx), "colour": colour,
                   "dash": dash}
                  for attr, colour, dash in (("diverged_rate", "#ef6c00", ""), ("failing_rate", "#c62828", "4 3"))]
    dots = [{"href": run_href(r.run_id), "x": f"{x:.1f}", "y": f"{y(s.failing_rate):.1f}",
             "colour": {"pass": "#2e7d32", "fail": "#c62828"}.get(r.verdict, "#37474f"), "label": clip(r.version, 9),
             "tip": f"{r.version} · {r.verdict} · {when(r.start_ms)} · diverged {fmt_pct(s.diverged_rate)} · "
                    f"failing {fmt_pct(s.failing_rate)}" + (f" · {r.line.title}" if len(kinds) > 1 else "")}
            for x, r, s in zip(xs, runs, stats)]
    return {"width": width, "height": top + height + 30, "label_y": top + height + 18, "grid": grid, "lines": lines,
            "dots": dots}


def version_matrix(runs: list, ctx: Context, suites: list[str]) -> dict:
    """One candidate line's versions (newest first) × suites: the latest run of each version on each suite."""
    latest: dict[tuple, object] = {}
    newest: dict[str, int] = {}
    for r in runs:  # runs are oldest first: the last one wins
        latest[(r.version, r.experiment)] = r
        newest[r.version] = max(newest.get(r.version, 0), r.start_ms)
    rows = []
    for v in sorted(newest, key=lambda v: -newest[v]):
        cells = []
        for s in suites:
            r = latest.get((v, s))
            ch = ctx.changes.get(r.run_id) if r else None
            cells.append(r and {"run": r, "stats": model.run_stats(r.report), "change": ch.kind if ch else None})
        labels = sorted({r.tags.get("candidate.label", "") for r in runs if r.version == v} - {"", v})
        rows.append({"version": v, "labels": ", ".join(labels), "when": when(newest[v]), "cells": cells})
    return {"suites": [s.removeprefix("difftest/") for s in suites], "rows": rows}


def version_matrices(runs: list, ctx: Context) -> list[dict]:
    """A versions × suites table per candidate line (vLLM-Omni's server, its offline API, a URL, ...)."""
    suites = sorted({r.experiment for r in runs})
    return [{"line": line, **version_matrix([r for r in runs if r.line == line], ctx, suites)}
            for line in sorted({r.line for r in runs}, key=lambda line: line.rank)]


def control_outcome(r) -> tuple[str, bool]:
    """What a control run says about the tester, in `difftest selfcheck`'s words, and whether that is right."""
    line = r.line
    if r.verdict == line.expect:
        return ("caught" if line.defect else "clean"), True
    if r.verdict == "error" or r.verdict not in ("pass", "fail"):
        return r.verdict, False
    return ("NOT caught" if line.defect else "FLAGGED"), False


def control_matrix(runs: list, ctx: Context) -> dict:
    """Control lines (the CPU test engine clean, then each planted defect) × suites: the latest run of each."""
    suites = sorted({r.experiment for r in runs})
    latest = {(r.line, r.experiment): r for r in runs}  # runs are oldest first: the last one wins
    rows = []
    for line in sorted({r.line for r in runs}, key=lambda line: line.rank):
        cells = []
        for s in suites:
            r = latest.get((line, s))
            ch = ctx.changes.get(r.run_id) if r else None
            cells.append(r and {"run": r, "stats": model.run_stats(r.report), "outcome": control_outcome(r),
                                "change": ch.kind if ch else None})
        labels = sorted({r.tags.get("candidate.label", "") for r in runs if r.line == line} - {""})
        rows.append({"line": line, "labels": ", ".join(labels), "cells": cells})
    return {"suites": [s.removeprefix("difftest/") for s in suites], "rows": rows}


def where_groups(run, root: str = "", limit: int = 3) -> dict:
    """The failing segments (else the diverged ones) grouped by what went wrong and where:
    `contamination ×2 · chunk 0 · handoff · donor s2: s0, s1`, most serious first."""
    segs = run.report.get("segments") or []
    failing = set(run.failing)
    shown = [s for s in segs if s["id"] in failing] or [s for s in segs if s.get("verdict") not in model.CLEAN]
    groups: dict[tuple, list] = {}
    for s in shown:
        key = (s.get("verdict"), s.get("first_divergent_chunk"), s.get("stage"), donor_text(s))
        groups.setdefault(key, []).append(s)
    rank = {v: i for i, v in enumerate(SERIOUSNESS)}
    ordered = sorted(groups.items(), key=lambda kv: (rank.get(kv[0][0], 99), -len(kv[1])))
    items = []
    for (verdict, chunk, stage, donor), members in ordered[:limit]:
        items.append({"verdict": verdict, "count": len(members), "where": where(members[0], " · "),
                      "members": [{"id": m["id"], "href": segment_href(run, m["id"], root), "name": clip(m["id"], 24)}
                                  for m in members[:4]],
                      "more": len(members) - 4})
    return {"items": items, "more_kinds": len(ordered) - limit}


def run_row(r, ctx: Context, with_suite: bool = False) -> dict:
    """One run in a runs table (`with_suite`: a table across suites says which)."""
    st = model.run_stats(r.report)
    label = r.tags.get("candidate.label", "")
    facts = [x for x in (r.suite if with_suite else "", label if label != r.version else "",
                         short(r.tags.get("candidate.commit")), r.device,
                         f"c={r.tags['concurrency']}" if r.tags.get("concurrency") else "") if x]
    return {"run": r, "stats": st, "change": ctx.changes.get(r.run_id), "facts": " · ".join(facts),
            "where": where_groups(r), "ml": mlflow_url(ctx, r.experiment_id, r.run_id)}


def bisect_row(b, ctx: Context) -> dict:
    return {"b": b, "culprit": b.culprit, "subject": _bisect_subject(b), "status": _bisect_status(b),
            "commits": len({p.commit for p in b.probes}), "ml": mlflow_url(ctx, b.experiment_id, b.run_id)}


def newest_first(runs: list) -> list:
    return sorted(runs, key=lambda r: (-r.start_ms, r.run_id))


def index_page(store, ctx: Context) -> str:
    runs = store.runs
    candidates = [r for r in runs if not r.line.control]
    controls = [r for r in runs if r.line.control]
    suites = []
    for exp in sorted({r.experiment for r in candidates}):
        mine = [r for r in candidates if r.experiment == exp]
        suites.append({"anchor": safe_name(exp), "name": mine[0].suite, "experiment": exp, "count": len(mine),
                       "trend": trend(mine), "rows": [run_row(r, ctx) for r in newest_first(mine)]})
    return _render("index.html", ctx=ctx, root="", title=ctx.title, crumbs=[("runs", None)], store=store, runs=runs,
                   n_suites=len({r.experiment for r in runs}), matrices=version_matrices(candidates, ctx),
                   suites=suites, controls=control_matrix(controls, ctx) if controls else None,
                   control_rows=[run_row(r, ctx, with_suite=True) for r in newest_first(controls)],
                   bisects=[bisect_row(b, ctx) for b in sorted(store.bisects, key=lambda b: -b.start_ms)])


def section_crumb(run, root: str) -> tuple[str, str]:
    """The index's section of a run: its suite's, or the controls' for a test engine."""
    if run.line.control:
        return "negative controls", f"{root}index.html#controls"
    return run.suite, f"{root}index.html#suite-{safe_name(run.experiment)}"


# -- a run ----------------------------------------------------------------------------------------------
def _cell_title(seg_id: str, cell: model.Cell) -> str:
    lines = [f"{seg_id} · chunk {cell.chunk}"]
    if cell.worst is not None:
        lines.append(f"worst: {TIERS[cell.worst]}")
    for comp in model.AUDIO_COMPARISONS:
        if comp in cell.tiers or comp in cell.logmel:
            t = TIERS[cell.tiers[comp]] if comp in cell.tiers else "?"
            lines.append(f"{model.COMPARISON_TITLES[comp]}: {t}, log-mel {fmt_num(cell.logmel.get(comp))}, "
                         f"SNR {fmt_num(cell.snr_db.get(comp))} dB, max |diff| {fmt_num(cell.max_abs.get(comp))}")
    for comp in model.CODE_COMPARISONS:
        if comp in cell.agreement:
            lines.append(f"{model.COMPARISON_TITLES[comp]}: {fmt_pct(cell.agreement[comp])} of frames agree")
    return "\n".join(lines)


def _cell_classes(cell: model.Cell, close: float) -> list[str]:
    def tier(v):
        return "x" if v is None else str(v)

    codes = cell.codes_agreement
    k = "x" if codes is None else "0" if codes >= 1 else "2" if codes >= 0.5 else "3"
    lb = model.logmel_bucket(cell.worst_logmel, close)
    return [f"w{tier(cell.worst)}", f"l{'x' if lb is None else lb}", f"k{k}",
            f"a{tier(cell.tiers.get('audio'))}", f"c{tier(cell.tiers.get('concurrency'))}",
            f"v{tier(cell.tiers.get('vocoder'))}"]


def heatmap(run, root_to_run: str = "") -> dict:
    """Segments × chunks: one row per segment, one cell per chunk; each cell carries a class per view
    (the stylesheet colours the checked view's)."""
    segs = run.report.get("segments") or []
    close = model.close_logmel(run.report)
    grid = [(s, model.segment_cells(s)) for s in segs]
    width = max((len(c) for _, c in grid), default=0)
    present = {"worst", "logmel"}
    for _, cells in grid:
        for c in cells:
            present.update(k for k in ("audio", "concurrency", "vocoder") if k in c.tiers)
            if c.agreement:
                present.add("codes")
    failing = set(run.failing)
    rows = []
    for s, cells in grid:
        onset = s.get("first_divergent_chunk") if s.get("verdict") not in model.CLEAN else None
        rows.append({"seg": s, "anchor": safe_name(s["id"]), "href": segment_href(run, s["id"], root_to_run),
                     "failing": s["id"] in failing, "pad": width - len(cells),
                     "cells": [{"chunk": c.chunk, "title": _cell_title(s["id"], c),
                                "classes": " ".join(_cell_classes(c, close) + (["onset"] if c.chunk == onset else []))}
                               for c in cells]})
    bounds = model.logmel_bounds(close)
    return {"views": [v for v in VIEWS if v[0] in present], "width": width, "every": 1 if width <= 40 else 5,
            "rows": rows, "close": close,
            "logmel_labels": ["0"] + [f"≤ {fmt_num(b, 2)}" for b in bounds] + [f"> {fmt_num(bounds[-1], 2)}"]}


def run_page(run, ctx: Context) -> str:
    root = "../../"
    rep = run.report
    st = model.run_stats(rep)
    t = run.tags
    ch = ctx.changes.get(run.run_id)
    cards = [
        ("segments", str(st.segments), ""),
        ("diverged", f"{st.diverged} ({fmt_pct(st.diverged_rate)})", "bad" if st.diverged else "good"),
        ("failing", f"{st.failing} ({fmt_pct(st.failing_rate)})", "bad" if st.failing else "good"),
        ("worst chunk-0 log-mel", fmt_num(st.chunk0_logmel) + (f" ({st.chunk0_worst_segment})"
                                                                if st.chunk0_logmel else ""), ""),
    ]
    one = rep.get("at_concurrency_1")
    if isinstance(one, dict) and one.get("verdict"):
        cards.append(("candidate at concurrency 1 alone", one["verdict"],
                      "good" if one["verdict"] == "pass" else "bad"))
    facts = [("candidate", t.get("candidate.label")), ("version", t.get("candidate.version")),
             ("commit", t.get("candidate.commit")), ("vLLM-Omni", t.get("vllm_omni.version")),
             ("vLLM", t.get("vllm.version")), ("qwen-tts", t.get("qwen_tts.version")),
             ("torch", t.get("torch.version")), ("device", t.get("device")), ("concurrency", t.get("concurrency")),
             ("checkpoint sha256", t.get("checkpoint.sha256")), ("deploy config", t.get("deploy_config")),
             ("suite", f"{t.get('suite.name', '')} {short(t.get('suite.hash'), 12)}".strip()),
             ("report created", t.get("difftest.report_created")), ("difftest", t.get("difftest.version")),
             ("policy fails on", ", ".join(model.fail_on(rep))), ("MLflow run", run.run_id),
             ("data", "report.json" if run.source == "report.json" else "rebuilt from the child runs' tags and "
                                                                         "metrics (no report.json artifact)")]
    crumbs = [("runs", f"{root}index.html"), section_crumb(run, root),
              (f"{run.version} ({when(run.start_ms)})", None)]
    return _render("run.html", ctx=ctx, root=root, title=f"{run.version} on {run.suite}: {run.verdict}", crumbs=crumbs,
                   run=run, line=run.line, tags=t, stats=st, cards=cards, change=ch,
                   previous=ctx.runs.get(ch.previous) if ch else None,
                   heat=heatmap(run), diverged=diverged_segments(rep), failing=set(run.failing), facts=facts,
                   nulls=null_tests(rep), sampling=sampling_rows(rep), served=served_configuration(rep),
                   ml=mlflow_url(ctx, run.experiment_id, run.run_id),
                   children={sid: mlflow_url(ctx, run.experiment_id, cid) for sid, cid in run.children.items()})


def served_configuration(report: dict) -> dict | None:
    """report.json's `configuration` (difftest.engines.deploy_diff): each deploy setting the candidate
    served with another value than the release's deploy file, production's value, the served one, why.
    None when the report has none (a candidate difftest did not configure, an older report)."""
    c = report.get("configuration")
    if not isinstance(c, dict):
        return None

    def text(v) -> str:
        return "(not set)" if v is None else json.dumps(v) if not isinstance(v, str) else v

    rows = [{"key": d.get("key"), "production": text(d.get("production")), "served": text(d.get("served")),
             "why": d.get("why") or "", "given": str(d.get("why") or "").startswith("set by --")}
            for d in c.get("differences") or [] if isinstance(d, dict)]
    return {"production": c.get("production"), "device": c.get("device"), "note": c.get("note"),
            "error": c.get("error"), "rows": rows}


# -- the sampling test ----------------------------------------------------------------------------------
SAMPLING_ROLES = {"candidate": "candidate at N", "control": "candidate at 1", "reference": "qwen-tts (calibration)",
                  "null": "qwen-tts in the candidate's numerics (calibration)"}


def sampling_rows(report: dict) -> list[dict]:
    """The sampling test (difftest/verdicts/sampling.py), a row per role and sampler site: z, the
    e-value against the sampler bank and its line, the PIT's p, the estimated temperature, and the
    power the suite had against a temperature error of 0.1 (what it could see)."""
    f = report.get("sampling")
    if not isinstance(f, dict):
        return []
    power = f.get("power") or {}
    rows = []
    for role, stat in (f.get("statistics") or {}).items():
        for site, s in (stat.get("parts") or {}).items():
            ev, pit, t = s.get("evalue") or {}, s.get("pit") or {}, s.get("temperature") or {}
            ci = t.get("ci95") or []
            rows.append({"role": SAMPLING_ROLES.get(role, role), "site": SITE_NAMES.get(site, site),
                         "tokens": s.get("tokens"), "z": s.get("z"),
                         "log_e": ev.get("log_e"), "line": ev.get("line"), "leading": ev.get("leading"),
                         "pit_p": pit.get("p"),
                         "temperature": f"{t['estimate']:.3g} ({ci[0]:.3g}-{ci[1]:.3g}; {t['requested']:.3g} asked)"
                         if t else "",
                         "power": (power.get(site) or {}).get("temperature_0.1") if role == "candidate" else None,
                         "flagged": bool(ev.get("flagged") or pit.get("flagged")
                                         or abs(s.get("z") or 0) > f.get("max_z", 4.0))})
    return rows


# -- the measured null ----------------------------------------------------------------------------------
NULL_TESTS = (("measured_null", "at concurrency 1"), ("measured_null_at_n", "at concurrency N"))
SITE_NAMES = {"talker": "talker (codebook 0)", "code_predictor": "code predictor (codebooks 1-15)",
              "talker_sampled": "talker (codebook 0), sampled", "code_predictor_sampled": "code predictor, sampled"}


def null_tests(report: dict) -> list[dict]:
    """The run's tests against the measured null, a row per test: the candidate's count beside the
    null's (qwen-tts in the candidate's numerics), the p-value and its alpha, and the decision."""
    rows = []
    for key, run_at in NULL_TESTS:
        f = report.get(key)
        if not isinstance(f, dict):
            continue
        failed = f.get("verdict") != "pass"
        mine = []
        for site, e in (f.get("sites") or {}).items():
            c, n, key = e.get("candidate") or {}, e.get("null"), counted(site)
            what = "tokens outside qwen-tts's sampling support" if key == "outside_support" else "tokens off qwen-tts's top-1"
            mine.append({"what": f"{SITE_NAMES.get(site, site)}: {what}",
                         "candidate": f"{c.get(key)} of {c.get('tokens')}",
                         "null": f"{n[key]} of {n['tokens']}" if n else "not decoded (nothing to explain)",
                         "p": e.get("p_value"), "alpha": e.get("alpha"), "flagged": failed and f.get("site") == site})
        flips = f.get("flips") or {}
        if flips.get("null") is not None:
            ties = f" (ties up to {flips['null_max_gap']:.3g} nats)" if flips.get("null_max_gap") else ""
            mine.append({"what": "segments whose codes at N part from those at 1",
                         "candidate": f"{flips['candidate']} of {flips['segments']}",
                         "null": f"{flips['null']} of {flips['segments']}{ties}", "p": flips.get("p_value"),
                         "alpha": flips.get("alpha"), "flagged": failed and "part from their codes at 1" in f.get("summary", "")})
            if flips.get("width_p_value") is not None:
                mine.append({"what": "how wide the ties they part on are (rank test)",
                             "candidate": _gaps(flips.get("candidate_flipped")), "null": _gaps(flips.get("null_flipped")),
                             "p": flips["width_p_value"], "alpha": flips.get("alpha"),
                             "flagged": failed and "wider ties" in f.get("summary", "")})
        numerics = f.get("numerics") or {}
        for i, r in enumerate(mine):
            rows.append({**r, "where": run_at,
                         "numerics": f"{numerics.get('dtype', '?')} ({numerics.get('from', '?')})" if i == 0 else None})
    return rows


def _gaps(flipped: dict | None) -> str:
    gaps = sorted(f["gap"] for f in (flipped or {}).values() if isinstance(f, dict) and f.get("gap") is not None)
    return "none" if not gaps else f"{gaps[0]:.3g}" if len(gaps) == 1 else f"{gaps[0]:.3g}-{gaps[-1]:.3g} nats"


def segment_null(report: dict, sid: str) -> list[dict]:
    """This segment beside the measured null: per test and site, its tokens off the top-1 and the null's."""
    rows = []
    for key, run_at in NULL_TESTS:
        per = ((report.get(key) or {}).get("segments") or {}).get(sid) or {}
        for site, (cand, null, tokens) in per.items():
            rows.append({"where": run_at, "site": SITE_NAMES.get(site, site), "candidate": cand,
                         "null": "not decoded" if null is None else null, "tokens": tokens})
    return rows


# -- a diverged segment ---------------------------------------------------------------------------------
def per_chunk(seg: dict) -> dict:
    """The per-chunk table: one row per comparison made, one column per chunk."""
    cells = model.segment_cells(seg)
    comps = [c for c in (*model.CODE_COMPARISONS, *model.AUDIO_COMPARISONS) if any(c in x.tiers for x in cells)]
    rows = []
    for comp in comps:
        tds = []
        for c in cells:
            if comp not in c.tiers:
                tds.append(None)
                continue
            tier = TIERS[c.tiers[comp]]
            if comp in model.CODE_COMPARISONS:
                txt, tip = fmt_pct(c.agreement.get(comp)), f"{fmt_pct(c.agreement.get(comp))} of frames agree"
            else:
                txt = fmt_num(c.logmel.get(comp), 2)
                tip = (f"{tier}; log-mel {fmt_num(c.logmel.get(comp))}, SNR {fmt_num(c.snr_db.get(comp))} dB, "
                       f"max |diff| {fmt_num(c.max_abs.get(comp))}")
            tds.append({"text": txt, "title": tip, "colour": TIER_CELL_COLOURS[c.tiers[comp]]})
        rows.append({"title": model.COMPARISON_TITLES[comp], "cells": tds})
    return {"chunks": [c.chunk for c in cells], "onset": seg.get("first_divergent_chunk"), "rows": rows}


def codes_at_divergence(seg: dict) -> list[dict]:
    """Each code comparison that found a divergent frame: the 16 codes of both sides there."""
    comps = seg.get("comparisons") or {}
    shown = []
    for comp, sides in (("codes", ("reference", "candidate@N")), ("concurrency_codes", ("candidate@1", "candidate@N"))):
        body = comps.get(comp)
        if not isinstance(body, dict) or body.get("first_divergent_frame") is None:
            continue
        a, b = (list(body.get("codes_at_divergence") or []) + [None, None])[:2]

        def row(name, vec, other):
            return {"name": name, "codes": None if vec is None else [
                (v, other is not None and i < len(other) and other[i] != v) for i, v in enumerate(vec)]}

        frame = body["first_divergent_frame"]
        frames = body.get("frames") or ["?", "?"]
        shown.append({"title": model.COMPARISON_TITLES[comp], "frame": frame, "seconds": f"{frame * 0.08:.2f}",
                      "differing": body.get("frames_differing", "?"), "frames": frames[:2],
                      "rows": [row(sides[0], a, b), row(sides[1], b, a)]})
    return shown


def codes_agree_note(seg: dict) -> dict:
    """When no code comparison diverged: what the codes say, and what differs instead."""
    comps = seg.get("comparisons") or {}
    codes, rc = comps.get("codes"), comps.get("ref_codes")
    note = {"captured": isinstance(codes, dict), "frames": (codes.get("frames") or ["?"])[0] if isinstance(codes, dict)
            else None, "ref_codes": None}
    if isinstance(rc, dict):
        peers = rc.get("peers_of_that_length")
        resized = (f": its own, {rc['own_resized']} to that length" + (f" ({' and '.join(peers)}'s)" if peers else "")
                   if rc.get("own_resized") else "")
        note["ref_codes"] = {"candidate": rc.get("candidate_frames"), "own": rc.get("own_frames"),
                             "peer": f" ({rc['matches_peer']}'s)" if rc.get("matches_peer") else "",
                             "source": rc.get("own_from", "?"), "resized": resized}
    return note


def donor(run, seg: dict) -> dict:
    """The donor, and the donor search: log-mel distance with each co-batched request's reference codes."""
    name = seg.get("donor")
    ds = (seg.get("comparisons") or {}).get("donor_search")
    out = {"name": name, "length": seg.get("donor_kind") == "length", "href": None, "text": None, "resized": None,
           "search": None}
    if name:
        link = segment_href(run, name)
        out.update(href=link.split("/")[-1] if link else f"index.html#seg-{safe_name(name)}",
                   text=run.texts.get(name),
                   resized=((seg.get("comparisons") or {}).get("ref_codes") or {}).get("own_resized") or "resized")
    if isinstance(ds, dict) and ds.get("peers_logmel"):
        out["search"] = {"own": ds.get("own_logmel"), "chunks": ", ".join(map(str, ds.get("chunks") or [])),
                         "peers": sorted(ds["peers_logmel"].items(), key=lambda x: x[1])}
    return out


def forced_plot(seg: dict, max_gap: float | None) -> dict | None:
    """The teacher-forced trace as a plot: per frame, how many nats the candidate's token lies below
    qwen-tts's top-1 (codebook 0, and the worst of codebooks 1-15), the policy's line, the first
    divergent frame marked. None when the segment was not scored."""
    tr = ((seg.get("comparisons") or {}).get("forced") or {}).get("trace")
    if not isinstance(tr, dict) or not tr.get("gap_codebook0"):
        return None
    g0, g1 = tr["gap_codebook0"], tr.get("gap_codebooks_1_15") or []
    start, n = int(tr.get("start") or 0), len(g0)
    left, top, height, step = 46, 12, 120, max(4.0, min(14.0, 560 / max(n, 1)))
    width = int(left + step * n + 20)
    top_value = max([*g0, *g1, max_gap or 0, 0.1]) * 1.1

    def y(v):
        return top + (1 - min(v, top_value) / top_value) * height

    def x(i):
        return left + step * i + step / 2

    lines = [{"points": " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(vals)), "colour": colour, "label": label}
             for vals, colour, label in ((g0, "#6a1b9a", "codebook 0 (talker)"), (g1, "#ef6c00", "worst of codebooks 1-15"))
             if vals]
    frame = seg.get("first_divergent_frame")
    mark = None
    if frame is not None and start <= frame < start + n:
        mark = {"x": f"{x(frame - start):.1f}", "label": f"frame {frame}"}
    ticks = [{"x": f"{x(i):.1f}", "label": str(start + i)} for i in range(0, n, max(1, n // 8))]
    ranks = tr.get("rank_codebook0") or []
    return {"width": width, "height": top + height + 30, "label_y": top + height + 16, "lines": lines, "mark": mark,
            "ticks": ticks, "threshold": None if max_gap is None else {"y": f"{y(max_gap):.1f}", "label": f"{max_gap:g}"},
            "grid": [{"y": f"{y(v):.1f}", "label": f"{v:.2g}"} for v in (0, top_value / 1.1)],
            "x1": left, "x2": width - 10, "worst_rank": max(ranks) if ranks else None,
            "summary": (seg["comparisons"]["forced"].get("decoding"), seg["comparisons"]["forced"].get("top1_share"))}


def _repro_links(repro: dict | None) -> dict | None:
    if not repro:
        return None
    return {**repro, "files": {name: href(*path.split("/")) for name, path in repro["files"].items()}}


def audio_label(meta: dict) -> str:
    """How the site stores one player's audio, as its caption says it: `FLAC 24-bit, to 2⁻²³ · 228 kB`."""
    size = f"{meta['bytes'] / 1000:.0f}\u00a0kB" if meta.get("bytes") is not None else ""
    fmt, bits = meta.get("format"), meta.get("bits")
    if fmt == "opus":
        rate = (f", {meta['bytes'] * 8 / meta['seconds'] / 1000:.0f} kbit/s" if meta.get("seconds") else "")
        what = f"Opus, lossy{rate}"
    elif fmt == "flac":
        what = f"FLAC {bits}-bit, " + ("the samples exactly" if meta.get("exact") else
                                        f"the float32 samples to {fmt_num(STEP_24 * meta.get('scale', 1))}")
    else:
        what = f"WAV{f' {bits}-bit' if bits else ''} as in MLflow"
    return " · ".join(x for x in (what, size) if x)


def players(run, seg: dict, ctx: Context) -> list[dict]:
    """The segment's audio players: what each is, its file on the site (loaded when played), how it
    is stored, and its float32 original in MLflow."""
    stored = (run.media.get(seg["id"]) or {}).get("audio") or {}
    titles = {role: title for role, title, _ in SEGMENT_ROLES}
    out = []
    for role, title, what in SEGMENT_ROLES:
        meta = stored.get(role)
        if not meta:
            continue
        if role == "cross_donor" and seg.get("donor_kind") == "length":
            continue  # the donor lent only its length: a decode with its reference codes shows nothing of it
        if role == "cross_donor" and seg.get("donor"):
            what = what.replace("the donor's", f"{seg['donor']}'s")
        notes = []
        if meta.get("same_as"):
            notes.append(f"the same samples as the {titles.get(meta['same_as'], meta['same_as'])}")
        if (meta.get("scale") or 1) > 1:
            notes.append(f"stored at 1/{meta['scale']} of its level: its peak, {fmt_num(meta.get('peak'))}, "
                         f"is beyond full scale")
        original = (mlflow_url(ctx, run.experiment_id, run.run_id) + "/artifactPath/"
                    + href(*meta["artifact"].split("/"))) if meta.get("artifact") else None
        out.append({"role": role, "title": title, "what": what, "src": href(*meta["src"].split("/")),
                    "format": meta.get("format"), "label": audio_label(meta), "notes": notes, "original": original})
    return out


def listen_note(shown: list[dict]) -> list[str]:
    """What the Listen section says about the files: lossless to what, or lossy."""
    formats = {p["format"] for p in shown}
    lines = ["Each file loads when it is played."]
    if "flac" in formats:
        lines.append(f"FLAC is lossless: 24-bit FLAC holds MLflow's float32 samples to within {fmt_num(STEP_24)} "
                     f"(2⁻²³, its step), 16-bit FLAC exactly the samples of audio that was 16-bit PCM already.")
    if "opus" in formats:
        lines.append("Opus copies are lossy: to listen to; for the samples take the float32 originals (or build "
                     "the site with --audio flac for lossless copies).")
    lines.append("The float32 originals are in MLflow: a link under each player.")
    return lines


def segment_page(run, index: int, seg: dict, ctx: Context) -> str:
    root = "../../"
    media = run.media.get(seg["id"]) or {}
    frame = seg.get("first_divergent_frame")
    shown = players(run, seg, ctx)
    facts = [("first divergent chunk", seg.get("first_divergent_chunk")),
             ("first divergent frame", None if frame is None else f"{frame} ({frame * 0.08:.2f} s)"),
             ("stage", seg.get("stage")), ("donor", donor_text(seg)), ("error kind", seg.get("error_kind")),
             ("notes", "; ".join(seg.get("notes") or []))]
    crumbs = [("runs", f"{root}index.html"), section_crumb(run, root),
              (run.version, "index.html"), (seg["id"], None)]
    return _render("segment.html", ctx=ctx, root=root, title=f"{seg['id']}: {seg.get('verdict')} ({run.version})",
                   crumbs=crumbs, run=run, seg=seg, failing=seg["id"] in set(run.failing), facts=facts,
                   players=shown, listen=listen_note(shown), chunks=per_chunk(seg),
                   close=model.close_logmel(run.report),
                   specdiff=href(*media["specdiff"].split("/")) if media.get("specdiff") else None,
                   picture=media.get("picture") or {},
                   specdiff_original=mlflow_url(ctx, run.experiment_id, run.run_id) + "/artifactPath/specdiff/"
                   + href(f"{safe_name(seg['id'])}.png"),
                   repro=_repro_links(media.get("repro")),
                   codes=codes_at_divergence(seg), codes_note=codes_agree_note(seg), donor=donor(run, seg),
                   nulls=segment_null(run.report, seg["id"]),
                   tie=((seg.get("comparisons") or {}).get("near_tie") or {}).get("null_n"),
                   forced=forced_plot(seg, ((run.report.get("policy") or {}).get("forced") or {}).get("max_gap")),
                   ml=mlflow_url(ctx, run.experiment_id, run.run_id),
                   ml_child=mlflow_url(ctx, run.experiment_id, run.children[seg["id"]])
                   if seg["id"] in run.children else None)


# -- a bisect -------------------------------------------------------------------------------------------
def _bisect_status(b) -> str:
    return b.tags.get("bisect.status") or b.status.lower()


def _bisect_subject(b) -> str:
    culprit = b.culprit
    decisions = (b.state or {}).get("decisions") or {}
    return b.tags.get("bisect.first_bad_subject") or (decisions.get(culprit) or {}).get("subject") or next(
        (p.tag("bisect.subject") for p in b.probes if p.commit == culprit), "")


def commit_line(b) -> list[dict]:
    """Every commit of the range, good end to bad end, with what the bisect decided about it."""
    decisions = (b.state or {}).get("decisions") or {}
    by_commit: dict[str, list] = {}
    for p in b.probes:
        by_commit.setdefault(p.commit, []).append(p)
    out = []
    for sha in (b.state or {}).get("commits") or list(dict.fromkeys(p.commit for p in b.probes)):
        ps = by_commit.get(sha) or []
        decision = (ps[0].tag("bisect.decision") if ps else "") or (decisions.get(sha) or {}).get("decision", "")
        subject = (decisions.get(sha) or {}).get("subject") or (ps[0].tag("bisect.subject") if ps else "")
        out.append({"sha": sha, "decision": decision, "subject": subject,
                    "classes": " ".join(x for x in (decision, "culprit" if sha == b.culprit else "") if x)})
    return out


def bisect_page(b, ctx: Context) -> str:
    root = "../"
    t = b.tags
    culprit = b.culprit
    heading = (f"bisect {short(t['bisect.good'])} .. {short(t.get('bisect.bad'))}" if t.get("bisect.good")
               else b.name)  # `git bisect run difftest probe` records no ends
    facts = [("repository", t.get("bisect.repo")), ("good end", t.get("bisect.good")), ("bad end", t.get("bisect.bad")),
             ("commits", t.get("bisect.commits")), ("mode", t.get("bisect.mode")),
             ("recipe", t.get("bisect.recipe.name") or t.get("bisect.recipe")),
             ("probes", fmt_num(b.metrics.get("probes"))), ("runs", fmt_num(b.metrics.get("runs"))),
             ("skipped", fmt_num(b.metrics.get("skipped"))), ("MLflow status", b.status), ("MLflow run", b.run_id)]
    status = _bisect_status(b)
    crumbs = [("runs", f"{root}index.html"), ("bisects", f"{root}index.html#bisects"), (b.name, None)]
    return _render("bisect.html", ctx=ctx, root=root, title=f"{b.name}: {status}", crumbs=crumbs, b=b, tags=t,
                   heading=heading, status=status, culprit=culprit, subject=_bisect_subject(b),
                   condemned=sorted({p.tag("bisect.condemned") for p in b.probes if p.commit == culprit} - {""}),
                   line=commit_line(b), facts=facts, ml=mlflow_url(ctx, b.experiment_id, b.run_id),
                   probes=[(p, mlflow_url(ctx, b.experiment_id, p.run_id)) for p in b.probes])
