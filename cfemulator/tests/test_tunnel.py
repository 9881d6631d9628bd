"""WebSocket upgrades pass through the emulator as through Cloudflare: the script gets the
upgrade, its 101 comes back, and the emulator relays bytes both ways until a side hangs up.
Over real sockets, with real workerd; the runtimes' own sessions are in the runtime contract."""

from __future__ import annotations

import base64
import os
import socket
import struct
import threading
import time

import pytest
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.sync.client import connect

from cfemulator.tests.test_api import Api, kv_binding
from cfemulator.tests.test_limits import stopped_within
from testsupport.processes import wait_until

# Greets first, then echoes; "spin" never returns.
GREETER = """export default { async fetch(request) {
  if (request.headers.get("upgrade") !== "websocket") return new Response("plain " + request.method);
  const [client, server] = Object.values(new WebSocketPair());
  server.accept();
  server.send("welcome");
  server.addEventListener("message", (event) => {
    if (event.data === "spin") { while (true) {} }
    server.send(event.data);
  });
  server.addEventListener("close", (event) => server.close(event.code, event.reason));
  return new Response(null, { status: 101, webSocket: client });
} }"""
LIMIT_MS = 40


@pytest.fixture
def greeter(cf_emulator_fresh):
    api = Api(cf_emulator_fresh)
    assert api.upload("greeter", GREETER, metadata={"limits": {"cpu_ms": LIMIT_MS}}).status_code == 200
    api.enable("greeter")
    return cf_emulator_fresh.workers_dev_host("greeter")


def _session(emulator, host: str, **kwargs):
    sock = socket.create_connection(("127.0.0.1", int(emulator.url.rsplit(":", 1)[1])), timeout=10)
    return connect(f"ws://{host}/", sock=sock, open_timeout=15, close_timeout=10, **kwargs)


def _relays() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ws-to-")]


def _masked_text_frame(text: str) -> bytes:
    payload = text.encode()
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return struct.pack("!BB", 0x81, 0x80 | len(payload)) + mask + masked


def _read_frame(reader) -> bytes:
    first, second = reader.read(2)
    assert first == 0x81 and not second & 0x80  # a text frame, unmasked from the server
    return reader.read(second & 0x7F)


def test_bytes_sent_right_after_either_head_are_relayed(cf_emulator_fresh, greeter):
    # The caller's first frame comes in the same write as its handshake, and the script's
    # greeting right behind its 101: neither may be lost in a buffer of the emulator's.
    port = int(cf_emulator_fresh.url.rsplit(":", 1)[1])
    key = base64.b64encode(os.urandom(16)).decode()
    head = (
        f"GET / HTTP/1.1\r\nHost: {greeter}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + _masked_text_frame("early"))
        reader = sock.makefile("rb")
        assert reader.readline().startswith(b"HTTP/1.1 101 ")
        fields = {}
        while (line := reader.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            fields[name.lower()] = value.strip()
        assert fields["upgrade"].lower() == "websocket"
        assert fields["connection"].lower() == "upgrade"
        assert fields["sec-websocket-accept"]
        assert "content-length" not in fields and "transfer-encoding" not in fields
        assert [_read_frame(reader), _read_frame(reader)] == [b"welcome", b"early"]
        reader.close()


def test_the_relay_ends_when_the_caller_hangs_up_with_or_without_a_goodbye(cf_emulator_fresh, greeter):
    with _session(cf_emulator_fresh, greeter) as ws:
        assert ws.recv(timeout=10) == "welcome"
        assert _relays()
    wait_until(lambda: not _relays(), timeout=10, what="the relay of a session closed properly to end")

    with _session(cf_emulator_fresh, greeter) as ws:
        assert ws.recv(timeout=10) == "welcome"
        ws.socket.shutdown(socket.SHUT_RDWR)  # gone without a closing handshake
        wait_until(lambda: not _relays(), timeout=10, what="the relay of an abandoned session to end")
    # The script serves on, plain calls and sessions alike.
    assert cf_emulator_fresh.worker_request(greeter).text == "plain GET"
    with _session(cf_emulator_fresh, greeter) as ws:
        assert ws.recv(timeout=10) == "welcome"


def test_a_session_whose_script_runs_past_its_cpu_limit_is_cut_and_the_script_serves_again(cf_emulator_fresh, greeter):
    with _session(cf_emulator_fresh, greeter) as ws:
        assert ws.recv(timeout=10) == "welcome"
        started = time.monotonic()
        ws.send("spin")
        with pytest.raises(ConnectionClosedError):
            ws.recv(timeout=30)
        assert time.monotonic() - started < stopped_within(LIMIT_MS)
    wait_until(lambda: not _relays(), timeout=10, what="the relay of the cut session to end")
    with _session(cf_emulator_fresh, greeter) as ws:
        assert ws.recv(timeout=10) == "welcome"


def test_an_upgrade_of_a_post_or_with_a_body_is_a_plain_call(cf_emulator_fresh, greeter):
    upgrade = {"Upgrade": "websocket", "Connection": "Upgrade"}
    posted = cf_emulator_fresh.worker_request(greeter, method="POST", headers=upgrade, data=b"x")
    assert (posted.status_code, posted.text) == (200, "plain POST")


def test_an_upgrade_to_a_host_without_a_worker_is_a_plain_404(cf_emulator_fresh):
    with pytest.raises(InvalidStatus) as refused:
        _session(cf_emulator_fresh, cf_emulator_fresh.workers_dev_host("nobody"))
    assert refused.value.response.status_code == 404


# Greets with its version, then echoes; with a KV binding it runs from a config of its own.
VERSIONED = """export default { async fetch(request, env) {
  if (request.headers.get("upgrade") !== "websocket") return new Response("plain %s");
  const [client, server] = Object.values(new WebSocketPair());
  server.accept();
  server.send("welcome %s");
  server.addEventListener("message", (event) => server.send(event.data));
  server.addEventListener("close", (event) => server.close(event.code, event.reason));
  return new Response(null, { status: 101, webSocket: client });
} }"""


def test_a_session_outlasts_a_new_version_and_the_old_process_stops_once_it_ends(cf_emulator_fresh):
    api = Api(cf_emulator_fresh)
    bound = {"bindings": [kv_binding(api.kv_namespace())]}
    assert api.upload("versioned", VERSIONED % ("v1", "v1"), metadata=bound).status_code == 200
    api.enable("versioned")
    host = cf_emulator_fresh.workers_dev_host("versioned")
    with _session(cf_emulator_fresh, host) as ws:
        assert ws.recv(timeout=10) == "welcome v1"
        assert api.upload("versioned", VERSIONED % ("v2", "v2"), metadata=bound).status_code == 200
        # New calls reach the new version; the session goes on with the old one.
        assert cf_emulator_fresh.worker_request(host).text == "plain v2"
        ws.send("still there")
        assert ws.recv(timeout=10) == "still there"
        old, new = sorted(cf_emulator_fresh.processes(":versioned"), key=lambda p: p["generation"])
        assert (old["replaced"], old["calls"], new["replaced"]) == (True, 1, False)
    wait_until(
        lambda: [p["name"] for p in cf_emulator_fresh.processes(":versioned")] == [new["name"]],
        timeout=10,
        what="the old version's process to stop once its session ended",
    )
    with _session(cf_emulator_fresh, host) as ws:
        assert ws.recv(timeout=10) == "welcome v2"
