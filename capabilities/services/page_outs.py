"""Paging capabilities out on runtimes with a slot limit: marking victims evicting (still
served), deleting their scripts once their calls in flight end, shedding what is over the
slots, the owner's evict, and recording a script the runtime lost. Also the pager's view
of the registry, which the pager is handed (it reads no database itself).
"""

from __future__ import annotations

import time

from django.conf import settings
from django.utils import timezone

from capabilities.books import copies, pager, routes
from capabilities.jobs import PAGE_OUT_RECHECK_SECONDS
from capabilities.jobs import capability_page_out as capability_page_out_task
from capabilities.models import Capability, State
from capabilities.runtimes import get_runtime, runtime_for
from capabilities.runtimes.base import Runtime
from capabilities.runtimes.errors import RuntimeUnavailable
from capabilities.services.placement_lock import placement_lock
from capabilities.services.records import capability_audit, capability_written
from sigil import redis_keys
from sigil.redis_client import get_redis
from sigil.work import MAX_COUNTDOWN_SECONDS

# A victim's delete waits for its calls in flight up to the invoke timeout after new calls
# were turned away from it, plus this: no call still within its timeout is cut.
PAGE_OUT_GRACE_SECONDS = 2.0
# How long restoring a victim waits for its placement lock before leaving it evicted.
RESTORE_LOCK_WAIT_SECONDS = 10


def same_runtime(runtime: Runtime) -> tuple[str, ...]:
    """The `backend` values of rows placed on `runtime` ("" for rows from before it was recorded)."""
    return ("", runtime.name) if runtime is get_runtime() else (runtime.name,)


def pager_rows() -> dict[str, pager.RegistryRow]:
    """What the registry says the pager holds: the live and evicting rows placed on this
    runtime (during a switch of SIGIL_BACKEND, those still on the previous runtime do not
    take its slots)."""
    rows = Capability.objects.filter(
        state__in=(State.LIVE, State.EVICTING), backend__in=same_runtime(get_runtime())
    ).values_list("full_name", "type", "state", "last_access_at", "updated_at", "expires_at")
    return {row[0]: pager.RegistryRow(*row[1:]) for row in rows.iterator()}


def pager_built() -> None:
    """Have the pager's sets, rebuilt from the registry if Redis lost them (restart, flush)."""
    pager.pager_ensure_built(rows=pager_rows)


def page_out_later(full: str) -> None:
    """Page `full` out in the background (once the transaction commits), its due time noted."""
    _page_out_due(full, within=0)
    capability_page_out_task.delay_on_commit(full=full)


def _page_out_due(full: str, *, within: float) -> None:
    get_redis().zadd(redis_keys.PAGE_OUTS_DUE, {full: time.time() + within})


def mark_evicting(victim: str) -> bool:
    """A victim keeps serving while the newcomer is placed; returns whether it was live.

    A victim the database does not have live is not this placement's to page out: one being
    removed keeps its evicting entry until its delete is done; any other has no script, so
    it stops holding margin.
    """
    with capability_written(victim) as write:
        capability = (
            Capability.objects.select_for_update().exclude(state=State.REMOVED).filter(full_name=victim).first()
        )
        if capability is None or capability.state != State.LIVE:
            write.unchanged()
            if capability is not None and capability.state != State.EVICTING:
                pager.pager_drop_evicting(victim)
            return capability is not None and capability.state == State.EVICTING
        capability.state = State.EVICTING
        capability.updated_at = timezone.now()
        capability.save(update_fields=["state", "updated_at"])
    return True


def restore_victim(victim: pager.Candidate) -> None:
    """Serve a victim again whose eviction was called off. If its lock is held too long
    (it is being removed or evicted by the owner), it is paged out after all."""
    lock = placement_lock(victim.full, blocking=True, wait_seconds=RESTORE_LOCK_WAIT_SECONDS)
    if not lock.acquire():
        page_out_later(victim.full)
        return
    try:
        with capability_written(victim.full) as write:
            restored = Capability.objects.filter(full_name=victim.full, state=State.EVICTING).update(state=State.LIVE)
            if not restored:
                write.unchanged()
        if restored:
            pager.pager_restore(victim)
    finally:
        lock.release()


def capability_shed_excess(*, now: float | None = None) -> list[str]:
    """Page out the capabilities over the runtime's slots (after its quota was lowered), least
    valuable first in the eviction order; return their names. They are deleted in the
    background, once their calls in flight end. Idempotent: nothing over, nothing done."""
    runtime = get_runtime()
    if runtime.total_slots is None:
        return []
    pager_built()
    victims = pager.pager_shed_excess(now=now or time.time(), slots=runtime.total_slots)
    shed = []
    for victim in victims:
        if mark_evicting(victim.full):
            page_out_later(victim.full)
            shed.append(victim.full)
    return shed


def page_out_for_account(*, newcomer: str, deadline: float) -> str | None:
    """Page out the least valuable live capability now (never `newcomer`, which is being
    placed): mark it evicting, then delete its script once its calls in flight end, waiting
    until `deadline` (monotonic) at most. Returns its name, or None when none could go."""
    pager_built()
    usage = pager.pager_usage()
    for victim in pager.pager_shed_excess(now=time.time(), slots=max(0, usage.used - 1)):
        if victim.full == newcomer:
            continue
        # A capability whose lock is held is being placed, paged or removed by another, or
        # is the one this placement is for (a split's base, whose staged version this is):
        # waiting for that lock could wait on this very placement, so it is passed over,
        # back in its class (the shed moved it to the evicting set).
        lock = placement_lock(victim.full, blocking=False)
        if not lock.acquire():
            pager.pager_restore(victim)
            continue
        try:
            if not mark_evicting(victim.full):
                continue
            # A failed delete is the page-out task's to finish; this placement is shed.
            return victim.full if page_out_when_idle(victim.full, deadline=deadline) else None
        finally:
            lock.release()
    return None


def capability_page_out_chosen(*, full: str, reason: str, deadline: float) -> bool:
    """Page `full` out now because `reason` (prewarm) chose it to make room: it is marked
    evicting (and still served), then its script is deleted once its calls in flight end
    (waiting until `deadline`, monotonic) and it is recorded paged out.

    Returns whether it was paged out: not when it is no longer live, or another placement
    holds its lock, or its delete failed (the page-out task finishes that one, and it holds
    the runtime's margin meanwhile). Raises nothing of the runtime's. Idempotent.
    """
    lock = placement_lock(full, blocking=False)
    if not lock.acquire():
        return False
    try:
        if not mark_evicting(full):
            return False
        pager.pager_mark_leaving(full, now=time.time())
        return page_out_when_idle(full, deadline=deadline, reason=reason)
    finally:
        lock.release()


def page_out_when_idle(full: str, *, deadline: float, reason: str | None = None) -> bool:
    """With `full` evicting and its lock held by the caller: delete its script once its calls
    in flight end, waiting until `deadline` (monotonic), after which a count still held is
    taken for a call that will never end, as any page-out does at its own deadline. Returns
    False when the delete failed: the page-out task is sent to finish it."""
    wait_until = time.time() + max(0.0, deadline - time.monotonic())
    while True:
        try:
            page_out_locked(full=full, wait_until=wait_until, reason=reason)
            return True
        except StillInFlight:
            time.sleep(0.05)
        except RuntimeUnavailable:
            capability_page_out_task.delay_on_commit(full=full)
            return False


class StillInFlight(Exception):
    """The victim is still serving calls; check again, waiting at most until `wait_until`."""

    def __init__(self, full: str, *, wait_until: float) -> None:
        super().__init__(full)
        self.wait_until = wait_until


def capability_page_out(*, full: str, wait_until: float | None = None) -> bool:
    """Delete an evicting capability's script from the runtime and mark it paged out.

    New calls are first sent to page it in (they wait for its lock); calls already in flight
    are then waited for until `wait_until` (epoch s; None: from now, for the invoke timeout
    and a grace), after which a count still held is taken for a call that will never end
    (its process died). Idempotent: does nothing unless `full` is still evicting (a deploy
    may have made it live again, or it was removed). Raises StillInFlight while calls to it
    are in flight, RuntimeUnavailable when the runtime fails transiently.
    """
    with placement_lock(full, blocking=True):
        return page_out_locked(full=full, wait_until=wait_until)


def page_out_locked(*, full: str, wait_until: float | None, reason: str | None = None) -> bool:
    """`capability_page_out` with `full`'s placement lock held by the caller; `reason` names
    who chose it, when not the pager for a page-in (its audit event's detail)."""
    capability = Capability.objects.select_related("agent").filter(full_name=full, state=State.EVICTING).first()
    if capability is None:
        get_redis().zrem(redis_keys.PAGE_OUTS_DUE, full)
        return False
    # The route first: a call that still found it served holds an in-flight count by the
    # time this checks; one that did not goes to page it in, and waits for this lock.
    copies.route_turn_away(capability)
    if wait_until is None:
        wait_until = time.time() + settings.SIGIL_INVOKE_TIMEOUT_SECONDS + PAGE_OUT_GRACE_SECONDS
    if pager.pager_inflight(full) > 0 and time.time() < wait_until:
        _page_out_due(full, within=PAGE_OUT_RECHECK_SECONDS)
        raise StillInFlight(full, wait_until=wait_until)
    try:
        runtime_for(capability.backend).remove(slot=capability.slot)
    except RuntimeUnavailable:
        _page_out_due(full, within=MAX_COUNTDOWN_SECONDS)  # the task's retry
        raise
    with capability_written(full):
        changed = Capability.objects.filter(pk=capability.pk, state=State.EVICTING).update(
            state=State.PAGED_OUT, placed_sha="", updated_at=timezone.now()
        )
        if changed:
            capability_audit(
                capability, actor="system", action="capability.evicted", detail={"reason": reason} if reason else None
            )
    pager.pager_forget(full)
    get_redis().zrem(redis_keys.PAGE_OUTS_DUE, full)
    return bool(changed)


def capability_mark_missing(*, full: str, slot: str | None = None, backend: str | None = None) -> None:
    """The runtime answered that `full`'s script is gone: record it as paged out so the
    next placement puts it back. Idempotent.

    With `slot` and `backend` (the placement the call went to), nothing changes when the
    capability has been placed elsewhere since (a switch of runtime): the call's route was
    merely out of date.
    """
    with capability_written(full) as write:
        capability = (
            Capability.objects.select_related("agent").filter(full_name=full, state__in=routes.SERVED_STATES).first()
        )
        moved = capability is not None and (
            capability.slot != slot or bool(backend and capability.backend and capability.backend != backend)
        )
        if capability is None or (slot is not None and moved):
            write.unchanged()
            return
        Capability.objects.filter(pk=capability.pk).update(
            state=State.PAGED_OUT, placed_sha="", updated_at=timezone.now()
        )
        capability_audit(
            capability,
            actor="system",
            action="capability.repaired",
            detail={"reason": "the runtime no longer had its script"},
        )
    pager.pager_forget(full)


def capability_evict(*, full: str, actor: str) -> bool:
    """Page `full` out now (the owner's "evict"): its script is deleted from the runtime and
    its next call pages it back in. Returns False when it was not placed. Idempotent.

    Unlike an eviction chosen by the pager, it does not wait for calls in flight.
    Raises RuntimeUnavailable when the runtime fails transiently.
    """
    with placement_lock(full, blocking=True):
        with capability_written(full) as write:
            capability = (
                Capability.objects.select_for_update()
                .select_related("agent")
                .filter(full_name=full, state__in=routes.SERVED_STATES)
                .first()
            )
            if capability is None:
                write.unchanged()
                return False
            capability.state = State.EVICTING
            capability.save(update_fields=["state"])
            capability_audit(capability, actor=actor, action="capability.evict_requested")
        if get_runtime().total_slots is not None:
            pager.pager_mark_leaving(full, now=time.time())
    return capability_page_out(full=full, wait_until=0)
