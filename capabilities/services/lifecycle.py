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

from agents.services import agent_notify, audit_record
from capabilities import pager
from capabilities.models import Capability, CapabilityStatsWindow, CapabilityType, State
from capabilities.runtimes import get_runtime
from capabilities.services.placement import capability_page_in
from sigil.errors import NotFound, Unavailable


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
            audit_record(
                actor="system",
                action="capability.inactive",
                agent_name=capability.agent.name,
                subject=capability.full_name,
                detail=detail,
            )
            agent_notify(
                agent_name=capability.agent.name,
                event="capability.inactive",
                payload={"capability": capability.full_name, **detail},
            )
        marked += 1
    return marked


def capability_prewarm(*, now: datetime | None = None) -> list[str]:
    """Page in the most called capabilities of the last SIGIL_PREWARM_WINDOW_SECONDS that are
    not live, up to SIGIL_PREWARM_TOP_N, hottest first; return their names. Only on runtimes
    with a pager.

    On a full runtime a capability is prewarmed only when its victim is colder than it and
    was not prewarmed in this same run (pager.prewarm_allows); the first that is not stops
    the run, as every one after it is colder still. The victim is judged on the pager's
    state just before each page-in. An account that refuses a page-in for want of room
    (Cloudflare's 10037) ends the run: prewarm never pages out a capability it did not
    judge. Idempotent: what is live is left alone.
    """
    runtime = get_runtime()
    if runtime.total_slots is None:
        return []
    now = now or timezone.now()
    since = now - timedelta(seconds=settings.SIGIL_PREWARM_WINDOW_SECONDS)
    window_calls = dict(
        CapabilityStatsWindow.objects.filter(window_start__gte=since)
        .values("full_name")
        .annotate(calls=Sum("calls"))
        .values_list("full_name", "calls")
    )
    ranked = sorted(window_calls, key=lambda full: (-window_calls[full], full))
    top = ranked[: min(settings.SIGIL_PREWARM_TOP_N, runtime.total_slots)]
    cold = set(
        Capability.objects.filter(full_name__in=top, state__in=(State.PAGED_OUT,)).values_list("full_name", flat=True)
    )
    warmed: list[str] = []
    for full in (f for f in top if f in cold):
        usage = pager.pager_usage()
        allowed = pager.prewarm_allows(
            calls=window_calls[full],
            candidates=pager.pager_candidates(),
            window_calls=window_calls,
            placed_this_round=warmed,
            victims=pager.victims_needed(
                used=usage.used, leaving=usage.evicting, slots=runtime.total_slots, margin=runtime.safety_margin
            ),
            now=time.time(),
        )
        if not allowed:
            break
        try:
            _, placed = capability_page_in(full=full, reason="prewarm")
        except NotFound:
            continue  # removed since the window was counted
        except Unavailable:
            break  # the account refused it for want of room (the owner was told): so it would the next
        if placed:  # not paged in by a call meanwhile
            warmed.append(full)
    return warmed
