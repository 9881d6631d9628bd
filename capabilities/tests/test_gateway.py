"""The gateway under failure and load: timeouts, the circuit breaker, expiry, concurrency,
and the warm path's promise of no SQL."""

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from agents.models import AuditEvent
from capabilities.models import Capability
from sigil import redis_keys
from testsupport.capability_code import FLAKY, PONG
from testsupport.cast import fail_flaky, wait_for

HANGS = "export default { async fetch() { await new Promise(r => setTimeout(r, 60000)); return new Response('late') } }"


def assert_error(response, status, code):
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


@pytest.mark.slow
def test_a_hung_capability_answers_504_and_counts_as_a_failure(alice, settings, redis_client):
    settings.SIGIL_INVOKE_TIMEOUT_SECONDS = 1
    alice.deploy(name="hangs", code=HANGS)
    started = time.monotonic()
    response = alice.call("/alice/hangs")
    assert_error(response, 504, "timeout")
    assert time.monotonic() - started < 5
    assert redis_client.get(redis_keys.breaker_failures("alice--hangs")) == b"1"


def test_breaker_opens_after_consecutive_failures_then_half_opens_and_closes(alice, settings, celery_worker):
    fail_flaky(alice, settings, threshold=5)  # each failure passed through unchanged
    refused = alice.call("/alice/flaky")
    assert_error(refused, 503, "degraded")
    assert int(refused.headers["Retry-After"]) >= 1
    wait_for(
        lambda: Capability.objects.get(full_name="alice--flaky").breaker_state == "open",
        message="breaker open in the registry",
    )

    time.sleep(1.1)
    # Half-open: the trial fails, so the breaker opens again for another cool-down.
    assert alice.call("/alice/flaky?fail=1").status_code == 500
    assert_error(alice.call("/alice/flaky"), 503, "degraded")

    time.sleep(1.1)
    trial = alice.call("/alice/flaky")
    assert trial.status_code == 200 and trial.text == "fine"
    assert alice.call("/alice/flaky").status_code == 200
    wait_for(
        lambda: Capability.objects.get(full_name="alice--flaky").breaker_state == "closed",
        message="breaker closed in the registry",
    )
    actions = set(AuditEvent.objects.filter(subject="alice--flaky").values_list("action", flat=True))
    assert {"capability.degraded", "capability.recovered"} <= actions


def test_successes_between_failures_keep_the_breaker_closed(alice, settings):
    settings.SIGIL_BREAKER_THRESHOLD = 3
    alice.deploy(name="flaky", code=FLAKY)
    for _ in range(4):
        assert alice.call("/alice/flaky?fail=1").status_code == 500
        assert alice.call("/alice/flaky?fail=1").status_code == 500
        assert alice.call("/alice/flaky").status_code == 200


def test_an_expired_ephemeral_answers_404_at_once(alice):
    full = alice.deploy(code=PONG, ttl=1).json()["capability"]
    path = "/" + full.replace("--", "/")
    assert alice.call(path).text == "pong"
    time.sleep(1.1)
    assert_error(alice.call(path), 404, "not_found")


def test_two_hundred_concurrent_invokes_all_succeed(alice):
    alice.deploy(name="ping", code=PONG)
    url = f"{alice.base_url}/alice/ping"
    headers = alice.headers(alice.invoke_token)

    def call(_):
        response = requests.get(url, headers=headers, timeout=60)
        return response.status_code, response.text

    with ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(call, range(200)))
    assert results == [(200, "pong")] * 200


def test_a_warm_call_runs_no_sql(alice):
    from testsupport.engine_calls import answers, call_request, sql_counted

    alice.deploy(name="ping", code=PONG)
    queries: list[str] = []
    # The first call fills the token and route caches; the second is counted.
    counting = contextlib.ExitStack()
    cold, warm = answers(
        [call_request(alice, "/alice/ping")],
        [call_request(alice, "/alice/ping")],
        between=lambda _: counting.enter_context(sql_counted(queries)),
    )
    counting.close()
    assert [(status, body) for status, _, body in cold + warm] == [(200, b"pong")] * 2
    assert queries == [], queries


def test_the_records_waiting_for_their_batch_are_applied_when_the_engine_stops(alice):
    from sigil.redis_client import get_redis
    from testsupport.engine_calls import answers, call_request

    alice.deploy(name="ping", code=PONG)
    [results] = answers([call_request(alice, "/alice/ping") for _ in range(5)])
    assert [status for status, _, _ in results] == [200] * 5
    # The engine stopped at once after the last answer, before its batch was due.
    assert int(get_redis().hget(redis_keys.stats("alice--ping"), "calls")) == 5


@pytest.mark.slow
def test_ttl_expiry_runs_on_beat_and_a_worker(alice, settings, celery_worker, tmp_path):
    import os
    import subprocess
    import sys

    from capabilities.runtimes import get_runtime

    full = alice.deploy(code=PONG, ttl=1).json()["capability"]
    assert full in get_runtime().list_slots()
    env = {
        **os.environ,
        "SIGIL_TTL_EXPIRY_INTERVAL_SECONDS": "0.5",
        "SIGIL_STATS_FLUSH_INTERVAL_SECONDS": "0.5",
    }
    beat = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "sigil_site",
            "beat",
            "--schedule",
            str(tmp_path / "beat-schedule"),
            "--loglevel",
            "WARNING",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: Capability.objects.get(full_name=full).state == "removed", timeout=15, message="expiry through beat"
        )
        assert AuditEvent.objects.filter(subject=full, action="capability.expired", actor="system").exists()
        wait_for(lambda: full not in get_runtime().list_slots(), timeout=10, message="the expired slot to be released")
    finally:
        beat.terminate()
        beat.wait(timeout=10)


def test_a_call_whose_workerd_dies_on_its_own_is_a_503_to_retry_and_not_the_capabilitys_failure(
    alice, redis_client, sigil
):
    import os
    import signal
    import threading

    from capabilities.runtimes import get_runtime
    from capabilities.workerd.group import read_status

    alice.deploy(name="slow", code="export default { async fetch() { await new Promise(r => setTimeout(r, 3000)); "
                 "return new Response('late') } }")  # fmt: skip
    assert alice.call("/alice/ping").status_code == 404  # the agent's workerd runs
    status_path = get_runtime().processes.status_path
    pid = read_status(status_path)["processes"]["alice"]["pid"]
    answers = []
    caller = threading.Thread(target=lambda: answers.append(alice.call("/alice/slow")))
    caller.start()
    wait_for(lambda: sigil.app.engine and sigil.app.engine.shares.calls.get("alice"), message="the call in flight")
    os.kill(pid, signal.SIGKILL)  # not the watchdog: it dies on its own
    caller.join(30)
    (answer,) = answers
    assert_error(answer, 503, "unavailable")
    assert answer.headers["Retry-After"] == "1"
    assert "its runtime process exited" in answer.json()["error"]["message"]
    assert redis_client.get(redis_keys.breaker_failures("alice--slow")) is None  # the breaker is not charged
    wait_for(lambda: alice.call("/alice/slow").status_code == 200, timeout=30, message="a fresh workerd to serve")


def test_an_unreachable_runtime_is_a_502_and_not_the_capabilitys_failure(alice, settings, redis_client, sigil):
    from capabilities.runtimes import runtimes_forget
    from sigil.ports import free_port

    alice.deploy(name="ping", code=PONG)
    settings.SIGIL_WORKERD_PORT = free_port()  # nothing listens there
    runtimes_forget()
    sigil.app.gateway = None
    response = alice.call("/alice/ping")
    assert_error(response, 502, "upstream_error")
    assert redis_client.get(redis_keys.breaker_failures("alice--ping")) is None  # the breaker is not charged
