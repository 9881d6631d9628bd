"""The dashboard's charts drawn by Chromium: every axis label inside the chart, at a desktop's
width and a phone's, whatever the values (a latency in seconds, a share, nothing at all)."""

import pytest
from django.template.loader import render_to_string

from sigil import charts
from testsupport.browser import DESKTOP, PHONE

# Each label's box in the chart's own units, and the chart's size.
LABELS_OUTSIDE = """() => [...document.querySelectorAll("figure.sigil-chart svg")].flatMap(svg => {
  const view = svg.viewBox.baseVal;
  return [...svg.querySelectorAll("text.axis")].map(text => {
    const box = text.getBBox();
    return {text: text.textContent, x: box.x, right: box.x + box.width, y: box.y, bottom: box.y + box.height,
            width: view.width, height: view.height};
  }).filter(b => b.x < 0 || b.y < 0 || b.right > b.width || b.bottom > b.height);
})"""

LABELS = [f"{hour:02d}:{minute:02d}" for hour in (20, 21) for minute in range(0, 60, 2)]


def chart(values, unit):
    return charts.time_chart(title="a chart", x_labels=LABELS, unit=unit, series=[charts.Series("p95", values, "p95")])


@pytest.mark.parametrize(
    ("values", "unit"),
    [
        pytest.param([2400.0] + [None] * 59, "ms", id="seconds-of-latency"),
        pytest.param([12.5] * 60, "ms", id="milliseconds"),
        pytest.param([0.37] * 60, "%", id="a-share"),
        pytest.param([None] * 60, "", id="nothing"),
        pytest.param([123_456.0] * 60, "calls", id="many-calls"),
    ],
)
@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_every_axis_label_is_inside_its_chart(page, values, unit, viewport):
    page.set_viewport_size(viewport)
    style = render_to_string("admin/sigil/charts_style.html")
    page.set_content(f"<!doctype html><html><head>{style}</head><body>{chart(values, unit)}</body></html>")
    assert page.evaluate(LABELS_OUTSIDE) == []
