"""Asynchronous calls: `Prefer: respond-async` answers 202 at once, the call runs on the
engine's runners, and its result is kept for its caller and posted to its callback."""

import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.models import Agent, AuditEvent
from capabilities.engine import runner
from capabilities.models import Capability
from sigil import redis_keys
from sigil.encryption import secret_encrypt
from sigil.redis_client import get_redis
from testsupport.capability_code import ECHO
from testsupport.cast import deploy_answering, wait_for
from testsupport.processes import wait_until
from testsupport.servers import database_url

ROOT = Path(__file__).resolve().parents[2]
ASYNC = {"Prefer": "respond-async"}
# Answers after a pause, so that a test can act while the call is in flight.
SLOW = """export default { async fetch(request) {
  await new Promise((resolve) => setTimeout(resolve, 2500));
  return new Response('slow ' + new URL(request.url).search);
} }"""


@pytest.fixture(autouse=True)
def callbacks_to_loopback(settings):
    """The tests' callback receiver listens on loopback, which callbacks may not reach unless
    the operator allows it."""
    settings.SIGIL_CALLBACK_ALLOWED_NETWORKS = ["127.0.0.0/8"]


def accepted(response) -> str:
    assert response.status_code == 202, response.text
    assert response.headers["Preference-Applied"] == "respond-async"
    body = response.json()
    assert body["status"] == "accepted"
    assert response.headers["Location"] == body["status_url"] == f"/_api/calls/{body['call']}"
    return body["status_url"]


def result_of(agent, status_url: str, timeout: float = 30.0):
    # Read with the deploy token, which a test may leave standing when it revokes the other.
    # A list, as a requests Response with a 4xx or 5xx status is false.
    return wait_for(
        lambda: (r := agent.call(status_url, token=agent.deploy_token)).status_code != 202 and [r],
        timeout=timeout,
        message="the call's result",
    )[0]


def subscribe(agent_name: str) -> str:
    secret = "callback-secret"
    Agent.objects.filter(name=agent_name).update(webhook_secret_encrypted=secret_encrypt(secret))
    return secret


def signed(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def test_a_warm_call_is_accepted_and_its_own_answer_fetched_by_polling(alice, celery_worker):
    alice.deploy(name="echo", code=ECHO)
    assert alice.call("/alice/echo").status_code == 207  # warm

    response = alice.call("/alice/echo/x?y=1", method="POST", data=b"hello", headers={**ASYNC, "X-Mine": "1"})
    result = result_of(alice, accepted(response))
    assert result.status_code == 207
    assert result.headers["x-echo"] == "yes"
    assert result.headers["X-Sigil-Capability"] == "alice--echo"
    echoed = result.json()
    assert echoed["method"] == "POST" and echoed["path"] == "/x" and echoed["query"] == "?y=1"
    assert echoed["body"] == "hello" and echoed["headers"]["x-mine"] == "1"
    # Addressed to Sigil, not the capability; and the caller's credentials are not passed on.
    assert "prefer" not in echoed["headers"] and "authorization" not in echoed["headers"]


def test_another_agent_gets_404_for_the_status_url(alice, bob, celery_worker):
    deploy_answering(alice, "ping", "pong")
    status_url = accepted(alice.call("/alice/ping", headers=ASYNC))
    assert result_of(alice, status_url).text == "pong"
    refused = bob.call(status_url)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found"
    assert bob.call("/_api/calls/no-such-call").status_code == 404


def test_an_async_call_counts_in_the_capabilitys_stats_and_goes_through_its_breaker(alice, settings, celery_worker):
    settings.SIGIL_BREAKER_THRESHOLD = 1
    alice.deploy(name="boom", code="export default { async fetch() { throw new Error('kaput') } }")
    result = result_of(alice, accepted(alice.call("/alice/boom", headers=ASYNC)))
    assert result.status_code == 502 and result.json()["error"]["code"] == "capability_error"
    redis = get_redis()
    assert int(redis.hget(redis_keys.stats("alice--boom"), "errors")) == 1
    assert redis.get(redis_keys.breaker_open("alice--boom")) is not None
    again = result_of(alice, accepted(alice.call("/alice/boom", headers=ASYNC)))
    assert again.status_code == 503 and again.json()["error"]["code"] == "degraded"


def test_a_call_to_a_paged_out_capability_is_run_once_it_is_paged_in(worker_pool, alice, celery_worker):
    for name in ("a", "b", "c", "d"):  # three slots: `a` is paged out
        deploy_answering(alice, name, name, type="normal")
    wait_for(lambda: Capability.objects.get(full_name="alice--a").state == "paged_out", message="a paged out")

    result = result_of(alice, accepted(alice.call("/alice/a", headers=ASYNC)))
    assert result.status_code == 200 and result.text == "a"
    assert result.headers["X-Sigil-Cold-Start"] == "1"
    assert Capability.objects.get(full_name="alice--a").state == "live"


def test_an_async_call_waits_out_a_placement_longer_than_a_call_would(worker_pool, alice, celery_worker, settings):
    from capabilities.services.placement import placement_lock

    settings.SIGIL_INVOKE_TIMEOUT_SECONDS = 2
    for name in ("a", "b", "c", "d"):  # three slots: `a` is paged out
        deploy_answering(alice, name, name, type="normal")
    wait_for(lambda: Capability.objects.get(full_name="alice--a").state == "paged_out", message="a paged out")
    placing = placement_lock("alice--a", blocking=False)  # a slow placement of `a` under way elsewhere
    # The page-out that marked `a` paged out lets go of its lock just after.
    wait_for(placing.acquire, message="the page-out of a to release its lock")
    try:
        status_url = accepted(alice.call("/alice/a", headers=ASYNC))
        direct = alice.call("/alice/a")  # a caller waits as long as a call may, then gives up
        assert direct.status_code == 504 and direct.json()["error"]["code"] == "timeout"
        time.sleep(1)
        assert alice.call(status_url).status_code == 202  # still waiting, past the call's own limit
    finally:
        placing.release()
    result = result_of(alice, status_url)
    assert (result.status_code, result.text) == (200, "a")


def test_the_result_is_posted_signed_to_the_callback_url(alice, webhook_receiver, celery_worker):
    secret = subscribe("alice")
    webhook_receiver.fail_first = 1  # the first delivery is retried
    deploy_answering(alice, "ping", "pong")
    status_url = accepted(alice.call("/alice/ping", headers={**ASYNC, "X-Callback-Url": webhook_receiver.url}))
    wait_for(lambda: webhook_receiver.received, timeout=30, message="the callback")
    headers, body = webhook_receiver.received[0]
    assert headers["x-sigil-signature"] == signed(secret, body)
    assert headers["x-sigil-event"] == "call.completed"
    delivery = json.loads(body)
    assert delivery["call"] == status_url.rsplit("/", 1)[1] == headers["x-sigil-delivery"]
    assert delivery["capability"] == "alice--ping"
    assert delivery["result"]["status"] == 200 and delivery["result"]["body"] == "pong"
    assert webhook_receiver.refused == 1 and len(webhook_receiver.received) == 1


def test_a_callback_of_an_agent_without_a_secret_is_signed_with_the_one_it_reads(
    alice, webhook_receiver, celery_worker
):
    assert Agent.objects.get(name="alice").webhook_secret == ""  # the default: none set
    deploy_answering(alice, "ping", "pong")
    accepted(alice.call("/alice/ping", headers={**ASYNC, "X-Callback-Url": webhook_receiver.url}))
    wait_for(lambda: webhook_receiver.received, timeout=30, message="the callback")
    headers, body = webhook_receiver.received[0]

    assert alice.call("/_api/agent/webhook").status_code == 403  # an invoke token may not read it
    shown = alice.call("/_api/agent/webhook", token="deploy")
    assert shown.status_code == 200 and shown.headers["Cache-Control"] == "no-store"
    secret = shown.json()["webhook_secret"]
    assert shown.json() == {"agent": "alice", "webhook_url": "", "webhook_secret": secret}
    assert headers["x-sigil-signature"] == signed(secret, body)
    assert alice.call("/_api/agent/webhook", token="deploy").json()["webhook_secret"] == secret  # kept
    created = AuditEvent.objects.filter(action="agent.webhook_secret_created", agent_name="alice")
    assert created.count() == 1 and secret not in json.dumps(created.get().detail)


def test_a_call_whose_token_is_revoked_before_it_runs_is_refused(alice, settings):
    from agents import services, tokens
    from agents.models import Token

    settings.SIGIL_ASYNC_RUNNERS = 0  # no runner takes it: it runs below, once the token is gone
    deploy_answering(alice, "ping", "pong")
    status_url = accepted(alice.call("/alice/ping", headers=ASYNC))
    token = Token.objects.get(secret_hash=tokens.hash_secret(alice.invoke_token))
    services.token_revoke(token=token, actor="owner:test")
    runner.run_now(call_id=status_url.rsplit("/", 1)[1])  # what a runner does
    result = result_of(alice, status_url)
    assert result.status_code == 401 and result.json()["error"]["code"] == "unauthenticated"


@pytest.mark.parametrize("url", ["ftp://example.invalid/x", "http://example.invalid:99999/", "/relative"])
def test_a_bad_callback_url_is_refused(alice, url):
    deploy_answering(alice, "ping", "pong")
    response = alice.call("/alice/ping", headers={**ASYNC, "X-Callback-Url": url})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_request"


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:6379/",  # Sigil's own Redis
        "http://localhost:5432/",
        "http://169.254.169.254/latest/meta-data/",  # a cloud's metadata service
        "http://10.1.2.3/hook",
        "http://[::1]:8000/",
        "http://[::ffff:192.168.0.1]/",
        # What a resolver also reads as a loopback or private address.
        "http://2130706433/",
        "http://0x7f.1/",
        "http://0177.0.0.1/",
        "http://127.1/",
        "http://127.0.0.1./",
        "http://0/",
        "http://0xa010203/",
        "http://[::ffff:7f00:1]/",
        "http://[fe80::1%25eth0]/",
        "http://%31%32%37.0.0.1/",
    ],
)
def test_a_callback_to_a_private_address_is_refused_at_once(alice, settings, url):
    settings.SIGIL_CALLBACK_ALLOWED_NETWORKS = []
    deploy_answering(alice, "ping", "pong")
    response = alice.call("/alice/ping", headers={**ASYNC, "X-Callback-Url": url})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and "private or reserved address" in error["message"]
    assert not get_redis().exists(redis_keys.async_pending("alice"))  # nothing was accepted


def test_a_callback_is_checked_again_when_it_is_delivered(alice, settings, webhook_receiver, celery_worker):
    settings.SIGIL_ASYNC_RUNNERS = 0  # run below, once the callback's address is no longer allowed
    deploy_answering(alice, "ping", "pong")
    status_url = accepted(alice.call("/alice/ping", headers={**ASYNC, "X-Callback-Url": webhook_receiver.url}))
    # As if the name had come to resolve to a private address since it was accepted.
    settings.SIGIL_CALLBACK_ALLOWED_NETWORKS = []
    runner.run_now(call_id=status_url.rsplit("/", 1)[1])  # the callback goes to the worker
    assert result_of(alice, status_url).text == "pong"  # the result itself is kept
    refused = wait_for(
        lambda: AuditEvent.objects.filter(action="webhook.refused", subject="alice--ping").first(),
        message="the refused delivery audited",
    )
    assert "127.0.0.1" in refused.detail["reason"] and "private or reserved" in refused.detail["reason"]
    assert webhook_receiver.received == [] and webhook_receiver.refused == 0


def test_an_async_call_to_an_unknown_capability_is_404_at_once(alice):
    assert alice.call("/alice/nothing", headers=ASYNC).status_code == 404


def test_a_large_result_is_kept_up_to_the_limit_and_marked(alice, settings, celery_worker):
    settings.SIGIL_ASYNC_RESULT_MAX_BYTES = 10
    deploy_answering(alice, "long", "abcdefghijklmnopqrstuvwxyz")
    result = result_of(alice, accepted(alice.call("/alice/long", headers=ASYNC)))
    assert result.content == b"abcdefghij" and result.headers["X-Sigil-Result-Truncated"] == "true"


def test_running_a_call_again_after_it_is_done_changes_nothing(alice, webhook_receiver, celery_worker):
    subscribe("alice")
    deploy_answering(alice, "ping", "pong")
    status_url = accepted(alice.call("/alice/ping", headers={**ASYNC, "X-Callback-Url": webhook_receiver.url}))
    assert result_of(alice, status_url).text == "pong"
    wait_for(lambda: webhook_receiver.received, message="the callback")
    call_id = status_url.rsplit("/", 1)[1]
    runner.run_now(call_id=call_id)  # run again, as after a runner's loss
    assert int(get_redis().hget(redis_keys.async_call(call_id), "attempts")) == 1
    assert len(webhook_receiver.received) == 1


@pytest.mark.slow
def test_a_call_survives_its_runner_being_killed_mid_call(alice, settings, webhook_receiver, tmp_path, celery_worker):
    from django.db import connection

    settings.SIGIL_ASYNC_RUNNERS = 0  # only the runner process below takes it, at first
    subscribe("alice")
    alice.deploy(name="slow", code=SLOW)
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "SIGIL_ACCESS_LOG": "false",
        "SIGIL_CALLBACK_ALLOWED_NETWORKS": "127.0.0.0/8",
    }
    command = [sys.executable, "manage.py", "runcalls"]
    with (tmp_path / "runcalls.log").open("wb") as log:
        runner = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        status_url = accepted(alice.call("/alice/slow?n=1", headers={**ASYNC, "X-Callback-Url": webhook_receiver.url}))
        call_id = status_url.rsplit("/", 1)[1]
        wait_until(
            lambda: alice.call(status_url).json().get("status") == "running",
            timeout=60,
            interval=0.1,
            what="the runner to start the call",
        )
        runner.kill()  # the runner's process dies mid-call, its lease with it
        runner.wait(timeout=30)
        settings.SIGIL_ASYNC_RUNNERS = 8  # the server's runners take it back once that lease lapses

        result = result_of(alice, status_url, timeout=60)
        assert result.status_code == 200 and result.text == "slow ?n=1"
        wait_for(lambda: webhook_receiver.received, timeout=30, message="the callback")
        assert int(get_redis().hget(redis_keys.async_call(call_id), "attempts")) == 2
        # Completed once: one result, one callback, one call recorded as answered.
        assert len(webhook_receiver.received) == 1
        assert json.loads(webhook_receiver.received[0][1])["result"]["body"] == "slow ?n=1"
        wait_for(lambda: get_redis().hget(redis_keys.stats("alice--slow"), "calls") == b"1", message="one call counted")
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=30)


@pytest.mark.slow
def test_calls_in_flight_when_redis_is_killed_all_end_once_it_is_back(alice, settings, own_redis, tmp_path):
    from django.db import connection

    settings.SIGIL_ASYNC_RUNNERS = 0  # the server's own runners are on the suite's Redis
    alice.deploy(name="slow", code=SLOW)
    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "REDIS_URL": own_redis.url,
        "SIGIL_ACCESS_LOG": "false",
    }
    status_urls = [accepted(alice.call(f"/alice/slow?n={i}", headers=ASYNC)) for i in range(6)]
    with (tmp_path / "runcalls.log").open("wb") as log:
        runner_process = subprocess.Popen(
            [sys.executable, "manage.py", "runcalls"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        wait_until(
            lambda: all(alice.call(url).json().get("status") == "running" for url in status_urls),
            timeout=60,
            interval=0.1,
            what="the runner to start every call",
        )
        # Redis dies while the calls are in flight, and stays away while they answer, so that
        # their runner cannot record them; it comes back from its append-only file.
        os.kill(own_redis.process.pid, signal.SIGKILL)
        own_redis.process.wait(timeout=10)
        time.sleep(4)
        own_redis.start()

        for i, url in enumerate(status_urls):
            result = result_of(alice, url, timeout=60)
            assert (result.status_code, result.text) == (200, f"slow ?n={i}"), url
        # The runner recorded nothing in Redis's absence: each call was run again.
        attempts = [
            int(get_redis().hget(redis_keys.async_call(url.rsplit("/", 1)[1]), "attempts")) for url in status_urls
        ]
        assert all(a >= 2 for a in attempts), attempts
        assert not get_redis().llen(redis_keys.ASYNC_QUEUE)
    finally:
        runner_process.kill()
        runner_process.wait(timeout=30)


def test_an_agent_with_its_limit_of_calls_waiting_is_refused_until_one_has_run(alice, bob, settings):
    settings.SIGIL_ASYNC_RUNNERS = 0  # no runner takes them: they wait, as behind busy runners
    settings.SIGIL_ASYNC_MAX_PENDING_PER_AGENT = 2
    deploy_answering(alice, "ping", "pong", public=True)
    waiting = [accepted(alice.call("/alice/ping", headers=ASYNC)) for _ in range(2)]

    refused = alice.call("/alice/ping", headers=ASYNC)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
    assert refused.headers["Retry-After"] == "1"
    accepted(bob.call("/alice/ping", headers=ASYNC))  # another agent's calls are its own

    runner.run_now(call_id=waiting[0].rsplit("/", 1)[1])  # one runs: room for one more
    assert result_of(alice, waiting[0]).text == "pong"
    accepted(alice.call("/alice/ping", headers=ASYNC))
    assert alice.call("/alice/ping", headers=ASYNC).status_code == 429
