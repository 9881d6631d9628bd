"""The pager's room: putting code on the runtime, with a slot claimed (and victims chosen)
on runtimes with a slot limit, and the runtime's refusals turned into API errors.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from django.utils import timezone

from agents.services import audit_record
from capabilities import bindings as binding_rules
from capabilities import names
from capabilities.books import pager, routes
from capabilities.jobs import capability_clear_slot as capability_clear_slot_task
from capabilities.models import Capability, State
from capabilities.runtimes import errors as runtime_errors
from capabilities.runtimes import get_runtime
from capabilities.runtimes.base import CodeBundle, Runtime
from capabilities.services.page_outs import (
    capability_shed_excess,
    mark_evicting,
    page_out_for_account,
    page_out_later,
    pager_built,
    restore_victim,
    same_runtime,
)
from capabilities.services.records import Placement
from sigil import redis_keys
from sigil.errors import Conflict, InvalidRequest, TooLarge, Unavailable, UpstreamError
from sigil.redis_client import get_redis

logger = logging.getLogger(__name__)

# How long a page-in waits for background page-outs to free the safety margin.
ROOM_WAIT_SECONDS = 30
# What a shed newcomer asks its caller to wait: a page-out or the owner freeing a script.
ACCOUNT_FULL_RETRY_SECONDS = 30
# How long /_health reports the account full after the last refusal.
ACCOUNT_FULL_REPORTED_SECONDS = 3600


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


class Room:
    """A placement on the runtime, made room for by the pager: see `placement_room`."""

    def __init__(self, *, full: str, capability_type: str, expires_at: datetime | None, evicts: bool = True) -> None:
        self.full = full
        self.evicts = evicts
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
            self.marked = [v for v in self.claim.victims if mark_evicting(v.full)]
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
            except runtime_errors.SlotsExhausted as exc:
                victim = (
                    page_out_for_account(newcomer=self.full, deadline=deadline) if self.claim and self.evicts else None
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
        pager_built()
        while True:
            claim = pager.pager_claim_slot(
                full=self.full,
                now=time.time(),
                slots=self.runtime.total_slots,
                safety_margin=self.runtime.safety_margin,
                max_victims=None if self.evicts else 0,
            )
            if claim.outcome == "no-room":
                raise Unavailable(
                    f"no free slot for {self.full}, and this placement pages nothing out to make one",
                    retry_after=ACCOUNT_FULL_RETRY_SECONDS,
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
            restore_victim(victim)
        pager.pager_take_chosen(self.full)

    def _slot_cleared(self) -> bool:
        """A failed new placement may have left its script behind (uploaded, its URL not yet
        turned on): delete it now, or have it deleted in the background if the runtime fails."""
        if Capability.objects.filter(full_name=self.full, state__in=routes.SERVED_STATES).exists():
            return True  # placed before after all (the pager had lost it): its script serves
        try:
            self.runtime.remove(slot=self.slot)
        except runtime_errors.RuntimeUnavailable:
            capability_clear_slot_task.delay_on_commit(full=self.full, slot=self.slot)
            return False
        return True


@contextmanager
def placement_room(
    *, full: str, capability_type: str, expires_at: datetime | None, evicts: bool = True
) -> Iterator[Room]:
    """Place `full` on the runtime with `room.place(bundle)`, and record the placement in the
    database inside the block.

    Call with `full`'s placement lock held. On a runtime with a slot limit the pager's page-out
    runs in the seeds' order: victims are marked evicting (still served), the newcomer is
    placed and recorded, and only then are the victims deleted, in the background. If the
    block raises, the victims are restored and the newcomer's claim is given back. Without
    `evicts`, the placement pages out nothing to make room (prewarm, which pages out what it
    chose first): it takes a free slot or raises Unavailable, and an account that refuses
    the newcomer (10037) sheds it.
    """
    room = Room(full=full, capability_type=capability_type, expires_at=expires_at, evicts=evicts)
    try:
        yield room
    except BaseException:
        room.release()
        raise
    room.settle()


def room_for(capability: Capability, **options: bool):
    """`placement_room` for `capability` as its row stands (its type and expiry)."""
    return placement_room(
        full=capability.full_name, capability_type=capability.type, expires_at=capability.expires_at, **options
    )


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
    get_redis().set(redis_keys.ACCOUNT_FULL, message, ex=ACCOUNT_FULL_REPORTED_SECONDS)


def runtime_account_warning() -> str | None:
    """What /_health warns of when the runtime's account refused a script lately, else None."""
    value = get_redis().get(redis_keys.ACCOUNT_FULL)
    return value.decode() if value is not None else None


def slot_for(full: str, runtime: Runtime) -> str:
    """The runtime slot `full` uses: the one it was given before on this runtime (so a pooled
    script keeps its workers.dev name across evictions), else the runtime's name for it, made
    longer while another capability already holds that name (a hash collision never
    overwrites). A slot on another runtime (before a switch of SIGIL_BACKEND) is not reused."""
    on_runtime = same_runtime(runtime)
    current = (
        Capability.objects.exclude(state=State.REMOVED).filter(full_name=full).values_list("slot", "backend").first()
    )
    if current and current[0] and current[1] in on_runtime:
        return current[0]
    for attempt in range(8):
        slot = runtime.slot_for(full, attempt=attempt)
        taken = (
            Capability.objects.exclude(state=State.REMOVED)
            .exclude(full_name=full)
            .filter(slot=slot, backend__in=on_runtime)
            .exists()
        )
        if not taken:
            return slot
    raise Conflict(f"no free runtime name for {full}")


def _place(full: str, slot: str, bundle: CodeBundle, runtime: Runtime) -> None:
    """Put `bundle` on `runtime` at `full`'s `slot`. Runtime errors become API errors, with
    the bundle's secrets masked in what the runtime quotes of the code (a start that threw)."""
    try:
        runtime.place(slot=slot, bundle=bundle, tenant=names.agent_of(full))
    except runtime_errors.ScriptTooLarge as exc:
        raise TooLarge(f"the runtime refused the script as too large: {exc}") from exc
    except runtime_errors.SlotsExhausted:
        raise  # a full account: the caller (Room) pages out or sheds
    except runtime_errors.RuntimeRejected as exc:
        told = bundle.masked(str(exc))
        # Not chained when masked: the runtime's own words would be logged with the traceback.
        raise InvalidRequest(f"the runtime refused the script: {told}") from (exc if told == str(exc) else None)
    except runtime_errors.RuntimeThrottled as exc:
        raise runtime_throttled(exc, doing=f"place {full}") from exc
    except runtime_errors.RuntimeUnavailable as exc:
        raise UpstreamError(f"the runtime could not place {full}: {exc}") from exc


def runtime_throttled(exc: runtime_errors.RuntimeThrottled, *, doing: str) -> Unavailable:
    """`503 unavailable` for a runtime whose provider refuses calls for a while (Cloudflare's
    rate-limit lockout, or Sigil's budget for its API having no room for longer than the work
    may wait), with Retry-After the time until there is room. The message is Sigil's and says
    one thing: the provider's own words (its error codes, its limits) stay in the log."""
    logger.warning("the runtime is throttled and could not %s: %s", doing, exc)
    seconds = max(1, math.ceil(exc.retry_after)) if exc.retry_after is not None else None
    why = exc.why or (
        f"the runtime's API is rate-limited for {seconds} s" if seconds else "the runtime's API is rate-limited for now"
    )
    return Unavailable(f"Sigil could not {doing}: {why}", retry_after=seconds)
