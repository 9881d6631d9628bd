"""An agent's versions and rollback: GET /_api/capabilities/{full}/versions, POST …/rollback,
and the MCP tools sigil.versions and sigil.rollback, against Sigil served on loopback."""

from __future__ import annotations

import pytest

from agents.models import AuditEvent
from capabilities.models import Capability
from capabilities.tests.test_contracts import ADD_CONTRACT, ADD_INPUT
from capabilities.tests.test_mcp import ADD, run
from testsupport.capability_code import answering
from testsupport.cast import wait_for

# A second version whose code and contract both differ from ADD's (null clears a field that
# a redeploy would otherwise keep).
GREET = answering("hello")
GREET_CONTRACT = {
    "description": "Says hello.",
    "input_schema": {"type": "object", "properties": {}},
    "output_schema": None,
    "examples": None,
}


def versions(client, full: str, *, token: str | None = None):
    return client.session.get(
        f"{client.base_url}/_api/capabilities/{full}/versions",
        headers=client.headers(token or client.invoke_token),
        timeout=30,
    )


def rollback(client, full: str, body, *, token: str | None = None):
    return client.session.post(
        f"{client.base_url}/_api/capabilities/{full}/rollback",
        json=body,
        headers=client.headers(token or client.deploy_token),
        timeout=30,
    )


def inspect(client, full: str) -> dict:
    answer = client.session.get(
        f"{client.base_url}/_api/capabilities/{full}", headers=client.headers(client.invoke_token), timeout=30
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_an_agent_lists_its_versions_and_rolls_back_code_and_contract_together(alice):
    assert alice.deploy(name="add", code=ADD, **ADD_CONTRACT).status_code == 201
    assert alice.deploy(name="add", code=GREET, **GREET_CONTRACT).status_code == 200

    listed = versions(alice, "alice--add")
    assert listed.status_code == 200, listed.text
    page = listed.json()
    assert page["count"] == 2
    v2, v1 = page["results"]
    assert (v2["version"], v2["status"], v2["deployed_by"], v2["restores"]) == (2, "served", "agent:alice", None)
    assert (v1["version"], v1["status"], v1["deployed_by"]) == (1, "retired", "agent:alice")
    assert v1["description"] == ADD_CONTRACT["description"]
    assert v1["declares"] == ["description", "input_schema", "output_schema", "examples"]
    assert v2["declares"] == ["description", "input_schema"]
    assert v1["sha256"] != v2["sha256"] and len(v1["sha256"]) == 64 and "code" not in v1

    rolled = rollback(alice, "alice--add", {"version": 1})

    assert rolled.status_code == 200, rolled.text
    assert rolled.json()["capability"] == "alice--add" and rolled.json()["version"] == 3
    # The code and the contract it was written for come back together.
    shown = inspect(alice, "alice--add")
    assert shown["version"] == 3 and shown["input_schema"] == ADD_INPUT
    assert shown["description"] == ADD_CONTRACT["description"] and shown["code"] == ADD
    called = alice.call("/alice/add", method="POST", json={"a": 40, "b": 2})
    assert called.json() == {"sum": 42}
    v3, v2, v1 = versions(alice, "alice--add").json()["results"]
    assert (v3["status"], v3["restores"], v3["sha256"]) == ("served", 1, v1["sha256"])
    assert v2["status"] == "retired"
    event = AuditEvent.objects.get(action="capability.rolled_back", subject="alice--add")
    assert event.actor == "agent:alice" and event.detail == {"version": 3, "restored_version": 1, "sha": v1["sha256"]}


def test_a_rollback_counts_as_a_deploy_for_the_cool_down_and_a_rollback_to_what_is_served_does_not(alice, settings):
    alice.deploy(name="greet", code=answering("one"))
    alice.deploy(name="greet", code=answering("two"))
    settings.SIGIL_DEPLOY_COOLDOWN_SECONDS = 60

    unchanged = rollback(alice, "alice--greet", {"version": 2})
    restored = rollback(alice, "alice--greet", {"version": 1})
    refused = rollback(alice, "alice--greet", {"version": 2})
    redeploy = alice.deploy(name="greet", code=answering("three"))

    assert unchanged.status_code == 200 and unchanged.json()["version"] == 2  # nothing changed, nothing claimed
    assert restored.status_code == 200 and restored.json()["version"] == 3
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "cooldown" and 1 <= int(refused.headers["Retry-After"]) <= 60
    assert redeploy.status_code == 429  # the rollback started the agent's cool-down
    assert alice.call("/alice/greet").text == "one"


def test_only_the_capabilitys_own_agent_lists_its_versions_and_rolls_it_back(alice, bob):
    alice.deploy(name="open", code=answering("one"), public=True)
    alice.deploy(name="open", code=answering("two"))
    alice.deploy(name="closed", code=answering("one"))

    assert versions(bob, "alice--open").status_code == 403  # public: bob may know it exists
    assert rollback(bob, "alice--open", {"version": 1}).status_code == 403
    assert versions(bob, "alice--closed").status_code == 404  # private: bob may not
    assert rollback(bob, "alice--closed", {"version": 1}).status_code == 404
    by_invoke = rollback(alice, "alice--open", {"version": 1}, token=alice.invoke_token)
    assert by_invoke.status_code == 403 and "deploy scope" in by_invoke.json()["error"]["message"]
    missing = rollback(alice, "alice--open", {"version": 9})
    assert (
        missing.status_code == 404 and "/_api/capabilities/alice--open/versions" in missing.json()["error"]["message"]
    )
    for body, field in (({}, "version"), ({"version": "1"}, "version"), ({"version": 1, "code": "x"}, "code")):
        bad = rollback(alice, "alice--open", body)
        assert bad.status_code == 400 and field in bad.json()["error"]["message"], (body, bad.text)
    staged = alice.deploy(name="open", code=answering("three"), stage=True)
    assert staged.status_code == 200 and staged.json()["version"] == 3
    assert [v["status"] for v in versions(alice, "alice--open").json()["results"]] == ["staged", "served", "retired"]
    to_staged = rollback(alice, "alice--open", {"version": 3})
    assert to_staged.status_code == 409 and "split/promote" in to_staged.json()["error"]["message"]
    assert alice.call("/alice/open").text == "two"  # none of these changed anything


@pytest.mark.slow
def test_on_the_pool_a_refused_version_is_listed_as_such_and_a_slow_rollback_answers_the_one_202(
    worker_pool, alice, settings
):
    alice.deploy(name="greet", code=answering("one"))
    alice.deploy(name="greet", code=answering("two"))
    settings.SIGIL_DEPLOY_WAIT_SECONDS = 0  # every answer comes before its placement
    pending = alice.deploy(name="greet", code="export default {")
    assert pending.status_code == 202, pending.text
    assert pending.json()["status"] == "deploying" and pending.json()["callback"] == "/_status/alice--greet"
    wait_for(
        lambda: versions(alice, "alice--greet").json()["results"][0]["status"] == "refused",
        timeout=30,
        message="v3 refused",
    )
    v3 = versions(alice, "alice--greet").json()["results"][0]
    assert v3["failure"]["code"] == "invalid_request" and v3["deployed_by"] == "agent:alice"

    refused = rollback(alice, "alice--greet", {"version": 3})
    assert refused.status_code == 400 and "was refused when it was deployed" in refused.json()["error"]["message"]

    accepted = rollback(alice, "alice--greet", {"version": 1})

    assert accepted.status_code == 202, accepted.text
    body = accepted.json()
    assert {key: body[key] for key in ("status", "callback", "eta_seconds", "capability", "version")} == {
        "status": "deploying",
        "callback": "/_status/alice--greet",
        "eta_seconds": 5,
        "capability": "alice--greet",
        "version": 4,
    }
    wait_for(lambda: alice.call("/alice/greet").text == "one", timeout=30, message="v4 placed and served")
    latest = versions(alice, "alice--greet").json()["results"][0]
    assert (latest["version"], latest["status"], latest["restores"], latest["deployed_by"]) == (
        4,
        "served",
        1,
        "agent:alice",
    )


def test_an_agent_lists_versions_and_rolls_back_over_mcp(sigil, alice):
    alice.deploy(name="add", code=ADD, **ADD_CONTRACT)
    alice.deploy(name="add", code=GREET, **GREET_CONTRACT)

    async def steps(client):
        listed = await client.call_tool("sigil.versions", {"capability": "alice--add"})
        rolled = await client.call_tool("sigil.rollback", {"capability": "alice--add", "version": 1})
        again = await client.call_tool("sigil.versions", {"capability": "alice--add", "limit": 1})
        missing = await client.call_tool("sigil.rollback", {"capability": "alice--add", "version": 9})
        others = await client.call_tool("sigil.versions", {"capability": "bob--nothing"})
        tool = {tool.name: tool for tool in (await client.list_tools()).tools}["alice--add"]
        return listed, rolled, again, missing, others, tool

    listed, rolled, again, missing, others, tool = run(sigil, alice.deploy_token, "2026-07-28", steps)

    assert not listed.is_error, listed.content[0].text
    assert [v["status"] for v in listed.structured_content["versions"]] == ["served", "retired"]
    assert not rolled.is_error and rolled.structured_content["version"] == 3
    assert again.structured_content["count"] == 3
    assert [(v["version"], v["restores"]) for v in again.structured_content["versions"]] == [(3, 1)]
    assert missing.is_error and missing.content[0].text.startswith("not_found: alice--add has no version 9")
    assert others.is_error and others.content[0].text.startswith("not_found:")
    assert tool.input_schema == ADD_INPUT  # the tool takes what the restored code handles
    event = AuditEvent.objects.get(action="capability.rolled_back", subject="alice--add")
    assert event.actor == "agent:alice"


def test_an_invoke_token_gets_no_rollback_tool(sigil, alice):
    alice.deploy(name="add", code=ADD)

    async def steps(client):
        return {tool.name for tool in (await client.list_tools()).tools}

    assert "sigil.rollback" not in run(sigil, alice.invoke_token, "2026-07-28", steps)


def test_a_rollback_records_the_runtime_that_placed_it(alice):
    alice.deploy(name="greet", code=answering("one"))
    alice.deploy(name="greet", code=answering("two"))
    # As if the capability had last been placed by the runtime used before SIGIL_BACKEND changed.
    Capability.objects.filter(full_name="alice--greet").update(backend="worker-pool")

    assert rollback(alice, "alice--greet", {"version": 1}).status_code == 200

    assert Capability.objects.get(full_name="alice--greet").backend == "local"


def test_a_rollback_in_the_request_during_a_switch_is_served_from_the_new_runtime(worker_pool, alice, sigil, settings):
    """A capability still on the worker pool while SIGIL_BACKEND is now local (no switch has
    moved it yet): the agent's rollback, placed in the request by the local runtime, records
    it there, slot and runtime together, so its next call reaches the code it restored."""
    from capabilities.tests.test_switch import switch_to

    alice.deploy(name="greet", code=answering("one"))
    alice.deploy(name="greet", code=answering("two"))
    assert Capability.objects.get(full_name="alice--greet").backend == "worker-pool"
    switch_to(settings, sigil, "local")

    assert rollback(alice, "alice--greet", {"version": 1}).status_code == 200

    capability = Capability.objects.get(full_name="alice--greet")
    assert (capability.backend, capability.slot, capability.state) == ("local", "alice--greet", "live")
    assert alice.call("/alice/greet").text == "one"
