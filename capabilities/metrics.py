"""`GET /metrics`: Sigil's counters and gauges, collected at each scrape by a collector of
`prometheus_client` and written by it in the format the scraper asks for (Prometheus text,
or OpenMetrics), named by Prometheus's conventions: base units (seconds), `_total` on every
counter and on nothing else.

Cardinality stays bounded however many capabilities there are: a capability's series carry
only its name and agent, plus at most the five status classes (`2xx` … `5xx`, and `1xx`
never occurs) and the latency buckets, a fixed number per capability; error codes, an open
set as Sigil grows, are counted in totals only, never per capability.

What a call adds to a capability's counters reaches the registry with the stats flush (every
SIGIL_STATS_FLUSH_INTERVAL_SECONDS): those metrics are up to that much behind the calls, and
their help text says so."""

from __future__ import annotations

from collections.abc import Iterator

from django.conf import settings
from django.db.models import Count
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from agents.models import Agent, AuditEvent
from capabilities.books import call_logs, stats
from capabilities.models import BreakerState, Capability, State
from capabilities.runtimes import get_runtime
from capabilities.runtimes.api_work import ApiClass
from capabilities.runtimes.cloudflare import (
    OPERATIONS,
)
from sigil import redis_keys
from sigil.redis_client import get_redis

CAPABILITY_LABELS = ["capability", "agent"]


def metrics_render(*, accept: str = "") -> tuple[bytes, str]:
    """Every metric, in the format the scraper's Accept header asks for: the body and its
    content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SigilCollector(flush_seconds=settings.SIGIL_STATS_FLUSH_INTERVAL_SECONDS))
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


class SigilCollector(Collector):
    """Sigil's metrics, read from the registry (as last flushed) and Redis at each scrape."""

    def __init__(self, *, flush_seconds: float) -> None:
        self.lag = f" As of the last stats flush: up to {flush_seconds:g} s behind the calls."

    def collect(self) -> Iterator[Metric]:
        capabilities = list(
            Capability.objects.exclude(state=State.REMOVED)
            .select_related("agent")
            .only(
                "full_name",
                "agent__name",
                "calls_total",
                "errors_total",
                "cold_calls_total",
                "latency_ms_total",
                "page_in_ms_total",
                "latency_buckets_total",
                "refused_total",
                "statuses_total",
                "codes_total",
                "breaker_state",
            )
        )
        yield from self._per_capability(capabilities)
        yield from self._answers(capabilities)
        yield from self._registry(capabilities)
        yield from self._cloudflare()
        yield from self._records()

    def _per_capability(self, capabilities: list[Capability]) -> Iterator[Metric]:
        counters = [
            ("sigil_capability_calls", "Calls that reached the capability.", lambda c: c.calls_total),
            ("sigil_capability_errors", "Calls answered 5xx, thrown or timed out.", lambda c: c.errors_total),
            ("sigil_capability_cold_calls", "Calls that paged the capability in.", lambda c: c.cold_calls_total),
            (
                "sigil_capability_page_in_seconds",
                "Time spent paging the capability in, in seconds.",
                lambda c: c.page_in_ms_total / 1000,
            ),
            (
                "sigil_capability_refused",
                "Answers Sigil gave without running the capability (401, 404, 429, 503 degraded, ...).",
                lambda c: c.refused_total,
            ),
        ]
        for name, help_text, value in counters:
            family = CounterMetricFamily(name, help_text + self.lag, labels=CAPABILITY_LABELS)
            for capability in capabilities:
                family.add_metric(_labels(capability), value(capability))
            yield family

        latency = HistogramMetricFamily(
            "sigil_capability_latency_seconds",
            "Call latency through the gateway, in seconds." + self.lag,
            labels=CAPABILITY_LABELS,
        )
        bounds = [_seconds(bound) for bound in stats.LATENCY_BUCKETS_MS] + ["+Inf"]
        for capability in capabilities:
            buckets, cumulative = [], 0
            for bound, count in zip(bounds, stats.add_buckets(capability.latency_buckets_total, []), strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            latency.add_metric(_labels(capability), buckets, capability.latency_ms_total / 1000)
        yield latency

    def _answers(self, capabilities: list[Capability]) -> Iterator[Metric]:
        per_capability = CounterMetricFamily(
            "sigil_capability_answers",
            "Every answer about the capability, by status class." + self.lag,
            labels=[*CAPABILITY_LABELS, "class"],
        )
        unrouted_statuses, unrouted_codes = stats.unrouted_totals()
        statuses, codes = dict(unrouted_statuses), dict(unrouted_codes)
        for capability in capabilities:
            for status_class, count in sorted(capability.statuses_total.items()):
                per_capability.add_metric([*_labels(capability), status_class], count)
            statuses = stats.add_counts(statuses, capability.statuses_total)
            codes = stats.add_counts(codes, capability.codes_total)
        yield per_capability
        answers = CounterMetricFamily(
            "sigil_answers",
            "Every answer of the gateway, by status class; those naming no capability are counted at once." + self.lag,
            labels=["class"],
        )
        for status_class, count in sorted(statuses.items()):
            answers.add_metric([status_class], count)
        yield answers
        errors = CounterMetricFamily(
            "sigil_answer_errors",
            "Every error answer of the gateway, by error code; those naming no capability are counted at once."
            + self.lag,
            labels=["code"],
        )
        for code, count in sorted(codes.items()):
            errors.add_metric([code], count)
        yield errors
        yield GaugeMetricFamily(
            "sigil_capabilities_degraded",
            "Capabilities whose breaker is open or forced.",
            value=sum(c.breaker_state == BreakerState.OPEN for c in capabilities),
        )

    def _registry(self, capabilities: list[Capability]) -> Iterator[Metric]:
        by_state = dict(Capability.objects.values_list("state").annotate(n=Count("id")))
        registered = GaugeMetricFamily("sigil_capabilities", "Registered capabilities by state.", labels=["state"])
        for state in State.values:
            registered.add_metric([state], by_state.get(state, 0))
        yield registered
        yield GaugeMetricFamily("sigil_agents", "Registered agents.", value=Agent.objects.count())
        placed = by_state.get(State.LIVE, 0) + by_state.get(State.EVICTING, 0)
        yield GaugeMetricFamily("sigil_slots_used", "Capabilities placed on the runtime.", value=placed)
        runtime = get_runtime()
        if runtime.total_slots is not None:
            yield GaugeMetricFamily("sigil_slots_capacity", "Slots the runtime offers.", value=runtime.total_slots)
        events = dict(
            AuditEvent.objects.filter(action__in=("capability.evicted", "capability.paged_in"))
            .values_list("action")
            .annotate(n=Count("id"))
        )
        yield CounterMetricFamily(
            "sigil_evictions", "Capabilities paged out to make room.", value=events.get("capability.evicted", 0)
        )
        yield CounterMetricFamily(
            "sigil_page_ins", "Capabilities paged in on demand.", value=events.get("capability.paged_in", 0)
        )

    def _cloudflare(self) -> Iterator[Metric]:
        redis = get_redis()
        api_calls, rate_limited = redis.mget(redis_keys.CF_CALLS, redis_keys.CF_RATE_LIMITED)
        yield CounterMetricFamily(
            "sigil_cloudflare_api_calls", "Cloudflare API calls, retries included.", value=int(api_calls or 0)
        )
        # What spends the budget: by the class of the work the calls were made for (the order the
        # budget serves them in) and by operation, each a fixed set of labels.
        by_class = {key.decode(): int(value) for key, value in redis.hgetall(redis_keys.CF_CALLS_BY_CLASS).items()}
        family = CounterMetricFamily(
            "sigil_cloudflare_api_calls_by_class",
            "Cloudflare API calls by the class of work they were made for (page-in, deploy, page-out, housekeeping).",
            labels=["class"],
        )
        for api_class in ApiClass:
            family.add_metric([api_class.value], by_class.get(api_class.value, 0))
        yield family
        by_operation = {
            key.decode(): int(value) for key, value in redis.hgetall(redis_keys.CF_CALLS_BY_OPERATION).items()
        }
        family = CounterMetricFamily(
            "sigil_cloudflare_api_calls_by_operation",
            "Cloudflare API calls by operation (upload, delete, subdomain-toggle, list, kv-read, kv-write, ...).",
            labels=["operation"],
        )
        for operation in OPERATIONS:
            family.add_metric([operation], by_operation.get(operation, 0))
        yield family
        yield CounterMetricFamily(
            "sigil_cloudflare_rate_limited", "Cloudflare API calls answered 429.", value=int(rate_limited or 0)
        )

    def _records(self) -> Iterator[Metric]:
        lost = CounterMetricFamily(
            "sigil_call_records_lost", "Call records (console lines, outcome) not kept.", labels=["why"]
        )
        lost.add_metric(["not_kept"], call_logs.call_records_lost_kept())
        lost.add_metric(["undelivered"], call_logs.call_records_undelivered_count())
        yield lost
        first, again = call_logs.call_records_pushes()
        pushes = CounterMetricFamily(
            "sigil_call_record_pushes", "Call record batches pushed from Cloudflare.", labels=["taken"]
        )
        pushes.add_metric(["first"], first)
        pushes.add_metric(["again"], again)
        yield pushes
        applied, lost_reports = stats.edge_reports_counts()
        yield CounterMetricFamily(
            "sigil_edge_reports", "Calls the edge answered, reported and applied here.", value=applied
        )
        yield CounterMetricFamily(
            "sigil_edge_reports_lost", "Reports of calls the edge answered that never arrived.", value=lost_reports
        )


def _labels(capability: Capability) -> list[str]:
    return [capability.full_name, capability.agent.name]


def _seconds(milliseconds: float) -> str:
    """A bucket's upper bound in seconds, as prometheus_client writes its own histograms' `le`."""
    return floatToGoString(milliseconds / 1000)
