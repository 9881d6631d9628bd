"""What the edge answers is counted at the origin: each call Sigil's Worker on Cloudflare answers
itself (the emulator's workerd running it) is reported to the origin by the report channel, and
applied as the engine records its own calls: counters, breaker, failure record, token last-use,
the pager's access time and the access log. Whether a call crossed the origin is read from the
origin's access log (test_edge.crossed_origin). With the origin's processes and Redis stopped,
the edge keeps serving warm calls, and what it served arrives once they are back."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import requests

from agents import tokens
from capabilities.books import breaker, failures, stats
from capabilities.models import BreakerState, Capability
from capabilities.record_pushes import PUSH_PATH, SIGNATURE_HEADER, SIGNED_AT_HEADER, push_key, push_signature
from capabilities.tests.test_edge import (
    THROWS,
    at_edge,
    crossed_origin,
    edge,  # noqa: F401 (a fixture)
    edge_url,
    publish,
)
from sigil import redis_keys
from sigil.redis_client import get_redis
from testsupport.capability_code import PONG, answering
from testsupport.cast import wait_for

# The capability's own 500, its body two lines long.
FAILS = "export default { async fetch() { return new Response('out of coffee\\nsecond line', { status: 500 }) } }"


def counters(full: str) -> stats.CallStats:
    """What the origin has counted of `full` in Redis (no flush runs in these tests)."""
    raw = get_redis().hgetall(redis_keys.stats(full))
    return stats.CallStats.from_fields({k.decode(): v.decode() for k, v in raw.items()})


def reported(access_log, answers) -> dict[str, dict]:
    """The access lines the origin wrote of the edge's reports of `answers`, by request id,
    once every one of them has arrived."""
    wanted = {answer.headers["X-Request-Id"] for answer in answers}

    def arrived():
        lines = {line["request_id"]: line for line in access_log() if line["at_edge"]}
        return lines if wanted <= set(lines) else None

    lines = wait_for(arrived, timeout=30, interval=0.1, message=f"the edge's reports of {sorted(wanted)}")
    return {request_id: lines[request_id] for request_id in wanted}


def test_calls_served_at_the_edge_are_counted_at_the_origin_as_its_own(edge, alice, bob, access_log, settings):  # noqa: F811
    settings.SIGIL_BREAKER_THRESHOLD = 100  # the failures here count, and open nothing
    alice.deploy(name="ping", code=PONG)
    alice.deploy(name="fails", code=FAILS)
    publish()
    auth = alice.headers(alice.invoke_token)
    ping, fails = edge_url(edge, "/alice/ping"), edge_url(edge, "/alice/fails")
    warmed = [
        at_edge(access_log, lambda: requests.get(ping, headers=auth, timeout=30), what="the edge to serve ping"),
        at_edge(access_log, lambda: requests.get(fails, headers=auth, timeout=30), what="the edge to serve fails"),
    ]
    reported(access_log, warmed)  # what went before is counted: from here, only what follows
    ping_before, fails_before = counters("alice--ping"), counters("alice--fails")
    started = time.time()

    served = [requests.get(ping, headers=auth, timeout=30) for _ in range(3)]
    failed = requests.get(fails, headers=auth, timeout=30)
    hidden = requests.get(ping, headers=bob.headers(bob.invoke_token), timeout=30)  # alice's is private
    answers = [*served, failed, hidden]
    assert [answer.status_code for answer in answers] == [200, 200, 200, 500, 404]
    assert failed.text == "out of coffee\nsecond line"  # the caller has the capability's answer whole
    assert not any(crossed_origin(access_log, answer) for answer in answers)

    lines = [reported(access_log, answers)[answer.headers["X-Request-Id"]] for answer in answers]
    assert [(line["status"], line["code"]) for line in lines] == [
        (200, None),
        (200, None),
        (200, None),
        (500, None),
        (404, "not_found"),
    ]
    assert all(line["edge"] and line["capability"] for line in lines)

    ping_now, fails_now = counters("alice--ping"), counters("alice--fails")
    assert ping_now.calls - ping_before.calls == 3 and ping_now.errors == ping_before.errors
    assert ping_now.statuses.get("2xx", 0) - ping_before.statuses.get("2xx", 0) == 3
    assert ping_now.refused - ping_before.refused == 1  # bob's 404, counted on the capability he named
    assert ping_now.codes.get("not_found", 0) - ping_before.codes.get("not_found", 0) == 1
    assert sum(ping_now.buckets) - sum(ping_before.buckets) == 3 and ping_now.latency_ms > ping_before.latency_ms
    assert ping_now.last_access_epoch >= started
    assert fails_now.calls - fails_before.calls == 1 and fails_now.errors - fails_before.errors == 1

    [newest, *_] = failures.failures_list(full="alice--fails")
    assert (newest.request_id, newest.status, newest.code, newest.message, newest.version) == (
        failed.headers["X-Request-Id"],
        500,
        None,
        "out of coffee",
        1,
    )
    used = stats.tokens_used_read()[tokens.hash_secret(alice.invoke_token)]
    assert float(used) >= started
    assert tokens.hash_secret(bob.invoke_token) not in stats.tokens_used_read()  # refused: not a use


def test_failures_at_the_edge_open_the_breaker_at_the_origin_which_the_edge_then_refuses_by(
    edge,  # noqa: F811
    alice,
    access_log,
    settings,
    celery_worker,
):
    settings.SIGIL_BREAKER_THRESHOLD = 3
    alice.deploy(name="ping", code=PONG)
    alice.deploy(name="boom", code=THROWS)
    publish()
    auth = alice.headers(alice.invoke_token)
    at_edge(
        access_log,
        lambda: requests.get(edge_url(edge, "/alice/ping"), headers=auth, timeout=30),
        what="the edge to serve ping",
    )

    thrown = []
    while len(thrown) < settings.SIGIL_BREAKER_THRESHOLD:
        answer = requests.get(edge_url(edge, "/alice/boom"), headers=auth, timeout=30)
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "capability_error"
        if not crossed_origin(access_log, answer):
            thrown.append(answer)

    # Counted at the origin: its breaker opens, and its database copy says so (Celery).
    wait_for(
        lambda: breaker.status_of(get_redis().get(redis_keys.breaker_open("alice--boom")), now=time.time())
        == breaker.Status.OPEN,
        timeout=30,
        message="the origin's breaker of alice--boom to open",
    )
    wait_for(
        lambda: Capability.objects.get(full_name="alice--boom").breaker_state == BreakerState.OPEN,
        timeout=30,
        message="the breaker's opening to be recorded",
    )
    recorded = {failure.request_id: failure for failure in failures.failures_list(full="alice--boom")}
    for answer in thrown:
        failure = recorded[answer.headers["X-Request-Id"]]
        assert (failure.status, failure.code, failure.message) == (502, "capability_error", "Error: kaput at the edge")

    publish()  # the transition marked the route: the edge learns of it
    refused = at_edge(
        access_log,
        lambda: requests.get(edge_url(edge, "/alice/boom"), headers=auth, timeout=30),
        until=lambda answer: answer.status_code == 503,
        what="the edge to refuse the degraded alice--boom",
    )
    assert refused.json()["error"] == {
        "code": "degraded",
        "message": "alice--boom is degraded after repeated failures",
    }
    assert 1 <= int(refused.headers["Retry-After"]) <= settings.SIGIL_BREAKER_COOLDOWN_SECONDS
    line = reported(access_log, [refused])[refused.headers["X-Request-Id"]]
    assert (line["status"], line["code"]) == (503, "degraded")


@pytest.mark.parametrize("edge", ["worker-pool"], indirect=True)
def test_a_capability_served_only_at_the_edge_stays_hot_in_the_pagers_books(
    edge,  # noqa: F811
    alice,
    access_log,
    celery_worker,
):
    for name in ("a", "b", "c"):  # the pool's three slots, placed in this order
        assert alice.deploy(name=name, code=answering(name), type="normal").status_code == 201
    publish()
    auth = alice.headers(alice.invoke_token)
    # The edge learns what was published by serving c (through the origin, until it serves it itself).
    at_edge(access_log, lambda: requests.get(edge_url(edge, "/alice/c"), headers=auth, timeout=30), what="c")
    lru = redis_keys.lru("normal")

    def stamp(full: str) -> float:
        return get_redis().zscore(lru, full)

    assert stamp("alice--a") < stamp("alice--b") < stamp("alice--c")
    for _ in range(3):
        answer = requests.get(edge_url(edge, "/alice/a"), headers=auth, timeout=30)
        assert answer.text == "a" and not crossed_origin(access_log, answer)  # never the origin's
    wait_for(
        lambda: stamp("alice--a") > stamp("alice--c"),
        timeout=30,
        message="the pager to see a's calls at the edge",
    )

    assert alice.deploy(name="d", code=answering("d"), type="normal").status_code == 201
    states = {c.full_name: c.state for c in Capability.objects.filter(agent__name="alice")}
    assert states["alice--a"] == states["alice--c"] == states["alice--d"] == "live"
    assert states["alice--b"] in ("evicting", "paged_out")  # the least recently called, wherever


def a_report(full: str, token_hash: str, **fields) -> dict:
    """One report as the edge writes it (edge.js:callReport): here a call of `full` that failed."""
    return {
        "rid": uuid.uuid4().hex[:16],
        "at": time.time(),
        "method": "GET",
        "path": "/alice/ping",
        "capability": full,
        "type": "persistent",
        "token": token_hash,
        "version": 1,
        "status": 500,
        "code": None,
        "ms": 12.5,
        "call": True,
        "ok": False,
        "message": "out of coffee",
        **fields,
    }


def push(sigil, batch: dict) -> requests.Response:
    """POST `batch` to the origin, signed as a Worker signs it."""
    from django.conf import settings

    body = json.dumps(batch).encode()
    at = str(int(time.time()))
    signature = push_signature(key=push_key(settings.SIGIL_INTERNAL_SECRET), signed_at=at, body=body)
    headers = {"Content-Type": "application/json", SIGNED_AT_HEADER: at, SIGNATURE_HEADER: signature}
    return requests.post(f"{sigil.url}/{PUSH_PATH}", data=body, headers=headers, timeout=10)


def test_a_batch_of_reports_pushed_twice_counts_once(sigil, alice, access_log, settings):
    token_hash = tokens.hash_secret(alice.invoke_token)
    batch = {
        "id": str(uuid.uuid4()),
        "records": [],
        "dropped": 0,
        "reports": [
            a_report("alice--ping", token_hash),
            a_report("alice--ping", None, call=False, type=None, status=404, code="not_found", ok=False, message=""),
        ],
        "reports_dropped": 2,
    }
    assert push(sigil, batch).status_code == 204
    assert push(sigil, batch).status_code == 204  # taken before: success, and nothing more

    counted = counters("alice--ping")
    assert (counted.calls, counted.errors, counted.refused) == (1, 1, 1)
    assert [f.request_id for f in failures.failures_list(full="alice--ping")] == [batch["reports"][0]["rid"]]
    assert [line["request_id"] for line in access_log() if line["at_edge"]] == [r["rid"] for r in batch["reports"]]
    assert stats.edge_reports_counts() == (2, 2)
    settings.SIGIL_METRICS_TOKEN = "scrape"
    metrics = requests.get(f"{sigil.url}/metrics", headers={"Authorization": "Bearer scrape"}, timeout=10).text
    assert "sigil_edge_reports_total 2.0" in metrics and "sigil_edge_reports_lost_total 2.0" in metrics


def test_a_batch_with_a_malformed_report_is_refused_and_applies_nothing(sigil, alice):
    token_hash = tokens.hash_secret(alice.invoke_token)
    batch = {
        "id": str(uuid.uuid4()),
        "records": [],
        "reports": [a_report("alice--ping", token_hash), a_report("alice--ping", token_hash, type="weird")],
    }
    refused = push(sigil, batch)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_request"
    assert counters("alice--ping").calls == 0
    assert stats.edge_reports_counts() == (0, 0)


# --- the origin down ------------------------------------------------------------------------


@pytest.fixture
def own_origin(settings, cf_settings, cf_emulator_fresh, transactional_db, tmp_path):
    """An origin the test can stop whole and start again: a web process and a Celery worker
    of their own (testsupport.hosts.Host) on a Redis of their own (kept on disk, as `make run`
    keeps it), Sigil's Workers on the emulator pushing to it. This process shares its settings
    (that Redis, that origin), so what it publishes and reads is the origin's. Yields `start`,
    `stop` and the edge's URL of a path."""
    from capabilities.runtimes import runtimes_forget
    from sigil.embedded_redis import EmbeddedRedis
    from sigil.ports import free_port
    from testsupport.hosts import Host

    redis_server = EmbeddedRedis(tmp_path / "redis")
    redis_server.start()
    port = free_port()
    settings.REDIS_URL = redis_server.url
    settings.SIGIL_EDGE = True
    settings.SIGIL_ORIGIN_URL = f"http://127.0.0.1:{port}"
    settings.SIGIL_CF_WORKERS_BASE = cf_emulator_fresh.url
    settings.SIGIL_LOGS_ENABLED = True
    # worker-pool: the edge's Worker and the Tail Worker are the system's scripts; 4 slots.
    settings.SIGIL_POOL_TOTAL_QUOTA, settings.SIGIL_POOL_SYSTEM_RESERVED = 10, 2
    settings.SIGIL_POOL_USER_RESERVED, settings.SIGIL_POOL_SAFETY_MARGIN = 2, 2
    cf_emulator_fresh.configure(kv_miss_cache_seconds=0, kv_propagation_seconds=0, script_limit=10)
    get_redis.cache_clear()
    runtimes_forget()
    hosts: list[Host] = []

    class Origin:
        url = settings.SIGIL_ORIGIN_URL

        def start(self) -> None:
            if not redis_server.ping():
                redis_server.start()  # reads back its append-only file
            environment = {
                name: str(getattr(settings, name))
                for name in ("SIGIL_BACKEND", "SIGIL_ORIGIN_URL", "REDIS_URL", "SIGIL_CF_WORKERS_BASE")
            }
            hosts.append(
                Host(
                    settings,
                    name="origin",
                    queues=f"celery,{settings.SIGIL_DEPLOY_QUEUE}",
                    port=port,
                    SIGIL_EDGE="true",
                    **environment,
                )
            )

        def stop(self) -> None:
            """The web process, the Celery worker and Redis, all stopped."""
            hosts.pop().stop()
            redis_server.stop()

        def edge_url(self, path: str) -> str:
            return edge_url(cf_emulator_fresh, path)

    origin = Origin()
    try:
        yield origin
    finally:
        for host in hosts:
            host.stop()
        redis_server.stop()
        get_redis.cache_clear()
        runtimes_forget()


def spooled_batches(emulator) -> dict[str, dict]:
    """Every batch waiting in a spool of Sigil's Workers, read over the account's API by the
    test (Sigil's own client would spend the budget it keeps in the Redis that is down): key →
    batch."""
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {emulator.token}"
    base = f"{emulator.api_base}/accounts/{emulator.account_id}/storage/kv/namespaces"
    batches = {}
    for namespace in session.get(base, timeout=10).json()["result"]:
        keys = session.get(f"{base}/{namespace['id']}/keys", params={"prefix": "spool:"}, timeout=10).json()
        for key in keys["result"]:
            value = session.get(f"{base}/{namespace['id']}/values/{key['name']}", timeout=10)
            batches[key["name"]] = json.loads(value.content)
    return batches


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["platform", "loader", "worker-pool"])
def test_the_edge_serves_while_the_origin_is_down_and_what_it_served_arrives_once_it_is_back(
    backend, settings, own_origin, cf_emulator_fresh
):
    from capabilities.services import capability_evict
    from testsupport.cast import make_agent

    settings.SIGIL_BACKEND = backend
    own_origin.start()
    alice = make_agent("alice", own_origin.url)
    for name, code in (("ping", PONG), ("boom", THROWS), ("cold", PONG), ("other", PONG)):
        deployed = alice.deploy(name=name, code=code)
        assert deployed.status_code == 201, deployed.text
    capability_evict(full="alice--cold", actor="owner:test")  # its next call is a page-in: the origin's
    publish()
    auth = alice.headers(alice.invoke_token)

    own_origin.stop()
    pings = [requests.get(own_origin.edge_url("/alice/ping"), headers=auth, timeout=30) for _ in range(4)]
    assert [(answer.status_code, answer.text) for answer in pings] == [(200, "pong")] * 4
    booms = [requests.get(own_origin.edge_url("/alice/boom"), headers=auth, timeout=30) for _ in range(2)]
    assert [answer.json()["error"]["code"] for answer in booms] == ["capability_error"] * 2
    for handed_on in (
        requests.get(own_origin.edge_url("/alice/cold"), headers=auth, timeout=30),
        requests.post(own_origin.edge_url("/alice/ping"), headers={**auth, "Prefer": "respond-async"}, timeout=30),
    ):
        assert handed_on.status_code == 503 and handed_on.headers["Retry-After"] == "5"
        assert handed_on.json()["error"]["code"] == "unavailable"

    # What the edge served waits in its spool, reports and call records alike.
    served_ids = {answer.headers["X-Request-Id"] for answer in (*pings, *booms)}

    def all_spooled():
        batches = spooled_batches(cf_emulator_fresh)
        reported = {report["rid"] for batch in batches.values() for report in batch.get("reports", [])}
        recorded = {record["request_id"] for batch in batches.values() for record in batch["records"]}
        return batches if served_ids <= reported and served_ids <= recorded else None

    spooled = wait_for(all_spooled, timeout=60, interval=0.5, message="the outage's reports and records spooled")

    own_origin.start()
    # The isolate's next push, once the origin takes it, drains what its spool holds.
    assert requests.get(own_origin.edge_url("/alice/other"), headers=auth, timeout=30).status_code == 200

    def arrived():
        return counters("alice--ping").calls == 4 and counters("alice--boom").calls == 2

    wait_for(arrived, timeout=60, interval=0.2, message="the outage's calls counted at the origin")
    assert counters("alice--boom").errors == 2
    assert {f.request_id for f in failures.failures_list(full="alice--boom")} == {
        answer.headers["X-Request-Id"] for answer in booms
    }
    for answer in pings:
        request_id = answer.headers["X-Request-Id"]
        record = wait_for(
            lambda request_id=request_id: alice.session.get(
                f"{own_origin.url}/_api/capabilities/alice--ping/logs",
                params={"request_id": request_id},
                headers=auth,
                timeout=10,
            ).json()["records"],
            timeout=30,
            interval=0.2,
            message=f"the call record of {request_id}",
        )
        assert record[0]["status"] == 200

    # A batch the edge spooled, pushed again: taken before, it counts nothing more.
    [replayed, *_] = [batch for batch in spooled.values() if batch.get("reports")]
    again = push(own_origin, replayed)
    assert again.status_code == 204
    assert (counters("alice--ping").calls, counters("alice--boom").calls) == (4, 2)
