"""Workers KV as Cloudflare documents it: eventually consistent (a write reaches a location
holding the key's value once what it holds times out, up to 60 s, and is seen where it was made
at once), with its limits (one binding write a second per key; keys, values, metadata and bulk
requests bounded), and the bulk write and delete endpoints with their answers' shape."""

from __future__ import annotations

import base64
import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from cfemulator.bodies import MAX_BODY_BYTES
from cfemulator.tests.test_api import Api, first_error, kv_binding

DELAY = 2.0  # long enough for a loaded machine to read twice within it
# A Worker that reads, writes (`?size=` bytes of "x", or the body; `?metadata=` bytes of it)
# and deletes `?key=` through its binding, answering what the binding threw as a 500.
STORE = """export default { async fetch(request, env) {
  const url = new URL(request.url);
  const key = url.searchParams.get("key") || "k";
  try {
    if (request.method === "PUT") {
      const size = url.searchParams.get("size");
      const value = size ? "x".repeat(Number(size)) : await request.text();
      const metadata = url.searchParams.get("metadata");
      const options = metadata ? { metadata: { m: "x".repeat(Number(metadata)) } } : {};
      await env.STORE.put(key, value, options);
      if (url.searchParams.get("twice")) await env.STORE.put(key, value);
      return new Response("put");
    }
    if (request.method === "DELETE") { await env.STORE.delete(key); return new Response("deleted"); }
    return new Response(String(await env.STORE.get(key)));
  } catch (error) {
    return new Response(error.message, { status: 500 });
  }
} }"""


@pytest.fixture
def api(cf_emulator_fresh):
    return Api(cf_emulator_fresh)


class Location:
    """A bound script of its own: one of Workers KV's locations, reading and writing `env.STORE`."""

    def __init__(self, api: Api, emulator, name: str, namespace: str) -> None:
        uploaded = api.upload(name, STORE, metadata={"bindings": [kv_binding(namespace)]})
        assert uploaded.status_code == 200, uploaded.text
        assert api.enable(name).status_code == 200
        self.emulator = emulator
        self.host = emulator.workers_dev_host(name)

    def read(self, key: str = "k") -> str:
        answer = self.emulator.worker_request(self.host, f"/?key={key}")
        assert answer.status_code == 200, answer.text
        return answer.text

    def write(self, value: str = "", key: str = "k", **params) -> tuple[int, str]:
        query = "&".join(f"{name}={value}" for name, value in {"key": key, **params}.items())
        answer = self.emulator.worker_request(self.host, f"/?{query}", method="PUT", data=value.encode())
        return answer.status_code, answer.text

    def delete(self, key: str = "k") -> None:
        assert self.emulator.worker_request(self.host, f"/?key={key}", method="DELETE").status_code == 200


def wait_for(read, expected: str, *, within: float) -> float:
    """Seconds until `read()` answers `expected`; fails after `within`."""
    started = time.monotonic()
    while (seen := read()) != expected:
        assert time.monotonic() - started < within, f"still {seen!r}, not {expected!r}"
        time.sleep(0.05)
    return time.monotonic() - started


def values_path(namespace: str, key: str = "k") -> str:
    return f"/storage/kv/namespaces/{namespace}/values/{key}"


# --- eventual consistency ------------------------------------------------------------------


def test_kv_writes_propagate_within_cloudflares_60_seconds_by_default(cf_emulator_fresh):
    assert cf_emulator_fresh.config()["kv_propagation_seconds"] == 60


def test_a_location_holding_a_value_reads_it_until_the_propagation_delay_has_passed(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(kv_propagation_seconds=DELAY)
    namespace = api.kv_namespace()
    api.call("PUT", values_path(namespace), data=b"old")
    here = Location(api, cf_emulator_fresh, "here", namespace)
    assert here.read() == "old"
    read_at = time.monotonic()

    api.call("PUT", values_path(namespace), data=b"new")
    assert api.call("GET", values_path(namespace)).content == b"new"  # the API reads the central store
    assert here.read() == "old"
    wait_for(here.read, "new", within=DELAY + 5)
    assert time.monotonic() - read_at >= DELAY - 0.05


def test_a_location_that_holds_nothing_reads_the_central_store(api, cf_emulator_fresh):
    namespace = api.kv_namespace()
    here = Location(api, cf_emulator_fresh, "here", namespace)
    api.call("PUT", values_path(namespace), data=b"fresh")
    assert here.read() == "fresh"


def test_a_bindings_write_is_seen_where_it_was_made_at_once_and_elsewhere_once_propagated(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(kv_propagation_seconds=DELAY)
    namespace = api.kv_namespace()
    api.call("PUT", values_path(namespace), data=b"old")
    here, there = (Location(api, cf_emulator_fresh, name, namespace) for name in ("here", "there"))
    assert (here.read(), there.read()) == ("old", "old")
    read_at = time.monotonic()

    assert here.write("mine") == (200, "put")
    assert here.read() == "mine"
    assert api.call("GET", values_path(namespace)).content == b"mine"
    assert there.read() == "old"
    wait_for(there.read, "mine", within=DELAY + 5)
    assert time.monotonic() - read_at >= DELAY - 0.05


def test_a_delete_propagates_as_a_write_does(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(kv_propagation_seconds=DELAY)
    namespace = api.kv_namespace()
    api.call("PUT", values_path(namespace), data=b"kept")
    here, there = (Location(api, cf_emulator_fresh, name, namespace) for name in ("here", "there"))
    assert (here.read(), there.read()) == ("kept", "kept")

    here.delete()
    assert here.read() == "null"
    assert api.call("GET", values_path(namespace)).status_code == 404
    assert there.read() == "kept"
    wait_for(there.read, "null", within=DELAY + 5)

    # Over the API too: a location holding the value reads it until the delay has passed.
    api.call("PUT", values_path(namespace, "other"), data=b"kept")
    assert here.read("other") == "kept"
    assert api.call("DELETE", values_path(namespace, "other")).status_code == 200
    assert here.read("other") == "kept"
    assert [k["name"] for k in api.call("GET", f"/storage/kv/namespaces/{namespace}/keys").json()["result"]] == []
    wait_for(lambda: here.read("other"), "null", within=DELAY + 5)


# --- limits --------------------------------------------------------------------------------


def test_a_binding_writes_one_key_at_most_once_a_second(api, cf_emulator_fresh):
    namespace = api.kv_namespace()
    here = Location(api, cf_emulator_fresh, "here", namespace)

    assert here.write("a", twice="1") == (500, "KV PUT failed: 429 Too Many Requests")
    assert here.write("b", key="another") == (200, "put")
    time.sleep(1.0)
    assert here.write("d") == (200, "put")
    assert api.call("GET", values_path(namespace)).content == b"d"


def test_the_apis_writes_of_one_key_are_held_by_the_api_rate_limit_only(api):
    # The KV FAQ: over the REST API "the write rate limit is 1,200 writes per 5 minutes".
    namespace = api.kv_namespace()
    answers = [api.call("PUT", values_path(namespace), data=str(n).encode()).status_code for n in range(3)]
    assert answers == [200, 200, 200]
    assert api.call("GET", values_path(namespace)).content == b"2"


def test_values_over_25_mib_and_metadata_over_1024_bytes_are_refused(api, cf_emulator_fresh):
    namespace = api.kv_namespace()
    most = 25 * 1024 * 1024
    assert api.call("PUT", values_path(namespace, "big"), data=b"x" * (most + 1)).status_code == 413
    assert api.call("PUT", values_path(namespace, "big"), data=b"x" * most).status_code == 200

    def with_metadata(size: int) -> int:
        metadata = json.dumps({"m": "x" * size})  # 8 bytes of JSON around it
        files = [("value", ("value", b"v", "application/octet-stream")), ("metadata", (None, metadata))]
        return api.call("PUT", values_path(namespace, "meta"), files=files).status_code

    assert (with_metadata(1024 - 8), with_metadata(1024 - 7)) == (200, 413)

    here = Location(api, cf_emulator_fresh, "here", namespace)
    assert here.write(key="b1", size=str(most + 1)) == (500, "KV PUT failed: 413 Request Entity Too Large")
    assert here.write(key="b2", metadata=str(1024 - 7)) == (500, "KV PUT failed: 413 Request Entity Too Large")
    assert here.write(key="b3", metadata=str(1024 - 8)) == (200, "put")
    assert api.call("GET", values_path(namespace, "b1")).status_code == 404


def test_keys_over_512_bytes_are_refused(api):
    namespace = api.kv_namespace()
    assert api.call("PUT", values_path(namespace, "k" * 513), data=b"v").status_code == 400
    refused = api.call("PUT", f"/storage/kv/namespaces/{namespace}/bulk", json=[{"key": "k" * 513, "value": "v"}])
    assert (refused.status_code, first_error(refused)) == (400, 10021)


# --- bulk writes and deletes ------------------------------------------------------------------


def test_a_bulk_write_stores_every_pair_and_answers_cloudflares_shape(api):
    namespace = api.kv_namespace()
    pairs = [
        {"key": "plain", "value": "one"},
        {"key": "meta", "value": "two", "metadata": {"sha": "abc"}, "expiration_ttl": 3600},
        {"key": "binary", "value": base64.b64encode(b"\x00\xff").decode(), "base64": True},
    ]
    answer = api.call("PUT", f"/storage/kv/namespaces/{namespace}/bulk", json=pairs)
    assert answer.status_code == 200, answer.text
    assert answer.json()["result"] == {"successful_key_count": 3, "unsuccessful_keys": []}

    assert api.call("GET", values_path(namespace, "plain")).content == b"one"
    assert api.call("GET", values_path(namespace, "binary")).content == b"\x00\xff"
    listed = {k["name"]: k for k in api.call("GET", f"/storage/kv/namespaces/{namespace}/keys").json()["result"]}
    assert listed["meta"]["metadata"] == {"sha": "abc"}
    assert listed["meta"]["expiration"] == pytest.approx(time.time() + 3600, abs=5)
    assert "expiration" not in listed["plain"]


def test_a_bulk_delete_removes_every_key_in_either_documented_form(api):
    namespace = api.kv_namespace()
    pairs = [{"key": f"k{n}", "value": "v"} for n in range(4)]
    assert api.call("PUT", f"/storage/kv/namespaces/{namespace}/bulk", json=pairs).status_code == 200

    deleted = api.call("POST", f"/storage/kv/namespaces/{namespace}/bulk/delete", json=["k0", "k1", "never"])
    assert deleted.json()["result"] == {"successful_key_count": 3, "unsuccessful_keys": []}
    deprecated = api.call("DELETE", f"/storage/kv/namespaces/{namespace}/bulk", json=["k2"])
    assert deprecated.status_code == 200
    listed = [k["name"] for k in api.call("GET", f"/storage/kv/namespaces/{namespace}/keys").json()["result"]]
    assert listed == ["k3"]


def test_a_bulk_request_holds_at_most_10000_pairs_and_a_refused_one_writes_nothing(api):
    namespace = api.kv_namespace()
    bulk = f"/storage/kv/namespaces/{namespace}/bulk"
    over = [{"key": f"k{n}", "value": "v"} for n in range(10_001)]
    refused = api.call("PUT", bulk, json=over)
    assert (refused.status_code, first_error(refused)) == (400, 10021)
    assert api.call("GET", f"/storage/kv/namespaces/{namespace}/keys").json()["result"] == []
    assert api.call("POST", f"{bulk}/delete", json=[f"k{n}" for n in range(10_001)]).status_code == 400

    assert api.call("PUT", bulk, json=over[:10_000]).json()["result"]["successful_key_count"] == 10_000
    ttl_too_short = [{"key": "a", "value": "v"}, {"key": "b", "value": "v", "expiration_ttl": 30}]
    assert api.call("PUT", bulk, json=ttl_too_short).status_code == 400
    assert api.call("GET", values_path(namespace, "a")).status_code == 404


def test_a_bulk_request_over_100_mb_is_refused_before_it_is_read(api, cf_emulator_fresh):
    namespace = api.kv_namespace()
    address = urlsplit(cf_emulator_fresh.url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as connection:
        connection.sendall(
            (
                f"PUT {urlsplit(api.url(f'/storage/kv/namespaces/{namespace}/bulk')).path} HTTP/1.1\r\n"
                f"Host: {address.netloc}\r\nAuthorization: Bearer {cf_emulator_fresh.token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n"
            ).encode()
        )
        status_line = connection.makefile("rb").readline()
    assert status_line.split()[1] == b"413"


def test_bulk_writes_reach_bindings_as_other_writes_do(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(kv_propagation_seconds=DELAY, kv_miss_cache_seconds=DELAY)
    namespace = api.kv_namespace()
    here = Location(api, cf_emulator_fresh, "here", namespace)
    assert here.read() == "null"  # the miss is held there
    api.call("PUT", f"/storage/kv/namespaces/{namespace}/bulk", json=[{"key": "k", "value": "bulk"}])
    assert here.read() == "null"
    wait_for(here.read, "bulk", within=DELAY + 5)
    api.call("POST", f"/storage/kv/namespaces/{namespace}/bulk/delete", json=["k"])
    assert here.read() == "bulk"
    wait_for(here.read, "null", within=DELAY + 5)
