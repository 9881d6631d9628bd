"""The owner's shell commands: each one's --json answer, and its effect seen through the API
(an agent's calls) or the database."""

import io
import json

import pytest
from django.core.management import CommandError, call_command

from agents.models import AuditEvent, Token
from capabilities.models import Capability
from testsupport.capability_code import PONG, answering
from testsupport.cast import AgentClient, wait_for


def run(*args) -> dict | list:
    output = io.StringIO()
    call_command(*args, "--json", stdout=output)
    return json.loads(output.getvalue())


def run_text(*args) -> str:
    output = io.StringIO()
    call_command(*args, stdout=output)
    return output.getvalue()


def test_listagents_shows_each_agent_its_tokens_and_capabilities(alice, bob):
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    agents = {entry["agent"]: entry for entry in run("listagents")}
    assert set(agents) == {"alice", "bob"}
    assert agents["alice"]["active"] is True
    assert agents["alice"]["capabilities"] == 1 and agents["bob"]["capabilities"] == 0
    assert sorted(t["scope"] for t in agents["alice"]["tokens"]) == ["deploy", "invoke"]
    assert alice.deploy_token[:12] in {t["prefix"] for t in agents["alice"]["tokens"]}
    text = run_text("listagents")
    assert "alice" in text and "bob" in text


def test_listcapabilities_lists_every_agents_or_one_agents(alice, bob):
    assert alice.deploy(name="ping", code=PONG, type="normal").status_code == 201
    assert bob.deploy(name="pong", code=PONG, public=True).status_code == 201
    listed = {c["capability"]: c for c in run("listcapabilities")}
    assert set(listed) == {"alice--ping", "bob--pong"}
    assert (listed["alice--ping"]["type"], listed["alice--ping"]["version"]) == ("normal", 1)
    assert listed["bob--pong"]["public"] is True
    assert [c["capability"] for c in run("listcapabilities", "--agent", "bob")] == ["bob--pong"]
    with pytest.raises(CommandError, match="no agent 'carol'"):
        call_command("listcapabilities", "--agent", "carol", stdout=io.StringIO())


def test_issuetoken_gives_a_token_that_works_and_revoketoken_stops_it(alice):
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    issued = run("issuetoken", "alice", "--scope", "invoke", "--label", "laptop")
    assert issued["agent"] == "alice" and issued["token"].startswith(issued["prefix"])
    assert Token.objects.get(prefix=issued["prefix"]).label == "laptop"
    assert alice.call("/alice/ping", token=issued["token"]).text == "pong"

    revoked = run("revoketoken", issued["prefix"])
    assert revoked == {"agent": "alice", "prefix": issued["prefix"], "revoked": True}
    assert alice.call("/alice/ping", token=issued["token"]).status_code == 401
    assert run("revoketoken", issued["token"])["revoked"] is False  # by the token itself, idempotent
    assert AuditEvent.objects.filter(action="token.revoked", actor="owner:cli").count() == 1
    with pytest.raises(CommandError, match="no token"):
        call_command("revoketoken", "sgl_nothing", stdout=io.StringIO())


def test_an_expiring_token_is_issued_with_its_end(alice):
    issued = run("issuetoken", "alice", "--scope", "deploy", "--expires-days", "2")
    assert issued["expires_at"] is not None
    assert Token.objects.get(prefix=issued["prefix"]).expires_at is not None


def test_disableagent_stops_its_tokens_and_enableagent_restores_them(alice):
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    assert run("disableagent", "alice") == {"agent": "alice", "active": False, "changed": True}
    assert alice.call("/alice/ping").status_code == 401
    assert run("disableagent", "alice")["changed"] is False
    assert run("enableagent", "alice") == {"agent": "alice", "active": True, "changed": True}
    assert alice.call("/alice/ping").text == "pong"
    assert "alice enabled" not in run_text("enableagent", "alice")  # already enabled


def test_resetbreaker_lets_calls_through_again(alice):
    from capabilities import services

    assert alice.deploy(name="ping", code=PONG).status_code == 201
    services.capability_force_degraded(capability=Capability.objects.get(full_name="alice--ping"), actor="owner:test")
    assert alice.call("/alice/ping").status_code == 503
    assert run("resetbreaker", "alice--ping") == {"capability": "alice--ping", "breaker": "closed"}
    assert alice.call("/alice/ping").text == "pong"
    with pytest.raises(CommandError, match="no capability alice--nothing"):
        call_command("resetbreaker", "alice--nothing", stdout=io.StringIO())


def test_rollback_serves_the_earlier_code_as_a_new_version(alice):
    assert alice.deploy(name="greet", code=answering("one")).status_code == 201
    assert alice.deploy(name="greet", code=answering("two")).status_code == 200
    assert alice.call("/alice/greet").text == "two"

    assert run("rollback", "alice--greet", "1") == {
        "capability": "alice--greet",
        "restored": 1,
        "version": 3,
        "changed": True,
        "placing": False,
    }
    assert alice.call("/alice/greet").text == "one"
    inspected = alice.call("/_api/capabilities/alice--greet").json()
    assert inspected["version"] == 3
    assert run("rollback", "alice--greet", "1")["changed"] is False
    with pytest.raises(CommandError, match="has no version 9"):
        call_command("rollback", "alice--greet", "9", stdout=io.StringIO())


def test_a_rollback_the_deploy_task_still_places_says_so(worker_pool, alice, settings):
    assert alice.deploy(name="greet", code=answering("one")).status_code == 201
    assert alice.deploy(name="greet", code=answering("two")).status_code == 200
    settings.SIGIL_DEPLOY_WAIT_SECONDS = 0  # the command answers before the placement is done
    out = io.StringIO()
    call_command("rollback", "alice--greet", "1", stdout=out)
    assert "version 3, with the code of version 1, is being placed" in out.getvalue()
    wait_for(lambda: alice.call("/alice/greet").text == "one", timeout=30, message="v3 placed and served")


def test_commands_refuse_unknown_agents_with_the_reason(sigil):
    with pytest.raises(CommandError, match="no agent 'ghost'"):
        call_command("disableagent", "ghost", stdout=io.StringIO())
    with pytest.raises(CommandError, match="no agent 'ghost'"):
        call_command("issuetoken", "ghost", "--scope", "invoke", stdout=io.StringIO())


def test_createagent_json_tokens_work(sigil):
    created = run("createagent", "carol")
    carol = AgentClient("carol", created["deploy_token"], created["invoke_token"], sigil.url)
    assert carol.deploy(name="ping", code=PONG).status_code == 201
    assert carol.call("/carol/ping").text == "pong"
