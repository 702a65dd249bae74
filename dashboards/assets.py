"""The site's one stylesheet (no fonts, scripts or images from elsewhere: the viewer may have no
internet either). Kept as a Python string so that it ships with the package as is.

The heatmap switches views without JavaScript: a radio input per view precedes the table, and
`#view-X:checked ~ .heat .cell.X3` picks the colours of view X from each cell's classes.
"""

from difftest.compare.chunks import TIERS
from difftest.verdicts.catalogue import COLOURS

VERDICT_COLOURS = COLOURS
RUN_COLOURS = {"pass": "#2e7d32", "fail": "#c62828", "error": "#37474f"}
TIER_COLOURS = ("#2e7d32", "#9ccc65", "#ffd54f", "#d32f2f")  # identical, within_quantisation, close, diverged
LOGMEL_COLOURS = ("#2e7d32", "#a5d6a7", "#e6ee9c", "#fff176", "#ffb74d", "#f4511e", "#b71c1c")
CODES_COLOURS = {"0": "#2e7d32", "2": "#ffb74d", "3": "#d32f2f"}
MISSING = "repeating-linear-gradient(45deg,#eceff1 0 3px,#fff 3px 6px)"

# view id -> (cell class prefix, label)
VIEWS = (("worst", "w", "worst tier"), ("logmel", "l", "log-mel distance"), ("codes", "k", "codes"),
         ("audio", "a", "vs reference"), ("concurrency", "c", "N vs 1"), ("vocoder", "v", "vocoder"))

BASE_CSS = """
:root { --fg:#1c2430; --muted:#5f6b7a; --line:#dde3ea; --bg:#f6f8fa; --card:#fff; --link:#1565c0; }
* { box-sizing: border-box; }
body { margin:0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color:var(--fg); background:var(--bg); }
a { color:var(--link); text-decoration:none; } a:hover { text-decoration:underline; }
header.top { display:flex; gap:16px; align-items:baseline; padding:10px 24px; background:#17212b; color:#e8eef4; }
header.top a { color:#fff; } header.top .brand { font-weight:700; letter-spacing:.3px; }
header.top nav { flex:1; color:#aab7c4; } header.top nav a { color:#cfe3f7; }
header.top .built { color:#8fa0b2; font-size:12px; }
main { padding:18px 24px 40px; max-width:1600px; }
h1 { font-size:22px; margin:4px 0 6px; display:flex; gap:12px; align-items:center; flex-wrap:wrap; }
h2 { font-size:17px; margin:26px 0 8px; padding-bottom:4px; border-bottom:1px solid var(--line); }
h3 { font-size:15px; margin:18px 0 6px; }
.sub { color:var(--muted); margin:0 0 12px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:12px 14px; margin:10px 0; }
.notes { background:#fff8e1; border-color:#ffe082; }
table { border-collapse:collapse; background:var(--card); }
table.grid { width:100%; border:1px solid var(--line); border-radius:8px; overflow:hidden; }
table.grid th, table.grid td { padding:6px 9px; border-bottom:1px solid var(--line); text-align:left; vertical-align:top; }
table.grid thead th { background:#eef2f6; font-weight:600; font-size:12px; color:#3b4756; white-space:nowrap; }
table.grid tbody tr:hover { background:#f3f8fe; }
td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
.mono, code { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; font-size:12.5px; }
.muted { color:var(--muted); } .small { font-size:12px; } .nowrap { white-space:nowrap; }
.badge { display:inline-block; padding:1px 8px; border-radius:10px; color:#fff; font-size:12px; font-weight:600;
         white-space:nowrap; line-height:18px; }
.badge.big { font-size:15px; padding:3px 14px; border-radius:14px; }
.badge.outline { background:#fff !important; border:1.5px solid currentColor; }
.chg-regressed { color:#c62828; font-weight:700; } .chg-fixed { color:#2e7d32; font-weight:700; }
.mix { display:flex; width:140px; height:12px; border-radius:3px; overflow:hidden; background:#eceff1; }
.mix span { display:block; height:100%; }
.bar { display:inline-block; height:8px; border-radius:2px; vertical-align:middle; margin-right:6px; }
dl.facts { display:grid; grid-template-columns: repeat(auto-fill, minmax(240px, 1fr)); gap:4px 18px; margin:0; }
dl.facts div { min-width:0; }
dl.facts dt { font-size:11px; color:var(--muted); text-transform:uppercase; letter-spacing:.4px; }
dl.facts dd { margin:0; overflow-wrap:anywhere; }
.stats { display:flex; gap:12px; flex-wrap:wrap; margin:10px 0; }
.stat { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:8px 14px; min-width:150px; }
.stat b { display:block; font-size:20px; } .stat span { color:var(--muted); font-size:12px; }
.stat.bad b { color:#c62828; } .stat.good b { color:#2e7d32; }
.matrix td, table.controls td { text-align:center; } .matrix td.ver, table.controls td.ver { text-align:left; }
table.matrix { margin-bottom:12px; }
table.matrix caption { text-align:left; font-weight:600; padding:6px 2px 4px; }
p.toc { margin:-6px 0 12px; }
/* negative controls: the CPU test engine, kept apart from vLLM-Omni */
section.negative { margin-top:30px; padding:2px 16px 14px; border:1px dashed #90a4ae; border-radius:10px;
                   background:#eef1f4; }
table.controls { margin-bottom:12px; }
.ctl-ok { color:#2e7d32; } .ctl-bad { color:#c62828; }
.where li { margin:0 0 3px; } ul.where { margin:0; padding-left:0; list-style:none; }
a.mlflow { white-space:nowrap; }
figure.trend { margin:6px 0 10px; } figure.trend figcaption { font-size:12px; color:var(--muted); margin-top:2px; }
svg.trend { background:var(--card); border:1px solid var(--line); border-radius:8px; display:block; }
.tablewrap { overflow-x:auto; }
td.wherecol { min-width:260px; max-width:460px; }
.matrix td, table.controls td { min-width:170px; }
table.perchunk td.num { min-width:64px; }
svg.trend text { font: 11px system-ui, sans-serif; fill:#5f6b7a; }
/* heatmap */
.views { margin:8px 0 4px; display:flex; gap:6px; flex-wrap:wrap; align-items:center; }
.heatmap > input { position:absolute; opacity:0; pointer-events:none; }
.views label { padding:3px 10px; border:1px solid var(--line); border-radius:14px; background:#fff; cursor:pointer;
               font-size:12.5px; }
.heatwrap { overflow-x:auto; background:var(--card); border:1px solid var(--line); border-radius:8px; padding:8px; }
table.heat { border-collapse:separate; border-spacing:2px; }
table.heat th { font-weight:500; font-size:12px; white-space:nowrap; padding:0 8px 0 2px; text-align:left;
                max-width:260px; overflow:hidden; text-overflow:ellipsis; }
table.heat thead th { font-size:10.5px; color:var(--muted); text-align:center; padding:0; }
table.heat thead th.lab { text-align:left; padding:0 8px 0 2px; }
table.heat td.cell { width:22px; min-width:22px; height:20px; border-radius:3px; background:#eceff1; }
table.heat td.cell.onset { box-shadow: inset 0 0 0 2px #000; }
table.heat td.pad { background:none; }
table.heat td.summ { font-size:12px; color:var(--muted); padding-left:10px; white-space:nowrap; max-width:520px;
                     overflow:hidden; text-overflow:ellipsis; }
.legend { display:none; gap:10px; align-items:center; flex-wrap:wrap; font-size:12px; color:var(--muted); margin:6px 0; }
.legend i { display:inline-block; width:14px; height:14px; border-radius:3px; vertical-align:-3px; margin-right:4px; }
/* segment page */
.players { display:grid; grid-template-columns: repeat(auto-fill, minmax(330px, 1fr)); gap:10px; }
.player { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:8px 10px; }
.player h4 { margin:0 0 2px; font-size:13px; } .player p { margin:0 0 6px; font-size:12px; color:var(--muted); }
.player audio { width:100%; height:36px; }
.player p.codec { margin:4px 0 0; font-size:11.5px; }
img.specdiff { max-width:100%; border:1px solid var(--line); border-radius:8px; background:#fff; }
table.codes td, table.codes th { padding:3px 6px; text-align:center; border:1px solid var(--line); font-size:12.5px; }
table.codes td.diff { background:#ffcdd2; font-weight:700; }
table.codes th.side { text-align:left; }
blockquote.text { margin:6px 0; padding:6px 12px; border-left:4px solid #90a4ae; background:#fff; }
/* bisect */
.line { display:flex; gap:3px; flex-wrap:wrap; margin:8px 0; }
.line a, .line span { display:inline-block; min-width:64px; padding:3px 6px; border-radius:4px; font-size:11.5px;
                      text-align:center; border:1px solid var(--line); background:#fff; color:var(--fg); }
.line .good { background:#c8e6c9; border-color:#81c784; } .line .bad { background:#ffcdd2; border-color:#e57373; }
.line .skip { background:#eceff1; border-color:#b0bec5; } .line .culprit { box-shadow: 0 0 0 2px #b71c1c; font-weight:700; }
tr.culprit td { background:#ffebee; }
"""


def _rules() -> str:
    out = []
    for v, c in VERDICT_COLOURS.items():
        out.append(f".badge.v-{v} {{ background:{c}; }} .badge.outline.v-{v} {{ color:{c}; }} "
                   f".mix .v-{v} {{ background:{c}; }}")
    for v, c in RUN_COLOURS.items():
        out.append(f".badge.r-{v} {{ background:{c}; }} .badge.outline.r-{v} {{ color:{c}; }}")
    out.append(".badge.r-unknown, .badge.v-unknown { background:#78909c; }")
    # the heatmap's views: colours by class, one block per view; legends shown with their view
    for view, prefix, _ in VIEWS:
        sel = f"#view-{view}:checked ~ .heatwrap .cell"
        if prefix == "l":
            colours = dict(enumerate(LOGMEL_COLOURS))
        elif prefix == "k":
            colours = {int(k): c for k, c in CODES_COLOURS.items()}
        else:
            colours = dict(enumerate(TIER_COLOURS))
        for i, c in colours.items():
            out.append(f"{sel}.{prefix}{i} {{ background:{c}; }}")
        out.append(f"{sel}.{prefix}x {{ background:{MISSING}; }}")
        out.append(f"#view-{view}:checked ~ .legend-{view} {{ display:flex; }}")
        out.append(f"#view-{view}:checked ~ .views label[for=view-{view}] {{ background:#17212b; color:#fff; "
                   f"border-color:#17212b; }}")
    for i, c in enumerate(TIER_COLOURS):
        out.append(f".legend i.t{i} {{ background:{c}; }}")
    for i, c in enumerate(LOGMEL_COLOURS):
        out.append(f".legend i.l{i} {{ background:{c}; }}")
    for k, c in CODES_COLOURS.items():
        out.append(f".legend i.k{k} {{ background:{c}; }}")
    out.append(f".legend i.x {{ background:{MISSING}; border:1px solid #cfd8dc; }}")
    return "\n".join(out)


def stylesheet() -> str:
    assert len(TIER_COLOURS) == len(TIERS)
    return BASE_CSS + _rules() + "\n"
