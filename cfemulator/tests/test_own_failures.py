"""When the emulator itself fails a call (the script's workerd dies under it), the caller gets
what Cloudflare answers when its own side fails: its 500, from `server: cloudflare`, with a
ray id and a Retry-After, in the form `Accept` asks for; a dispatch Worker's `fetch()` throws
workerd's "internal error" instead. Over real HTTP, with real workerd."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from cfemulator.tests.test_api import Api
from testsupport.emulator import killed_under_a_call
from testsupport.processes import wait_until

# Says it runs (in its workerd's output), and answers once it has slept: a call is in flight
# in its process long enough to be cut there.
SLEEPS = """export default { async fetch() {
  console.log("sleepy runs");
  await new Promise((resolve) => setTimeout(resolve, 2000));
  return new Response("slept");
} }"""
DISPATCHES = """export default { async fetch(request, env) {
  try {
    return await env.DISPATCHER.get("sleepy").fetch(request);
  } catch (error) {
    return new Response(String(error.message), { status: 599 });
  }
} }"""


@pytest.fixture
def api(cf_emulator_fresh):
    return Api(cf_emulator_fresh)


def said_runs(workerd_output, times: int) -> Callable[[], bool]:
    """Whether the script has said it runs `times` times (once per call it ran)."""
    return lambda: workerd_output().count("sleepy runs") >= times


@pytest.mark.parametrize(
    ("accept", "content_type"),
    [(None, "text/html; charset=UTF-8"), ("application/json", "application/json; charset=utf-8")],
)
def test_a_call_whose_workerd_dies_gets_cloudflares_own_500(
    api, cf_emulator_fresh, workerd_output, accept, content_type
):
    assert api.upload("sleepy", SLEEPS).status_code == 200
    api.enable("sleepy")
    host = cf_emulator_fresh.workers_dev_host("sleepy")
    headers = {"Accept": accept} if accept else {}

    answer = killed_under_a_call(
        cf_emulator_fresh,
        ":sleepy",
        lambda: cf_emulator_fresh.worker_request(host, headers=headers),
        runs=said_runs(workerd_output, 1),
    )

    assert answer.status_code == 500
    assert answer.headers["Content-Type"] == content_type
    assert answer.headers["Server"] == "cloudflare"
    assert answer.headers["CF-Ray"] and answer.headers["Retry-After"] == "1"
    if accept:
        problem = json.loads(answer.content)
        assert (problem["error_code"], problem["error_category"], problem["status"]) == (500, "cloudflare", 500)
        assert (problem["cloudflare_error"], problem["retryable"], problem["retry_after"]) == (True, True, 1)
        assert problem["ray_id"] == answer.headers["CF-Ray"].split("-")[0]
    else:
        assert '<span class="cf-error-code">500</span>' in answer.text and "Cloudflare" in answer.text
    # Its supervisor starts it again (a call that meets the restart gets the same 500).
    wait_until(lambda: cf_emulator_fresh.worker_request(host).text == "slept", timeout=15, what="the script again")


def test_a_dispatch_workers_fetch_throws_an_internal_error_when_the_emulator_fails_its_user_worker(
    api, cf_emulator_fresh, workerd_output
):
    assert api.call("POST", "/workers/dispatch/namespaces", json={"name": "tenants"}).status_code == 200
    assert api.upload("sleepy", SLEEPS, namespace="tenants").status_code == 200
    binding = {"type": "dispatch_namespace", "name": "DISPATCHER", "namespace": "tenants"}
    assert api.upload("front", DISPATCHES, metadata={"bindings": [binding]}).status_code == 200
    api.enable("front")
    host = cf_emulator_fresh.workers_dev_host("front")

    answer = killed_under_a_call(
        cf_emulator_fresh,
        "tenants:sleepy",
        lambda: cf_emulator_fresh.worker_request(host),
        runs=said_runs(workerd_output, 1),
    )

    assert answer.status_code == 599
    assert answer.text.startswith("internal error; reference = ")
    assert [d["status"] for d in cf_emulator_fresh.dispatches()] == [500]
