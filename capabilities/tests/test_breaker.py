"""The circuit breaker's states and transitions, on a real Redis (its Lua included), and a
failure counted outside a call (a capability stopped for exceeding a limit)."""

import time

import pytest

from capabilities import breaker
from capabilities.models import Capability
from sigil.errors import Degraded
from testsupport.capability_code import PONG
from testsupport.cast import wait_for

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (None, breaker.Status.CLOSED),
        (breaker.FORCED, breaker.Status.FORCED),
        (b"%f" % (NOW + 5), breaker.Status.OPEN),
        (b"%f" % (NOW - 5), breaker.Status.HALF_OPEN),
        (b"%f" % NOW, breaker.Status.HALF_OPEN),  # the cool-down ends at its epoch
    ],
)
def test_the_open_key_reads_as_one_state(raw, status):
    assert breaker.status_of(raw, now=NOW) == status


def read(redis_client, full="alice--x"):
    return breaker.status_of(redis_client.get(breaker.open_key(full)), now=time.time())


def test_failures_in_a_row_open_it_and_a_success_between_them_starts_again(redis_client):
    rules = breaker.Breaker(threshold=3, cooldown_seconds=30)
    assert not rules.count_failure(full="alice--x")
    assert not rules.count_failure(full="alice--x")
    redis_client.delete(breaker.failures_key("alice--x"))  # what a success does (stats.RECORD_CALL)
    assert not rules.count_failure(full="alice--x")
    assert not rules.count_failure(full="alice--x")
    assert read(redis_client) == breaker.Status.CLOSED
    assert rules.count_failure(full="alice--x")  # the third in a row: a transition, reported once
    assert read(redis_client) == breaker.Status.OPEN
    assert not rules.count_failure(full="alice--x")  # already open: no new transition
    with pytest.raises(Degraded) as refused:
        rules.enter(redis_client, full="alice--x", raw=redis_client.get(breaker.open_key("alice--x")), now=time.time())
    assert 29 < refused.value.retry_after <= 30


def test_half_open_lets_exactly_one_trial_through(redis_client):
    rules = breaker.Breaker(threshold=1, cooldown_seconds=30)
    rules.count_failure(full="alice--x", now=time.time() - 31)  # opened a cool-down ago
    raw = redis_client.get(breaker.open_key("alice--x"))
    assert read(redis_client) == breaker.Status.HALF_OPEN
    assert rules.enter(redis_client, full="alice--x", raw=raw, now=time.time()) is True
    with pytest.raises(Degraded, match="trial call is in progress"):
        rules.enter(redis_client, full="alice--x", raw=raw, now=time.time())


def test_forced_is_a_flag_that_failures_do_not_move_and_only_reset_clears(redis_client):
    rules = breaker.Breaker(threshold=1, cooldown_seconds=30)
    breaker.breaker_force(full="alice--x")
    assert redis_client.get(breaker.open_key("alice--x")) == breaker.FORCED
    assert not rules.count_failure(full="alice--x")
    assert read(redis_client) == breaker.Status.FORCED
    with pytest.raises(Degraded, match="owner") as refused:
        rules.enter(redis_client, full="alice--x", raw=breaker.FORCED, now=time.time())
    assert refused.value.retry_after == 30  # no end to announce: look again after a cool-down

    breaker.breaker_reset(full="alice--x")
    assert read(redis_client) == breaker.Status.CLOSED
    assert redis_client.get(breaker.failures_key("alice--x")) is None


def test_a_failure_counted_outside_a_call_moves_only_that_capabilitys_breaker(alice, settings, celery_worker):
    settings.SIGIL_BREAKER_THRESHOLD = 2
    alice.deploy(name="runaway", code=PONG)
    alice.deploy(name="neighbour", code=PONG)

    assert not breaker.breaker_count_failure(full="alice--runaway")
    assert breaker.breaker_count_failure(full="alice--runaway")  # e.g. stopped twice for its CPU limit

    refused = alice.call("/alice/runaway")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "degraded"
    assert alice.call("/alice/neighbour").text == "pong"
    wait_for(
        lambda: Capability.objects.get(full_name="alice--runaway").breaker_state == "open",
        message="the transition persisted",
    )
    assert Capability.objects.get(full_name="alice--neighbour").breaker_state == "closed"
