"""The gateway's edge answers in the contract, whatever fails behind it: an unexpected error,
Redis gone, a page-in that holds its lock past the invoke timeout."""

import os
import re
import signal
import subprocess
import time

import pytest
import redis

from agents import tokens
from capabilities.books import copies
from capabilities.models import Capability, State
from capabilities.runtimes.worker_pool import pool_script_name
from capabilities.services.placement import placement_lock
from sigil import redis_keys
from sigil.embedded_redis import EmbeddedRedis
from sigil.redis_client import SOCKET_TIMEOUT_SECONDS, get_redis
from testsupport.capability_code import PONG
from testsupport.cast import wait_for


def assert_error(response, status, code):
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == code
    return response.json()["error"]["message"]


def test_an_unexpected_error_is_a_500_internal_error_logged_with_its_request_id(alice, caplog, access_log):
    alice.deploy(name="ping", code=PONG)
    # A route entry Sigil cannot read (written by an incompatible version, or by hand).
    get_redis().set(redis_keys.route("alice--ping"), b'{"id": 1}')

    answer = alice.call("/alice/ping")
    message = assert_error(answer, 500, "internal_error")

    request_id = re.search(r"request ([0-9a-f]{16})", message).group(1)
    assert answer.headers["X-Request-Id"] == request_id  # one id for the answer, its log lines and traceback
    logged = [r for r in caplog.records if r.name == "capabilities.engine" and request_id in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None  # the traceback, once
    # The access line carries the same id, as every line logged while serving the request.
    assert any(
        (line["path"], line["status"], line.get("request_id")) == ("/alice/ping", 500, request_id)
        for line in access_log()
    )


def test_an_unexpected_error_in_the_control_api_is_a_500_internal_error_with_a_request_id(alice, caplog):
    # A token cache entry Sigil cannot read: authentication itself fails unexpectedly.
    get_redis().set(redis_keys.token(tokens.hash_secret(alice.invoke_token)), b"not a cached token")

    listed = alice.session.get(f"{alice.base_url}/_api/capabilities", headers=alice.headers(alice.invoke_token))

    message = assert_error(listed, 500, "internal_error")
    request_id = re.search(r"request ([0-9a-f]{16})", message).group(1)
    assert listed.headers["X-Request-Id"] == request_id
    assert any(r.name == "sigil.errors" and request_id in r.getMessage() for r in caplog.records)
    assert any(r.name == "django.request" and r.exc_info for r in caplog.records)  # Django's traceback
    assert_error(alice.call("/alice/anything"), 500, "internal_error")  # the gateway reads the same entry


def test_redis_unreachable_is_503_unavailable_with_retry_after_and_recovers(own_redis, alice, access_log):
    alice.deploy(name="ping", code=PONG)
    assert alice.call("/alice/ping").text == "pong"  # the gateway now holds Redis connections

    own_redis.stop()
    refused = alice.call("/alice/ping")
    assert_error(refused, 503, "unavailable")
    assert int(refused.headers["Retry-After"]) >= 1
    assert any(line["status"] == 503 for line in access_log())
    listed = alice.session.get(f"{alice.base_url}/_api/capabilities", headers=alice.headers(alice.invoke_token))
    assert_error(listed, 503, "unavailable")
    assert int(listed.headers["Retry-After"]) >= 1

    own_redis.start()  # empty: the token and route caches fill again from the database
    assert alice.call("/alice/ping").text == "pong"


def restart_loading(server: EmbeddedRedis, *, keys: int = 200_000, key_load_delay_us: int = 30) -> None:
    """Restart `server` with enough data, read back slowly enough (Redis's own debug setting
    `key-load-delay`), that it answers LOADING for a few seconds; return once it does."""
    client = redis.Redis(unix_socket_path=str(server.socket_path))
    pipe = client.pipeline(transaction=False)
    for i in range(keys):
        pipe.set(f"test:padding:{i}", os.urandom(16).hex())
    pipe.execute()
    client.save()  # dump.rdb, which the next start reads back
    server.stop()
    server.prepare()
    server.process = subprocess.Popen(
        [*server.command(), "--key-load-delay", str(key_load_delay_us)], start_new_session=True
    )

    def loading():
        try:
            client.ping()
        except redis.BusyLoadingError:
            return True
        except redis.ConnectionError:
            return False  # not listening yet
        raise AssertionError("Redis finished loading before the test could see it load")

    wait_for(loading, timeout=10, message="Redis to be loading its data")


def test_a_redis_loading_its_data_is_503_unavailable_with_retry_after_then_serves(own_redis, alice):
    alice.deploy(name="ping", code=PONG)
    assert alice.call("/alice/ping").text == "pong"

    restart_loading(own_redis)
    refused = alice.call("/alice/ping")
    assert "reading its data back" in assert_error(refused, 503, "unavailable")
    assert int(refused.headers["Retry-After"]) >= 1
    listed = alice.session.get(f"{alice.base_url}/_api/capabilities", headers=alice.headers(alice.invoke_token))
    assert_error(listed, 503, "unavailable")

    wait_for(lambda: alice.call("/alice/ping").status_code == 200, timeout=60, message="Redis to finish loading")
    assert alice.call("/alice/ping").text == "pong"


@pytest.mark.slow
def test_a_hung_redis_is_503_unavailable_after_the_socket_timeout_not_a_hung_call(own_redis, alice):
    alice.deploy(name="ping", code=PONG)
    assert alice.call("/alice/ping").text == "pong"

    os.kill(own_redis.process.pid, signal.SIGSTOP)  # the server still accepts, never answers
    try:
        started = time.monotonic()
        assert_error(alice.call("/alice/ping"), 503, "unavailable")
        assert time.monotonic() - started < SOCKET_TIMEOUT_SECONDS + 10
    finally:
        os.kill(own_redis.process.pid, signal.SIGCONT)
    assert alice.call("/alice/ping").text == "pong"


def test_a_page_in_lock_held_past_the_invoke_timeout_is_504_not_a_wait_for_the_lock(alice, settings):
    settings.SIGIL_INVOKE_TIMEOUT_SECONDS = 1
    alice.deploy(name="ping", code=PONG)
    capability = Capability.objects.get(full_name="alice--ping")
    Capability.objects.filter(pk=capability.pk).update(state=State.PAGED_OUT)
    copies.copies_publish(capability.full_name)

    lock = placement_lock("alice--ping", blocking=False)
    assert lock.acquire()  # another placement of this capability, taking its time
    try:
        started = time.monotonic()
        assert_error(alice.call("/alice/ping"), 504, "timeout")
        # The lock's own wait is SIGIL_PLACEMENT_LOCK_SECONDS (180 s); the call gives up
        # after its invoke timeout instead (slack for a loaded machine).
        assert time.monotonic() - started < 15
        assert Capability.objects.get(pk=capability.pk).state == State.PAGED_OUT
    finally:
        lock.release()

    answered = alice.call("/alice/ping")
    assert answered.text == "pong" and answered.headers["X-Sigil-Cold-Start"] == "1"


def test_a_miss_whose_page_in_is_held_is_accepted_and_run_once_placed(
    worker_pool, alice, cf_client, settings, celery_worker
):
    settings.SIGIL_INVOKE_TIMEOUT_SECONDS = 1
    alice.deploy(name="ping", code=PONG)
    cf_client.script_delete(pool_script_name("alice--ping"))  # gone behind Sigil's back

    lock = placement_lock("alice--ping", blocking=False)
    assert lock.acquire()  # another call is already placing it again
    try:
        warming = alice.call("/alice/ping", headers={"Prefer": "respond-async"})
    finally:
        lock.release()
    assert warming.status_code == 202, warming.text
    assert warming.json()["status"] == "accepted"
    assert warming.headers["Preference-Applied"] == "respond-async"
    # The call the 202 accepted runs in the background, paging the capability in again.
    status_url = warming.json()["status_url"]
    result = wait_for(lambda: (r := alice.call(status_url)).status_code == 200 and r, message="the call's result")
    assert result.text == "pong"
    assert Capability.objects.get(full_name="alice--ping").state == State.LIVE
