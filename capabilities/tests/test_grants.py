"""Tenants stay apart: bindings are granted per agent, and secrets never rest in plain text.

Two agents over the real API: alpha is granted a secret, beta acts in bad faith. Run on the
local runtime (workerd, code store on disk) and on the loader runtime (Workers KV, through
the Cloudflare emulator).
"""

import secrets
from pathlib import Path

import pytest

from agents.models import Agent, AuditEvent
from capabilities import services
from capabilities.models import Binding, Capability
from sigil.encryption import secret_encrypt
from testsupport.cast import grant, make_agent, wait_for

READS_KEY = """export default { async fetch(request, env) {
  return Response.json({ key: env.ALPHA_KEY ?? null, names: Object.keys(env).sort() });
} }"""


@pytest.fixture(params=["local", "loader"])
def backend(request, settings):
    """The runtime under test; deploy cool-downs off so each agent may deploy at will."""
    settings.SIGIL_DEPLOY_COOLDOWN_SECONDS = 0
    if request.param == "loader":
        request.getfixturevalue("loader")
    return request.param


@pytest.fixture
def alpha_key():
    """A secret value no other test uses, so that finding it anywhere is this test's leak."""
    return f"alpha-secret-{secrets.token_hex(16)}"


def files_holding(root: Path, needle: str) -> list[str]:
    """Every file under `root` whose bytes contain `needle`, read whole."""
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and needle.encode() in path.read_bytes():
                found.append(str(path))
        except (FileNotFoundError, PermissionError):  # a temporary file gone, a socket
            continue
    return found


def kv_values_holding(cf_client, needle: str) -> tuple[list[str], int]:
    """Every Workers KV value of the account holding `needle`, read through the emulator's
    API; and how many values were read."""
    found, read = [], 0
    for namespace in cf_client.kv_namespace_list():
        for key in cf_client.kv_keys(namespace["id"]):
            read += 1
            if needle.encode() in cf_client.kv_get(namespace["id"], key["name"]):
                found.append(f"{namespace['title']}/{key['name']}")
    return found, read


def assert_not_at_rest(backend: str, needle: str, request, settings) -> None:
    assert files_holding(settings.VAR_DIR, needle) == []
    if backend == "loader":
        found, read = kv_values_holding(request.getfixturevalue("cf_client"), needle)
        assert read > 0 and found == []


def test_a_binding_granted_to_one_agent_is_out_of_another_agents_reach(
    backend, sigil, alpha_key, celery_worker, request, settings
):
    alpha, beta = make_agent("alpha", sigil.url), make_agent("beta", sigil.url)
    key = Binding.objects.create(kind="SECRET", name="ALPHA_KEY", secret_encrypted=secret_encrypt(alpha_key))
    grant(key, "alpha")

    assert alpha.deploy(name="uses", code=READS_KEY, bindings=["SECRET:ALPHA_KEY"]).status_code == 201
    assert alpha.call("/alpha/uses").json() == {"key": alpha_key, "names": ["ALPHA_KEY"]}

    # Declaring it: refused in the same words as a binding that does not exist.
    stolen = beta.deploy(name="steal", code=READS_KEY, bindings=["SECRET:ALPHA_KEY"])
    invented = beta.deploy(name="steal", code=READS_KEY, bindings=["SECRET:BETA_GUESS"])
    assert stolen.status_code == invented.status_code == 403
    assert stolen.json()["error"]["code"] == invented.json()["error"]["code"] == "forbidden"
    assert stolen.json()["error"]["message"].replace("ALPHA_KEY", "BETA_GUESS") == invented.json()["error"]["message"]
    assert not Capability.objects.filter(agent__name="beta").exists()
    # Reading it: not in beta's own env, and alpha's capability is not beta's to call or inspect.
    assert beta.deploy(name="peek", code=READS_KEY).status_code == 201
    assert beta.call("/beta/peek").json() == {"key": None, "names": []}
    assert beta.call("/alpha/uses").status_code == 404
    assert alpha_key not in beta.call("/_api/capabilities/alpha--uses", token="deploy").text

    # At rest: the code store (or KV) holds the code and the sealed secret, never the value.
    placed = Capability.objects.get(full_name="alpha--uses").placed_sha
    if backend == "local":
        assert b'"sealed"' in (settings.SIGIL_CODE_DIR / f"{placed}.json").read_bytes()
    assert_not_at_rest(backend, alpha_key, request, settings)

    # Revoked: gone from alpha's live capability, audited, and no longer declarable.
    revoked = services.binding_revoke(binding=key, agent=Agent.objects.get(name="alpha"), actor="owner:test")
    assert revoked == ["alpha--uses"]
    wait_for(lambda: alpha.call("/alpha/uses").json() == {"key": None, "names": []}, message="the grant revoked")
    event = AuditEvent.objects.get(action="binding.revoked")
    assert (event.agent_name, event.subject, event.actor) == ("alpha", "SECRET:ALPHA_KEY", "owner:test")
    assert Capability.objects.get(full_name="alpha--uses").versions.count() == 1
    again = alpha.deploy(name="uses", code=READS_KEY + "\n", bindings=["SECRET:ALPHA_KEY"])
    assert again.status_code == 403 and again.json()["error"]["code"] == "forbidden"
    assert_not_at_rest(backend, alpha_key, request, settings)

    # Granted again: it comes back to the capability that still declares it.
    assert services.binding_grant(binding=key, agent=Agent.objects.get(name="alpha"), actor="owner:test") == [
        "alpha--uses"
    ]
    wait_for(lambda: alpha.call("/alpha/uses").json()["key"] == alpha_key, message="the grant restored")
    assert_not_at_rest(backend, alpha_key, request, settings)


# --- the owner's grants in the admin ---------------------------------------------------------

GREETS = "export default { async fetch(request, env) { return new Response(env.GREETING ?? 'nothing') } }"


@pytest.fixture
def owner_client(sigil, client):
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.create_superuser("owner", "owner@example.invalid", "owner-password")
    client.force_login(user)
    return client


def change_form(client, url: str) -> tuple[dict, dict]:
    """What the change page at `url` posts back unchanged, and each inline's prefix by model name."""
    response = client.get(url)
    assert response.status_code == 200
    form = response.context["adminform"].form
    data = {name: form[name].value() for name in form.fields if form[name].value() not in (None, False)}
    prefixes = {}
    for inline in response.context["inline_admin_formsets"]:
        formset = inline.formset
        prefixes[formset.model._meta.model_name] = formset.prefix
        for name in formset.management_form.fields:
            data[f"{formset.prefix}-{name}"] = formset.management_form[name].value()
        for row in formset.forms:
            data.update({row.add_prefix(n): row[n].value() for n in row.fields if row[n].value() is not None})
    return data, prefixes


def add_row(data: dict, prefix: str, **fields) -> dict:
    index = int(data[f"{prefix}-TOTAL_FORMS"])
    return {**data, f"{prefix}-TOTAL_FORMS": index + 1, **{f"{prefix}-{index}-{k}": v for k, v in fields.items()}}


def test_the_owner_grants_and_revokes_a_binding_on_its_page(owner_client, alice, bob, celery_worker):
    greeting = Binding.objects.create(kind="VAR", name="GREETING", value="hello")
    url = f"/admin/capabilities/binding/{greeting.pk}/change/"
    assert alice.deploy(name="greets", code=GREETS, bindings=["VAR:GREETING"]).status_code == 403

    data, prefixes = change_form(owner_client, url)
    alice_id = Agent.objects.get(name="alice").pk
    assert owner_client.post(url, add_row(data, prefixes["bindinggrant"], agent=alice_id)).status_code == 302
    assert list(greeting.grants.values_list("agent__name", flat=True)) == ["alice"]
    granted = AuditEvent.objects.get(action="binding.granted")
    assert (granted.actor, granted.agent_name, granted.subject) == ("owner:owner", "alice", "VAR:GREETING")
    assert alice.deploy(name="greets", code=GREETS, bindings=["VAR:GREETING"]).status_code == 201
    assert alice.call("/alice/greets").text == "hello"
    assert "alice" in owner_client.get("/admin/capabilities/binding/").content.decode()  # the list's "granted to"

    # An existing grant is not repointed to another agent: only revoked.
    data, prefixes = change_form(owner_client, url)
    row = f"{prefixes['bindinggrant']}-0"
    owner_client.post(url, {**data, f"{row}-agent": Agent.objects.get(name="bob").pk})
    assert list(greeting.grants.values_list("agent__name", flat=True)) == ["alice"]

    revoked = owner_client.post(url, {**data, f"{row}-DELETE": "on"}, follow=True)
    assert "Placing again with the grants changed: alice--greets." in [str(m) for m in revoked.context["messages"]]
    assert not greeting.grants.exists()
    assert AuditEvent.objects.filter(action="binding.revoked", agent_name="alice", actor="owner:owner").exists()
    wait_for(lambda: alice.call("/alice/greets").text == "nothing", message="the grant revoked")
    page = owner_client.get(f"/admin/capabilities/capability/{Capability.objects.get().pk}/change/").content
    assert "not granted to alice, left out" in page.decode()


def test_the_owner_grants_and_revokes_bindings_on_the_agents_page(owner_client, alice, bob):
    greeting = Binding.objects.create(kind="VAR", name="GREETING", value="hello")
    agent = Agent.objects.get(name="bob")
    url = f"/admin/agents/agent/{agent.pk}/change/"

    data, prefixes = change_form(owner_client, url)
    assert owner_client.post(url, add_row(data, prefixes["bindinggrant"], binding=greeting.pk)).status_code == 302
    assert list(agent.binding_grants.values_list("binding__name", flat=True)) == ["GREETING"]
    assert AuditEvent.objects.filter(action="binding.granted", agent_name="bob", subject="VAR:GREETING").exists()
    assert bob.deploy(name="greets", code=GREETS, bindings=["VAR:GREETING"]).status_code == 201
    assert alice.deploy(name="greets", code=GREETS, bindings=["VAR:GREETING"]).status_code == 403

    data, prefixes = change_form(owner_client, url)
    twice = owner_client.post(url, add_row(data, prefixes["bindinggrant"], binding=greeting.pk))
    assert twice.status_code == 200  # the form again: it is granted already
    assert agent.binding_grants.count() == 1

    assert owner_client.post(url, {**data, f"{prefixes['bindinggrant']}-0-DELETE": "on"}).status_code == 302
    assert not agent.binding_grants.exists()
    assert AuditEvent.objects.filter(action="binding.revoked", agent_name="bob", subject="VAR:GREETING").exists()
    again = bob.deploy(name="greets", code=GREETS + "\n", bindings=["VAR:GREETING"])
    assert again.status_code == 403

    # A new agent can be given its grants as it is created.
    data, prefixes = change_form(owner_client, "/admin/agents/agent/add/")
    created = owner_client.post(
        "/admin/agents/agent/add/", add_row({**data, "name": "cy"}, prefixes["bindinggrant"], binding=greeting.pk)
    )
    assert created.status_code == 302
    assert list(greeting.grants.values_list("agent__name", flat=True)) == ["cy"]


@pytest.mark.django_db(transaction=True)
def test_the_migration_grants_each_agent_exactly_what_its_current_capabilities_declare():
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    from capabilities.models import BindingGrant

    before = [("capabilities", "0008_binding_grant"), ("agents", "0002_lifecycle")]
    executor = MigrationExecutor(connection)
    leaves = executor.loader.graph.leaf_nodes()
    try:
        executor.migrate(before)
        old = executor.loader.project_state(before).apps
        agents = {n: old.get_model("agents", "Agent").objects.create(name=n) for n in ("amy", "ben", "cy")}
        old_binding = old.get_model("capabilities", "Binding").objects
        old_binding.create(kind="VAR", name="GREETING", value="hello")
        old_binding.create(kind="SECRET", name="KEY", secret_env="SOME_KEY")
        old_binding.create(kind="VAR", name="UNUSED", value="x")
        capability = old.get_model("capabilities", "Capability").objects
        for agent, name, state, declared in [
            ("amy", "a", "live", ["VAR:GREETING", "SECRET:KEY", "VAR:NOT_CONFIGURED"]),
            ("amy", "b", "paged_out", ["VAR:GREETING"]),
            ("ben", "gone", "removed", ["VAR:GREETING"]),
            ("cy", "c", "live", ["SECRET:KEY"]),
        ]:
            capability.create(
                agent=agents[agent], name=name, full_name=f"{agent}--{name}", type="persistent", state=state,
                bindings=declared,
            )  # fmt: skip
        executor = MigrationExecutor(connection)
        executor.migrate(leaves)
        grants = sorted((str(g.binding), g.agent.name) for g in BindingGrant.objects.all())
        assert grants == [("SECRET:KEY", "amy"), ("SECRET:KEY", "cy"), ("VAR:GREETING", "amy")]
    finally:
        MigrationExecutor(connection).migrate(leaves)


def test_the_owner_grants_a_binding_in_the_browser(sigil, owner, alice):
    page = owner
    greeting = Binding.objects.create(kind="VAR", name="GREETING", value="hello")
    page.goto(f"{sigil.url}/admin/capabilities/binding/{greeting.pk}/change/")
    page.get_by_text("Add another grant").click()
    page.select_option("select[name=grants-0-agent]", label="alice")
    page.click("input[name=_save]")
    page.get_by_text("was changed successfully").wait_for()
    assert list(greeting.grants.values_list("agent__name", flat=True)) == ["alice"]
    assert alice.deploy(name="greets", code=GREETS, bindings=["VAR:GREETING"]).status_code == 201
    assert alice.call("/alice/greets").text == "hello"
