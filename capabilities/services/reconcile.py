"""Keeping Sigil's records and the runtime in agreement: reconciling what the runtime holds
with the registry (and the pager's sets with both), and provisioning what the runtime needs
besides capabilities.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from agents.services import audit_record
from capabilities.books import pager, routes
from capabilities.models import Capability, State
from capabilities.runtimes import get_runtime
from capabilities.runtimes.api_work import ApiClass, api_work
from capabilities.runtimes.errors import RuntimeFailure
from capabilities.services.edge import edge_provision
from capabilities.services.page_outs import capability_shed_excess, page_out_later, pager_rows, same_runtime
from capabilities.services.placement_lock import placement_in_progress
from capabilities.services.reaper import capability_reap
from capabilities.services.records import capability_audit, capability_written

logger = logging.getLogger(__name__)


def runtime_provision(*, actor: str) -> list[str]:
    """Create what the current runtime needs besides capabilities (the platform runtime's
    namespace and dispatch Worker, the loader runtime's KV namespace and loader Worker; with
    the edge on, its KV namespace, and on worker-pool its Worker); return what was done.
    Idempotent. Raises RuntimeUnavailable, RuntimeRejected."""
    runtime = get_runtime()
    done = edge_provision()  # first: the Workers carrying the edge bind its namespace
    done += runtime.provision()
    if done:
        audit_record(actor=actor, action="runtime.provisioned", subject=runtime.name, detail={"done": done})
    return done


def runtime_ready(*, actor: str) -> list[str]:
    """Make the current runtime ready to serve as a process starts (web, Celery worker): what
    `runtime_provision` does, once per process (the runtime remembers it), with the deploy of
    Sigil's own Worker made once across processes by its lock. So `/_health` is ok right after
    a start without a separate `deployruntime`.

    Never raises a runtime failure: a process must start even while Cloudflare is down or
    misconfigured, or its API budget spent; the failure is logged, `/_health` reports it, and
    the first placement provisions again. Its API calls are housekeeping: they never wait for
    room, so a process started while the budget is spent starts at once. Returns what was done.
    """
    try:
        with api_work(ApiClass.HOUSEKEEPING):
            return runtime_provision(actor=actor)
    except RuntimeFailure as exc:
        logger.warning("%s runtime not ready at start: %s", settings.SIGIL_BACKEND, exc)
        return []


def capability_reconcile() -> dict[str, int]:
    """Compare what the runtime holds with the registry, and repair both sides.

    Scripts no capability should have (a worker killed mid-page-in, a lost delete) are
    deleted; capabilities the registry thinks live but the runtime lacks are marked paged
    out, so their next call pages them in. On a runtime with a slot limit, the pager's sets
    are then made to agree with the registry (`pager_sync`), and the capabilities over the
    slots are shed. Placements in progress are left alone. What dead processes left is
    ended too (services/reaper.py). Each change is in the audit trail; the counts are
    returned. Safe to run at any time.
    Raises RuntimeUnavailable when the runtime cannot list its slots.
    """
    runtime = get_runtime()
    placed = set(runtime.list_slots())
    # Only this runtime's placements: during a switch of SIGIL_BACKEND, capabilities still on
    # the previous runtime are the switch's to move, not missing here.
    on_this_runtime = Capability.objects.filter(backend__in=same_runtime(runtime))
    served = dict(on_this_runtime.filter(state__in=routes.SERVED_STATES).values_list("slot", "full_name"))
    counts = {"orphans_removed": _remove_orphans(runtime, placed, served, on_this_runtime)}
    counts["repaired"] = _repair_missing(runtime, placed, served)
    if runtime.total_slots is None:
        return {**counts, "pager_corrected": 0, "shed": 0, **capability_reap()}
    corrected = pager.pager_sync(rows=pager_rows(), is_placing=placement_in_progress)
    for full in corrected:
        audit_record(actor="system", action="pager.corrected", subject=full)
    # An evicting capability whose page-out was never sent (the placement that chose it died
    # after placing its newcomer) would hold margin for good: send it again once any such
    # placement's lock has expired (a page-out still queued makes this one a no-op).
    stale = timezone.now() - timedelta(seconds=settings.SIGIL_PLACEMENT_LOCK_SECONDS)
    for full in on_this_runtime.filter(state=State.EVICTING, updated_at__lt=stale).values_list("full_name", flat=True):
        page_out_later(full)
    shed = capability_shed_excess()
    return {**counts, "pager_corrected": len(corrected), "shed": len(shed), **capability_reap()}


def _remove_orphans(runtime, placed: set[str], served: dict[str, str], on_this_runtime) -> int:
    """Delete the scripts Sigil placed that no served capability holds; return how many."""
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
    return orphans


def _repair_missing(runtime, placed: set[str], served: dict[str, str]) -> int:
    """Record as paged out the served capabilities whose script the runtime lacks; return how many."""
    repaired = 0
    for slot, full in served.items():
        if slot in placed or placement_in_progress(full):
            continue
        with capability_written(full) as write:
            capability = (
                Capability.objects.select_related("agent")
                .filter(full_name=full, state__in=routes.SERVED_STATES, backend__in=same_runtime(runtime))
                .first()
            )
            if capability is None:
                write.unchanged()
                continue
            capability.state = State.PAGED_OUT
            capability.placed_sha = ""
            capability.updated_at = timezone.now()
            capability.save(update_fields=["state", "placed_sha", "updated_at"])
            capability_audit(
                capability,
                actor="system",
                action="capability.repaired",
                detail={"reason": "not on the runtime", "slot": slot},
            )
        repaired += 1
    return repaired
