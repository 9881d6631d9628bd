"""The CPU meter on real processes: one that spins past a call's limit is stopped, one that
waits is not, and CPU is shared among the calls in flight."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from capabilities.workerd.supervision import process_cpu_ms
from cfemulator.cpumeter import CpuMeter

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
