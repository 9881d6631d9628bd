"""Declared bindings, least privilege: a capability gets exactly what it declared."""

import pytest

from capabilities.models import Binding, Capability
from sigil.encryption import secret_encrypt
from testsupport.cast import grant

READS_ENV = """export default { async fetch(request, env) {
  return Response.json({ greeting: env.GREETING ?? null, key: env.API_KEY ?? null, names: Object.keys(env).sort() });
} }"""


@pytest.fixture
def configured(db, monkeypatch, alice):
    """The owner's bindings, each granted to alice."""
    monkeypatch.setenv("SIGIL_TEST_API_KEY", "from-the-environment")
    for binding in [
        Binding.objects.create(kind="VAR", name="GREETING", value="hello"),
        Binding.objects.create(kind="SECRET", name="API_KEY", secret_env="SIGIL_TEST_API_KEY"),
        Binding.objects.create(kind="SECRET", name="TOKEN", secret_encrypted=secret_encrypt("stored-encrypted")),
        Binding.objects.create(kind="KV", name="CACHE", value="0123456789abcdef0123456789abcdef"),
    ]:
        grant(binding, "alice")


def test_a_capability_sees_exactly_the_bindings_it_declared(configured, alice):
    assert alice.deploy(name="greets", code=READS_ENV, bindings=["VAR:GREETING", "SECRET:API_KEY"]).status_code == 201
    assert alice.deploy(name="plain", code=READS_ENV).status_code == 201
    assert alice.call("/alice/greets").json() == {
        "greeting": "hello",
        "key": "from-the-environment",
        "names": ["API_KEY", "GREETING"],
    }
    assert alice.call("/alice/plain").json() == {"greeting": None, "key": None, "names": []}


def test_an_encrypted_secret_reaches_the_capability_and_not_the_api(configured, alice):
    code = "export default { async fetch(request, env) { return new Response(env.TOKEN) } }"
    alice.deploy(name="secretive", code=code, bindings=["SECRET:TOKEN"])
    assert alice.call("/alice/secretive").text == "stored-encrypted"
    seen = alice.call("/_api/capabilities/alice--secretive").json()
    assert seen["bindings"] == ["SECRET:TOKEN"]
    assert "stored-encrypted" not in alice.call("/_api/capabilities/alice--secretive").text
    assert "stored-encrypted" not in Binding.objects.get(name="TOKEN").secret_encrypted


def test_an_unconfigured_binding_is_refused_as_one_not_granted_and_creates_nothing(configured, alice):
    response = alice.deploy(name="wants", code=READS_ENV, bindings=["VAR:MISSING"])
    assert response.status_code == 403 and response.json()["error"]["code"] == "forbidden"
    assert response.json()["error"]["message"] == (
        "binding VAR:MISSING is not granted to this agent; the owner grants bindings"
    )
    assert not Capability.objects.exists()


def test_a_kind_the_local_runtime_cannot_provide_is_a_clear_400(configured, alice):
    response = alice.deploy(name="wants", code=READS_ENV, bindings=["KV:CACHE"])
    assert response.status_code == 400
    assert "cannot provide KV" in response.json()["error"]["message"]
    assert not Capability.objects.exists()


def test_changing_bindings_places_a_new_bundle_with_the_same_code(configured, alice):
    alice.deploy(name="greets", code=READS_ENV)
    assert alice.call("/alice/greets").json()["greeting"] is None
    again = alice.deploy(name="greets", code=READS_ENV, bindings=["VAR:GREETING"])
    assert again.status_code == 200 and again.json()["version"] == 2
    assert alice.call("/alice/greets").json()["greeting"] == "hello"


def test_two_bindings_cannot_share_a_name(configured, alice):
    response = alice.deploy(name="dup", code=READS_ENV, bindings=["VAR:GREETING", "VAR:GREETING"])
    assert response.status_code == 400 and "share a name" in response.json()["error"]["message"]


READS_KV = """export default { async fetch(request, env) {
  return Response.json({ names: Object.keys(env).sort(), value: await env.CACHE.get("greeting") });
} }"""


@pytest.mark.parametrize("runtime_fixture", ["worker_pool", "platform"])
def test_a_kv_binding_reaches_a_capability_on_the_cloudflare_runtimes(runtime_fixture, request, cf_client, alice):
    request.getfixturevalue(runtime_fixture)
    namespace = cf_client.kv_namespace_create("capability-cache")["id"]
    cf_client.kv_put(namespace, "greeting", b"from kv")
    grant(Binding.objects.create(kind="KV", name="CACHE", value=namespace), "alice")
    assert alice.deploy(name="cached", code=READS_KV, bindings=["KV:CACHE"]).status_code == 201
    assert alice.call("/alice/cached").json() == {"names": ["CACHE"], "value": "from kv"}


def test_the_loader_runtime_gives_values_only_and_says_so(configured, loader, alice):
    response = alice.deploy(name="wants", code=READS_ENV, bindings=["KV:CACHE"])
    assert response.status_code == 400
    assert "cannot provide KV" in response.json()["error"]["message"]
    assert not Capability.objects.exists()


@pytest.mark.parametrize("runtime_fixture", ["worker_pool", "platform", "loader"])
def test_a_changed_binding_reaches_a_live_capability_on_the_cloudflare_runtimes(
    runtime_fixture, request, configured, alice, celery_worker
):
    from capabilities import services
    from testsupport.cast import wait_for

    request.getfixturevalue(runtime_fixture)
    alice.deploy(name="greets", code=READS_ENV, bindings=["VAR:GREETING"])
    assert alice.call("/alice/greets").json()["greeting"] == "hello"
    greeting = Binding.objects.get(name="GREETING")
    greeting.value = "bonjour"
    assert services.binding_save(binding=greeting, actor="owner:test") == ["alice--greets"]
    wait_for(lambda: alice.call("/alice/greets").json()["greeting"] == "bonjour", message="the new value")
    assert Capability.objects.get(full_name="alice--greets").versions.count() == 1
