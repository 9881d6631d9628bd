"""A supervised workerd per name (`WorkerdGroup`), on a port each that every process agrees
on (`PortRegistry`), and the status file through which other processes see them.

- `PortRegistry(path, base_port)`: `port_for(name)` is stable for a name across restarts of
  every process (an index kept in a JSON file, allocated once under a file lock); `names()`.
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
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from capabilities.workerd.supervision import Host, Kill, KillLog, Limits, SupervisedWorkerd
from sigil.files import write_atomically

logger = logging.getLogger(__name__)

#: how long a status file stays believable without being rewritten
STATUS_MAX_AGE_SECONDS = 3.0
# How often a group with `idle` asks it which processes are no longer needed (also how long
# a name it has retired may wait to be started again).
RETIRE_CHECK_SECONDS = 1.0


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


class Companion(Protocol):
    """What serves beside the group's processes for as long as it runs (the log sink)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


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
        companions: Sequence[Companion] = (),
    ) -> None:
        self.make_host = make_host
        self.idle = idle
        self.companions = tuple(companions)
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
        for companion in self.companions:
            companion.start()
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
        for companion in self.companions:
            companion.stop()
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
