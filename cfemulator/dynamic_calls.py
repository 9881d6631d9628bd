"""The calls in flight to scripts with a Worker Loader, and their Dynamic Workers' turns on
their process's event loop, as the CPU meter must know them (`cfemulator.bound`, METER_HEADER).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from cfemulator.cpumeter import Ticket

# How long a Dynamic Worker's begin waits for another one to give the event loop back before
# it runs anyway, beside it: a Worker that holds the loop that long spins (and is stopped at
# its limit) or computes, which workerd would have made the waiting one wait for as well.
LOOP_HELD_SECONDS = 5.0


@dataclass(eq=False)
class MeteredCall:
    """A call to a script with a Worker Loader, as `DynamicCalls.mark` knows it by `id`."""

    id: str
    ticket: Ticket
    pid: int
    # Its Dynamic Worker is to throw Cloudflare's "exceeded CPU" at once, when it begins.
    replaying_stop: bool = False


class DynamicCalls:
    """The calls to scripts with a Worker Loader, by the id they were sent with (CALL_HEADER):
    their Dynamic Workers' limits are metered on them (`mark`). Thread-safe."""

    def __init__(self) -> None:
        self._calls: dict[str, MeteredCall] = {}
        # By process: the call whose Dynamic Worker was let start and has not given the event
        # loop back yet (`mark`); the others' begin waits on `_changed`.
        self._loop_holders: dict[int, str] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    @contextlib.contextmanager
    def tracked(self, ticket: Ticket, *, pid: int, replaying_stop: bool = False) -> Iterator[MeteredCall]:
        """The call metered by `ticket` on process `pid`, known to `mark` by its id while
        the block runs. `replaying_stop`: the call is sent again after its Dynamic Worker was
        stopped, and that Worker's entrypoint is to throw at once instead of running again
        (see `cfemulator.proxy`); the call's `replaying_stop` tells whether it has yet."""
        call = secrets.token_hex(8)
        marked = MeteredCall(call, ticket, pid, replaying_stop)
        with self._lock:
            self._calls[call] = marked
        try:
            yield marked
        finally:
            with self._changed:
                self._calls.pop(call, None)
                if self._loop_holders.get(pid) == call:
                    del self._loop_holders[pid]
                self._changed.notify_all()

    def mark(self, call: str, phase: str, cpu_ms: int) -> int:
        """A Worker Loader's entrypoint, in the call `call`, starts ("begin") a Dynamic Worker
        limited to `cpu_ms`, which gave the event loop back ("yield": it awaits) or ended
        ("end"). Returns the status the entrypoint is answered: 204, 404 for an unknown call,
        429 when the Worker is to throw Cloudflare's "exceeded CPU" at once (the replay of a
        call whose Dynamic Worker was stopped).

        A begin waits while another call's Dynamic Worker on the same process holds its event
        loop: the meter can then tell which Worker spins when the process must be stopped
        (`cfemulator.cpumeter`), where the order the emulator answered begins in is not the
        order workerd started them in. It costs nothing a single-threaded workerd would not
        make the call wait for anyway, but the round trip of the "yield".
        """
        with self._changed:
            metered = self._calls.get(call)
            if metered is None:
                return 404
            if phase != "begin":
                if self._loop_holders.get(metered.pid) == call:
                    del self._loop_holders[metered.pid]
                    self._changed.notify_all()
                if phase == "yield":
                    metered.ticket.gave_back_loop()
                else:
                    metered.ticket.run_dynamic(None)
                return 204
            if metered.replaying_stop:
                metered.replaying_stop = False
                return 429
            deadline = time.monotonic() + LOOP_HELD_SECONDS
            while (holder := self._loop_holders.get(metered.pid, call)) != call and call in self._calls:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            if call not in self._calls:
                return 404
            metered.ticket.run_dynamic(cpu_ms if cpu_ms > 0 else None)
            if holder == call:
                self._loop_holders[metered.pid] = call
            else:
                metered.ticket.gave_back_loop()  # it runs beside the holder, which keeps the blame
        return 204
