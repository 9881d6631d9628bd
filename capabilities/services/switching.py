"""Switching SIGIL_BACKEND with capabilities live: moving each to the new runtime, then
releasing what it left on the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from agents.services import audit_record
from capabilities import pager, routes
from capabilities.models import Capability, State
from capabilities.runtimes import get_runtime, runtime_for
from capabilities.services.placement import (
    bundle_for,
    placement_in_progress,
    placement_lock,
    placement_room,
    slot_for,
)


@dataclass(frozen=True)
class SwitchStep:
    """What switching one capability to the current runtime did.

    `outcome`: "moved" (placed on the new runtime), "reassigned" (not placed anywhere, now
    due to page in on the new runtime), "already" (nothing to do) or "gone" (removed).
    `source`/`old_slot` name the previous placement, which the caller removes later.
    """

    full: str
    outcome: str
    source: str = ""
    old_slot: str = ""
    new_slot: str = ""


def capability_switch_backend(*, full: str, actor: str) -> SwitchStep:
    """Move `full` to the runtime SIGIL_BACKEND names, leaving its previous placement alone.

    A served capability is placed on the new runtime first, and only then recorded there,
    so the gateway serves it from the previous runtime until this returns. On a runtime
    with a slot limit that is full, it is recorded as paged out instead (a switch never
    evicts): its next call pages it in. Idempotent, one audit event per move.
    Raises InvalidRequest (the new runtime cannot give a binding it declared), TooLarge,
    UpstreamError; the capability then stays where it was.
    """
    runtime = get_runtime()
    with placement_lock(full, blocking=True):
        capability = (
            Capability.objects.select_related("agent", "current_version")
            .exclude(state=State.REMOVED)
            .filter(full_name=full)
            .first()
        )
        if capability is None:
            return SwitchStep(full=full, outcome="gone")
        if capability.backend in ("", runtime.name):
            return SwitchStep(full=full, outcome="already", source=capability.backend, new_slot=capability.slot)
        source, old_slot = capability.backend, capability.slot
        bundle = None
        if capability.state in routes.SERVED_STATES and capability.current_version is not None:
            bundle = bundle_for(capability.current_version.code, capability, runtime)
        # The pager's sets speak for the new runtime: this capability is not placed there yet.
        pager.pager_forget(full)
        if bundle is not None and runtime.total_slots is not None and pager.pager_usage().used >= runtime.total_slots:
            bundle = None
        if bundle is None:
            slot, backend = slot_for(full, runtime), runtime.name
            state = State.FAILED if capability.state == State.FAILED else State.PAGED_OUT
            _record_switch(
                capability,
                actor=actor,
                source=source,
                old_slot=old_slot,
                slot=slot,
                backend=backend,
                state=state,
                placed_sha="",
            )
        else:
            with placement_room(full=full, capability_type=capability.type, expires_at=capability.expires_at) as room:
                placement = room.place(bundle)
                slot, backend = placement.slot, placement.backend
                _record_switch(
                    capability,
                    actor=actor,
                    source=source,
                    old_slot=old_slot,
                    slot=slot,
                    backend=backend,
                    state=State.LIVE,
                    placed_sha=bundle.sha,
                )
        capability.refresh_from_db()
        routes.route_publish(capability)
    return SwitchStep(
        full=full,
        outcome="moved" if bundle is not None else "reassigned",
        source=source,
        old_slot=old_slot,
        new_slot=slot,
    )


def _record_switch(
    capability: Capability,
    *,
    actor: str,
    source: str,
    old_slot: str,
    slot: str,
    backend: str,
    state: str,
    placed_sha: str,
) -> None:
    full = capability.full_name
    with transaction.atomic():
        Capability.objects.filter(pk=capability.pk).update(
            state=state, slot=slot, placed_sha=placed_sha, backend=backend, updated_at=timezone.now()
        )
        audit_record(
            actor=actor,
            action="capability.switched",
            agent_name=capability.agent.name,
            subject=full,
            detail={
                "from": source,
                "to": backend,
                "from_slot": old_slot,
                "to_slot": slot,
                "placed": state == State.LIVE,
            },
        )


def capability_adopt_backend(*, backend: str) -> int:
    """Record `backend` as the runtime of every capability placed before Sigil recorded
    runtimes (an empty `backend` field); return how many. Idempotent."""
    fulls = list(Capability.objects.exclude(state=State.REMOVED).filter(backend="").values_list("full_name", flat=True))
    for full in fulls:
        with transaction.atomic():
            changed = (
                Capability.objects.exclude(state=State.REMOVED)
                .filter(full_name=full, backend="")
                .update(backend=backend)
            )
        if changed:
            capability = Capability.objects.select_related("agent").exclude(state=State.REMOVED).get(full_name=full)
            routes.route_publish(capability)
    return len(fulls)


def runtime_release_previous(*, backend: str, slot: str, actor: str) -> bool:
    """Delete `slot` from the runtime `backend` unless a capability placed there holds it;
    return whether it did. Idempotent. Raises RuntimeUnavailable (transient)."""
    runtime = runtime_for(backend)
    if Capability.objects.exclude(state=State.REMOVED).filter(backend=backend, slot=slot).exists():
        return False
    runtime.remove(slot=slot)
    audit_record(actor=actor, action="runtime.slot_released", subject=slot, detail={"backend": backend})
    return True


def runtime_sweep_previous(*, backend: str, actor: str) -> list[str]:
    """Delete every slot the runtime `backend` holds that no capability placed there holds
    (what an interrupted switch left behind); return them. Placements in progress are left
    alone. Idempotent. Raises RuntimeUnavailable (transient)."""
    runtime = runtime_for(backend)
    held = set(Capability.objects.exclude(state=State.REMOVED).filter(backend=backend).values_list("slot", flat=True))
    owners = dict(Capability.objects.filter(backend=backend).values_list("slot", "full_name"))
    released = []
    for slot in sorted(set(runtime.list_slots()) - held):
        if slot in owners and placement_in_progress(owners[slot]):
            continue
        runtime.remove(slot=slot)
        audit_record(actor=actor, action="runtime.slot_released", subject=slot, detail={"backend": backend})
        released.append(slot)
    return released
