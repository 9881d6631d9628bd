"""Where capabilities run: placing code on the runtime, and on runtimes with a slot limit the
pager's writes (claiming a slot, evicting the least recently used, paging in and out),
reconciling Sigil's records with what the runtime holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from agents.services import audit_record
from capabilities import bindings as binding_rules
from capabilities import pager, routes
from capabilities.models import Capability, State
from capabilities.runtimes import get_runtime, runtime_for
from capabilities.runtimes.base import CodeBundle, Runtime, RuntimeRejected, RuntimeUnavailable, ScriptTooLarge
from capabilities.tasks import capability_page_out as capability_page_out_task
from sigil_site.errors import Conflict, InvalidRequest, NotFound, SigilError, TooLarge, UpstreamError
from sigil_site.redis_client import get_redis


def placement_lock(full: str, *, blocking: bool):
    """The Redis lock held while `full` is placed, paged, moved or removed: one at a time."""
    seconds = settings.SIGIL_PLACEMENT_LOCK_SECONDS
    return get_redis().lock(f"sigil:lock:place:{full}", timeout=seconds, blocking=blocking, blocking_timeout=seconds)


def bundle_for(code: str, capability: Capability, runtime: Runtime) -> CodeBundle:
    """`code` with the current values of the bindings `capability` declares and its agent
    is still granted, as `runtime` gives them (a binding no longer granted is left out).
    Raises InvalidRequest (a binding of a kind the runtime lacks, a secret's variable unset)."""
    resolved = binding_rules.bindings_resolve(
        capability.bindings, agent_id=capability.agent_id, supported_kinds=runtime.binding_kinds, strict=False
    )
    return CodeBundle.from_code(code, bindings=resolved)


@dataclass(frozen=True)
class Placement:
    slot: str
    backend: str  # the runtime that placed it: what the capability's row records
    cold_start: bool  # this placement paged the capability in (bounded runtimes only)
    evicted: str | None  # the victim chosen to make room, if any


# How long a page-in waits for background page-outs to free the safety margin.
ROOM_WAIT_SECONDS = 30


def place_with_room(
    *, full: str, capability_type: str, expires_at: datetime | None, bundle: CodeBundle, was_evicting: bool
) -> Placement:
    """Place `bundle` for `full`; on a runtime with a slot limit, claim a slot first and
    evict the least recently used capability when the runtime is full.

    Call with the capability's placement lock held. Raises the errors of `_place`, and
    UpstreamError when no room frees up in time.
    """
    runtime = get_runtime()
    if runtime.total_slots is None:
        return Placement(slot=_place(full, bundle, runtime), backend=runtime.name, cold_start=False, evicted=None)
    if was_evicting:
        pager.pager_drop_evicting(full)
    deadline = time.monotonic() + ROOM_WAIT_SECONDS
    while True:
        claim = pager.pager_claim_slot(
            full=full,
            capability_type=capability_type,
            now=time.time(),
            slots=runtime.total_slots,
            safety_margin=runtime.safety_margin,
            expires_epoch=expires_at.timestamp() if expires_at else None,
        )
        if claim.outcome != "full":
            break
        if time.monotonic() > deadline:
            raise UpstreamError(f"no room on the runtime for {full}: every slot is live and page-outs are pending")
        time.sleep(0.05)
    if claim.victim:
        _mark_evicting(claim.victim)
    try:
        slot = _place(full, bundle, runtime)
    except SigilError:
        if claim.outcome != "live":
            pager.pager_forget(full)
        raise
    return Placement(slot=slot, backend=runtime.name, cold_start=claim.outcome != "live", evicted=claim.victim)


def _mark_evicting(victim: str) -> None:
    """The victim keeps serving while its page-out runs in the background."""
    with transaction.atomic():
        capability = (
            Capability.objects.select_for_update()
            .select_related("agent")
            .filter(full_name=victim, state=State.LIVE)
            .first()
        )
        if capability is None:
            return
        capability.state = State.EVICTING
        capability.updated_at = timezone.now()
        capability.save(update_fields=["state", "updated_at"])
        capability_page_out_task.delay_on_commit(full=victim)
    routes.route_publish(capability)


def slot_for(full: str, runtime: Runtime) -> str:
    """The runtime slot `full` uses: the one it was given before on this runtime (so a pooled
    script keeps its workers.dev name across evictions), else the runtime's name for it, made
    longer while another capability already holds that name (a hash collision never
    overwrites). A slot on another runtime (before a switch of SIGIL_BACKEND) is not reused."""
    current = (
        Capability.objects.exclude(state=State.REMOVED).filter(full_name=full).values_list("slot", "backend").first()
    )
    if current and current[0] and current[1] in ("", runtime.name):
        return current[0]
    for attempt in range(8):
        slot = runtime.slot_for(full, attempt=attempt)
        taken = (
            Capability.objects.exclude(state=State.REMOVED)
            .exclude(full_name=full)
            .filter(slot=slot, backend__in=("", runtime.name))
            .exists()
        )
        if not taken:
            return slot
    raise Conflict(f"no free runtime name for {full}")


def _place(full: str, bundle: CodeBundle, runtime: Runtime) -> str:
    """Put `bundle` on `runtime` for `full`; return the slot. Runtime errors become API errors."""
    slot = slot_for(full, runtime)
    try:
        runtime.place(slot=slot, bundle=bundle)
    except ScriptTooLarge as exc:
        raise TooLarge(f"the runtime refused the script as too large: {exc}") from exc
    except RuntimeRejected as exc:
        raise InvalidRequest(f"the runtime refused the script: {exc}") from exc
    except RuntimeUnavailable as exc:
        raise UpstreamError(f"the runtime could not place {full}: {exc}") from exc
    return slot


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
            .filter(slot=capability.slot, backend__in=_same_runtime(runtime))
            .exists()
        )
        if successor:
            return False
        runtime.remove(slot=capability.slot)
        if not Capability.objects.exclude(state=State.REMOVED).filter(full_name=capability.full_name).exists():
            pager.pager_drop_evicting(capability.full_name)
    return True


def capability_page_in(*, full: str, reason: str = "call") -> tuple[routes.CachedRoute, bool]:
    """Make `full` live on the runtime (the cold path); return its fresh route and whether
    this call placed it.

    Concurrent callers for the same capability wait on one lock, so one placement serves
    them all. Raises NotFound, UpstreamError.
    """
    with placement_lock(full, blocking=True):
        capability = (
            Capability.objects.select_related("agent", "current_version")
            .exclude(state=State.REMOVED)
            .filter(full_name=full)
            .first()
        )
        if capability is None or capability.current_version is None:
            raise NotFound(f"no capability {full}")
        placed = capability.state not in routes.SERVED_STATES
        if placed:
            started = time.perf_counter()
            bundle = bundle_for(capability.current_version.code, capability, get_runtime())
            placement = place_with_room(
                full=full,
                capability_type=capability.type,
                expires_at=capability.expires_at,
                bundle=bundle,
                was_evicting=False,
            )
            with transaction.atomic():
                Capability.objects.filter(pk=capability.pk).update(
                    state=State.LIVE,
                    slot=placement.slot,
                    placed_sha=bundle.sha,
                    backend=placement.backend,
                    updated_at=timezone.now(),
                )
                audit_record(
                    actor="system",
                    action="capability.paged_in",
                    agent_name=capability.agent.name,
                    subject=full,
                    detail={
                        "evicted": placement.evicted,
                        "reason": reason,
                        "ms": round((time.perf_counter() - started) * 1000, 1),
                    },
                )
            capability.refresh_from_db()
        routes.route_publish(capability)
    return routes.decode(routes.encode(capability)), placed


# A victim still answering calls is deleted once they finish, or after this many checks
# (the gateway treats a call that then finds no script as a miss and pages in again).
PAGE_OUT_INFLIGHT_CHECKS = 50


class StillInFlight(Exception):
    """The victim is still serving calls; the page-out task retries shortly."""


def capability_page_out(*, full: str, attempt: int = 0) -> bool:
    """Delete an evicting capability's script from the runtime and mark it paged out.

    Idempotent: does nothing unless `full` is still evicting (a deploy may have made it
    live again, or it was removed). Raises StillInFlight while calls to it are in flight,
    RuntimeUnavailable when the runtime fails transiently.
    """
    with placement_lock(full, blocking=True):
        capability = Capability.objects.select_related("agent").filter(full_name=full, state=State.EVICTING).first()
        if capability is None:
            return False
        if pager.pager_inflight(full) > 0 and attempt < PAGE_OUT_INFLIGHT_CHECKS:
            raise StillInFlight(full)
        runtime_for(capability.backend).remove(slot=capability.slot)
        with transaction.atomic():
            changed = Capability.objects.filter(pk=capability.pk, state=State.EVICTING).update(
                state=State.PAGED_OUT, placed_sha="", updated_at=timezone.now()
            )
            if changed:
                audit_record(
                    actor="system", action="capability.evicted", agent_name=capability.agent.name, subject=full
                )
        pager.pager_drop_evicting(full)
        capability.refresh_from_db()
        routes.route_publish(capability)
    return bool(changed)


def runtime_provision(*, actor: str) -> list[str]:
    """Create what the current runtime needs besides capabilities (the platform runtime's
    namespace and dispatch Worker, the loader runtime's KV namespace and loader Worker);
    return what was done. Idempotent. Raises RuntimeUnavailable, RuntimeRejected."""
    runtime = get_runtime()
    done = runtime.provision()
    if done:
        audit_record(actor=actor, action="runtime.provisioned", subject=runtime.name, detail={"done": done})
    return done


def _same_runtime(runtime: Runtime) -> tuple[str, ...]:
    """The `backend` values of rows placed on `runtime` ("" for rows from before it was recorded)."""
    return ("", runtime.name) if runtime is get_runtime() else (runtime.name,)


def placement_in_progress(full: str) -> bool:
    return bool(get_redis().exists(f"sigil:lock:place:{full}"))


def capability_reconcile() -> dict[str, int]:
    """Compare what the runtime holds with the registry, and repair both sides.

    Scripts no capability should have (a worker killed mid-page-in, a lost delete) are
    deleted; capabilities the registry thinks live but the runtime lacks are marked paged
    out, so their next call pages them in. Placements in progress are left alone. The
    pager's sets are then rebuilt from the registry. Safe to run at any time.
    Raises RuntimeUnavailable when the runtime cannot list its slots.
    """
    runtime = get_runtime()
    placed = set(runtime.list_slots())
    # Only this runtime's placements: during a switch of SIGIL_BACKEND, capabilities still on
    # the previous runtime are the switch's to move, not missing here.
    on_this_runtime = Capability.objects.filter(backend__in=_same_runtime(runtime))
    served = dict(on_this_runtime.filter(state__in=routes.SERVED_STATES).values_list("slot", "full_name"))
    owners: dict[str, list[str]] = {}
    for slot, full in on_this_runtime.filter(slot__in=placed - set(served)).values_list("slot", "full_name"):
        owners.setdefault(slot, []).append(full)

    orphans = 0
    for slot in sorted(placed - set(served)):
        if any(placement_in_progress(full) for full in owners.get(slot, [])):
            continue
        runtime.remove(slot=slot)
        audit_record(
            actor="system", action="runtime.orphan_removed", subject=slot, detail={"owners": owners.get(slot, [])}
        )
        orphans += 1

    repaired = 0
    for slot, full in served.items():
        if slot in placed or placement_in_progress(full):
            continue
        with transaction.atomic():
            capability = (
                Capability.objects.select_related("agent")
                .filter(full_name=full, state__in=routes.SERVED_STATES, backend__in=_same_runtime(runtime))
                .first()
            )
            if capability is None:
                continue
            capability.state = State.PAGED_OUT
            capability.placed_sha = ""
            capability.updated_at = timezone.now()
            capability.save(update_fields=["state", "placed_sha", "updated_at"])
            audit_record(
                actor="system",
                action="capability.repaired",
                agent_name=capability.agent.name,
                subject=full,
                detail={"reason": "not on the runtime", "slot": slot},
            )
        routes.route_publish(capability)
        repaired += 1

    corrected = pager.pager_sync(is_placing=placement_in_progress) if runtime.total_slots is not None else 0
    return {"orphans_removed": orphans, "repaired": repaired, "pager_corrected": corrected}


def capability_mark_missing(*, full: str, slot: str | None = None, backend: str | None = None) -> None:
    """The runtime answered that `full`'s script is gone: record it as paged out so the
    next placement puts it back. Idempotent.

    With `slot` and `backend` (the placement the call went to), nothing changes when the
    capability has been placed elsewhere since (a switch of runtime): the call's route was
    merely out of date.
    """
    with transaction.atomic():
        capability = (
            Capability.objects.select_related("agent").filter(full_name=full, state__in=routes.SERVED_STATES).first()
        )
        if capability is None:
            return
        moved = capability.slot != slot or bool(backend and capability.backend and capability.backend != backend)
        if slot is not None and moved:
            return
        Capability.objects.filter(pk=capability.pk).update(
            state=State.PAGED_OUT, placed_sha="", updated_at=timezone.now()
        )
        audit_record(
            actor="system",
            action="capability.repaired",
            agent_name=capability.agent.name,
            subject=full,
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
        with transaction.atomic():
            capability = (
                Capability.objects.select_for_update()
                .select_related("agent")
                .filter(full_name=full, state__in=routes.SERVED_STATES)
                .first()
            )
            if capability is None:
                return False
            capability.state = State.EVICTING
            capability.save(update_fields=["state"])
            audit_record(
                actor=actor, action="capability.evict_requested", agent_name=capability.agent.name, subject=full
            )
        if get_runtime().total_slots is not None:
            pager.pager_mark_leaving(full)
    return capability_page_out(full=full, attempt=PAGE_OUT_INFLIGHT_CHECKS)


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
            .filter(full_name=full, state=State.LIVE, backend__in=("", runtime.name))
            .first()
        )
        if capability is None or capability.current_version is None:
            return False
        bundle = bundle_for(capability.current_version.code, capability, runtime)
        if bundle.sha == capability.placed_sha:
            return False
        runtime.place(slot=capability.slot, bundle=bundle)
        with transaction.atomic():
            Capability.objects.filter(pk=capability.pk).update(placed_sha=bundle.sha, updated_at=timezone.now())
            audit_record(
                actor="system",
                action="capability.bindings_refreshed",
                agent_name=capability.agent.name,
                subject=full,
                detail={"bindings": capability.bindings},
            )
        capability.placed_sha = bundle.sha
        routes.route_publish(capability)
    return True
