"""The event-driven call path: no agent waits for another, each agent has its fair share,
the failed-token brake stops only guesses, bodies stream both ways, WebSockets pass through,
and never-ending async calls end."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
import requests
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from agents import services as agent_services
from agents.models import Agent
from capabilities.models import Capability
from sigil import redis_keys
from sigil.redis_client import get_redis
from testsupport.capability_code import COUNTS_BODY
from testsupport.cast import deploy_answering, wait_for
from testsupport.engine_calls import answers_together, call_request
from testsupport.processes import resident_mb

SLOW = "export default { async fetch() { await new Promise(r => setTimeout(r, %d)); return new Response('slow') } }"
# Answers the first bytes of its request body at once, without waiting for the rest.
FIRST_BYTES = """export default { async fetch(request) {
  const reader = request.body.getReader();
  const { value } = await reader.read();
  return new Response('first ' + value.length);
} }"""
ECHO_SOCKET = """export default { async fetch(request) {
  if (request.headers.get('upgrade') !== 'websocket') return new Response('send an upgrade', { status: 426 });
  const [client, server] = Object.values(new WebSocketPair());
  server.accept();
  server.addEventListener('message', (event) => server.send(event.data));
  server.addEventListener('close', (event) => server.close(event.code, 'bye'));
  return new Response(null, { status: 101, webSocket: client });
} }"""


def storm(url: str, token: str, count: int, path: str) -> list[tuple[int, float, str | None]]:
    """`count` concurrent GETs of `path`: (status, when it ended, Retry-After) of each."""

    async def run():
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def one():
                async with session.get(url + path, headers={"Authorization": f"Bearer {token}"}) as response:
                    await response.read()
                    return response.status, time.monotonic(), response.headers.get("Retry-After")

            return await asyncio.gather(*(one() for _ in range(count)))

    return asyncio.run(run())


class Storm:
    """A storm of one agent's calls in a thread of its own, while the test goes on."""

    def __init__(self, url: str, token: str, count: int, path: str) -> None:
        self.results: list = []
        self.thread = threading.Thread(target=lambda: self.results.extend(storm(url, token, count, path)))
        self.thread.start()

    def join(self) -> list:
        self.thread.join(120)
        return self.results


def in_flight(sigil, agent: str) -> int:
    engine = sigil.app.engine
    return 0 if engine is None else engine.shares.calls.get(agent, 0)


def test_one_agents_slow_calls_do_not_hold_another_agents_calls(sigil, alice, bob):
    agent_services.agent_set_shares(
        agent=Agent.objects.get(name="alice"), calls_in_flight=1000, placements_in_flight=None, actor="owner:test"
    )
    alice.deploy(name="slow", code=SLOW % 3000)
    deploy_answering(bob, "ping", "pong")
    slow = Storm(sigil.url, alice.invoke_token, 300, "/alice/slow")
    wait_for(lambda: in_flight(sigil, "alice") == 300, timeout=30, message="alice's 300 calls in flight")

    bob_ended = []
    for _ in range(20):
        response = bob.call("/bob/ping")
        assert (response.status_code, response.text) == (200, "pong")
        bob_ended.append(time.monotonic())
    results = slow.join()
    assert [status for status, _, _ in results] == [200] * 300
    # Every one of bob's calls was answered while all of alice's were still waiting.
    assert max(bob_ended) < min(ended for _, ended, _ in results)


def test_an_agent_over_its_share_gets_429_and_another_agent_does_not(sigil, alice, bob, settings):
    settings.SIGIL_AGENT_CALLS_IN_FLIGHT = 10
    alice.deploy(name="slow", code=SLOW % 2000)
    deploy_answering(bob, "ping", "pong")
    slow = Storm(sigil.url, alice.invoke_token, 30, "/alice/slow")
    wait_for(lambda: in_flight(sigil, "alice") == 10, timeout=30, message="alice's share of calls in flight")
    for _ in range(5):
        assert bob.call("/bob/ping").status_code == 200
    results = slow.join()
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200] * 10 + [429] * 20
    assert {retry for status, _, retry in results if status == 429} == {"1"}
    refused = bob.call("/bob/ping")
    assert refused.status_code == 200
    # Counted as refusals of the capability called, not as its calls (a success's record is
    # applied up to a batch's wait after its answer).
    wait_for(
        lambda: get_redis().hmget(redis_keys.stats("alice--slow"), "refused", "calls") == [b"20", b"10"],
        message="20 refusals and 10 calls counted",
    )


def test_a_429_for_an_agents_share_says_what_to_do(sigil, alice, settings):
    settings.SIGIL_AGENT_CALLS_IN_FLIGHT = 1
    alice.deploy(name="slow", code=SLOW % 1500)
    slow = Storm(sigil.url, alice.invoke_token, 1, "/alice/slow")
    wait_for(lambda: in_flight(sigil, "alice") == 1, timeout=30, message="alice's call in flight")
    refused = alice.call("/alice/slow")
    slow.join()
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "rate_limited" and "1 calls in flight" in error["message"]


def test_slow_page_ins_do_not_hold_another_agents_warm_calls(worker_pool, alice, bob):
    for name in ("a", "b"):
        deploy_answering(alice, name, name, type="normal")
    deploy_answering(bob, "ping", "pong")
    deploy_answering(alice, "c", "c", type="normal")  # three slots: `a` is paged out
    wait_for(lambda: Capability.objects.get(full_name="alice--a").state == "paged_out", message="a paged out")
    worker_pool.configure(latency=1.0)  # Cloudflare answers each API call in a second
    cold = Storm(alice.base_url, alice.invoke_token, 10, "/alice/a")
    bob_ended = []
    for _ in range(10):
        assert bob.call("/bob/ping").text == "pong"
        bob_ended.append(time.monotonic())
    results = cold.join()
    assert [status for status, _, _ in results] == [200] * 10
    assert max(bob_ended) < min(ended for _, ended, _ in results)


def test_calls_that_find_a_cold_capability_together_share_its_one_placement(worker_pool, alice, settings):
    # With a share of one placement, every call but the first must await that placement, not
    # start one of its own (and meet the share's 429).
    settings.SIGIL_AGENT_PLACEMENTS_IN_FLIGHT = 1
    for name in ("a", "b", "c", "d"):  # three slots: `a` is paged out
        deploy_answering(alice, name, name, type="normal")
    wait_for(lambda: Capability.objects.get(full_name="alice--a").state == "paged_out", message="a paged out")
    results = answers_together([call_request(alice, "/alice/a") for _ in range(20)])
    assert [(status, body) for status, _, body in results] == [(200, b"a")] * 20


def test_a_stale_token_storm_from_an_address_does_not_lock_out_a_valid_token(alice, settings):
    from agents import tokens
    from agents.models import Token

    settings.SIGIL_AUTH_FAILURE_LIMIT = 5
    deploy_answering(alice, "ping", "pong")
    token, stale = agent_services.token_issue(
        agent=Agent.objects.get(name="alice"), scope="invoke", label="stale", actor="owner:test"
    )
    agent_services.token_revoke(token=Token.objects.get(pk=token.pk), actor="owner:test")
    refused = [alice.call("/alice/ping", token=stale).status_code for _ in range(20)]
    assert refused == [401] * 5 + [429] * 15  # the brake stops the failing token
    # A token that authenticates, from the same address (loopback), is served all the same.
    assert alice.call("/alice/ping").text == "pong"
    assert alice.call("/_api/capabilities").status_code == 200
    assert alice.call("/alice/ping", token=stale).status_code == 429
    assert tokens.hash_secret(stale) == token.secret_hash


def test_request_bodies_in_flight_are_bounded_per_agent(alice, bob, settings):
    settings.SIGIL_AGENT_BODY_BYTES_IN_FLIGHT = 3 * 1024 * 1024
    slow_reader = """export default { async fetch(request) {
      await new Promise(r => setTimeout(r, 1500));
      return new Response(String((await request.arrayBuffer()).byteLength));
    } }"""
    alice.deploy(name="big", code=slow_reader)
    bob.deploy(name="big", code=slow_reader)
    body = b"b" * (2 * 1024 * 1024)

    def post(agent):
        return agent.call(f"/{agent.name}/big", method="POST", data=body)

    with ThreadPoolExecutor(max_workers=4) as pool:
        alices = [pool.submit(post, alice) for _ in range(3)]
        time.sleep(0.3)  # alice's bodies on their way
        bobs = pool.submit(post, bob)
        statuses = sorted(future.result().status_code for future in alices)
        # Past the bound, alice's bodies wait their turn (429); bob's are his own.
        assert statuses == [200, 429, 429]
        assert (bobs.result().status_code, bobs.result().text) == (200, str(len(body)))


def test_a_large_upload_reaches_the_capability_as_it_arrives(alice):
    alice.deploy(name="first", code=FIRST_BYTES)
    host, port = alice.base_url.removeprefix("http://").split(":")
    size = 50 * 1024 * 1024
    with socket.create_connection((host, int(port)), timeout=30) as client:
        head = (
            f"POST /alice/first HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {alice.invoke_token}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {size}\r\n\r\n"
        )
        client.sendall(head.encode() + b"x" * 65536)
        # The answer comes while 49.9 MB of the body have not been sent: nothing waited for them.
        answer = b""
        while b"first " not in answer and (chunk := client.recv(65536)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b"first " in answer


def test_a_50_mb_upload_streams_through_whole(alice):
    alice.deploy(name="count", code=COUNTS_BODY)
    size = 50 * 1024 * 1024

    def body():
        for _ in range(size // (1024 * 1024)):
            yield b"y" * (1024 * 1024)

    response = alice.call("/alice/count", method="POST", data=body())  # chunked: no length given
    assert (response.status_code, response.text) == (200, str(size))
    known = alice.call("/alice/count", method="POST", data=b"z" * size)
    assert (known.status_code, known.text) == (200, str(size))


@pytest.mark.parametrize("runtime", ["local", "worker_pool", "platform", "loader"])
def test_a_websocket_session_passes_through_sigil(runtime, request, alice, bob):
    if runtime != "local":
        request.getfixturevalue(runtime)
    assert alice.deploy(name="ws", code=ECHO_SOCKET).status_code == 201
    url = alice.base_url.replace("http://", "ws://") + "/alice/ws"
    with connect(url, additional_headers={"Authorization": f"Bearer {alice.invoke_token}"}, proxy=None) as session:
        assert session.response.headers["X-Sigil-Capability"] == "alice--ws"
        session.send("hello")
        assert session.recv(timeout=10) == "hello"
        session.send(b"\x00\x01binary")
        assert session.recv(timeout=10) == b"\x00\x01binary"
    # One call, with its duration, in the capability's stats.
    wait_for(lambda: get_redis().hget(redis_keys.stats("alice--ws"), "calls") == b"1", message="the session counted")

    with pytest.raises(InvalidStatus) as refused:  # the token rules hold for a session
        connect(url, proxy=None).close()
    assert refused.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as hidden:  # and so does visibility
        connect(url, additional_headers={"Authorization": f"Bearer {bob.invoke_token}"}, proxy=None).close()
    assert hidden.value.response.status_code == 404
    plain = alice.call("/alice/ws")
    assert plain.status_code == 426  # no upgrade asked for: the capability says so itself


def test_a_websocket_session_ends_at_its_maximum_length(alice, settings):
    settings.SIGIL_WEBSOCKET_MAX_SECONDS = 1
    alice.deploy(name="ws", code=ECHO_SOCKET)
    url = alice.base_url.replace("http://", "ws://") + "/alice/ws"
    with connect(url, additional_headers={"Authorization": f"Bearer {alice.invoke_token}"}, proxy=None) as session:
        session.send("still here")
        assert session.recv(timeout=10) == "still here"
        with pytest.raises(Exception):  # noqa: B017, PT011  (closed by Sigil, going away)
            session.recv(timeout=10)
        assert session.close_code == 1001


def test_never_ending_async_calls_end_and_hold_no_other_agents_calls(alice, bob, settings, celery_worker):
    from capabilities.tasks import capability_flush_stats as capability_flush_stats_task

    settings.SIGIL_ASYNC_CALL_MAX_SECONDS = 4
    settings.SIGIL_ASYNC_RUNNERS_PER_AGENT = 2
    alice.deploy(name="forever", code=SLOW % 60000)
    deploy_answering(bob, "ping", "pong")
    prefer = {"Prefer": "respond-async"}
    stuck = [alice.call("/alice/forever", headers=prefer).json()["status_url"] for _ in range(4)]
    quick = [bob.call("/bob/ping", headers=prefer).json()["status_url"] for _ in range(3)]

    def result(agent, url):
        response = agent.call(url)
        return [response] if response.status_code != 202 else None  # a list: a 5xx Response is false

    for url in quick:
        (answer,) = wait_for(lambda url=url: result(bob, url), timeout=30, message="bob's async result")
        assert answer.text == "pong"
    flushed = capability_flush_stats_task.delay()
    flushed.get(timeout=30)  # housekeeping runs while alice's calls hold their runners
    assert [alice.call(url).json()["status"] for url in stuck] != ["done"] * 4  # still under way
    for url in stuck:
        (answer,) = wait_for(lambda url=url: result(alice, url), timeout=60, message="alice's call to end")
        assert answer.status_code == 504 and answer.json()["error"]["code"] == "timeout"
        assert "the longest an asynchronous call runs" in answer.json()["error"]["message"]
    assert not get_redis().zcard(redis_keys.async_pending("alice"))


def test_an_async_call_gives_the_capability_the_request_id_of_its_202(alice, celery_worker):
    from testsupport.capability_code import ECHO

    alice.deploy(name="echo", code=ECHO)
    accepted = alice.call("/alice/echo", headers={"Prefer": "respond-async"})
    request_id = accepted.headers["X-Request-Id"]
    body = accepted.json()
    assert body["callback"] == body["status_url"] and body["eta_seconds"] >= 0
    (answer,) = wait_for(
        lambda: (r := alice.call(body["status_url"])).status_code != 202 and [r], message="the async call's result"
    )
    assert answer.json()["headers"]["x-request-id"] == request_id
    assert answer.headers["X-Request-Id"] != ""


ENDLESS = """export default { async fetch() {
  const chunk = new Uint8Array(64 * 1024).fill(120);
  return new Response(new ReadableStream({ pull(controller) { controller.enqueue(chunk); } }));
} }"""


def test_callers_that_never_read_an_endless_answer_leave_sigils_memory_flat(sigil, alice):
    # Without backpressure the web process would buffer what workerd writes, at hundreds of MB a
    # second; with it, each call holds at most a few buffers (the server runs in this process).
    alice.deploy(name="endless", code=ENDLESS)
    with alice.call("/alice/endless", stream=True) as answer:
        assert answer.status_code == 200 and len(answer.raw.read(1 << 20)) == 1 << 20
    request = f"GET /alice/endless HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {alice.invoke_token}\r\n\r\n"
    port = int(alice.base_url.rsplit(":", 1)[1])
    idle = []
    for _ in range(4):
        caller = socket.create_connection(("127.0.0.1", port))
        caller.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        caller.sendall(request.encode())
        idle.append(caller)  # never read from
    try:
        wait_for(lambda: in_flight(sigil, "alice") == 4, message="the four calls in flight")
        baseline = resident_mb(os.getpid())
        growth = 0.0
        watched_until = time.monotonic() + 3
        while time.monotonic() < watched_until:
            growth = max(growth, resident_mb(os.getpid()) - baseline)
            time.sleep(0.1)
        assert growth < 64, f"the web process grew by {growth:.0f} MB for callers that read nothing"
    finally:
        for caller in idle:
            caller.close()
    # A caller that leaves ends its call.
    wait_for(lambda: in_flight(sigil, "alice") == 0, message="the calls to end once their callers left")


def test_a_capabilitys_slow_answer_reaches_the_caller_as_it_is_written(alice):
    dribble = """export default { async fetch() {
      const { readable, writable } = new TransformStream();
      const writer = writable.getWriter();
      (async () => {
        await writer.write(new TextEncoder().encode('first|'));
        await new Promise(r => setTimeout(r, 1500));
        await writer.write(new TextEncoder().encode('second'));
        await writer.close();
      })();
      return new Response(readable);
    } }"""
    alice.deploy(name="dribble", code=dribble)
    with requests.get(
        f"{alice.base_url}/alice/dribble", headers=alice.headers(alice.invoke_token), stream=True, timeout=30
    ) as response:
        chunks = response.iter_content(chunk_size=None)
        first = next(chunks)
        got_first = time.monotonic()
        rest = b"".join(chunks)
        got_rest = time.monotonic()
    assert first == b"first|" and rest == b"second"
    assert got_rest - got_first > 0.5  # the first part came before the capability wrote the second
