"""The stats flush loses no call and counts none twice, whichever step it dies after: claiming
a batch in Redis, committing it to the database, or releasing it."""

import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from django.db import DatabaseError

from capabilities import services, tasks
from capabilities.books import stats
from capabilities.models import Capability, CapabilityStatsWindow, StatsFlush
from sigil import redis_keys
from sigil.redis_client import get_redis
from testsupport.capability_code import PONG
from testsupport.cast import wait_for


def call_and_wait_until_recorded(alice, times: int) -> None:
    """Call alice's ping `times` times; return once the gateway has counted them all."""
    redis = get_redis()
    before = int(redis.hget(redis_keys.stats("alice--ping"), "calls") or 0)
    for _ in range(times):
        assert alice.call("/alice/ping").text == "pong"
    wait_for(
        lambda: int(redis.hget(redis_keys.stats("alice--ping"), "calls") or 0) >= before + times,
        message=f"{times} calls counted",
    )


def totals() -> tuple[int, int]:
    """(calls in the capability's totals, calls in its minute windows)."""
    capability = Capability.objects.get(full_name="alice--ping")
    in_windows = sum(CapabilityStatsWindow.objects.filter(full_name="alice--ping").values_list("calls", flat=True))
    return capability.calls_total, in_windows


def nothing_pending() -> bool:
    redis = get_redis()
    return redis.zcard(redis_keys.STATS_PENDING) == 0 and not redis.keys(redis_keys.stats_batch("*"))


@pytest.fixture
def ping(alice):
    alice.deploy(name="ping", code=PONG)
    return alice


def test_a_flush_that_died_after_claiming_its_batch_is_completed_by_the_next(ping):
    call_and_wait_until_recorded(ping, 3)
    claimed = stats.stats_claim(now_epoch=time.time(), batch_size=500)  # ... and the flush dies here
    assert claimed.calls["alice--ping"].calls == 3
    assert get_redis().hget(redis_keys.stats("alice--ping"), "calls") is None  # moved, not copied
    assert totals() == (0, 0)

    call_and_wait_until_recorded(ping, 2)  # counted meanwhile, in a fresh hash
    tasks.capability_flush_stats()
    assert totals() == (5, 5)
    assert nothing_pending()

    tasks.capability_flush_stats()  # nothing left to count
    assert totals() == (5, 5)


def test_a_flush_that_died_after_its_commit_is_not_counted_twice(ping):
    call_and_wait_until_recorded(ping, 3)
    claimed = stats.stats_claim(now_epoch=time.time(), batch_size=500)
    assert services.capability_apply_stats(batch=claimed)  # committed; the flush dies before releasing
    assert totals() == (3, 3)
    assert not services.capability_apply_stats(batch=claimed)  # applying it again changes nothing

    assert services.capability_flush_stats() == 0  # releases the batch, counts nothing
    assert totals() == (3, 3)
    assert nothing_pending()


def test_a_database_error_mid_flush_keeps_the_batch_for_the_next_flush(ping):
    call_and_wait_until_recorded(ping, 3)
    # A total the database cannot grow: adding to it fails inside the flush's transaction.
    Capability.objects.filter(full_name="alice--ping").update(calls_total=2**63 - 1)

    with pytest.raises((OverflowError, DatabaseError)):
        tasks.capability_flush_stats()
    assert get_redis().zcard(redis_keys.STATS_PENDING) == 1  # the claimed calls wait in Redis
    assert not StatsFlush.objects.exists()  # rolled back with the rest
    assert not CapabilityStatsWindow.objects.exists()

    Capability.objects.filter(full_name="alice--ping").update(calls_total=0)
    tasks.capability_flush_stats()
    assert totals() == (3, 3)
    assert nothing_pending()


def test_flushing_several_capabilities_in_small_batches_counts_each_call_once(alice):
    for name in ("a", "b", "c"):
        alice.deploy(name=name, code=PONG)
    expected = {"alice--a": 1, "alice--b": 2, "alice--c": 3}
    for full, times in expected.items():
        for _ in range(times):
            assert alice.call("/" + full.replace("--", "/")).text == "pong"
    redis = get_redis()
    wait_for(lambda: all(redis.hget(redis_keys.stats(f), "calls") for f in expected), message="calls counted")

    while services.capability_flush_stats(batch_size=1):
        pass
    assert dict(Capability.objects.values_list("full_name", "calls_total")) == expected
    assert nothing_pending()


def test_a_flush_failing_in_the_worker_is_reported_as_internal_error_and_keeps_its_batch(ping, celery_worker):
    from sigil_site.beat import beat_schedule_list

    call_and_wait_until_recorded(ping, 2)
    Capability.objects.filter(full_name="alice--ping").update(calls_total=2**63 - 1)

    failed = tasks.capability_flush_stats.delay()
    wait_for(
        lambda: get_redis().hexists(redis_keys.BEAT_LAST_RUN, "capabilities.capability_flush_stats"), message="a run"
    )
    (run,) = [e for e in beat_schedule_list() if e.task == "capabilities.capability_flush_stats"]
    assert run.last_ok is False
    assert run.last_error.startswith("internal_error: ") and failed.id in run.last_error
    assert get_redis().zcard(redis_keys.STATS_PENDING) == 1

    Capability.objects.filter(full_name="alice--ping").update(calls_total=0)
    tasks.capability_flush_stats.delay()
    wait_for(lambda: totals() == (2, 2), message="the kept batch flushed")
    assert nothing_pending()


def test_a_token_used_while_its_stamp_is_flushed_keeps_the_newer_stamp(ping):
    from datetime import UTC, datetime

    from agents.models import Token
    from agents.tokens import hash_secret

    redis = get_redis()
    call_and_wait_until_recorded(ping, 1)
    read = stats.tokens_used_read()  # what a flush wrote to the database...
    token_hash = hash_secret(ping.invoke_token)  # (the deploy token is stamped too, by the deploy)
    call_and_wait_until_recorded(ping, 1)  # ... while the token was used again
    newer = redis.hget(redis_keys.TOKENS_USED, token_hash).decode()
    assert newer != read[token_hash]

    stats.tokens_used_forget(read)
    assert redis.hget(redis_keys.TOKENS_USED, token_hash).decode() == newer  # not forgotten
    tasks.capability_flush_stats()
    assert Token.objects.get(secret_hash=token_hash).last_used_at == datetime.fromtimestamp(float(newer), tz=UTC)
    assert not redis.exists(redis_keys.TOKENS_USED)


# --- a flush process killed between its steps -----------------------------------------------


@pytest.fixture
def database_writes_held():
    """Hold the SQLite database's write lock, as a long writer would; release it by calling."""
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("holds SQLite's single write lock; the steps themselves are tested above")
    holder = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    released = []

    def release():
        if not released:
            holder.execute("ROLLBACK")
            released.append(True)

    yield release
    release()
    holder.close()


def start_flush_process() -> subprocess.Popen:
    """`capability_flush_stats()` in a process of its own, on this test's database and Redis."""
    from django.conf import settings
    from django.db import connection

    env = {**os.environ, "DATABASE_URL": f"sqlite:///{connection.settings_dict['NAME']}"}
    script = "import django; django.setup(); from capabilities import services; services.capability_flush_stats()"
    return subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=settings.BASE_DIR,
        env={**env, "DJANGO_SETTINGS_MODULE": "sigil_site.settings"},
    )


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)


@pytest.mark.slow
def test_a_flush_process_killed_after_claiming_loses_no_call(ping, database_writes_held):
    call_and_wait_until_recorded(ping, 3)
    flush = start_flush_process()
    try:
        # It claims its batch, then waits for the database: kill it there.
        wait_for(lambda: get_redis().zcard(redis_keys.STATS_PENDING) == 1, timeout=30, message="the batch claimed")
    finally:
        kill(flush)
    database_writes_held()
    assert totals() == (0, 0)

    tasks.capability_flush_stats()
    assert totals() == (3, 3)
    assert nothing_pending()


@pytest.mark.slow
def test_a_flush_process_killed_after_committing_counts_nothing_twice(ping, database_writes_held):
    call_and_wait_until_recorded(ping, 3)
    redis = get_redis()
    flush = start_flush_process()
    try:
        wait_for(lambda: redis.zcard(redis_keys.STATS_PENDING) == 1, timeout=30, message="the batch claimed")
        # Writes to Redis wait from here, so the flush commits and then stops before releasing.
        redis.execute_command("CLIENT", "PAUSE", 20_000, "WRITE")
        try:
            database_writes_held()
            wait_for(lambda: StatsFlush.objects.exists(), timeout=15, message="the batch committed")
        finally:
            kill(flush)
            redis.execute_command("CLIENT", "UNPAUSE")
    finally:
        if flush.poll() is None:
            kill(flush)
    assert totals() == (3, 3)
    assert redis.zcard(redis_keys.STATS_PENDING) == 1  # never released

    tasks.capability_flush_stats()
    assert totals() == (3, 3)
    assert nothing_pending()
