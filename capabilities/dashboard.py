"""Reads for the owner's dashboard: traffic, latency and paging over time, from the flushed
minute windows and the audit trail (the last few seconds of calls may not be flushed yet)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils import timezone
from django.utils.safestring import SafeString

from agents.models import AuditEvent
from capabilities import selectors
from capabilities.books import stats
from capabilities.models import Capability, CapabilityStatsWindow
from sigil import charts


@dataclass
class Traffic:
    """Calls, errors and latency over some span, with the figures derived from them."""

    calls: int = 0
    errors: int = 0
    cold_calls: int = 0
    latency_buckets: list[int] = field(default_factory=list)
    refused: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.calls if self.calls else None

    def error_rate_over(self, min_calls: int) -> float | None:
        """The error rate, or None below `min_calls` calls (one failed call of one is no 100 %)."""
        return self.error_rate if self.calls >= max(1, min_calls) else None

    @property
    def answers(self) -> int:
        return sum(self.statuses.values())

    @property
    def p50_ms(self) -> float | None:
        return stats.percentile_ms(self.latency_buckets, 0.50)

    @property
    def p95_ms(self) -> float | None:
        return stats.percentile_ms(self.latency_buckets, 0.95)


@dataclass(kw_only=True)
class Bucket(Traffic):
    """One step of the dashboard's time axis."""

    start: datetime
    page_ins: int = 0
    evictions: int = 0


@dataclass(kw_only=True)
class CapabilityTraffic(Traffic):
    full_name: str


@dataclass
class Dashboard:
    since: datetime
    until: datetime
    step: timedelta
    buckets: list[Bucket]
    total: CapabilityTraffic
    top: list[CapabilityTraffic]
    degraded: list[Capability]
    status: dict


def dashboard_get(
    *,
    now: datetime,
    span: timedelta,
    step: timedelta,
    top_n: int = 10,
    agent: str | None = None,
    full: str | None = None,
) -> Dashboard:
    """Everything the dashboard draws for the `span` up to `now`, in steps of `step`, for
    every capability, one agent's or one capability's. Answers that named no capability
    (stats.UNROUTED) count in the totals of the unfiltered view only.

    Reads every minute window in the span once; spans are hours, not months.
    """
    until = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    since = until - span
    count = max(1, int(span / step))
    buckets = [Bucket(start=since + i * step) for i in range(count)]
    total = CapabilityTraffic(full_name="")
    per_capability: dict[str, CapabilityTraffic] = {}

    def index(at: datetime) -> int:
        return min(count - 1, max(0, int((at - since) / step)))

    windows = CapabilityStatsWindow.objects.filter(window_start__gte=since, window_start__lt=until)
    paging = AuditEvent.objects.filter(
        action__in=("capability.paged_in", "capability.evicted"), created_at__gte=since, created_at__lt=until
    )
    degraded = selectors.capabilities_degraded()
    if agent is not None:
        windows = windows.filter(agent_name=agent)
        paging = paging.filter(agent_name=agent)
        degraded = degraded.filter(agent__name=agent)
    if full is not None:
        windows = windows.filter(full_name=full)
        paging = paging.filter(subject=full)
        degraded = degraded.filter(full_name=full)
    rows = windows.values_list(
        "full_name", "window_start", "calls", "errors", "cold_calls", "latency_buckets", "refused", "statuses", "codes"
    )
    for name, start, calls, errors, cold, latency, refused, statuses, codes in rows.iterator():
        counted = [buckets[index(start)], total]
        if name != stats.UNROUTED:
            counted.append(per_capability.setdefault(name, CapabilityTraffic(full_name=name)))
        for row in counted:
            row.calls += calls
            row.errors += errors
            row.cold_calls += cold
            row.refused += refused
            row.latency_buckets = stats.add_buckets(row.latency_buckets, latency)
            row.statuses = stats.add_counts(row.statuses, statuses)
            row.codes = stats.add_counts(row.codes, codes)

    paging = paging.values_list("action", "created_at")
    for action, at in paging.iterator():
        bucket = buckets[index(at)]
        if action == "capability.paged_in":
            bucket.page_ins += 1
        else:
            bucket.evictions += 1

    top = sorted(per_capability.values(), key=lambda c: (-(c.calls + c.refused), c.full_name))[:top_n]
    degraded = list(degraded)
    return Dashboard(
        since=since,
        until=until,
        step=step,
        buckets=buckets,
        total=total,
        top=top,
        degraded=degraded,
        status=selectors.backend_status(),
    )


def dashboard_chart(
    dashboard: Dashboard,
    *,
    title: str,
    series: Iterable[tuple[str, Callable[[Bucket], float | None], str]],
    kind: str = "line",
    unit: str = "",
) -> SafeString:
    """A chart of the dashboard's steps, labelled by their local time; each series is its
    label, the figure it reads of a step, and its colour (a CSS class of charts_style.html)."""
    return charts.time_chart(
        title=title,
        x_labels=[timezone.localtime(bucket.start).strftime("%H:%M") for bucket in dashboard.buckets],
        kind=kind,
        unit=unit,
        series=[charts.Series(label, [value(b) for b in dashboard.buckets], css) for label, value, css in series],
    )
