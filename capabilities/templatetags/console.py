"""Template tags for the owner's console pages."""

from __future__ import annotations

from django import template

from capabilities.models import BreakerState, Capability, State

register = template.Library()


@register.simple_tag
def degraded_capabilities(limit: int = 20) -> list[Capability]:
    """The capabilities whose breaker is open (tripped or forced), most recently opened first."""
    query = (
        Capability.objects.select_related("agent")
        .exclude(state=State.REMOVED)
        .filter(breaker_state=BreakerState.OPEN)
        .order_by("-breaker_opened_at", "full_name")
    )
    return list(query[:limit])
