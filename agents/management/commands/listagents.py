"""`python manage.py listagents [--json]`: every agent, whether it is enabled, its tokens and capabilities."""

from django.db.models import Count, Q

from agents.models import Agent
from sigil_site.owner_commands import OwnerCommand, iso, table


class Command(OwnerCommand):
    help = "List the agents: enabled or not, usable tokens, capabilities (not removed)."

    def act(self, **options) -> list[dict]:
        agents = Agent.objects.annotate(
            capability_count=Count("capabilities", filter=~Q(capabilities__state="removed"), distinct=True),
        ).order_by("name")
        return [
            {
                "agent": agent.name,
                "active": agent.is_active,
                "capabilities": agent.capability_count,
                "tokens": [
                    {
                        "prefix": token.prefix,
                        "scope": token.scope,
                        "label": token.label,
                        "created_at": iso(token.created_at),
                        "expires_at": iso(token.expires_at),
                        "revoked_at": iso(token.revoked_at),
                        "last_used_at": iso(token.last_used_at),
                    }
                    for token in agent.tokens.order_by("created_at")
                ],
                "webhook_url": agent.webhook_url or None,
                "created_at": iso(agent.created_at),
            }
            for agent in agents
        ]

    def describe(self, result: list[dict]) -> str:
        rows = [
            {
                "agent": a["agent"],
                "active": "yes" if a["active"] else "no",
                "capabilities": a["capabilities"],
                "tokens": ", ".join(f"{t['prefix']} {t['scope']}" for t in a["tokens"] if not t["revoked_at"]),
            }
            for a in result
        ]
        return table(rows, ["agent", "active", "capabilities", "tokens"])
