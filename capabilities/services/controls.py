"""What the owner sets on a capability: the public flag, its CPU limit, and the breaker
(reset, or forced open).
"""

from __future__ import annotations

import time

from django.db import transaction
from django.utils import timezone

from capabilities.books import breaker
from capabilities.models import BreakerState, Capability, State
from capabilities.services.observability import capability_record_breaker
from capabilities.services.records import capability_audit, capability_written
from sigil.errors import InvalidRequest, NotFound


def capability_reset_breaker(*, capability: Capability, actor: str) -> None:
    """Close a capability's breaker now (the owner's reset). Idempotent."""
    breaker.breaker_reset(full=capability.full_name)
    capability_record_breaker(full=capability.full_name, state=BreakerState.CLOSED, at_epoch=timezone.now().timestamp())
    capability_audit(capability, actor=actor, action="capability.breaker_reset")


# Cloudflare's longest CPU time per invocation on the Paid plan (reference §7.3).
MAX_CPU_MS = 300_000


def capability_set_cpu_limit(*, capability: Capability, cpu_ms: int | None, actor: str) -> None:
    """Give a capability its own CPU limit per call in ms (None: SIGIL_CPU_MS again), on the
    platform and loader runtimes; calls after this one use it. Idempotent.

    Raises InvalidRequest when it is not between 1 and 300000 ms.
    """
    if cpu_ms is not None and not 1 <= cpu_ms <= MAX_CPU_MS:
        raise InvalidRequest(f"a CPU limit is 1 to {MAX_CPU_MS} ms")
    detail = {"cpu_ms": cpu_ms}
    _owner_update(capability=capability, actor=actor, action="capability.cpu_limit_set", detail=detail, cpu_ms=cpu_ms)


def capability_set_public(*, capability: Capability, is_public: bool, actor: str) -> bool:
    """Make a capability public (callable by every agent) or private (its agent's only), for
    the owner. Returns False when it already was. Raises NotFound when it was removed."""
    if not Capability.objects.filter(pk=capability.pk).exclude(state=State.REMOVED).exists():
        raise NotFound(f"no capability {capability.full_name}")
    action, detail = "capability.updated", {"public": is_public}
    return _owner_update(capability=capability, actor=actor, action=action, detail=detail, is_public=is_public)


def _owner_update(*, capability: Capability, actor: str, action: str, detail: dict, **values) -> bool:
    """Set `values` on a capability not removed; when that changed it, audit `action` with
    `detail` (its Redis copies are published again by capability_written). Returns whether it
    changed."""
    with capability_written(capability.full_name) as write:
        changed = (
            Capability.objects.exclude(state=State.REMOVED)
            .filter(pk=capability.pk)
            .exclude(**values)
            .update(**values, updated_at=timezone.now())
        )
        if not changed:
            write.unchanged()
        else:
            capability_audit(capability, actor=actor, action=action, detail=detail)
    capability.refresh_from_db()
    return bool(changed)


def capability_force_degraded(*, capability: Capability, actor: str) -> None:
    """Open a capability's breaker until the owner resets it (capability_reset_breaker):
    the engine answers every call 503 `degraded` without trying the code. Idempotent.

    A call already in flight neither closes nor shortens it. Raises NotFound when the
    capability was removed.
    """
    full = capability.full_name
    if not Capability.objects.filter(pk=capability.pk).exclude(state=State.REMOVED).exists():
        raise NotFound(f"no capability {full}")
    now = time.time()
    breaker.breaker_force(full=full, actor=actor, now=now)
    with transaction.atomic():
        capability_record_breaker(full=full, state=BreakerState.OPEN, at_epoch=now, announce=False)
        capability_audit(capability, actor=actor, action="capability.forced_degraded")
    capability.refresh_from_db()
