"""When Cloudflare's own side fails a call (here the emulator: the workerd running the
capability is killed under the call), Sigil answers with the runtime's error, and the
capability's breaker and failure records do not hear of it: the code did nothing wrong."""

from __future__ import annotations

import pytest

from capabilities.books import failures
from capabilities.runtimes import get_runtime
from capabilities.tests.test_cloudflare_redeploy import script_running
from cfemulator.tests.test_own_failures import said_runs
from sigil import redis_keys
from testsupport.emulator import killed_under_a_call
from testsupport.processes import wait_until

SLEEPS = """export default { async fetch() {
  console.log("sleepy runs");
  await new Promise((resolve) => setTimeout(resolve, 2000));
  return new Response("slept");
} }"""
FULL = "alice--sleepy"
# (the runtime, whose process is killed) -> what Sigil answers. Where the killed process's
# answer was Cloudflare's own 500 (with its Retry-After), `503 unavailable`: the pooled
# script's, or the platform's dispatch Worker's (the capability's user Worker then ran on,
# for nobody). Where it ran the user Worker, the dispatch Worker's fetch() threw Cloudflare's
# "internal error", which says no wait: `502 upstream_error`.
CASES = {
    ("worker-pool", "script"): (503, "unavailable", "1"),
    ("platform", "dispatch Worker"): (503, "unavailable", "1"),
    ("platform", "user Worker"): (502, "upstream_error", None),
}


@pytest.fixture(params=sorted(CASES), ids=lambda case: f"{case[0]}-{case[1].replace(' ', '-')}")
def case(request, settings):
    """(the runtime, whose process is killed), Sigil on that runtime against the fresh emulator
    (set up before the test runs: starting the deploy worker configures logging anew)."""
    request.getfixturevalue(request.param[0].replace("-", "_"))
    # Call records off: the capability's console.log then reaches workerd's output, where the
    # test sees that the call runs (it would reach only Sigil's Tail Worker otherwise).
    settings.SIGIL_LOGS_ENABLED = False
    return request.param


@pytest.mark.slow
def test_a_failure_of_cloudflares_own_side_is_the_runtimes_not_the_capabilitys(
    case, cf_emulator_fresh, alice, redis_client, workerd_output
):
    assert alice.deploy(name="sleepy", code=SLEEPS).status_code == 201
    assert alice.call("/alice/sleepy").text == "slept"
    wait_until(said_runs(workerd_output, 1), timeout=10, what="the first call's line")
    script = get_runtime().front.name if case[1] == "dispatch Worker" else script_running(FULL)

    answer = killed_under_a_call(
        cf_emulator_fresh, f":{script}", lambda: alice.call("/alice/sleepy"), runs=said_runs(workerd_output, 2)
    )

    status, code, retry_after = CASES[case]
    assert (answer.status_code, answer.json()["error"]["code"]) == (status, code)
    assert answer.json()["error"]["message"].startswith(f"the runtime failed to run {FULL} on its own side")
    assert answer.headers.get("Retry-After") == retry_after
    assert redis_client.get(redis_keys.breaker_failures(FULL)) in (None, b"0")
    assert redis_client.get(redis_keys.breaker_open(FULL)) is None
    assert failures.failures_list(full=FULL) == []
    wait_until(lambda: alice.call("/alice/sleepy").text == "slept", timeout=20, what="the capability again")
