"""The authentication and authorization matrix, over HTTP against a running Sigil."""

import pytest

from agents import services as agent_services
from agents.models import Token
from capabilities.models import Capability
from testsupport.capability_code import PONG


def assert_error(response, status, code):
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["message"]


@pytest.fixture
def ping(alice):
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    return "/alice/ping"


def test_call_without_token_is_unauthenticated(alice, ping):
    assert_error(alice.call(ping, token=None), 401, "unauthenticated")


def test_call_with_unknown_token_is_unauthenticated(alice, ping):
    assert_error(alice.call(ping, token="sgl_not-a-real-token"), 401, "unauthenticated")


def test_call_with_malformed_authorization_is_unauthenticated(alice, ping):
    response = alice.call(ping, token=None, headers={"Authorization": "Basic YWxpY2U6cHc="})
    assert_error(response, 401, "unauthenticated")


def test_revoked_token_is_refused_on_the_next_call(alice, ping):
    assert alice.call(ping).status_code == 200  # warms the cache
    token = Token.objects.get(agent__name="alice", scope="invoke")
    agent_services.token_revoke(token=token, actor="owner:test")
    assert_error(alice.call(ping), 401, "unauthenticated")
    assert_error(
        alice.session.get(f"{alice.base_url}/_api/capabilities", headers=alice.headers(alice.invoke_token)),
        401,
        "unauthenticated",
    )


def test_expired_token_is_refused(alice, ping):
    from datetime import timedelta

    from django.utils import timezone

    agent = alice_agent()
    _, secret = agent_services.token_issue(
        agent=agent, scope="invoke", actor="owner:test", expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert_error(alice.call(ping, token=secret), 401, "unauthenticated")


def test_disabled_agent_tokens_stop_at_once(alice, ping):
    assert alice.call(ping).status_code == 200
    agent_services.agent_set_active(agent=alice_agent(), is_active=False, actor="owner:test")
    assert_error(alice.call(ping), 401, "unauthenticated")
    agent_services.agent_set_active(agent=alice_agent(), is_active=True, actor="owner:test")
    assert alice.call(ping).status_code == 200


def test_invoke_token_cannot_deploy_or_remove(alice, ping):
    assert_error(alice.deploy(name="other", code=PONG, token="invoke"), 403, "forbidden")
    removal = alice.session.delete(
        f"{alice.base_url}/_api/capabilities/alice--ping", headers=alice.headers(alice.invoke_token)
    )
    assert_error(removal, 403, "forbidden")
    assert not Capability.objects.filter(full_name="alice--other").exists()
    assert Capability.objects.get(full_name="alice--ping").state == "live"


def test_deploy_token_may_also_invoke(alice, ping):
    assert alice.call(ping, token="deploy").text == "pong"


def test_deploy_to_another_agents_prefix_is_forbidden(alice, bob):
    assert_error(bob.deploy(agent="alice", name="sneaky", code=PONG), 403, "forbidden")
    assert not Capability.objects.filter(full_name__startswith="alice--").exists()


def test_removing_another_agents_capability_is_forbidden(alice, bob, ping):
    response = bob.session.delete(
        f"{bob.base_url}/_api/capabilities/alice--ping", headers=bob.headers(bob.deploy_token)
    )
    assert_error(response, 403, "forbidden")
    assert alice.call(ping).text == "pong"


def test_other_agents_private_capability_is_not_found(alice, bob, ping):
    assert_error(bob.call(ping), 404, "not_found")
    inspect = bob.session.get(f"{bob.base_url}/_api/capabilities/alice--ping", headers=bob.headers(bob.invoke_token))
    assert_error(inspect, 404, "not_found")
    listed = bob.session.get(f"{bob.base_url}/_api/capabilities", headers=bob.headers(bob.invoke_token)).json()
    assert listed["count"] == 0


def test_public_capability_is_callable_by_others_without_its_code(alice, bob):
    alice.deploy(name="shared", code=PONG, public=True)
    assert bob.call("/alice/shared").text == "pong"
    seen = bob.session.get(
        f"{bob.base_url}/_api/capabilities/alice--shared", headers=bob.headers(bob.invoke_token)
    ).json()
    assert seen["public"] is True and seen["code"] is None
    own = alice.session.get(
        f"{alice.base_url}/_api/capabilities/alice--shared", headers=alice.headers(alice.invoke_token)
    ).json()
    assert own["code"] == PONG


def test_ephemeral_is_private_unless_deployed_public(alice, bob):
    private = alice.deploy(code=PONG).json()["capability"]
    public = alice.deploy(code=PONG.replace("pong", "pub"), public=True).json()["capability"]
    assert private.startswith("alice--t-") and public.startswith("alice--t-")
    assert_error(bob.call("/" + private.replace("--", "/")), 404, "not_found")
    assert bob.call("/" + public.replace("--", "/")).text == "pub"


def alice_agent():
    from agents.models import Agent

    return Agent.objects.get(name="alice")
