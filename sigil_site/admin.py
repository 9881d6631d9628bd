"""The owner's pages beyond the models: the dashboard and beat's schedule (staff only,
mounted under /admin/ by sigil_site/urls.py through the admin site's own login check)."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import admin
from django.template.response import TemplateResponse
from django.utils import timezone

from capabilities.dashboard import dashboard_get
from sigil_site import charts
from sigil_site.beat import beat_schedule_list

admin.site.site_header = "Sigil"
admin.site.site_title = "Sigil"
admin.site.index_title = "The owner's console"

# The spans the dashboard offers, with the step of their time axis: each is read from the
# per-minute windows, so they stay in hours.
SPANS = {
    "1h": ("last hour", timedelta(hours=1), timedelta(minutes=1)),
    "6h": ("last 6 hours", timedelta(hours=6), timedelta(minutes=10)),
    "24h": ("last 24 hours", timedelta(hours=24), timedelta(minutes=30)),
}


def dashboard_view(request):
    """Slots, traffic, errors, latency and paging over time, top and degraded capabilities."""
    span_key = request.GET.get("span") if request.GET.get("span") in SPANS else "1h"
    span_label, span, step = SPANS[span_key]
    data = dashboard_get(now=timezone.now(), span=span, step=step)
    labels = [timezone.localtime(bucket.start).strftime("%H:%M") for bucket in data.buckets]
    buckets = data.buckets
    status = data.status
    total = data.total
    context = {
        **admin.site.each_context(request),
        "title": "Dashboard",
        "spans": [(key, label) for key, (label, _, _) in SPANS.items()],
        "span": span_key,
        "span_label": span_label,
        "data": data,
        "status": status,
        "total": total,
        "warm_calls": total.calls - total.cold_calls,
        "slots_meter": charts.meter(value=status["used_slots"], total=status["total_slots"]),
        "top": [(c, charts.meter(value=c.calls, total=data.top[0].calls)) for c in data.top],
        "charts": [
            charts.time_chart(
                title="Calls and errors",
                x_labels=labels,
                kind="overlay",
                series=[
                    charts.Series("calls", [b.calls for b in buckets], "calls"),
                    charts.Series("errors", [b.errors for b in buckets], "errors"),
                ],
            ),
            charts.time_chart(
                title="Error rate",
                x_labels=labels,
                unit="%",
                series=[charts.Series("errors / calls", [b.error_rate for b in buckets], "errors")],
            ),
            charts.time_chart(
                title="Latency through the gateway",
                x_labels=labels,
                unit="ms",
                series=[
                    charts.Series("p50", [b.p50_ms for b in buckets], "p50"),
                    charts.Series("p95", [b.p95_ms for b in buckets], "p95"),
                ],
            ),
            charts.time_chart(
                title="Page-ins and evictions",
                x_labels=labels,
                kind="bars",
                series=[
                    charts.Series("page-ins", [b.page_ins for b in buckets], "pageins"),
                    charts.Series("evictions", [b.evictions for b in buckets], "evictions"),
                ],
            ),
        ],
        "warm_cold": charts.share_bar(
            title="Warm and cold calls",
            parts=[("warm", total.calls - total.cold_calls, "calls"), ("cold", total.cold_calls, "cold")],
        ),
    }
    return TemplateResponse(request, "admin/sigil/dashboard.html", context)


def beat_schedule_view(request):
    """Every periodic task of CELERY_BEAT_SCHEDULE, its interval and when it last ran."""
    context = {
        **admin.site.each_context(request),
        "title": "Beat schedule",
        "entries": beat_schedule_list(),
        "now": timezone.now(),
    }
    return TemplateResponse(request, "admin/sigil/beat_schedule.html", context)
