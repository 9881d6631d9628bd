"""Switching SIGIL_BACKEND: every capability moves to the new runtime while agents keep
calling it at the same URL with the same tokens (the seed's path from the $5 pool to the
namespace).

The owner changes SIGIL_BACKEND, restarts Sigil, and runs `manage.py switchbackend`,
which walks `backend_switch`. Each capability is placed on the new runtime and recorded
there (`capability_switch_backend`); until then the engine serves it from its previous
placement, and a grace period later that placement is deleted
(`runtime_release_previous`). A last sweep (`runtime_sweep_previous`) deletes whatever
the previous runtime still holds that no capability does, so a switch that was
interrupted and run again finishes the job.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured
from django.db.models import Count, F, Q, QuerySet
from django.utils import timezone

from agents.services import audit_record
from capabilities.books import pager, routes
from capabilities.models import Capability, State
from capabilities.runtimes import RUNTIMES, get_runtime, runtime_for
from capabilities.runtimes.errors import RuntimeFailure
from capabilities.services.placement_lock import placement_in_progress, placement_lock
from capabilities.services.records import capability_audit, capability_current, capability_written, record_live
from capabilities.services.room import bundle_for, room_for, slot_for
from sigil.errors import InvalidRequest, SigilError
from sigil.serving import Serving, switch_command


def never_placed() -> Q:
    """Capabilities no runtime ever held: no slot given (the first deploy was refused, or is
    still queued), or no version placed. A switch has nothing of theirs to move: they stay
    on no runtime, and their next placement is on the current one."""
    return Q(slot="") | Q(current_version__isnull=True)


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
    so the engine serves it from the previous runtime until this returns. On a runtime
    with a slot limit that is full, it is recorded as paged out instead (a switch never
    evicts): its next call pages it in. Idempotent, one audit event per move.
    Raises InvalidRequest (the new runtime cannot give a binding it declared), TooLarge,
    UpstreamError; the capability then stays where it was.
    """
    runtime = get_runtime()
    with placement_lock(full, blocking=True):
        capability = capability_current(full, "agent", "current_version")
        if capability is None:
            return SwitchStep(full=full, outcome="gone")
        if capability.backend in ("", runtime.name):
            return SwitchStep(full=full, outcome="already", source=capability.backend, new_slot=capability.slot)
        source, old_slot = capability.backend, capability.slot
        bundle = None
        if capability.state in routes.SERVED_STATES and capability.current_version is not None:
            current = capability.current_version
            bundle = bundle_for(current.code, capability, runtime, version=current.number)
        # The pager's sets speak for the new runtime: this capability is not placed there yet.
        pager.pager_forget(full)
        if bundle is not None and runtime.total_slots is not None and pager.pager_usage().used >= runtime.total_slots:
            bundle = None
        if bundle is None:
            slot = slot_for(full, runtime)
            state = State.FAILED if capability.state == State.FAILED else State.PAGED_OUT
            with _switch_recorded(capability, actor=actor, source=source, old_slot=old_slot, slot=slot, placed=False):
                Capability.objects.filter(pk=capability.pk).update(
                    state=state, slot=slot, placed_sha="", backend=runtime.name, updated_at=timezone.now()
                )
        else:
            with room_for(capability) as room:
                placement = room.place(bundle)
                slot = placement.slot
                with _switch_recorded(
                    capability, actor=actor, source=source, old_slot=old_slot, slot=slot, placed=True
                ):
                    record_live(capability, placement, bundle_sha=bundle.sha)
    return SwitchStep(
        full=full,
        outcome="moved" if bundle is not None else "reassigned",
        source=source,
        old_slot=old_slot,
        new_slot=slot,
    )


@contextmanager
def _switch_recorded(
    capability: Capability, *, actor: str, source: str, old_slot: str, slot: str, placed: bool
) -> Iterator[None]:
    """Record the move of `capability` to the current runtime, its row written in the block."""
    backend = get_runtime().name
    with capability_written(capability.full_name):
        yield
        capability_audit(
            capability,
            actor=actor,
            action="capability.switched",
            detail={"from": source, "to": backend, "from_slot": old_slot, "to_slot": slot, "placed": placed},
        )


def capability_adopt_backend(*, backend: str) -> int:
    """Record `backend` as the runtime of every capability placed before Sigil recorded
    runtimes (an empty `backend` field, and placed); return how many. Idempotent."""
    fulls = list(_unrecorded().values_list("full_name", flat=True))
    for full in fulls:
        with capability_written(full) as write:
            if not _unrecorded().filter(full_name=full).update(backend=backend):
                write.unchanged()
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
        if not runtime.created_here(slot=slot):
            continue  # the owner's own, though it looks like Sigil's
        runtime.remove(slot=slot)
        audit_record(actor=actor, action="runtime.slot_released", subject=slot, detail={"backend": backend})
        released.append(slot)
    return released


def _unrecorded():
    """Capabilities placed before Sigil recorded their runtime (it records it on every
    placement now): an empty `backend`, though a runtime held them."""
    return Capability.objects.exclude(state=State.REMOVED).filter(backend="").exclude(never_placed())


@dataclass(frozen=True)
class SwitchEvent:
    """One thing the switch did, for the owner to follow: `kind` is "provisioned",
    "adopted", "skipped" (never placed: nothing to move), "moved" (with `step`), "failed"
    (with `error`), "released" or "swept"."""

    kind: str
    full: str = ""
    index: int = 0
    total: int = 0
    step: SwitchStep | None = None
    error: str = ""
    backend: str = ""
    slots: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SwitchPlan:
    """What a switch would do, read without touching anything: `moving` are (full name, its
    runtime) in the order they would move; `unrecorded` were placed before Sigil recorded
    runtimes (they count as `source`'s, and make the switch refuse without one); `skipped`
    were never placed on any runtime (they stay on none)."""

    target: str
    source: str | None
    moving: list[tuple[str, str]]
    unrecorded: int
    skipped: list[str] = field(default_factory=list)


def switch_plan(*, source: str | None) -> SwitchPlan:
    """The capabilities a switch to the current runtime would move. Raises InvalidRequest
    where the switch itself would refuse to start."""
    target = get_runtime().name
    if source == target:
        raise InvalidRequest(f"SIGIL_BACKEND is already {source}: set it to the runtime to switch to")
    unrecorded = _unrecorded().count()
    if unrecorded and source is None:
        raise InvalidRequest(
            f"{unrecorded} capabilities were placed before Sigil recorded their runtime: name it with --from"
        )
    # Only a capability Sigil never placed has no runtime recorded now; nothing of it is to move.
    unplaced = Capability.objects.exclude(state=State.REMOVED).filter(backend="").filter(never_placed())
    skipped = sorted(unplaced.values_list("full_name", flat=True))
    moving = Capability.objects.exclude(state=State.REMOVED).exclude(backend=target).exclude(full_name__in=skipped)
    if source is not None:
        moving = moving.filter(backend__in=[source, ""])
    # Most recently called first: on a runtime with a slot limit, they are the ones placed.
    fulls = moving.order_by(F("last_access_at").desc(nulls_last=True), "full_name").values_list("full_name", "backend")
    moving_now = [(full, backend or source) for full, backend in fulls]
    return SwitchPlan(target=target, source=source, moving=moving_now, unrecorded=unrecorded, skipped=skipped)


def backend_switch(*, source: str | None, actor: str, grace_seconds: float) -> Iterator[SwitchEvent]:
    """Move every capability not on the current runtime to it, yielding progress.

    `source` limits the switch to capabilities on that runtime, and names the runtime of
    those placed before Sigil recorded runtimes; without it, such capabilities make the
    switch refuse (InvalidRequest) rather than guess. A capability never placed (its first
    deploy refused or still queued) is skipped and reported: it stays on no runtime. Safe
    to interrupt and run again: each capability moves at most once, and the sweep deletes
    what an interrupted run left. A capability that cannot move is reported and keeps being
    served where it is.
    """
    runtime = get_runtime()
    switch_plan(source=source)  # refuses what the switch cannot start with
    yield SwitchEvent("provisioned", backend=runtime.name, lines=runtime.provision())

    if _unrecorded().exists():
        yield SwitchEvent("adopted", backend=source, total=capability_adopt_backend(backend=source))

    plan = switch_plan(source=source)
    for full in plan.skipped:
        yield SwitchEvent("skipped", full=full)
    fulls = plan.moving
    sources = {backend for _, backend in fulls} | ({source} if source else set())

    pending: deque[tuple[float, str, str, str]] = deque()  # (due, backend, slot, full)
    for index, (full, _) in enumerate(fulls, start=1):
        try:
            step = capability_switch_backend(full=full, actor=actor)
        except (SigilError, RuntimeFailure) as exc:
            yield SwitchEvent("failed", full=full, index=index, total=len(fulls), error=str(exc))
            continue
        yield SwitchEvent("moved", full=full, index=index, total=len(fulls), step=step)
        if step.outcome in ("moved", "reassigned") and step.old_slot:
            pending.append((time.monotonic() + grace_seconds, step.source, step.old_slot, full))
        while pending and pending[0][0] <= time.monotonic():
            yield _release(pending.popleft(), actor)
    while pending:
        time.sleep(max(0.0, pending[0][0] - time.monotonic()))
        yield _release(pending.popleft(), actor)

    for backend in sorted(sources - {runtime.name}):
        yield SwitchEvent("swept", backend=backend, slots=runtime_sweep_previous(backend=backend, actor=actor))


def _release(item: tuple[float, str, str, str], actor: str) -> SwitchEvent:
    _, backend, slot, full = item
    try:
        released = runtime_release_previous(backend=backend, slot=slot, actor=actor)
    except RuntimeFailure as exc:
        # The sweep at the end (or of the next run) deletes it.
        return SwitchEvent("failed", full=full, backend=backend, slots=[slot], error=str(exc))
    return SwitchEvent("released", full=full, backend=backend, slots=[slot] if released else [])


@dataclass(frozen=True)
class LeftBehind:
    """Capabilities still placed on `backend`, a runtime other than SIGIL_BACKEND's, because
    no switch has moved them yet. `failure` says why that runtime cannot serve them (it is
    gone, or not configured any more); empty while it answers, and the engine serves them
    there."""

    backend: str
    capabilities: int
    failure: str = ""

    def describe(self) -> str:
        where = f"{self.capabilities} capabilities are still placed on the {self.backend} runtime"
        if self.failure:
            where += f", which does not answer ({self.failure}): their calls fail"
        else:
            where += ", and served there"
        return f"{where} until `{switch_command(get_runtime().name)}` moves them to {get_runtime().name}"


def switch_target(*, configured: str, named_here: bool, serving: Serving | None, var_dir: Path) -> str:
    """The runtime a switch moves every capability to: the one the Sigil running on `var_dir`
    serves (`serving`, as runsigil recorded it), which SIGIL_BACKEND (`configured`) must name
    when this shell sets it (`named_here`); with no Sigil running there, SIGIL_BACKEND as this
    shell sets it. Reads only.

    Raises InvalidRequest, naming the command to run, when this shell names another runtime
    than the running Sigil serves, or when nothing tells the runtime: no Sigil running there,
    and SIGIL_BACKEND not set (its default, local, would move everything there).
    """
    if serving is not None:
        if named_here and configured != serving.backend:
            raise InvalidRequest(
                f"the Sigil running on port {serving.port} serves {serving.backend}, but SIGIL_BACKEND is "
                f"{configured} here: restart Sigil with SIGIL_BACKEND={configured} first, or switch to what "
                f"it serves with `{switch_command(serving.backend)}`"
            )
        return serving.backend
    if named_here:
        return configured
    raise InvalidRequest(
        f"SIGIL_BACKEND is not set in this shell, and no Sigil running on {var_dir} says which runtime it "
        f"serves: name the runtime Sigil serves now, as in `{switch_command('worker-pool')}` "
        f"(one of {', '.join(RUNTIMES)})"
    )


def placed_elsewhere(current: str) -> QuerySet[Capability]:
    """The rows still placed on a runtime other than `current` (SIGIL_BACKEND's), because no
    switch has moved them yet: served there (live, a split's staged version included) or
    waiting there for their delete (evicting). Reads only."""
    return Capability.objects.filter(state__in=[State.LIVE, State.EVICTING]).exclude(backend__in=["", current])


def runtimes_still_holding(current: str) -> list[str]:
    """The runtimes other than `current` that still hold a placement (`placed_elsewhere`):
    until a switch has moved every one, they must keep serving, so their processes on this
    machine run beside the current runtime's (runsigil). Reads only the database."""
    return sorted(set(placed_elsewhere(current).values_list("backend", flat=True)))


def runtimes_left_behind() -> list[LeftBehind]:
    """Per runtime other than the configured one, the capabilities still placed there, and
    whether it answers (its `check()`: a network call, made only for runtimes that hold
    something). Reads only."""
    placed = (
        placed_elsewhere(get_runtime().name)
        .filter(variant_of__isnull=True)
        .values("backend")
        .annotate(count=Count("id"))
        .order_by("backend")
    )
    return [LeftBehind(row["backend"], row["count"], runtime_failure(row["backend"])) for row in placed]


def runtime_failure(backend: str) -> str:
    """Why `backend` cannot serve what is placed on it, or "" when it answers."""
    try:
        runtime_for(backend).check()
    except RuntimeFailure as exc:
        return str(exc)
    except (ImproperlyConfigured, ValueError) as exc:  # not configured any more, or unknown
        return f"it cannot be built from the settings: {exc}"
    return ""
