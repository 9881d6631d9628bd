"""The agent, token and audit admin through Django's test client."""

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.test import Client

from agents.models import Agent, AuditEvent, Token
from testsupport.cast import AgentClient

PONG = 'export default { fetch() { return new Response("pong") } }'


@pytest.fixture
def owner_client(sigil, client):
    user = get_user_model().objects.create_superuser("owner", "owner@example.invalid", "owner-password")
    client.force_login(user)
    return client


def test_disabling_an_agent_stops_all_its_tokens_at_once_and_enabling_restores_them(owner_client, alice):
    agent = Agent.objects.get(name="alice")
    assert alice.call("/_api/capabilities").status_code == 200
    assert alice.call("/_api/capabilities", token="deploy").status_code == 200

    chosen = {"action": "disable_agents", "_selected_action": [agent.pk]}
    asked = owner_client.post("/admin/agents/agent/", chosen)
    assert asked.status_code == 200 and 'id="confirm"' in asked.content.decode()
    assert alice.call("/_api/capabilities").status_code == 200  # asked first: nothing changed yet

    owner_client.post("/admin/agents/agent/", {**chosen, "confirmed": "yes"})
    assert alice.call("/_api/capabilities").status_code == 401
    assert alice.call("/_api/capabilities", token="deploy").status_code == 401

    chosen = {"action": "enable_agents", "_selected_action": [agent.pk]}
    assert 'id="confirm"' in owner_client.post("/admin/agents/agent/", chosen).content.decode()
    owner_client.post("/admin/agents/agent/", {**chosen, "confirmed": "yes"})
    assert alice.call("/_api/capabilities").status_code == 200
    assert AuditEvent.objects.filter(action="agent.disabled", actor="owner:owner").count() == 1


def test_agent_list_counts_capabilities_calls_and_errors(owner_client, alice):
    alice.deploy(name="a", code="export default { fetch() { return new Response('a') } }")
    response = owner_client.get("/admin/agents/agent/")
    row = next(a for a in response.context["cl"].result_list if a.name == "alice")
    assert (row.capability_count, row.calls or 0, row.errors or 0) == (1, 0, 0)
    page = owner_client.get(f"/admin/agents/agent/{row.pk}/change/").content.decode()
    assert 'id="agent-capabilities"' in page and "alice--a" in page


def inline_data(response) -> dict:
    """What the page's read-only token inline posts back unchanged."""
    data = {}
    for inline in response.context["inline_admin_formsets"]:
        formset = inline.formset
        for name in formset.management_form.fields:
            data[f"{formset.prefix}-{name}"] = formset.management_form[name].value()
        for form in formset.forms:
            data.update({form.add_prefix(n): form[n].value() for n in form.fields if form[n].value() is not None})
    return data


def test_webhook_form_sets_the_url_and_a_write_only_secret(owner_client, alice):
    agent = Agent.objects.get(name="alice")
    url = f"/admin/agents/agent/{agent.pk}/change/"
    inlines = inline_data(owner_client.get(url))
    secret = "webhook-secret-never-shown"  # long enough not to turn up in a CSRF token by chance

    def post(**fields):
        assert owner_client.post(url, {**inlines, **fields}).status_code == 302

    post(webhook_url="https://hooks.example.invalid/a", new_webhook_secret=secret)
    agent.refresh_from_db()
    assert (agent.webhook_url, agent.webhook_secret) == ("https://hooks.example.invalid/a", secret)
    assert secret not in owner_client.get(url).content.decode()

    post(webhook_url="https://hooks.example.invalid/b", new_webhook_secret="")
    agent.refresh_from_db()
    assert (agent.webhook_url, agent.webhook_secret) == ("https://hooks.example.invalid/b", secret)
    post(webhook_url="", clear_webhook_secret="on")
    agent.refresh_from_db()
    assert (agent.webhook_url, agent.webhook_secret) == ("", "")
    assert AuditEvent.objects.filter(action="agent.webhook_changed").count() == 3


def test_issued_secret_is_shown_once_after_a_redirect_and_never_stored(owner_client, alice):
    agent = Agent.objects.get(name="alice")
    tokens_before = Token.objects.count()
    posted = owner_client.post(
        "/admin/agents/token/add/", {"agent": agent.pk, "scope": "invoke", "label": "x", "expires_at_0": ""}
    )
    token = Token.objects.get(label="x")
    assert posted.status_code == 302 and posted["Location"] == f"/admin/agents/token/{token.pk}/issued/"

    shown = owner_client.get(posted["Location"])
    secret = shown.context["secret"]
    assert "no-store" in shown["Cache-Control"] and secret in shown.content.decode()
    assert secret not in {token.prefix, token.secret_hash}

    reloaded = owner_client.get(posted["Location"])  # the owner reloads the page
    assert reloaded.status_code == 200 and 'id="secret-gone"' in reloaded.content.decode()
    assert secret not in reloaded.content.decode()
    assert Token.objects.count() == tokens_before + 1  # reloading issued nothing

    assert secret not in owner_client.get(f"/admin/agents/token/{token.pk}/change/").content.decode()
    assert secret not in owner_client.get("/admin/agents/token/").content.decode()
    assert alice.call("/_api/capabilities", token=secret).status_code == 200


def test_an_agent_added_in_the_admin_comes_with_its_two_tokens_shown_once(owner_client, sigil):
    inlines = inline_data(owner_client.get("/admin/agents/agent/add/"))
    posted = owner_client.post("/admin/agents/agent/add/", {**inlines, "name": "dora"})
    dora = Agent.objects.get(name="dora")
    assert posted.status_code == 302 and posted["Location"].startswith(f"/admin/agents/agent/{dora.pk}/created/?")

    shown = owner_client.get(posted["Location"])
    assert "no-store" in shown["Cache-Control"]
    secrets = {token.scope: secret for token, secret in shown.context["issued"]}
    assert set(secrets) == {"deploy", "invoke"} and all(secrets.values())
    page = shown.content.decode()
    assert "An <strong>invoke</strong> token" in page and "A <strong>deploy</strong> token" in page
    assert all(secret in page for secret in secrets.values())
    assert {t.scope: t.prefix for t in dora.tokens.all()} == {s: secret[:12] for s, secret in secrets.items()}
    assert AuditEvent.objects.filter(action="token.issued", agent_name="dora", actor="owner:owner").count() == 2

    reloaded = owner_client.get(posted["Location"]).content.decode()
    assert 'id="secret-gone"' in reloaded and not any(secret in reloaded for secret in secrets.values())
    assert dora.tokens.count() == 2  # reloading issued nothing

    dora_client = AgentClient("dora", secrets["deploy"], secrets["invoke"], sigil.url)
    assert dora_client.deploy(name="ping", code=PONG).status_code == 201
    assert dora_client.call("/dora/ping").text == "pong"


def test_the_secret_page_shows_nothing_to_another_session(owner_client, alice):
    agent = Agent.objects.get(name="alice")
    posted = owner_client.post("/admin/agents/token/add/", {"agent": agent.pk, "scope": "invoke", "label": "y"})
    other = Client()
    other.force_login(get_user_model().objects.create_superuser("other", "other@example.invalid", "pw"))
    assert 'id="secret-gone"' in other.get(posted["Location"]).content.decode()
    assert owner_client.get(posted["Location"]).context["secret"]  # still there for the one who issued it


def test_adding_an_agent_with_a_bad_name_or_over_the_limit_says_why(owner_client, alice, settings):
    bad = owner_client.post("/admin/agents/agent/add/", {"name": "Not A Name"})
    assert bad.status_code == 200 and "must match" in bad.content.decode()
    assert not Agent.objects.filter(name="Not A Name").exists()

    taken = owner_client.post("/admin/agents/agent/add/", {"name": "alice"})
    assert taken.status_code == 200 and "already exists" in taken.content.decode()

    settings.SIGIL_MAX_AGENTS = Agent.objects.count()
    inlines = inline_data(owner_client.get("/admin/agents/agent/add/"))
    over = owner_client.post("/admin/agents/agent/add/", {**inlines, "name": "carol"}, follow=True)
    assert over.status_code == 200
    assert any("SIGIL_MAX_AGENTS" in str(m) and m.level_tag == "error" for m in over.context["messages"])
    assert not Agent.objects.filter(name="carol").exists()
    assert not AuditEvent.objects.filter(agent_name="carol").exists()


def test_token_expiry_must_be_in_the_future(owner_client, alice):
    agent = Agent.objects.get(name="alice")
    response = owner_client.post(
        "/admin/agents/token/add/",
        {"agent": agent.pk, "scope": "invoke", "expires_at_0": "2001-01-01", "expires_at_1": "00:00:00"},
    )
    assert response.status_code == 200 and "the expiry must be in the future" in response.content.decode()
    assert not Token.objects.filter(agent=agent, expires_at__isnull=False).exists()


def test_audit_trail_is_read_only_and_filters_by_agent_capability_action_and_time(owner_client, alice):
    alice.deploy(name="a", code="export default { fetch() { return new Response('a') } }")
    event = AuditEvent.objects.get(subject="alice--a")
    listing = "/admin/agents/auditevent/"

    def subjects(query: str) -> set[str]:
        return {e.subject for e in owner_client.get(f"{listing}?{query}").context["cl"].result_list}

    assert subjects("subject=alice--a") == {"alice--a"}
    assert subjects("agent_name=alice&action=capability.created") == {"alice--a"}
    assert "alice--a" in subjects("within=1h")
    assert owner_client.get(f"{listing}add/").status_code == 403
    assert owner_client.post(f"/admin/agents/auditevent/{event.pk}/delete/").status_code == 403
    page = owner_client.get(f"/admin/agents/auditevent/{event.pk}/change/").content.decode()
    assert 'name="_save"' not in page


def test_revoking_selected_tokens_asks_first_then_stops_them(owner_client, alice):
    token = Token.objects.get(agent__name="alice", scope="invoke")
    chosen = {"action": "revoke_tokens", "_selected_action": [token.pk]}

    asked = owner_client.post("/admin/agents/token/", chosen)
    assert asked.status_code == 200 and 'id="confirm"' in asked.content.decode()
    assert alice.call("/_api/capabilities").status_code == 200  # nothing revoked yet

    owner_client.post("/admin/agents/token/", {**chosen, "confirmed": "yes"})
    assert alice.call("/_api/capabilities").status_code == 401
    assert AuditEvent.objects.filter(action="token.revoked", subject=token.prefix).exists()
    assert LogEntry.objects.filter(object_id=str(token.pk), change_message="Revoked").exists()


def test_the_a2a_form_sets_the_agent_card_url_public_addresses_only(owner_client, alice, settings):
    agent = Agent.objects.get(name="alice")
    url = f"/admin/agents/agent/{agent.pk}/change/"
    inlines = inline_data(owner_client.get(url))

    card = "https://agent.example/.well-known/agent-card.json"
    assert owner_client.post(url, {**inlines, "a2a_card_url": card}).status_code == 302
    agent.refresh_from_db()
    assert agent.a2a_card_url == card
    assert AuditEvent.objects.filter(action="agent.a2a_changed", actor__startswith="owner").count() == 1

    loopback = "http://127.0.0.1:9/.well-known/agent-card.json"
    refused = owner_client.post(url, {**inlines, "a2a_card_url": loopback})
    assert refused.status_code == 200 and "private or reserved address" in refused.content.decode()
    settings.SIGIL_CALLBACK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    assert owner_client.post(url, {**inlines, "a2a_card_url": loopback}).status_code == 302
    agent.refresh_from_db()
    assert agent.a2a_card_url == loopback


def test_the_token_list_filters_by_state(owner_client, alice):
    from datetime import timedelta

    from django.utils import timezone

    from agents import services

    agent = Agent.objects.get(name="alice")
    now = timezone.now()
    lasting = set(Token.objects.filter(agent=agent).values_list("pk", flat=True))  # no expiry

    def issued(**fields) -> Token:
        return services.token_issue(agent=agent, scope="invoke", actor="owner:test", **fields)[0]

    soon = issued(expires_at=now + timedelta(days=2))
    later = issued(expires_at=now + timedelta(days=30))
    gone = issued(expires_at=now + timedelta(days=1))
    Token.objects.filter(pk=gone.pk).update(expires_at=now - timedelta(days=1))
    revoked = issued()
    services.token_revoke(token=revoked, actor="owner:test")

    def listed(state: str) -> set[int]:
        page = owner_client.get(f"/admin/agents/token/?state={state}&agent__id__exact={agent.pk}")
        return {t.pk for t in page.context["cl"].result_list}

    assert listed("usable") == lasting | {soon.pk, later.pk}
    assert listed("expiring") == {soon.pk}
    assert listed("revoked") == {revoked.pk}
    assert listed("expired") == {gone.pk}
