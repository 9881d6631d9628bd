"""Reads on capabilities, with the visibility rules of the contract."""

from __future__ import annotations

from django.db.models import Q, QuerySet

from agents.models import Agent, AuditEvent
from agents.tokens import Principal
from capabilities import names
from capabilities.models import Capability, CapabilityType, State
from capabilities.runtimes import get_runtime
from sigil_site.errors import InvalidRequest, NotFound


def capability_get_visible(*, principal: Principal, full: str) -> Capability:
    """The capability `full` if the caller may see it: its own, or another agent's public one.

    Another agent's private capability is NotFound, so its existence is not revealed.
    """
    names.split_full_name(full)
    capability = (
        Capability.objects.select_related("agent", "current_version")
        .exclude(state=State.REMOVED)
        .filter(full_name=full)
        .first()
    )
    if capability is None or not (capability.agent_id == principal.agent_id or capability.is_public):
        raise NotFound(f"no capability {full}")
    return capability


def capability_list_visible(
    *, principal: Principal, type: str | None = None, state: str | None = None, agent: str | None = None
) -> QuerySet[Capability]:
    """The caller's own capabilities and every public one, filtered; removed ones only on request."""
    query = Capability.objects.select_related("agent", "current_version").filter(
        Q(agent_id=principal.agent_id) | Q(is_public=True)
    )
    if type is not None:
        if type not in CapabilityType.values:
            raise InvalidRequest(f"type must be one of {', '.join(CapabilityType.values)}")
        query = query.filter(type=type)
    if state is not None:
        if state not in State.values:
            raise InvalidRequest(f"state must be one of {', '.join(State.values)}")
        query = query.filter(state=state)
        if state == State.REMOVED:
            query = query.filter(agent_id=principal.agent_id)
    else:
        query = query.exclude(state=State.REMOVED)
    if agent is not None:
        query = query.filter(agent__name=agent)
    return query.order_by("full_name", "id")


def backend_status() -> dict:
    """The runtime's slots and the registry's counts, as GET /_api/status reports them."""
    runtime = get_runtime()
    return {
        "backend": runtime.name,
        "total_slots": runtime.total_slots,
        "used_slots": Capability.objects.filter(state__in=(State.LIVE, State.EVICTING)).count(),
        "agents": Agent.objects.count(),
        "lru_enabled": runtime.total_slots is not None,
        "eviction_count": AuditEvent.objects.filter(action="capability.evicted").count(),
    }
