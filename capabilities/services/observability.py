"""Statistics and the breaker: flushing Redis counters into per-minute windows, error-rate
alerts, recording breaker transitions, pruning old windows.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from agents.models import Token
from agents.services import agent_notify, audit_record
from capabilities import jobs, names
from capabilities.books import breaker, call_logs, stats
from capabilities.models import BreakerState, Capability, CapabilityStatsWindow, State, StatsFlush
from capabilities.services.records import capability_audit
from sigil import redis_keys
from sigil.edge_state import edge_mark, route_key
from sigil.errors import Degraded
from sigil.redis_client import get_redis

# Leftover batches one flush retries before claiming its own: bounded, so that a batch the
# database keeps refusing cannot grow one run without end.
PENDING_BATCHES_PER_FLUSH = 20


def capability_flush_stats(*, batch_size: int = 500, now: datetime | None = None) -> int:
    """Move the hot path's counters from Redis into the database; return how many
    capabilities' counters it applied.

    Each capability's totals grow, and the calls land in the stats window of the minute
    they were claimed in. Crash-safe and exactly once (see redis_keys.STATS_PENDING): batches left
    pending by a flush that died are applied first, unless the database already holds
    them. Then the traffic splits' guards look at the new figures. Safe to overlap with
    itself. Raises the database's errors, leaving the batch pending for the next run.
    """
    now = now or timezone.now()
    applied = 0
    for batch in stats.stats_pending(limit=PENDING_BATCHES_PER_FLUSH):
        applied += _apply_and_release(batch)
    batch = stats.stats_claim(now_epoch=now.timestamp(), batch_size=batch_size)
    if batch is not None:
        applied += _apply_and_release(batch)
    _flush_token_use()
    if applied:
        from capabilities.services.splits import capability_split_guard

        capability_split_guard()  # it reads the windows just written
    return applied


def _apply_and_release(batch: stats.StatsBatch) -> int:
    applied = capability_apply_stats(batch=batch)
    stats.stats_release(batch.flush_id)
    return len(batch.calls) if applied else 0


@transaction.atomic
def capability_apply_stats(*, batch: stats.StatsBatch) -> bool:
    """Add a claimed batch of counters to the capabilities' totals and minute windows, in one
    transaction; return False when the batch was applied before (idempotent by flush id)."""
    # First write of the transaction: a concurrent flush applying the same batch waits on
    # this row's unique key, then finds it.
    _, created = StatsFlush.objects.get_or_create(flush_id=batch.flush_id)
    if not created:
        return False
    window_start = datetime.fromtimestamp(batch.claimed_epoch, tz=UTC).replace(second=0, microsecond=0)
    for full, taken in sorted(batch.calls.items()):  # one lock order for overlapping flushes
        if taken.calls == 0 and taken.refused == 0:
            continue
        capability = Capability.objects.select_for_update().exclude(state=State.REMOVED).filter(full_name=full).first()
        if capability is not None:
            _add_counters(capability, taken, {counter: total for counter, (total, _) in SUMMED.items()})
            if taken.last_access_epoch is not None:
                capability.last_access_at = datetime.fromtimestamp(taken.last_access_epoch, tz=UTC)
                capability.inactive_at = None  # called again: active
            totals = [total for total, _ in SUMMED.values()]
            capability.save(update_fields=[*totals, "last_access_at", "inactive_at"])
        window, _ = CapabilityStatsWindow.objects.select_for_update().get_or_create(
            full_name=full,
            window_start=window_start,
            defaults={"agent_name": full.split(names.SEPARATOR, 1)[0]},
        )
        _add_counters(window, taken, {counter: window_sum for counter, (_, window_sum) in SUMMED.items()})
        window.save()
        _alert_on_error_rate(window)
    return True


# Each counter of a claimed batch (stats.CallStats) and the fields it is added to: the
# capability's total, and its minute window's sum.
SUMMED = {
    "calls": ("calls_total", "calls"),
    "errors": ("errors_total", "errors"),
    "latency_ms": ("latency_ms_total", "latency_ms_sum"),
    "cold_calls": ("cold_calls_total", "cold_calls"),
    "page_in_ms": ("page_in_ms_total", "page_in_ms_sum"),
    "buckets": ("latency_buckets_total", "latency_buckets"),
    "refused": ("refused_total", "refused"),
    "statuses": ("statuses_total", "statuses"),
    "codes": ("codes_total", "codes"),
}


def _add_counters(row, taken: stats.CallStats, fields: dict[str, str]) -> None:
    """Add `taken`'s counters to `row`'s fields (counter → field name): histograms bucket by
    bucket, counts by status class or code key by key, the rest as numbers."""
    for counter, name in fields.items():
        value, more = getattr(row, name), getattr(taken, counter)
        if isinstance(more, list):
            value = stats.add_buckets(value, more)
        elif isinstance(more, dict):
            value = stats.add_counts(value, more)
        else:
            value += more
        setattr(row, name, value)


def _alert_on_error_rate(window: CapabilityStatsWindow) -> None:
    """Tell the agent when a capability's error rate in this minute crosses the threshold;
    at most once per SIGIL_ALERT_COOLDOWN_SECONDS per capability."""
    if window.calls < settings.SIGIL_ALERT_MIN_CALLS:
        return
    rate = window.errors / window.calls
    if rate < settings.SIGIL_ALERT_ERROR_RATE:
        return
    if not get_redis().set(
        redis_keys.error_rate_alert(window.full_name), 1, nx=True, ex=settings.SIGIL_ALERT_COOLDOWN_SECONDS
    ):
        return
    detail = {
        "error_rate": round(rate, 4),
        "calls": window.calls,
        "errors": window.errors,
        "window_start": window.window_start.isoformat(),
    }
    audit_record(
        actor="system",
        action="capability.error_rate_alert",
        agent_name=window.agent_name,
        subject=window.full_name,
        detail=detail,
    )
    agent_notify(
        agent_name=window.agent_name,
        event="capability.error_rate_alert",
        payload={
            "capability": window.full_name,
            **detail,
            **call_logs.call_records_alert_fields(full=window.full_name),
        },
    )


def _flush_token_use() -> None:
    # Stamps leave Redis only once the database holds them; after a crash in between they
    # are written again, which is harmless: a stamp is set, not added.
    used = stats.tokens_used_read()
    for token_hash, stamp in used.items():
        Token.objects.filter(secret_hash=token_hash).update(last_used_at=datetime.fromtimestamp(float(stamp), tz=UTC))
    stats.tokens_used_forget(used)


def breaker_enter(rules: breaker.Breaker, redis, *, full: str, raw: bytes, now: float) -> bool:
    """Admit a call past `full`'s breaker (breaker.Breaker.enter: True for the half-open
    breaker's one trial). Raises Degraded when it refuses; a staged version refused counts
    toward its split's guard (stats.split_refusal_count), which is asked to look when due. No
    SQL: the engine calls it on the hot path, one more round trip for staged versions only."""
    try:
        return rules.enter(redis, full=full, raw=raw, now=now)
    except Degraded:
        breaker_refused(redis, full=full)
        raise


def breaker_refused(redis, *, full: str) -> None:
    """Count a call `full`'s breaker refused (at the origin, or at the edge and reported): a
    staged version's counts toward its split's guard (stats.split_refusal_count), which is asked
    to look when due. One round trip for a staged version, none otherwise; no SQL."""
    if names.is_variant(full) and stats.split_refusal_count(redis, variant=full):
        jobs.capability_split_guard.delay()


def breaker_changed(*, full: str, change: bytes | str | None, at_epoch: float) -> None:
    """Act on what a breaker script reported ('opened', 'closed'; '' is none): the transition
    is persisted by the record task (capability_record_breaker), and a staged version whose
    breaker opened has its split's guard look at once. No SQL: it only sends tasks."""
    state = breaker.transition(change)
    if state is None:
        return
    jobs.capability_record_breaker.delay(full=full, state=state, at_epoch=at_epoch)
    if state == BreakerState.OPEN and names.is_variant(full):
        jobs.capability_split_guard.delay()


def capability_record_breaker(*, full: str, state: str, at_epoch: float, announce: bool = True) -> bool:
    """Persist a breaker transition on the capability's row: the one writer of the breaker's
    database copy (breaker_state, breaker_opened_at), which the admin and the API read. With
    `announce`, a change is audited (capability.degraded, capability.recovered) and an opening
    sent to the agent's webhook; the owner's force announces itself instead. Returns whether
    the row changed. Idempotent.

    Every change of the breaker's state reaches it (a transition the record script reported,
    the owner's force and reset), so the capability's route at the edge, which carries the
    breaker, is marked to be published again here, changed row or not (a failed trial opens
    the breaker again until a later time)."""
    edge_mark(route_key(full))
    opened_at = datetime.fromtimestamp(at_epoch, tz=UTC) if state == BreakerState.OPEN else None
    with transaction.atomic():
        capability = Capability.objects.exclude(state=State.REMOVED).filter(full_name=full).first()
        if capability is None or capability.breaker_state == state:
            return False
        capability.breaker_state = state
        capability.breaker_opened_at = opened_at
        capability.save(update_fields=["breaker_state", "breaker_opened_at"])
        if not announce:
            return True
        action = "capability.degraded" if state == BreakerState.OPEN else "capability.recovered"
        capability_audit(capability, actor="system", action=action)
        if state == BreakerState.OPEN:
            agent_notify(
                agent_name=capability.agent.name,
                event=action,
                payload={
                    "capability": full,
                    "reason": "circuit breaker opened after repeated failures",
                    **call_logs.call_records_alert_fields(full=full),
                },
            )
    return True


def capability_prune_stats(*, now: datetime | None = None, batch_size: int = 10_000) -> int:
    """Delete minute windows older than SIGIL_STATS_RETENTION_DAYS; return how many.

    Totals on each capability are kept; only the per-minute history goes. Safe to overlap
    with itself: each run deletes one bounded batch of the oldest rows.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(days=settings.SIGIL_STATS_RETENTION_DAYS)
    old = list(
        CapabilityStatsWindow.objects.filter(window_start__lt=cutoff)
        .order_by("window_start")
        .values_list("pk", flat=True)[:batch_size]
    )
    deleted, _ = CapabilityStatsWindow.objects.filter(pk__in=old).delete()
    # A flush's record is needed only while its batch may still be pending in Redis.
    StatsFlush.objects.filter(applied_at__lt=cutoff).delete()
    return deleted
