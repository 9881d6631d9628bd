"""Each call's wall and CPU time, for its trace, as Cloudflare gives them to Tail Workers.

Cloudflare's TraceItem carries the invocation's `wallTime` and `cpuTime` in ms; open-source
workerd, which produces the emulator's events, gives 0 for both. The emulator measures them
itself: the proxy times each call it runs in a script's or a Dynamic Worker's process, from
sending it to the end of relaying its answer, and takes the CPU the meter charged it
(`cfemulator.cpumeter`: the process's CPU time shared among the calls in flight on it, which
Linux counts in clock ticks of 10 ms). It notes them under the process's key and the call's
`CF-Ray` request header, which Cloudflare gives every request to a Worker and which the
call's trace shows among its request's headers; the tail relay (`cfemulator.tails`) puts them
in the events of that call before a Tail Worker sees them.

A call's events may reach the relay before its answer is relayed to the end, so the relay
waits a moment for its times (`taken`). Times nobody takes are forgotten past a bound.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass

# The times of calls whose events did not come (a script with no Tail Worker, a start check).
KEPT = 4096


def new_ray() -> str:
    """A ray id as Cloudflare's front door gives each request: 16 hex digits and where it ran."""
    return f"{secrets.token_hex(8)}-EMU"


@dataclass(frozen=True)
class CallTimes:
    wall_ms: float
    cpu_ms: float


class CallTimings:
    """The times of the calls whose events have not been relayed yet. Thread-safe."""

    def __init__(self) -> None:
        self._times: OrderedDict[tuple[str, str], CallTimes] = OrderedDict()
        self._noted = threading.Condition()

    def noted(self, key: str, ray: str, times: CallTimes) -> None:
        """The call with `ray` on the process `key` took `times`."""
        with self._noted:
            self._times[(key, ray)] = times
            while len(self._times) > KEPT:
                self._times.popitem(last=False)
            self._noted.notify_all()

    def taken(self, key: str, ray: str, *, wait_seconds: float) -> CallTimes | None:
        """The times of the call with `ray` on `key`, waiting up to `wait_seconds` for them to
        be noted; None when they are not."""
        with self._noted:
            self._noted.wait_for(lambda: (key, ray) in self._times, timeout=wait_seconds)
            return self._times.pop((key, ray), None)
