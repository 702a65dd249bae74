"""Building HTML safely: everything that comes from data is escaped unless it is Markup.

    render("<a href='{href}'>{text}</a>", href=url, text=segment_id)   # both escaped
    join(render("<td>{x}</td>", x=x) for x in row)                     # Markup stays Markup

The templates are literals in pages.py; only their {fields} are data. An attribute value is
always quoted in the templates, and escaping covers both quote characters, so data can end
neither a text node nor an attribute.
"""

from __future__ import annotations

import html as _html
import math
import urllib.parse
from typing import Iterable


class Markup(str):
    """A string that is already HTML."""

    def __html__(self) -> str:
        return str(self)


def esc(value) -> Markup:
    if isinstance(value, Markup):
        return value
    if value is None:
        return Markup("")
    return Markup(_html.escape(str(value), quote=True))


def render(template: str, **fields) -> Markup:
    return Markup(template.format(**{k: esc(v) for k, v in fields.items()}))


def join(parts: Iterable, sep: str = "") -> Markup:
    return Markup(esc(sep).join(esc(p) for p in parts))


def href(*segments: str) -> str:
    """A relative URL from path segments, each percent-encoded (a file name from data stays one segment)."""
    return "/".join(urllib.parse.quote(s, safe="") if s not in ("..", ".") else s for s in segments)


def fmt_num(x, digits: int = 3) -> str:
    if x is None:
        return "–"
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "∞" if v > 0 else "-∞"
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 10 ** -(digits):
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}"


def fmt_pct(x) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"
