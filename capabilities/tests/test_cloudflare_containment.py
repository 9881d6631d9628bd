"""A runaway capability on the Cloudflare runtimes, under the Cloudflare emulator, over real HTTP:
stopped at its CPU limit, counted against it alone, unnoticed by every other agent."""

from __future__ import annotations

import time

import pytest
import requests

from sigil import redis_keys
from testsupport.capability_code import COUNTS_BODY, PONG
from testsupport.steady import SteadyCalls

SPIN = "export default { async fetch() { while (true) {} } }"
HOG = "export default { async fetch() { const kept = []; while (true) kept.push(new Array(1e6).fill(1)) } }"
CPU_MS = 100


def stopped_within(cpu_ms: int) -> float:
    """Wall seconds a runaway with this CPU limit may take to be answered. Generous: the limit
    and the emulator's grace are CPU time, which a loaded machine's two cores hand out slowly;
    then the emulator's poll and its supervisor's kill."""
    return 3 * (cpu_ms + 100) / 1000 + 1.5


STOPPED_WITHIN_SECONDS = stopped_within(CPU_MS)
# A runaway's limit long enough that a call held up until its stop cannot pass for a slow one,
# and a bound well below it that a call of another agent never reaches, even on a loaded machine.
LONG_CPU_MS = 3000
UNDELAYED_SECONDS = 1.0


def caller(agent, path: str, *, body: bytes | None = None) -> SteadyCalls:
    """Calls `path` as `agent` over and over in a thread (POSTing `body` when given), keeping
    every status and body and how long each took."""
    headers = {"Authorization": f"Bearer {agent.invoke_token}"}
    return SteadyCalls(f"{agent.base_url}{path}", headers=headers, body=body)


def incident(alice, bob, *, runaway_calls: int = 3, code: str = SPIN):
    """alice's `spin` (`code`) called `runaway_calls` times while bob's `ping` and `pong` are
    called without pause; returns [(response, seconds)] of the runaway calls, and bob's answers."""
    assert alice.deploy(name="spin", code=code).status_code == 201
    assert bob.deploy(name="ping", code=PONG).status_code == 201
    assert bob.deploy(name="pong", code=PONG).status_code == 201
    assert bob.call("/bob/ping").text == "pong" and bob.call("/bob/pong").text == "pong"
    stopped = []
    with caller(bob, "/bob/ping") as ping, caller(bob, "/bob/pong") as pong:
        time.sleep(0.3)
        for _ in range(runaway_calls):
            started = time.monotonic()
            response = alice.call("/alice/spin")
            stopped.append((response, time.monotonic() - started))
        time.sleep(0.3)
    return stopped, ping.answers + pong.answers


def assert_contained(
    stopped,
    others,
    redis_client,
    *,
    status: int,
    code: str,
    message: str,
    within: float = STOPPED_WITHIN_SECONDS,
    or_answer: tuple[int, str, str] | None = None,
) -> None:
    """The runaway's calls got the answer (or `or_answer`, when either limit may be met
    first), and nobody else noticed."""
    answers = {(status, code, message)} | ({or_answer} if or_answer else set())
    for response, took in stopped:
        error = response.json()["error"]
        assert (response.status_code, error["code"], error["message"]) in answers
        assert took < within
    # Every call of the other agent succeeded, during the incident and after it.
    assert len(others) > 6
    assert set(others) == {(200, "pong")}
    # Only the runaway's breaker moved.
    assert int(redis_client.get(redis_keys.breaker_failures("alice--spin"))) == len(stopped)
    for innocent in ("bob--ping", "bob--pong"):
        assert redis_client.get(redis_keys.breaker_failures(innocent)) in (None, b"0")
        assert redis_client.get(redis_keys.breaker_open(innocent)) is None


def spin_stopped_at_its_cpu_limit(alice, bob, settings, redis_client) -> None:
    """alice's `spin`, under a CPU limit of CPU_MS, answers 504 `timeout` each time and nobody
    else notices; then Sigil is healthy again without anyone acting."""
    settings.SIGIL_CPU_MS = CPU_MS
    stopped, others = incident(alice, bob)
    assert_contained(
        stopped,
        others,
        redis_client,
        status=504,
        code="timeout",
        message=f"alice--spin ran past its CPU limit of {CPU_MS} ms and was stopped",
    )
    assert wait_healthy(alice.base_url)["checks"]["runtime"] == "ok"


def wait_healthy(base_url: str) -> dict:
    deadline = time.monotonic() + 5
    while (health := requests.get(f"{base_url}/_health", timeout=10)).status_code != 200:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.1)
    return health.json()


@pytest.mark.slow
def test_a_runaway_capability_on_the_platform_runtime_is_stopped_at_its_cpu_limit_unnoticed(
    platform, alice, bob, settings, redis_client
):
    spin_stopped_at_its_cpu_limit(alice, bob, settings, redis_client)
    # The emulator says why it stopped the calls.
    assert [d["status"] for d in platform.dispatches() if d["script"] == "alice--spin"] == [503] * 3


@pytest.mark.slow
def test_a_runaway_capability_on_the_loader_runtime_is_stopped_at_its_cpu_limit_unnoticed(
    loader, alice, bob, settings, redis_client
):
    # Its Dynamic Worker's own limit (not the loader Worker's 30 s) stops it.
    spin_stopped_at_its_cpu_limit(alice, bob, settings, redis_client)


@pytest.mark.slow
def test_a_runaway_dynamic_worker_on_the_loader_runtime_holds_up_no_other_agents_call(
    loader, alice, bob, settings, redis_client
):
    # On Cloudflare each Dynamic Worker has an isolate of its own, which no other one's spin
    # stops; on the emulator, a process of its own. So while alice's spins for its 3 s, bob's
    # calls (with a body too) answer as they always do.
    settings.SIGIL_CPU_MS = LONG_CPU_MS
    body = b"x" * 4096
    assert alice.deploy(name="spin", code=SPIN).status_code == 201
    assert bob.deploy(name="ping", code=PONG).status_code == 201
    assert bob.deploy(name="count", code=COUNTS_BODY).status_code == 201
    assert bob.call("/bob/ping").text == "pong"
    assert bob.call("/bob/count", method="POST", data=body).text == str(len(body))
    with caller(bob, "/bob/ping") as ping, caller(bob, "/bob/count", body=body) as count:
        time.sleep(0.3)
        sent = time.monotonic()
        stopped = alice.call("/alice/spin")
        answered = time.monotonic()
        time.sleep(0.3)

    error = stopped.json()["error"]
    assert (stopped.status_code, error["code"], error["message"]) == (
        504,
        "timeout",
        f"alice--spin ran past its CPU limit of {LONG_CPU_MS} ms and was stopped",
    )
    assert LONG_CPU_MS / 1000 <= answered - sent < stopped_within(LONG_CPU_MS)
    assert set(ping.answers) == {(200, "pong")}
    assert set(count.answers) == {(200, str(len(body)))}
    timings = ping.timings + count.timings
    during = sorted(took for at, took in timings if sent <= at <= answered)
    print(
        f"bob's calls while alice's spun for {answered - sent:.2f} s: {len(during)}, "
        f"median {during[len(during) // 2] * 1000:.0f} ms, slowest {during[-1] * 1000:.0f} ms; "
        f"slowest of all {max(took for _, took in timings) * 1000:.0f} ms"
    )
    assert len(during) > 10
    assert max(took for _, took in timings) < UNDELAYED_SECONDS
    assert int(redis_client.get(redis_keys.breaker_failures("alice--spin"))) == 1
    for innocent in ("bob--ping", "bob--count"):
        assert redis_client.get(redis_keys.breaker_failures(innocent)) in (None, b"0")


@pytest.mark.slow
def test_a_runaway_capability_on_the_worker_pool_runtime_is_stopped_by_cloudflares_limit_unnoticed(
    worker_pool, alice, bob, settings, redis_client
):
    # Sigil uploads each pool script with its CPU limit (limits.cpu_ms), which Cloudflare
    # enforces; the account's default (30 s) would hold the runaway far longer.
    settings.SIGIL_CPU_MS = CPU_MS
    stopped, others = incident(alice, bob, runaway_calls=2)
    assert_contained(
        stopped,
        others,
        redis_client,
        status=502,
        code="capability_error",
        message="alice--spin ran past its resource limits (CPU time or memory) and was stopped",
    )
    assert wait_healthy(alice.base_url)["checks"]["runtime"] == "ok"


@pytest.mark.slow
def test_a_capability_allocating_without_bound_on_the_platform_runtime_is_stopped_unnoticed(
    platform, alice, bob, redis_client, settings
):
    stopped, others = incident(alice, bob, runaway_calls=1, code=HOG)
    assert_contained(
        stopped,
        others,
        redis_client,
        status=502,
        code="capability_error",
        # The dispatch binding's exception, as Sigil's dispatch Worker passes on any other.
        message="alice--spin threw: Error: Worker exceeded memory limit.",
        # Filling memory is CPU work too: on a slow machine its CPU limit may be met first.
        or_answer=(504, "timeout", f"alice--spin ran past its CPU limit of {settings.SIGIL_CPU_MS} ms and was stopped"),
        within=15,  # the emulator's 512 MB per script process fill at the loaded machine's pace
    )
    assert wait_healthy(alice.base_url)["checks"]["runtime"] == "ok"


@pytest.mark.parametrize("runtime", ["worker_pool", "platform"])
def test_a_capabilitys_own_503_passes_through_and_is_not_read_as_cloudflares_1102(runtime, request, alice):
    request.getfixturevalue(runtime)
    busy = "export default { async fetch() { return new Response('come back later', { status: 503 }) } }"
    assert alice.deploy(name="busy", code=busy).status_code == 201
    response = alice.call("/alice/busy")
    assert (response.status_code, response.text) == (503, "come back later")
