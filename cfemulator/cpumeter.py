"""Each call's CPU time on the emulator's workerd processes, and the stop of a call past its limit.

Open-source workerd accepts CPU limits and does not enforce them (reference §5.3), so the
emulator does: every call to a script is registered with the limit Cloudflare would give it
(`cfemulator.limits.call_cpu_ms`), and a watchdog thread charges the CPU time its process
spends (from /proc, every `poll_seconds`) to the calls in flight on it, in equal shares.
When one call has used more than its limit plus `grace_ms`, its process is stopped (by
its supervisor, through the `stop` the call was registered with): every call in flight on
it is marked exceeded (they shared the isolate that was stopped) and is answered with
Cloudflare's error 1102 by the server.

The grace covers what the emulator cannot measure finely: /proc counts CPU in clock ticks
(10 ms), and a first call pays for its isolate's start, which Cloudflare does not charge to
the call (startup has its own limit). So a call is stopped once it has used between its
limit and its limit plus the grace of CPU, one poll and the supervisor's kill later.

One exception: the supervisor renices a process whose event loop stays silent (a script
spinning), so that it yields its core to the others. A script running on Cloudflare has
its core to itself; so while its process is silent and reniced, a call is charged the
wall time that passes when that is more than the CPU it got, or a runaway on a busy
machine would wait for its limit's worth of CPU for many times as long.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from capabilities.workerd.supervision import process_cpu_ms

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Ticket:
    """One call in flight: its limit, the CPU charged to it so far, whether it was stopped."""

    limit_ms: int
    used_ms: float = 0.0
    exceeded: bool = False

    def over_ms(self) -> float:
        """How far past its limit the call is now (negative: within it)."""
        return self.used_ms - self.limit_ms


def _reniced(pid: int) -> bool:
    """Whether `pid` runs nicer than the emulator that started it."""
    try:
        return os.getpriority(os.PRIO_PROCESS, pid) > os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:
        return False


@dataclass(eq=False)
class _Metered:
    pid: int
    stop: Callable[[], None]
    silent: Callable[[], bool]
    tickets: list[Ticket] = field(default_factory=list)
    last_cpu_ms: float | None = None
    last_at: float = field(default_factory=time.monotonic)

    def spent_ms(self, cpu_ms: float, now: float) -> float:
        """What the process spent since the last look: its CPU, or the wall time while
        silent and reniced (see the module's docstring)."""
        spent = cpu_ms - self.last_cpu_ms
        if self.silent() and _reniced(self.pid):
            spent = max(spent, (now - self.last_at) * 1000)
        return spent


def _charge(metered: _Metered) -> bool:
    """Charge what `metered` spent since the last look to its calls, in equal shares; False
    when nothing could be charged (no calls, or the process is gone). Under the meter's lock."""
    cpu_ms, at = process_cpu_ms(metered.pid), time.monotonic()
    if cpu_ms is None or metered.last_cpu_ms is None or not metered.tickets:
        metered.last_cpu_ms, metered.last_at = cpu_ms, at
        return False
    share = metered.spent_ms(cpu_ms, at) / len(metered.tickets)
    metered.last_cpu_ms, metered.last_at = cpu_ms, at
    for ticket in metered.tickets:
        ticket.used_ms += share
    return True


class CpuMeter:
    """The watchdog over the calls in flight. Thread-safe; `start()` runs its thread."""

    def __init__(self, *, grace_ms: Callable[[], int], poll_seconds: float = 0.05) -> None:
        self._grace_ms = grace_ms
        self.poll_seconds = poll_seconds
        self._lock = threading.Lock()
        self._processes: dict[int, _Metered] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="cfemulator-cpu", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    @contextmanager
    def call(
        self, *, pid: int, stop: Callable[[], None], limit_ms: int, silent: Callable[[], bool] = lambda: False
    ) -> Iterator[Ticket]:
        """Meter one call on process `pid` for as long as the block runs; `stop()` ends
        that process (it must not block on the meter); `silent()` tells whether its event
        loop has stopped answering. The ticket says whether it was stopped."""
        ticket = Ticket(limit_ms=limit_ms)
        with self._lock:
            metered = self._processes.get(pid)
            if metered is None:
                metered = self._processes[pid] = _Metered(
                    pid=pid, stop=stop, silent=silent, last_cpu_ms=process_cpu_ms(pid)
                )
            metered.tickets.append(ticket)
        try:
            yield ticket
        finally:
            with self._lock:
                # What the process spent since the last look is the call's too (its CPU time
                # in its trace: cfemulator.timings); it is over, so no limit is checked.
                _charge(metered)
                metered.tickets.remove(ticket)
                if not metered.tickets and self._processes.get(pid) is metered:
                    del self._processes[pid]

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            self.charge()

    def charge(self) -> None:
        """Charge each metered process's CPU since the last look to its calls; stop those past a limit."""
        grace = self._grace_ms()
        stopping: list[tuple[_Metered, Ticket]] = []
        with self._lock:
            for metered in self._processes.values():
                if not _charge(metered):
                    continue
                worst = max(metered.tickets, key=Ticket.over_ms)
                if worst.over_ms() > grace:
                    # They shared the process that is stopped, as calls sharing an isolate do.
                    for ticket in metered.tickets:
                        ticket.exceeded = True
                    stopping.append((metered, worst))
            for metered, _ in stopping:
                del self._processes[metered.pid]
        for metered, worst in stopping:
            logger.warning(
                "a call used %.0f ms of CPU against its limit of %s ms: stopping workerd (pid %s)",
                worst.used_ms,
                worst.limit_ms,
                metered.pid,
            )
            metered.stop()
