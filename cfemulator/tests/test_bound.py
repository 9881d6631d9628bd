"""Scripts with KV, Worker Loader and dispatch namespace bindings run with those bindings
working, each in a workerd of its own, over real HTTP."""

from __future__ import annotations

import json
import time

import pytest

from cfemulator.limits import CPU_EXCEEDED_MESSAGE
from cfemulator.tests.test_api import Api, first_error, kv_binding
from cfemulator.tests.test_limits import calling_steady, stopped_within

KV_WORKER = """export default { async fetch(request, env) {
  const url = new URL(request.url);
  if (request.method === "PUT") {
    await env.STORE.put(url.pathname.slice(1), await request.text(), { metadata: { by: "worker" } });
    return new Response("stored");
  }
  if (url.pathname === "/") return Response.json((await env.STORE.list({ prefix: "k" })).keys);
  const { value, metadata } = await env.STORE.getWithMetadata(url.pathname.slice(1));
  return Response.json({ value, metadata });
} }"""

LOADS = """export default { async fetch(request, env) {
  const worker = env.LOADER.get("one@1", async () => ({
    compatibilityDate: "2025-01-01", mainModule: "m.js",
    modules: { "m.js": "export default { fetch() { return new Response('loaded at run time') } }" },
  }));
  return worker.getEntrypoint().fetch(request);
} }"""

# Dynamic Workers limited to 40 ms of CPU: one spins on /spin, any other path awaits a moment
# (longer than the emulator's wait for a Worker to give the event loop back) and answers.
LOADS_SPINNER = """export default { async fetch(request, env) {
  const spin = new URL(request.url).pathname === "/spin";
  const worker = env.LOADER.get(spin ? "spin@1" : "steady@1", async () => ({
    compatibilityDate: "2025-01-01", mainModule: "m.js",
    modules: { "m.js": spin
      ? "export default { async fetch() { while (true) {} } }"
      : "export default { async fetch() { await new Promise((r) => setTimeout(r, 30)); "
        + "return new Response('still here') } }" },
  }));
  try {
    return await worker.getEntrypoint(null, { limits: { cpuMs: 40 } }).fetch(request);
  } catch (error) {
    return new Response(String(error.message), { status: 599 });
  }
} }"""

DISPATCHES = """export default { async fetch(request, env) {
  const name = new URL(request.url).pathname.slice(1);
  try {
    return await env.DISPATCHER.get(name, {}, { limits: { cpuMs: 25 } }).fetch(request);
  } catch (error) {
    return new Response(String(error.message), { status: 599 });
  }
} }"""


@pytest.fixture
def api(cf_emulator_fresh):
    return Api(cf_emulator_fresh)


def serve(api, emulator, name, code, bindings):
    response = api.upload(name, code, metadata={"bindings": bindings})
    assert response.status_code == 200, response.text
    api.enable(name)
    return emulator.workers_dev_host(name)


def test_a_kv_binding_reads_and_writes_the_accounts_kv_store(api, cf_emulator_fresh):
    namespace = api.kv_namespace()
    values = f"/storage/kv/namespaces/{namespace}/values"
    api.call("PUT", f"{values}/from-api", data=b"written over REST")
    host = serve(api, cf_emulator_fresh, "kv-user", KV_WORKER, [kv_binding(namespace)])
    read = cf_emulator_fresh.worker_request(host, "/from-api").json()
    assert read == {"value": "written over REST", "metadata": None}
    assert cf_emulator_fresh.worker_request(host, "/k1", "PUT", data=b"from the worker").text == "stored"
    assert api.call("GET", f"{values}/k1").content == b"from the worker"
    read_back = cf_emulator_fresh.worker_request(host, "/k1").json()
    assert read_back == {"value": "from the worker", "metadata": {"by": "worker"}}
    assert cf_emulator_fresh.worker_request(host, "/").json() == [{"name": "k1", "metadata": {"by": "worker"}}]
    assert cf_emulator_fresh.worker_request(host, "/absent").json() == {"value": None, "metadata": None}
    # The binding's reads and writes are the runtime's, not API calls: only this test's five are logged.
    assert [c["method"] for c in cf_emulator_fresh.api_calls()] == ["POST", "PUT", "PUT", "POST", "GET"]


def test_a_worker_loader_binding_loads_code_at_run_time(api, cf_emulator_fresh):
    host = serve(api, cf_emulator_fresh, "loads", LOADS, [{"type": "worker_loader", "name": "LOADER"}])
    assert cf_emulator_fresh.worker_request(host).text == "loaded at run time"


GREETS_ITSELF = """import { WorkerEntrypoint } from "cloudflare:workers";
export class Greeter extends WorkerEntrypoint {
  greet(name) { return `hello ${name} from ${this.env.WHO}`; }
}
export default { async fetch(request, env, ctx) {
  return new Response(await ctx.exports.Greeter.greet("world"));
} }"""


def test_a_worker_loader_scripts_named_entrypoints_are_in_its_ctx_exports(api, cf_emulator_fresh):
    # The emulator wraps such a script's entry module (the CPU meter); its top-level exports
    # stay the script's own, as the loader host's tail entrypoint needs (host.js SigilTail).
    response = api.upload(
        "greets",
        GREETS_ITSELF,
        metadata={
            "bindings": [
                {"type": "worker_loader", "name": "LOADER"},
                {"type": "plain_text", "name": "WHO", "text": "v1"},
            ],
            "compatibility_flags": ["enable_ctx_exports"],
        },
    )
    assert response.status_code == 200, response.text
    api.enable("greets")
    answer = cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host("greets"))
    assert (answer.status_code, answer.text) == (200, "hello world from v1")


def test_a_dynamic_worker_past_its_limit_throws_into_its_loader_worker_and_the_others_never_notice(
    api, cf_emulator_fresh
):
    # They all run in the loader Worker's one process, which the emulator stops for the runaway.
    host = serve(api, cf_emulator_fresh, "loads", LOADS_SPINNER, [{"type": "worker_loader", "name": "LOADER"}])
    assert cf_emulator_fresh.worker_request(host, "/steady").text == "still here"
    with calling_steady(cf_emulator_fresh, host) as one, calling_steady(cf_emulator_fresh, host) as two:
        time.sleep(0.3)
        for _ in range(3):
            started = time.monotonic()
            stopped = cf_emulator_fresh.worker_request(host, "/spin")
            assert (stopped.status_code, stopped.text) == (599, CPU_EXCEEDED_MESSAGE)
            assert time.monotonic() - started < stopped_within(40)
        time.sleep(0.3)
    answers = one.answers + two.answers
    assert len(answers) > 6 and set(answers) == {(200, "still here")}


def test_a_dispatch_namespace_binding_reaches_namespace_scripts_and_throws_worker_not_found(api, cf_emulator_fresh):
    api.call("POST", "/workers/dispatch/namespaces", json={"name": "users"})
    echo = "export default { fetch(r) { return new Response('user ' + new URL(r.url).host, { status: 201 }) } }"
    api.upload("customer-1", echo, namespace="users")
    host = serve(
        api,
        cf_emulator_fresh,
        "dispatcher",
        DISPATCHES,
        [
            {"type": "dispatch_namespace", "name": "DISPATCHER", "namespace": "users"},
        ],
    )
    found = cf_emulator_fresh.worker_request(host, "/customer-1")
    # The user Worker sees the request as the dispatch Worker received it.
    assert (found.status_code, found.text) == (201, f"user {host}")
    missing = cf_emulator_fresh.worker_request(host, "/customer-2")
    assert (missing.status_code, missing.text) == (599, "Worker not found.")
    assert [(d["script"], d["limits"], d["status"]) for d in cf_emulator_fresh.dispatches()] == [
        ("customer-1", {"cpuMs": 25}, 201),
        ("customer-2", {"cpuMs": 25}, 404),
    ]


def test_a_reupload_runs_the_new_code(api, cf_emulator_fresh):
    host = serve(api, cf_emulator_fresh, "loads", LOADS, [{"type": "worker_loader", "name": "LOADER"}])
    assert cf_emulator_fresh.worker_request(host).status_code == 200
    serve(
        api,
        cf_emulator_fresh,
        "loads",
        "export default { fetch() { return new Response('v2') } }",
        [{"type": "worker_loader", "name": "LOADER"}],
    )
    assert cf_emulator_fresh.worker_request(host).text == "v2"


@pytest.mark.parametrize(
    ("binding", "code"),
    [
        # Cloudflare's code for a KV binding to a namespace the account lacks.
        ({"type": "kv_namespace", "name": "STORE", "namespace_id": "0" * 32}, 10042),
        ({"type": "dispatch_namespace", "name": "DISPATCHER", "namespace": "no-such"}, 10021),
        ({"type": "kv_namespace", "name": "STORE"}, 10021),
    ],
)
def test_a_binding_to_a_namespace_the_account_lacks_is_refused(api, binding, code):
    response = api.upload("broken", KV_WORKER, metadata={"bindings": [binding]})
    assert (response.status_code, first_error(response)) == (400, code)
    assert (
        "invalid" in response.json()["errors"][0]["message"] or "not valid" in response.json()["errors"][0]["message"]
    )


def test_text_bindings_of_a_bound_script_stay_out_of_its_config_file(api, cf_emulator_fresh, settings):
    namespace = api.kv_namespace()
    code = "export default { fetch(r, env) { return new Response(env.TOKEN + ' ' + typeof env.STORE) } }"
    host = serve(
        api,
        cf_emulator_fresh,
        "secretive",
        code,
        [
            kv_binding(namespace),
            {"type": "secret_text", "name": "TOKEN", "text": "s3cr3t-value"},
        ],
    )
    assert cf_emulator_fresh.worker_request(host).text == "s3cr3t-value object"
    configs = list((settings.VAR_DIR / "cfemulator").rglob("*.capnp"))
    assert configs and not [c for c in configs if "s3cr3t-value" in c.read_text()]


def test_reset_stops_every_scripts_workerd(api, cf_emulator_fresh, settings):
    serve(api, cf_emulator_fresh, "loads", LOADS, [{"type": "worker_loader", "name": "LOADER"}])
    assert cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host("loads")).status_code == 200
    assert list((settings.VAR_DIR / "cfemulator" / "scripts").iterdir())
    cf_emulator_fresh.reset()
    assert not list((settings.VAR_DIR / "cfemulator" / "scripts").iterdir())
    assert json.loads(json.dumps(cf_emulator_fresh.dispatches())) == []


FETCHES = """export default { async fetch(request, env) {
  try {
    const answer = await fetch(env.TARGET, { method: "POST", body: "from the worker" });
    return new Response(`${answer.status} ${await answer.text()}`);
  } catch (error) {
    return new Response(String(error.message), { status: 599 });
  }
} }"""


@pytest.mark.parametrize("bound", [False, True], ids=["plain script", "script with a KV binding"])
def test_a_workers_fetch_reaches_this_machines_loopback_as_cloudflare_reaches_a_public_origin(
    api, cf_emulator_fresh, bound
):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received = []

    class Origin(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "6")
            self.end_headers()
            self.wfile.write(b"origin")

        def log_message(self, *args) -> None:
            pass

    origin = ThreadingHTTPServer(("127.0.0.1", 0), Origin)
    threading.Thread(target=origin.serve_forever, daemon=True).start()
    try:
        bindings = [{"type": "plain_text", "name": "TARGET", "text": f"http://127.0.0.1:{origin.server_port}/"}]
        if bound:
            bindings.append(kv_binding(api.kv_namespace()))
        host = serve(api, cf_emulator_fresh, "fetches", FETCHES, bindings)
        answer = cf_emulator_fresh.worker_request(host, "/")
        assert (answer.status_code, answer.text) == (200, "200 origin")
        assert received == [b"from the worker"]
    finally:
        origin.shutdown()
        origin.server_close()


KV_LISTS = """export default { async fetch(request, env) {
  const url = new URL(request.url);
  if (url.pathname === "/short") {
    try {
      await env.STORE.put("short", "lived", { expirationTtl: 30 });
      return new Response("stored");
    } catch (error) {
      return new Response(String(error.message), { status: 599 });
    }
  }
  for (const key of ["k1", "k2", "k3"]) await env.STORE.put(key, "v", { expirationTtl: 60 });
  const first = await env.STORE.list({ prefix: "k", limit: 2 });
  const rest = await env.STORE.list({ prefix: "k", limit: 2, cursor: first.cursor });
  return Response.json({
    first: first.keys.map((k) => k.name), complete: first.list_complete, rest: rest.keys.map((k) => k.name),
  });
} }"""


def test_a_kv_bindings_own_writes_are_listed_at_once_in_pages_of_its_limit(api, cf_emulator_fresh):
    host = serve(api, cf_emulator_fresh, "lists", KV_LISTS, [kv_binding(api.kv_namespace())])
    listed = cf_emulator_fresh.worker_request(host, "/").json()
    assert listed == {"first": ["k1", "k2"], "complete": False, "rest": ["k3"]}
    # Workers KV holds expirationTtl to at least 60 s through a binding too.
    refused = cf_emulator_fresh.worker_request(host, "/short")
    assert refused.status_code == 599 and "KV PUT failed: 400" in refused.text
