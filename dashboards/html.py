"""What the templates put into HTML besides escaped text: relative links and numbers as people read them.
(Escaping is Jinja2's autoescape: every template quotes its attribute values, and escaping covers
both quote characters, so data can end neither a text node nor an attribute.)"""

from __future__ import annotations

import math
import urllib.parse


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
