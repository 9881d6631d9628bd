"""The circuit breaker's states and transitions, on a real Redis, through the script the
gateway records each call's outcome with (stats.RECORD_CALLS, which holds the breaker's Lua)."""

import time
from types import SimpleNamespace

import pytest

from capabilities.books import breaker, stats
from capabilities.models import BreakerState
from sigil import redis_keys
from sigil.errors import Degraded

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
    return breaker.status_of(redis_client.get(redis_keys.breaker_open(full)), now=time.time())


def record(redis_client, rules, *, ok=False, full="alice--x", now=None) -> bool:
    """One call's outcome, recorded as the gateway records it; whether it opened the breaker."""
    [change] = record_together(redis_client, rules, [ok], full=full, now=now)
    return breaker.transition(change) == BreakerState.OPEN


def record_together(redis_client, rules, oks: list[bool], *, full="alice--x", now=None) -> list:
    """Calls' outcomes recorded in one script call, as the gateway records the calls that
    ended together; each one's breaker change."""
    now = time.time() if now is None else now
    called = SimpleNamespace(  # what stats.RecordedCall reads of the engine's call
        full=full,
        capability_type="persistent",
        token_hash="token",
        is_trial=False,
        inflight_process=None,
        page_in_ms=None,
    )
    keys, args = [], []
    for ok in oks:
        call = stats.CallRecord(call=called, at_epoch=now, latency_ms=1.0, status=200 if ok else 500, ok=ok)
        keys += call.keys()
        args += call.args(rules=rules, failures_kept=10, access_log_length=0)
    return redis_client.eval(stats.RECORD_CALLS, len(keys), *keys, *args)


def test_records_applied_together_count_in_the_order_their_calls_ended(redis_client):
    rules = breaker.Breaker(threshold=2, cooldown_seconds=30)
    # A success between two failures starts the count again...
    assert record_together(redis_client, rules, [False, True, False]) == [b"", b"", b""]
    assert read(redis_client) == breaker.Status.CLOSED
    # ... and the failure after them is the second in a row.
    assert record_together(redis_client, rules, [False, True]) == [b"opened", b"closed"]
    assert int(redis_client.hget(redis_keys.stats("alice--x"), "calls")) == 5
    assert int(redis_client.hget(redis_keys.stats("alice--x"), "errors")) == 3


def test_failures_in_a_row_open_it_and_a_success_between_them_starts_again(redis_client):
    rules = breaker.Breaker(threshold=3, cooldown_seconds=30)
    assert not record(redis_client, rules)
    assert not record(redis_client, rules)
    record(redis_client, rules, ok=True)  # a success between them
    assert not record(redis_client, rules)
    assert not record(redis_client, rules)
    assert read(redis_client) == breaker.Status.CLOSED
    assert record(redis_client, rules)  # the third in a row: a transition, reported once
    assert read(redis_client) == breaker.Status.OPEN
    assert not record(redis_client, rules)  # already open: no new transition
    with pytest.raises(Degraded) as refused:
        rules.enter(
            redis_client, full="alice--x", raw=redis_client.get(redis_keys.breaker_open("alice--x")), now=time.time()
        )
    assert 29 < refused.value.retry_after <= 30


def test_half_open_lets_exactly_one_trial_through(redis_client):
    rules = breaker.Breaker(threshold=1, cooldown_seconds=30)
    record(redis_client, rules, now=time.time() - 31)  # opened a cool-down ago
    raw = redis_client.get(redis_keys.breaker_open("alice--x"))
    assert read(redis_client) == breaker.Status.HALF_OPEN
    assert rules.enter(redis_client, full="alice--x", raw=raw, now=time.time()) is True
    with pytest.raises(Degraded, match="trial call is in progress"):
        rules.enter(redis_client, full="alice--x", raw=raw, now=time.time())


def test_forced_is_a_flag_that_failures_do_not_move_and_only_reset_clears(redis_client):
    rules = breaker.Breaker(threshold=1, cooldown_seconds=30)
    breaker.breaker_force(full="alice--x")
    assert redis_client.get(redis_keys.breaker_open("alice--x")) == breaker.FORCED
    assert not record(redis_client, rules)
    assert read(redis_client) == breaker.Status.FORCED
    with pytest.raises(Degraded, match="owner") as refused:
        rules.enter(redis_client, full="alice--x", raw=breaker.FORCED, now=time.time())
    assert refused.value.retry_after == 30  # no end to announce: look again after a cool-down

    breaker.breaker_reset(full="alice--x")
    assert read(redis_client) == breaker.Status.CLOSED
    assert redis_client.get(redis_keys.breaker_failures("alice--x")) is None
