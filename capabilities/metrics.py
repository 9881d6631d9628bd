"""`GET /metrics`: Sigil's counters and gauges in the Prometheus text format.

Cardinality stays bounded however many capabilities there are: a capability's series carry
only its name and agent, plus at most the five status classes (`2xx` … `5xx`, and `1xx`
never occurs) and the latency buckets, a fixed number per capability; error codes, an open
set as Sigil grows, are counted in totals only, never per capability."""

from __future__ import annotations

from collections.abc import Iterator

from django.db.models import Count

from agents.models import Agent, AuditEvent
from capabilities import call_logs, stats
from capabilities.models import BreakerState, Capability, State
from capabilities.runtimes import get_runtime
from capabilities.runtimes.api_work import ApiClass
from capabilities.runtimes.cloudflare import (
    API_CALLS_BY_CLASS_KEY,
    API_CALLS_BY_OPERATION_KEY,
    API_CALLS_KEY,
    API_RATE_LIMITED_KEY,
    OPERATIONS,
)
from sigil.redis_client import get_redis


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, help_text: str) -> Iterator[str]:
    yield f"# HELP {name} {help_text}"
    yield f"# TYPE {name} {kind}"


def metrics_render() -> str:
    """Every metric, from the registry as last flushed (calls reach it every few seconds)."""
    lines: list[str] = []
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
    per_capability = [
        ("sigil_capability_calls_total", "counter", "Calls that reached the capability.", "calls_total"),
        ("sigil_capability_errors_total", "counter", "Calls answered 5xx, thrown or timed out.", "errors_total"),
        ("sigil_capability_cold_calls_total", "counter", "Calls that paged the capability in.", "cold_calls_total"),
        ("sigil_capability_page_in_ms_total", "counter", "Time spent paging the capability in.", "page_in_ms_total"),
        (
            "sigil_capability_refused_total",
            "counter",
            "Answers Sigil gave without running the capability (401, 404, 429, 503 degraded, ...).",
            "refused_total",
        ),
    ]
    for name, kind, help_text, attribute in per_capability:
        lines.extend(_family(name, kind, help_text))
        for capability in capabilities:
            labels = f'capability="{_escape(capability.full_name)}",agent="{_escape(capability.agent.name)}"'
            lines.append(f"{name}{{{labels}}} {getattr(capability, attribute)}")

    lines.extend(
        _family("sigil_capability_answers_total", "counter", "Every answer about the capability, by status class.")
    )
    unrouted_statuses, unrouted_codes = stats.unrouted_totals()
    statuses, codes = dict(unrouted_statuses), dict(unrouted_codes)
    for capability in capabilities:
        labels = f'capability="{_escape(capability.full_name)}",agent="{_escape(capability.agent.name)}"'
        for status_class, count in sorted(capability.statuses_total.items()):
            lines.append(f'sigil_capability_answers_total{{{labels},class="{_escape(status_class)}"}} {count}')
        statuses = stats.add_counts(statuses, capability.statuses_total)
        codes = stats.add_counts(codes, capability.codes_total)
    lines.extend(_family("sigil_answers_total", "counter", "Every answer of the gateway, by status class."))
    for status_class, count in sorted(statuses.items()):
        lines.append(f'sigil_answers_total{{class="{_escape(status_class)}"}} {count}')
    lines.extend(_family("sigil_answer_errors_total", "counter", "Every error answer of the gateway, by error code."))
    for code, count in sorted(codes.items()):
        lines.append(f'sigil_answer_errors_total{{code="{_escape(code)}"}} {count}')
    lines.extend(_family("sigil_capabilities_degraded", "gauge", "Capabilities whose breaker is open or forced."))
    lines.append(f"sigil_capabilities_degraded {sum(c.breaker_state == BreakerState.OPEN for c in capabilities)}")

    lines.extend(_family("sigil_capability_latency_ms", "histogram", "Call latency through the gateway."))
    for capability in capabilities:
        labels = f'capability="{_escape(capability.full_name)}",agent="{_escape(capability.agent.name)}"'
        buckets = stats.add_buckets(capability.latency_buckets_total, [])
        cumulative = 0
        for bound, count in zip((*stats.LATENCY_BUCKETS_MS, "+Inf"), buckets, strict=True):
            cumulative += count
            lines.append(f'sigil_capability_latency_ms_bucket{{{labels},le="{bound}"}} {cumulative}')
        lines.append(f"sigil_capability_latency_ms_sum{{{labels}}} {capability.latency_ms_total}")
        lines.append(f"sigil_capability_latency_ms_count{{{labels}}} {cumulative}")

    lines.extend(_family("sigil_capabilities", "gauge", "Registered capabilities by state."))
    by_state = dict(Capability.objects.values_list("state").annotate(n=Count("id")))
    for state in State.values:
        lines.append(f'sigil_capabilities{{state="{state}"}} {by_state.get(state, 0)}')

    runtime = get_runtime()
    lines.extend(_family("sigil_agents", "gauge", "Registered agents."))
    lines.append(f"sigil_agents {Agent.objects.count()}")
    lines.extend(_family("sigil_slots_used", "gauge", "Capabilities placed on the runtime."))
    lines.append(f"sigil_slots_used {by_state.get(State.LIVE, 0) + by_state.get(State.EVICTING, 0)}")
    if runtime.total_slots is not None:
        lines.extend(_family("sigil_slots_total", "gauge", "Slots the runtime offers."))
        lines.append(f"sigil_slots_total {runtime.total_slots}")
    events = dict(
        AuditEvent.objects.filter(action__in=("capability.evicted", "capability.paged_in"))
        .values_list("action")
        .annotate(n=Count("id"))
    )
    lines.extend(_family("sigil_evictions_total", "counter", "Capabilities paged out to make room."))
    lines.append(f"sigil_evictions_total {events.get('capability.evicted', 0)}")
    lines.extend(_family("sigil_page_ins_total", "counter", "Capabilities paged in on demand."))
    lines.append(f"sigil_page_ins_total {events.get('capability.paged_in', 0)}")
    redis = get_redis()
    api_calls, rate_limited = redis.mget(API_CALLS_KEY, API_RATE_LIMITED_KEY)
    lines.extend(_family("sigil_cloudflare_api_calls_total", "counter", "Cloudflare API calls, retries included."))
    lines.append(f"sigil_cloudflare_api_calls_total {int(api_calls or 0)}")
    # What spends the budget: by the class of the work the calls were made for (the order the
    # budget serves them in) and by operation, each a fixed set of labels.
    by_class = {key.decode(): int(value) for key, value in redis.hgetall(API_CALLS_BY_CLASS_KEY).items()}
    lines.extend(
        _family(
            "sigil_cloudflare_api_calls_by_class_total",
            "counter",
            "Cloudflare API calls by the class of work they were made for (page-in, deploy, page-out, housekeeping).",
        )
    )
    for api_class in ApiClass:
        count = by_class.get(api_class.value, 0)
        lines.append(f'sigil_cloudflare_api_calls_by_class_total{{class="{api_class.value}"}} {count}')
    by_operation = {key.decode(): int(value) for key, value in redis.hgetall(API_CALLS_BY_OPERATION_KEY).items()}
    lines.extend(
        _family(
            "sigil_cloudflare_api_calls_by_operation_total",
            "counter",
            "Cloudflare API calls by operation (upload, delete, subdomain-toggle, list, kv-read, kv-write, ...).",
        )
    )
    for operation in OPERATIONS:
        count = by_operation.get(operation, 0)
        lines.append(f'sigil_cloudflare_api_calls_by_operation_total{{operation="{operation}"}} {count}')
    lines.extend(_family("sigil_cloudflare_rate_limited_total", "counter", "Cloudflare API calls answered 429."))
    lines.append(f"sigil_cloudflare_rate_limited_total {int(rate_limited or 0)}")
    lines.extend(_family("sigil_call_records_lost_total", "counter", "Call records (console lines, outcome) not kept."))
    lines.append(f'sigil_call_records_lost_total{{why="not_kept"}} {call_logs.call_records_lost_kept()}')
    lines.append(f'sigil_call_records_lost_total{{why="undelivered"}} {call_logs.call_records_undelivered_count()}')
    first, again = call_logs.call_records_pushes()
    lines.extend(_family("sigil_call_record_pushes_total", "counter", "Call record batches pushed from Cloudflare."))
    lines.append(f'sigil_call_record_pushes_total{{taken="first"}} {first}')
    lines.append(f'sigil_call_record_pushes_total{{taken="again"}} {again}')
    applied, lost = stats.edge_reports_counts()
    lines.extend(_family("sigil_edge_reports_total", "counter", "Calls the edge answered, reported and applied here."))
    lines.append(f"sigil_edge_reports_total {applied}")
    lines.extend(
        _family("sigil_edge_reports_lost_total", "counter", "Reports of calls the edge answered that never arrived.")
    )
    lines.append(f"sigil_edge_reports_lost_total {lost}")
    return "\n".join(lines) + "\n"
