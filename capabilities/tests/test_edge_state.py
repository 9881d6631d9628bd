"""The state the edge decides by, published to Workers KV: every change of a token, a route or a
breaker is marked, and after one run of the publisher (as its beat task runs it) the emulator's
KV holds each key's value as the schema of docs/cloudflare.md says; many changes are one bulk
write; a failed write loses nothing; reconcile repairs what was changed behind Sigil's back.

On the worker-pool runtime under the Cloudflare emulator, with real Celery workers, real Redis
and the real database; KV is read back over the emulator's API."""

from __future__ import annotations

import io
import json
import time

import pytest
import requests
from django.core.management import call_command

from agents import services as agent_services
from agents import tokens
from agents.models import Agent, Token
from capabilities import services, tasks
from capabilities.models import Capability
from capabilities.runtimes.cloudflare import CloudflareNotFound
from sigil import redis_keys
from sigil.redis_client import get_redis
from testsupport.capability_code import PONG, PONG2
from testsupport.cast import fail_flaky, wait_for

TITLE = "sigil-edge"
DAY = 86_400


@pytest.fixture
def edge(settings, worker_pool, cf_client, cf_emulator_fresh):
    """The edge on, on the worker-pool runtime under the fresh emulator. Taken before `alice`,
    whose tokens are then marked as issued (cf_client empties Redis when first made)."""
    settings.SIGIL_EDGE = True
    settings.SIGIL_EDGE_KV_TITLE = TITLE
    return Kv(cf_client, cf_emulator_fresh)


class Kv:
    """The edge's namespace as anyone with the account's API reads it."""

    def __init__(self, client, emulator) -> None:
        self.client = client
        self.emulator = emulator

    @property
    def id(self) -> str:
        found = [ns["id"] for ns in self.client.kv_namespace_list() if ns["title"] == TITLE]
        assert len(found) == 1, found
        return found[0]

    def get(self, key: str) -> bytes | None:
        try:
            return self.client.kv_get(self.id, key)
        except CloudflareNotFound:
            return None

    def route(self, full: str) -> dict:
        return json.loads(self.get(f"route:{full}"))

    def listed(self) -> dict[str, dict]:
        return {entry["name"]: entry for entry in self.client.kv_keys(self.id)}

    def bulk_writes(self) -> int:
        return len(self.emulator.api_calls(method="PUT", path_suffix="/bulk"))

    def delete_namespace(self) -> None:
        """The owner deletes the namespace (the dashboard, or any client of the API)."""
        url = f"{self.emulator.api_base}/accounts/{self.emulator.account_id}/storage/kv/namespaces/{self.id}"
        deleted = requests.delete(url, headers={"Authorization": f"Bearer {self.emulator.token}"}, timeout=10)
        assert deleted.status_code == 200, deleted.text


def publish() -> None:
    """One run of the publisher, as beat runs it."""
    tasks.edge_publish()


def token_hash(secret: str) -> str:
    return tokens.hash_secret(secret)


def schema_token(token: Token) -> bytes:
    """A usable token as the schema writes it: id|agent|scope|exp|calls|placements."""
    agent = token.agent
    expires = token.expires_at.timestamp() if token.expires_at else ""
    calls, placements = agent.max_calls_in_flight or "", agent.max_placements_in_flight or ""
    return f"{agent.pk}|{agent.name}|{token.scope}|{expires}|{calls}|{placements}".encode()


def tombstone_expires(kv: Kv, key: str) -> float:
    return kv.listed()[key]["expiration"] - time.time()


# --- tokens ------------------------------------------------------------------------------------


def test_tokens_issued_revoked_and_of_a_disabled_agent_reach_the_edge_as_the_schema_says(edge, alice):
    agent = Agent.objects.get(name="alice")
    token, secret = agent_services.token_issue(agent=agent, scope="invoke", actor="owner:test")
    publish()
    key = f"tok:{token_hash(secret)}"
    assert edge.get(key) == schema_token(token)
    assert "expiration" not in edge.listed()[key]

    agent_services.agent_set_shares(agent=agent, calls_in_flight=7, placements_in_flight=None, actor="owner:test")
    publish()
    token.refresh_from_db()
    assert edge.get(key) == schema_token(token) == f"{agent.pk}|alice|invoke||7|".encode()

    agent_services.agent_set_active(agent=agent, is_active=False, actor="owner:test")
    publish()
    assert edge.get(key) == b"-disabled"
    assert edge.get(f"tok:{token_hash(alice.deploy_token)}") == b"-disabled"

    agent_services.agent_set_active(agent=agent, is_active=True, actor="owner:test")
    publish()
    assert edge.get(key) == schema_token(token)

    agent_services.token_revoke(token=token, actor="owner:test")
    publish()
    assert edge.get(key) == b"-"
    assert tombstone_expires(edge, key) == pytest.approx(DAY, abs=60)


def test_nothing_is_marked_with_the_edge_off(settings, worker_pool, cf_client, alice):
    settings.SIGIL_EDGE = False
    get_redis().delete(redis_keys.EDGE_DIRTY)  # what alice's tokens marked, had the edge been on until now
    agent = Agent.objects.get(name="alice")
    agent_services.token_issue(agent=agent, scope="invoke", actor="owner:test")
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    assert get_redis().scard(redis_keys.EDGE_DIRTY) == 0
    assert services.edge_publish() is None
    assert [ns["title"] for ns in cf_client.kv_namespace_list()] == []


# --- routes ------------------------------------------------------------------------------------


def test_a_deploy_a_split_and_a_removal_reach_the_edge_as_the_schema_says(edge, alice):
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    publish()
    capability = Capability.objects.get(full_name="alice--ping")
    route = edge.route("alice--ping")
    assert route == {
        "id": capability.pk,
        "agent": "alice",
        "type": capability.type,
        "public": False,
        "exp": None,
        "state": "live",
        "slot": capability.slot,
        "sha": capability.placed_sha,
        "backend": "worker-pool",
        "cpu": None,
        "ver": 1,
        "split": None,
        "cache": False,
        "brk": None,
    }

    staged = alice.deploy(name="ping", code=PONG2, stage=True)
    assert staged.status_code == 200, staged.text
    started = alice.session.put(
        f"{alice.base_url}/_api/capabilities/alice--ping/split",
        json={"weight": 25, "caller_header": "X-User"},
        headers=alice.headers(alice.deploy_token),
    )
    assert started.status_code == 200, started.text
    publish()
    assert edge.route("alice--ping")["split"] == ["alice--ping--v2", 25, "x-user"]
    variant = edge.route("alice--ping--v2")
    assert (variant["state"], variant["ver"], variant["brk"]) == ("live", 2, None)

    removed = alice.session.delete(
        f"{alice.base_url}/_api/capabilities/alice--ping", headers=alice.headers(alice.deploy_token)
    )
    assert removed.status_code in (200, 204), removed.text
    publish()
    assert edge.get("route:alice--ping") == b"-"
    assert tombstone_expires(edge, "route:alice--ping") == pytest.approx(DAY, abs=60)


def test_a_forced_breaker_its_reset_and_a_breaker_tripped_by_failures_reach_the_edge(
    edge, alice, celery_worker, settings
):
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    capability = Capability.objects.get(full_name="alice--ping")
    services.capability_force_degraded(capability=capability, actor="owner:test")
    publish()
    assert edge.route("alice--ping")["brk"] == "forced"

    services.capability_reset_breaker(capability=capability, actor="owner:test")
    publish()
    assert edge.route("alice--ping")["brk"] is None

    fail_flaky(alice, settings, threshold=2)  # a cool-down of 1 s
    opened_by = time.time()
    # The transition is recorded by a Celery task, which marks the route.
    wait_for(
        lambda: get_redis().sismember(redis_keys.EDGE_DIRTY, "route:alice--flaky"), message="the tripped breaker's mark"
    )
    publish()
    until = edge.route("alice--flaky")["brk"]
    assert isinstance(until, float)
    assert opened_by - 5 < until - 1 <= opened_by


# --- the publisher -----------------------------------------------------------------------------


def test_many_changes_are_one_bulk_write_and_nothing_to_publish_is_no_request(edge, alice):
    agent = Agent.objects.get(name="alice")
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    issued = [agent_services.token_issue(agent=agent, scope="invoke", actor="owner:test")[1] for _ in range(40)]
    publish()  # the namespace is created first: counted from here
    writes = edge.bulk_writes()
    for secret in issued[:20]:
        agent_services.token_revoke(token=Token.objects.get(secret_hash=token_hash(secret)), actor="owner:test")
    services.capability_force_degraded(capability=Capability.objects.get(full_name="alice--ping"), actor="owner:test")
    assert get_redis().scard(redis_keys.EDGE_DIRTY) == 21
    published = services.edge_publish()
    assert published.written == 21
    assert edge.bulk_writes() == writes + 1
    assert [edge.get(f"tok:{token_hash(secret)}") for secret in issued[:20]] == [b"-"] * 20
    assert edge.route("alice--ping")["brk"] == "forced"

    calls = len(edge.emulator.api_calls())
    assert services.edge_publish() is None
    assert len(edge.emulator.api_calls()) == calls


def test_a_failed_publish_loses_nothing_and_is_told_on_health(edge, alice, settings, sigil):
    settings.SIGIL_CF_MAX_RETRIES = 0  # one fault fails one run
    agent = Agent.objects.get(name="alice")
    token, secret = agent_services.token_issue(agent=agent, scope="invoke", actor="owner:test")
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    publish()  # creates the namespace
    services.capability_force_degraded(capability=Capability.objects.get(full_name="alice--ping"), actor="owner:test")
    agent_services.token_revoke(token=token, actor="owner:test")

    edge.emulator.configure(fail_next=3)
    for _ in range(3):
        assert services.edge_publish().failed
    assert get_redis().scard(redis_keys.EDGE_DIRTY) == 2
    assert edge.route("alice--ping")["brk"] is None
    health = requests.get(f"{sigil.url}/_health", timeout=10).json()
    assert any("has not been published for 3 runs" in warning for warning in health.get("warnings", [])), health
    output = io.StringIO()
    call_command("edgestate", "--json", stdout=output)
    standing = json.loads(output.getvalue())
    assert (standing["edge_on"], standing["waiting"], standing["failures_in_a_row"]) == (True, 2, 3)
    assert "Cloudflare answered" in standing["error"]

    assert services.edge_publish().written == 2
    assert edge.route("alice--ping")["brk"] == "forced"
    assert edge.get(f"tok:{token_hash(secret)}") == b"-"
    assert services.edge_standing().failures_in_a_row == 0
    assert "warnings" not in requests.get(f"{sigil.url}/_health", timeout=10).json()


def test_a_publisher_that_died_mid_write_leaves_its_keys_to_the_next(edge, alice):
    agent = Agent.objects.get(name="alice")
    token, secret = agent_services.token_issue(agent=agent, scope="invoke", actor="owner:test")
    redis = get_redis()
    # What a publisher killed between taking its keys and writing them leaves.
    redis.sunionstore(redis_keys.EDGE_PUBLISHING, [redis_keys.EDGE_DIRTY])
    redis.delete(redis_keys.EDGE_DIRTY)
    assert services.edge_publish().written == 3  # alice's own two tokens as well
    assert edge.get(f"tok:{token_hash(secret)}") == schema_token(token)
    assert redis.scard(redis_keys.EDGE_PUBLISHING) == 0


# --- the namespace and reconcile ---------------------------------------------------------------


def test_the_edges_namespace_is_made_on_provision_and_again_by_the_publisher_once_gone(edge, alice):
    provisioned = services.runtime_provision(actor="owner:test")
    # First the namespace, then the edge's Worker (worker-pool's own), which binds it.
    assert provisioned[0] == f"created the edge's KV namespace {TITLE} ({edge.id})"
    assert [line.split(" (")[0] for line in provisioned[1:]] == ["deployed the edge Worker sigil-edge"]
    assert services.runtime_provision(actor="owner:test") == []

    # Deleted behind Sigil's back: the publisher that meets it missing gives its keys back and
    # forgets it; the next makes it again.
    edge.delete_namespace()
    agent_services.token_issue(agent=Agent.objects.get(name="alice"), scope="invoke", actor="owner:test")
    assert services.edge_publish().failed
    assert services.edge_publish().written == 3  # alice's two tokens and the new one
    assert [ns["title"] for ns in edge.client.kv_namespace_list()] == [TITLE]


def test_reconcile_repairs_what_was_changed_behind_sigils_back(edge, alice):
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    publish()
    deploy_key = f"tok:{token_hash(alice.deploy_token)}"
    published = {key: edge.get(key) for key in (deploy_key, "route:alice--ping")}
    assert services.edge_reconcile() == 0

    namespace = edge.id
    edge.client.kv_put(namespace, deploy_key, b"1|alice|deploy|||")  # tampered with
    edge.client.kv_delete(namespace, "route:alice--ping")  # lost
    edge.client.kv_put(namespace, "route:alice--ghost", b'{"agent":"alice"}')  # never Sigil's
    edge.client.kv_put(namespace, "tok:" + "0" * 64, b"-", metadata={"sha": "stale"})
    assert services.edge_reconcile() == 4
    publish()
    assert {key: edge.get(key) for key in published} == published
    assert edge.get("route:alice--ghost") == b"-"
    assert edge.get("tok:" + "0" * 64) == b"-"
    assert services.edge_reconcile() == 0
