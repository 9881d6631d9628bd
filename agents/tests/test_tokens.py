"""A token's usability is one rule (agents.tokens.token_state): a row, its cached entry and the
owner's filter on rows all agree on it, at the very moment of expiry too."""

from datetime import timedelta

import pytest
from django.utils import timezone

from agents import selectors, services, tokens
from agents.models import Token
from agents.tokens import TokenState
from sigil.errors import Unauthenticated


@pytest.mark.django_db
def test_a_row_its_cached_entry_and_the_owners_filter_agree_on_every_state(redis_client):
    agent = services.agent_create(name="carol", actor="owner:test")
    now = timezone.now()
    expiries = {"open-ended": None, "later": now + timedelta(hours=1), "now": now, "earlier": now - timedelta(hours=1)}
    secrets = {}
    for label, expires_at in expiries.items():
        _, secrets[label] = services.token_issue(
            agent=agent, scope="invoke", actor="owner:test", label=label, expires_at=expires_at
        )
    revoked, secrets["revoked"] = services.token_issue(agent=agent, scope="invoke", actor="owner:test", label="revoked")
    services.token_revoke(token=revoked, actor="owner:test")

    expected = {
        "open-ended": TokenState.USABLE,
        "later": TokenState.USABLE,
        "now": TokenState.EXPIRED,
        "earlier": TokenState.EXPIRED,
        "revoked": TokenState.REVOKED,
    }
    rows = {token.label: token for token in Token.objects.all()}
    assert {label: token.state(now.timestamp()) for label, token in rows.items()} == expected
    for state in TokenState:
        filtered = set(Token.objects.filter(tokens.state_filter(state, now)).values_list("label", flat=True))
        assert filtered == {label for label, s in expected.items() if s == state}, state
    for label, state in expected.items():
        if state == TokenState.USABLE:
            assert selectors.token_authenticate(secrets[label]).agent_name == "carol"
        else:
            with pytest.raises(Unauthenticated, match="revoked or expired"):
                selectors.token_authenticate(secrets[label])
    entry = tokens.encode(agent.pk, "carol", "invoke", now.timestamp())
    assert tokens.decode("hash", entry, now.timestamp()) is None  # expired at that very moment
    assert tokens.decode("hash", entry, now.timestamp() - 1) is not None
