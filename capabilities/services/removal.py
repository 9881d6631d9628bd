"""Removing capabilities: by their agent, by the owner, and ephemerals whose TTL has passed."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone

from agents.tokens import Principal
from capabilities import names
from capabilities.books import call_logs, failures, pager
from capabilities.jobs import capability_release_slot as capability_release_slot_task
from capabilities.models import Capability, CapabilityType, State
from capabilities.runtimes import get_runtime
from capabilities.services.placement_lock import placement_lock
from capabilities.services.records import capability_audit, capability_written
from capabilities.services.versions import actor_of
from sigil.errors import Forbidden, NotFound


def capability_remove(*, principal: Principal, full: str) -> Capability:
    """An agent removes one of its capabilities: stop serving now, delete from the runtime
    in the background. The row and its versions stay (state removed) for the audit trail.

    Raises Forbidden (not the caller's prefix, or no deploy scope) or NotFound.
    """
    agent_name, _ = names.split_full_name(full)
    if not principal.can_deploy:
        raise Forbidden("removing needs a token with the deploy scope")
    if agent_name != principal.agent_name:
        raise Forbidden(f"{full} is not under {principal.agent_name}'s prefix")
    return _remove(full=full, actor=actor_of(principal), action="capability.removed")


def capability_remove_as_owner(*, full: str, actor: str) -> Capability:
    """The owner removes any capability, as capability_remove does. Raises NotFound."""
    return _remove(full=full, actor=actor, action="capability.removed")


def _remove(*, full: str, actor: str, action: str, only_if_expired_by: datetime | None = None) -> Capability:
    # Under the placement lock: a deploy or page-in under way finishes first (it would
    # otherwise record the capability live again), and the pager's sets change with the row.
    with placement_lock(full, blocking=True):
        now = timezone.now()
        with capability_written(full):
            query = Capability.objects.select_for_update().exclude(state=State.REMOVED).filter(full_name=full)
            if only_if_expired_by is not None:
                query = query.filter(expires_at__lte=only_if_expired_by)
            capability = query.first()
            if capability is None:
                raise NotFound(f"no capability {full}")
            capability.state = State.REMOVED
            capability.removed_at = now
            capability.updated_at = now
            capability.save(update_fields=["state", "removed_at", "updated_at"])
            capability_audit(capability, actor=actor, action=action)
            capability_release_slot_task.delay_on_commit(capability_id=capability.pk)
        # A capability deployed later under the same name starts with no failures (nor call
        # records) of this one.
        failures.failures_forget(full=full)
        call_logs.call_records_forget(full=full)
        # One never placed (its first deploy still queued) holds no slot to give back.
        if get_runtime().total_slots is not None and capability.slot:
            pager.pager_mark_leaving(full, now=now.timestamp())
    # The placement of a staged version in traffic goes with its capability.
    for variant in Capability.objects.filter(variant_of=capability).exclude(state=State.REMOVED):
        try:
            _remove(full=variant.full_name, actor=actor, action=action)
        except NotFound:
            continue
    return capability


def capability_expire_ephemerals(*, now: datetime | None = None, batch_size: int = 200) -> int:
    """Remove ephemerals whose TTL has passed; return how many. Safe to overlap with itself."""
    now = now or timezone.now()
    expired = list(
        Capability.objects.filter(type=CapabilityType.EPHEMERAL, expires_at__lte=now)
        .exclude(state=State.REMOVED)
        .values_list("full_name", flat=True)[:batch_size]
    )
    count = 0
    for full in expired:
        try:
            _remove(full=full, actor="system", action="capability.expired", only_if_expired_by=now)
        except NotFound:
            continue  # removed meanwhile by its agent or a concurrent expiry run
        count += 1
    return count
