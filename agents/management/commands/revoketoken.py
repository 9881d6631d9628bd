"""`python manage.py revoketoken TOKEN_OR_PREFIX [--json]`."""

from agents import services, tokens
from agents.models import Token
from sigil.errors import InvalidRequest, NotFound
from sigil.owner_commands import CLI_ACTOR, OwnerCommand, argument


class Command(OwnerCommand):
    """Revoke a token, named by its secret or by its prefix (as listagents and the admin show it)."""

    arguments = (argument("token", help="the token itself, or its prefix"),)

    def act(self, *, token: str, **options) -> dict:
        found = list(Token.objects.select_related("agent").filter(secret_hash=tokens.hash_secret(token)))
        if not found:
            found = list(Token.objects.select_related("agent").filter(prefix=token)[:2])
        if not found:
            raise NotFound(f"no token {token[:12]!r}")
        if len(found) > 1:
            raise InvalidRequest(f"more than one token has the prefix {token!r}: give the token itself")
        revoked = services.token_revoke(token=found[0], actor=CLI_ACTOR)
        return {"agent": found[0].agent.name, "prefix": found[0].prefix, "revoked": revoked}

    def describe(self, result: dict) -> str:
        done = "revoked" if result["revoked"] else "was already revoked"
        return f"token {result['prefix']} of {result['agent']} {done}"
