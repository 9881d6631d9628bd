"""The emulator answers as the Cloudflare API reference says, over real HTTP, with real workerd."""

from __future__ import annotations

import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

HELLO = "export default { async fetch(request) { return new Response('hello ' + new URL(request.url).pathname) } }"
ECHO = """export default { async fetch(request, env) {
  return Response.json({
    url: request.url,
    method: request.method,
    body: await request.text(),
    headers: Object.fromEntries(request.headers),
    env: Object.keys(env).sort(),
    greeting: env.GREETING ?? null,
  });
} }"""


class Api:
    """Raw calls to the emulator's API, as any HTTP client would make them."""

    def __init__(self, emulator) -> None:
        self.emulator = emulator
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {emulator.token}"

    def url(self, path: str) -> str:
        return f"{self.emulator.api_base}/accounts/{self.emulator.account_id}{path}"

    def call(self, method: str, path: str, **kwargs) -> requests.Response:
        return self.session.request(method, self.url(path), timeout=30, **kwargs)

    def upload(self, name: str, code: str = HELLO, *, metadata: dict | None = None, namespace: str | None = None):
        meta = {"main_module": "worker.js", "compatibility_date": "2025-01-01", **(metadata or {})}
        files = [
            ("metadata", (None, json.dumps(meta))),
            ("worker.js", ("worker.js", code.encode(), "application/javascript+module")),
        ]
        prefix = f"/workers/dispatch/namespaces/{namespace}" if namespace else "/workers"
        return self.call("PUT", f"{prefix}/scripts/{name}", files=files)

    def enable(self, name: str) -> requests.Response:
        return self.call("POST", f"/workers/scripts/{name}/subdomain", json={"enabled": True})

    def kv_namespace(self, title: str = "store") -> str:
        """A new KV namespace of the account: its id."""
        return self.call("POST", "/storage/kv/namespaces", json={"title": title}).json()["result"]["id"]


def kv_binding(namespace: str) -> dict:
    """The binding of KV namespace `namespace` as `env.STORE`."""
    return {"type": "kv_namespace", "name": "STORE", "namespace_id": namespace}


@pytest.fixture
def api(cf_emulator_fresh):
    return Api(cf_emulator_fresh)


def first_error(response: requests.Response) -> int:
    body = response.json()
    assert body["success"] is False and body["result"] is None and body["messages"] == []
    return body["errors"][0]["code"]


# --- scripts and workers.dev ---------------------------------------------------------------


def test_uploaded_script_is_listed_runs_on_workers_dev_and_is_gone_after_delete(api, cf_emulator_fresh):
    uploaded = api.upload("hello-1")
    assert uploaded.status_code == 200
    body = uploaded.json()
    assert body["success"] is True and body["errors"] == [] and body["messages"] == []
    assert body["result"]["id"] == "hello-1"
    assert len(body["result"]["etag"]) == 64
    assert [s["id"] for s in api.call("GET", "/workers/scripts").json()["result"]] == ["hello-1"]

    host = cf_emulator_fresh.workers_dev_host("hello-1")
    assert cf_emulator_fresh.worker_request(host).status_code == 404  # not enabled yet
    assert api.enable("hello-1").json()["result"] == {"enabled": True, "previews_enabled": False}
    served = cf_emulator_fresh.worker_request(host, "/some/path")
    assert (served.status_code, served.text) == (200, "hello /some/path")

    deleted = api.call("DELETE", "/workers/scripts/hello-1", params={"force": "true"})
    assert deleted.status_code == 200 and deleted.json()["success"] is True
    assert cf_emulator_fresh.worker_request(host).status_code == 404
    assert api.call("GET", "/workers/scripts").json()["result"] == []
    again = api.call("DELETE", "/workers/scripts/hello-1")
    assert (again.status_code, first_error(again)) == (404, 10007)


def test_reupload_replaces_the_code_and_frees_the_old_bundle(api, cf_emulator_fresh):
    first = api.upload("versioned").json()["result"]["etag"]
    api.enable("versioned")
    second = api.upload("versioned", "export default { fetch() { return new Response('v2') } }").json()["result"]
    assert second["etag"] != first
    host = cf_emulator_fresh.workers_dev_host("versioned")
    assert cf_emulator_fresh.worker_request(host).text == "v2"
    assert len(api.call("GET", "/workers/scripts").json()["result"]) == 1


def test_worker_sees_its_request_bindings_and_no_internal_headers(api, cf_emulator_fresh):
    bindings = [
        {"type": "plain_text", "name": "GREETING", "text": "hi"},
        {"type": "secret_text", "name": "TOKEN", "text": "s3cr3t"},
    ]
    assert api.upload("echo", ECHO, metadata={"bindings": bindings}).status_code == 200
    api.enable("echo")
    host = cf_emulator_fresh.workers_dev_host("echo")
    # A caller's X-Sigil-Retire would have the loader host release the script instead of running it.
    forged = {"X-Custom": "kept", "X-Sigil-Secret": "forged", "X-Sigil-Retire": "1", "X-Sigil-Store": "1"}
    seen = cf_emulator_fresh.worker_request(host, "/p?q=1", "POST", data=b"payload", headers=forged).json()
    assert seen["url"] == f"http://{host}/p?q=1"
    assert (seen["method"], seen["body"]) == ("POST", "payload")
    assert seen["headers"]["x-custom"] == "kept"
    assert not [name for name in seen["headers"] if name.startswith("x-sigil")]
    assert (seen["env"], seen["greeting"]) == (["GREETING", "TOKEN"], "hi")
    settings = api.call("GET", "/workers/scripts/echo/settings").json()["result"]
    assert {"type": "secret_text", "name": "TOKEN"} in settings["bindings"]
    assert "s3cr3t" not in json.dumps(settings)


def test_streamed_request_body_reaches_the_worker(api, cf_emulator_fresh):
    api.upload("echo", ECHO)
    api.enable("echo")
    chunks = (part for part in [b"one,", b"two,", b"three"])
    seen = cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host("echo"), "/", "PUT", data=chunks)
    assert seen.json()["body"] == "one,two,three"


def test_python_sdk_layout_and_typed_metadata_are_accepted(api, cf_emulator_fresh):
    meta = {"main_module": "index.js", "compatibility_date": "2025-01-01"}
    files = [
        ("metadata", ("blob", json.dumps(meta).encode(), "application/json")),
        (
            "files",
            ("index.js", b"export default { fetch() { return new Response('sdk') } }", "application/javascript+module"),
        ),
    ]
    assert api.call("PUT", "/workers/scripts/sdk-style", files=files).status_code == 200
    api.enable("sdk-style")
    assert cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host("sdk-style")).text == "sdk"


def test_multi_module_upload_runs_its_imports(api, cf_emulator_fresh):
    meta = {"main_module": "worker.js", "compatibility_date": "2025-01-01"}
    files = [
        ("metadata", (None, json.dumps(meta))),
        (
            "worker.js",
            (
                "worker.js",
                b"import { word } from './lib.js'; export default { fetch() { return new Response(word) } }",
                "application/javascript+module",
            ),
        ),
        ("lib.js", ("lib.js", b"export const word = 'imported';", "application/javascript+module")),
    ]
    assert api.call("PUT", "/workers/scripts/multi", files=files).status_code == 200
    api.enable("multi")
    assert cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host("multi")).text == "imported"


def test_account_subdomain_is_reported_and_can_be_missing(api, cf_emulator_fresh):
    assert api.call("GET", "/workers/subdomain").json()["result"] == {"subdomain": "sigil-emulator"}
    cf_emulator_fresh.configure(subdomain="")
    missing = api.call("GET", "/workers/subdomain")
    assert (missing.status_code, first_error(missing)) == (404, 10007)


def test_subdomain_toggle_of_a_missing_script_is_not_found(api):
    response = api.enable("nobody")
    assert (response.status_code, first_error(response)) == (404, 10007)


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "body", "code"),
    [
        ({"Content-Type": "application/javascript"}, b"addEventListener('fetch', () => {})", 10001),
        ({"Content-Type": "multipart/form-data"}, b"no boundary", 10026),
        ({"Content-Type": "multipart/form-data; boundary=xyz"}, b"not the boundary at all", 10026),
        (
            {"Content-Type": "multipart/form-data; boundary=xyz"},
            b'--xyz\r\nContent-Disposition: form-data; name="metadata"\r\n\r\n{}\r\n',  # never closed
            10026,
        ),
        (
            {"Content-Type": "multipart/form-data; boundary=xyz"},
            b"--xyz\r\nContent-Disposition: form-data\r\n\r\nnameless\r\n--xyz--\r\n",
            10026,
        ),
    ],
    ids=["not-multipart", "no-boundary", "boundary-absent", "unterminated", "part-without-name"],
)
def test_malformed_uploads_are_rejected(api, headers, body, code):
    response = api.call("PUT", "/workers/scripts/broken", headers=headers, data=body)
    assert (response.status_code, first_error(response)) == (400, code)
    assert api.call("GET", "/workers/scripts").json()["result"] == []


def test_malformed_chunked_framing_is_a_400_not_an_emulator_failure(cf_emulator_fresh):
    port = int(cf_emulator_fresh.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"PUT /client/v4/x HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 400 ")


def test_upload_without_metadata_is_rejected(api):
    files = [("worker.js", ("worker.js", HELLO.encode(), "application/javascript+module"))]
    response = api.call("PUT", "/workers/scripts/no-meta", files=files)
    assert (response.status_code, first_error(response)) == (400, 10026)


def test_main_module_must_be_one_of_the_parts(api):
    response = api.upload("wrong-main", metadata={"main_module": "index.js"})
    assert (response.status_code, first_error(response)) == (400, 10021)
    assert "index.js" in response.json()["errors"][0]["message"]


@pytest.mark.parametrize(
    ("metadata", "code"),
    [
        ({"bindings": [{"type": "plain_text", "text": "x"}]}, 10052),
        ({"bindings": [{"type": "teleporter", "name": "T"}]}, 10021),
        ({"tags": [f"t{i}" for i in range(9)]}, 10021),
        ({"limits": {"cpu_ms": "fast"}}, 10021),
        ({"compatibility_date": "yesterday"}, 10021),
    ],
    ids=["nameless-binding", "unknown-binding", "nine-tags", "bad-limits", "bad-date"],
)
def test_invalid_metadata_is_rejected(api, metadata, code):
    response = api.upload("bad-meta", metadata=metadata)
    assert (response.status_code, first_error(response)) == (400, code)


def test_invalid_script_name_is_10016(api):
    response = api.upload("Not_Lower")
    assert (response.status_code, first_error(response)) == (400, 10016)


def test_a_script_that_does_not_start_is_10021_with_the_reason_and_stores_nothing(api, settings):
    response = api.upload("broken", "throw new Error('no config'); export default {}")
    assert (response.status_code, first_error(response)) == (400, 10021)
    assert "Uncaught Error: no config" in response.json()["errors"][0]["message"]
    assert api.call("GET", "/workers/scripts").json()["result"] == []
    assert api.upload("unfinished", "export default { async fetch() {").status_code == 400
    assert api.upload("fine", HELLO).status_code == 200
    code_dir = Path(settings.VAR_DIR) / "cfemulator" / "code"  # the session emulator's, see conftest
    assert len(list(code_dir.glob("*.json"))) == 1  # only the script that started left its bundle


def test_script_over_the_size_limit_is_10027_measured_compressed(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(script_max_bytes=64 * 1024)
    # 200 KB that compresses to a few hundred bytes is accepted, as Cloudflare measures gzip size.
    assert api.upload("compressible", HELLO + "//" + "a" * 200_000).status_code == 200
    noise = os.urandom(100_000).hex()
    response = api.upload("too-big", HELLO + "//" + noise)
    assert (response.status_code, first_error(response)) == (400, 10027)
    assert [s["id"] for s in api.call("GET", "/workers/scripts").json()["result"]] == ["compressible"]


# --- quota --------------------------------------------------------------------------------------


def test_script_quota_is_10037_and_never_exceeded_under_concurrent_uploads(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(script_limit=3)
    with ThreadPoolExecutor(max_workers=10) as pool:
        responses = list(pool.map(lambda i: api.upload(f"quota-{i}"), range(10)))
    assert sorted(r.status_code for r in responses) == [200] * 3 + [400] * 7
    refused = [r for r in responses if r.status_code == 400]
    assert {first_error(r) for r in refused} == {10037}
    assert "exceeded the limit of 3 Workers" in refused[0].json()["errors"][0]["message"]
    listed = [s["id"] for s in api.call("GET", "/workers/scripts").json()["result"]]
    assert len(listed) == 3
    # Replacing a script that exists is not a new Worker, so the full account may still update it.
    assert api.upload(listed[0], "export default { fetch() { return new Response('x') } }").status_code == 200
    api.call("DELETE", f"/workers/scripts/{listed[1]}")
    assert api.upload("quota-new").status_code == 200


# --- auth, routes, rate limit, faults --------------------------------------------------------------


def test_bad_or_missing_token_is_10000_without_echoing_it(cf_emulator_fresh):
    url = f"{cf_emulator_fresh.api_base}/accounts/{cf_emulator_fresh.account_id}/workers/scripts"
    for headers in ({"Authorization": "Bearer wrong-token-value"}, {}):
        response = requests.get(url, headers=headers, timeout=10)
        assert (response.status_code, first_error(response)) == (403, 10000)
        assert "wrong-token-value" not in response.text


def test_unknown_routes_and_other_accounts_are_7003(api, cf_emulator_fresh):
    unknown = requests.get(f"{cf_emulator_fresh.api_base}/zones", timeout=10)
    assert (unknown.status_code, first_error(unknown)) == (404, 7003)
    wrong_method = api.call("PATCH", "/workers/scripts")
    assert first_error(wrong_method) == 7003
    other = api.session.get(f"{cf_emulator_fresh.api_base}/accounts/0000/workers/scripts", timeout=10)
    assert (other.status_code, first_error(other)) == (400, 7003)
    assert "Could not route to" in other.json()["errors"][0]["message"]
    outside = requests.get(f"{cf_emulator_fresh.url}/elsewhere", timeout=10)
    assert first_error(outside) == 7003


def test_rate_limit_locks_out_with_429_971_and_retry_after(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(rate_limit="3/1")
    statuses = [api.call("GET", "/workers/scripts") for _ in range(5)]
    assert [r.status_code for r in statuses] == [200, 200, 200, 429, 429]
    limited = statuses[3]
    assert first_error(limited) == 971
    assert limited.headers["Retry-After"] == "1"
    assert statuses[0].headers["Ratelimit"] == '"default";r=2;t=1'
    time.sleep(1.05)
    assert api.call("GET", "/workers/scripts").status_code == 200


def test_fail_next_injects_a_cycle_of_5xx_without_side_effects(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(fail_next=3)
    failed = [api.upload("faulty") for _ in range(3)]
    assert [r.status_code for r in failed] == [500, 502, 503]
    assert first_error(failed[0]) == 10002
    assert failed[1].headers["Content-Type"].startswith("text/html")
    assert api.call("GET", "/workers/scripts").json()["result"] == []
    assert api.upload("faulty").status_code == 200


def test_fault_rate_fails_about_that_fraction_reproducibly(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(fault_rate=0.5, fault_seed=7)
    first = [api.call("GET", "/workers/scripts").status_code for _ in range(40)]
    cf_emulator_fresh.configure(fault_seed=7)
    second = [api.call("GET", "/workers/scripts").status_code for _ in range(40)]
    assert first == second
    assert 8 <= sum(status >= 500 for status in first) <= 32


def test_latency_is_added_to_api_calls(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(latency=0.2)
    started = time.monotonic()
    api.call("GET", "/workers/scripts")
    assert time.monotonic() - started >= 0.2


# --- dispatch namespaces and KV ---------------------------------------------------------------------


def test_dispatch_namespace_holds_uncapped_scripts_filtered_by_tag(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(script_limit=1)
    created = api.call("POST", "/workers/dispatch/namespaces", json={"name": "sigil-test"}).json()["result"]
    assert created["namespace_name"] == "sigil-test" and created["script_count"] == 0
    duplicate = api.call("POST", "/workers/dispatch/namespaces", json={"name": "sigil-test"})
    assert duplicate.status_code == 400  # as Cloudflare answers, not 409
    for i, tag in enumerate(["blue", "blue", "red"]):
        response = api.upload(f"user-{i}", namespace="sigil-test", metadata={"tags": [tag]})
        assert response.status_code == 200
    assert api.call("GET", "/workers/dispatch/namespaces/sigil-test").json()["result"]["script_count"] == 3
    blue = api.call("GET", "/workers/dispatch/namespaces/sigil-test/scripts", params={"tags": "blue:yes"})
    # Cloudflare's schema nests each name in `script.id`, beside the namespace and the dates.
    listed = blue.json()["result"]
    assert sorted(s["script"]["id"] for s in listed) == ["user-0", "user-1"]
    assert all("id" not in s and s["dispatch_namespace"] == "sigil-test" and s["created_on"] for s in listed)
    detail = api.call("GET", "/workers/dispatch/namespaces/sigil-test/scripts/user-2").json()["result"]
    assert detail["dispatch_namespace"] == "sigil-test" and detail["script"]["id"] == "user-2"

    served = cf_emulator_fresh.worker_request(cf_emulator_fresh.dispatch_host("sigil-test", "user-2"), "/x")
    assert served.text == "hello /x"
    assert api.call("DELETE", "/workers/dispatch/namespaces/sigil-test/scripts", params={"tags": "blue:yes"}).ok
    remaining = api.call("GET", "/workers/dispatch/namespaces/sigil-test/scripts").json()["result"]
    assert [s["script"]["id"] for s in remaining] == ["user-2"]
    assert api.call("DELETE", "/workers/dispatch/namespaces/sigil-test").ok
    gone = api.call("GET", "/workers/dispatch/namespaces/sigil-test")
    assert (gone.status_code, first_error(gone)) == (404, 10007)
    assert cf_emulator_fresh.worker_request(cf_emulator_fresh.dispatch_host("sigil-test", "user-2")).status_code == 404


def test_a_free_account_refuses_worker_loader_bindings_as_cloudflare_does(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(plan="free")
    refused = api.upload("loads", metadata={"bindings": [{"type": "worker_loader", "name": "LOADER"}]})
    assert (refused.status_code, first_error(refused)) == (400, 10021)
    assert refused.json()["errors"][0]["message"] == "binding LOADER of type worker_loader is invalid"
    assert api.upload("plain").status_code == 200  # everything else still deploys


def test_an_account_without_workers_for_platforms_refuses_dispatch_namespaces(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(workers_for_platforms=False)
    for method, path in [("GET", ""), ("POST", ""), ("GET", "/sigil"), ("GET", "/sigil/scripts")]:
        refused = api.call(method, f"/workers/dispatch/namespaces{path}", json={"name": "sigil"})
        assert (refused.status_code, first_error(refused)) == (403, 10015)
    assert api.upload("plain").status_code == 200


def test_kv_values_are_raw_bytes_with_envelopes_around_everything_else(api):
    namespace = api.call("POST", "/storage/kv/namespaces", json={"title": "code"}).json()["result"]
    assert api.call("POST", "/storage/kv/namespaces", json={"title": "code"}).json()["errors"][0]["code"] == 10014
    values = f"/storage/kv/namespaces/{namespace['id']}/values"
    key = "code%3Aab%2Fcd"  # "code:ab/cd", percent-encoded as the reference says keys must be
    put = api.call("PUT", f"{values}/{key}", data=b"\x00bytes\xff", params={"expiration_ttl": "120"})
    assert put.json() == {"success": True, "errors": [], "messages": [], "result": None}
    got = api.call("GET", f"{values}/{key}")
    assert got.content == b"\x00bytes\xff"
    assert int(got.headers["expiration"]) > time.time()
    keys = api.call("GET", f"/storage/kv/namespaces/{namespace['id']}/keys", params={"prefix": "code:"}).json()
    assert [k["name"] for k in keys["result"]] == ["code:ab/cd"]
    short = api.call("PUT", f"{values}/k", data=b"x", params={"expiration_ttl": "10"})
    assert short.status_code == 400
    assert api.call("DELETE", f"{values}/{key}").json()["success"] is True
    missing = api.call("GET", f"{values}/{key}")
    assert (missing.status_code, first_error(missing)) == (404, 10009)
    no_namespace = api.call("GET", "/storage/kv/namespaces/0123/values/x")
    assert (no_namespace.status_code, first_error(no_namespace)) == (404, 10013)


# --- the emulator's own controls ------------------------------------------------------------------


def test_request_log_counts_api_calls_with_status_and_code(api, cf_emulator_fresh):
    api.upload("logged")
    api.upload("Bad_Name")
    api.call("DELETE", "/workers/scripts/logged")
    cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host("logged"))  # not an API call
    calls = cf_emulator_fresh.api_calls()
    assert [(c["method"], c["status"], c["code"]) for c in calls] == [
        ("PUT", 200, None),
        ("PUT", 400, 10016),
        ("DELETE", 200, None),
    ]
    assert calls[0]["path"].endswith("/workers/scripts/logged")
    assert len(cf_emulator_fresh.api_calls(method="PUT", path_suffix="/workers/scripts/logged")) == 1
    cf_emulator_fresh.reset()
    assert cf_emulator_fresh.api_calls() == []


def test_reset_forgets_scripts_and_restores_the_start_config(api, cf_emulator_fresh):
    cf_emulator_fresh.configure(script_limit=1, latency=0.01)
    api.upload("kept-until-reset")
    config = cf_emulator_fresh.reset()
    assert (config["script_limit"], config["latency"], config["rate_limit"]) == (500, 0.0, "1200/300")
    assert api.call("GET", "/workers/scripts").json()["result"] == []


def test_config_rejects_unknown_settings_and_bad_values(cf_emulator_fresh):
    for body in ({"scripts": 3}, {"fault_rate": 2}, {"rate_limit": "fast"}):
        response = requests.post(f"{cf_emulator_fresh.url}/__emulator/config", json=body, timeout=10)
        assert response.status_code == 400, body


def test_sixty_concurrent_connections_are_all_served(api, cf_emulator_fresh):
    api.upload("busy")
    api.enable("busy")
    host = cf_emulator_fresh.workers_dev_host("busy")

    def one(i: int) -> tuple[int, int]:
        # A fresh connection each, so the server really holds sixty at once.
        with requests.Session() as session:
            worker = session.get(f"{cf_emulator_fresh.url}/{i}", headers={"Host": host}, timeout=30)
            listing = session.get(api.url("/workers/scripts"), headers=api.session.headers, timeout=30)
        return worker.status_code, listing.status_code

    with ThreadPoolExecutor(max_workers=60) as pool:
        results = list(pool.map(one, range(60)))
    assert results == [(200, 200)] * 60


def test_emulator_listens_on_loopback_only(cf_emulator_fresh):
    assert cf_emulator_fresh.url.startswith("http://127.0.0.1:")
    port = int(cf_emulator_fresh.url.rsplit(":", 1)[1])
    table = Path("/proc/net/tcp")
    if not table.exists():
        pytest.skip("needs Linux's /proc/net/tcp to read listening addresses")
    listening = [
        line.split()[1]
        for line in table.read_text().splitlines()[1:]
        if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == port
    ]
    assert listening == [f"0100007F:{port:04X}"]  # 127.0.0.1, little-endian, and nothing else
