"""The owner's pages beyond the models: the dashboard and beat's schedule (staff only,
mounted under /admin/ by sigil_site/urls.py through the admin site's own login check)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from operator import attrgetter, methodcaller

from django import forms
from django.conf import settings
from django.contrib import admin
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User
from django.core.exceptions import ValidationError
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.http import urlencode

from agents.models import Agent
from capabilities.dashboard import Bucket, dashboard_chart, dashboard_get
from sigil import charts
from sigil.console import SelectionChecked
from sigil_site.beat import beat_schedule_list

admin.site.site_header = "Sigil"
admin.site.site_title = "Sigil"
admin.site.index_title = "The owner's console"
# "View site" opens the dashboard: Sigil's own root answers agents, not people.
admin.site.site_url = "/admin/dashboard/"

# The spans the dashboard offers, with the step of their time axis: each is read from the
# per-minute windows, so they stay in hours.
SPANS = {
    "1h": ("last hour", timedelta(hours=1), timedelta(minutes=1)),
    "6h": ("last 6 hours", timedelta(hours=6), timedelta(minutes=10)),
    "24h": ("last 24 hours", timedelta(hours=24), timedelta(minutes=30)),
}


# Auto-refresh of the dashboard, seconds: a meta refresh, so no script is needed.
REFRESH_SECONDS = 60
# Colours (CSS classes of charts_style.html) of the status classes.
STATUS_CSS = {"1xx": "s3xx", "2xx": "s2xx", "3xx": "s3xx", "4xx": "s4xx", "5xx": "s5xx"}


def _status_count(status_class: str) -> Callable[[Bucket], int]:
    return lambda bucket: bucket.statuses.get(status_class, 0)


def dashboard_view(request):
    """Slots, traffic, errors, refusals, latency and paging over time, top and degraded
    capabilities; for every agent or one (`?agent=`), refreshed every minute unless `?refresh=off`."""
    span_key = request.GET.get("span") if request.GET.get("span") in SPANS else "1h"
    span_label, span, step = SPANS[span_key]
    agents = list(Agent.objects.order_by("name").values_list("name", flat=True))
    agent = request.GET.get("agent") if request.GET.get("agent") in agents else None
    refresh = request.GET.get("refresh") != "off"
    data = dashboard_get(now=timezone.now(), span=span, step=step, agent=agent)
    buckets = data.buckets
    status = data.status
    total = data.total
    # One failed call of one is no 100 % error rate: steps with fewer calls show no rate.
    min_calls = settings.SIGIL_ALERT_MIN_CALLS
    classes = sorted({c for b in buckets for c in b.statuses}) or ["2xx"]
    calls, errors = attrgetter("calls"), attrgetter("errors")
    shown = [
        ("Calls and errors", "overlay", "", [("calls", calls, "calls"), ("errors", errors, "errors")]),
        ("Answers by status", "bars", "", [(c, _status_count(c), STATUS_CSS.get(c, "s3xx")) for c in classes]),
        (
            f"Error rate (steps with {min_calls} calls or more)",
            "line",
            "%",
            [("errors / calls", methodcaller("error_rate_over", min_calls), "errors")],
        ),
        (
            "Latency through the gateway",
            "line",
            "ms",
            [("p50", attrgetter("p50_ms"), "p50"), ("p95", attrgetter("p95_ms"), "p95")],
        ),
    ]
    if status["total_slots"] is not None:
        paging = [("page-ins", attrgetter("page_ins"), "pageins"), ("evictions", attrgetter("evictions"), "evictions")]
        shown.append(("Page-ins and evictions", "bars", "", paging))
    charts_shown = [
        dashboard_chart(data, title=title, kind=kind, unit=unit, series=series) for title, kind, unit, series in shown
    ]
    query = {"span": span_key, **({"agent": agent} if agent else {}), **({} if refresh else {"refresh": "off"})}
    context = {
        **admin.site.each_context(request),
        "title": "Dashboard" if agent is None else f"Dashboard: {agent}",
        "spans": [(key, label, urlencode({**query, "span": key})) for key, (label, _, _) in SPANS.items()],
        "span": span_key,
        "span_label": span_label,
        "agents": [(name, urlencode({**query, "agent": name})) for name in agents],
        "all_agents_query": urlencode({k: v for k, v in query.items() if k != "agent"}),
        "agent": agent,
        "refresh": refresh,
        "refresh_seconds": REFRESH_SECONDS,
        "refresh_toggle_query": urlencode({**query, "refresh": "on" if not refresh else "off"}),
        "data": data,
        "status": status,
        "total": total,
        "total_error_rate": total.error_rate_over(min_calls),
        "min_calls": min_calls,
        "warm_calls": total.calls - total.cold_calls,
        "slots_meter": charts.meter(value=status["used_slots"], total=status["total_slots"]),
        "top": [(c, charts.meter(value=c.calls, total=data.top[0].calls)) for c in data.top],
        "charts": charts_shown,
        "statuses": sorted(total.statuses.items()),
        "codes": sorted(total.codes.items(), key=lambda item: (-item[1], item[0])),
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


class BoundedModelMultipleChoiceField(forms.ModelMultipleChoiceField):
    """A choice of rows by id where an id beyond a 64-bit integer is refused as an unknown
    choice: SQLite raises OverflowError for it in the `__in` query Django builds, a 500."""

    def _check_values(self, value):
        for pk in value or ():
            try:
                number = int(pk)
            except (TypeError, ValueError):
                continue  # Django's own check names it
            if not -(2**63) <= number < 2**63:
                raise ValidationError(
                    self.error_messages["invalid_choice"], code="invalid_choice", params={"value": pk}
                )
        return super()._check_values(value)


class BoundedChoices:
    def formfield_for_manytomany(self, db_field, request, **kwargs):
        kwargs.setdefault("form_class", BoundedModelMultipleChoiceField)
        return super().formfield_for_manytomany(db_field, request, **kwargs)


class OwnerGroupAdmin(SelectionChecked, BoundedChoices, GroupAdmin):
    pass


class OwnerUserAdmin(SelectionChecked, BoundedChoices, UserAdmin):
    pass


for _model, _model_admin in ((Group, OwnerGroupAdmin), (User, OwnerUserAdmin)):
    admin.site.unregister(_model)
    admin.site.register(_model, _model_admin)
