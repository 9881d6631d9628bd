"""Charts for the owner's pages, drawn on the server as inline SVG.

No JavaScript and no static files: a chart is markup in the page, styled by the admin's
own CSS variables (so it follows the light and dark themes), and every label goes through
Django's escaping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT = 640, 180
RIGHT, TOP, BOTTOM = 12, 14, 26  # TOP: room for the top value label, centred on its line
# The axis labels' largest font size (charts_style.html: 11 units, 15 on a phone, where the
# chart is drawn at about 0.55 of its size) and a generous width of one of their characters,
# in em: the left margin is made wide enough for the widest value label at that size.
AXIS_FONT_MAX = 15
AXIS_CHAR_EM = 0.62


@dataclass(frozen=True)
class Series:
    label: str
    values: list[float | None]
    css: str  # a class of the dashboard's style sheet: the series' colour


def _f(value: float, digits: int = 1) -> str:
    """A coordinate as text: format_html escapes its arguments, so numbers arrive formatted."""
    return f"{value:.{digits}f}"


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 × 10^k at or above `value` (1 for nothing)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        candidate = step * 10**exponent
        if candidate >= value * (1 - 1e-9):
            return candidate
    return 10 ** (exponent + 1)


def _number(value: float, unit: str) -> str:
    if unit == "%":
        return f"{value * 100:.3g} %"
    text = f"{value:.3g}" if value < 1000 else f"{value:,.0f}"
    return f"{text} {unit}".rstrip()


def time_chart(
    *, title: str, x_labels: list[str], series: list[Series], kind: str = "line", unit: str = "", top: float = 0
) -> SafeString:
    """A chart of values over time: `line` (gaps where a value is None), `bars` (series side
    by side) or `overlay` (bars drawn over each other, for a part of a whole)."""
    count = max(1, len(x_labels))
    peak = max([v for s in series for v in s.values if v is not None] + [top, 0])
    ceiling = nice_ceiling(peak)
    if unit == "%":
        ceiling = min(ceiling, 1.0)  # a share never goes past 100 %
    y_labels = [(fraction, _number(ceiling * fraction, unit)) for fraction in (0, 0.5, 1)]
    # Wide enough for the widest value label: "1,000 ms" was cut at the chart's left edge.
    left = math.ceil(8 + AXIS_CHAR_EM * AXIS_FONT_MAX * max(len(text) for _, text in y_labels))
    plot_w, plot_h = WIDTH - left - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / count

    def y(value: float) -> float:
        return TOP + plot_h - plot_h * value / ceiling

    parts: list[str] = []
    for fraction, text in y_labels:
        value = ceiling * fraction
        parts.append(
            format_html(
                '<line class="grid" x1="{}" x2="{}" y1="{}" y2="{}"/>'
                '<text class="axis" x="{}" y="{}" text-anchor="end" dominant-baseline="middle">{}</text>',
                left,
                WIDTH - RIGHT,
                _f(y(value)),
                _f(y(value)),
                left - 6,
                _f(max(y(value), TOP)),
                text,
            )
        )
    ticks = sorted({0, count // 4, count // 2, 3 * count // 4, count - 1})
    for i in ticks:
        # The first and last labels end at the plot's edges rather than centred on their
        # step, which would put half of each outside the chart.
        if i == ticks[0] and len(ticks) > 1:
            x, anchor = left, "start"
        elif i == ticks[-1] and len(ticks) > 1:
            x, anchor = WIDTH - RIGHT, "end"
        else:
            x, anchor = left + slot * (i + 0.5), "middle"
        parts.append(
            format_html(
                '<text class="axis" x="{}" y="{}" text-anchor="{}">{}</text>',
                _f(x),
                HEIGHT - 6,
                anchor,
                x_labels[i] if i < len(x_labels) else "",
            )
        )
    for position, line in enumerate(series):
        points = list(enumerate(line.values))
        if kind == "line":
            runs: list[list[tuple[float, float]]] = [[]]
            for i, value in points:
                if value is None:
                    runs.append([])
                else:
                    runs[-1].append((left + slot * (i + 0.5), y(value)))
            for run in runs:
                if len(run) > 1:
                    path = " ".join(f"{x:.1f},{py:.1f}" for x, py in run)
                    parts.append(format_html('<polyline class="line {}" points="{}"/>', line.css, path))
                for x, py in run:
                    parts.append(format_html('<circle class="dot {}" cx="{}" cy="{}" r="2"/>', line.css, _f(x), _f(py)))
        else:
            group = len(series) if kind == "bars" else 1
            width = max(1.0, slot * 0.8 / group)
            offset = slot * 0.1 + (width * position if kind == "bars" else 0)
            for i, value in points:
                if not value:
                    continue
                parts.append(
                    format_html(
                        '<rect class="bar {}" x="{}" y="{}" width="{}" height="{}"><title>{} {}: {}</title></rect>',
                        line.css,
                        _f(left + slot * i + offset),
                        _f(y(value)),
                        _f(width),
                        _f(TOP + plot_h - y(value)),
                        x_labels[i] if i < len(x_labels) else "",
                        line.label,
                        _number(value, unit),
                    )
                )
    legend = format_html_join(
        "", '<span class="legend-item"><span class="swatch {}"></span>{}</span>', ((s.css, s.label) for s in series)
    )
    return format_html(
        '<figure class="sigil-chart"><figcaption>{} <span class="legend">{}</span></figcaption>'
        '<svg viewBox="0 0 {} {}" role="img" aria-label="{}">{}</svg></figure>',
        title,
        legend,
        WIDTH,
        HEIGHT,
        title,
        mark_safe("".join(parts)),  # every part was built by format_html
    )


def share_bar(*, title: str, parts: list[tuple[str, float, str]]) -> SafeString:
    """One bar split into the shares of its parts, e.g. warm and cold calls."""
    total = sum(value for _, value, _ in parts)
    x = 0.0
    rects = []
    for label, value, css in parts:
        if total and value:
            width = 100 * value / total
            rects.append(
                format_html(
                    '<rect class="bar {}" x="{}%" y="0" width="{}%" height="24"><title>{}: {}</title></rect>',
                    css,
                    _f(x, 2),
                    _f(width, 2),
                    label,
                    f"{value:g}",
                )
            )
            x += width
    if not rects:
        rects.append(mark_safe('<rect class="empty" x="0" y="0" width="100%" height="24"/>'))
    legend = format_html_join(
        "",
        '<span class="legend-item"><span class="swatch {}"></span>{}: {} ({})</span>',
        ((css, label, f"{value:g}", f"{100 * value / total:.0f} %" if total else "–") for label, value, css in parts),
    )
    return format_html(
        '<figure class="sigil-chart share"><figcaption>{}</figcaption>'
        '<svg width="100%" height="24" role="img" aria-label="{}">{}</svg><div class="legend">{}</div></figure>',
        title,
        title,
        mark_safe("".join(rects)),  # every part was built by format_html
        legend,
    )


def meter(*, value: float, total: float | None, css: str = "calls") -> SafeString:
    """A small horizontal bar: `value` as a share of `total` (empty when there is no total)."""
    share = min(1.0, value / total) if total else 0.0
    return format_html(
        '<svg class="meter" width="120" height="10" role="img" aria-label="{} %">'
        '<rect class="empty" x="0" y="0" width="120" height="10"/>'
        '<rect class="bar {}" x="0" y="0" width="{}" height="10"/></svg>',
        _f(share * 100, 0),
        css,
        _f(120 * share),
    )
