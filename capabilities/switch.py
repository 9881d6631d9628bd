"""Switching SIGIL_BACKEND: every capability moves to the new runtime while agents keep
calling it at the same URL with the same tokens (the seed's path from the $5 pool to the
namespace).

The owner changes SIGIL_BACKEND, restarts Sigil, and runs `manage.py switchbackend`,
which walks `backend_switch`. Each capability is placed on the new runtime and recorded
there (`capability_switch_backend`); until then the gateway serves it from its previous
placement, and a grace period later that placement is deleted. A last sweep deletes
whatever the previous runtime still holds that no capability does, so a switch that was
interrupted and run again finishes the job.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from django.db.models import F

from capabilities import services
from capabilities.models import Capability, State
from capabilities.runtimes import get_runtime
from capabilities.runtimes.errors import RuntimeFailure
from sigil_site.errors import InvalidRequest, SigilError


@dataclass(frozen=True)
class SwitchEvent:
    """One thing the switch did, for the owner to follow: `kind` is "provisioned",
    "adopted", "moved" (with `step`), "failed" (with `error`), "released" or "swept"."""

    kind: str
    full: str = ""
    index: int = 0
    total: int = 0
    step: services.SwitchStep | None = None
    error: str = ""
    backend: str = ""
    slots: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def backend_switch(*, source: str | None, actor: str, grace_seconds: float) -> Iterator[SwitchEvent]:
    """Move every capability not on the current runtime to it, yielding progress.

    `source` limits the switch to capabilities on that runtime, and names the runtime of
    those placed before Sigil recorded runtimes; without it, such capabilities make the
    switch refuse (InvalidRequest) rather than guess. Safe to interrupt and run again: each
    capability moves at most once, and the sweep deletes what an interrupted run left.
    A capability that cannot move is reported and keeps being served where it is.
    """
    runtime = get_runtime()
    if source == runtime.name:
        raise InvalidRequest(f"SIGIL_BACKEND is already {source}: set it to the runtime to switch to")
    yield SwitchEvent("provisioned", backend=runtime.name, lines=runtime.provision())

    unrecorded = Capability.objects.exclude(state=State.REMOVED).filter(backend="")
    if unrecorded.exists():
        if source is None:
            raise InvalidRequest(
                f"{unrecorded.count()} capabilities were placed before Sigil recorded their runtime: "
                "name it with --from"
            )
        yield SwitchEvent("adopted", backend=source, total=services.capability_adopt_backend(backend=source))

    moving = Capability.objects.exclude(state=State.REMOVED).exclude(backend=runtime.name)
    if source is not None:
        moving = moving.filter(backend=source)
    # Most recently called first: on a runtime with a slot limit, they are the ones placed.
    fulls = list(
        moving.order_by(F("last_access_at").desc(nulls_last=True), "full_name").values_list("full_name", "backend")
    )
    sources = {backend for _, backend in fulls} | ({source} if source else set())

    pending: deque[tuple[float, str, str, str]] = deque()  # (due, backend, slot, full)
    for index, (full, _) in enumerate(fulls, start=1):
        try:
            step = services.capability_switch_backend(full=full, actor=actor)
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
        yield SwitchEvent("swept", backend=backend, slots=services.runtime_sweep_previous(backend=backend, actor=actor))


def _release(item: tuple[float, str, str, str], actor: str) -> SwitchEvent:
    _, backend, slot, full = item
    try:
        released = services.runtime_release_previous(backend=backend, slot=slot, actor=actor)
    except RuntimeFailure as exc:
        # The sweep at the end (or of the next run) deletes it.
        return SwitchEvent("failed", full=full, backend=backend, slots=[slot], error=str(exc))
    return SwitchEvent("released", full=full, backend=backend, slots=[slot] if released else [])
