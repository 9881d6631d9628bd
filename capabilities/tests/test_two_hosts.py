"""Two hosts on one database, one Redis and one Cloudflare account (the emulator), each with a
var directory of its own; one is killed with -9 mid page-in, mid deploy or mid async call, and
the survivor serves all of it within the bound, with the pager's books and in-flight counts
right again. Beat, which runs on one host, is stood in for by calling the reaper's service
every half second, as in test_work_ends."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import requests

from agents.models import AuditEvent
from capabilities.books import pager
from capabilities.models import Capability
from capabilities.tests.test_work_ends import BOUND, LEASE, deploy_until_uploaded, reap_the_stranded_deploy
from sigil import redis_keys
from sigil.redis_client import get_redis
from testsupport.capability_code import answering
from testsupport.cast import AgentClient, make_agent, wait_for
from testsupport.hosts import Host

pytestmark = pytest.mark.slow

SLOW = "export default { async fetch() { await new Promise(r => setTimeout(r, 3000)); return new Response('late') } }"


@pytest.fixture
def hosts(worker_pool, settings):
    """Start hosts by name; each takes the deploys its web server queues (`deploys-NAME`)."""
    settings.SIGIL_LEASE_SECONDS = LEASE
    started: list[Host] = []

    def start(name: str, **extra: str) -> Host:
        queue = f"deploys-{name}"
        host = Host(settings, name=name, queues=f"celery,{queue}", SIGIL_DEPLOY_QUEUE=queue, **extra)
        started.append(host)
        return host

    yield start
    for host in started:
        host.stop()


def through(agent: AgentClient, host: Host) -> AgentClient:
    """The same agent, calling another host."""
    return AgentClient(agent.name, agent.deploy_token, agent.invoke_token, host.url)


def call_dying_host(agent: AgentClient, path: str) -> None:
    """A call whose host dies under it: its caller sees the connection go."""
    with contextlib.suppress(requests.RequestException):
        agent.call(path)


def books_are_right(full: str) -> bool:
    """The pager holds `full` once, served, nothing placing it, no call of it counted."""
    kind = Capability.objects.get(full_name=full).type
    return (
        pager.pager_locations().get(full) == {redis_keys.lru(kind)}
        and full not in pager.pager_placing()
        and pager.pager_inflight(full) == 0
    )


def test_a_host_killed_mid_page_in_leaves_the_survivor_serving_within_the_bound(hosts, worker_pool):
    a, b = hosts("a"), hosts("b")
    alice = make_agent("alice", a.url)
    for name in ("a", "b", "c", "d"):  # three slots: `a` is paged out
        assert alice.deploy(name=name, code=answering(name), type="normal").status_code == 201
    wait_for(lambda: Capability.objects.get(full_name="alice--a").state == "paged_out", message="a paged out")
    worker_pool.configure(latency=1.5)  # each API call takes 1.5 s: the page-in is in flight
    cold = threading.Thread(target=call_dying_host, args=(alice, "/alice/a"))
    cold.start()
    wait_for(lambda: get_redis().exists(redis_keys.place_lock("alice--a")), message="host a to hold the placement")
    a.kill()
    killed_at = time.monotonic()
    worker_pool.configure(latency=0)

    answer = through(alice, b).call("/alice/a")
    assert (answer.status_code, answer.text) == (200, "a")
    assert time.monotonic() - killed_at < BOUND
    wait_for(lambda: books_are_right("alice--a"), timeout=LEASE + 5, message="the pager's books to be right")
    cold.join(10)


def test_a_host_killed_mid_deploy_has_its_deploy_placed_by_the_survivor(hosts, worker_pool, settings):
    a, b = hosts("a", SIGIL_DEPLOY_WAIT_SECONDS="0.5"), hosts("b")
    alice = make_agent("alice", a.url)
    worker_pool.configure(latency=1.5)
    deploy_until_uploaded(worker_pool, alice, "slow", "placed after all")  # by host a's worker
    a.kill()
    killed_at = time.monotonic()
    worker_pool.configure(latency=0)
    settings.SIGIL_DEPLOY_QUEUE = "deploys-b"  # beat on the survivor sends work to its worker
    reap_the_stranded_deploy("alice--slow", killed_at=killed_at)
    assert AuditEvent.objects.filter(subject="alice--slow", action="capability.deploy_resent").exists()
    assert through(alice, b).call("/alice/slow").text == "placed after all"
    wait_for(lambda: books_are_right("alice--slow"), timeout=LEASE + 5, message="the pager's books to be right")


def runner_holding(call_id: str) -> str | None:
    """The id of the runner whose taken list holds `call_id` (host:pid:tag)."""
    redis = get_redis()
    for key in redis.scan_iter(redis_keys.async_taken("*")):
        if call_id.encode() in redis.lrange(key, 0, -1):
            return key.decode().removeprefix(redis_keys.async_taken(""))
    return None


def test_a_host_killed_mid_async_call_has_the_call_run_by_the_survivor(hosts, worker_pool, settings):
    settings.SIGIL_ASYNC_RUNNERS = 0  # this test process's own server takes none of them
    first, second = hosts("a"), hosts("b")
    alice = make_agent("alice", first.url)
    assert alice.deploy(name="slow", code=SLOW).status_code == 201
    accepted = alice.call("/alice/slow", headers={"Prefer": "respond-async"})
    assert accepted.status_code == 202, accepted.text
    status_url = accepted.json()["status_url"]
    call_id = status_url.rstrip("/").rsplit("/", 1)[1]  # /_api/calls/{id}
    runner = wait_for(lambda: runner_holding(call_id), message="a host's runner to take the call")
    pid = int(runner.split(":")[1])
    taker, survivor = (first, second) if pid == first.web.pid else (second, first)
    assert pid == taker.web.pid, f"the call was taken by {runner}, neither host's web process"
    taker.kill()
    killed_at = time.monotonic()

    via_survivor = through(alice, survivor)
    (result,) = wait_for(
        lambda: (r := via_survivor.call(status_url)).status_code != 202 and [r],
        timeout=BOUND + 15,
        message="the call's result",
    )
    assert (result.status_code, result.text) == (200, "late")
    assert time.monotonic() - killed_at < BOUND + 15
    assert not get_redis().zcard(redis_keys.async_pending("alice"))
