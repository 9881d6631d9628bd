"""The CPU meter on real processes: one that spins past a call's limit is stopped, one that
waits is not, and CPU is shared among the calls in flight."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

from cfemulator.cpumeter import CpuMeter, process_cpu_ms

SPIN = "while True: pass"
WAIT = "import time; time.sleep(60)"


@pytest.fixture
def meter():
    meter = CpuMeter(grace_ms=lambda: 20, poll_seconds=0.02)
    meter.start()
    yield meter
    meter.stop()


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []

    def start(code: str) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", code])
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def wait_for_a_stop(stops: list) -> None:
    """Wait up to 10 s for the meter to stop a process (`stops` gains an entry)."""
    deadline = time.monotonic() + 10
    while not stops and time.monotonic() < deadline:
        time.sleep(0.01)


@contextlib.contextmanager
def two_calls_on_one_spinning_process(meter, processes):
    """Two calls in flight on one spinning process, within a loader Worker's limit of 60 s
    each, and the list of the process's stops; the block's end waits for one."""
    spinning = processes(SPIN)
    stops = []
    with (
        meter.call(pid=spinning.pid, stop=lambda: stops.append(spinning.kill()), limit_ms=60_000) as first,
        meter.call(pid=spinning.pid, stop=lambda: stops.append(spinning.kill()), limit_ms=60_000) as second,
    ):
        yield first, second, stops
        wait_for_a_stop(stops)


def test_a_call_on_a_spinning_process_is_stopped_once_past_its_limit(meter, processes):
    spinning = processes(SPIN)
    stops = []
    with meter.call(pid=spinning.pid, stop=lambda: stops.append(spinning.kill()), limit_ms=50) as ticket:
        wait_for_a_stop(stops)
    assert stops == [None] and ticket.exceeded
    # Charged past its limit and the grace, then stopped (a late poll on a loaded machine
    # charges more at once).
    assert 50 + 20 < ticket.used_ms < 50 + 20 + 500


def test_a_call_on_a_waiting_process_is_never_stopped(meter, processes):
    waiting = processes(WAIT)
    with meter.call(pid=waiting.pid, stop=waiting.kill, limit_ms=1) as ticket:
        time.sleep(0.5)
    assert not ticket.exceeded and ticket.used_ms < 1 + 20
    assert waiting.poll() is None


def test_calls_in_flight_together_share_their_process_cpu(meter, processes):
    spinning = processes(SPIN)
    with (
        meter.call(pid=spinning.pid, stop=spinning.kill, limit_ms=60_000) as first,
        meter.call(pid=spinning.pid, stop=spinning.kill, limit_ms=60_000) as second,
    ):
        time.sleep(0.5)
    assert first.used_ms > 50 and abs(first.used_ms - second.used_ms) < 50
    assert first.used_ms + second.used_ms <= process_cpu_ms(spinning.pid) + 10


def test_a_silent_process_its_supervisor_reniced_is_charged_the_wall_time_it_waits(meter, processes):
    # Stands for a spinning workerd starved of CPU after its supervisor reniced it: on
    # Cloudflare the call would have had its core, so it is charged as if it had.
    starved, merely_slow = processes(WAIT), processes(WAIT)
    os.setpriority(os.PRIO_PROCESS, starved.pid, 19)
    with (
        meter.call(pid=starved.pid, stop=starved.kill, limit_ms=100, silent=lambda: True) as charged,
        meter.call(pid=merely_slow.pid, stop=merely_slow.kill, limit_ms=100, silent=lambda: True) as spared,
    ):
        deadline = time.monotonic() + 5
        while starved.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert charged.exceeded and starved.poll() is not None
    assert not spared.exceeded and merely_slow.poll() is None


def test_a_dynamic_workers_limit_stops_the_call_that_started_it_last(meter, processes):
    # A loader Worker's calls share its process; one runs a Dynamic Worker limited to 50 ms,
    # started after the other's: it is the one blamed, the other only shared the process.
    with two_calls_on_one_spinning_process(meter, processes) as (earlier, later, stops):
        earlier.run_dynamic(50)
        time.sleep(0.01)
        later.run_dynamic(50)
    assert stops == [None] and earlier.exceeded and later.exceeded
    assert later.dynamic_exceeded and not earlier.dynamic_exceeded
    assert earlier.stopped_by_dynamic and later.stopped_by_dynamic
    # Within its loader Worker's own limit of 60 s by far: the Dynamic Worker's stopped it.
    assert later.used_ms < 2_000


def test_a_dynamic_worker_holding_the_event_loop_is_blamed_over_one_started_after_it(meter, processes):
    # The emulator answered the other's begin later, but that Worker gave the loop back (it
    # awaits): the one still holding it is the one spinning, though it started first.
    with two_calls_on_one_spinning_process(meter, processes) as (holding, awaiting, stops):
        holding.run_dynamic(50)
        time.sleep(0.01)
        awaiting.run_dynamic(50)
        awaiting.gave_back_loop()
    assert stops == [None] and holding.exceeded and awaiting.exceeded
    assert holding.dynamic_exceeded and not awaiting.dynamic_exceeded
    assert holding.stopped_by_dynamic and awaiting.stopped_by_dynamic


def test_a_dynamic_worker_that_ended_no_longer_limits_its_call(meter, processes):
    waiting = processes(WAIT)
    with meter.call(pid=waiting.pid, stop=waiting.kill, limit_ms=60_000) as ticket:
        ticket.run_dynamic(1)
        ticket.run_dynamic(None)
        time.sleep(0.2)
    assert not ticket.exceeded and ticket.over_ms() < 0
