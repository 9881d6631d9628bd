"""`python manage.py resetbreaker AGENT--NAME [--json]`."""

from capabilities import services
from capabilities.selectors import capability_get
from sigil.owner_commands import CAPABILITY, CLI_ACTOR, OwnerCommand


class Command(OwnerCommand):
    """Close a capability's breaker now: calls reach it again (a forced degraded state ends too)."""

    arguments = (CAPABILITY,)

    def act(self, *, capability: str, **options) -> dict:
        services.capability_reset_breaker(capability=capability_get(full=capability), actor=CLI_ACTOR)
        return {"capability": capability, "breaker": "closed"}

    def describe(self, result: dict) -> str:
        return f"{result['capability']}: breaker closed"
