"""Lifecycle crons: marking long-unused capabilities inactive, and prewarming the most called
ones on runtimes with a pager.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from agents.services import agent_notify, audit_record
from capabilities.models import Capability, CapabilityStatsWindow, CapabilityType, State
from capabilities.runtimes import get_runtime
from capabilities.services.placement import capability_page_in
from sigil_site.errors import NotFound


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
    not live, up to SIGIL_PREWARM_TOP_N; return their names. Only on runtimes with a pager."""
    runtime = get_runtime()
    if runtime.total_slots is None:
        return []
    now = now or timezone.now()
    since = now - timedelta(seconds=settings.SIGIL_PREWARM_WINDOW_SECONDS)
    top = list(
        CapabilityStatsWindow.objects.filter(window_start__gte=since)
        .values("full_name")
        .annotate(calls=Sum("calls"))
        .order_by("-calls", "full_name")
        .values_list("full_name", flat=True)[: min(settings.SIGIL_PREWARM_TOP_N, runtime.total_slots)]
    )
    cold = set(
        Capability.objects.filter(full_name__in=top, state__in=(State.PAGED_OUT,)).values_list("full_name", flat=True)
    )
    warmed = []
    for full in (f for f in top if f in cold):
        try:
            capability_page_in(full=full, reason="prewarm")
        except NotFound:
            continue  # removed since the window was counted
        warmed.append(full)
    return warmed
