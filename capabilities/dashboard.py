"""Reads for the owner's dashboard: traffic, latency and paging over time, from the flushed
minute windows and the audit trail (the last few seconds of calls may not be flushed yet)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from agents.models import AuditEvent
from capabilities import selectors, stats
from capabilities.models import BreakerState, Capability, CapabilityStatsWindow, State


@dataclass
class Traffic:
    """Calls, errors and latency over some span, with the figures derived from them."""

    calls: int = 0
    errors: int = 0
    cold_calls: int = 0
    latency_buckets: list[int] = field(default_factory=list)

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.calls if self.calls else None

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


def dashboard_get(*, now: datetime, span: timedelta, step: timedelta, top_n: int = 10) -> Dashboard:
    """Everything the dashboard draws for the `span` up to `now`, in steps of `step`.

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

    windows = CapabilityStatsWindow.objects.filter(window_start__gte=since, window_start__lt=until).values_list(
        "full_name", "window_start", "calls", "errors", "cold_calls", "latency_buckets"
    )
    for full, start, calls, errors, cold, latency in windows.iterator():
        for row in (buckets[index(start)], total, per_capability.setdefault(full, CapabilityTraffic(full_name=full))):
            row.calls += calls
            row.errors += errors
            row.cold_calls += cold
            row.latency_buckets = stats.add_buckets(row.latency_buckets, latency)

    paging = AuditEvent.objects.filter(
        action__in=("capability.paged_in", "capability.evicted"), created_at__gte=since, created_at__lt=until
    ).values_list("action", "created_at")
    for action, at in paging.iterator():
        bucket = buckets[index(at)]
        if action == "capability.paged_in":
            bucket.page_ins += 1
        else:
            bucket.evictions += 1

    top = sorted(per_capability.values(), key=lambda c: (-c.calls, c.full_name))[:top_n]
    degraded = list(
        Capability.objects.select_related("agent")
        .exclude(state=State.REMOVED)
        .filter(breaker_state=BreakerState.OPEN)
        .order_by("-breaker_opened_at", "full_name")
    )
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
