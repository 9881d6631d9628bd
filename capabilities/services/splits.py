"""Staged versions and traffic splits: a version deployed without being made current, a share
of the callers sent to it, then `promote` (it becomes current) or `abort` (it leaves traffic),
by hand or by the guard when it fails more than the current one.

While a split runs, the staged version is placed as a capability of its own, named
`{full}--v{n}` (`variant_of` the capability): the runtime, the pager, the stats and the
breaker treat it as any other, so it takes its own slot and pages like any other. The
engine picks the version per call from the route (routes.Split), by a hash of the caller's
key: no query.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.utils import timezone

from agents.services import agent_notify
from capabilities import selectors
from capabilities.books import routes, stats
from capabilities.models import Capability, State
from capabilities.runtimes import get_runtime
from capabilities.services.placement import capability_page_in
from capabilities.services.placement_lock import placement_lock
from capabilities.services.records import capability_audit, capability_current, capability_written, record_live
from capabilities.services.removal import capability_remove_as_owner
from capabilities.services.room import bundle_for, room_for
from sigil.errors import Conflict, InvalidRequest, NotFound

# The guard's least number of calls to the staged version when the agent names none.
GUARD_MIN_CALLS_DEFAULT = 20
HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,100}$")
# Headers that never reach a capability, or that Sigil writes: no caller key there.
UNUSABLE_HEADERS = {"authorization", "connection", "host", "content-length", "transfer-encoding"}


@dataclass(frozen=True)
class SplitGuard:
    margin: float  # how much higher (0 to 1) the staged error rate may be than the current one's
    min_calls: int = GUARD_MIN_CALLS_DEFAULT


def _validate_split(*, weight: int, caller_header: str, guard: SplitGuard | None) -> None:
    if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 100:
        raise InvalidRequest("weight is the percent of callers sent to the staged version, an integer from 0 to 100")
    if caller_header:
        lowered = caller_header.lower()
        if not HEADER_NAME.match(caller_header) or lowered in UNUSABLE_HEADERS or lowered.startswith("x-sigil-"):
            raise InvalidRequest(
                "caller_header must be a request header name (letters, digits and dashes), "
                "not Authorization, a hop-by-hop header or X-Sigil-*"
            )
    if guard is not None:
        if not 0 < guard.margin <= 1:
            raise InvalidRequest("guard.margin is a share of calls, greater than 0 and at most 1")
        if guard.min_calls < 1:
            raise InvalidRequest("guard.min_calls must be at least 1")


def _locked(full: str):
    lock = placement_lock(full, blocking=False)
    if not lock.acquire():
        raise Conflict(f"{full} is being deployed or placed; retry when it is done")
    return lock


def _current(capability: Capability) -> Capability:
    current = capability_current(capability.full_name, "agent", "current_version", "staged_version")
    if current is None or current.pk != capability.pk:
        raise NotFound(f"no capability {capability.full_name}")
    return current


def capability_split_set(
    *, capability: Capability, weight: int, caller_header: str = "", guard: SplitGuard | None = None, actor: str
) -> Capability:
    """Send `weight` percent of the callers to the staged version (starting the split, or
    changing it); the same caller key always reaches the same version. Starting it places
    the staged version (its code must start, as at deploy). Returns the capability.

    Raises InvalidRequest (bad weight, header or guard; staged code that does not start),
    Conflict (nothing staged; a placement under way), NotFound, TooLarge, UpstreamError.
    """
    _validate_split(weight=weight, caller_header=caller_header, guard=guard)
    lock = _locked(capability.full_name)
    try:
        current = _current(capability)
        if current.staged_version is None:
            raise Conflict(f'{current.full_name} has no staged version: deploy one with "stage": true first')
        if current.current_version is None:
            raise Conflict(f"{current.full_name} has no version placed yet to split its callers with")
        starting = not current.has_split
        if starting:
            _place_variant(current)
        with capability_written(current.full_name):
            locked = Capability.objects.select_for_update().get(pk=current.pk)
            locked.split_weight = weight
            locked.split_caller_header = caller_header
            locked.split_guard_margin = guard.margin if guard else None
            locked.split_guard_min_calls = guard.min_calls if guard else None
            if starting:
                locked.split_started_at = timezone.now()
            locked.updated_at = timezone.now()
            locked.save()
            capability_audit(
                current,
                actor=actor,
                action="capability.split_started" if starting else "capability.split_changed",
                detail={
                    "current_version": current.current_version.number,
                    "staged_version": current.staged_version.number,
                    "weight": weight,
                    "caller_header": caller_header or None,
                    "guard": {"margin": guard.margin, "min_calls": guard.min_calls} if guard else None,
                },
            )
        current.refresh_from_db()
    finally:
        lock.release()
    return current


VARIANT_COPIES = ("agent", "name", "type", "is_public", "bindings", "cpu_ms")


def _place_variant(capability: Capability) -> None:
    """Register the staged version's own placement and place it; a placement that fails
    leaves nothing behind (the split does not start)."""
    full = routes.variant_name(capability)
    variant = Capability.objects.exclude(state=State.REMOVED).filter(full_name=full).first()
    if variant is None:
        # It runs as its capability does: the same agent, name, type, visibility, bindings, CPU.
        same = {name: getattr(capability, name) for name in VARIANT_COPIES}
        staged = capability.staged_version
        variant = Capability.objects.create(
            full_name=full, state=State.PAGED_OUT, current_version=staged, variant_of=capability, **same
        )
    try:
        capability_page_in(full=full, reason="split")
    except BaseException:
        Capability.objects.filter(pk=variant.pk, state=State.PAGED_OUT).delete()
        raise


@contextmanager
def _ending_split(capability: Capability, *, actor: str, doing: str) -> Iterator[Capability]:
    """Hold the capability's placement lock and give it, with its staged version, to the
    block that records the split's end (inside `capability_written`); then retire the staged
    version's placement. Raises Conflict (nothing staged; a placement under way), NotFound."""
    lock = _locked(capability.full_name)
    try:
        current = _current(capability)
        if current.staged_version is None:
            raise Conflict(f"{current.full_name} has no staged version to {doing}")
        yield current
        current.refresh_from_db()
    finally:
        lock.release()
    _retire_variants(current, actor=actor)


def capability_promote(*, capability: Capability, actor: str) -> Capability:
    """Make the staged version current (placed where the capability is, as a deploy places
    code) and end the split; the staged version's own placement leaves the runtime.

    Raises Conflict (nothing staged; a placement under way; a deploy came after the staged
    version), NotFound, and what placing code raises (InvalidRequest, TooLarge, UpstreamError).
    """
    with _ending_split(capability, actor=actor, doing="promote") as current:
        staged, previous = current.staged_version, current.current_version
        if previous is not None and previous.number > staged.number:
            # The version an agent reads never goes back: the staged code would have to be
            # staged again, after the deploy that came since.
            raise Conflict(
                f"v{previous.number} was deployed after v{staged.number} was staged: abort, and stage "
                f"v{staged.number}'s code again to try it against v{previous.number}"
            )
        bundle = bundle_for(staged.code, current, get_runtime(), version=staged.number)
        with room_for(current) as room:
            placement = room.place(bundle)
            with capability_written(current.full_name):
                locked = Capability.objects.select_for_update().get(pk=current.pk)
                record_live(locked, placement, bundle_sha=bundle.sha, version=staged)
                _end_split(locked)
                capability_audit(
                    current,
                    actor=actor,
                    action="capability.promoted",
                    detail={"version": staged.number, "previous_version": previous.number if previous else None},
                )
    return current


def capability_split_abort(*, capability: Capability, actor: str, reason: dict | None = None) -> Capability:
    """End the split and unstage the staged version (it stays among the versions); every
    call goes to the current version again, and the staged version's placement leaves the
    runtime. `reason` is recorded with the audit event (the guard's figures).

    Raises Conflict (nothing staged; a placement under way), NotFound.
    """
    with _ending_split(capability, actor=actor, doing="abort") as current, capability_written(current.full_name):
        locked = Capability.objects.select_for_update().get(pk=current.pk)
        _end_split(locked)
        capability_audit(
            current,
            actor=actor,
            action="capability.split_aborted",
            detail={"staged_version": current.staged_version.number, **(reason or {})},
        )
    return current


def _end_split(locked: Capability) -> None:
    locked.staged_version = None
    locked.split_weight = None
    locked.split_caller_header = ""
    locked.split_started_at = None
    locked.split_guard_margin = None
    locked.split_guard_min_calls = None
    locked.updated_at = timezone.now()
    locked.save()


def _retire_variants(capability: Capability, *, actor: str) -> None:
    """Remove the placements of versions no longer in traffic (their rows stay, with their
    stats, as any removed capability's do)."""
    for full in (
        Capability.objects.filter(variant_of=capability)
        .exclude(state=State.REMOVED)
        .values_list("full_name", flat=True)
    ):
        stats.split_forget(full)
        try:
            capability_remove_as_owner(full=full, actor=actor)
        except NotFound:
            continue  # retired meanwhile


@dataclass(frozen=True)
class GuardFigures:
    """What the guard decides on: the staged version's answers and failed answers since the
    split began (its calls, and the calls its breaker refused, which failed too), and the
    current version's calls and errors."""

    staged_answers: int
    staged_failed: int
    current_calls: int
    current_errors: int
    staged_refused: int = 0


def guard_trips(figures: GuardFigures, *, margin: float, min_calls: int) -> bool:
    """Whether a split's guard aborts it: over at least `min_calls` answers of the staged
    version, its failure rate exceeds the current version's error rate by more than `margin`."""
    if figures.staged_answers < min_calls or figures.staged_answers == 0:
        return False
    current_rate = figures.current_errors / figures.current_calls if figures.current_calls else 0.0
    return figures.staged_failed / figures.staged_answers - current_rate > margin


def _guard_figures(capability: Capability, report: dict) -> GuardFigures | None:
    """The guard's figures: the flushed windows, and what the engine recorded since the
    last flush, so a decision is taken on every answer recorded so far."""
    staged, current = report["staged"]["stats"], report["current"]["stats"]
    if staged is None:
        return None
    variant = routes.variant_name(capability)
    staged_calls, staged_errors = stats.live_counts(variant)
    current_calls, current_errors = stats.live_counts(capability.full_name)
    refused = stats.split_refusals(variant)
    return GuardFigures(
        staged_answers=staged["calls"] + staged_calls + refused,
        staged_failed=staged["errors"] + staged_errors + refused,
        current_calls=current["calls"] + current_calls,
        current_errors=current["errors"] + current_errors,
        staged_refused=refused,
    )


def capability_split_guard() -> list[str]:
    """Abort every split whose guard trips (guard_trips): the staged version's failure rate
    since the split began (every answer counts: its errors, and the calls its own breaker
    refused) exceeds the current version's error rate by more than the guard's margin, over
    at least its least number of answers. Run after each stats flush, and as soon as a
    staged version's breaker opens or refuses. Each abort is audited (actor `system`) and
    sent to the agent's webhook. Returns the capabilities whose split it aborted. Safe to
    run at any time, and concurrently."""
    aborted = []
    guarded = Capability.objects.select_related("agent", "current_version", "staged_version").filter(
        split_weight__isnull=False, split_guard_margin__isnull=False
    )
    for capability in guarded.exclude(state=State.REMOVED):
        report = selectors.capability_split_report(capability=capability)
        figures = _guard_figures(capability, report)
        if figures is None or not guard_trips(
            figures, margin=capability.split_guard_margin, min_calls=capability.split_guard_min_calls
        ):
            continue
        current_rate = figures.current_errors / figures.current_calls if figures.current_calls else 0.0
        reason = {
            "reason": "guard",
            "staged_error_rate": round(figures.staged_failed / figures.staged_answers, 4),
            "current_error_rate": round(current_rate, 4),
            "staged_calls": figures.staged_answers,
            "margin": capability.split_guard_margin,
        }
        if figures.staged_refused:
            reason["staged_refused"] = figures.staged_refused
        try:
            capability_split_abort(capability=capability, actor="system", reason=reason)
        except (Conflict, NotFound):
            continue  # promoted, aborted or being placed meanwhile: the next run looks again
        agent_notify(
            agent_name=capability.agent.name,
            event="capability.split_aborted",
            payload={"capability": capability.full_name, "staged_version": capability.staged_version.number, **reason},
        )
        aborted.append(capability.full_name)
    return aborted
