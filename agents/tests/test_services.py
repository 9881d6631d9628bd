"""Owner-facing services on agents: the webhook settings."""

import pytest

from agents import services
from agents.models import Agent, AuditEvent
from sigil_site.errors import InvalidRequest


@pytest.mark.django_db
def test_webhook_is_set_audited_without_its_secret_and_kept_when_not_given():
    agent = services.agent_create(name="carol", actor="owner:test")
    assert services.agent_set_webhook(
        agent=agent, url="https://hooks.example.invalid/sigil", secret="s3cret", actor="owner:test"
    )
    assert not services.agent_set_webhook(
        agent=agent, url="https://hooks.example.invalid/sigil", secret=None, actor="owner:test"
    )
    agent = Agent.objects.get(name="carol")
    assert agent.webhook_url == "https://hooks.example.invalid/sigil" and agent.webhook_secret == "s3cret"
    event = AuditEvent.objects.get(action="agent.webhook_changed")
    assert event.detail == {"url": "https://hooks.example.invalid/sigil", "secret_changed": True}
    assert "s3cret" not in str(event.detail)

    services.agent_set_webhook(agent=agent, url="", secret="", actor="owner:test")
    agent.refresh_from_db()
    assert agent.webhook_url == "" and agent.webhook_secret == ""


@pytest.mark.django_db
def test_webhook_must_be_an_http_url():
    agent = services.agent_create(name="carol", actor="owner:test")
    with pytest.raises(InvalidRequest):
        services.agent_set_webhook(agent=agent, url="file:///etc/passwd", secret=None, actor="owner:test")
