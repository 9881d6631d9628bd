"""`python manage.py listagents [--json]`: every agent, whether it is enabled, its tokens and capabilities."""

from datetime import datetime

from django.db.models import Count, Q
from django.utils import timezone

from agents.models import Agent
from sigil.owner_commands import OwnerCommand, iso, table


class Command(OwnerCommand):
    """List the agents: enabled or not, their tokens (revoked and expired ones marked), capabilities."""

    def act(self, **options) -> list[dict]:
        # Not removed, and no split's staged version (a row of its own, named `{full}--v{n}`).
        current = ~Q(capabilities__state="removed") & Q(capabilities__variant_of__isnull=True)
        agents = Agent.objects.annotate(
            capability_count=Count("capabilities", filter=current, distinct=True),
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
                "tokens": ", ".join(f"{t['prefix']} {t['scope']}{token_state(t)}" for t in a["tokens"]),
            }
            for a in result
        ]
        return table(rows, ["agent", "active", "capabilities", "tokens"])


def token_state(token: dict) -> str:
    """(revoked) or (expired) after a token that no longer works; nothing for a usable one."""
    if token["revoked_at"]:
        return " (revoked)"
    if token["expires_at"] and datetime.fromisoformat(token["expires_at"]) <= timezone.now():
        return " (expired)"
    return ""
