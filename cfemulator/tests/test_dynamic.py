"""A Worker Loader's Dynamic Workers, each in a workerd process of its own as each has an isolate
of its own on Cloudflare: one that spins is stopped at its own limit and holds up no other one,
and each keeps what its loader Worker gave it (its env, its entrypoints' props, its tails).
Over real HTTP, with real workerd."""

from __future__ import annotations

import json
import time

import pytest

from cfemulator.bound import DYNAMIC_CALL_HEADER, DYNAMIC_TAIL_HEADER
from cfemulator.limits import CPU_EXCEEDED_MESSAGE, dynamic_cpu_ms
from cfemulator.tests.test_api import Api, kv_binding
from cfemulator.tests.test_limits import stopped_within
from testsupport.cast import wait_for
from testsupport.steady import SteadyCalls

# The runaway's limit: long enough that a call held up until its stop cannot pass for a slow
# one; and a bound well below it that no other Dynamic Worker's call reaches.
SPIN_LIMIT_MS = 2000
UNDELAYED_SECONDS = 0.8

# Runs the Dynamic Worker named by the path's first segment, `{kind}-{anything}`: its code is
# the kind's. Each is given an env of plain values; `noisy-*` ones a tail of the loader
# Worker's own (kept in KV, named by the Dynamic Worker's id); `stub-*` ones an env value that
# is no plain value. What the Dynamic Worker throws is answered 599 with its name and message.
LOADER = """import { WorkerEntrypoint } from "cloudflare:workers";

export class Tail extends WorkerEntrypoint {
  async tail(events) {
    await this.env.SEEN.put(`${this.ctx.props.who}:${Date.now()}:${Math.random()}`, JSON.stringify(events));
  }
}

const CODE = {
  steady: "export default { async fetch(request) { return new Response('pong ' + (await request.text()).length) } }",
  spin: "export default { async fetch() { while (true) {} } }",
  noisy: `export default { async fetch(request, env) {
    console.log("hello", env.GREETING);
    if (new URL(request.url).pathname.endsWith("/boom")) throw new TypeError("exploded");
    return new Response("fine");
  } }`,
  named: `import { WorkerEntrypoint } from "cloudflare:workers";
    export class Greeter extends WorkerEntrypoint { fetch() { return new Response("hello " + this.ctx.props.name) } }
    export default { fetch() { return new Response("the default entrypoint") } }`,
  env: "export default { fetch(request, env) { return Response.json(env) } }",
  stub: "export default { fetch() { return new Response('never') } }",
  broken: "export default {",
};

export default { async fetch(request, env, ctx) {
  const id = new URL(request.url).pathname.split("/")[1];
  const kind = id.split("-")[0];
  const worker = env.LOADER.get(id, async () => ({
    compatibilityDate: "2025-01-01",
    mainModule: "m.js",
    modules: { "m.js": CODE[kind] },
    env: { GREETING: "hi from env", LIST: [1, { two: 2 }], ...(kind === "stub" ? { TAIL: ctx.exports.Tail } : {}) },
    tails: kind === "noisy" ? [ctx.exports.Tail({ props: { who: id } })] : [],
  }));
  try {
    const entrypoint = kind === "named"
      ? worker.getEntrypoint("Greeter", { props: { name: "from props" } })
      : worker.getEntrypoint(null, { limits: { cpuMs: Number(env.SPIN_LIMIT_MS) } });
    return await entrypoint.fetch(request);
  } catch (error) {
    return new Response(`${error.name}: ${error.message}`, { status: 599 });
  }
} }"""


@pytest.fixture
def api(cf_emulator_fresh):
    return Api(cf_emulator_fresh)


@pytest.fixture
def loads(api, cf_emulator_fresh):
    """The loader Worker's host, and the KV namespace its tails keep events in."""
    seen = api.kv_namespace("seen")
    response = api.upload(
        "loads",
        LOADER,
        metadata={
            "bindings": [
                {"type": "worker_loader", "name": "LOADER"},
                {**kv_binding(seen), "name": "SEEN"},
                {"type": "plain_text", "name": "SPIN_LIMIT_MS", "text": str(SPIN_LIMIT_MS)},
            ],
            "compatibility_flags": ["enable_ctx_exports"],
        },
    )
    assert response.status_code == 200, response.text
    api.enable("loads")
    return cf_emulator_fresh.workers_dev_host("loads"), seen


def test_each_dynamic_worker_runs_in_a_process_of_its_own(loads, cf_emulator_fresh):
    host, _ = loads
    for id_ in ("steady-a", "steady-b", "steady-a"):
        assert cf_emulator_fresh.worker_request(host, f"/{id_}/").text == "pong 0"
    running = {worker["id"]: worker for worker in cf_emulator_fresh.dynamic_workers()}
    assert set(running) == {"steady-a", "steady-b"}
    (loader_process,) = (process["name"] for process in cf_emulator_fresh.processes("script:loads"))
    assert {worker["owner"] for worker in running.values()} == {loader_process}
    pids = {worker["pid"] for worker in running.values()}
    assert len(pids) == 2 and None not in pids


def test_a_spinning_dynamic_worker_is_stopped_at_its_limit_and_holds_up_no_other_one(loads, cf_emulator_fresh):
    host, _ = loads
    body = b"x" * 4096
    assert cf_emulator_fresh.worker_request(host, "/steady-1/").text == "pong 0"
    gets = SteadyCalls(f"{cf_emulator_fresh.url}/steady-1/", headers={"Host": host}, join_timeout=30)
    posts = SteadyCalls(f"{cf_emulator_fresh.url}/steady-1/", headers={"Host": host}, body=body, join_timeout=30)
    with gets, posts:
        time.sleep(0.3)
        sent = time.monotonic()
        stopped = cf_emulator_fresh.worker_request(host, "/spin-1/")
        answered = time.monotonic()
        time.sleep(0.3)

    # As on Cloudflare: the loader Worker's fetch() throws, and its own code answers.
    assert (stopped.status_code, stopped.text) == (599, f"Error: {CPU_EXCEEDED_MESSAGE}")
    assert SPIN_LIMIT_MS / 1000 <= answered - sent < stopped_within(SPIN_LIMIT_MS)
    assert set(gets.answers) == {(200, "pong 0")}
    assert set(posts.answers) == {(200, f"pong {len(body)}")}
    timings = gets.timings + posts.timings
    assert len([at for at, _ in timings if sent <= at <= answered]) > 10
    assert max(took for _, took in timings) < UNDELAYED_SECONDS
    # Its next call runs it again, in a fresh process.
    stopped_again = cf_emulator_fresh.worker_request(host, "/spin-1/")
    assert (stopped_again.status_code, stopped_again.text) == (599, f"Error: {CPU_EXCEEDED_MESSAGE}")


def test_a_dynamic_worker_gets_the_plain_values_of_its_env_and_its_entrypoints_props(loads, cf_emulator_fresh):
    host, _ = loads
    assert cf_emulator_fresh.worker_request(host, "/env-1/").json() == {
        "GREETING": "hi from env",
        "LIST": [1, {"two": 2}],
    }
    assert cf_emulator_fresh.worker_request(host, "/named-1/").text == "hello from props"
    refused = cf_emulator_fresh.worker_request(host, "/stub-1/")
    assert refused.status_code == 599
    assert refused.text.startswith("TypeError: the emulator hands a Dynamic Worker only plain values in its env")


def test_what_a_dynamic_worker_throws_and_code_that_does_not_start_throw_into_its_loader_worker(
    loads, cf_emulator_fresh
):
    host, _ = loads
    thrown = cf_emulator_fresh.worker_request(host, "/noisy-throws/boom")
    assert (thrown.status_code, thrown.text) == (599, "TypeError: exploded")
    broken = cf_emulator_fresh.worker_request(host, "/broken-1/")
    assert broken.status_code == 599 and "Failed to start Worker" in broken.text


def test_a_dynamic_workers_tail_events_reach_the_tails_its_loader_worker_named(api, loads, cf_emulator_fresh):
    host, seen = loads

    def events():
        keys = [key["name"] for key in api.call("GET", f"/storage/kv/namespaces/{seen}/keys").json()["result"]]
        batches = {key: api.call("GET", f"/storage/kv/namespaces/{seen}/values/{key}").content for key in keys}
        found = [(key, event) for key, batch in batches.items() for event in json.loads(batch)]
        return found if len(found) >= 2 else None

    # Two calls, the second from another request than the one that gave the Dynamic Worker its tail.
    fine = cf_emulator_fresh.worker_request(host, "/noisy-1/ok", headers={"X-Request-Id": "call-1"})
    boom = cf_emulator_fresh.worker_request(host, "/noisy-1/boom", headers={"X-Request-Id": "call-2"})
    assert (fine.status_code, boom.status_code) == (200, 599)

    found = wait_for(events, timeout=20)
    assert {key.split(":")[0] for key, _ in found} == {"noisy-1"}  # the tail's own props
    by_id = {event["event"]["request"]["headers"]["x-request-id"]: event for _, event in found}
    ok, failed = by_id["call-1"], by_id["call-2"]
    assert ok["outcome"] == "ok" and ok["event"]["response"]["status"] == 200
    assert ok["event"]["request"]["url"] == f"http://{host}/noisy-1/ok"
    assert [(line["level"], line["message"]) for line in ok["logs"]] == [("log", ["hello", "hi from env"])]
    assert failed["outcome"] == "exception"
    assert [(x["name"], x["message"]) for x in failed["exceptions"]] == [("TypeError", "exploded")]
    # The emulator's own headers never reach the Dynamic Worker.
    assert not [name for name in ok["event"]["request"]["headers"] if name.startswith("x-cfemulator")]


def test_a_callers_own_emulator_headers_never_reach_the_loader_worker(loads, cf_emulator_fresh):
    host, _ = loads
    # Else a caller could hand a loader Worker's tails events of its own making.
    faked = {DYNAMIC_TAIL_HEADER: "some-key", DYNAMIC_CALL_HEADER: "some-key"}
    answer = cf_emulator_fresh.worker_request(host, "/steady-1/", headers=faked)
    assert (answer.status_code, answer.text) == (200, "pong 0")


def test_an_idle_dynamic_workers_process_is_stopped_and_its_next_call_starts_one(loads, cf_emulator_fresh):
    host, _ = loads
    cf_emulator_fresh.configure(dynamic_idle_seconds=0.5)
    assert cf_emulator_fresh.worker_request(host, "/steady-idle/").text == "pong 0"
    [worker] = cf_emulator_fresh.dynamic_workers()
    assert worker["pid"] is not None

    wait_for(lambda: cf_emulator_fresh.dynamic_workers()[0]["process"] is None, timeout=10)
    assert cf_emulator_fresh.worker_request(host, "/steady-idle/", "POST", data=b"back").text == "pong 4"
    [again] = cf_emulator_fresh.dynamic_workers()
    assert again["pid"] not in (None, worker["pid"])


@pytest.mark.parametrize(
    ("code", "entrypoint", "expected"),
    [
        (None, None, 30_000),
        ({"cpuMs": 50}, None, 50),
        (None, {"cpuMs": 50}, 50),
        ({"cpuMs": 50}, {"cpuMs": 500}, 50),
        ({"cpuMs": 500}, {"cpuMs": 50}, 50),
        ({"subRequests": 5}, {"cpuMs": 0}, 30_000),
    ],
)
def test_a_dynamic_workers_cpu_limit_is_the_lower_of_its_codes_and_its_entrypoints(code, entrypoint, expected):
    assert dynamic_cpu_ms(code, entrypoint, default=30_000) == expected
