"""What the recorded traffic would cost a month on each Cloudflare runtime, and how the pool
copes with it: reads for the owner's cost page, `GET /_api/cost` and `manage.py cost`.

Sources, all recorded by Sigil: the per-minute windows the stats flush writes (calls, their
duration, cold calls, which capabilities were called each day), the audit trail's page-ins,
the Cloudflare API calls counted per hour, in all, by class of work and by operation
(capabilities.runtimes.cloudflare: the KV operations among them are billed), and the access log of
the last calls (redis_keys.ACCESS_LOG), which is replayed through the pager's own eviction
policy to find the smallest slot count that would have kept cold calls under 1 %.

Sigil cannot see the CPU time Cloudflare bills: it bills each call's recorded duration
(through Sigil, so waiting included) as CPU time, an upper bound.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from django.conf import settings

from agents.models import AuditEvent
from capabilities.books import pager, stats
from capabilities.models import Capability, CapabilityStatsWindow, State
from capabilities.runtimes import runtime_classes
from capabilities.runtimes.billing import Prices, RuntimeBill, Usage, prices_with
from sigil import redis_keys
from sigil.redis_client import get_redis

DAYS_PER_MONTH = 30
# The share of calls that may be cold for a slot count to be enough.
COLD_TARGET = 0.01


@dataclass(frozen=True)
class PoolReport:
    page_ins: int
    page_ins_per_hour: float
    peak_page_ins_per_hour: int
    cloudflare_api_calls: int
    cloudflare_api_calls_per_hour: float
    peak_cloudflare_api_calls_per_hour: int
    cloudflare_api_budget_per_hour: float
    # What spent the budget: the calls by the class of work they were made for, and by operation.
    cloudflare_api_calls_by_class: dict[str, int]
    cloudflare_api_calls_by_operation: dict[str, int]
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
    """The recorded access pattern, oldest first (redis_keys.ACCESS_LOG)."""
    accesses = []
    for entry in get_redis().lrange(redis_keys.ACCESS_LOG, 0, -1):
        at, full, capability_type = entry.decode().split("|")
        accesses.append(Access(at=float(at), full=full, type=capability_type))
    return accesses


# --- the estimate --------------------------------------------------------------------------------


def cost_estimate(*, now: datetime, days: float = DAYS_PER_MONTH, prices: Prices | None = None) -> CostEstimate:
    """The monthly bill of the last `days` of traffic on each runtime, and the pool's figures,
    at `prices` (by default Cloudflare's table with SIGIL_CLOUDFLARE_PRICES over it).

    Reads the minute windows of the span once, the page-ins of the audit trail, one hour
    counter per hour of the span and the access log.
    """
    prices = prices or prices_with(settings.SIGIL_CLOUDFLARE_PRICES)
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
        tail_worker=settings.SIGIL_LOGS_ENABLED,
    )

    accesses = [a for a in access_log_read() if since.timestamp() <= a.at < until.timestamp()]
    slots = _smallest_slots_kept(accesses, days=days)
    pool = _pool_report(since=since, until=until, calls=calls, cold=cold, accesses=accesses, slots=slots)
    usage = dataclasses.replace(usage, **kv_usage(pool.cloudflare_api_calls_by_operation, scale=scale))
    return CostEstimate(
        since=since,
        until=until,
        days=days,
        usage=usage,
        # Each runtime's own bills, in SIGIL_BACKEND's order (the local runtime has none).
        runtimes=[bill for runtime in runtime_classes() for bill in runtime.bills(usage, prices, smallest_slots=slots)],
        pool=pool,
        prices=prices,
    )


def kv_usage(by_operation: dict[str, int], *, scale: float) -> dict[str, float]:
    """The Workers KV operations a month of Sigil's API calls `by_operation` (scaled by `scale`)
    makes Cloudflare bill: each read, write and delete of a value and each page of keys listed
    through the API. Call records cost none while the origin takes their pushes (the report
    channel); what the Workers spool meanwhile goes through their bindings, unseen here."""
    return {
        "kv_reads": by_operation.get("kv-read", 0) * scale,
        "kv_writes": by_operation.get("kv-write", 0) * scale,
        "kv_deletes": by_operation.get("kv-delete", 0) * scale,
        "kv_lists": by_operation.get("kv-list", 0) * scale,
    }


# The replay takes seconds on a full log: its result is kept this long, since a figure over
# weeks of calls does not move in minutes, and the dashboard reads it on every load.
SLOTS_KEPT_SECONDS = 300


def _smallest_slots_kept(accesses: list[Access], *, days: float) -> int | None:
    key = redis_keys.cost_slots(days)
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
    span = range(first_hour, first_hour + hours + 1)
    hour_counts = _hourly_api_calls(span)
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
        cloudflare_api_calls_by_class=_hourly_api_calls_by(redis_keys.cf_calls_hour_by_class, span),
        cloudflare_api_calls_by_operation=_hourly_api_calls_by(redis_keys.cf_calls_hour_by_operation, span),
        calls=calls,
        cold_calls=cold,
        cold_share=cold / calls if calls else None,
        replayed_calls=len(accesses),
        replayed_since=datetime.fromtimestamp(accesses[0].at, tz=since.tzinfo) if accesses else None,
        smallest_slots_under_1pct=slots,
    )


def _hourly_api_calls(hours: Iterable[int]) -> list[int]:
    keys = [redis_keys.cf_calls_hour(hour) for hour in hours]
    return [int(value or 0) for value in get_redis().mget(keys)] if keys else []


def _hourly_api_calls_by(key_of: Callable[[int], str], hours: Iterable[int]) -> dict[str, int]:
    """The API calls of `hours` summed by the field of their hourly hashes (`key_of(hour)`),
    most first."""
    pipe = get_redis().pipeline(transaction=False)
    for hour in hours:
        pipe.hgetall(key_of(hour))
    totals: dict[str, int] = defaultdict(int)
    for counts in pipe.execute():
        for field, count in counts.items():
            totals[field.decode()] += int(count)
    return dict(sorted(totals.items(), key=lambda item: (-item[1], item[0])))
