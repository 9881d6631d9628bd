"""The owner sees a split's staged version as part of its capability: never as a capability
of its own (its internal `{full}--v{n}` row), and never offered as a rollback target while it
was never served."""

import io
import json

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from agents.models import Agent
from capabilities.models import Capability
from capabilities.runtimes import runtimes_forget
from capabilities.tests.test_splits import VARIANT, split, stage
from testsupport.cast import deploy_answering as deploy


@pytest.fixture
def owner_client(sigil, client):
    client.force_login(get_user_model().objects.create_superuser("owner", "owner@example.invalid", "pw"))
    return client


def command(*args) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_a_splits_staged_version_is_shown_on_its_capability_only(owner_client, alice, cf_settings, monkeypatch):
    settings = cf_settings
    settings.SIGIL_DEPLOY_COOLDOWN_SECONDS = 0
    deploy(alice, "ping", "one")
    stage(alice, "two")
    assert split(alice, weight=50).status_code == 200
    assert Capability.objects.filter(full_name=VARIANT).exists()  # the internal row is there...
    ping = Capability.objects.get(full_name="alice--ping")
    agent = Agent.objects.get(name="alice")

    # ... and shown nowhere as a capability: the agent's page and count, listcapabilities,
    agent_page = owner_client.get(f"/admin/agents/agent/{agent.pk}/change/").content.decode()
    assert "alice--ping" in agent_page and VARIANT not in agent_page
    listing = owner_client.get("/admin/agents/agent/")
    assert next(a for a in listing.context["cl"].result_list if a.name == "alice").capability_count == 1
    assert [a["capabilities"] for a in json.loads(command("listagents", "--json"))] == [1]
    listed = json.loads(command("listcapabilities", "--json"))
    assert [(c["capability"], c["version"], c["staged_version"]) for c in listed] == [("alice--ping", 1, 2)]
    assert VARIANT not in command("listcapabilities")

    # ... while switchbackend names it as the capability's staged version.
    settings.SIGIL_BACKEND = "worker-pool"  # the owner changed it and restarted
    monkeypatch.setenv("SIGIL_BACKEND", "worker-pool")  # in the shell the command runs from
    runtimes_forget()
    plan = command("switchbackend", "--dry-run", "--from", "local")
    assert "alice--ping (staged v2): local -> worker-pool" in plan and f"{VARIANT}:" not in plan
    settings.SIGIL_BACKEND = "local"
    runtimes_forget()

    # The staged version is not offered as a rollback: it never served as the current one.
    page = owner_client.get(f"/admin/capabilities/capability/{ping.pk}/change/").content.decode()
    assert 'id="rollback-v2"' not in page and "staged: promote or abort it below" in page
    version_page = owner_client.get(f"/admin/capabilities/capability/{ping.pk}/versions/2/").content.decode()
    assert "Roll back to v2" not in version_page

    abort = alice.session.post(
        f"{alice.base_url}/_api/capabilities/alice--ping/split/abort", headers=alice.headers(alice.deploy_token)
    )
    assert abort.status_code == 200
    page = owner_client.get(f"/admin/capabilities/capability/{ping.pk}/change/").content.decode()
    assert 'id="rollback-v2"' not in page and "staged once, never served" in page


def test_listagents_text_marks_revoked_tokens_instead_of_hiding_them(alice):
    from agents import services
    from agents.models import Token

    token = Token.objects.get(agent__name="alice", scope="deploy")
    services.token_revoke(token=token, actor="owner:test")
    text = command("listagents")
    assert f"{token.prefix} deploy (revoked)" in text
    assert "invoke (revoked)" not in text
