"""Lifecycle crons: marking long-unused capabilities inactive, and prewarming the most called
ones on runtimes with a pager.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from agents.services import agent_notify
from capabilities.books import pager
from capabilities.models import Capability, CapabilityStatsWindow, CapabilityType, State
from capabilities.runtimes import get_runtime
from capabilities.services.page_outs import PAGE_OUT_GRACE_SECONDS, capability_page_out_chosen, pager_built
from capabilities.services.placement import capability_page_in
from capabilities.services.records import capability_audit
from sigil import redis_keys
from sigil.errors import NotFound, Unavailable
from sigil.leases import Lease


def capability_mark_inactive(*, now: datetime | None = None, batch_size: int = 500) -> int:
    """Mark normal capabilities not called for SIGIL_INACTIVE_AFTER_DAYS as inactive and tell
    their agents; return how many. Persistent ones are never touched; a later call clears
    the mark (the stats flush does). Idempotent: a marked capability is not marked again."""
    now = now or timezone.now()
    cutoff = now - timedelta(days=settings.SIGIL_INACTIVE_AFTER_DAYS)
    stale = (
        Capability.objects.filter(type=CapabilityType.NORMAL, inactive_at__isnull=True)
        .exclude(state=State.REMOVED)
        .filter(Q(last_access_at__lt=cutoff) | Q(last_access_at__isnull=True, created_at__lt=cutoff))
        .select_related("agent")[:batch_size]
    )
    marked = 0
    for capability in stale:
        with transaction.atomic():
            claimed = Capability.objects.filter(pk=capability.pk, inactive_at__isnull=True).update(inactive_at=now)
            if not claimed:
                continue  # another run got there first
            detail = {"last_access_at": capability.last_access_at.isoformat() if capability.last_access_at else None}
            capability_audit(capability, actor="system", action="capability.inactive", detail=detail)
            agent_notify(
                agent_name=capability.agent.name,
                event="capability.inactive",
                payload={"capability": capability.full_name, **detail},
            )
        marked += 1
    return marked


def capability_prewarm(*, now: datetime | None = None) -> list[str]:
    """Place the hourly top-N and keep it placed: the SIGIL_PREWARM_TOP_N capabilities (at
    most the runtime's slots) most called in the last SIGIL_PREWARM_WINDOW_SECONDS that are
    not live are paged in, hottest first; return their names. Only on runtimes with a pager.

    The choice is the pager's `prewarm_plan`, on the pager's state at the start of the run:
    free slots are filled first, and only capabilities outside the top-N are paged out to
    make more room, least valuable first in the pager's eviction order, each before the
    page-in it makes room for; a capability of the top-N is never paged out for another.
    Prewarm never pages out a capability it did not judge: its page-ins evict nothing, so
    one that finds no free slot (a call took it meanwhile), or that the account refuses for
    want of room (Cloudflare's 10037), ends the run. Idempotent: what is live is left alone.
    One run at a time: a run that finds another under way places nothing and returns [].
    """
    runtime = get_runtime()
    if runtime.total_slots is None:
        return []
    # Two prewarm runs at once (the beat's and an owner's) would each judge the pager's state
    # before the other's page-ins and page out what the other just placed: one run at a time.
    lease = Lease(redis_keys.PREWARM_LEASE, hold_seconds=settings.CELERY_TASK_SOFT_TIME_LIMIT, blocking=False)
    if not lease.acquire():
        return []
    try:
        return _prewarm(runtime, now=now or timezone.now())
    finally:
        if lease.owned():
            lease.release()


def _prewarm(runtime, *, now: datetime) -> list[str]:
    top = prewarm_top(now=now, count=min(settings.SIGIL_PREWARM_TOP_N, runtime.total_slots))
    cold = set(Capability.objects.filter(full_name__in=top, state=State.PAGED_OUT).values_list("full_name", flat=True))
    pager_built()
    plan = pager.prewarm_plan(
        top=top,
        cold=cold,
        candidates=pager.pager_candidates(),
        used=pager.pager_usage().used,
        slots=runtime.total_slots,
        now=time.time(),
    )
    victims = list(plan.evict)
    warmed: list[str] = []
    for full in plan.place:
        while victims and pager.pager_usage().used >= runtime.total_slots:
            deadline = time.monotonic() + settings.SIGIL_INVOKE_TIMEOUT_SECONDS + PAGE_OUT_GRACE_SECONDS
            capability_page_out_chosen(full=victims.pop(0), reason="prewarm", deadline=deadline)
        try:
            _, placed = capability_page_in(full=full, reason="prewarm")
        except NotFound:
            continue  # removed since the window was counted
        except Unavailable:
            break  # no free slot, or the account refused it for want of room (the owner was told)
        if placed:  # not paged in by a call meanwhile
            warmed.append(full)
    return warmed


def prewarm_top(*, now: datetime, count: int) -> list[str]:
    """The `count` capabilities called most in the prewarm window before `now`, hottest first
    (ties by name), among those that exist (neither removed nor expired). Reads only."""
    since = now - timedelta(seconds=settings.SIGIL_PREWARM_WINDOW_SECONDS)
    window_calls = dict(
        CapabilityStatsWindow.objects.filter(window_start__gte=since)
        .values("full_name")
        .annotate(calls=Sum("calls"))
        .filter(calls__gt=0)
        .values_list("full_name", "calls")
    )
    existing = set(
        Capability.objects.filter(full_name__in=window_calls)
        .exclude(state=State.REMOVED)
        .exclude(expires_at__lte=now)
        .values_list("full_name", flat=True)
    )
    ranked = sorted(existing, key=lambda full: (-window_calls[full], full))
    return ranked[:count]
