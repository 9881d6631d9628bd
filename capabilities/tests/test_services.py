"""Services and tasks run directly: stats flush, slot release, expiry, and their idempotency."""

from datetime import timedelta

import pytest
from django.utils import timezone

from agents.models import Token
from capabilities import services, tasks
from capabilities.models import Capability
from capabilities.runtimes import get_runtime
from testsupport.capability_code import PONG
from testsupport.cast import flush_stats_when_recorded, wait_for


def test_flush_moves_call_counts_into_the_registry_once(alice):
    alice.deploy(name="ping", code=PONG)
    for _ in range(3):
        assert alice.call("/alice/ping").status_code == 200
    assert alice.call("/alice/ping?x", headers={"X-Ignored": "1"}).status_code == 200

    flush_stats_when_recorded(alice__ping=4)
    capability = Capability.objects.get(full_name="alice--ping")
    assert capability.calls_total == 4 and capability.errors_total == 0
    assert capability.latency_ms_total > 0
    assert capability.last_access_at is not None
    assert Token.objects.get(agent__name="alice", scope="invoke").last_used_at is not None

    tasks.capability_flush_stats()  # a second run finds nothing new
    capability.refresh_from_db()
    assert capability.calls_total == 4


def test_release_slot_runs_twice_safely_and_spares_a_successor(alice):
    alice.deploy(name="ping", code=PONG)
    old = Capability.objects.get(full_name="alice--ping")
    alice.session.delete(f"{alice.base_url}/_api/capabilities/alice--ping", headers=alice.headers(alice.deploy_token))
    alice.deploy(name="ping", code=PONG.replace("pong", "new"))

    # The old row's release must not delete the slot the new capability now holds.
    assert services.capability_release_slot(capability_id=old.pk) is False
    assert "alice--ping" in get_runtime().list_slots()
    assert alice.call("/alice/ping").text == "new"


def test_release_slot_of_a_removed_capability_is_idempotent(alice):
    alice.deploy(name="ping", code=PONG)
    capability = Capability.objects.get(full_name="alice--ping")
    alice.session.delete(f"{alice.base_url}/_api/capabilities/alice--ping", headers=alice.headers(alice.deploy_token))
    tasks.capability_release_slot(capability_id=capability.pk)
    assert "alice--ping" not in get_runtime().list_slots()
    tasks.capability_release_slot(capability_id=capability.pk)
    assert "alice--ping" not in get_runtime().list_slots()


def test_expiry_removes_only_expired_ephemerals_and_is_idempotent(alice):
    short = alice.deploy(code=PONG, ttl=1).json()["capability"]
    long = alice.deploy(code=PONG.replace("pong", "long"), ttl=3600).json()["capability"]
    persistent = alice.deploy(name="keep", code=PONG).json()["capability"]

    later = timezone.now() + timedelta(seconds=5)
    assert services.capability_expire_ephemerals(now=later) == 1
    assert services.capability_expire_ephemerals(now=later) == 0
    states = dict(Capability.objects.values_list("full_name", "state"))
    assert states == {short: "removed", long: "live", persistent: "live"}


def test_createagent_prints_the_agent_and_two_working_tokens(sigil, capsys):
    import json

    import requests
    from django.core.management import call_command

    call_command("createagent", "carol", "--json")
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == {"agent", "deploy_token", "invoke_token"} and printed["agent"] == "carol"
    deployed = requests.post(
        f"{sigil.url}/_api/deploy",
        json={"name": "hi", "code": PONG},
        headers={"Authorization": f"Bearer {printed['deploy_token']}"},
        timeout=30,
    )
    assert deployed.status_code == 201
    called = requests.get(
        f"{sigil.url}/carol/hi", headers={"Authorization": f"Bearer {printed['invoke_token']}"}, timeout=30
    )
    assert called.text == "pong"
    assert Token.objects.filter(agent__name="carol").count() == 2
    assert not Token.objects.filter(secret_hash=printed["deploy_token"]).exists()  # only the hash is stored


@pytest.mark.parametrize("name", ["Carol", "admin", "a--b", "9lives", ""])
def test_createagent_refuses_bad_names(db, name):
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError):
        call_command("createagent", name, "--json")


def test_at_most_eight_agents(db, settings):
    from agents.services import agent_create
    from sigil.errors import QuotaExceeded

    settings.SIGIL_MAX_AGENTS = 2
    agent_create(name="one", actor="owner:test")
    agent_create(name="two", actor="owner:test")
    with pytest.raises(QuotaExceeded):
        agent_create(name="three", actor="owner:test")


def test_remove_enqueues_the_slot_release_only_after_commit(db, workerd_group, django_capture_on_commit_callbacks):
    from agents import services as agent_services
    from agents.tokens import Principal

    agent = agent_services.agent_create(name="dave", actor="owner:test")
    principal = Principal(agent.pk, agent.name, "deploy", "test")
    services.capability_deploy(principal=principal, name="ping", code=PONG)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        services.capability_remove(principal=principal, full="dave--ping")
    assert len(callbacks) == 1
    assert "dave--ping" in get_runtime().list_slots()  # nothing deleted before the commit


def test_inspect_reports_recent_calls_errors_and_percentiles_to_the_owner_only(alice, bob):
    alice.deploy(
        name="flaky",
        public=True,
        code="""export default { async fetch(request) {
      return new Response('x', { status: new URL(request.url).searchParams.has('fail') ? 500 : 200 });
    } }""",
    )
    for _ in range(8):
        assert alice.call("/alice/flaky").status_code == 200
    for _ in range(2):
        assert alice.call("/alice/flaky?fail=1").status_code == 500
    flush_stats_when_recorded(alice__flaky=10)

    seen = alice.call("/_api/capabilities/alice--flaky").json()
    recent = seen["recent"]
    assert recent["calls"] == 10 and recent["errors"] == 2 and recent["error_rate"] == 0.2
    assert recent["cold_calls"] == 0
    assert 0 < recent["p50_ms"] <= recent["p95_ms"]
    assert seen["stats"]["calls"] == 10

    other = bob.call("/_api/capabilities/alice--flaky").json()
    assert other["recent"] is None and other["stats"] is None


def test_inspect_counts_the_calls_sigil_refused_by_code_as_the_owners_dashboard_does(alice):
    alice.deploy(name="ping", code=PONG)
    assert alice.call("/alice/ping").status_code == 200
    services.capability_force_degraded(capability=Capability.objects.get(full_name="alice--ping"), actor="owner:test")
    for _ in range(3):
        assert alice.call("/alice/ping").status_code == 503
    flush_stats_when_recorded(alice__ping=1)
    wait_for(
        lambda: alice.call("/_api/capabilities/alice--ping").json()["stats"]["refused"] == 3
        or services.capability_flush_stats(),
        message="the refusals flushed",
    )

    stats = alice.call("/_api/capabilities/alice--ping").json()["stats"]
    assert (stats["calls"], stats["errors"], stats["refused"]) == (1, 0, 3)
    assert stats["codes"] == {"degraded": 3}
    assert Capability.objects.get(full_name="alice--ping").refused_total == stats["refused"]  # the admin's column


def test_pruning_drops_minute_windows_past_retention_and_keeps_totals(alice, settings):
    from capabilities.models import CapabilityStatsWindow

    settings.SIGIL_STATS_RETENTION_DAYS = 30
    alice.deploy(name="ping", code=PONG)
    alice.call("/alice/ping")
    flush_stats_when_recorded(alice__ping=1)
    assert CapabilityStatsWindow.objects.count() == 1

    assert services.capability_prune_stats(now=timezone.now() + timedelta(days=29)) == 0
    assert services.capability_prune_stats(now=timezone.now() + timedelta(days=31)) == 1
    assert CapabilityStatsWindow.objects.count() == 0
    assert Capability.objects.get(full_name="alice--ping").calls_total == 1


def test_a_redeploy_whose_capability_was_removed_since_it_was_read_is_a_conflict(alice):
    """The row a deploy read may be removed before the deploy records its version (a DELETE,
    or a refused first deploy cleared): a 409 to deploy again, neither a 500 nor a version
    added to a removed capability."""
    from django.db import transaction

    from capabilities.contracts import Contract
    from capabilities.services.versions import NewVersion
    from sigil.errors import Conflict

    alice.deploy(name="ping", code=PONG)
    read = Capability.objects.select_related("agent").get(full_name="alice--ping")
    services.capability_remove_as_owner(full="alice--ping", actor="owner:test")
    new = NewVersion(
        owner=read.agent,
        existing=read,
        full=read.full_name,
        type=read.type,
        expires_at=None,
        code=PONG,
        sha="0" * 64,
        contract=Contract(),
        now=timezone.now(),
    )
    with pytest.raises(Conflict, match="removed by a concurrent request"), transaction.atomic():
        new.capability_locked()
    Capability.objects.filter(pk=read.pk).delete()  # the row is gone altogether: the same
    with pytest.raises(Conflict, match="removed by a concurrent request"), transaction.atomic():
        new.capability_locked()


def test_a_deploy_request_reads_back_what_earlier_deploys_and_rollbacks_stored():
    """The deploy task reads the request back from the version's JSON, also as versions
    recorded before the request had a type stored it."""
    from capabilities.models import DeployRequest

    deploy = {"bindings": ["KV:CACHE"], "public": True, "cache_when_degraded": None, "actor": "agent:alice"}
    rollback = {"bindings": [], "public": False, "actor": "owner:test", "restores": 1}
    assert DeployRequest.from_json(deploy) == DeployRequest(bindings=["KV:CACHE"], public=True, actor="agent:alice")
    assert DeployRequest.from_json(rollback) == DeployRequest(public=False, actor="owner:test", restores=1)
    assert DeployRequest.from_json({}) == DeployRequest()  # a version placed in its request records none

    asked = DeployRequest(bindings=["KV:CACHE"], public=True, actor="agent:alice", cache_when_degraded=True)
    assert DeployRequest.from_json(asked.to_json()) == asked
    assert {key: asked.to_json()[key] for key in deploy} == {**deploy, "cache_when_degraded": True}
