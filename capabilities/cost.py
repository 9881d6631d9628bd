"""What the recorded traffic would cost a month on each Cloudflare runtime, and how the pool
copes with it: reads for the owner's cost page, `GET /_api/cost` and `manage.py cost`.

Sources, all recorded by Sigil: the per-minute windows the stats flush writes (calls, their
duration, cold calls, which capabilities were called each day), the audit trail's page-ins,
the Cloudflare API calls counted per hour (capabilities.runtimes.cloudflare), and the access log of
the last calls (stats.ACCESS_LOG_KEY), which is replayed through the pager's own eviction
policy to find the smallest slot count that would have kept cold calls under 1 %.

Sigil cannot see the CPU time Cloudflare bills: it bills each call's recorded duration
(through Sigil, so waiting included) as CPU time, an upper bound.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta

from django.conf import settings

from agents.models import AuditEvent
from capabilities import pager, stats
from capabilities.runtimes.cloudflare import api_calls_hour_key
from capabilities.models import Capability, CapabilityStatsWindow, State
from sigil.redis_client import get_redis

DAYS_PER_MONTH = 30
# The share of calls that may be cold for a slot count to be enough.
COLD_TARGET = 0.01


@dataclass(frozen=True)
class Prices:
    """Cloudflare's published prices and included amounts, from settings (README gives the
    source and date of each)."""

    free_requests_per_day: int
    free_cpu_ms_per_call: int
    free_scripts: int
    paid_monthly_usd: float
    paid_included_requests: int
    paid_included_cpu_ms: int
    requests_per_million_usd: float
    cpu_per_million_ms_usd: float
    platforms_monthly_usd: float
    platforms_included_requests: int
    platforms_included_cpu_ms: int
    platforms_included_scripts: int
    platforms_script_usd: float
    dynamic_included_workers: int
    dynamic_worker_day_usd: float

    @classmethod
    def from_settings(cls) -> Prices:
        return cls(
            free_requests_per_day=settings.SIGIL_PRICE_FREE_REQUESTS_PER_DAY,
            free_cpu_ms_per_call=settings.SIGIL_PRICE_FREE_CPU_MS_PER_CALL,
            free_scripts=settings.SIGIL_PRICE_FREE_SCRIPTS,
            paid_monthly_usd=settings.SIGIL_PRICE_PAID_MONTHLY_USD,
            paid_included_requests=settings.SIGIL_PRICE_PAID_INCLUDED_REQUESTS,
            paid_included_cpu_ms=settings.SIGIL_PRICE_PAID_INCLUDED_CPU_MS,
            requests_per_million_usd=settings.SIGIL_PRICE_REQUESTS_PER_MILLION_USD,
            cpu_per_million_ms_usd=settings.SIGIL_PRICE_CPU_PER_MILLION_MS_USD,
            platforms_monthly_usd=settings.SIGIL_PRICE_PLATFORMS_MONTHLY_USD,
            platforms_included_requests=settings.SIGIL_PRICE_PLATFORMS_INCLUDED_REQUESTS,
            platforms_included_cpu_ms=settings.SIGIL_PRICE_PLATFORMS_INCLUDED_CPU_MS,
            platforms_included_scripts=settings.SIGIL_PRICE_PLATFORMS_INCLUDED_SCRIPTS,
            platforms_script_usd=settings.SIGIL_PRICE_PLATFORMS_SCRIPT_USD,
            dynamic_included_workers=settings.SIGIL_PRICE_DYNAMIC_INCLUDED_WORKERS,
            dynamic_worker_day_usd=settings.SIGIL_PRICE_DYNAMIC_WORKER_DAY_USD,
        )


@dataclass(frozen=True)
class Usage:
    """A month of traffic, as the window's traffic scaled to DAYS_PER_MONTH."""

    calls: float
    duration_ms: float
    busiest_day_calls: int
    calls_over_free_cpu_share: float  # calls longer than the free plan's CPU limit (an upper bound)
    capabilities: int  # registered now: one script each on Workers for Platforms
    dynamic_worker_days: float  # (capability, day) pairs with a call: unique Dynamic Workers a day


@dataclass(frozen=True)
class RuntimeBill:
    runtime: str
    plan: str
    monthly_usd: float
    requests: float
    cpu_ms: float
    items: dict[str, float]  # the bill's lines, in USD
    fits: bool = True
    limits: list[str] = field(default_factory=list)  # what does not fit, in words


@dataclass(frozen=True)
class PoolReport:
    page_ins: int
    page_ins_per_hour: float
    peak_page_ins_per_hour: int
    cloudflare_api_calls: int
    cloudflare_api_calls_per_hour: float
    peak_cloudflare_api_calls_per_hour: int
    cloudflare_api_budget_per_hour: float
    calls: int
    cold_calls: int
    cold_share: float | None
    replayed_calls: int
    replayed_since: datetime | None
    smallest_slots_under_1pct: int | None


@dataclass(frozen=True)
class CostEstimate:
    since: datetime
    until: datetime
    days: float
    usage: Usage
    runtimes: list[RuntimeBill]
    pool: PoolReport
    prices: Prices

    def as_json(self) -> dict:
        data = asdict(self)
        data["since"], data["until"] = self.since.isoformat(), self.until.isoformat()
        replayed = self.pool.replayed_since
        data["pool"]["replayed_since"] = replayed.isoformat() if replayed else None
        return data


# --- the bill, as plain arithmetic ------------------------------------------------------------


def _overage(used: float, included: float, per_million: float) -> float:
    return max(0.0, used - included) / 1_000_000 * per_million


def bill_workers_free(usage: Usage, prices: Prices, *, smallest_slots: int | None) -> RuntimeBill:
    limits = []
    if usage.busiest_day_calls > prices.free_requests_per_day:
        limits.append(f"the busiest day had {usage.busiest_day_calls} calls, over {prices.free_requests_per_day} a day")
    if usage.calls_over_free_cpu_share > 0:
        limits.append(
            f"{usage.calls_over_free_cpu_share:.1%} of calls took over {prices.free_cpu_ms_per_call} ms "
            "(an upper bound of their CPU time)"
        )
    if smallest_slots is not None and smallest_slots > prices.free_scripts:
        limits.append(f"cold calls stay under 1 % only with {smallest_slots} slots, over {prices.free_scripts} scripts")
    return RuntimeBill(
        runtime="worker-pool",
        plan="Workers Free",
        monthly_usd=0.0,
        requests=usage.calls,
        cpu_ms=usage.duration_ms,
        items={},
        fits=not limits,
        limits=limits,
    )


def bill_workers_paid(usage: Usage, prices: Prices) -> RuntimeBill:
    """The worker-pool runtime: one Worker request per call (the gateway runs outside)."""
    items = {
        "plan": prices.paid_monthly_usd,
        "requests": _overage(usage.calls, prices.paid_included_requests, prices.requests_per_million_usd),
        "cpu": _overage(usage.duration_ms, prices.paid_included_cpu_ms, prices.cpu_per_million_ms_usd),
    }
    return RuntimeBill(
        runtime="worker-pool",
        plan="Workers Paid",
        monthly_usd=round(sum(items.values()), 4),
        requests=usage.calls,
        cpu_ms=usage.duration_ms,
        items=items,
    )


def bill_workers_for_platforms(usage: Usage, prices: Prices) -> RuntimeBill:
    """The platform runtime: the dispatch Worker and the capability's are billed as one
    request; one script per registered capability."""
    extra_scripts = max(0, usage.capabilities - prices.platforms_included_scripts)
    items = {
        "plan": prices.platforms_monthly_usd,
        "requests": _overage(usage.calls, prices.platforms_included_requests, prices.requests_per_million_usd),
        "cpu": _overage(usage.duration_ms, prices.platforms_included_cpu_ms, prices.cpu_per_million_ms_usd),
        "scripts": extra_scripts * prices.platforms_script_usd,
    }
    return RuntimeBill(
        runtime="platform",
        plan="Workers for Platforms",
        monthly_usd=round(sum(items.values()), 4),
        requests=usage.calls,
        cpu_ms=usage.duration_ms,
        items=items,
    )


def bill_dynamic_workers(usage: Usage, prices: Prices) -> RuntimeBill:
    """The loader runtime on Workers Paid: each call is two requests (the loader Worker and
    the Dynamic Worker it calls), and each capability called on a day is one Dynamic Worker
    that day."""
    requests = 2 * usage.calls
    extra_workers = max(0.0, usage.dynamic_worker_days - prices.dynamic_included_workers)
    items = {
        "plan": prices.paid_monthly_usd,
        "requests": _overage(requests, prices.paid_included_requests, prices.requests_per_million_usd),
        "cpu": _overage(usage.duration_ms, prices.paid_included_cpu_ms, prices.cpu_per_million_ms_usd),
        "dynamic_workers": extra_workers * prices.dynamic_worker_day_usd,
    }
    return RuntimeBill(
        runtime="loader",
        plan="Dynamic Workers (Workers Paid)",
        monthly_usd=round(sum(items.values()), 4),
        requests=requests,
        cpu_ms=usage.duration_ms,
        items=items,
    )


# --- the slot replay, through the pager's own policy -------------------------------------------


@dataclass(frozen=True)
class Access:
    at: float  # epoch s
    full: str
    type: str


def replay_cold_calls(accesses: Sequence[Access], *, slots: int) -> int:
    """How many of `accesses` would have found their capability paged out with `slots`
    slots, evicting as the pager does (pager.victims_needed, pager.eviction_rank). A
    capability's first access is not counted: it was placed when deployed, or before the
    pattern begins; it takes a slot all the same.

    The placed capabilities wait in a heap under the rank they had when pushed. A later
    access only raises a rank (the log has no expiry times, so a rank depends on the last
    access alone), so a victim is found by popping: an entry whose capability was accessed
    since goes back with its current rank, and the first entry still current is the one
    eviction_order would put first. A hit costs a dictionary write, and a replay of N
    calls O(N log N) at most.
    """
    placed: dict[str, Access] = {}  # full name -> its last access
    ranked: list[tuple[tuple, Access]] = []
    seen: set[str] = set()
    cold = 0
    for access in accesses:
        if access.full not in placed:
            if access.full in seen:
                cold += 1
            # No deletes are pending in a replay, so the margin never holds a newcomer back.
            for _ in range(pager.victims_needed(used=len(placed), leaving=0, slots=slots, margin=1) or 0):
                while True:
                    _, pushed = heapq.heappop(ranked)
                    last = placed[pushed.full]
                    if last is pushed:
                        del placed[pushed.full]
                        break
                    heapq.heappush(ranked, (_rank(last), last))
            heapq.heappush(ranked, (_rank(access), access))
            seen.add(access.full)
        placed[access.full] = access
    return cold


def _rank(access: Access) -> tuple:
    candidate = pager.Candidate(full=access.full, type=access.type, last_access=access.at)
    return pager.eviction_rank(candidate, now=access.at)


def smallest_slots(accesses: Sequence[Access], *, target: float = COLD_TARGET) -> int | None:
    """The fewest slots whose replay keeps cold calls under `target` of the accesses; None
    when there is nothing to replay. Cold calls only fall as slots grow (the policy ranks
    capabilities the same whatever the slot count), so a binary search finds it."""
    if not accesses:
        return None
    low, high = 1, len({access.full for access in accesses})  # with that many, none is ever cold
    while low < high:
        middle = (low + high) // 2
        if replay_cold_calls(accesses, slots=middle) < target * len(accesses):
            high = middle
        else:
            low = middle + 1
    return low


def access_log_read() -> list[Access]:
    """The recorded access pattern, oldest first (stats.ACCESS_LOG_KEY)."""
    accesses = []
    for entry in get_redis().lrange(stats.ACCESS_LOG_KEY, 0, -1):
        at, full, capability_type = entry.decode().split("|")
        accesses.append(Access(at=float(at), full=full, type=capability_type))
    return accesses


# --- the estimate --------------------------------------------------------------------------------


def cost_estimate(*, now: datetime, days: float = DAYS_PER_MONTH, prices: Prices | None = None) -> CostEstimate:
    """The monthly bill of the last `days` of traffic on each runtime, and the pool's figures.

    Reads the minute windows of the span once, the page-ins of the audit trail, one hour
    counter per hour of the span and the access log.
    """
    prices = prices or Prices.from_settings()
    until = now
    since = now - timedelta(days=days)
    scale = DAYS_PER_MONTH / days
    windows = CapabilityStatsWindow.objects.filter(window_start__gte=since, window_start__lt=until)

    calls = cold = 0
    duration_ms = 0.0
    per_day: dict[object, int] = defaultdict(int)
    called_days: set[tuple[str, object]] = set()
    buckets: list[int] = []
    rows = windows.values_list("full_name", "window_start", "calls", "cold_calls", "latency_ms_sum", "latency_buckets")
    for full, start, window_calls, window_cold, latency_ms, latency_buckets in rows.iterator():
        calls += window_calls
        cold += window_cold
        duration_ms += latency_ms
        per_day[start.date()] += window_calls
        called_days.add((full, start.date()))
        buckets = stats.add_buckets(buckets, latency_buckets)
    within_free_cpu = _calls_within(buckets, prices.free_cpu_ms_per_call)
    usage = Usage(
        calls=calls * scale,
        duration_ms=duration_ms * scale,
        busiest_day_calls=max(per_day.values(), default=0),
        calls_over_free_cpu_share=(calls - within_free_cpu) / calls if calls else 0.0,
        capabilities=Capability.objects.exclude(state=State.REMOVED).count(),
        dynamic_worker_days=len(called_days) * scale,
    )

    accesses = [a for a in access_log_read() if since.timestamp() <= a.at < until.timestamp()]
    slots = _smallest_slots_kept(accesses, days=days)
    pool = _pool_report(since=since, until=until, calls=calls, cold=cold, accesses=accesses, slots=slots)
    return CostEstimate(
        since=since,
        until=until,
        days=days,
        usage=usage,
        runtimes=[
            bill_workers_free(usage, prices, smallest_slots=slots),
            bill_workers_paid(usage, prices),
            bill_workers_for_platforms(usage, prices),
            bill_dynamic_workers(usage, prices),
        ],
        pool=pool,
        prices=prices,
    )


# The replay takes seconds on a full log: its result is kept this long, since a figure over
# weeks of calls does not move in minutes, and the dashboard reads it on every load.
SLOTS_KEPT_SECONDS = 300


def _smallest_slots_kept(accesses: list[Access], *, days: float) -> int | None:
    key = f"sigil:cost:slots:{days:g}"
    redis = get_redis()
    kept = redis.get(key)
    if kept is not None:
        return int(kept) if kept else None
    slots = smallest_slots(accesses)
    redis.set(key, "" if slots is None else slots, ex=SLOTS_KEPT_SECONDS)
    return slots


def _calls_within(buckets: list[int], limit_ms: float) -> int:
    """Calls whose latency bucket lies wholly within `limit_ms`."""
    return sum(count for bound, count in zip(stats.LATENCY_BUCKETS_MS, buckets, strict=False) if bound <= limit_ms)


def _pool_report(
    *, since: datetime, until: datetime, calls: int, cold: int, accesses: list[Access], slots: int | None
) -> PoolReport:
    hours = max(1, math.ceil((until - since).total_seconds() / 3600))
    page_in_hours: dict[int, int] = defaultdict(int)
    page_ins = AuditEvent.objects.filter(action="capability.paged_in", created_at__gte=since, created_at__lt=until)
    for at in page_ins.values_list("created_at", flat=True).iterator():
        page_in_hours[int(at.timestamp() // 3600)] += 1
    first_hour = int(since.timestamp() // 3600)
    hour_counts = _hourly_api_calls(range(first_hour, first_hour + hours + 1))
    api_calls = sum(hour_counts)
    budget_per_hour = settings.SIGIL_CF_RATE_LIMIT * 3600 / settings.SIGIL_CF_RATE_WINDOW_SECONDS
    return PoolReport(
        page_ins=sum(page_in_hours.values()),
        page_ins_per_hour=round(sum(page_in_hours.values()) / hours, 3),
        peak_page_ins_per_hour=max(page_in_hours.values(), default=0),
        cloudflare_api_calls=api_calls,
        cloudflare_api_calls_per_hour=round(api_calls / hours, 3),
        peak_cloudflare_api_calls_per_hour=max(hour_counts, default=0),
        cloudflare_api_budget_per_hour=budget_per_hour,
        calls=calls,
        cold_calls=cold,
        cold_share=cold / calls if calls else None,
        replayed_calls=len(accesses),
        replayed_since=datetime.fromtimestamp(accesses[0].at, tz=since.tzinfo) if accesses else None,
        smallest_slots_under_1pct=slots,
    )


def _hourly_api_calls(hours: Iterable[int]) -> list[int]:
    keys = [api_calls_hour_key(hour) for hour in hours]
    return [int(value or 0) for value in get_redis().mget(keys)] if keys else []
