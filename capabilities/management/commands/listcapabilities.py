"""`python manage.py listcapabilities [--agent NAME] [--state STATE] [--json]`."""

from agents.selectors import agent_named
from capabilities.models import Capability, State
from sigil.owner_commands import OwnerCommand, argument, iso, table


class Command(OwnerCommand):
    """List the capabilities (removed ones only with --state removed), with their version (and staged one),
    breaker and calls."""

    arguments = (
        argument("--agent", help="only this agent's"),
        argument("--state", choices=State.values, help="only those in this state"),
    )

    def act(self, *, agent: str | None, state: str | None, **options) -> list[dict]:
        # A split's staged version, placed as a row of its own, is shown on its capability's line.
        query = (
            Capability.objects.filter(variant_of__isnull=True)
            .select_related("agent", "current_version", "staged_version")
            .order_by("full_name")
        )
        query = query.filter(state=state) if state else query.exclude(state=State.REMOVED)
        if agent:
            query = query.filter(agent=agent_named(agent))
        return [
            {
                "capability": c.full_name,
                "agent": c.agent.name,
                "type": c.type,
                "public": c.is_public,
                "state": c.state,
                "backend": c.backend,
                "version": c.current_version.number if c.current_version else None,
                "staged_version": c.staged_version.number if c.staged_version else None,
                "breaker": c.breaker_state,
                "calls": c.calls_total,
                "errors": c.errors_total,
                "last_access_at": iso(c.last_access_at),
                "expires_at": iso(c.expires_at),
            }
            for c in query
        ]

    def describe(self, result: list[dict]) -> str:
        return table(result, ["capability", "type", "public", "state", "version", "breaker", "calls", "errors"])
