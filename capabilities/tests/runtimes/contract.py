"""What every Runtime guarantees. Subclasses provide a `runtime` fixture; each test places
real code and sends a real request to it."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest
import urllib3
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from capabilities.runtimes.base import CodeBundle, Route
from capabilities.runtimes.errors import RuntimeRejected

HELLO = "export default { async fetch(request) { return new Response('hello ' + new URL(request.url).pathname) } }"
SECOND = "export default { async fetch() { return new Response('second version') } }"
# Code that does not start: Cloudflare refuses it at upload, the loader host at its start check.
UNFINISHED = "export default { async fetch() { return new Response('hi') "
THROWS_AT_START = "throw new Error('no config at start'); export default { async fetch() { return new Response('x') } }"
# Code that starts but is no capability: nothing could ever answer a call to it.
NO_FETCH = "export default { async scheduled() {} }"
NOT_A_MODULE_WITH_DEFAULT = "0"
ECHO_HEADERS = """export default { async fetch(request) {
  return Response.json(Object.fromEntries(request.headers));
} }"""

# A WebSocket session: each message comes back as it was sent; "close please" has the code end
# the session with 4000, and a close from the caller is answered with the caller's own code.
# It takes the first subprotocol offered, and says what path it was called on.
WEBSOCKET_ECHO = """export default { async fetch(request) {
  if (request.headers.get("upgrade") !== "websocket") return new Response("expected a WebSocket", { status: 426 });
  const [client, server] = Object.values(new WebSocketPair());
  let closing = false;
  server.accept();
  server.addEventListener("message", (event) => {
    if (event.data === "close please") {
      closing = true;
      server.close(4000, "as asked");
    } else {
      server.send(event.data);
    }
  });
  server.addEventListener("close", (event) => { if (!closing) server.close(event.code, event.reason); });
  const url = new URL(request.url);
  const headers = { "x-seen": url.pathname + url.search };
  const offered = request.headers.get("sec-websocket-protocol");
  if (offered) headers["sec-websocket-protocol"] = offered.split(",")[0].trim();
  return new Response(null, { status: 101, webSocket: client, headers });
} }"""

_http = urllib3.PoolManager(retries=False, timeout=10)


def call(route: Route, path: str = "/", method: str = "GET", headers: dict | None = None):
    all_headers = dict(route.headers)
    if route.host_header:
        all_headers["Host"] = route.host_header
    all_headers.update(headers or {})
    return _http.request(method, route.base_url + path, headers=all_headers)


def open_websocket(route: Route, path: str = "/", headers: dict | None = None, **options) -> ClientConnection:
    """A WebSocket session with the code behind `route`, as the gateway opens one: to the
    route's base URL with its headers, and its Host header when it has one."""
    base = urlsplit(route.base_url)
    sock = socket.create_connection((base.hostname, base.port or 80), timeout=10)
    # The handshake names the route's Host; the socket goes to the base URL.
    return connect(
        f"ws://{route.host_header or base.netloc}{path}",
        sock=sock,
        additional_headers=[*route.headers, *(headers or {}).items()],
        open_timeout=15,
        close_timeout=10,
        **options,
    )


@dataclass(frozen=True)
class _Answer:
    """An answer to an upgrade, as `Runtime.is_missing` reads one."""

    status: int
    headers: object


class RuntimeContract:
    def test_forward_reaches_placed_code(self, runtime):
        bundle = CodeBundle.from_code(HELLO)
        slot = runtime.slot_for("alice--hello")
        runtime.place(slot=slot, tenant="alice", bundle=bundle)
        response = call(runtime.route(slot=slot, tenant="alice", sha=bundle.sha), "/some/path")
        assert response.status == 200
        assert response.data == b"hello /some/path"

    def test_new_code_gets_a_fresh_isolate_and_old_id_keeps_nothing(self, runtime):
        slot = runtime.slot_for("alice--versioned")
        first, second = CodeBundle.from_code(HELLO), CodeBundle.from_code(SECOND)
        runtime.place(slot=slot, tenant="alice", bundle=first)
        assert call(runtime.route(slot=slot, tenant="alice", sha=first.sha)).data == b"hello /"
        runtime.place(slot=slot, tenant="alice", bundle=second)
        assert call(runtime.route(slot=slot, tenant="alice", sha=second.sha)).data == b"second version"

    def test_placing_the_same_code_twice_is_a_no_op(self, runtime):
        slot = runtime.slot_for("alice--twice")
        bundle = CodeBundle.from_code(HELLO)
        runtime.place(slot=slot, tenant="alice", bundle=bundle)
        runtime.place(slot=slot, tenant="alice", bundle=bundle)
        assert runtime.list_slots().count(slot) == 1
        assert call(runtime.route(slot=slot, tenant="alice", sha=bundle.sha)).status == 200

    def test_every_answer_is_of_the_version_its_route_or_its_header_names_through_a_redeploy(self, runtime):
        """The gateway takes the version from SERVED_VERSION_HEADER when the answer carries it,
        else from the route: either way the version whose code answered, while a redeploy
        replaces the code of one slot under a route that may still be the previous one."""
        import threading

        from capabilities.runtimes.base import SERVED_VERSION_HEADER
        from testsupport.capability_code import answering

        slot = runtime.slot_for("alice--redeployed")
        first = CodeBundle.from_code(answering("one"), version=1)
        runtime.place(slot=slot, tenant="alice", bundle=first)
        routes = {1: runtime.route(slot=slot, tenant="alice", sha=first.sha)}
        answers, stop = [], threading.Event()

        def poll():
            while not stop.is_set():
                route_version = max(routes)  # the route a gateway holds: updated after the placement
                response = call(routes[route_version])
                if runtime.is_missing(response):
                    continue  # not the code's answer: the gateway finds the route again
                version = response.headers.get(SERVED_VERSION_HEADER) or str(route_version)
                answers.append((response.data.decode(), version))

        thread = threading.Thread(target=poll)
        thread.start()
        try:
            second = CodeBundle.from_code(answering("two"), version=2)
            runtime.place(slot=slot, tenant="alice", bundle=second)
            threading.Event().wait(0.2)  # the gateway's route is updated a moment later
            routes[2] = runtime.route(slot=slot, tenant="alice", sha=second.sha)
            updated = len(answers)
            while len(answers) < updated + 10:
                threading.Event().wait(0.01)
        finally:
            stop.set()
            thread.join()
        assert set(answers) <= {("one", "1"), ("two", "2")}, sorted(set(answers))
        assert answers[-1] == ("two", "2")

    def test_removed_slot_is_not_listed(self, runtime):
        slot = runtime.slot_for("alice--gone")
        runtime.place(slot=slot, tenant="alice", bundle=CodeBundle.from_code(HELLO))
        assert slot in runtime.list_slots()
        runtime.remove(slot=slot)
        assert slot not in runtime.list_slots()

    def test_removing_a_missing_slot_is_not_an_error(self, runtime):
        runtime.remove(slot=runtime.slot_for("alice--never-placed"))

    def test_internal_headers_do_not_reach_the_capability(self, runtime):
        slot = runtime.slot_for("alice--headers")
        bundle = CodeBundle.from_code(ECHO_HEADERS)
        runtime.place(slot=slot, tenant="alice", bundle=bundle)
        seen = call(runtime.route(slot=slot, tenant="alice", sha=bundle.sha), headers={"X-Custom": "kept"}).json()
        assert seen["x-custom"] == "kept"
        assert not [name for name in seen if name.startswith("x-sigil")]

    def test_a_websocket_session_echoes_text_and_binary_both_ways(self, runtime):
        slot = runtime.slot_for("alice--echo")
        bundle = CodeBundle.from_code(WEBSOCKET_ECHO)
        runtime.place(slot=slot, tenant="alice", bundle=bundle)
        route = runtime.route(slot=slot, tenant="alice", sha=bundle.sha)
        with open_websocket(route, "/room/1?who=alice", subprotocols=["sigil.echo", "other"]) as ws:
            assert ws.response.status_code == 101
            assert ws.response.headers["x-seen"] == "/room/1?who=alice"
            assert ws.subprotocol == "sigil.echo"  # the code's choice reached the caller
            ws.send("hello")
            assert ws.recv(timeout=10) == "hello"
            ws.send(b"\x00\x01\xff")
            assert ws.recv(timeout=10) == b"\x00\x01\xff"
            large = bytes(range(256)) * 2048  # 512 KiB, within Cloudflare's 1 MiB per message
            ws.send(large)
            assert ws.recv(timeout=10) == large
            for n in range(20):
                ws.send(f"message {n}")
            assert [ws.recv(timeout=10) for _ in range(20)] == [f"message {n}" for n in range(20)]
            ws.close(code=1000, reason="done")
        assert (ws.protocol.close_rcvd.code, ws.protocol.close_rcvd.reason) == (1000, "done")  # the code's answer

    def test_the_code_can_end_a_websocket_session(self, runtime):
        slot = runtime.slot_for("alice--echo-ends")
        bundle = CodeBundle.from_code(WEBSOCKET_ECHO)
        runtime.place(slot=slot, tenant="alice", bundle=bundle)
        with open_websocket(runtime.route(slot=slot, tenant="alice", sha=bundle.sha)) as ws:
            ws.send("close please")
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
        assert (ws.protocol.close_rcvd.code, ws.protocol.close_rcvd.reason) == (4000, "as asked")

    def test_an_upgrade_reaches_the_code_with_its_headers_and_without_sigils(self, runtime):
        slot = runtime.slot_for("alice--upgrade-headers")
        bundle = CodeBundle.from_code(ECHO_HEADERS)  # answers the upgrade with a plain 200
        runtime.place(slot=slot, tenant="alice", bundle=bundle)
        with pytest.raises(InvalidStatus) as refused:
            open_websocket(
                runtime.route(slot=slot, tenant="alice", sha=bundle.sha), headers={"Sec-WebSocket-Protocol": "chat"}
            )
        answer = refused.value.response
        assert answer.status_code == 200
        seen = json.loads(answer.body)
        assert seen["upgrade"] == "websocket"
        assert "upgrade" in seen["connection"].lower()
        assert seen["sec-websocket-version"] == "13"
        assert seen["sec-websocket-protocol"] == "chat"
        assert seen["sec-websocket-key"]
        assert not [name for name in seen if name.startswith("x-sigil")]

    def test_an_upgrade_to_code_that_is_not_there_is_a_miss(self, runtime):
        runtime.place(slot=runtime.slot_for("alice--present"), tenant="alice", bundle=CodeBundle.from_code(HELLO))
        with pytest.raises(InvalidStatus) as refused:
            open_websocket(runtime.route(slot=runtime.slot_for("alice--absent"), tenant="alice", sha="0" * 64))
        answer = refused.value.response
        assert runtime.is_missing(_Answer(answer.status_code, answer.headers))

    @pytest.mark.parametrize(
        ("code", "words"),
        [
            (UNFINISHED, "SyntaxError"),
            (THROWS_AT_START, "no config at start"),
            (NO_FETCH, "has no fetch handler"),
            (NOT_A_MODULE_WITH_DEFAULT, "default export"),
        ],
    )
    def test_code_that_does_not_start_is_refused_and_placed_nowhere(self, runtime, code, words):
        slot = runtime.slot_for("alice--broken")
        with pytest.raises(RuntimeRejected, match=words):
            runtime.place(slot=slot, tenant="alice", bundle=CodeBundle.from_code(code))
        assert slot not in runtime.list_slots()

    def test_check_passes_when_the_runtime_serves(self, runtime):
        runtime.check()


class ProvisionedRuntimeContract(RuntimeContract):
    """The contract for a runtime with an account Worker of its own (the loader's host, the
    platform's dispatcher)."""

    @pytest.fixture
    def runtime(self, runtime):
        """Deployed as `manage.py deployruntime` does, so that `check` finds its Worker."""
        runtime.provision()
        return runtime
