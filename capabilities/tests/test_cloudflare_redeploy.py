"""A redeploy on the Cloudflare runtimes, under the Cloudflare emulator, over real HTTP: as on
Cloudflare, the calls the old version is serving finish there while new calls reach the new
one, and nothing of it counts against the capability."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from capabilities.books import failures
from capabilities.runtimes import get_runtime
from sigil import redis_keys
from testsupport.processes import wait_until

# Answers which version it is, once it has slept: calls stay in flight across the redeploy
# (long enough to outlast it on a loaded machine, which the test checks).
SLEEPS = """export default { async fetch() {
  await new Promise((resolve) => setTimeout(resolve, 3000));
  return new Response("%s");
} }"""
FULL = "alice--sleepy"
# (the runtime's fixture, whether call records are on). With them on, a worker-pool script
# (Sigil's Tail Worker is its tail consumer) and a platform user Worker (tailed through the
# dispatch Worker) run from a workerd config of their own, a process per version; with them
# off, a pooled script runs in the emulator's loader host, and the loader runtime's code runs
# as Dynamic Workers of its loader Worker: one process serves every version.
CASES = {
    "worker-pool": ("worker_pool", True),
    "worker-pool-plain": ("worker_pool", False),
    "platform": ("platform", True),
    "loader": ("loader", True),
}


@pytest.fixture(params=sorted(CASES))
def emulator(request, settings):
    fixture, records = CASES[request.param]
    emulator = request.getfixturevalue(fixture)
    settings.SIGIL_LOGS_ENABLED = records
    if fixture == "worker_pool" and records:
        emulator.configure(script_limit=8)  # Sigil's Tail Worker takes the script reserved for it
    return emulator


def script_running(full: str) -> str:
    """The name of the account's script whose process runs `full`'s code."""
    runtime = get_runtime()
    return runtime.front.name if runtime.name == "loader" else runtime.slot_for(full)


@pytest.mark.slow
def test_a_redeploy_lets_the_calls_in_flight_finish_on_the_old_version(emulator, alice, redis_client):
    assert alice.deploy(name="sleepy", code=SLEEPS % "old").status_code == 201
    assert alice.call("/alice/sleepy").text == "old"
    script = script_running(FULL)

    def in_flight() -> int:
        return sum(process["calls"] for process in emulator.processes(f":{script}"))

    with ThreadPoolExecutor(4) as pool:
        calls = [pool.submit(alice.call, "/alice/sleepy") for _ in range(3)]
        wait_until(lambda: in_flight() >= 3, timeout=10, what="three calls in flight in the script's process")
        redeployed = alice.deploy(name="sleepy", code=SLEEPS % "new")
        assert redeployed.status_code == 200, redeployed.text
        assert in_flight() >= 3, "the calls ended before the redeploy did: nothing was tested"
        # A call sent now, while the old version still serves three, gets the new one.
        after = pool.submit(alice.call, "/alice/sleepy")
        answers = [call.result() for call in calls]

    # Each was answered by the version that had it in flight.
    assert [(answer.status_code, answer.text) for answer in answers] == [(200, "old")] * 3
    assert (after.result().status_code, after.result().text) == (200, "new")
    assert redis_client.get(redis_keys.breaker_failures(FULL)) in (None, b"0")
    assert redis_client.get(redis_keys.breaker_open(FULL)) is None
    assert failures.failures_list(full=FULL) == []
    # The old version's process, if it had one of its own, stopped once its calls had ended.
    wait_until(
        lambda: not any(process["replaced"] for process in emulator.processes(f":{script}")),
        timeout=10,
        what="the replaced version's process to stop",
    )
    assert {process["state"] for process in emulator.processes(f":{script}")} == {"serving"}
