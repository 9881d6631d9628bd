"""Where capabilities run: placing code on the runtime, and on runtimes with a slot limit the
pager's writes (claiming a slot, evicting the least recently used, paging in and out),
reconciling Sigil's records with what the runtime holds.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from agents.services import audit_record
from capabilities import bindings as binding_rules
from capabilities import names, pager, routes
from capabilities.models import Capability, State
from capabilities.runtimes import get_runtime, runtime_for
from capabilities.runtimes.base import CodeBundle, Runtime
from capabilities.runtimes.errors import (
    RuntimeFailure,
    RuntimeRejected,
    RuntimeThrottled,
    RuntimeUnavailable,
    ScriptTooLarge,
    SlotsExhausted,
)
from capabilities.tasks import MAX_COUNTDOWN_SECONDS, PAGE_OUT_RECHECK_SECONDS
from capabilities.tasks import capability_clear_slot as capability_clear_slot_task
from capabilities.tasks import capability_page_out as capability_page_out_task
from sigil import leases
from sigil.errors import Conflict, InvalidRequest, NotFound, Timeout, TooLarge, Unavailable, UpstreamError
from sigil.redis_client import get_redis

logger = logging.getLogger(__name__)


class PlacementUnderWay(Exception):
    """Another call or process holds the capability's placement lock (a caller that asked not
    to wait for it watches the route instead: the engine)."""


def placement_lock(full: str, *, blocking: bool, wait_seconds: float | None = None) -> leases.Lease:
    """The lock held while `full` is placed, paged, moved or removed: one at a time.

    A lease (sigil/leases.py): held up to SIGIL_PLACEMENT_LOCK_SECONDS while its
    process lives, free within SIGIL_LEASE_SECONDS of its death. A blocking caller waits up
    to SIGIL_PLACEMENT_LOCK_SECONDS, or `wait_seconds` when given.
    """
    seconds = settings.SIGIL_PLACEMENT_LOCK_SECONDS
    return leases.Lease(
        placement_lock_key(full),
        hold_seconds=seconds,
        blocking=blocking,
        blocking_timeout=seconds if wait_seconds is None else wait_seconds,
    )


def placement_lock_key(full: str) -> str:
    return f"sigil:lock:place:{full}"


@contextmanager
def placement_lock_within(full: str, *, wait_seconds: float | None) -> Iterator[None]:
    """Hold `full`'s placement lock, waiting at most `wait_seconds` (None: the lock's timeout;
    0: not at all).

    Raises Timeout when another placement still holds it then: a caller waiting on a page-in
    gives up when its call would have (SIGIL_INVOKE_TIMEOUT_SECONDS), not after the lock's
    far longer timeout. With 0, raises PlacementUnderWay at once instead.
    """
    if wait_seconds == 0:
        lock = placement_lock(full, blocking=False)
        if not lock.acquire():
            raise PlacementUnderWay(full)
    else:
        waited = wait_seconds or settings.SIGIL_PLACEMENT_LOCK_SECONDS
        lock = placement_lock(full, blocking=True, wait_seconds=waited)
        if not lock.acquire():
            raise Timeout(f"{full} is still being placed after {waited:g} s; try again shortly")
    try:
        yield
    finally:
        lock.release()


def bundle_for(code: str, capability: Capability, runtime: Runtime, *, version: int | None = None) -> CodeBundle:
    """`code` with the current values of the bindings `capability` declares and its agent
    is still granted, as `runtime` gives them (a binding no longer granted is left out), as
    the capability's version number `version` (which the placed code names in its answers
    where the runtime replaces code in place). Raises InvalidRequest (a binding of a kind
    the runtime lacks, a secret's variable unset)."""
    resolved = binding_rules.bindings_resolve(
        capability.bindings, agent_id=capability.agent_id, supported_kinds=runtime.binding_kinds, strict=False
    )
    return CodeBundle.from_code(code, bindings=resolved, cpu_ms=capability.cpu_ms, version=version)


@dataclass(frozen=True)
class Placement:
    slot: str
    backend: str  # the runtime that placed it: what the capability's row records
    cold_start: bool  # this placement paged the capability in (bounded runtimes only)
    evicted: str | None  # the (first) victim chosen to make room, if any


# How long a page-in waits for background page-outs to free the safety margin.
ROOM_WAIT_SECONDS = 30
# How long restoring a victim waits for its placement lock before leaving it evicted.
RESTORE_LOCK_WAIT_SECONDS = 10


class Room:
    """A placement on the runtime, made room for by the pager: see `placement_room`."""

    def __init__(
        self, *, full: str, capability_type: str, expires_at: datetime | None, page_out_for_account: bool = True
    ) -> None:
        self.full = full
        self.page_out_for_account = page_out_for_account
        self.capability_type = capability_type
        self.expires_epoch = expires_at.timestamp() if expires_at else None
        self.runtime = get_runtime()
        self.claim: pager.Claim | None = None
        self.marked: list[pager.Candidate] = []  # victims this placement made evicting in the database
        self.slot: str | None = None

    def place(self, bundle: CodeBundle) -> Placement:
        """Claim a slot (evicting when full), then put `bundle` on the runtime. Raises the
        errors of `_place`, and UpstreamError when no room frees up in time."""
        if self.runtime.total_slots is not None:
            self.claim = self._claim()
            self.marked = [v for v in self.claim.victims if _mark_evicting(v.full)]
            pager.pager_note_chosen(self.full, (v.full for v in self.marked))
        self.slot = slot_for(self.full, self.runtime)
        paged_out = self._place_within_account(bundle)
        victims = [v.full for v in self.claim.victims] if self.claim else []
        victims += paged_out
        return Placement(
            slot=self.slot,
            backend=self.runtime.name,
            cold_start=bool(self.claim and self.claim.outcome == "claimed"),
            evicted=victims[0] if victims else None,
        )

    def _place_within_account(self, bundle: CodeBundle) -> list[str]:
        """Put `bundle` on the runtime; return what was paged out to make room on the account.

        The runtime may refuse a new script though the pager had a slot: the account holds as
        many as its plan allows (Cloudflare's 10037), the owner's own Workers sharing that
        quota. That is a full pool: the least valuable capability is paged out at once and
        the upload tried again, until ROOM_WAIT_SECONDS have passed. When nothing can be paged
        out, or no room came in time, the newcomer is shed (`503 unavailable`). Each refusal
        is told to the owner (`runtime_account_full`).
        """
        deadline = time.monotonic() + ROOM_WAIT_SECONDS
        paged_out: list[str] = []
        while True:
            try:
                _place(self.full, self.slot, bundle, self.runtime)
                return paged_out
            except SlotsExhausted as exc:
                victim = (
                    _page_out_for_account(newcomer=self.full, deadline=deadline)
                    if self.claim and self.page_out_for_account
                    else None
                )
                runtime_account_full(runtime=self.runtime, full=self.full, paged_out=victim, refusal=str(exc))
                if victim is None or time.monotonic() > deadline:
                    raise Unavailable(
                        f"the runtime's account has no room for {self.full}: it holds as many scripts as its plan "
                        "allows, with scripts Sigil does not manage among them, and no capability of Sigil's could "
                        "be paged out in time; the owner has been told",
                        retry_after=ACCOUNT_FULL_RETRY_SECONDS,
                    ) from exc
                paged_out.append(victim)

    def _claim(self) -> pager.Claim:
        deadline = time.monotonic() + ROOM_WAIT_SECONDS
        while True:
            claim = pager.pager_claim_slot(
                full=self.full,
                now=time.time(),
                slots=self.runtime.total_slots,
                safety_margin=self.runtime.safety_margin,
            )
            if claim.outcome != "full":
                return claim
            # Full: page-outs under way free room; after the slots were lowered, shedding the
            # excess starts them.
            capability_shed_excess()
            if time.monotonic() > deadline:
                raise UpstreamError(
                    f"no room on the runtime for {self.full}: every slot is live and page-outs are pending"
                )
            time.sleep(0.05)

    def settle(self) -> None:
        """The placement is recorded: serve the newcomer from its class, and page the victims
        out now that it is in place (after their calls in flight, up to the invoke timeout)."""
        if self.claim is None:
            return
        pager.pager_settle(
            full=self.full, capability_type=self.capability_type, now=time.time(), expires_epoch=self.expires_epoch
        )
        for victim in self.marked:
            page_out_later(victim.full)
        pager.pager_take_chosen(self.full)

    def release(self) -> None:
        """The placement failed or was not recorded: the newcomer goes back where it was,
        and its victims are served again, not evicted for nothing."""
        if self.claim is None:
            return
        if self.claim.outcome == "claimed" and self.slot and not self._slot_cleared():
            # Its script may still be there: it holds margin until the delete is done.
            pager.pager_mark_leaving(self.full, now=time.time())
        else:
            pager.pager_release(
                full=self.full, claim=self.claim, capability_type=self.capability_type, expires_epoch=self.expires_epoch
            )
        for victim in self.marked:
            _restore_victim(victim)
        pager.pager_take_chosen(self.full)

    def _slot_cleared(self) -> bool:
        """A failed new placement may have left its script behind (uploaded, its URL not yet
        turned on): delete it now, or have it deleted in the background if the runtime fails."""
        if Capability.objects.filter(full_name=self.full, state__in=routes.SERVED_STATES).exists():
            return True  # placed before after all (the pager had lost it): its script serves
        try:
            self.runtime.remove(slot=self.slot)
        except RuntimeUnavailable:
            capability_clear_slot_task.delay_on_commit(full=self.full, slot=self.slot)
            return False
        return True


@contextmanager
def placement_room(
    *, full: str, capability_type: str, expires_at: datetime | None, page_out_for_account: bool = True
) -> Iterator[Room]:
    """Place `full` on the runtime with `room.place(bundle)`, and record the placement in the
    database inside the block.

    Call with `full`'s placement lock held. On a runtime with a slot limit the pager's page-out
    runs in the seeds' order: victims are marked evicting (still served), the newcomer is
    placed and recorded, and only then are the victims deleted, in the background. If the
    block raises, the victims are restored and the newcomer's claim is given back. Without
    `page_out_for_account`, an account that refuses the newcomer (10037) sheds it rather
    than paging out a capability the pager did not choose.
    """
    room = Room(
        full=full, capability_type=capability_type, expires_at=expires_at, page_out_for_account=page_out_for_account
    )
    try:
        yield room
    except BaseException:
        room.release()
        raise
    room.settle()


def _page_out_for_account(*, newcomer: str, deadline: float) -> str | None:
    """Page out the least valuable live capability now (never `newcomer`, which is being
    placed): mark it evicting, then delete its script once its calls in flight end, waiting
    until `deadline` (monotonic) at most. Returns its name, or None when none could go."""
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
            if not _mark_evicting(victim.full):
                continue
            # Its calls in flight may finish first; after the deadline a count still held is
            # taken for a call that will never end, as any page-out does at its own deadline.
            wait_until = time.time() + max(0.0, deadline - time.monotonic())
            while True:
                try:
                    _page_out_locked(full=victim.full, wait_until=wait_until)
                    return victim.full
                except StillInFlight:
                    time.sleep(0.05)
                except RuntimeUnavailable:
                    # Its delete failed: the page-out task finishes it; this placement is shed.
                    capability_page_out_task.delay_on_commit(full=victim.full)
                    return None
        finally:
            lock.release()
    return None


# What a shed newcomer asks its caller to wait: a page-out or the owner freeing a script.
ACCOUNT_FULL_RETRY_SECONDS = 30
# How long /_health reports the account full after the last refusal.
ACCOUNT_FULL_REPORTED_SECONDS = 3600
ACCOUNT_FULL_KEY = "sigil:runtime:account_full"


def runtime_account_full(*, runtime: Runtime, full: str, paged_out: str | None, refusal: str) -> None:
    """Tell the owner the runtime's account refused a script for want of room: an audit
    event, and /_health's warning for the next hour (`runtime_account_warning`)."""
    detail = {"capability": full, "paged_out": paged_out, "refusal": refusal}
    audit_record(actor="system", action="runtime.account_full", subject=runtime.name, detail=detail)
    message = (
        f"the {runtime.name} runtime's account refused a script for want of room at "
        f"{timezone.now().isoformat(timespec='seconds')}: it holds as many scripts as its plan allows, the "
        "owner's own Workers included; free some, or lower SIGIL_POOL_TOTAL_QUOTA (python manage.py cfcheck "
        "tells how many slots Sigil can use)"
    )
    get_redis().set(ACCOUNT_FULL_KEY, message, ex=ACCOUNT_FULL_REPORTED_SECONDS)


def runtime_account_warning() -> str | None:
    """What /_health warns of when the runtime's account refused a script lately, else None."""
    value = get_redis().get(ACCOUNT_FULL_KEY)
    return value.decode() if value is not None else None


def _mark_evicting(victim: str) -> bool:
    """A victim keeps serving while the newcomer is placed; returns whether it was live.

    A victim the database does not have live is not this placement's to page out: one being
    removed keeps its evicting entry until its delete is done; any other has no script, so
    it stops holding margin.
    """
    with transaction.atomic():
        capability = (
            Capability.objects.select_for_update()
            .select_related("agent")
            .exclude(state=State.REMOVED)
            .filter(full_name=victim)
            .first()
        )
        if capability is None or capability.state != State.LIVE:
            if capability is not None and capability.state != State.EVICTING:
                pager.pager_drop_evicting(victim)
            return capability is not None and capability.state == State.EVICTING
        capability.state = State.EVICTING
        capability.updated_at = timezone.now()
        capability.save(update_fields=["state", "updated_at"])
    routes.route_publish(capability)
    return True


def _restore_victim(victim: pager.Candidate) -> None:
    """Serve a victim again whose eviction was called off. If its lock is held too long
    (it is being removed or evicted by the owner), it is paged out after all."""
    lock = placement_lock(victim.full, blocking=True, wait_seconds=RESTORE_LOCK_WAIT_SECONDS)
    if not lock.acquire():
        page_out_later(victim.full)
        return
    try:
        with transaction.atomic():
            capability = (
                Capability.objects.select_for_update()
                .select_related("agent")
                .filter(full_name=victim.full, state=State.EVICTING)
                .first()
            )
            if capability is None:
                return
            capability.state = State.LIVE
            capability.save(update_fields=["state"])
        pager.pager_restore(victim)
        routes.route_publish(capability)
    finally:
        lock.release()


def capability_shed_excess(*, now: float | None = None) -> list[str]:
    """Page out the capabilities over the runtime's slots (after its quota was lowered), least
    valuable first in the eviction order; return their names. They are deleted in the
    background, once their calls in flight end. Idempotent: nothing over, nothing done."""
    runtime = get_runtime()
    if runtime.total_slots is None:
        return []
    victims = pager.pager_shed_excess(now=now or time.time(), slots=runtime.total_slots)
    shed = []
    for victim in victims:
        if _mark_evicting(victim.full):
            page_out_later(victim.full)
            shed.append(victim.full)
    return shed


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


def _place(full: str, slot: str, bundle: CodeBundle, runtime: Runtime) -> None:
    """Put `bundle` on `runtime` at `full`'s `slot`. Runtime errors become API errors."""
    try:
        runtime.place(slot=slot, bundle=bundle, tenant=names.agent_of(full))
    except ScriptTooLarge as exc:
        raise TooLarge(f"the runtime refused the script as too large: {exc}") from exc
    except SlotsExhausted:
        raise  # a full account: the caller (Room) pages out or sheds
    except RuntimeRejected as exc:
        raise InvalidRequest(f"the runtime refused the script: {exc}") from exc
    except RuntimeThrottled as exc:
        raise runtime_throttled(exc, doing=f"place {full}") from exc
    except RuntimeUnavailable as exc:
        raise UpstreamError(f"the runtime could not place {full}: {exc}") from exc


def runtime_throttled(exc: RuntimeThrottled, *, doing: str) -> Unavailable:
    """`503 unavailable` for a runtime whose provider refuses calls for a while (Cloudflare's
    rate-limit lockout), with Retry-After as the provider answered it. The message is Sigil's:
    the provider's own words (its error codes, its limits) stay in the log."""
    logger.warning("the runtime is throttled and could not %s: %s", doing, exc)
    seconds = max(1, math.ceil(exc.retry_after)) if exc.retry_after is not None else None
    wait = f"try again in {seconds} s" if seconds is not None else "try again later"
    return Unavailable(
        f"the runtime's API is rate-limited for now, so Sigil could not {doing}; {wait}", retry_after=seconds
    )


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


def capability_clear_slot(*, full: str, slot: str) -> bool:
    """Delete `slot`, left on the runtime by a failed placement of `full`, unless `full` has
    been placed there since; return whether it did. Idempotent. Raises RuntimeUnavailable
    (transient) for the task to retry."""
    with placement_lock(full, blocking=True):
        runtime = get_runtime()
        placed = Capability.objects.filter(
            full_name=full, slot=slot, state__in=routes.SERVED_STATES, backend__in=_same_runtime(runtime)
        ).exists()
        if placed:
            return False
        runtime.remove(slot=slot)
        pager.pager_drop_evicting(full)
    return True


def capability_page_in(
    *, full: str, reason: str = "call", wait_seconds: float | None = None
) -> tuple[routes.CachedRoute, bool]:
    """Make `full` live on the runtime (the cold path); return its fresh route and whether
    this call placed it.

    Concurrent callers for the same capability wait on one lock, so one placement serves
    them all; a caller waits at most `wait_seconds` for it (0: not at all). A prewarm
    (`reason="prewarm"`) pages out only the victims the pager chose, which prewarm judged:
    when the account refuses it for want of room, it is shed. Raises NotFound,
    UpstreamError, Timeout (the wait ran out), PlacementUnderWay (with 0, the lock is held),
    Unavailable (the account is full).
    """
    with placement_lock_within(full, wait_seconds=wait_seconds):
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
            current = capability.current_version
            bundle = bundle_for(current.code, capability, get_runtime(), version=current.number)
            with placement_room(
                full=full,
                capability_type=capability.type,
                expires_at=capability.expires_at,
                page_out_for_account=reason != "prewarm",
            ) as room:
                placement = room.place(bundle)
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


# A victim's delete waits for its calls in flight up to the invoke timeout after new calls
# were turned away from it, plus this: no call still within its timeout is cut.
PAGE_OUT_GRACE_SECONDS = 2.0


# Page-outs sent or waiting on calls in flight, by when their task should next run (epoch s):
# one past that by a lease was lost with its worker, and is sent again (services/reaper.py).
PAGE_OUTS_DUE_KEY = "sigil:pageout:due"


def page_out_later(full: str) -> None:
    """Page `full` out in the background (once the transaction commits), its due time noted."""
    _page_out_due(full, within=0)
    capability_page_out_task.delay_on_commit(full=full)


def _page_out_due(full: str, *, within: float) -> None:
    get_redis().zadd(PAGE_OUTS_DUE_KEY, {full: time.time() + within})


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
        return _page_out_locked(full=full, wait_until=wait_until)


def _page_out_locked(*, full: str, wait_until: float | None) -> bool:
    """`capability_page_out` with `full`'s placement lock held by the caller."""
    capability = Capability.objects.select_related("agent").filter(full_name=full, state=State.EVICTING).first()
    if capability is None:
        get_redis().zrem(PAGE_OUTS_DUE_KEY, full)
        return False
    # The route first: a call that still found it served holds an in-flight count by the
    # time this checks; one that did not goes to page it in, and waits for this lock.
    leaving = copy.copy(capability)
    leaving.state = State.PAGED_OUT
    routes.route_publish(leaving)
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
    with transaction.atomic():
        changed = Capability.objects.filter(pk=capability.pk, state=State.EVICTING).update(
            state=State.PAGED_OUT, placed_sha="", updated_at=timezone.now()
        )
        if changed:
            audit_record(actor="system", action="capability.evicted", agent_name=capability.agent.name, subject=full)
    pager.pager_forget(full)
    get_redis().zrem(PAGE_OUTS_DUE_KEY, full)
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


def runtime_ready(*, actor: str) -> list[str]:
    """Make the current runtime ready to serve as a process starts (web, Celery worker): what
    `runtime_provision` does, once per process (the runtime remembers it), with the deploy of
    Sigil's own Worker made once across processes by its lock. So `/_health` is ok right after
    a start without a separate `deployruntime`.

    Never raises a runtime failure: a process must start even while Cloudflare is down or
    misconfigured; the failure is logged, `/_health` reports it, and the first placement
    provisions again. Returns what was done.
    """
    try:
        return runtime_provision(actor=actor)
    except RuntimeFailure as exc:
        logger.warning("%s runtime not ready at start: %s", settings.SIGIL_BACKEND, exc)
        return []


def _same_runtime(runtime: Runtime) -> tuple[str, ...]:
    """The `backend` values of rows placed on `runtime` ("" for rows from before it was recorded)."""
    return ("", runtime.name) if runtime is get_runtime() else (runtime.name,)


def placement_in_progress(full: str) -> bool:
    return bool(get_redis().exists(placement_lock_key(full)))


def capability_reap_placements(*, now: float | None = None) -> dict[str, int]:
    """End what a dead process left of its placements and page-outs, once its lease is over:
    a `placing` entry whose placer's lock is gone gives its slot back (and the victims that
    placement chose are paged out); a page-out due more than a lease ago whose capability is
    still evicting, its lock free, is sent again. Each is audited. Idempotent; returns counts.
    """
    now = time.time() if now is None else now
    freed = 0
    for full in pager.pager_placing():
        if not pager.pager_drop_unheld_placing(full, lock_key=placement_lock_key(full)):
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
    overdue = [m.decode() for m in redis.zrangebyscore(PAGE_OUTS_DUE_KEY, "-inf", now - leases.lease_seconds())]
    evicting = set(
        Capability.objects.filter(full_name__in=overdue, state=State.EVICTING).values_list("full_name", flat=True)
    )
    for full in overdue:
        if full not in evicting:
            redis.zrem(PAGE_OUTS_DUE_KEY, full)
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


def capability_reconcile() -> dict[str, int]:
    """Compare what the runtime holds with the registry, and repair both sides.

    Scripts no capability should have (a worker killed mid-page-in, a lost delete) are
    deleted; capabilities the registry thinks live but the runtime lacks are marked paged
    out, so their next call pages them in. On a runtime with a slot limit, the pager's sets
    are then made to agree with the registry (`pager_sync`), and the capabilities over the
    slots are shed. Placements in progress are left alone. Each change is in the audit
    trail; the counts are returned. Safe to run at any time.
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
        if not runtime.created_here(slot=slot):
            continue  # the owner's own, though it looks like Sigil's
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

    if runtime.total_slots is None:
        return {"orphans_removed": orphans, "repaired": repaired, "pager_corrected": 0, "shed": 0, **_reap()}
    corrected = pager.pager_sync(is_placing=placement_in_progress)
    for full in corrected:
        audit_record(actor="system", action="pager.corrected", subject=full)
    # An evicting capability whose page-out was never sent (the placement that chose it died
    # after placing its newcomer) would hold margin for good: send it again once any such
    # placement's lock has expired (a page-out still queued makes this one a no-op).
    stale = timezone.now() - timedelta(seconds=settings.SIGIL_PLACEMENT_LOCK_SECONDS)
    for full in on_this_runtime.filter(state=State.EVICTING, updated_at__lt=stale).values_list("full_name", flat=True):
        page_out_later(full)
    shed = capability_shed_excess()
    return {
        "orphans_removed": orphans,
        "repaired": repaired,
        "pager_corrected": len(corrected),
        "shed": len(shed),
        **_reap(),
    }


def _reap() -> dict[str, int]:
    """Reconcile ends what dead processes left too (services/reaper.py, which imports this module)."""
    from capabilities.services.reaper import capability_reap

    return capability_reap()


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
            pager.pager_mark_leaving(full, now=time.time())
    return capability_page_out(full=full, wait_until=0)


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
        current = capability.current_version
        bundle = bundle_for(current.code, capability, runtime, version=current.number)
        if bundle.sha == capability.placed_sha:
            return False
        try:
            # Through the pager, like any placement: never chosen as a victim meanwhile.
            with placement_room(full=full, capability_type=capability.type, expires_at=capability.expires_at) as room:
                room.place(bundle)
                with transaction.atomic():
                    Capability.objects.filter(pk=capability.pk).update(placed_sha=bundle.sha, updated_at=timezone.now())
                    audit_record(
                        actor="system",
                        action="capability.bindings_refreshed",
                        agent_name=capability.agent.name,
                        subject=full,
                        detail={"bindings": capability.bindings},
                    )
        except Unavailable as exc:
            raise RuntimeThrottled(exc.message, retry_after=exc.retry_after) from exc  # the task waits it out
        except UpstreamError as exc:
            raise RuntimeUnavailable(str(exc)) from exc  # transient: the task tries again
        capability.placed_sha = bundle.sha
        routes.route_publish(capability)
    return True
