"""Supervised workerd processes: a liveness probe, a CPU-stall and memory watchdog, restarts.

Open-source workerd runs every isolate of a process on one event loop and enforces no CPU
limit: one Worker spinning in `while (true) {}` stops every other Worker of its process, and
the process then ignores SIGTERM. What this module supervises is therefore a process, and
what it contains is damage to that process: a stalled or bloated workerd is SIGKILLed and
started again, and a record of why is left for whoever has calls in flight on it.

API (everything a runtime or the Cloudflare emulator needs; the host is any object with
`start()`, `stop(timeout=...)`, `process` (a Popen or None) and `port`, like
`capabilities.workerd.WorkerdHost`):

- `Limits(stall_ms, memory_mb, probe_interval_ms=100)`: a process whose event loop has not
  answered a probe for `stall_ms`, or whose resident memory is over `memory_mb`, is stopped.
- `Kill`: what the watchdog records before it stops a process: `name`, `pid`, `reason`
  (`"cpu"` or `"memory"`), `limit` (ms or MB), `at` (epoch), and the window of send times
  (`culprit_from`..`culprit_until`) of the calls that can have caused it; `blames(sent_at)`
  tells whether a call sent at `sent_at` (epoch) is one of them. `describe()` is a sentence.
- `KillLog(directory)`: `record(kill)` and `latest(name)`, one JSON file per name, so the
  processes that forwarded the calls (web, Celery) can read what the supervisor decided.
- `PortRegistry(path, base_port)`: `port_for(name)` is stable for a name across restarts of
  every process (an index kept in a JSON file, allocated once under a file lock); `names()`.
- `SupervisedWorkerd(name, host, limits, kill_log=None, on_kill=None, on_state=None)`: one
  process kept running by `run(stop_event)` (in a thread of its own); `state`, `serving()`,
  `wait_serving(timeout)`, `alive_at` (epoch of the last answered probe), `blame_ends_at()`
  (while the loop is silent, the send time after which no call is blamed for it),
  `kill(reason)` (as if past that limit), `restart()` (no record), `snapshot()`. An error
  from `host.start()` with a true `permanent` attribute (workerd not installed) ends the
  supervision; any other RuntimeError is retried, backed off.
- `WorkerdGroup(make_host, limits, registry, kill_log=None, status_path=None, on_kill=None)`:
  one SupervisedWorkerd per name, started on demand. `ensure(name, timeout)` starts (or
  finds) the process for `name` and returns its port once it serves; `run(stop_event)`
  also starts one for every name the registry holds, writes a status file every half
  second and whenever a process changes state (`read_status(path)`), and stops them all
  when `stop_event` is set: SIGTERM, and SIGKILL for any that has not exited after
  `stop_seconds` (a stalled one at once). With `idle(names)`, asked every
  RETIRE_CHECK_SECONDS, the processes of the names it returns are stopped the same way,
  and not started again until it no longer returns them.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import logging
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from capabilities.workerd import write_atomically

logger = logging.getLogger(__name__)

#: a process that dies on its own within this many seconds of its start is backed off
STABLE_SECONDS = 10.0
MAX_BACKOFF_SECONDS = 10.0
#: how long a status file stays believable without being rewritten
STATUS_MAX_AGE_SECONDS = 3.0
# Which calls a stall is blamed on, by send time. The culprit may have been sent well
# before the last answered probe: the loop answers probes while it reads the culprit's code
# and loads its isolate, and only then runs it. It was sent before the first probe left
# unanswered, or not long after: a workerd the kernel did not schedule for a while finds
# both requests waiting when it wakes, and may run the culprit first (seen 40 ms apart on a
# loaded machine). A call of the same process sent within that window is blamed too;
# anything later (`blame_ends_at()`) is not.
_SENT_BEFORE_LAST_ANSWER = 0.5
# A loop silent for this many probe intervals is spinning, not merely busy for a moment.
_NICE_AFTER_SILENT_INTERVALS = 3
_SENT_AFTER_STUCK_PROBE = 0.25
# How often a group with `idle` asks it which processes are no longer needed (also how long
# a name it has retired may wait to be started again).
RETIRE_CHECK_SECONDS = 1.0


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
    reason: str  # "cpu" or "memory"
    limit: int  # ms for "cpu", MB for "memory"
    at: float
    culprit_from: float
    culprit_until: float

    def blames(self, sent_at: float) -> bool:
        """Whether a call sent at `sent_at` (epoch) can be the one that ran past the limit."""
        return self.culprit_from <= sent_at <= self.culprit_until

    def describe(self) -> str:
        if self.reason == "cpu":
            return f"ran past its CPU limit of {self.limit} ms"
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


class PortRegistry:
    """A stable port per name: `base_port` plus an index allocated once and kept in `path`.

    Every process on the machine (web, Celery, the supervisor) reads the same file, so they
    agree on where a name is served, and a restart of any of them changes nothing.
    """

    def __init__(self, path: Path, base_port: int) -> None:
        self.path = Path(path)
        self.base_port = base_port
        self._known: dict[str, int] = {}
        self._lock = threading.Lock()

    def port_for(self, name: str) -> int:
        """The port of `name`, allocating it on first use. Idempotent."""
        index = self._known.get(name)
        if index is None:
            index = self._read().get(name)
        if index is None:
            with self._lock, self._file_lock():
                indices = self._read()
                index = indices.get(name)
                if index is None:
                    index = max(indices.values(), default=-1) + 1
                    indices[name] = index
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    write_atomically(self.path, json.dumps(indices, sort_keys=True).encode())
        self._known[name] = index
        return self.base_port + index

    def names(self) -> list[str]:
        return sorted(self._read())

    def _read(self) -> dict[str, int]:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    @contextlib.contextmanager
    def _file_lock(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


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


class SupervisedWorkerd:
    """One workerd process under a watchdog, kept running by `run()` until its stop event is set."""

    def __init__(
        self,
        name: str,
        host: Host,
        limits: Limits,
        *,
        kill_log: KillLog | None = None,
        on_kill: Callable[[Kill], None] | None = None,
        on_state: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.host = host
        self.limits = limits
        self.kill_log = kill_log
        self.on_kill = on_kill
        self.on_state = on_state
        self.state = "starting"  # starting, serving, restarting, failed, stopped
        self.state_since = time.time()
        self.last_kill: Kill | None = None
        self.last_error = ""
        self.alive_at = 0.0  # epoch of the last answered probe
        self.unanswered_since: float | None = None  # epoch the probe awaiting its answer was sent
        self._serving = threading.Event()
        self._kill_requested: str | None = None
        self._restart_requested = False

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
        backoff = 0.0
        try:
            while not stop.is_set():
                if backoff and stop.wait(backoff):
                    break
                try:
                    self.host.start()
                except RuntimeError as exc:
                    if getattr(exc, "permanent", False):
                        raise
                    backoff = min(max(backoff * 2, 0.2), MAX_BACKOFF_SECONDS)
                    self.last_error = str(exc)
                    self._set_state("failed")
                    logger.error("workerd for %s did not start: %s; retrying in %.1f s", self.name, exc, backoff)
                    self.host.process = None
                    continue
                started = time.monotonic()
                self.last_error = ""
                if self._watch(stop):
                    backoff = 0.0  # stopped for a limit: the next call needs a process at once
                elif not stop.is_set():
                    ran = time.monotonic() - started
                    backoff = 0.0 if ran >= STABLE_SECONDS else min(max(backoff * 2, 0.2), MAX_BACKOFF_SECONDS)
                    process = self.host.process
                    self.last_error = f"exited with {process.returncode if process else '?'} after {ran:.1f} s"
                    logger.warning("workerd for %s %s; restarting in %.1f s", self.name, self.last_error, backoff)
                    self.host.process = None
                    self._set_state("restarting")
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
                if answered:
                    self.alive_at = time.time()
                    if niced:  # without the privilege to undo it, it stays low until restarted
                        niced = not _set_nice(process.pid, 0)
                    # Answered: probe again one interval after the last, not at once.
                    stop.wait(max(0.0, interval - (time.monotonic() - tick_started)))
                now = time.time()
                if not niced and now - self.alive_at > _NICE_AFTER_SILENT_INTERVALS * interval:
                    # Until it answers again or is stopped, a spinning workerd yields the CPU
                    # to the others (it would hold a whole core of a small machine).
                    niced = _set_nice(process.pid, 19)
                rss = read_rss_mb(process.pid)
                if self._kill_requested or now - self.alive_at > stall or (rss or 0) > self.limits.memory_mb:
                    reason = self._kill_requested or ("memory" if (rss or 0) > self.limits.memory_mb else "cpu")
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
            limit=self.limits.stall_ms if reason == "cpu" else self.limits.memory_mb,
            at=now,
            culprit_from=self.alive_at - _SENT_BEFORE_LAST_ANSWER if stalled else 0.0,
            culprit_until=stuck_at + _SENT_AFTER_STUCK_PROBE if stalled else now,
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


class WorkerdGroup:
    """One supervised workerd per name, each in a thread of its own, started on demand."""

    def __init__(
        self,
        make_host: Callable[[str, int], Host],
        limits: Limits,
        registry: PortRegistry,
        *,
        kill_log: KillLog | None = None,
        status_path: Path | None = None,
        on_kill: Callable[[Kill], None] | None = None,
        stop_seconds: float = 2.0,
        idle: Callable[[list[str]], set[str]] | None = None,
    ) -> None:
        self.make_host = make_host
        self.idle = idle
        self.limits = limits
        self.registry = registry
        self.kill_log = kill_log
        self.status_path = Path(status_path) if status_path else None
        self.on_kill = on_kill
        self.stop_seconds = stop_seconds
        self.processes: dict[str, SupervisedWorkerd] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._stops: dict[str, threading.Event] = {}  # one per process: it is retired alone
        self._failures: list[BaseException] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._status_lock = threading.Lock()

    def ensure(self, name: str, *, timeout: float = 15.0) -> int:
        """Start the process of `name` unless it runs; return its port once it serves.

        Raises TimeoutError when it does not serve within `timeout` s."""
        supervised = self._start(name)
        if not supervised.wait_serving(timeout):
            raise TimeoutError(f"workerd for {name} is not serving after {timeout} s: {supervised.last_error}")
        return supervised.port

    def get(self, name: str) -> SupervisedWorkerd | None:
        return self.processes.get(name)

    def _start(self, name: str) -> SupervisedWorkerd:
        with self._lock:
            supervised = self.processes.get(name)
            if supervised is None:
                if self._stop.is_set():
                    raise RuntimeError("the workerd group is stopping")
                supervised = SupervisedWorkerd(
                    name,
                    self.make_host(name, self.registry.port_for(name)),
                    self.limits,
                    kill_log=self.kill_log,
                    on_kill=self.on_kill,
                    # Other processes wait for a new name's process to serve: tell them at once.
                    on_state=self.write_status if self.status_path is not None else None,
                )
                stop = threading.Event()
                thread = threading.Thread(
                    target=self._run_one, args=(supervised, stop), name=f"workerd-{name}", daemon=True
                )
                self.processes[name] = supervised
                self._threads[name] = thread
                self._stops[name] = stop
                thread.start()
            return supervised

    def _run_one(self, supervised: SupervisedWorkerd, stop: threading.Event) -> None:
        try:
            supervised.run(stop, stop_seconds=self.stop_seconds)
        except BaseException as exc:  # handed to run(), which raises it in its caller
            self._failures.append(exc)

    def retire(self, name: str) -> bool:
        """Stop the process of `name` (as `stop` stops every one) and forget it, so that the
        next `ensure` or run of the loop starts a fresh one; return whether one ran."""
        with self._lock:
            supervised = self.processes.pop(name, None)
            thread, stop = self._threads.pop(name, None), self._stops.pop(name, None)
        if supervised is None:
            return False
        stop.set()
        thread.join(self.stop_seconds + 5)
        logger.info("workerd for %s stopped: nothing of it is placed any more", name)
        if self.status_path is not None:
            self.write_status()
        return True

    def run(self, stop: threading.Event, *, poll_seconds: float = 0.2) -> None:
        """Serve every name the registry holds (and any `ensure`d) until `stop` is set, then
        stop them all. Raises the first error a process's supervision could not handle."""
        last_status = last_idle_check = 0.0
        idle: set[str] = set()
        try:
            while not stop.is_set() and not self._failures:
                names = self.registry.names()
                if self.idle is not None and time.monotonic() - last_idle_check >= RETIRE_CHECK_SECONDS:
                    idle, last_idle_check = self.idle(names), time.monotonic()
                    for name in idle & set(self.processes):
                        self.retire(name)
                for name in names:
                    if name not in idle:
                        self._start(name)
                if self.status_path is not None and time.monotonic() - last_status >= 0.5:
                    self.write_status()
                    last_status = time.monotonic()
                stop.wait(poll_seconds)
        finally:
            self.stop()
        if self._failures:
            raise self._failures[0]

    def stop(self) -> None:
        """Stop every process, together. Idempotent."""
        self._stop.set()
        with self._lock:
            stops = list(self._stops.values())
        for event in stops:
            event.set()
        for thread in list(self._threads.values()):
            thread.join(self.stop_seconds + 5)
        if self.status_path is not None:
            self.status_path.unlink(missing_ok=True)

    def write_status(self) -> None:
        with self._status_lock:  # in order: a later snapshot is never replaced by an earlier one
            status = {
                "pid": os.getpid(),
                "at": time.time(),
                "processes": {name: p.snapshot() for name, p in sorted(self.processes.items())},
            }
            self.status_path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.status_path, json.dumps(status).encode())


def read_status(path: Path, *, max_age: float = STATUS_MAX_AGE_SECONDS) -> dict[str, Any] | None:
    """The status a running WorkerdGroup wrote to `path`; None when there is none this fresh."""
    try:
        status = json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return status if time.time() - status.get("at", 0) <= max_age else None
