"""The capability admin through Django's test client: filters, actions, versions, CSRF."""

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from agents.models import AuditEvent
from capabilities import services
from capabilities.models import Binding, Capability
from sigil.encryption import secret_encrypt
from testsupport.capability_code import answering as code
from testsupport.cast import grant, wait_for


@pytest.fixture
def owner_client(sigil, client):
    user = get_user_model().objects.create_superuser("owner", "owner@example.invalid", "owner-password")
    client.force_login(user)
    return client


def act(client, action: str, *capabilities: Capability):
    """Run a list action on `capabilities`, confirming it when it asks first."""
    return client.post(
        "/admin/capabilities/capability/",
        {"action": action, "_selected_action": [c.pk for c in capabilities], "confirmed": "yes"},
        follow=True,
    )


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def test_changelist_filters_show_the_matching_capabilities(owner_client, alice):
    alice.deploy(name="kept", code=code("kept"))
    alice.deploy(name="flaky", code=code("flaky"), type="normal")
    flaky = Capability.objects.get(full_name="alice--flaky")
    act(owner_client, "force_degraded", flaky)
    act(owner_client, "evict", flaky)

    def names(query: str) -> set[str]:
        response = owner_client.get(f"/admin/capabilities/capability/?{query}")
        assert response.status_code == 200
        return {c.full_name for c in response.context["cl"].result_list}

    assert names("health=degraded") == {"alice--flaky"}
    assert names("health=ok") == {"alice--kept"}
    assert names("placement=placed") == {"alice--kept"}
    assert names("placement=paged_out") == {"alice--flaky"}
    assert names("type__exact=normal") == {"alice--flaky"}
    assert names("activity=inactive") == set()
    assert names("expiry=expired") == set()
    assert names("q=kept") == {"alice--kept"}
    assert names(f"agent__id__exact={flaky.agent_id}") == {"alice--kept", "alice--flaky"}


def test_actions_report_a_count_and_each_failure_by_name(owner_client, alice):
    alice.deploy(name="a", code=code("a"))
    alice.deploy(name="b", code=code("b"))
    a, b = Capability.objects.order_by("full_name")

    assert messages_of(act(owner_client, "make_public", a, b)) == ["Made 2 capabilities public."]
    assert messages_of(act(owner_client, "make_public", a)) == ["Made 0 capabilities public."]
    assert messages_of(act(owner_client, "evict", a)) == ["Evicted 1 capability."]
    assert Capability.objects.get(pk=a.pk).state == "paged_out"
    assert messages_of(act(owner_client, "page_in", a, b)) == ["Paged in 1 capability."]
    assert alice.call("/alice/a").text == "a"
    assert messages_of(act(owner_client, "remove_capabilities", b)) == ["Removed 1 capability."]
    assert alice.call("/alice/b").status_code == 404

    a.bindings = ["KV:NOT_OFFERED"]  # placing it again now fails, and the action says which one
    a.save(update_fields=["bindings"])
    act(owner_client, "evict", a)
    response = act(owner_client, "page_in", a)
    errors = [str(m) for m in response.context["messages"] if m.level_tag == "error"]
    assert len(errors) == 1 and errors[0].startswith("alice--a: ")


def test_version_page_shows_code_and_diff_escaped(owner_client, alice):
    alice.deploy(name="x", code=code("one"))
    alice.deploy(name="x", code=code("</pre><script>alert(1)</script>"))
    capability = Capability.objects.get(full_name="alice--x")

    response = owner_client.get(f"/admin/capabilities/capability/{capability.pk}/versions/2/")
    body = response.content.decode()
    assert response.status_code == 200
    assert "<script>alert(1)</script>" not in body
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert '<span class="del">-export default' in body and '<span class="add">+export default' in body
    assert owner_client.get(f"/admin/capabilities/capability/{capability.pk}/versions/7/").status_code == 404


def test_rollback_asks_first_and_needs_the_csrf_token_and_a_post(sigil, alice):
    alice.deploy(name="x", code=code("one"))
    alice.deploy(name="x", code=code("two"))
    capability = Capability.objects.get(full_name="alice--x")
    user = get_user_model().objects.create_superuser("owner", "owner@example.invalid", "owner-password")
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    url = f"/admin/capabilities/capability/{capability.pk}/rollback/"

    assert client.post(url, {"version": 1}).status_code == 403
    asked = client.get(url, {"version": 1})  # the confirmation page, which changes nothing
    assert asked.status_code == 200 and "The code of v1 is deployed again" in asked.content.decode()
    assert alice.call("/alice/x").text == "two"
    assert capability.versions.count() == 2


def test_change_page_shows_bindings_versions_and_traffic(owner_client, alice):
    alice.deploy(name="x", code=code("one"))
    capability = Capability.objects.get(full_name="alice--x")
    response = owner_client.get(f"/admin/capabilities/capability/{capability.pk}/change/")
    body = response.content.decode()
    assert response.status_code == 200
    assert 'id="versions"' in body and "none declared" in body and "0 calls, 0 errors, 0 refused" in body
    assert "<h1>Capability alice--x</h1>" in body and "Change capability" not in body
    assert 'id="call-url"' in body and 'id="recent-failures"' in body and 'id="contract"' in body
    assert 'id="action-force-degraded"' in body and 'id="action-reset-breaker"' not in body  # closed
    assert 'name="_save"' not in body  # read-only: changed through actions and buttons


def test_destructive_page_actions_ask_first_and_write_the_admins_history(owner_client, alice):
    from django.contrib.admin.models import LogEntry

    alice.deploy(name="x", code=code("one"))
    capability = Capability.objects.get(full_name="alice--x")
    url = f"/admin/capabilities/capability/{capability.pk}/actions/remove/"
    asked = owner_client.get(url)
    assert asked.status_code == 200 and "stops serving at once" in asked.content.decode()
    assert alice.call("/alice/x").text == "one"

    assert owner_client.post(url).status_code == 302
    assert alice.call("/alice/x").status_code == 404
    assert LogEntry.objects.get(object_id=str(capability.pk)).get_change_message() == "Remove"
    assert owner_client.get(f"/admin/capabilities/capability/{capability.pk}/actions/nothing/").status_code == 404


SHOWS_BINDINGS = """export default { async fetch(request, env) {
  return Response.json({ greeting: env.GREETING ?? null, token: env.TOKEN ?? null })
} }"""


def binding_form(binding: Binding, **changes) -> dict:
    form = {"kind": binding.kind, "name": binding.name, "value": binding.value, "secret_env": "", "description": ""}
    grants = {"grants-TOTAL_FORMS": 0, "grants-INITIAL_FORMS": 0}  # the grants inline, left as it is
    return {**form, **grants, "secret_value": "", **changes}


def test_a_changed_binding_reaches_the_live_capabilities_that_declare_it(owner_client, alice, celery_worker):
    greeting = Binding.objects.create(kind="VAR", name="GREETING", value="hello")
    token = Binding.objects.create(kind="SECRET", name="TOKEN", secret_encrypted=secret_encrypt("old"))
    grant(greeting, "alice")
    grant(token, "alice")
    alice.deploy(name="greets", code=SHOWS_BINDINGS, bindings=["VAR:GREETING", "SECRET:TOKEN"])
    alice.deploy(name="plain", code=SHOWS_BINDINGS)
    assert alice.call("/alice/greets").json() == {"greeting": "hello", "token": "old"}

    changed = owner_client.post(
        f"/admin/capabilities/binding/{greeting.pk}/change/", binding_form(greeting, value="bonjour"), follow=True
    )
    assert "Placing again with the new value: alice--greets." in messages_of(changed)
    wait_for(lambda: alice.call("/alice/greets").json()["greeting"] == "bonjour", message="the new greeting")
    owner_client.post(f"/admin/capabilities/binding/{token.pk}/change/", binding_form(token, secret_value="rotated"))
    wait_for(lambda: alice.call("/alice/greets").json()["token"] == "rotated", message="the rotated secret")

    assert alice.call("/alice/plain").json() == {"greeting": None, "token": None}
    capability = Capability.objects.get(full_name="alice--greets")
    assert capability.versions.count() == 1  # the same version, placed again
    refreshed = AuditEvent.objects.filter(action="capability.bindings_refreshed", subject="alice--greets")
    assert refreshed.count() == 2
    assert AuditEvent.objects.get(action="binding.changed", subject="VAR:GREETING").detail == {
        "refreshing": ["alice--greets"]
    }


def test_a_binding_that_capabilities_declare_cannot_be_renamed_or_deleted(owner_client, alice):
    greeting = Binding.objects.create(kind="VAR", name="GREETING", value="hello")
    grant(greeting, "alice")
    alice.deploy(name="greets", code=SHOWS_BINDINGS, bindings=["VAR:GREETING"])
    page = f"/admin/capabilities/binding/{greeting.pk}"

    assert "alice--greets" in owner_client.get(f"{page}/change/").content.decode()
    renamed = owner_client.post(f"{page}/change/", binding_form(greeting, name="SALUTATION"))
    assert renamed.status_code == 200  # the form again, with the reason
    assert "declared by alice--greets" in renamed.content.decode()
    confirm = owner_client.get(f"{page}/delete/").content.decode()
    assert "VAR:GREETING, declared by alice--greets" in confirm and 'name="post"' not in confirm
    owner_client.post(f"{page}/delete/", {"post": "yes"})
    owner_client.post(
        "/admin/capabilities/binding/", {"action": "delete_selected", "_selected_action": [greeting.pk], "post": "yes"}
    )
    assert Binding.objects.filter(kind="VAR", name="GREETING").exists()

    services.capability_remove_as_owner(full="alice--greets", actor="owner:test")
    assert 'name="post"' in owner_client.get(f"{page}/delete/").content.decode()
    assert owner_client.post(f"{page}/delete/", {"post": "yes"}).status_code == 302
    assert not Binding.objects.exists()
    assert AuditEvent.objects.filter(action="binding.deleted", subject="VAR:GREETING", actor="owner:owner").exists()


def test_destructive_list_actions_ask_first(owner_client, alice):
    alice.deploy(name="x", code=code("one"))
    capability = Capability.objects.get(full_name="alice--x")
    asked = owner_client.post(
        "/admin/capabilities/capability/", {"action": "remove_capabilities", "_selected_action": [capability.pk]}
    )
    body = asked.content.decode()
    assert asked.status_code == 200 and "stops serving at once" in body and "alice--x" in body
    assert f'name="_selected_action" value="{capability.pk}"' in body
    assert alice.call("/alice/x").text == "one"


def test_changing_publicity_asks_first_on_the_list_and_on_the_page(owner_client, alice, bob):
    alice.deploy(name="shy", code=code("shy"))
    shy = Capability.objects.get(full_name="alice--shy")
    chosen = {"action": "make_public", "_selected_action": [shy.pk]}

    asked = owner_client.post("/admin/capabilities/capability/", chosen)
    assert asked.status_code == 200 and 'id="confirm"' in asked.content.decode()
    assert bob.call("/alice/shy").status_code == 404  # asked first: still private
    owner_client.post("/admin/capabilities/capability/", {**chosen, "confirmed": "yes"})
    assert bob.call("/alice/shy").text == "shy"

    page = owner_client.get(f"/admin/capabilities/capability/{shy.pk}/change/").content.decode()
    assert f'href="/admin/capabilities/capability/{shy.pk}/actions/make-private/"' in page  # a link, not a form
    asked = owner_client.get(f"/admin/capabilities/capability/{shy.pk}/actions/make-private/")
    assert 'id="confirm"' in asked.content.decode() and bob.call("/alice/shy").text == "shy"
    owner_client.post(f"/admin/capabilities/capability/{shy.pk}/actions/make-private/")
    assert bob.call("/alice/shy").status_code == 404
