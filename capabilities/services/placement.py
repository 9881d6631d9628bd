"""Where capabilities run: paging a capability in (the cold path), placing it again with its
bindings' new values, and deleting what a removed capability or a failed placement left on
the runtime. The parts live beside it, by job: the placement lock (placement_lock.py), the
pager's room (room.py), paging out (page_outs.py), reconciling and provisioning
(reconcile.py); what callers import from here is re-exported.
"""

from __future__ import annotations

import time

from django.utils import timezone

from capabilities.books import copies, pager, routes
from capabilities.models import Capability, State
from capabilities.runtimes import get_runtime, runtime_for
from capabilities.runtimes.errors import RuntimeThrottled, RuntimeUnavailable
from capabilities.services.page_outs import same_runtime
from capabilities.services.placement_lock import (
    PlacementUnderWay,
    placement_lock,
    placement_lock_within,
)
from capabilities.services.records import capability_audit, capability_current, capability_written, record_live
from capabilities.services.room import bundle_for, room_for, runtime_throttled
from sigil.errors import NotFound, Unavailable, UpstreamError

# Imported from here by the engine and the tests.
__all__ = [
    "PlacementUnderWay",
    "capability_clear_slot",
    "capability_page_in",
    "capability_refresh_bindings",
    "capability_release_slot",
    "placement_lock",
    "runtime_throttled",
]


def capability_page_in(
    *, full: str, reason: str = "call", wait_seconds: float | None = None
) -> tuple[routes.CachedRoute, bool]:
    """Make `full` live on the runtime (the cold path); return its fresh route and whether
    this call placed it.

    Concurrent callers for the same capability wait on one lock, so one placement serves
    them all; a caller waits at most `wait_seconds` for it (0: not at all). A prewarm
    (`reason="prewarm"`) pages nothing out: it takes a free slot (prewarm made room first,
    paging out what it chose), or raises Unavailable, as when the account refuses it for
    want of room. Raises NotFound, UpstreamError, Timeout (the wait ran out),
    PlacementUnderWay (with 0, the lock is held), Unavailable (no room).
    """
    with placement_lock_within(full, wait_seconds=wait_seconds):
        capability = capability_current(full, "agent", "current_version")
        if capability is None or capability.current_version is None:
            raise NotFound(f"no capability {full}")
        placed = capability.state not in routes.SERVED_STATES
        if not placed:
            # Served already (by another call's page-in): the caller's route was out of date.
            capability = copies.copies_publish(full)
        else:
            started = time.perf_counter()
            current = capability.current_version
            runtime = get_runtime()
            bundle = bundle_for(current.code, capability, runtime, version=current.number)
            # Its API calls wait for the rate budget within one allowance in all, so that a
            # spent budget never holds the caller past the call's own wait.
            with room_for(capability, evicts=reason != "prewarm") as room, runtime.api_waits_shared():
                placement = room.place(bundle)
                with capability_written(full):
                    record_live(capability, placement, bundle_sha=bundle.sha)
                    capability_audit(
                        capability,
                        actor="system",
                        action="capability.paged_in",
                        detail={
                            "evicted": placement.evicted,
                            "reason": reason,
                            "ms": round((time.perf_counter() - started) * 1000, 1),
                        },
                    )
    return routes.decode(routes.encode(capability)), placed


def capability_refresh_bindings(*, full: str) -> bool:
    """Place `full` again with its bindings' current values (a rotated secret, another KV
    namespace id), keeping its version and slot. Only a live capability on the current
    runtime is placed again: any other gets the current values when it is next placed.

    Returns whether it placed a new bundle. Raises RuntimeUnavailable (transient, retried by
    the task), InvalidRequest (a binding no longer resolves).
    """
    runtime = get_runtime()
    with placement_lock(full, blocking=True):
        capability = (
            Capability.objects.select_related("agent", "current_version")
            .filter(full_name=full, state=State.LIVE, backend__in=same_runtime(runtime))
            .first()
        )
        if capability is None or capability.current_version is None:
            return False
        current = capability.current_version
        bundle = bundle_for(current.code, capability, runtime, version=current.number)
        if bundle.sha == capability.placed_sha:
            return False
        try:
            # Through the pager, like any placement: never chosen as a victim meanwhile.
            with room_for(capability) as room:
                room.place(bundle)
                with capability_written(full):
                    Capability.objects.filter(pk=capability.pk).update(placed_sha=bundle.sha, updated_at=timezone.now())
                    capability_audit(
                        capability,
                        actor="system",
                        action="capability.bindings_refreshed",
                        detail={"bindings": capability.bindings},
                    )
        except Unavailable as exc:
            raise RuntimeThrottled(exc.message, retry_after=exc.retry_after) from exc  # the task waits it out
        except UpstreamError as exc:
            raise RuntimeUnavailable(str(exc)) from exc  # transient: the task tries again
    return True


def capability_release_slot(*, capability_id: int) -> bool:
    """Delete a removed capability's code from the runtime. Idempotent.

    Does nothing when the capability is not removed, or when a newer capability of the same
    name already holds the slot. Raises RuntimeUnavailable (transient) for the task to retry.
    """
    capability = Capability.objects.filter(pk=capability_id).first()
    if capability is None or capability.state != State.REMOVED or not capability.slot:
        return False
    with placement_lock(capability.full_name, blocking=True):
        runtime = runtime_for(capability.backend)
        successor = (
            Capability.objects.exclude(state=State.REMOVED)
            .filter(slot=capability.slot, backend__in=same_runtime(runtime))
            .exists()
        )
        if successor:
            return False
        runtime.remove(slot=capability.slot)
        if not Capability.objects.exclude(state=State.REMOVED).filter(full_name=capability.full_name).exists():
            pager.pager_drop_evicting(capability.full_name)
    return True


def capability_clear_slot(*, full: str, slot: str) -> bool:
    """Delete `slot`, left on the runtime by a failed placement of `full`, unless `full` has
    been placed there since; return whether it did. Idempotent. Raises RuntimeUnavailable
    (transient) for the task to retry."""
    with placement_lock(full, blocking=True):
        runtime = get_runtime()
        placed = Capability.objects.filter(
            full_name=full, slot=slot, state__in=routes.SERVED_STATES, backend__in=same_runtime(runtime)
        ).exists()
        if placed:
            return False
        runtime.remove(slot=slot)
        pager.pager_drop_evicting(full)
    return True
