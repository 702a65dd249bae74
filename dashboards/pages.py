"""The dashboard's pages as HTML strings. Every value from MLflow or a report passes through
html.esc (via render/join); links are relative, so the site opens from file://."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field

from difftest.mlflow_records import donor_text
from difftest.policy import TIERS, VERDICTS
from difftest.segment_media import safe_name
from . import model
from .assets import VERDICT_COLOURS, VIEWS
from .html import Markup, esc, fmt_num, fmt_pct, href, join, render

SEGMENT_ROLES = (  # audio role -> (title, what it is)
    ("reference", "reference", "qwen-tts at concurrency 1"),
    ("candidate", "candidate", "the candidate at concurrency N"),
    ("cross_own", "cross-decoded (own)", "the reference vocoder on the candidate's codes and its own reference "
                                         "codes: what the candidate should sound like"),
    ("cross_donor", "cross-decoded (donor)", "the reference vocoder on the candidate's codes with the donor's "
                                             "reference codes: what a leak from the donor sounds like"),
    ("control", "candidate at concurrency 1", "the same candidate alone"),
    ("difference", "difference", "candidate minus reference, sample by sample"),
)


@dataclass
class Context:
    ui_url: str
    uri: str
    built: str
    title: str = "difftest dashboard"
    changes: dict = field(default_factory=dict)  # run id -> model.Change
    runs: dict = field(default_factory=dict)  # run id -> gather.Run


# -- small pieces ---------------------------------------------------------------------------------------
def when(ms: int) -> str:
    if not ms:
        return "–"
    return _dt.datetime.fromtimestamp(ms / 1000, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def short(sha: str | None, n: int = 10) -> str:
    return (sha or "")[:n]


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


def verdict_badge(v: str | None, *, big: bool = False, outline: bool = False) -> Markup:
    cls = f"v-{v}" if v in VERDICT_COLOURS else "v-unknown"
    return render('<span class="badge {cls}{big}{out}">{v}</span>', cls=cls, big=" big" if big else "",
                  out=" outline" if outline else "", v=v or "?")


def run_badge(v: str | None, *, big: bool = False) -> Markup:
    cls = f"r-{v}" if v in ("pass", "fail", "error") else "r-unknown"
    return render('<span class="badge {cls}{big}">{v}</span>', cls=cls, big=" big" if big else "",
                  v=(v or "?").upper())


def decision_badge(d: str | None) -> Markup:
    cls = {"good": "r-pass", "bad": "r-fail", "skip": "r-unknown"}.get(d or "", "r-unknown")
    return render('<span class="badge {cls}">{d}</span>', cls=cls, d=d or "?")


def mlflow_url(ctx: Context, exp_id: str, run_id: str) -> str:
    return f"{ctx.ui_url.rstrip('/')}/#/experiments/{href(str(exp_id))}/runs/{href(str(run_id))}"


def mlflow_link(ctx: Context, exp_id: str, run_id: str, text: str = "MLflow ↗") -> Markup:
    return render('<a class="mlflow" href="{u}" title="open this run in the MLflow UI">{t}</a>',
                  u=mlflow_url(ctx, exp_id, run_id), t=text)


def mix_bar(counts: dict, total: int) -> Markup:
    if not total:
        return Markup('<div class="mix"></div>')
    parts = [render('<span class="v-{v}" style="width:{w}%" title="{n} {v}"></span>', v=v, n=counts[v],
                    w=Markup(f"{100 * counts[v] / total:.2f}"))
             for v in VERDICTS if counts.get(v)]
    title = ", ".join(f"{counts[v]} {v}" for v in VERDICTS if counts.get(v))
    return render('<div class="mix" title="{t}">{p}</div>', t=title, p=join(parts))


def page(title: str, root: str, crumbs: list, body: Markup, ctx: Context) -> str:
    nav = join((render('<a href="{h}">{t}</a>', h=h, t=t) if h else esc(t) for t, h in crumbs), Markup(" › "))
    return render(
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<title>{title}</title><link rel="stylesheet" href="{root}assets/style.css"></head>\n'
        '<body><header class="top"><a class="brand" href="{root}index.html">{brand}</a><nav>{nav}</nav>'
        '<span class="built">built {built}</span></header>\n<main>{body}</main></body></html>\n',
        title=title, root=root, brand=ctx.title, nav=nav, built=ctx.built, body=body)


def where_line(run, seg: dict, root: str = "") -> Markup:
    """`s0 contamination · chunk 0 · handoff · donor s2`, the id linked to its page."""
    link = segment_href(run, seg["id"], root)
    name = render('<a href="{h}">{i}</a>', h=link, i=seg["id"]) if link else esc(seg["id"])
    bits = []
    if seg.get("first_divergent_chunk") is not None:
        bits.append(f"chunk {seg['first_divergent_chunk']}")
    if seg.get("stage"):
        bits.append(seg["stage"])
    if seg.get("donor"):
        bits.append(f"donor {donor_text(seg)}")
    return render('{n} {b} <span class="muted small">{w}</span>', n=name, b=verdict_badge(seg.get("verdict")),
                  w=" · ".join(bits))


# -- the index ------------------------------------------------------------------------------------------
def trend_svg(runs: list, ctx: Context) -> Markup:
    """Diverged and failing share of segments per run, oldest to newest; dots coloured by verdict."""
    n = len(runs)
    step, left, top, height = 64, 46, 14, 96
    width = max(460, left + step * max(n, 1) + 20)
    total_h = top + height + 30

    def y(v):
        return top + (1 - (v or 0)) * height

    parts = []
    for frac in (0, 0.5, 1):
        parts.append(render('<line x1="{a}" x2="{b}" y1="{y}" y2="{y}" stroke="#e3e8ee"/>'
                            '<text x="{t}" y="{ty}" text-anchor="end">{l}</text>',
                            a=left, b=width - 10, y=f"{y(frac):.1f}", t=left - 6, ty=f"{y(frac) + 4:.1f}",
                            l=f"{frac:.0%}"))
    xs = [left + step * i + step / 2 for i in range(n)]
    stats = [model.run_stats(r.report) for r in runs]
    for attr, colour, dash in (("diverged_rate", "#ef6c00", ""), ("failing_rate", "#c62828", "4 3")):
        pts = " ".join(f"{x:.1f},{y(getattr(s, attr)):.1f}" for x, s in zip(xs, stats))
        parts.append(render('<polyline points="{p}" fill="none" stroke="{c}" stroke-width="2" '
                            'stroke-dasharray="{d}"/>', p=pts, c=colour, d=dash))
    for x, r, s in zip(xs, runs, stats):
        colour = {"pass": "#2e7d32", "fail": "#c62828"}.get(r.verdict, "#37474f")
        label = r.version if len(r.version) <= 9 else r.version[:8] + "…"
        tip = (f"{r.version} · {r.verdict} · {when(r.start_ms)} · diverged {fmt_pct(s.diverged_rate)} · "
               f"failing {fmt_pct(s.failing_rate)}")
        parts.append(render(
            '<a href="{h}"><circle cx="{x}" cy="{cy}" r="6" fill="{c}" stroke="#fff" stroke-width="1.5">'
            '<title>{tip}</title></circle><text x="{x}" y="{ly}" text-anchor="middle">{lab}</text></a>',
            h=run_href(r.run_id), x=f"{x:.1f}", cy=f"{y(s.failing_rate):.1f}", c=colour, tip=tip,
            ly=top + height + 18, lab=label))
    return render('<figure class="trend"><svg class="trend" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
                  'aria-label="divergence over time">{p}</svg><figcaption><span style="color:#ef6c00">━ diverged'
                  '</span> <span style="color:#c62828">┅ failing</span> share of segments, oldest run to newest; '
                  'a dot is a run (green pass, red fail), on its failing share</figcaption></figure>',
                  w=width, h=total_h, p=join(parts))


def version_matrix(runs: list, ctx: Context) -> Markup:
    """Versions (newest first) × suites: the latest run of each version on each suite."""
    suites = sorted({r.experiment for r in runs})
    latest: dict[tuple, object] = {}
    newest: dict[str, int] = {}
    for r in runs:  # runs are oldest first: the last one wins
        latest[(r.version, r.experiment)] = r
        newest[r.version] = max(newest.get(r.version, 0), r.start_ms)
    versions = sorted(newest, key=lambda v: -newest[v])
    head = join(render('<th>{s}</th>', s=s.removeprefix("difftest/")) for s in suites)
    rows = []
    for v in versions:
        cells = []
        for s in suites:
            r = latest.get((v, s))
            if r is None:
                cells.append(Markup('<td class="muted">·</td>'))
                continue
            st = model.run_stats(r.report)
            ch = ctx.changes.get(r.run_id)
            mark = render(' <span class="chg-{k}" title="{t}">{a}</span>', k=ch.kind,
                          t=f"{ch.kind} against the run before it", a="▲ regressed" if ch.kind == "regressed"
                          else "✓ fixed") if ch and ch.kind else Markup("")
            cells.append(render('<td><a href="{h}">{b}</a> <span class="small muted">{f}/{n} failing</span>{m}</td>',
                                h=run_href(r.run_id), b=run_badge(r.verdict), f=st.failing, n=st.segments, m=mark))
        labels = sorted({r.tags.get("candidate.label", "") for r in runs if r.version == v} - {"", v})
        rows.append(render('<tr><td class="ver"><b>{v}</b> <span class="small muted">{l}</span><br>'
                           '<span class="small muted">{w}</span></td>{c}</tr>',
                           v=v, l=", ".join(labels), w=when(newest[v]), c=join(cells)))
    return render('<table class="grid matrix" style="width:auto"><thead><tr><th>version (newest first)</th>{h}</tr></thead>'
                  '<tbody>{r}</tbody></table>', h=head, r=join(rows))


def where_groups(run, root: str = "", limit: int = 3) -> Markup:
    """The failing segments (else the diverged ones) grouped by what went wrong and where:
    `contamination ×2 · chunk 0 · handoff · donor s2: s0, s1`, most serious first."""
    segs = run.report.get("segments") or []
    failing = set(run.failing)
    shown = [s for s in segs if s["id"] in failing] or [s for s in segs if s.get("verdict") not in model.CLEAN]
    groups: dict[tuple, list] = {}
    for s in shown:
        key = (s.get("verdict"), s.get("first_divergent_chunk"), s.get("stage"), donor_text(s))
        groups.setdefault(key, []).append(s)
    rank = {v: i for i, v in enumerate(("error", "contamination", "vocoder_defect", "concurrency_defect",
                                        "length_mismatch", "code_divergence", "audio_divergence"))}
    ordered = sorted(groups.items(), key=lambda kv: (rank.get(kv[0][0], 99), -len(kv[1])))
    items = []
    for (verdict, chunk, stage, donor), members in ordered[:limit]:
        bits = [f"chunk {chunk}" if chunk is not None else "", stage or "", f"donor {donor}" if donor else ""]
        links = join((render('<a href="{h}" title="{i}">{t}</a>', h=segment_href(run, m["id"], root), i=m["id"],
                             t=m["id"] if len(m["id"]) <= 24 else m["id"][:23] + "…")
                      for m in members[:4]), Markup(", "))
        more = render(" +{n}", n=len(members) - 4) if len(members) > 4 else ""
        items.append(render('<li>{b}{n} <span class="muted small">{w}</span> <span class="small">{l}{m}</span></li>',
                            b=verdict_badge(verdict), n=f" ×{len(members)}" if len(members) > 1 else "",
                            w=" · ".join(b for b in bits if b), l=links, m=more))
    if len(ordered) > limit:
        items.append(render('<li class="muted small">+{n} more kinds</li>', n=len(ordered) - limit))
    return render('<ul class="where">{i}</ul>', i=join(items)) if items else Markup('<span class="muted">–</span>')


def runs_table(runs: list, ctx: Context) -> Markup:
    rows = []
    for r in sorted(runs, key=lambda r: (-r.start_ms, r.run_id)):
        st = model.run_stats(r.report)
        ch = ctx.changes.get(r.run_id)
        change = Markup("")
        if ch and ch.kind:
            change = render('<div class="chg-{k} small">{a}</div>', k=ch.kind,
                            a="▲ regressed" if ch.kind == "regressed" else "✓ fixed")
        if ch and ch.previous and ch.new_failures:
            names = [x if len(x) <= 16 else x[:15] + "…" for x in ch.new_failures[:3]]
            change = join([change, render('<div class="small muted" title="{all}">new: {n}{more}</div>',
                                          all=", ".join(ch.new_failures), n=", ".join(names),
                                          more=f" +{len(ch.new_failures) - 3}" if len(ch.new_failures) > 3 else "")])
        onset = (render('{v}<div class="muted small">{s}</div>', v=fmt_num(st.chunk0_logmel),
                        s=st.chunk0_worst_segment if st.chunk0_logmel else "") if st.chunk0_logmel is not None else "–")
        label = r.tags.get("candidate.label", "")
        facts = [x for x in (label if label != r.version else "", short(r.tags.get("candidate.commit")), r.device,
                             f"c={r.tags['concurrency']}" if r.tags.get("concurrency") else "") if x]
        rows.append(render(
            '<tr data-run="{rid}"><td class="nowrap small">{when}</td>'
            '<td><a href="{h}"><b>{ver}</b></a><div class="small muted">{facts}</div></td>'
            '<td>{badge}{change}</td><td>{mix}<div class="small muted">{n} segments</div></td>'
            '<td class="num">{div}</td><td class="num">{fail}</td><td class="num">{onset}</td>'
            '<td class="wherecol">{where}</td><td>{ml}</td></tr>',
            rid=r.run_id, when=when(r.start_ms), h=run_href(r.run_id), ver=r.version, facts=" · ".join(facts),
            badge=run_badge(r.verdict), change=change, n=st.segments, mix=mix_bar(st.counts, st.segments),
            div=fmt_pct(st.diverged_rate), fail=fmt_pct(st.failing_rate), onset=onset, where=where_groups(r),
            ml=mlflow_link(ctx, r.experiment_id, r.run_id)))
    return render(
        '<div class="tablewrap"><table class="grid runs"><thead><tr><th>when</th><th>version</th><th>verdict</th>'
        '<th>verdicts</th><th class="num" title="segments not identical and not numeric drift">diverged</th>'
        '<th class="num" title="segments whose verdict fails the run">failing</th>'
        '<th class="num" title="the worst log-mel distance any comparison measured on a chunk 0 (the onset)">'
        'chunk-0 log-mel</th><th>where it fails</th><th></th></tr></thead><tbody>{rows}</tbody></table></div>',
        rows=join(rows))


def bisects_table(bisects: list, ctx: Context, root: str = "") -> Markup:
    rows = []
    for b in sorted(bisects, key=lambda b: -b.start_ms):
        culprit = b.culprit
        subject = b.tags.get("bisect.first_bad_subject") or next(
            (p.tag("bisect.subject") for p in b.probes if p.commit == culprit), "")
        status = b.tags.get("bisect.status") or b.status.lower()
        rows.append(render(
            '<tr><td class="nowrap">{when}</td><td><a href="{h}">{name}</a></td><td>{suite}</td>'
            '<td class="mono small">{good} .. {bad}</td><td>{status}</td><td class="mono">{c}</td><td>{subj}</td>'
            '<td class="num">{n}</td><td>{ml}</td></tr>',
            when=when(b.start_ms), h=f"{root}bisects/{href(safe_name(b.run_id))}.html", name=b.name,
            suite=b.tags.get("suite.name", b.experiment), good=short(b.tags.get("bisect.good")),
            bad=short(b.tags.get("bisect.bad")), status=status, c=short(culprit), subj=subject,
            n=len({p.commit for p in b.probes}), ml=mlflow_link(ctx, b.experiment_id, b.run_id)))
    return render('<table class="grid"><thead><tr><th>started</th><th>bisect</th><th>suite</th><th>range</th>'
                  '<th>status</th><th>first bad commit</th><th>subject</th><th class="num">commits probed</th>'
                  '<th></th></tr></thead><tbody>{r}</tbody></table>', r=join(rows))


def index_page(store, ctx: Context) -> str:
    runs = store.runs
    body = [render('<h1>vLLM-Omni against qwen-tts</h1><p class="sub">{n} runs in {s} suites, {b} bisects · '
                   'MLflow store <code>{uri}</code> · <a href="{ui}">MLflow UI ↗</a></p>',
                   n=len(runs), s=len({r.experiment for r in runs}), b=len(store.bisects), uri=ctx.uri,
                   ui=ctx.ui_url)]
    if store.notes:
        body.append(render('<div class="card notes"><b>Notes</b><ul>{li}</ul></div>',
                           li=join(render("<li>{n}</li>", n=n) for n in store.notes)))
    if not runs and not store.bisects:
        body.append(Markup('<div class="card">Nothing logged yet: <code>difftest run</code> logs every run, '
                           '<code>difftest log OUT</code> uploads one later.</div>'))
    if runs:
        body.append(Markup('<h2 id="versions">Versions × suites</h2><p class="sub">The latest run of each version '
                           'on each suite; ▲ marks a run that fails where the run before it passed.</p>'))
        body.append(version_matrix(runs, ctx))
    for exp in sorted({r.experiment for r in runs}):
        mine = [r for r in runs if r.experiment == exp]
        body.append(render('<h2 id="suite-{a}">Suite {s} <span class="small muted">({n} runs; experiment {e})</span>'
                           '</h2>', a=safe_name(exp), s=mine[0].suite, n=len(mine), e=exp))
        body.append(trend_svg(mine, ctx))
        body.append(runs_table(mine, ctx))
    if store.bisects:
        body.append(Markup('<h2 id="bisects">Bisects</h2>'))
        body.append(bisects_table(store.bisects, ctx))
    return page(ctx.title, "", [("runs", None)], join(body), ctx)


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


def _legends(close: float, views: list) -> Markup:
    tiers = join(render('<span><i class="t{i}"></i>{t}</span>', i=i, t=t) for i, t in enumerate(TIERS))
    missing = Markup('<span><i class="x"></i>not measured</span><span><i style="box-shadow:inset 0 0 0 2px #000">'
                     '</i>first divergent chunk</span>')
    bounds = model.logmel_bounds(close)
    labels = ["0"] + [f"≤ {fmt_num(b, 2)}" for b in bounds] + [f"> {fmt_num(bounds[-1], 2)}"]
    logmel = join(render('<span><i class="l{i}"></i>{t}</span>', i=i, t=t) for i, t in enumerate(labels))
    codes = Markup('<span><i class="k0"></i>all frames agree</span><span><i class="k2"></i>≥ 50% agree</span>'
                   '<span><i class="k3"></i>&lt; 50% agree</span>')
    out = []
    for view, _, _ in views:
        if view == "logmel":
            body = join([logmel, Markup(f'<span>(mean log-mel distance; the policy\'s close_logmel is '
                                        f'{fmt_num(close, 2)})</span>'), missing])
        elif view == "codes":
            body = join([codes, missing])
        elif view == "worst":
            body = join([tiers, missing, Markup("<span>(the worst tier any comparison reached)</span>")])
        else:
            body = join([tiers, missing, render("<span>({t})</span>", t=model.COMPARISON_TITLES[view])])
        out.append(render('<div class="legend legend-{v}">{b}</div>', v=view, b=body))
    return join(out)


def heatmap(run, root_to_run: str = "") -> Markup:
    """Segments × chunks. One table; radio inputs before it pick which of each cell's classes colour it."""
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
    views = [v for v in VIEWS if v[0] in present]
    inputs = join(render('<input type="radio" name="view" id="view-{v}"{c}>', v=v, c=Markup(" checked") if i == 0
                         else Markup("")) for i, (v, _, _) in enumerate(views))
    labels = join(render('<label for="view-{v}">{l}</label>', v=v, l=l) for v, _, l in views)
    every = 1 if width <= 40 else 5
    head = join(render('<th>{i}</th>', i=i if i % every == 0 else "") for i in range(width))
    failing = set(run.failing)
    rows = []
    for s, cells in grid:
        onset = s.get("first_divergent_chunk") if s.get("verdict") not in model.CLEAN else None
        link = segment_href(run, s["id"], root_to_run)
        name = render('<a href="{h}">{i}</a>', h=link, i=s["id"]) if link else esc(s["id"])
        tds = join(render('<td class="cell {cls}" data-chunk="{i}" title="{t}"></td>',
                          cls=" ".join(_cell_classes(c, close) + (["onset"] if c.chunk == onset else [])),
                          i=c.chunk, t=_cell_title(s["id"], c)) for c in cells)
        pad = Markup('<td class="pad"></td>' * (width - len(cells)))
        if not cells:
            pad = Markup('<td class="pad muted small" colspan="{}">no per-chunk comparison</td>'.format(max(width, 1)))
        rows.append(render('<tr id="seg-{a}" data-segment="{sid}"><th title="{sid}">{name}{star}</th><td>{b}</td>{tds}{pad}'
                           '<td class="summ" title="{sm}">{sm}</td></tr>',
                           a=safe_name(s["id"]), sid=s["id"], name=name,
                           star=Markup(' <span title="fails the run" class="chg-regressed">●</span>')
                           if s["id"] in failing else Markup(""),
                           b=verdict_badge(s.get("verdict")), tds=tds, pad=pad, sm=s.get("summary", "")))
    table = render('<div class="heatwrap"><table class="heat"><thead><tr><th class="lab">segment</th>'
                   '<th class="lab">verdict</th>{h}'
                   '<th></th></tr><tr><th></th><th></th><th colspan="{w}" style="text-align:left">chunk →</th>'
                   '</tr></thead><tbody>{r}</tbody></table></div>',
                   h=head, w=max(width, 1), r=join(rows))
    return render('<div class="heatmap">{inputs}<div class="views"><span class="muted small">colour by</span>'
                  '{labels}</div>{legends}{table}</div>',
                  inputs=inputs, labels=labels, legends=_legends(close, views), table=table)


def _facts(items: list) -> Markup:
    return render('<dl class="facts">{d}</dl>', d=join(
        render("<div><dt>{k}</dt><dd>{v}</dd></div>", k=k, v=v) for k, v in items if v not in (None, "")))


def run_page(run, ctx: Context) -> str:
    root = "../../"
    rep = run.report
    st = model.run_stats(rep)
    t = run.tags
    ch = ctx.changes.get(run.run_id)
    body = [render('<h1>{ver} <span class="muted">on</span> {suite} {badge}</h1>'
                   '<p class="sub">{label} · concurrency {c} · {dev} · {when} · {ml}</p>',
                   ver=run.version, suite=run.suite, badge=run_badge(run.verdict, big=True),
                   label=t.get("candidate.label", ""), c=t.get("concurrency", "?"), dev=run.device or "?",
                   when=when(run.start_ms), ml=mlflow_link(ctx, run.experiment_id, run.run_id, "MLflow run ↗"))]
    if ch and ch.previous:
        prev = ctx.runs.get(ch.previous)
        pv = prev.version if prev else ch.previous
        what = {"regressed": "▲ regressed against", "fixed": "✓ fixed against"}.get(ch.kind, "against")
        body.append(render(
            '<div class="card"><span class="chg-{k}">{w}</span> the run before it, <a href="{h}">{pv}</a>'
            ' ({pw}). {nf}{gf}</div>', k=ch.kind or "none", w=what, h=f"../{href(safe_name(ch.previous))}/index.html",
            pv=pv, pw=prev.verdict if prev else "?",
            nf=render("Failing now, not then: <b>{x}</b>. ", x=", ".join(ch.new_failures)) if ch.new_failures else "",
            gf=render("Fixed since: {x}.", x=", ".join(ch.gone_failures)) if ch.gone_failures else ""))
    stat_cards = [
        ("segments", str(st.segments), ""),
        ("diverged", f"{st.diverged} ({fmt_pct(st.diverged_rate)})", "bad" if st.diverged else "good"),
        ("failing", f"{st.failing} ({fmt_pct(st.failing_rate)})", "bad" if st.failing else "good"),
        ("worst chunk-0 log-mel", fmt_num(st.chunk0_logmel) + (f" ({st.chunk0_worst_segment})"
                                                                if st.chunk0_logmel else ""), ""),
    ]
    one = rep.get("at_concurrency_1")
    if isinstance(one, dict) and one.get("verdict"):
        stat_cards.append(("candidate at concurrency 1 alone", one["verdict"],
                           "good" if one["verdict"] == "pass" else "bad"))
    body.append(render('<div class="stats">{c}</div>', c=join(
        render('<div class="stat {cls}"><b>{v}</b><span>{k}</span></div>', cls=c, v=v, k=k) for k, v, c in stat_cards)))
    body.append(render('<div class="card">{m} <span class="small muted">{c}</span></div>',
                       m=mix_bar(st.counts, st.segments),
                       c=", ".join(f"{n} {v}" for v, n in sorted(st.counts.items(), key=lambda x: -x[1]))))
    body.append(Markup('<h2>Segments × chunks</h2><p class="sub">One row per segment, one cell per chunk of the '
                       'candidate\'s streaming schedule; hover a cell for its numbers, click a segment for its '
                       'evidence.</p>'))
    body.append(heatmap(run))
    div = diverged_segments(rep)
    if div:
        rows = join(render(
            '<tr><td class="nowrap"><a href="{h}">{i}</a></td><td>{b}</td><td>{f}</td><td class="num">{c}</td><td class="num">{fr}</td>'
            '<td>{st}</td><td>{d}</td><td>{sm}</td><td>{ml}</td></tr>',
            h=href(segment_file(i, s["id"])), i=s["id"], b=verdict_badge(s.get("verdict")),
            f="fails" if s["id"] in set(run.failing) else "", c=s.get("first_divergent_chunk"),
            fr=s.get("first_divergent_frame"), st=s.get("stage") or "", d=donor_text(s),
            sm=s.get("summary", ""),
            ml=mlflow_link(ctx, run.experiment_id, run.children[s["id"]], "MLflow ↗") if s["id"] in run.children
            else "") for i, s in div)
        body.append(render('<h2>Diverged segments</h2><table class="grid"><thead><tr><th>segment</th><th>verdict</th>'
                           '<th></th><th class="num">chunk</th><th class="num">frame</th><th>stage</th><th>donor</th>'
                           '<th>summary</th><th></th></tr></thead><tbody>{r}</tbody></table>', r=rows))
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
    body.append(render('<h2>Provenance</h2><div class="card">{f}</div>', f=_facts(facts)))
    if rep.get("warnings"):
        body.append(render('<h2>Warnings</h2><ul>{w}</ul>', w=join(render("<li>{x}</li>", x=w) for w in rep["warnings"])))
    crumbs = [("runs", f"{root}index.html"), (run.suite, f"{root}index.html#suite-{safe_name(run.experiment)}"),
              (f"{run.version} ({when(run.start_ms)})", None)]
    return page(f"{run.version} on {run.suite}: {run.verdict}", root, crumbs, join(body), ctx)


# -- a diverged segment ---------------------------------------------------------------------------------
def _per_chunk_table(seg: dict, close: float) -> Markup:
    cells = model.segment_cells(seg)
    if not cells:
        return Markup('<p class="muted">No per-chunk comparison was made for this segment.</p>')
    comps = [c for c in (*model.CODE_COMPARISONS, *model.AUDIO_COMPARISONS)
             if any(c in x.tiers for x in cells)]
    onset = seg.get("first_divergent_chunk")
    head = join(render('<th class="{o}">{i}</th>', i=c.chunk, o="onset" if c.chunk == onset else "") for c in cells)
    rows = []
    for comp in comps:
        tds = []
        for c in cells:
            if comp not in c.tiers:
                tds.append(Markup('<td class="muted">·</td>'))
                continue
            tier = TIERS[c.tiers[comp]]
            if comp in model.CODE_COMPARISONS:
                txt, tip = fmt_pct(c.agreement.get(comp)), f"{fmt_pct(c.agreement.get(comp))} of frames agree"
            else:
                txt = fmt_num(c.logmel.get(comp), 2)
                tip = (f"{tier}; log-mel {fmt_num(c.logmel.get(comp))}, SNR {fmt_num(c.snr_db.get(comp))} dB, "
                       f"max |diff| {fmt_num(c.max_abs.get(comp))}")
            colour = ("#c8e6c9", "#dcedc8", "#fff9c4", "#ffcdd2")[c.tiers[comp]]
            tds.append(render('<td class="num" style="background:{bg}" title="{t}">{x}</td>', bg=colour, t=tip, x=txt))
        rows.append(render('<tr><th class="side">{t}</th>{d}</tr>', t=model.COMPARISON_TITLES[comp], d=join(tds)))
    return render('<table class="grid perchunk" style="width:auto"><thead><tr><th>chunk</th>{h}</tr></thead>'
                  '<tbody>{r}</tbody></table>'
                  '<p class="small muted">Audio rows: mean log-mel distance (cell colour: tier); code rows: share of '
                  'frames that agree. Close log-mel: ≤ {c}.</p>', h=head, r=join(rows), c=fmt_num(close, 2))


def _codes_block(seg: dict) -> Markup:
    comps = seg.get("comparisons") or {}
    shown = []
    for comp, sides in (("codes", ("reference", "candidate@N")), ("concurrency_codes", ("candidate@1", "candidate@N"))):
        body = comps.get(comp)
        if not isinstance(body, dict) or body.get("first_divergent_frame") is None:
            continue
        a, b = (list(body.get("codes_at_divergence") or []) + [None, None])[:2]
        frame = body["first_divergent_frame"]
        head = join(render("<th>{i}</th>", i=i) for i in range(16))

        def row(name, vec, other):
            if vec is None:
                return render('<tr><th class="side">{n}</th><td colspan="16" class="muted">no frame {f}: this side '
                              'ends before it</td></tr>', n=name, f=frame)
            return render('<tr><th class="side">{n}</th>{d}</tr>', n=name, d=join(
                render('<td class="{c}">{v}</td>', c="diff" if other is not None and i < len(other) and other[i] != v
                       else "", v=v) for i, v in enumerate(vec)))

        frames = body.get("frames") or ["?", "?"]
        shown.append(render(
            '<h3>{t}: frame {f} <span class="muted small">({s} s; {n} of the common frames differ; frames {fa} '
            'against {fb})</span></h3><table class="codes"><thead><tr><th class="side">codebook</th>{h}</tr></thead>'
            '<tbody>{ra}{rb}</tbody></table>',
            t=model.COMPARISON_TITLES[comp], f=frame, s=f"{frame * 0.08:.2f}", n=body.get("frames_differing", "?"),
            fa=frames[0], fb=frames[1], h=head, ra=row(sides[0], a, b), rb=row(sides[1], b, a)))
    if shown:
        return join(shown)
    rc = comps.get("ref_codes")
    codes = comps.get("codes")
    msg = "No codes were captured for this segment: the comparison is audio only."
    if isinstance(codes, dict):
        msg = f"The codes agree at every frame ({(codes.get('frames') or ['?'])[0]} frames)."
    extra = Markup("")
    if isinstance(rc, dict):
        resized = (f": its own, {rc['own_resized']} to that length"
                   + (f" ({' and '.join(rc['peers_of_that_length'])}'s)" if rc.get("peers_of_that_length") else "")
                   if rc.get("own_resized") else "")
        extra = render(' What differs is the <b>reference codes</b> handed to the vocoder: {c} frames{p} instead of '
                       'its own {o} (own: from the {src}){r}.', c=rc.get("candidate_frames"),
                       p=f" ({rc['matches_peer']}'s)" if rc.get("matches_peer") else "", o=rc.get("own_frames"),
                       src=rc.get("own_from", "?"), r=resized)
    return render('<p>{m}{e}</p>', m=msg, e=extra)


def _donor_block(run, seg: dict) -> Markup:
    donor = seg.get("donor")
    ds = (seg.get("comparisons") or {}).get("donor_search")
    parts = []
    if donor:
        link = segment_href(run, donor)
        anchor = f"index.html#seg-{safe_name(donor)}"
        what = ("its vocoder got its own reference codes, {v} to {d}'s length"
                if seg.get("donor_kind") == "length" else "this segment was decoded with {d}'s reference")
        parts.append(render('<p>Donor: <b><a href="{h}">{d}</a></b> — ' + what + '. {extra}</p>',
                            h=link.split("/")[-1] if link else anchor, d=donor,
                            v=((seg.get("comparisons") or {}).get("ref_codes") or {}).get("own_resized") or "resized",
                            extra=render("<q>{t}</q>", t=run.texts[donor]) if donor in run.texts else ""))
    if isinstance(ds, dict) and ds.get("peers_logmel"):
        rows = join(render('<tr class="{c}"><td>{p}</td><td class="num">{v}</td></tr>',
                           c="culprit" if p == donor and seg.get("donor_kind") != "length" else "", p=p,
                           v=fmt_num(v))
                    for p, v in sorted(ds["peers_logmel"].items(), key=lambda x: x[1]))
        parts.append(render('<table class="grid" style="width:auto"><thead><tr><th>decoded with the reference codes of'
                            '</th><th class="num">log-mel distance to the candidate</th></tr></thead><tbody>'
                            '<tr><td><i>its own</i></td><td class="num">{own}</td></tr>{r}</tbody></table>'
                            '<p class="small muted">over chunks {ch}; the lowest explains the candidate\'s audio.</p>',
                            own=fmt_num(ds.get("own_logmel")), r=rows, ch=", ".join(map(str, ds.get("chunks") or []))))
    if not parts:
        return Markup('<p class="muted">No donor: nothing points at another request.</p>')
    return join(parts)


def segment_page(run, index: int, seg: dict, ctx: Context) -> str:
    root = "../../"
    media = run.media.get(seg["id"]) or {}
    failing = seg["id"] in set(run.failing)
    frame = seg.get("first_divergent_frame")
    body = [render('<h1>{i} {b} {f}</h1><p class="sub">{ver} on {suite} · <a href="index.html#seg-{a}">the run</a>'
                   ' ({rv}) · {ml}{mlc}</p>',
                   i=seg["id"], b=verdict_badge(seg.get("verdict"), big=True),
                   f=Markup('<span class="badge r-fail">fails the run</span>') if failing else "",
                   ver=run.version, suite=run.suite, a=safe_name(seg["id"]), rv=run.verdict,
                   ml=mlflow_link(ctx, run.experiment_id, run.run_id, "MLflow: the run ↗"),
                   mlc=join([Markup(" · "), mlflow_link(ctx, run.experiment_id, run.children[seg["id"]],
                                                        "MLflow: this segment ↗")])
                   if seg["id"] in run.children else "")]
    if seg["id"] in run.texts:
        body.append(render('<blockquote class="text">{t}</blockquote>', t=run.texts[seg["id"]]))
    body.append(render('<div class="card"><p style="margin:0 0 8px"><b>{s}</b></p>{f}</div>', s=seg.get("summary", ""),
                       f=_facts([("first divergent chunk", seg.get("first_divergent_chunk")),
                                 ("first divergent frame", None if frame is None else f"{frame} ({frame * 0.08:.2f} s)"),
                                 ("stage", seg.get("stage")), ("donor", donor_text(seg)),
                                 ("error kind", seg.get("error_kind")),
                                 ("notes", "; ".join(seg.get("notes") or []))])))
    body.append(Markup("<h2>Listen</h2>"))
    players = []
    for role, title, what in SEGMENT_ROLES:
        path = (media.get("audio") or {}).get(role)
        if not path:
            continue
        if role == "cross_donor" and seg.get("donor_kind") == "length":
            continue  # the donor lent only its length: a decode with its reference codes shows nothing of it
        if role == "cross_donor" and seg.get("donor"):
            what = what.replace("the donor's", f"{seg['donor']}'s")
        players.append(render('<div class="player" data-role="{r}"><h4>{t}</h4><p>{w}</p>'
                              '<audio controls preload="metadata" src="{src}"></audio></div>',
                              r=role, t=title, w=what, src=href(*path.split("/"))))
    body.append(render('<div class="players">{p}</div>', p=join(players)) if players else
                Markup('<p class="muted">No audio was logged for this segment (its result files were not readable '
                       'when it was logged).</p>'))
    body.append(Markup("<h2>Where it parts</h2>"))
    body.append(_per_chunk_table(seg, model.close_logmel(run.report)))
    if media.get("specdiff"):
        body.append(render('<h3>Spectrogram difference</h3><img class="specdiff" alt="log-mel spectrograms of the '
                           'reference and the candidate and their difference" src="{s}">',
                           s=href(*media["specdiff"].split("/"))))
    body.append(Markup("<h2>Codes at the first divergent frame</h2>"))
    body.append(_codes_block(seg))
    body.append(Markup("<h2>Donor</h2>"))
    body.append(_donor_block(run, seg))
    crumbs = [("runs", f"{root}index.html"), (run.suite, f"{root}index.html#suite-{safe_name(run.experiment)}"),
              (run.version, "index.html"), (seg["id"], None)]
    return page(f"{seg['id']}: {seg.get('verdict')} ({run.version})", root, crumbs, join(body), ctx)


# -- a bisect -------------------------------------------------------------------------------------------
def bisect_page(b, ctx: Context) -> str:
    root = "../"
    t = b.tags
    culprit = b.culprit
    status = t.get("bisect.status") or b.status.lower()
    decisions = (b.state or {}).get("decisions") or {}
    subject = t.get("bisect.first_bad_subject") or (decisions.get(culprit) or {}).get("subject") or next(
        (p.tag("bisect.subject") for p in b.probes if p.commit == culprit), "")
    heading = (f"bisect {short(t['bisect.good'])} .. {short(t.get('bisect.bad'))}" if t.get("bisect.good")
               else b.name)  # `git bisect run difftest probe` records no ends
    body = [render('<h1>{head} <span class="badge {cls} big">{s}</span></h1>'
                   '<p class="sub">{suite} · {when} · {ml}</p>', head=heading, s=status,
                   cls="r-fail" if culprit else "r-unknown", suite=t.get("suite.name", b.experiment),
                   when=when(b.start_ms), ml=mlflow_link(ctx, b.experiment_id, b.run_id, "MLflow run ↗"))]
    if culprit:
        condemned = sorted({p.tag("bisect.condemned") for p in b.probes if p.commit == culprit} - {""})
        body.append(render('<div class="card" style="border-color:#e57373"><b>First bad commit</b>: '
                           '<span class="mono">{c}</span><br><b>{s}</b>{cond}</div>', c=culprit, s=subject,
                           cond=render('<div class="small">condemned by: {x}</div>', x=" | ".join(condemned))
                           if condemned else ""))
    elif t.get("bisect.suspects"):
        body.append(render('<div class="card notes">No single first bad commit; suspects: <span class="mono">{s}</span>'
                           '</div>', s=t["bisect.suspects"]))
    by_commit: dict[str, list] = {}
    for p in b.probes:
        by_commit.setdefault(p.commit, []).append(p)
    commits = (b.state or {}).get("commits") or list(dict.fromkeys(p.commit for p in b.probes))
    boxes = []
    for i, sha in enumerate(commits):
        ps = by_commit.get(sha) or []
        decision = (ps[0].tag("bisect.decision") if ps else "") or (decisions.get(sha) or {}).get("decision", "")
        subj = (decisions.get(sha) or {}).get("subject") or (ps[0].tag("bisect.subject") if ps else "")
        cls = " ".join(x for x in (decision, "culprit" if sha == culprit else "") if x)
        boxes.append(render('<span class="{c}" title="{t}">{i}. {s}</span>', c=cls,
                            t=f"{sha} {subj} ({decision or 'not probed'})", i=i, s=short(sha, 8)))
    body.append(render('<h2>The commit line</h2><p class="sub">Oldest (the good end) to newest (the bad end); '
                       'green good, red bad, grey skipped, white not probed; the first bad commit is ringed.</p>'
                       '<div class="line">{b}</div>', b=join(boxes)))
    rows = []
    for n, p in enumerate(b.probes, start=1):
        rows.append(render(
            '<tr class="{c}" data-commit="{sha}"><td class="num">{n}</td><td class="mono">{s}</td><td>{subj}</td>'
            '<td>{role}</td><td>{d}</td><td class="num">{rep}</td><td>{o}</td><td>{v}</td><td class="small">{why}</td>'
            '<td class="small">{cond}</td><td class="num">{sec}</td><td>{cul}</td><td>{ml}</td></tr>',
            c="culprit" if p.culprit else "", sha=p.commit, n=n, s=short(p.commit), subj=p.tag("bisect.subject"),
            role=p.tag("bisect.role"), d=decision_badge(p.tag("bisect.decision")), rep=p.tag("bisect.repeat"),
            o=p.tag("bisect.outcome"), v=p.tag("verdict"), why=p.tag("bisect.reason"), cond=p.tag("bisect.condemned"),
            sec=fmt_num(p.metrics.get("seconds"), 2), cul=Markup("<b>culprit</b>") if p.culprit else "",
            ml=mlflow_link(ctx, b.experiment_id, p.run_id)))
    body.append(render('<h2>Probes</h2><p class="sub">In the order they ran; one row per run of a probe.</p>'
                       '<table class="grid probes"><thead><tr><th class="num">#</th><th>commit</th><th>subject</th>'
                       '<th>role</th><th>decision</th><th class="num">run</th><th>this run</th><th>verdict</th>'
                       '<th>why</th><th>condemned by</th><th class="num">s</th><th></th><th></th></tr></thead>'
                       '<tbody>{r}</tbody></table>', r=join(rows)))
    facts = [("repository", t.get("bisect.repo")), ("good end", t.get("bisect.good")), ("bad end", t.get("bisect.bad")),
             ("commits", t.get("bisect.commits")), ("mode", t.get("bisect.mode")),
             ("recipe", t.get("bisect.recipe.name") or t.get("bisect.recipe")),
             ("probes", fmt_num(b.metrics.get("probes"))), ("runs", fmt_num(b.metrics.get("runs"))),
             ("skipped", fmt_num(b.metrics.get("skipped"))), ("MLflow status", b.status), ("MLflow run", b.run_id)]
    body.append(render('<h2>Details</h2><div class="card">{f}</div>', f=_facts(facts)))
    crumbs = [("runs", f"{root}index.html"), ("bisects", f"{root}index.html#bisects"), (b.name, None)]
    return page(f"{b.name}: {status}", root, crumbs, join(body), ctx)
