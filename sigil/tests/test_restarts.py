"""The one restart rule every supervisor follows (sigil.restarts)."""

import threading
import time

import pytest

from sigil.restarts import FIRST_BACKOFF_SECONDS, MAX_BACKOFF_SECONDS, STABLE_SECONDS, Backoff, keep_running


def test_a_process_that_keeps_dying_young_waits_longer_each_time_up_to_the_cap():
    backoff = Backoff()
    delays = [backoff.after_exit(0.1) for _ in range(10)]
    assert delays[0] == FIRST_BACKOFF_SECONDS
    assert delays[1] == 2 * FIRST_BACKOFF_SECONDS
    assert delays == sorted(delays)
    assert delays[-1] == MAX_BACKOFF_SECONDS


def test_a_process_that_ran_long_enough_is_restarted_at_once_and_its_backoff_forgotten():
    backoff = Backoff()
    for _ in range(5):
        backoff.after_exit(0.1)
    assert backoff.after_exit(STABLE_SECONDS) == 0.0
    assert backoff.after_exit(0.1) == FIRST_BACKOFF_SECONDS


def test_a_failed_start_backs_off_and_a_stop_on_purpose_restarts_at_once():
    backoff = Backoff()
    assert backoff.after_failed_start() == FIRST_BACKOFF_SECONDS
    assert backoff.after_failed_start() == 2 * FIRST_BACKOFF_SECONDS
    assert backoff.after_stop() == 0.0


class Missing(RuntimeError):
    permanent = True


def test_supervision_gives_up_at_once_on_a_failure_no_restart_can_fix():
    starts = []

    def start() -> None:
        starts.append(time.monotonic())
        raise Missing("not installed")

    with pytest.raises(Missing):
        keep_running(threading.Event(), what="test", start=start, watch=lambda: False)
    assert len(starts) == 1


def test_other_failures_are_retried_after_the_first_backoff_and_a_stopped_process_at_once():
    stop = threading.Event()
    starts: list[float] = []
    failures: list[str] = []

    def start() -> None:
        starts.append(time.monotonic())
        if len(starts) == 1:
            raise RuntimeError("port in use")

    def watch() -> bool:
        if len(starts) == 4:
            stop.set()
        return True  # stopped on purpose (past a limit): the next start comes at once

    keep_running(stop, what="test", start=start, watch=watch, on_failed_start=lambda e: failures.append(str(e)))

    assert failures == ["port in use"]
    assert len(starts) == 4
    assert starts[1] - starts[0] >= FIRST_BACKOFF_SECONDS
    assert starts[3] - starts[1] < FIRST_BACKOFF_SECONDS
