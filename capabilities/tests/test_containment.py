"""A runaway capability on the local runtime stops only its own agent, and only until Sigil
stops it: real workerd processes under the session's supervisor, the real gateway over HTTP."""

import contextlib
import threading
import time

import pytest
import requests
from django.conf import settings

from capabilities.runtimes.local import STALL_MARGIN_MS
from sigil import redis_keys
from testsupport.capability_code import PONG
from testsupport.cast import wait_for

SPIN = "export default { async fetch() { while (true) {} } }"
HOG = "export default { async fetch() { const kept = []; while (true) kept.push(new Uint8Array(64 << 20).fill(1)) } }"
# On a loaded machine the watchdog's probes, the kill and the gateway's reading of its
# record can each be late; the issue asks for "the limit plus about a second".
SLACK_SECONDS = 3.0


def keep_calling(agent, path: str, stop: threading.Event, answers: list) -> None:
    session = requests.Session()  # a Session is not shared across threads
    headers = {"Authorization": f"Bearer {agent.invoke_token}"}
    while not stop.is_set():
        response = session.get(f"{agent.base_url}{path}", headers=headers, timeout=30)
        answers.append((response.status_code, response.headers.get("Retry-After"), response.text))
        time.sleep(0.01)


def health(sigil) -> dict:
    return requests.get(f"{sigil.url}/_health", timeout=10).json()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("code", "answers"),
    [
        (SPIN, {(504, "timeout", "ran past its CPU limit")}),
        # It also keeps the loop busy: on a loaded machine it can reach the CPU budget before
        # it reaches SIGIL_WORKERD_MEMORY_MB. Either way it is stopped, and named for it.
        (HOG, {(502, "capability_error", "ran past its memory limit"), (504, "timeout", "ran past its CPU limit")}),
    ],
    ids=["endless-loop", "unbounded-allocation"],
)
def test_a_runaway_capability_stops_only_its_own_agent_and_only_until_sigil_stops_it(
    sigil, alice, bob, redis_client, workerd_group, code, answers
):
    assert alice.deploy(name="runaway", code=code).status_code == 201
    assert alice.deploy(name="neighbour", code=PONG).status_code == 201
    assert bob.deploy(name="pong", code=PONG).status_code == 201
    assert bob.call("/bob/pong").text == "pong" and alice.call("/alice/neighbour").text == "pong"
    alice_workerd = workerd_group.get("alice")

    stop = threading.Event()
    bob_answers: list = []
    alice_answers: list = []
    bob_calls = threading.Thread(target=keep_calling, args=(bob, "/bob/pong", stop, bob_answers))
    alice_calls = threading.Thread(target=keep_calling, args=(alice, "/alice/neighbour", stop, alice_answers))
    runaway_answer: list = []
    runaway_call = threading.Thread(target=lambda: runaway_answer.append(timed_call(alice, "/alice/runaway")))
    bob_calls.start()
    try:
        time.sleep(0.3)  # bob's calls flowing before the runaway starts
        killed_before = alice_workerd.last_kill
        runaway_call.start()

        # alice's other capability is called while her process is stalled and restarting.
        # (A call of hers sent together with the runaway, before the loop stopped answering
        # its probes, would be blamed as well: the watchdog knows calls only by send time.)
        def stalled_and_past_blame() -> bool:
            blame_ends_at = alice_workerd.blame_ends_at()
            return (blame_ends_at is not None and time.time() > blame_ends_at) or (
                alice_workerd.last_kill is not killed_before
            )

        wait_for(stalled_and_past_blame, timeout=10, message="alice's workerd to stall")
        alice_calls.start()
        runaway_call.join(30)
        runaway, took = runaway_answer[0]

        error = runaway.json()["error"]
        assert any(
            runaway.status_code == status and error["code"] == code and words in error["message"]
            for status, code, words in answers
        ), runaway.text
        budget = (settings.SIGIL_CPU_MS + STALL_MARGIN_MS) / 1000
        assert took < budget + SLACK_SECONDS, took

        wait_for(lambda: health(sigil)["status"] == "ok", timeout=5, message="/_health to be ok again")
        wait_for(lambda: alice_answers and alice_answers[-1][0] == 200, timeout=5, message="alice served again")
        time.sleep(0.3)  # and calls keep flowing on the fresh process
    finally:
        stop.set()
        for thread in (bob_calls, alice_calls, runaway_call):
            if thread.is_alive():
                thread.join(30)

    # The other agent did not notice: every call answered.
    assert bob_answers and {answer[0] for answer in bob_answers} == {200}, bob_answers
    # The runaway's own agent was interrupted only briefly, and told to come back, not failed.
    interrupted = [answer for answer in alice_answers if answer[0] != 200]
    if code == SPIN:  # a call sent while the loop spun waited for the kill, then was told so
        assert interrupted
    assert all(answer[0] == 503 and answer[1] == "1" and "unavailable" in answer[2] for answer in interrupted), (
        interrupted
    )
    # Only the runaway's breaker moved.
    assert redis_client.get(redis_keys.breaker_failures("alice--runaway")) == b"1"
    assert redis_client.get(redis_keys.breaker_failures("alice--neighbour")) is None
    assert redis_client.get(redis_keys.breaker_failures("bob--pong")) is None


def timed_call(agent, path: str) -> tuple[requests.Response, float]:
    started = time.monotonic()
    response = requests.get(
        f"{agent.base_url}{path}", headers={"Authorization": f"Bearer {agent.invoke_token}"}, timeout=60
    )
    return response, time.monotonic() - started


@pytest.mark.slow
def test_code_whose_top_level_code_never_ends_is_refused_at_deploy(sigil, alice):
    refused = alice.deploy(name="stuck", code="while (true) {}\n" + PONG)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "invalid_request"
    assert "ran past its CPU limit" in refused.json()["error"]["message"]
    assert alice.call("/alice/stuck").status_code == 404  # nothing was created
    assert alice.deploy(name="fine", code=PONG).status_code == 201  # and alice is served again
    assert alice.call("/alice/fine").text == "pong"


# Streams a chunk every 100 ms for 5 s.
TRICKLE = """export default { async fetch() {
  const { readable, writable } = new TransformStream();
  (async () => {
    const writer = writable.getWriter();
    for (let i = 0; i < 50; i++) {
      await writer.write(new TextEncoder().encode('tick\\n'));
      await scheduler.wait(100);
    }
    await writer.close();
  })();
  return new Response(readable);
} }"""


@pytest.mark.slow
def test_a_response_cut_short_by_a_neighbours_runaway_is_not_counted_against_its_capability(sigil, alice, redis_client):
    assert alice.deploy(name="trickle", code=TRICKLE).status_code == 201
    assert alice.deploy(name="runaway", code=SPIN).status_code == 201
    stream = requests.get(
        f"{alice.base_url}/alice/trickle",
        headers={"Authorization": f"Bearer {alice.invoke_token}"},
        stream=True,
        timeout=30,
    )
    assert stream.status_code == 200
    lines = stream.iter_lines(chunk_size=1)  # each line as it arrives
    assert next(lines) == b"tick"
    time.sleep(0.8)  # well before the runaway: the watchdog does not blame it

    assert alice.call("/alice/runaway").status_code == 504
    received = 1
    with contextlib.suppress(requests.exceptions.RequestException):
        for _ in lines:
            received += 1
    assert received < 50  # the stream was cut when alice's workerd was stopped

    wait_for(lambda: redis_client.hget(redis_keys.stats("alice--runaway"), "calls") == b"1", message="calls recorded")
    assert redis_client.get(redis_keys.breaker_failures("alice--runaway")) == b"1"
    assert redis_client.get(redis_keys.breaker_failures("alice--trickle")) is None
