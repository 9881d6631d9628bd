"""Cloudflare's API budget through the real parts, on every Cloudflare runtime: Sigil's REST API
and gateway over HTTP, the emulator over HTTP, a real Celery worker. A spent budget answers a
cold call at once in one sentence; warm calls, and a process started meanwhile, never need
the API; housekeeping in a loop leaves deploys and page-ins their requests."""

from __future__ import annotations

import contextlib
import re
import threading
import time

import pytest
import requests

from capabilities import services, tasks
from capabilities.models import Capability
from capabilities.runtimes import runtimes_forget
from capabilities.runtimes.api_work import ApiClass, api_work
from capabilities.runtimes.cloudflare import CloudflareClient, CloudflareRateLimited
from capabilities.runtimes.errors import RuntimeUnavailable
from sigil import redis_keys
from testsupport.cast import deploy_answering as deploy
from testsupport.cast import wait_for

RUNTIMES = ["worker_pool", "platform", "loader"]


@pytest.fixture(params=RUNTIMES)
def cloudflare(request, cf_settings):
    """Sigil on one Cloudflare runtime (each in turn), with a budget of `SIGIL_CF_RATE_LIMIT`
    requests per 45 s: longer than a call may wait (SIGIL_INVOKE_TIMEOUT_SECONDS, 30 s)."""
    emulator = request.getfixturevalue(request.param)
    cf_settings.SIGIL_INVOKE_TIMEOUT_SECONDS = 30
    cf_settings.SIGIL_CF_RATE_LIMIT = 60
    cf_settings.SIGIL_CF_RATE_WINDOW_SECONDS = 45
    runtimes_forget()
    return emulator


def spend_the_budget() -> None:
    """Take what is left of Sigil's API budget, as page-ins in other processes would: every
    request the budget gives any class."""
    client = CloudflareClient.from_settings()
    try:
        with api_work(ApiClass.PAGE_IN, wait_seconds=0):
            while True:
                client.script_list()
    except CloudflareRateLimited:
        return
    finally:
        client.close()


def paged_out(alice, name: str) -> None:
    """`name` deployed, then paged out by the owner: its next call pages it in."""
    deploy(alice, name, name)
    services.capability_evict(full=f"alice--{name}", actor="owner:test")
    assert Capability.objects.get(full_name=f"alice--{name}").state == "paged_out"


NO_ROOM = re.compile(
    r"Sigil could not place alice--cold: Cloudflare's API budget has no room for (\d+) s, "
    r"longer than this call may wait \(([\d.]+) s\)"
)


def test_a_cold_call_under_a_spent_budget_is_503_at_once_in_one_sentence(cloudflare, alice, settings):
    paged_out(alice, "cold")
    spend_the_budget()
    calls_before = len(cloudflare.api_calls())

    started = time.monotonic()
    answer = alice.call("/alice/cold")
    took = time.monotonic() - started

    assert answer.status_code == 503, answer.text
    assert took < 5, f"the first cold call waited {took:.1f} s"  # the call may wait 30 s
    error = answer.json()["error"]
    assert error["code"] == "unavailable"
    said = NO_ROOM.fullmatch(error["message"])
    assert said, error["message"]
    # The time it says is the header's, and the budget's own: its window is 45 s.
    assert said.group(1) == answer.headers["Retry-After"]
    assert 40 <= int(answer.headers["Retry-After"]) <= 45
    assert float(said.group(2)) <= settings.SIGIL_INVOKE_TIMEOUT_SECONDS
    assert len(cloudflare.api_calls()) == calls_before  # nothing reached Cloudflare
    # The next caller is told the same, as fast.
    started = time.monotonic()
    again = alice.call("/alice/cold")
    assert again.status_code == 503 and time.monotonic() - started < 5
    assert 40 <= int(again.headers["Retry-After"]) <= 45


def test_a_process_started_while_the_budget_is_spent_serves_warm_calls(cloudflare, alice, sigil):
    deploy(alice, "warm", "warm")
    assert alice.call("/alice/warm").text == "warm"  # the account's facts are known now
    spend_the_budget()
    calls_before = len(cloudflare.api_calls())

    # A fresh process: its runtime and engine built anew, nothing in their memory. It makes
    # its runtime ready as it starts, which is housekeeping: it does not wait for room.
    runtimes_forget()
    sigil.app.reset_engine()
    started = time.monotonic()
    services.runtime_ready(actor="system")
    assert time.monotonic() - started < 2

    for _ in range(3):
        answer = alice.call("/alice/warm")
        assert (answer.status_code, answer.text) == (200, "warm")
    health = requests.get(f"{sigil.url}/_health", timeout=10)
    assert health.status_code == 200, health.text
    assert health.json()["checks"]["runtime"] == "ok"
    assert len(cloudflare.api_calls()) == calls_before  # not one API request for any of it


def test_a_deploy_and_a_page_in_get_their_requests_while_reconcile_runs_in_a_loop(
    cloudflare, alice, settings, redis_client
):
    # Each waits for room no longer than 2 s: a budget taken by housekeeping would refuse them.
    settings.SIGIL_CF_MAX_RATE_WAIT_SECONDS = 2
    runtimes_forget()
    paged_out(alice, "cold")
    stop = threading.Event()
    runs = []

    def reconcile_in_a_loop() -> None:
        while not stop.is_set():
            # As beat sends it: housekeeping, skipped when it finds no room (and a failure is
            # run again by the next beat, as here).
            with contextlib.suppress(RuntimeUnavailable):
                tasks.capability_reconcile()
            runs.append(1)
            time.sleep(0.01)

    loops = [threading.Thread(target=reconcile_in_a_loop, name=f"reconcile-{i}") for i in range(3)]
    for loop in loops:
        loop.start()
    try:
        # Long enough to have taken the whole window, were housekeeping not held to its share.
        wait_for(lambda: len(runs) >= 90, timeout=30, message="reconcile to run 90 times")
        deployed = alice.deploy(name="new", code="export default { fetch() { return new Response('new') } }")
        assert deployed.status_code == 201, deployed.text
        assert alice.call("/alice/new").text == "new"
        paged_in = alice.call("/alice/cold")
        assert (paged_in.status_code, paged_in.text) == (200, "cold")
        assert paged_in.headers["X-Sigil-Cold-Start"] == "1"
    finally:
        stop.set()
        for loop in loops:
            loop.join(30)
    spent = {key.decode(): int(count) for key, count in redis_client.hgetall(redis_keys.CF_CALLS_BY_CLASS).items()}
    # Housekeeping took its share of the window (0.2 of 60), and no more.
    assert 1 <= spent["housekeeping"] <= 12
    assert spent["deploy"] >= 2 and spent["page-in"] >= 1
    assert not [call for call in cloudflare.api_calls() if call["status"] == 429]


def test_a_workers_dev_subdomain_cloudflare_says_is_wrong_is_learnt_again(cloudflare, alice):
    deploy(alice, "moved", "moved")
    assert alice.call("/alice/moved").text == "moved"
    # The owner renamed the account's workers.dev subdomain: the kept one now reaches nothing.
    cloudflare.configure(subdomain="renamed")
    answer = alice.call("/alice/moved")
    assert (answer.status_code, answer.text) == (200, "moved")
    asked = cloudflare.api_calls(method="GET", path_suffix="/workers/subdomain")
    assert len(asked) == 2  # once when first needed, once when Cloudflare said it was wrong
    assert alice.call("/alice/moved").text == "moved"
    assert len(cloudflare.api_calls(method="GET", path_suffix="/workers/subdomain")) == 2


def test_housekeeping_that_finds_no_room_is_skipped_at_once_and_not_retried(worker_pool, alice, settings, caplog):
    settings.SIGIL_CF_RATE_LIMIT, settings.SIGIL_CF_RATE_WINDOW_SECONDS = 60, 45
    runtimes_forget()
    deploy(alice, "a", "a")
    spend_the_budget()
    started = time.monotonic()
    assert tasks.capability_reconcile() is None  # ended, not failed: its next beat runs it again
    assert time.monotonic() - started < 1
    assert "skipped until its next run: Cloudflare's API budget has no room for housekeeping" in caplog.text
