"""Supervised workerd processes: a liveness probe, a CPU-stall and memory watchdog, restarts.

Open-source workerd runs every isolate of a process on one event loop and enforces no CPU
limit: one Worker spinning in `while (true) {}` stops every other Worker of its process, and
the process then ignores SIGTERM. What this module supervises is therefore a process, and
what it contains is damage to that process: a stalled or bloated workerd is SIGKILLed and
started again, and a record of why is left for whoever has calls in flight on it.

API (what a runtime or the Cloudflare emulator needs; the host is any object with
`start()`, `stop(timeout=...)`, `process` (a Popen or None) and `port`, like
`capabilities.workerd.host.WorkerdHost`; `capabilities.workerd.group` runs one per name):

- `Limits(stall_ms, memory_mb, probe_interval_ms=100)`: a process whose event loop has not
  answered a probe for `stall_ms` while it spins (it used SPINNING_CPU_MS of CPU
  without answering), or whose resident memory is over `memory_mb`, is stopped. A process
  silent without using the CPU is not spinning but starved by a busy host: it is stopped
  only after STARVED_AFTER_STALLS times `stall_ms`, and no call of it is blamed.
- `process_cpu_ms(pid)`: the CPU time a process has used (every thread), from /proc.
- `Kill`: what the watchdog records before it stops a process: `name`, `pid`, `reason`
  (`"cpu"`, `"memory"` or `"starved"`), `limit` (ms or MB), `at` (epoch), and the window of send times
  (`culprit_from`..`culprit_until`) of the calls that can have caused it; `blames(sent_at)`
  tells whether a call sent at `sent_at` (epoch) is one of them. `describe()` is a sentence.
- `KillLog(directory)`: `record(kill)` and `latest(name)`, one JSON file per name, so the
  processes that forwarded the calls (web, Celery) can read what the supervisor decided.
- `SupervisedWorkerd(name, host, limits, kill_log=None, on_kill=None, on_state=None)`: one
  process kept running by `run(stop_event)` (in a thread of its own); `state`, `serving()`,
  `wait_serving(timeout)`, `alive_at` (epoch of the last answered probe), `blame_ends_at()`
  (while the loop is silent, the send time after which no call is blamed for it),
  `kill(reason)` (as if past that limit), `restart()` (no record), `snapshot()`. It is
  restarted as sigil.restarts says: at once after the watchdog stopped it, backed off when
  it died young or did not start; an error from `host.start()` with a true `permanent`
  attribute (workerd not installed) ends the supervision.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sigil.files import write_atomically
from sigil.restarts import keep_running

logger = logging.getLogger(__name__)

# Which calls a stall is blamed on, by send time. The culprit may have been sent well
# before the last answered probe: the loop answers probes while it reads the culprit's code
# and loads its isolate, and only then runs it. It was sent before the first probe left
# unanswered, or not long after: a workerd the kernel did not schedule for a while finds
# both requests waiting when it wakes, and may run the culprit first (seen 40 ms apart on a
# loaded machine). A call of the same process sent within that window is blamed too;
# anything later (`blame_ends_at()`) is not.
_SENT_BEFORE_LAST_ANSWER = 0.5
# A loop silent for this many probe intervals is spinning, not merely busy for a moment...
_NICE_AFTER_SILENT_INTERVALS = 3
_SENT_AFTER_STUCK_PROBE = 0.25
# ... if it used this much CPU meanwhile: a loop that merely waits for a busy host to run it
# answers a probe with a millisecond of CPU once it runs at all.
SPINNING_CPU_MS = 100
# A loop silent this many times its stall limit without spinning is starved by the host; it
# is stopped (nothing answers through it meanwhile), and no call of it is blamed.
STARVED_AFTER_STALLS = 10
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


class Host(Protocol):
    port: int
    process: subprocess.Popen | None

    def start(self) -> None: ...

    def stop(self, *, timeout: float = ...) -> None: ...


@dataclass(frozen=True)
class Limits:
    """When the watchdog stops a process."""

    stall_ms: int
    memory_mb: int
    probe_interval_ms: int = 100


@dataclass(frozen=True)
class Kill:
    """A process stopped by the watchdog, and which calls can have caused it."""

    name: str
    pid: int
    reason: str  # "cpu", "memory" or "starved"
    limit: int  # ms for "cpu" and "starved", MB for "memory"
    at: float
    culprit_from: float
    culprit_until: float

    def blames(self, sent_at: float) -> bool:
        """Whether a call sent at `sent_at` (epoch) can be the one that ran past the limit."""
        return self.culprit_from <= sent_at <= self.culprit_until

    def describe(self) -> str:
        if self.reason == "cpu":
            return f"ran past its CPU limit of {self.limit} ms"
        if self.reason == "starved":
            return f"stopped answering for {STARVED_AFTER_STALLS * self.limit / 1000:g} s, the host too busy to run it"
        return f"ran past its memory limit of {self.limit} MB"


class KillLog:
    """The latest Kill of each name, one JSON file each under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def record(self, kill: Kill) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(self.directory / f"{kill.name}.json", json.dumps(asdict(kill)).encode())

    def latest(self, name: str) -> Kill | None:
        try:
            return Kill(**json.loads((self.directory / f"{name}.json").read_text()))
        except (FileNotFoundError, ValueError, TypeError):
            return None


class _Prober:
    """At most one liveness probe in flight: `GET /` on a kept-alive connection. Any HTTP
    answer shows that the event loop runs; no capability code is involved."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connection: http.client.HTTPConnection | None = None
        self.sent_at: float | None = None  # epoch of the probe awaiting its answer

    def tick(self, wait: float) -> bool:
        """Send a probe if none is in flight; wait up to `wait` s for its answer. True when answered."""
        if self.sent_at is None:
            try:
                if self.connection is None:
                    self.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1.0)
                    self.connection.connect()
                self.sent_at = time.time()
                self.connection.request("GET", "/")
            except OSError:
                self.reset()
                time.sleep(wait)
                return False
        sock = self.connection.sock
        if sock is None or not select.select([sock], [], [], wait)[0]:
            return False
        try:
            response = self.connection.getresponse()
            response.read()
        except (OSError, http.client.HTTPException):
            self.reset()
            return False
        self.sent_at = None
        if response.will_close:
            self.reset()
        return True

    def reset(self) -> None:
        if self.connection is not None:
            self.connection.close()
        self.connection = None
        self.sent_at = None


def _set_nice(pid: int, value: int) -> bool:
    """Set `pid`'s scheduling niceness; False when not allowed (lowering it needs privileges)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, value)
    except (PermissionError, ProcessLookupError):
        return False
    return True


def process_cpu_ms(pid: int) -> float | None:
    """CPU time (user and system, every thread) `pid` has used, in ms; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            raw = stat.read()
    except OSError:
        return None
    # The command name may hold spaces: the fields that follow its closing parenthesis are fixed.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / _TICKS_PER_SECOND


def read_rss_mb(pid: int) -> float | None:
    """Resident memory of `pid` in MB (Linux /proc), None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


@dataclass(eq=False)
class SupervisedWorkerd:
    """One workerd process under a watchdog, kept running by `run()` until its stop event is set."""

    name: str
    host: Host
    limits: Limits
    _: KW_ONLY
    kill_log: KillLog | None = None
    on_kill: Callable[[Kill], None] | None = None
    on_state: Callable[[], None] | None = None
    state: str = field(default="starting", init=False)  # starting, serving, restarting, failed, stopped
    state_since: float = field(default_factory=time.time, init=False)
    last_kill: Kill | None = field(default=None, init=False)
    last_error: str = field(default="", init=False)
    alive_at: float = field(default=0.0, init=False)  # epoch of the last answered probe
    #: epoch the probe awaiting its answer was sent
    unanswered_since: float | None = field(default=None, init=False)
    _serving: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _kill_requested: str | None = field(default=None, init=False, repr=False)
    _restart_requested: bool = field(default=False, init=False, repr=False)

    @property
    def port(self) -> int:
        return self.host.port

    def serving(self) -> bool:
        return self._serving.is_set()

    def wait_serving(self, timeout: float) -> bool:
        return self._serving.wait(timeout)

    def kill(self, reason: str) -> None:
        """Have the watchdog stop the process as if it had run past `reason`'s limit."""
        self._kill_requested = reason

    def blame_ends_at(self) -> float | None:
        """While the loop does not answer: the send time after which a call is never blamed
        for the stall (None while it answers)."""
        since = self.unanswered_since
        return None if since is None else since + _SENT_AFTER_STUCK_PROBE

    def restart(self) -> None:
        """Have the watchdog stop the process (SIGTERM) and start a fresh one, recording nothing."""
        self._restart_requested = True

    def snapshot(self) -> dict[str, Any]:
        process = self.host.process
        return {
            "port": self.port,
            "pid": process.pid if process is not None else None,
            "state": self.state,
            "since": self.state_since,
            "error": self.last_error,
            "last_kill": asdict(self.last_kill) if self.last_kill else None,
        }

    def _set_state(self, state: str) -> None:
        changed = state != self.state
        if changed:
            self.state, self.state_since = state, time.time()
        if state == "serving":
            self._serving.set()
        else:
            self._serving.clear()
        if changed and self.on_state is not None:
            self.on_state()

    def run(self, stop: threading.Event, *, stop_seconds: float = 2.0) -> None:
        """Start the process, watch it, restart it (at once after a kill, backed off after a
        crash) until `stop` is set; then stop it. Raises what `host.start()` raises when it
        cannot be fixed by retrying (FileNotFoundError, the host's own "missing" error)."""

        def start() -> None:
            self.host.start()
            self.last_error = ""

        def failed(error: RuntimeError) -> None:
            self.last_error = str(error)
            self._set_state("failed")
            self.host.process = None

        def exited(ran: float) -> str:
            process, self.host.process = self.host.process, None
            self.last_error = f"exited with {process.returncode if process else '?'} after {ran:.1f} s"
            self._set_state("restarting")
            return self.last_error

        try:
            keep_running(
                stop,
                what=f"workerd for {self.name}",
                start=start,
                watch=lambda: self._watch(stop),
                on_failed_start=failed,
                on_exit=exited,
            )
        finally:
            self._stop_process(stop_seconds)
            self._set_state("stopped")

    def _watch(self, stop: threading.Event) -> bool:
        """Watch the running process until it exits (False) or is killed for a limit (True),
        or `stop` is set (False)."""
        process = self.host.process
        prober = _Prober(self.port)
        niced = False
        interval = self.limits.probe_interval_ms / 1000
        stall = self.limits.stall_ms / 1000
        self.alive_at = time.time()
        cpu_at_answer = process_cpu_ms(process.pid) or 0.0
        self._set_state("serving")
        try:
            while not stop.is_set():
                if process.poll() is not None:
                    return False
                if self._restart_requested:
                    self._restart_requested = False
                    self._set_state("restarting")
                    self.host.stop(timeout=2.0)
                    return True
                tick_started = time.monotonic()
                answered = prober.tick(interval)
                self.unanswered_since = prober.sent_at
                cpu = process_cpu_ms(process.pid) or cpu_at_answer
                if answered:
                    self.alive_at, cpu_at_answer = time.time(), cpu
                    if niced:  # without the privilege to undo it, it stays low until restarted
                        niced = not _set_nice(process.pid, 0)
                    # Answered: probe again one interval after the last, not at once.
                    stop.wait(max(0.0, interval - (time.monotonic() - tick_started)))
                now = time.time()
                silent = now - self.alive_at
                spinning = cpu - cpu_at_answer >= SPINNING_CPU_MS
                if not niced and spinning and silent > _NICE_AFTER_SILENT_INTERVALS * interval:
                    # Until it answers again or is stopped, a spinning workerd yields the CPU
                    # to the others (it would hold a whole core of a small machine).
                    niced = _set_nice(process.pid, 19)
                over_memory = (read_rss_mb(process.pid) or 0) > self.limits.memory_mb
                stalled = silent > stall and spinning
                starved = silent > STARVED_AFTER_STALLS * stall
                if self._kill_requested or over_memory or stalled or starved:
                    reason = self._kill_requested or ("memory" if over_memory else "cpu" if stalled else "starved")
                    self._kill_requested = None
                    self._kill(process, reason, prober.sent_at, now)
                    return True
        finally:
            prober.reset()
            self.unanswered_since = None
        return False

    def _kill(self, process: subprocess.Popen, reason: str, stuck_at: float | None, now: float) -> None:
        # The loop stalled if a probe has been waiting longer than a couple of intervals:
        # then the culprit is a call that reached it around the stall. A process bloated with
        # its loop still answering cannot tell which of its calls allocates: all in flight.
        stalled = stuck_at is not None and now - self.alive_at > 2 * self.limits.probe_interval_ms / 1000
        kill = Kill(
            name=self.name,
            pid=process.pid,
            reason=reason,
            limit=self.limits.memory_mb if reason == "memory" else self.limits.stall_ms,
            at=now,
            culprit_from=self.alive_at - _SENT_BEFORE_LAST_ANSWER if stalled else 0.0,
            # A starved process blames nobody; one bloated with its loop answering, every call.
            culprit_until=0.0 if reason == "starved" else stuck_at + _SENT_AFTER_STUCK_PROBE if stalled else now,
        )
        # Recorded before the kill: a caller whose connection drops reads it at once.
        if self.kill_log is not None:
            self.kill_log.record(kill)
        self.last_kill = kill
        self._set_state("restarting")
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()
        self.host.process = None
        logger.warning("workerd for %s (pid %s) %s; stopped it", self.name, kill.pid, kill.describe())
        if self.on_kill is not None:
            self.on_kill(kill)

    def _stop_process(self, timeout: float) -> None:
        process = self.host.process
        if process is None:
            return
        stalled = self.state == "serving" and time.time() - self.alive_at > 3 * self.limits.probe_interval_ms / 1000
        if stalled and process.poll() is None:
            # A stalled workerd does not act on SIGTERM until its loop turns again.
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        self.host.stop(timeout=timeout)
