"""A Worker's own fetches leave the emulator as they leave Cloudflare: another Worker of the
account's workers.dev zone only with `global_fetch_strictly_public` (else error 1042), an
origin on this machine as a public origin; and a workers.dev URL is one curl calls as it is,
through the emulator's door."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from cfemulator.tests.test_api import Api, kv_binding

# Fetches the URL in the `to` query parameter and answers what came back. A KV binding makes it
# a bound script (a workerd config of its own), as every Worker of Sigil's that fetches is.
FETCHER = """export default { async fetch(request) {
  const to = new URL(request.url).searchParams.get("to");
  const answer = await fetch(to, { headers: { "x-asked-by": "fetcher" } });
  return new Response(`${answer.status} ${await answer.text()}`);
} }"""

# Answers where it was called and what it was sent.
ECHO = """export default { fetch(request) {
  const url = new URL(request.url);
  return Response.json({
    url: request.url, path: url.pathname + url.search,
    asked_by: request.headers.get("x-asked-by"), client: request.headers.get("cf-connecting-ip"),
    emulators: [...request.headers.keys()].filter((name) => name.startsWith("x-cfemulator")),
  });
} }"""


@pytest.fixture
def api(cf_emulator_fresh):
    return Api(cf_emulator_fresh)


def deploy(api, name: str, code: str, *, flags: list[str] = (), bound: bool = False) -> None:
    metadata: dict = {"compatibility_flags": list(flags)}
    if bound:
        metadata["bindings"] = [kv_binding(api.kv_namespace(f"kv-of-{name}"))]
    assert api.upload(name, code, metadata=metadata).status_code == 200
    assert api.enable(name).status_code == 200


@pytest.fixture
def origin():
    """A server on loopback standing for an origin (Sigil's own server): answers its path."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"origin saw {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_fetch_of_another_worker_on_the_zone_is_refused_without_the_strictly_public_flag(api, cf_emulator_fresh):
    deploy(api, "echo", ECHO)
    deploy(api, "fetcher", FETCHER, bound=True)
    target = f"https://{cf_emulator_fresh.workers_dev_host('echo')}/x"
    answer = cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host("fetcher"), "/", params={"to": target})
    assert answer.text == "404 error code: 1042"


def test_with_the_flag_a_fetch_of_another_worker_goes_through_the_front_door(api, cf_emulator_fresh):
    deploy(api, "echo", ECHO)
    deploy(api, "fetcher", FETCHER, flags=["global_fetch_strictly_public"], bound=True)
    target = f"https://{cf_emulator_fresh.workers_dev_host('echo')}/x?y=1"
    answer = cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host("fetcher"), "/", params={"to": target})
    status, _, body = answer.text.partition(" ")
    assert status == "200"
    seen = json.loads(body)
    # The emulator serves Workers over plain HTTP: the host and path are what Cloudflare shows.
    assert seen["url"] == target.replace("https://", "http://")
    assert seen["asked_by"] == "fetcher"
    assert seen["emulators"] == []  # the emulator's own marks never reach a Worker


def test_a_worker_reaches_an_origin_on_this_machine(api, cf_emulator_fresh, origin):
    deploy(api, "fetcher", FETCHER, bound=True)
    answer = cf_emulator_fresh.worker_request(
        cf_emulator_fresh.workers_dev_host("fetcher"), "/", params={"to": f"{origin}/agent/thing?q=1"}
    )
    assert answer.text == "200 origin saw /agent/thing?q=1"


def test_the_workers_dev_door_serves_a_worker_on_a_url_with_no_host_header(api, cf_emulator_fresh):
    deploy(api, "echo", ECHO)
    host = cf_emulator_fresh.workers_dev_host("echo")
    seen = requests.get(f"{cf_emulator_fresh.url}/{host}/deep/path?q=1", timeout=30).json()
    assert seen["url"] == f"http://{host}/deep/path?q=1"  # its own host, as on workers.dev
    assert seen["path"] == "/deep/path?q=1"
    assert seen["client"] == "127.0.0.1"  # CF-Connecting-IP: who called the front door
    # A caller cannot pose as another address.
    forged = requests.get(f"{cf_emulator_fresh.url}/{host}/", headers={"CF-Connecting-IP": "1.2.3.4"}, timeout=30)
    assert forged.json()["client"] == "127.0.0.1"


def test_the_door_of_a_worker_not_served_is_a_404(api, cf_emulator_fresh):
    api.upload("echo", ECHO)  # its workers.dev URL not turned on
    host = cf_emulator_fresh.workers_dev_host("echo")
    assert requests.get(f"{cf_emulator_fresh.url}/{host}/", timeout=30).status_code == 404


@pytest.mark.parametrize("path", ["//deep//path?q=//x", "/deep//path", "/a/%2F/b"])
def test_a_worker_gets_the_path_as_the_caller_sent_it(api, cf_emulator_fresh, path):
    # Cloudflare keeps doubled slashes, a leading one too, for the Worker (a local dev server
    # that folded them was a bug: cloudflare/workers-sdk#4743), on its host and through the door.
    import http.client

    deploy(api, "echo", ECHO)
    host = cf_emulator_fresh.workers_dev_host("echo")
    port = int(cf_emulator_fresh.url.rsplit(":", 1)[1])
    for target, host_header in ((path, host), (f"/{host}{path}", f"127.0.0.1:{port}")):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.putrequest("GET", target, skip_host=True)
            connection.putheader("Host", host_header)
            connection.endheaders()
            seen = json.loads(connection.getresponse().read())
        finally:
            connection.close()
        assert seen["path"] == path, target
