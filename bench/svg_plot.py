"""A tiny deterministic SVG line chart (no matplotlib on the benchmark hosts needed).

Same input, same bytes: coordinates are printed with fixed decimals and series keep
their given order, so a plot can be diffed and tested.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

WIDTH, HEIGHT = 720, 440
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 70, 190, 40, 50


@dataclass(frozen=True)
class Series:
    name: str
    points: tuple[tuple[float, float], ...]  # (x, y); points with y None are left out by the caller
    color: str = "#1f77b4"
    dashed: bool = False
    markers: bool = True


@dataclass(frozen=True)
class Chart:
    title: str
    x_label: str
    y_label: str
    series: tuple[Series, ...] = field(default_factory=tuple)
    log_x: bool = True


def _nice_step(span: float) -> float:
    """A 1/2/5 x 10^k step giving about five ticks over `span`."""
    if span <= 0:
        return 1.0
    raw = span / 5
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _fmt(v: float) -> str:
    return f"{v:.2f}"


def _tick_label(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e5 else f"{v:.3g}"


def render_svg(chart: Chart) -> str:
    pts = [p for s in chart.series for p in s.points
           if p[1] is not None and math.isfinite(p[1]) and (not chart.log_x or p[0] > 0)]
    xs = [p[0] for p in pts] or [1.0]
    ys = [p[1] for p in pts] or [0.0]
    x_lo, x_hi = min(xs), max(xs)
    if chart.log_x:
        lx_lo = math.floor(math.log2(x_lo))
        lx_hi = max(math.ceil(math.log2(x_hi)), lx_lo + 1)
        x_ticks = [2.0**k for k in range(lx_lo, lx_hi + 1)]

        def fx(x: float) -> float:
            return (math.log2(x) - lx_lo) / (lx_hi - lx_lo)
    else:
        if x_hi == x_lo:
            x_hi = x_lo + 1
        step = _nice_step(x_hi - x_lo)
        x_lo = math.floor(x_lo / step) * step
        x_hi = math.ceil(x_hi / step) * step
        x_ticks = [x_lo + i * step for i in range(int(round((x_hi - x_lo) / step)) + 1)]

        def fx(x: float) -> float:
            return (x - x_lo) / (x_hi - x_lo)

    y_top = max(ys) if max(ys) > 0 else 1.0
    y_step = _nice_step(y_top)
    y_hi = math.ceil(y_top / y_step) * y_step
    y_ticks = [i * y_step for i in range(int(round(y_hi / y_step)) + 1)]
    pw = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    ph = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM

    def px(x: float) -> float:
        return MARGIN_LEFT + fx(x) * pw

    def py(y: float) -> float:
        return MARGIN_TOP + ph - (y / y_hi) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2:.2f}" y="22" text-anchor="middle" font-size="15">{escape(chart.title)}</text>',
    ]
    for t in y_ticks:
        y = py(t)
        out.append(f'<line x1="{MARGIN_LEFT}" y1="{_fmt(y)}" x2="{MARGIN_LEFT + pw}" y2="{_fmt(y)}" stroke="#dddddd"/>')
        out.append(f'<text x="{MARGIN_LEFT - 6}" y="{_fmt(y + 4)}" text-anchor="end">{_tick_label(t)}</text>')
    for t in x_ticks:
        x = px(t)
        out.append(f'<line x1="{_fmt(x)}" y1="{MARGIN_TOP}" x2="{_fmt(x)}" y2="{MARGIN_TOP + ph}" stroke="#eeeeee"/>')
        out.append(f'<text x="{_fmt(x)}" y="{MARGIN_TOP + ph + 16}" text-anchor="middle">{_tick_label(t)}</text>')
    out.append(f'<rect x="{MARGIN_LEFT}" y="{MARGIN_TOP}" width="{pw}" height="{ph}" fill="none" stroke="#333333"/>')
    out.append(f'<text x="{MARGIN_LEFT + pw / 2:.2f}" y="{HEIGHT - 10}" text-anchor="middle">'
               f'{escape(chart.x_label)}{" (log scale)" if chart.log_x else ""}</text>')
    out.append(f'<text x="16" y="{MARGIN_TOP + ph / 2:.2f}" text-anchor="middle" '
               f'transform="rotate(-90 16 {MARGIN_TOP + ph / 2:.2f})">{escape(chart.y_label)}</text>')
    for i, s in enumerate(chart.series):
        good = [(x, y) for x, y in s.points
                if y is not None and math.isfinite(y) and (not chart.log_x or x > 0)]
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        if len(good) > 1:
            path = " ".join(f"{_fmt(px(x))},{_fmt(py(y))}" for x, y in good)
            out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>')
        if s.markers:
            for x, y in good:
                out.append(f'<circle cx="{_fmt(px(x))}" cy="{_fmt(py(y))}" r="3" fill="{s.color}"/>')
        ly = MARGIN_TOP + 14 + 18 * i
        lx = MARGIN_LEFT + pw + 12
        out.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 24}" y2="{ly - 4}" stroke="{s.color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{lx + 30}" y="{ly}">{escape(s.name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
