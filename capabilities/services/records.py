"""The two rules every write of a capability's row keeps: its Redis copies follow it
(`capability_written`), and a placement becomes current in one way (`record_live`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from agents.services import audit_record
from capabilities.books import copies
from capabilities.models import Capability, CapabilityVersion, State


@dataclass(frozen=True)
class Placement:
    """Code put on a runtime by the pager's room (services/room.py): what `record_live` records."""

    slot: str
    backend: str  # the runtime that placed it: the slot is that runtime's
    cold_start: bool  # this placement paged the capability in (bounded runtimes only)
    evicted: str | None  # the (first) victim chosen to make room, if any


class Write:
    """The write `capability_written` wraps; `unchanged()` says the block found nothing to
    write after all, so the copies are left as they are."""

    changed = True

    def unchanged(self) -> None:
        self.changed = False


@contextmanager
def capability_written(full: str) -> Iterator[Write]:
    """A transaction that writes `full`'s row (and what goes with it: versions, audit
    events); once it is over, the row's Redis copies are published again from the database
    (copies.copies_publish). Every write of a capability's row is made inside one, so no
    caller republishes a copy by hand. A block that raises, or that calls
    `write.unchanged()`, publishes nothing."""
    write = Write()
    with transaction.atomic():
        yield write
    if write.changed:
        copies.copies_publish(full)


def record_live(
    capability: Capability,
    placement: Placement,
    *,
    bundle_sha: str,
    version: CapabilityVersion | None = None,
    now: datetime | None = None,
    **fields: Any,
) -> Capability:
    """A placement becomes current: `capability` is live at `placement`'s slot on the runtime
    that placed it (slot and runtime together, always), holding the bundle `bundle_sha`,
    serving `version` (None: its current one); `fields` are what else the same write
    changes (the public flag, the bindings a deploy asked for). Saves only those fields and
    returns the row.

    The one home of that rule: a deploy, a rollback, a promote, a page-in and a switch all
    call it, inside `capability_written` and with the capability's placement lock held.
    """
    capability.state = State.LIVE
    capability.slot = placement.slot
    capability.backend = placement.backend
    capability.placed_sha = bundle_sha
    capability.updated_at = now or timezone.now()
    changed = ["state", "slot", "backend", "placed_sha", "updated_at"]
    if version is not None:
        capability.current_version = version
        changed.append("current_version")
    for name, value in fields.items():
        setattr(capability, name, value)
        changed.append(name)
    capability.save(update_fields=changed)
    return capability


def capability_audit(capability: Capability, *, actor: str, action: str, detail: dict | None = None) -> None:
    """An event about `capability` in the audit trail, under its agent and full name."""
    audit_record(
        actor=actor, action=action, agent_name=capability.agent.name, subject=capability.full_name, detail=detail
    )


def capability_current(full: str, *related: str) -> Capability | None:
    """`full`'s row unless removed, with `related` loaded alongside (select_related)."""
    return Capability.objects.select_related(*related).exclude(state=State.REMOVED).filter(full_name=full).first()
