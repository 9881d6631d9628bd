"""Two beats on one Redis (two hosts, or `make run` beside a production host): one sends."""

import time

import pytest

from sigil import redis_keys
from sigil.leases import lease_seconds
from sigil.redis_client import get_redis
from sigil_site import beat_leader
from sigil_site.celery import app

QUEUE = "beat-leader-test"  # no worker consumes it


@pytest.fixture
def beats(tmp_path):
    get_redis().delete(redis_keys.BEAT_LEADER, QUEUE)
    schedule = {"probe": {"task": "sigil.test.beat_probe", "schedule": 0.01, "options": {"queue": QUEUE}}}
    made = []

    def make(name: str) -> beat_leader.LeasedScheduler:
        scheduler = beat_leader.LeasedScheduler(
            app=app, schedule_filename=str(tmp_path / name), lazy=False, beat_schedule=schedule
        )
        scheduler.update_from_dict(schedule)
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.close()
    get_redis().delete(redis_keys.BEAT_LEADER, QUEUE)


def sent(scheduler: beat_leader.LeasedScheduler) -> int:
    return scheduler.schedule["probe"].total_run_count


def test_only_the_beat_holding_the_lease_sends_and_the_other_takes_over_when_it_stops(beats):
    first, second = beats("first"), beats("second")
    for _ in range(3):
        first.tick()
        second.tick()
        time.sleep(0.02)
    assert first.leading and not second.leading
    assert sent(first) >= 1 and sent(second) == 0
    assert get_redis().pttl(redis_keys.BEAT_LEADER) > (lease_seconds() - 5) * 1000

    first.close()  # a clean stop hands the lease back at once
    second.tick()
    assert second.leading and sent(second) >= 1


def test_a_lease_whose_beat_died_runs_out_and_another_beat_takes_it(beats):
    get_redis().set(redis_keys.BEAT_LEADER, "a-dead-hosts-token", px=300)  # as a killed beat leaves it
    beat = beats("survivor")
    beat.tick()
    assert not beat.leading and sent(beat) == 0
    time.sleep(0.35)
    beat.tick()
    assert beat.leading and sent(beat) >= 1


def test_a_beat_whose_lease_was_taken_over_stops_sending(beats):
    beat = beats("paused")
    beat.tick()
    assert beat.leading
    # As after a pause longer than a lease: the lease ran out and another beat took it.
    get_redis().set(redis_keys.BEAT_LEADER, "another-beats-token", px=60_000)
    count = sent(beat)
    beat.tick()
    assert not beat.leading and sent(beat) == count
