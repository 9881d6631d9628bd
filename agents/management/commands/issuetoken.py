"""`python manage.py issuetoken AGENT --scope deploy|invoke [--label L] [--expires-days N] [--json]`."""

from datetime import timedelta

from django.utils import timezone

from agents import services
from agents.models import Scope
from agents.selectors import agent_named
from sigil.owner_commands import CLI_ACTOR, OwnerCommand, argument, iso


class Command(OwnerCommand):
    """Issue a token to an agent; its secret is shown once."""

    arguments = (
        argument("agent"),
        argument("--scope", required=True, choices=Scope.values),
        argument("--label", default="", help="a note to recognise the token by"),
        argument("--expires-days", type=float, help="days until the token stops working (default never)"),
    )

    def act(self, *, agent: str, scope: str, label: str, expires_days: float | None, **options) -> dict:
        expires_at = timezone.now() + timedelta(days=expires_days) if expires_days is not None else None
        token, secret = services.token_issue(
            agent=agent_named(agent), scope=scope, actor=CLI_ACTOR, label=label, expires_at=expires_at
        )
        return {"agent": agent, "scope": scope, "prefix": token.prefix, "token": secret, "expires_at": iso(expires_at)}

    def describe(self, result: dict) -> str:
        return f"{result['scope']} token for {result['agent']}, shown once:\n  {result['token']}"
