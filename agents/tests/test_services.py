"""Owner-facing services on agents: the webhook settings."""

import pytest

from agents import services
from agents.models import Agent, AuditEvent
from sigil.errors import InvalidRequest


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
    # At rest the key is encrypted: the database never holds it in plain text.
    stored = Agent.objects.filter(name="carol").values_list("webhook_secret_encrypted", flat=True).get()
    assert stored and "s3cret" not in stored
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


@pytest.mark.django_db(transaction=True)
def test_the_migration_encrypts_webhook_keys_kept_in_plain_text():
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    before = [("agents", "0002_lifecycle")]
    executor = MigrationExecutor(connection)
    leaves = executor.loader.graph.leaf_nodes()
    try:
        executor.migrate(before)
        old_agent = executor.loader.project_state(before).apps.get_model("agents", "Agent").objects
        old_agent.create(name="keyed", webhook_secret="shared-key")
        old_agent.create(name="unkeyed")
        MigrationExecutor(connection).migrate(leaves)
        keyed, unkeyed = Agent.objects.get(name="keyed"), Agent.objects.get(name="unkeyed")
        assert keyed.webhook_secret == "shared-key" and "shared-key" not in keyed.webhook_secret_encrypted
        assert (unkeyed.webhook_secret, unkeyed.webhook_secret_encrypted) == ("", "")
    finally:
        MigrationExecutor(connection).migrate(leaves)


def test_a_webhook_key_stored_under_another_secrets_key_fails_the_delivery_visibly(sigil, settings, webhook_receiver):
    agent = services.agent_create(name="dora", actor="owner:test")
    services.agent_set_webhook(agent=agent, url=webhook_receiver.url, secret="old-key", actor="owner:test")
    settings.SIGIL_SECRETS_KEY = "A" * 43 + "="  # a new key: the stored webhook key no longer opens
    delivery = {"id": "d-1", "event": "capability.degraded", "capability": "dora--x"}
    services.agent_webhook_deliver(agent_id=agent.pk, delivery=delivery)
    assert webhook_receiver.received == []  # neither unsigned nor signed with a wrong key
    failed = AuditEvent.objects.get(action="webhook.failed", agent_name="dora")
    assert "SIGIL_SECRETS_KEY changed" in failed.detail["reason"] and failed.detail["delivery"] == "d-1"

    # As the reason says, the owner sets the secret again; deliveries are signed with it.
    assert services.agent_set_webhook(agent=agent, url=webhook_receiver.url, secret="new-key", actor="owner:test")
    services.agent_webhook_deliver(agent_id=agent.pk, delivery={**delivery, "id": "d-2"})
    headers, body = webhook_receiver.received[0]
    assert headers["x-sigil-signature"] == services.webhook_signature("new-key", body)


def test_an_alert_to_an_agent_without_a_webhook_key_is_signed_with_one_made_for_it(sigil, webhook_receiver):
    agent = services.agent_create(name="erin", actor="owner:test")
    services.agent_set_webhook(agent=agent, url=webhook_receiver.url, secret=None, actor="owner:test")
    assert Agent.objects.get(name="erin").webhook_secret == ""  # the owner set none
    delivery = {"id": "d-1", "event": "capability.degraded", "capability": "erin--x"}
    services.agent_webhook_deliver(agent_id=agent.pk, delivery=delivery)
    services.agent_webhook_deliver(agent_id=agent.pk, delivery={**delivery, "id": "d-2"})

    made = Agent.objects.get(name="erin").webhook_secret
    assert made.startswith("whsec_") and len(made) > 40
    assert [headers["x-sigil-signature"] for headers, _ in webhook_receiver.received] == [
        services.webhook_signature(made, body) for _, body in webhook_receiver.received
    ]
    assert len(webhook_receiver.received) == 2  # both signed with the one key, made once
    assert AuditEvent.objects.filter(action="agent.webhook_secret_created", agent_name="erin").count() == 1
