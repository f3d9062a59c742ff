"""Small inline-SVG charts for the run report: no library, no script, nothing fetched, so the
page opens offline and in any browser (and without matplotlib installed)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import TypeGuard

__all__ = ["Series", "line_chart", "bar_chart", "PALETTE"]

PALETTE = ("#4e79a7", "#f28e2c", "#e15759", "#76b7b2", "#59a14f", "#edc949", "#af7aa1", "#ff9da7",
           "#9c755f", "#bab0ab")
_W, _H = 560, 250
_L, _R, _T, _B = 60, 130, 28, 40  # margins: the legend sits on the right


@dataclass(frozen=True)
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    dashed: bool = False


def _finite(v: object) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    return [start + k * step for k in range(int((hi - start) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.1e}"
    return f"{v:.4g}"


def line_chart(series: Sequence[Series], *, title: str, xlabel: str, ylabel: str = "", log_y: bool = False,
               hlines: Sequence[tuple[str, float]] = ()) -> str:
    """One ``<svg>`` element with a line per series (points that are not finite, or not
    positive on a log axis, are left out), and labelled horizontal reference lines."""
    def ok(v: float | None) -> TypeGuard[float]:
        return _finite(v) and (not log_y or v > 0)

    def ty(v: float) -> float:
        return math.log10(v) if log_y else v
    pts = [[(float(x), ty(y)) for x, y in zip(s.xs, s.ys) if _finite(x) and ok(y)] for s in series]
    xs = [x for p in pts for x, _ in p]
    ys = [y for p in pts for _, y in p] + [ty(v) for _, v in hlines if ok(v)]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" '
           f'class="chart" role="img" aria-label="{escape(title)}">',
           f'<rect width="{_W}" height="{_H}" fill="#ffffff"/>',
           f'<text x="{_L}" y="16" font-size="13" font-weight="bold">{escape(title)}</text>']
    if not xs or not ys:
        out.append(f'<text x="{_L}" y="{_H / 2}" font-size="12" fill="#666">no data</text></svg>')
        return "".join(out)
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (y1 - y0) * 0.05 or (abs(y1) * 0.1 or 1.0)
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = _W - _L - _R, _H - _T - _B

    def sx(x: float) -> float:
        return _L + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return _T + (1 - (y - y0) / (y1 - y0)) * ph

    out.append(f'<rect x="{_L}" y="{_T}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for t in _ticks(y0, y1):
        label = _fmt(10**t) if log_y else _fmt(t)
        out.append(f'<line x1="{_L}" x2="{_L + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>'
                   f'<text x="{_L - 4}" y="{sy(t) + 4:.1f}" font-size="10" text-anchor="end">{label}</text>')
    for t in _ticks(x0, x1):
        out.append(f'<text x="{sx(t):.1f}" y="{_T + ph + 14}" font-size="10" text-anchor="middle">{_fmt(t)}</text>')
    out.append(f'<text x="{_L + pw / 2}" y="{_H - 6}" font-size="11" text-anchor="middle">{escape(xlabel)}</text>')
    if ylabel:
        out.append(f'<text x="12" y="{_T + ph / 2}" font-size="11" text-anchor="middle" '
                   f'transform="rotate(-90 12 {_T + ph / 2})">{escape(ylabel)}</text>')
    for label, value in hlines:
        if ok(value):
            y = sy(ty(value))
            out.append(f'<line x1="{_L}" x2="{_L + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d62728" '
                       f'stroke-dasharray="6 3"/><text x="{_L + pw - 4}" y="{y - 4:.1f}" font-size="10" '
                       f'text-anchor="end" fill="#d62728">{escape(label)}</text>')
    for k, (s, p) in enumerate(zip(series, pts)):
        colour = PALETTE[k % len(PALETTE)]
        if len(p) == 1:
            out.append(f'<circle cx="{sx(p[0][0]):.1f}" cy="{sy(p[0][1]):.1f}" r="3" fill="{colour}"/>')
        elif p:
            d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in p)
            dash = ' stroke-dasharray="5 3"' if s.dashed else ""
            out.append(f'<polyline points="{d}" fill="none" stroke="{colour}" stroke-width="1.6"{dash}/>')
        ly = _T + 12 + 16 * k
        out.append(f'<rect x="{_L + pw + 10}" y="{ly - 8}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{_L + pw + 24}" y="{ly + 1}" font-size="10">{escape(s.label[:22])}</text>')
    out.append("</svg>")
    return "".join(out)


def bar_chart(bars: Sequence[tuple[str, float, str]], *, title: str) -> str:
    """Horizontal bars with their values (e.g. predicted against measured peak memory)."""
    h = 34 + 26 * len(bars)
    top = max([v for _, v, _t in bars if _finite(v)] + [1e-12])
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {h}" width="{_W}" height="{h}" '
           f'class="chart" role="img" aria-label="{escape(title)}"><rect width="{_W}" height="{h}" fill="#fff"/>',
           f'<text x="8" y="16" font-size="13" font-weight="bold">{escape(title)}</text>']
    for k, (label, value, text) in enumerate(bars):
        y = 28 + 26 * k
        width = (value / top) * (_W - 300) if _finite(value) else 0
        out.append(f'<text x="8" y="{y + 14}" font-size="11">{escape(label)}</text>'
                   f'<rect x="170" y="{y}" width="{max(width, 1):.1f}" height="18" fill="{PALETTE[k % len(PALETTE)]}"/>'
                   f'<text x="{176 + width:.1f}" y="{y + 14}" font-size="11">{escape(text)}</text>')
    out.append("</svg>")
    return "".join(out)
