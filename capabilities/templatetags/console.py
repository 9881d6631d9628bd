"""Template tags for the owner's console pages."""

from __future__ import annotations

from django import template

from capabilities import selectors
from capabilities.models import Capability

register = template.Library()


@register.simple_tag
def degraded_capabilities(limit: int = 20) -> list[Capability]:
    """The capabilities whose breaker is open, most recently opened first."""
    return list(selectors.capabilities_degraded()[:limit])
