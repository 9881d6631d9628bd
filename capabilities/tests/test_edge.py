"""Calls served at the edge: Sigil's own Worker on each Cloudflare runtime (the emulator's
workerd running it), its state in Workers KV as Sigil's publisher writes it (one run of the
publisher, as beat runs it), Sigil's server as the origin for the rest, a Celery worker placing
deploys. Whether a call crossed the origin is read from the origin's access log."""

from __future__ import annotations

import zlib

import pytest
import requests

from agents import tokens
from agents.models import Token
from capabilities import services, tasks
from capabilities.books import routes
from capabilities.models import Capability
from capabilities.runtimes import get_runtime
from testsupport.capability_code import COUNTS_BODY, ECHO, PONG, STREAMS, answering
from testsupport.cast import wait_for
from testsupport.inflight import SERVER_REQUESTS

RUNTIMES = ["platform", "loader", "worker-pool"]


@pytest.fixture(params=RUNTIMES)
def edge(request, settings, sigil):
    """Sigil on one Cloudflare runtime with the edge on, its origin the test server. What a KV
    location read is not kept (Cloudflare keeps a value, or a miss, up to a minute where it was
    read, which these tests would only wait out). Taken before `alice`, so that her tokens are
    marked for the publisher as they are issued. Returns the emulator's control."""
    settings.SIGIL_EDGE = True
    settings.SIGIL_ORIGIN_URL = sigil.url
    fixture = {"platform": "platform", "loader": "loader", "worker-pool": "worker_pool"}[request.param]
    emulator = request.getfixturevalue(fixture)
    emulator.configure(kv_miss_cache_seconds=0, kv_propagation_seconds=0)
    return emulator


def edge_url(emulator, path: str) -> str:
    """`path` on the edge, as deploy hands it to agents (the emulator's workers.dev door)."""
    runtime = get_runtime()
    worker = {"platform": "sigil-dispatcher", "loader": "sigil-loader", "worker-pool": "sigil-edge"}[runtime.name]
    return f"{emulator.url}/{worker}.{emulator.subdomain}.workers.dev{path}"


def publish() -> None:
    """One run of the publisher, as beat runs it: what changed reaches the edge's KV."""
    tasks.edge_publish()


def crossed_origin(access_log, answer) -> bool:
    """Whether the origin served `answer`: its access log names the answer's request id, once
    the origin is done with every request it took (it logs a call after its last byte), in a
    line of its own rather than of the edge's report (`at_edge`)."""
    for server in SERVER_REQUESTS:
        assert server.wait_idle(timeout=10)
    request_id = answer.headers.get("X-Request-Id")
    return any(line["request_id"] == request_id and not line["at_edge"] for line in access_log())


def at_edge(access_log, call, *, until=lambda answer: True, what: str):
    """The first answer of `call()` the edge gave itself and `until` accepts, once what was
    published has reached it (its in-isolate memory of KV lasts a second)."""

    def served():
        answer = call()
        # In a list: a Response of an error status is false.
        return [answer] if not crossed_origin(access_log, answer) and until(answer) else None

    return wait_for(served, timeout=15, interval=0.2, message=what)[0]


def test_a_capability_is_called_through_the_origin_at_once_then_at_the_edge_once_published(edge, alice, access_log):
    deployed = alice.deploy(name="ping", code=PONG)
    assert deployed.status_code == 201, deployed.text
    url = edge_url(edge, "/alice/ping")
    assert deployed.json()["url"] == url  # what agents are handed: the edge
    assert alice.call("/alice/ping").text == "pong"  # the origin's URL keeps working

    first = requests.get(url, headers=alice.headers(alice.invoke_token), timeout=30)
    assert (first.status_code, first.text) == (200, "pong")
    assert crossed_origin(access_log, first)  # nothing published yet
    [line] = [line for line in access_log() if line["request_id"] == first.headers["X-Request-Id"]]
    assert line["edge"] is True  # handed on by the edge, with its mark

    publish()
    served = at_edge(
        access_log,
        lambda: requests.get(url, headers=alice.headers(alice.invoke_token), timeout=30),
        what="the edge to serve alice--ping",
    )
    assert (served.status_code, served.text) == (200, "pong")
    assert served.headers["X-Sigil-Capability"] == "alice--ping"
    assert served.headers["X-Sigil-Version"] == "1"
    assert served.headers["Server-Timing"].startswith("sigil;dur=")
    assert len(served.headers["X-Request-Id"]) == 16
    assert not any(
        name.lower().startswith("x-sigil-") and name.lower() not in ("x-sigil-capability", "x-sigil-version")
        for name in served.headers
    )


def test_a_revoked_token_and_a_forced_breaker_are_refused_at_the_edge(edge, alice, access_log):
    alice.deploy(name="ping", code=PONG)
    url = edge_url(edge, "/alice/ping")
    publish()
    at_edge(
        access_log,
        lambda: requests.get(url, headers=alice.headers(alice.invoke_token), timeout=30),
        what="the edge to serve alice--ping",
    )

    services.capability_force_degraded(capability=Capability.objects.get(full_name="alice--ping"), actor="owner:test")
    publish()
    degraded = at_edge(
        access_log,
        lambda: requests.get(url, headers=alice.headers(alice.invoke_token), timeout=30),
        until=lambda answer: answer.status_code == 503,
        what="the edge to refuse the degraded alice--ping",
    )
    assert degraded.json() == {
        "error": {"code": "degraded", "message": "alice--ping was made degraded by Sigil's owner"}
    }
    assert degraded.headers["Retry-After"] == "30"

    from agents import services as agent_services

    token = Token.objects.get(secret_hash=tokens.hash_secret(alice.invoke_token))
    agent_services.token_revoke(token=token, actor="owner:test")
    publish()
    refused = at_edge(
        access_log,
        lambda: requests.get(url, headers=alice.headers(alice.invoke_token), timeout=30),
        until=lambda answer: answer.status_code == 401,
        what="the edge to refuse the revoked token",
    )
    assert refused.json()["error"] == {
        "code": "unauthenticated",
        "message": "the token is unknown, revoked or expired: ask the owner for a new one",
    }
    assert refused.headers["WWW-Authenticate"] == 'Bearer realm="sigil"'


def test_a_cold_capability_and_an_asynchronous_call_are_answered_by_the_origin(edge, alice, access_log):
    alice.deploy(name="ping", code=PONG)
    url = edge_url(edge, "/alice/ping")
    services.capability_evict(full="alice--ping", actor="owner:test")
    publish()  # paged out: only the origin pages it in

    cold = requests.get(url, headers=alice.headers(alice.invoke_token), timeout=60)
    assert (cold.status_code, cold.text) == (200, "pong")
    assert cold.headers["X-Sigil-Cold-Start"] == "1"
    assert crossed_origin(access_log, cold)

    publish()  # live again
    at_edge(
        access_log,
        lambda: requests.get(url, headers=alice.headers(alice.invoke_token), timeout=30),
        what="the edge to serve alice--ping",
    )
    later = requests.post(
        url, headers={**alice.headers(alice.invoke_token), "Prefer": "respond-async"}, data=b"{}", timeout=30
    )
    assert later.status_code == 202, later.text
    assert crossed_origin(access_log, later)


def test_what_the_caller_sent_reaches_the_capability_as_through_the_origin(edge, alice, access_log):
    alice.deploy(name="echo", code=ECHO)
    publish()
    path = "/alice/echo/deep/path%20x?q=1&r=two"
    headers = {**alice.headers(alice.invoke_token), "X-Sigil-Forged": "1", "X-Custom": "kept"}

    def sent(base: str) -> requests.Response:
        return requests.put(base + path, headers=headers, data=b"payload-bytes", timeout=30)

    through_origin = sent(alice.base_url)
    at_edge_answer = at_edge(access_log, lambda: sent(edge_url(edge, "")), what="the edge to serve alice--echo")
    origin_seen, edge_seen = through_origin.json(), at_edge_answer.json()
    for seen in (origin_seen, edge_seen):
        assert seen["method"] == "PUT"
        assert seen["body"] == "payload-bytes"
        assert seen["headers"]["x-custom"] == "kept"
        assert "authorization" not in seen["headers"]
        assert not any(name.startswith("x-sigil-") for name in seen["headers"])
        assert len(seen["headers"]["x-request-id"]) == 16
    assert edge_seen["path"] == origin_seen["path"]
    assert edge_seen["query"] == origin_seen["query"]


def test_the_edge_answers_sigils_refusals_in_the_contracts_words(edge, alice, bob, access_log):
    alice.deploy(name="private", code=PONG)
    publish()
    base = edge_url(edge, "")

    def answer(path: str, **headers):
        return lambda: requests.get(base + path, headers=headers, timeout=30)

    bad_name = at_edge(access_log, answer("/alice/Bad_Name"), what="the edge to refuse a bad name")
    assert (bad_name.status_code, bad_name.json()["error"]) == (
        404,
        {"code": "not_found", "message": "no capability at /alice/Bad_Name"},
    )
    unsigned = at_edge(access_log, answer("/alice/private"), what="the edge to ask for a token")
    assert unsigned.status_code == 401 and unsigned.json()["error"]["message"] == "send Authorization: Bearer <token>"
    hidden = at_edge(
        access_log,
        answer("/alice/private", Authorization=f"Bearer {bob.invoke_token}"),
        until=lambda answer: answer.status_code == 404,
        what="the edge to hide alice's private capability from bob",
    )
    assert hidden.json()["error"] == {"code": "not_found", "message": "no capability alice--private"}
    # The origin says the same, word for word.
    for path, headers in (("/alice/Bad_Name", {}), ("/alice/private", {})):
        assert (
            requests.get(alice.base_url + path, headers=headers, timeout=30).json()
            == requests.get(base + path, headers=headers, timeout=30).json()
        )


def test_a_split_sends_the_callers_the_engine_would_to_the_staged_version(edge, alice, access_log):
    alice.deploy(name="ping", code=answering("one"))
    staged = alice.deploy(name="ping", code=answering("two"), stage=True)
    assert staged.status_code in (200, 201), staged.text
    split = alice.session.put(
        f"{alice.base_url}/_api/capabilities/alice--ping/split",
        json={"weight": 50, "caller_header": "X-User"},
        headers=alice.headers(alice.deploy_token),
        timeout=60,
    )
    assert split.status_code == 200, split.text
    variant = routes.variant_name(Capability.objects.get(full_name="alice--ping"))
    publish()
    url = edge_url(edge, "/alice/ping")
    at_edge(
        access_log,
        lambda: requests.get(url, headers=alice.headers(alice.invoke_token), timeout=30),
        what="the edge to serve alice--ping",
    )
    callers = [f"user-{n}" for n in range(12)]
    for caller in callers:
        answer = requests.get(url, headers={**alice.headers(alice.invoke_token), "X-User": caller}, timeout=30)
        assert not crossed_origin(access_log, answer)
        expected = "two" if zlib.crc32(f"{variant}|{caller}".encode()) % 100 < 50 else "one"
        assert answer.text == expected, caller
        assert answer.headers["X-Sigil-Capability"] == "alice--ping"


THROWS = "export default { async fetch() { throw new Error('kaput at the edge\\nsecond line') } }"
ECHO_SOCKET = """export default { async fetch(request) {
  if (request.headers.get('upgrade') !== 'websocket') return new Response('send an upgrade', { status: 426 });
  const [client, server] = Object.values(new WebSocketPair());
  server.accept();
  server.addEventListener('message', (event) => server.send(event.data));
  return new Response(null, { status: 101, webSocket: client });
} }"""


def served_at_edge(edge, agent, access_log, full: str, *, method: str = "GET", data: bytes | None = None):
    """Publish what changed, and wait until the edge serves `full`."""
    publish()
    agent_name, name = full.split("--")
    url = edge_url(edge, f"/{agent_name}/{name}")
    headers = agent.headers(agent.invoke_token)
    at_edge(
        access_log,
        lambda: requests.request(method, url, headers=headers, data=data, timeout=30),
        what=f"the edge to serve {full}",
    )
    return url


def test_bodies_over_the_limit_are_refused_at_the_edge_and_the_rest_pass_whole(edge, alice, access_log, settings):
    settings.SIGIL_INVOKE_MAX_BODY_BYTES = 16  # the edge is uploaded with it
    alice.deploy(name="count", code=COUNTS_BODY)
    url = served_at_edge(edge, alice, access_log, "alice--count", method="POST", data=b"1")
    auth = alice.headers(alice.invoke_token)

    fits = requests.post(url, headers=auth, data=b"x" * 16, timeout=30)
    assert (fits.status_code, fits.text) == (200, "16") and not crossed_origin(access_log, fits)
    over = requests.post(url, headers=auth, data=b"x" * 17, timeout=30)
    assert over.status_code == 413 and not crossed_origin(access_log, over)
    assert over.json()["error"] == {"code": "too_large", "message": "the request body is over 16 bytes"}
    chunked = requests.post(url, headers=auth, data=iter([b"x" * 10, b"y" * 10]), timeout=30)  # no length
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "too_large"
    small_chunks = requests.post(url, headers=auth, data=iter([b"x" * 5, b"y" * 5]), timeout=30)
    assert (small_chunks.status_code, small_chunks.text) == (200, "10")


def test_head_an_encoded_path_and_a_thrown_exception_are_answered_at_the_edge_as_by_the_origin(edge, alice, access_log):
    alice.deploy(name="ping", code=PONG)
    alice.deploy(name="boom", code=THROWS)
    url = served_at_edge(edge, alice, access_log, "alice--ping")
    publish()
    auth = alice.headers(alice.invoke_token)

    head = requests.head(url, headers=auth, timeout=30)
    assert (head.status_code, head.content) == (200, b"")
    encoded = requests.get(edge_url(edge, "/%61lice/p%69ng"), headers=auth, timeout=30)
    assert (encoded.status_code, encoded.text) == (200, "pong") and not crossed_origin(access_log, encoded)

    thrown = at_edge(
        access_log,
        lambda: requests.get(edge_url(edge, "/alice/boom"), headers=auth, timeout=30),
        until=lambda answer: answer.status_code == 502,
        what="the edge to answer alice--boom's exception",
    )
    origin = alice.call("/alice/boom")
    assert (
        thrown.json()
        == origin.json()
        == {"error": {"code": "capability_error", "message": "alice--boom threw: Error: kaput at the edge"}}
    )


def test_an_answer_streams_through_the_edge_as_it_is_written(edge, alice, access_log):
    import time

    alice.deploy(name="streams", code=STREAMS)
    url = served_at_edge(edge, alice, access_log, "alice--streams")
    started = time.monotonic()
    response = requests.get(url, headers=alice.headers(alice.invoke_token), stream=True, timeout=30)
    first = response.raw.read(len(b"first;"))
    first_at = time.monotonic() - started
    assert (first, response.raw.read()) == (b"first;", b"second")
    assert first_at < 1.0  # the first chunk arrived before the capability wrote its second
    assert not crossed_origin(access_log, response)


def test_a_websocket_session_passes_through_the_edge(edge, alice, access_log):
    from websockets.sync.client import connect

    alice.deploy(name="ws", code=ECHO_SOCKET)
    url = served_at_edge(edge, alice, access_log, "alice--ws").replace("http://", "ws://")  # its 426 is served
    headers = alice.headers(alice.invoke_token)
    with connect(url, additional_headers=headers, proxy=None) as session:
        assert session.response.headers["X-Sigil-Capability"] == "alice--ws"
        assert not crossed_origin(access_log, session.response)
        session.send("hello")
        assert session.recv(timeout=10) == "hello"
        session.send(b"\x00\x01binary")
        assert session.recv(timeout=10) == b"\x00\x01binary"


def test_a_call_the_edge_cannot_hand_to_its_origin_is_503_unavailable(platform, settings, sigil, alice):
    from sigil.ports import free_port

    settings.SIGIL_EDGE = True
    settings.SIGIL_ORIGIN_URL = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    answer = requests.get(edge_url(platform, "/alice/ping"), headers=alice.headers(alice.invoke_token), timeout=30)
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "5"
    assert answer.json()["error"] == {
        "code": "unavailable",
        "message": "Sigil's server could not be reached; try again shortly",
    }
