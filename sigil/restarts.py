"""When a supervised process that ended is started again: the one rule of every supervisor
(runsigil's programs, runworkerd's and the emulator's workerd processes).

- A process that ran for STABLE_SECONDS is healthy: when it ends, it is started again at
  once and its backoff is forgotten.
- One that ends sooner, or fails to start, waits before its next start: FIRST_BACKOFF_SECONDS,
  doubled each time up to MAX_BACKOFF_SECONDS, so a crash loop does not spin, and a process
  whose cause went away serves again within MAX_BACKOFF_SECONDS.
- One stopped on purpose (past a limit, or asked to) is started again at once: the next call
  needs it.
- Supervision gives up on a process only when it fails in a way no restart can fix (the
  error's `permanent` attribute is true: workerd not installed); every other failure is
  retried, for as long as the supervisor runs.

Imports nothing of Sigil's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# A fraction of a second: a process that dies on its own is back before most callers notice
# (/_health fails only for the moment a restart takes).
FIRST_BACKOFF_SECONDS = 0.2
# A process that keeps dying is tried again at least this often, so one whose cause went
# away (a port released, Redis back) serves again soon without anyone acting.
MAX_BACKOFF_SECONDS = 10.0
# A process that ran this long is restarted at once: a crash loop this slow costs at most one
# start every 10 s, and one that fails at start (a bad setting, a port in use) dies sooner.
STABLE_SECONDS = 10.0


def is_permanent(error: BaseException) -> bool:
    """Whether `error` is one no restart can fix, so that supervision gives up at once."""
    return bool(getattr(error, "permanent", False))


@dataclass
class Backoff:
    """How long one supervised process waits before its next start (`delay`, in seconds)."""

    delay: float = 0.0

    def after_exit(self, ran_seconds: float) -> float:
        """The process ended on its own after `ran_seconds`: the wait before its next start."""
        self.delay = 0.0 if ran_seconds >= STABLE_SECONDS else self._grown()
        return self.delay

    def after_failed_start(self) -> float:
        """The process did not start: the wait before the next try."""
        self.delay = self._grown()
        return self.delay

    def after_stop(self) -> float:
        """The process was stopped on purpose, to be started again at once."""
        self.delay = 0.0
        return self.delay

    def _grown(self) -> float:
        return min(max(self.delay * 2, FIRST_BACKOFF_SECONDS), MAX_BACKOFF_SECONDS)


def keep_running(
    stop: threading.Event,
    *,
    what: str,
    start: Callable[[], None],
    watch: Callable[[], bool],
    on_failed_start: Callable[[RuntimeError], None] = lambda error: None,
    on_exit: Callable[[float], str] = lambda ran: f"exited after {ran:.1f} s",
) -> None:
    """Start a process and start it again whenever it ends, backed off as Backoff says,
    until `stop` is set.

    `start()` returns once the process serves, or raises RuntimeError; one that is
    permanent (`is_permanent`) is raised from here, any other is retried. `watch()` returns
    when `stop` is set, when the process ended on its own (False), or when it was stopped
    on purpose (True). `on_failed_start(error)` and `on_exit(ran_seconds)` let the caller
    record what happened; `on_exit` returns how it ended, for the log (`what` names the
    process there). Stopping the process once `stop` is set is the caller's.
    """
    backoff = Backoff()
    while not stop.is_set():
        if backoff.delay and stop.wait(backoff.delay):
            return
        try:
            start()
        except RuntimeError as error:
            if is_permanent(error):
                raise
            delay = backoff.after_failed_start()
            logger.error("%s did not start: %s; retrying in %.1f s", what, error, delay)
            on_failed_start(error)
            continue
        started = time.monotonic()
        if watch():
            backoff.after_stop()
        elif not stop.is_set():
            ran = time.monotonic() - started
            delay = backoff.after_exit(ran)
            logger.warning("%s %s; restarting in %.1f s", what, on_exit(ran), delay)
