"""Ending the work a dead process held: every accepted deploy, rollback and page-out ends,
and every mark it held in what the hosts share is freed, within a bound.

A Celery worker's main process killed with -9 acknowledges nothing: the broker gives its
tasks to another worker only after its visibility timeout (settings). What it held is
owned by leases (sigil/leases.py), so a lease after its death this reaper, run by
beat every SIGIL_REAP_INTERVAL_SECONDS (and by reconcile), finds the work nobody owns and
sends it again or ends it with a recorded outcome. Bound: SIGIL_LEASE_SECONDS plus
SIGIL_REAP_INTERVAL_SECONDS until a resend (30 s by default), and a deploy no worker takes
after DEPLOY_RESENDS resends is failed one interval later each (about a minute).
"""

from __future__ import annotations

import time

from agents.services import audit_record
from capabilities.books import pager
from capabilities.models import Capability, State
from capabilities.services.deploy_task import capability_reap_deploys
from capabilities.services.page_outs import page_out_later
from capabilities.services.placement_lock import placement_in_progress
from sigil import leases, redis_keys
from sigil.redis_client import get_redis


def capability_reap() -> dict[str, int]:
    """Send again, or end, the deploys, rollbacks and page-outs whose owner died, and free
    the `placing` entries of dead placers. Idempotent; returns the counts of each."""
    return {**capability_reap_deploys(), **capability_reap_placements()}


def capability_reap_placements(*, now: float | None = None) -> dict[str, int]:
    """End what a dead process left of its placements and page-outs, once its lease is over:
    a `placing` entry whose placer's lock is gone gives its slot back (and the victims that
    placement chose are paged out); a page-out due more than a lease ago whose capability is
    still evicting, its lock free, is sent again. Each is audited. Idempotent; returns counts.
    """
    now = time.time() if now is None else now
    freed = 0
    for full in pager.pager_placing():
        if not pager.pager_drop_unheld_placing(full, lock_key=redis_keys.place_lock(full)):
            continue
        victims = pager.pager_take_chosen(full)
        audit_record(
            actor="system",
            action="pager.placing_freed",
            subject=full,
            detail={"reason": "its placer died", "victims": victims},
        )
        for victim in victims:
            page_out_later(victim)
        freed += 1
    resent = 0
    redis = get_redis()
    overdue = [m.decode() for m in redis.zrangebyscore(redis_keys.PAGE_OUTS_DUE, "-inf", now - leases.lease_seconds())]
    evicting = set(
        Capability.objects.filter(full_name__in=overdue, state=State.EVICTING).values_list("full_name", flat=True)
    )
    for full in overdue:
        if full not in evicting:
            redis.zrem(redis_keys.PAGE_OUTS_DUE, full)
        elif not placement_in_progress(full):
            audit_record(
                actor="system",
                action="capability.page_out_resent",
                subject=full,
                detail={"reason": "its worker was lost"},
            )
            page_out_later(full)
            resent += 1
    return {"placing_freed": freed, "page_outs_resent": resent}
