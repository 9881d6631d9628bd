"""Tenants stay apart: bindings are granted per agent, and secrets never rest in plain text.

Two agents over the real API: alpha is granted a secret, beta acts in bad faith. Run on the
local runtime (workerd, code store on disk) and on the loader runtime (Workers KV, through
the Cloudflare emulator).
"""

import secrets
from pathlib import Path

import pytest

from agents.models import Agent, AuditEvent
from capabilities import bindings, services
from capabilities.models import Binding, Capability
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
    key = Binding.objects.create(kind="SECRET", name="ALPHA_KEY", secret_encrypted=bindings.secret_encrypt(alpha_key))
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
