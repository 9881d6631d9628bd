"""Tail Workers as Cloudflare runs them: a script uploaded with `tail_consumers`, and a
dispatch Worker's Tail Worker, which receives its user Workers' events; the events are the
TraceItems workerd produced, named for their producer."""

from __future__ import annotations

import json

import pytest

from cfemulator.tests.test_api import Api, first_error, kv_binding
from cfemulator.tests.test_bound import DISPATCHES
from testsupport.cast import wait_for

# Keeps every batch of events it is given in KV, one key per batch.
TAIL = """export default {
  async fetch() { return new Response("a tail worker") },
  async tail(events, env, ctx) {
    ctx.waitUntil(env.SEEN.put("batch:" + Date.now() + ":" + Math.random(), JSON.stringify(events)));
  },
}"""

NOISY = """export default { async fetch(request) {
  console.log("hello", { n: 1 });
  console.warn("careful");
  if (new URL(request.url).pathname.endsWith("/boom")) throw new TypeError("exploded");
  return new Response("fine");
} }"""


@pytest.fixture
def api(cf_emulator_fresh):
    return Api(cf_emulator_fresh)


def seen_events(api, namespace):
    values = f"/storage/kv/namespaces/{namespace}/values"
    keys = [k["name"] for k in api.call("GET", f"/storage/kv/namespaces/{namespace}/keys").json()["result"]]
    return [event for key in keys for event in json.loads(api.call("GET", f"{values}/{key}").content)]


def test_a_script_uploaded_with_tail_consumers_has_its_events_delivered_to_the_tail_worker(api, cf_emulator_fresh):
    seen = api.kv_namespace("seen")
    assert api.upload("tail", TAIL, metadata={"bindings": [{**kv_binding(seen), "name": "SEEN"}]}).status_code == 200
    response = api.upload("noisy", NOISY, metadata={"tail_consumers": [{"service": "tail"}]})
    assert response.status_code == 200, response.text
    settings = api.call("GET", "/workers/scripts/noisy/settings").json()["result"]
    assert settings["tail_consumers"] == [{"service": "tail"}]
    api.enable("noisy")
    host = cf_emulator_fresh.workers_dev_host("noisy")

    fine = cf_emulator_fresh.worker_request(host, "/ok", headers={"X-Request-Id": "call-1"})
    boom = cf_emulator_fresh.worker_request(host, "/boom", headers={"X-Request-Id": "call-2"})
    assert (fine.status_code, boom.status_code) == (200, 500)

    events = wait_for(lambda: (found := seen_events(api, seen)) and len(found) >= 2 and found, timeout=20)
    by_id = {e["event"]["request"]["headers"]["x-request-id"]: e for e in events}
    ok, failed = by_id["call-1"], by_id["call-2"]
    assert (ok["scriptName"], ok["outcome"], ok["event"]["response"]["status"]) == ("noisy", "ok", 200)
    assert [(line["level"], line["message"]) for line in ok["logs"]] == [
        ("log", ["hello", {"n": 1}]),
        ("warn", ["careful"]),
    ]
    assert ok["event"]["request"]["url"].endswith("/ok") and ok["exceptions"] == []
    assert failed["outcome"] == "exception"
    assert [(x["name"], x["message"]) for x in failed["exceptions"]] == [("TypeError", "exploded")]


def test_a_dispatch_workers_tail_worker_receives_its_user_workers_events(api, cf_emulator_fresh):
    seen = api.kv_namespace("seen")
    api.upload("tail", TAIL, metadata={"bindings": [{**kv_binding(seen), "name": "SEEN"}]})
    api.call("POST", "/workers/dispatch/namespaces", json={"name": "users"})
    api.upload("customer-1", NOISY, namespace="users")
    response = api.upload(
        "dispatcher",
        DISPATCHES,
        metadata={
            "bindings": [{"type": "dispatch_namespace", "name": "DISPATCHER", "namespace": "users"}],
            "tail_consumers": [{"service": "tail"}],
        },
    )
    assert response.status_code == 200, response.text
    api.enable("dispatcher")
    host = cf_emulator_fresh.workers_dev_host("dispatcher")
    assert cf_emulator_fresh.worker_request(host, "/customer-1", headers={"X-Request-Id": "call-3"}).text == "fine"

    def both():
        found = seen_events(api, seen)
        return {e["scriptName"]: e for e in found} if len(found) >= 2 else None

    events = wait_for(both, timeout=20)
    user = events["customer-1"]
    assert user["dispatchNamespace"] == "users" and user["outcome"] == "ok"
    assert [line["message"] for line in user["logs"]] == [["hello", {"n": 1}], ["careful"]]
    assert events["dispatcher"]["event"]["request"]["headers"]["x-request-id"] == "call-3"


@pytest.mark.parametrize("consumers", ["tail", [{"environment": "production"}], [{"service": "t", "extra": 1}]])
def test_a_malformed_tail_consumers_list_is_refused(api, consumers):
    response = api.upload("noisy", NOISY, metadata={"tail_consumers": consumers})
    assert response.status_code == 400 and first_error(response) == 10021


# Waits on a timer, then spends CPU (a fixed count of steps: workerd's clock stands still while
# code runs).
WAIT_MS = 150
SLOW = f"""export default {{ async fetch() {{
  await new Promise((resolve) => setTimeout(resolve, {WAIT_MS}));
  let x = 0;
  for (let i = 0; i < 20000000; i++) x = (x * 31 + i) | 0;
  return new Response(String(x));
}} }}"""


def test_each_event_carries_its_calls_wall_and_cpu_time_and_names_its_ray(api, cf_emulator_fresh):
    seen = api.kv_namespace("seen")
    api.upload("tail", TAIL, metadata={"bindings": [{**kv_binding(seen), "name": "SEEN"}]})
    api.upload("slow", SLOW, metadata={"tail_consumers": [{"service": "tail"}]})
    api.upload("quick", NOISY, metadata={"tail_consumers": [{"service": "tail"}]})
    api.enable("slow")
    api.enable("quick")
    # A caller's own ray id is not the call's: Cloudflare's front door gives each its own.
    slow = cf_emulator_fresh.worker_request(
        cf_emulator_fresh.workers_dev_host("slow"), "/", headers={"CF-Ray": "0000000000000000-XXX"}
    )
    quick = cf_emulator_fresh.worker_request(cf_emulator_fresh.workers_dev_host("quick"), "/ok")
    assert (slow.status_code, quick.status_code) == (200, 200)

    events = wait_for(lambda: (found := seen_events(api, seen)) and len(found) >= 2 and found, timeout=20)
    by_script = {event["scriptName"]: event for event in events}
    timed, untimed = by_script["slow"], by_script["quick"]
    assert timed["wallTime"] >= WAIT_MS and timed["cpuTime"] > 0
    assert timed["cpuTime"] <= timed["wallTime"] + 10  # the meter counts in 10 ms ticks
    assert untimed["wallTime"] < timed["wallTime"]
    rays = {event["event"]["request"]["headers"]["cf-ray"] for event in events}
    assert len(rays) == 2 and "0000000000000000-XXX" not in rays
    assert all(ray.endswith("-EMU") and len(ray) == 20 for ray in rays)
