"""A script that runs past its CPU limit is stopped with Cloudflare's error 1102, and every
other script keeps answering; over real HTTP, with real workerd."""

from __future__ import annotations

import json
import time

import pytest

from cfemulator.errorpages import negotiate
from cfemulator.limits import DEFAULT_CPU_MS, call_cpu_ms, exceeded_answer
from cfemulator.tests.test_api import HELLO, Api, first_error
from testsupport.steady import SteadyCalls

# Spins on /spin; answers at once anywhere else.
SPINNER = """export default { async fetch(request) {
  if (new URL(request.url).pathname.endsWith("/spin")) { while (true) {} }
  return new Response("still here");
} }"""
DISPATCHES = """export default { async fetch(request, env) {
  const name = new URL(request.url).pathname.split("/")[1];
  try {
    return await env.DISPATCHER.get(name, {}, { limits: { cpuMs: 40 } }).fetch(request);
  } catch (error) {
    return new Response(String(error.message), { status: 599 });
  }
} }"""
LIMIT_MS = 40


def stopped_within(limit_ms: int) -> float:
    """Wall seconds a call with this CPU limit may take before it is stopped. Generous: the
    limit and the grace are CPU time, which a loaded machine's two cores hand out slowly,
    then the meter's poll and the supervisor's kill."""
    return 3 * (limit_ms + 100) / 1000 + 1.5


STOPPED_WITHIN_SECONDS = stopped_within(LIMIT_MS)


@pytest.fixture
def api(cf_emulator_fresh):
    return Api(cf_emulator_fresh)


def calling_steady(emulator, host: str) -> SteadyCalls:
    """Calls a well-behaved Worker over and over in a thread, keeping every answer."""
    return SteadyCalls(emulator.url + "/steady", headers={"Host": host}, join_timeout=30)


def test_a_script_past_its_cpu_limit_gets_1102_while_other_scripts_keep_answering(api, cf_emulator_fresh):
    assert api.upload("spinner", SPINNER, metadata={"limits": {"cpu_ms": LIMIT_MS}}).status_code == 200
    assert api.upload("steady", HELLO).status_code == 200
    api.enable("spinner")
    api.enable("steady")
    spinner = cf_emulator_fresh.workers_dev_host("spinner")

    with calling_steady(cf_emulator_fresh, cf_emulator_fresh.workers_dev_host("steady")) as steady:
        time.sleep(0.2)
        started = time.monotonic()
        stopped = cf_emulator_fresh.worker_request(spinner, "/spin")
        took = time.monotonic() - started
        as_json = cf_emulator_fresh.worker_request(spinner, "/spin", headers={"Accept": "application/json"})
        time.sleep(0.2)

    assert stopped.status_code == 503
    assert took < STOPPED_WITHIN_SECONDS
    assert stopped.headers["Content-Type"] == "text/html; charset=UTF-8"
    assert stopped.headers["Server"] == "cloudflare" and stopped.headers["CF-Ray"]
    assert '<span class="cf-error-code">1102</span>' in stopped.text
    assert "<title>Worker exceeded resource limits | spinner.sigil-emulator.workers.dev | Cloudflare" in stopped.text
    problem = as_json.json()
    assert (as_json.status_code, as_json.headers["Content-Type"]) == (503, "application/json; charset=utf-8")
    assert problem == {
        **problem,
        "title": "Error 1102: Worker exceeded resource limits",
        "status": 503,
        "error_code": 1102,
        "error_name": "worker_exceeded_resources",
        "retryable": False,
        "zone": "workers.dev",
    }
    assert problem["instance"] == problem["ray_id"] == as_json.headers["CF-Ray"].split("-")[0]
    # The other script never noticed; the stopped one answers again, from a fresh process.
    assert len(steady.answers) > 3
    assert set(steady.answers) == {(200, "hello /steady")}
    assert cf_emulator_fresh.worker_request(spinner, "/").text == "still here"


def test_a_dispatch_namespace_script_past_its_limit_makes_the_fetcher_throw(api, cf_emulator_fresh):
    api.call("POST", "/workers/dispatch/namespaces", json={"name": "users"})
    api.upload("runaway", SPINNER, namespace="users")
    api.upload("steady", HELLO, namespace="users")
    binding = [{"type": "dispatch_namespace", "name": "DISPATCHER", "namespace": "users"}]
    assert api.upload("dispatcher", DISPATCHES, metadata={"bindings": binding}).status_code == 200
    api.enable("dispatcher")
    host = cf_emulator_fresh.workers_dev_host("dispatcher")

    with calling_steady(cf_emulator_fresh, host) as steady:
        started = time.monotonic()
        stopped = cf_emulator_fresh.worker_request(host, "/runaway/spin")
        took = time.monotonic() - started

    # As on Cloudflare: the dispatch Worker's fetch() throws, with the platform's words.
    assert (stopped.status_code, stopped.text) == (599, "Worker exceeded CPU time limit.")
    assert took < STOPPED_WITHIN_SECONDS
    assert steady.answers and set(steady.answers) == {(200, "hello /steady")}
    assert cf_emulator_fresh.worker_request(host, "/runaway/").text == "still here"
    logged = [(d["script"], d["limits"], d["status"]) for d in cf_emulator_fresh.dispatches()]
    assert ("runaway", {"cpuMs": LIMIT_MS}, 503) in logged


@pytest.mark.slow
def test_a_script_past_the_memory_limit_gets_1102_too(api, cf_emulator_fresh):
    hog = "export default { async fetch() { const kept = []; while (true) kept.push(new Array(1e6).fill(1)) } }"
    api.upload("hog", hog, metadata={"limits": {"cpu_ms": 60_000}})
    api.upload("steady", HELLO)
    api.enable("hog")
    api.enable("steady")
    with calling_steady(cf_emulator_fresh, cf_emulator_fresh.workers_dev_host("steady")) as steady:
        stopped = cf_emulator_fresh.worker_request(
            cf_emulator_fresh.workers_dev_host("hog"), headers={"Accept": "application/json"}
        )
    assert (stopped.status_code, stopped.json()["error_code"]) == (503, 1102)
    assert steady.answers and set(steady.answers) == {(200, "hello /steady")}


@pytest.mark.slow
def test_an_upload_whose_top_level_never_ends_is_10021_and_the_account_keeps_serving(api, cf_emulator_fresh):
    api.upload("steady", HELLO)
    api.enable("steady")
    with calling_steady(cf_emulator_fresh, cf_emulator_fresh.workers_dev_host("steady")) as steady:
        started = time.monotonic()
        refused = api.upload("stuck", "while (true) {}\nexport default { fetch() { return new Response('never') } }")
        took = time.monotonic() - started
    assert (refused.status_code, first_error(refused)) == (400, 10021)
    assert refused.json()["errors"][0]["message"] == "Script startup exceeded CPU time limit."
    assert took < stopped_within(1000)  # Cloudflare's startup limit of 1 s of CPU
    assert steady.answers and set(steady.answers) == {(200, "hello /steady")}
    assert [s["id"] for s in api.call("GET", "/workers/scripts").json()["result"]] == ["steady"]
    assert api.upload("fine", HELLO).status_code == 200  # the start checks' process was replaced


def test_a_script_within_its_limit_is_not_stopped(api, cf_emulator_fresh):
    busy = """export default { async fetch() {
      const until = Date.now() + 30; let n = 0; while (Date.now() < until) n++;
      return new Response("done");
    } }"""
    api.upload("busy", busy, metadata={"limits": {"cpu_ms": 1000}})
    api.enable("busy")
    host = cf_emulator_fresh.workers_dev_host("busy")
    assert [cf_emulator_fresh.worker_request(host).text for _ in range(5)] == ["done"] * 5


@pytest.mark.parametrize(
    ("script", "dispatch", "expected"),
    [
        ({}, None, DEFAULT_CPU_MS),
        ({"cpu_ms": 50}, None, 50),
        ({}, {"cpuMs": 25}, 25),
        ({"cpu_ms": 50}, {"cpuMs": 500}, 50),
        ({"cpu_ms": 500}, {"cpuMs": 50}, 50),
        ({}, {"subRequests": 5}, DEFAULT_CPU_MS),
        ({}, "not json", DEFAULT_CPU_MS),
    ],
)
def test_a_calls_cpu_limit(script, dispatch, expected):
    assert call_cpu_ms(script, dispatch) == expected


@pytest.mark.parametrize(
    ("accept", "form"),
    [
        (None, "html"),
        ("*/*", "html"),
        ("text/html,application/xhtml+xml,*/*;q=0.8", "html"),
        ("application/json", "json"),
        ("application/problem+json", "problem+json"),
        ("application/json, text/markdown;q=0.9", "json"),
        ("text/markdown", "markdown"),
        ("text/markdown, application/json", "markdown"),
        ("text/markdown, text/html;q=0.9", "markdown"),
        ("text/*", "markdown"),
        ("text/html;q=0.5, application/json;q=0.4", "html"),
        ("application/json;q=0", "html"),
        ("image/png", "html"),
    ],
)
def test_the_1102_answer_is_negotiated_as_cloudflare_documents(accept, form):
    assert negotiate(accept) == form


def test_the_1102_answer_in_markdown_and_problem_json():
    markdown = exceeded_answer(host="x.sub.workers.dev", accept="text/markdown")
    assert markdown.content_type == "text/markdown; charset=utf-8"
    front = markdown.body.decode().split("---\n")[1]
    assert "error_code: 1102\n" in front and "status: 503\n" in front and "retryable: false\n" in front
    assert "## What happened" in markdown.body.decode() and "## What you should do" in markdown.body.decode()
    problem = exceeded_answer(host="x.sub.workers.dev", accept="application/problem+json")
    assert problem.content_type == "application/problem+json; charset=utf-8"
    assert json.loads(problem.body)["type"].endswith("/cloudflare-1xxx-errors/error-1102/")
