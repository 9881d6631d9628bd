"""Processes that end with the process that started them, however it ends.

Two means, because one alone leaves a gap:

- The kernel's parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`), set in the child
  between fork and exec: when its parent dies, even by SIGKILL, the child gets the signal.
  Chosen over keeping the children in the parent's process group, which a `kill -9` of the
  parent's pid alone (not its group) does not reach, and which a Ctrl-C in a terminal would
  reach directly, behind the supervisor's back. The signal follows the *thread* that
  started the child: start children from a thread that lives as long as they should.
- Pid files (`PidFiles`) for what a parent-death signal cannot end: a program that takes
  its time over SIGTERM, or whatever its own children left, or the instant between fork
  and prctl. A start ends, by SIGKILL (to its process group, when it leads one), what a
  previous run recorded and left behind when it died, before it binds ports.

A supervisor itself runs until SIGINT or SIGTERM (`supervise_until_signalled`).

Imports nothing of Sigil's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def die_with_parent(signum: int = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child gets `signum` when the calling thread's
    process dies. Only async-signal-safe work happens in the child (one prctl, one getppid)."""
    parent = os.getpid()

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signum)

    return preexec


def start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), None when there is no such
    process: with the pid, it names one process, never a later one given the same pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


class PidFiles:
    """`directory/NAME.pid` for each running program: its pid and start time, and those of
    the process that started it (its parent), so that a later start can tell what a dead
    run left (a leftover) from what a live one runs."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def record(self, name: str, pid: int, *, parent: int | None = None) -> None:
        """Record `pid` as `name`, started by `parent` (this process unless given)."""
        parent = os.getpid() if parent is None else parent
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{name}.pid"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{pid} {start_time(pid) or '-'} {parent} {start_time(parent) or '-'}\n")
        os.replace(tmp, path)

    def forget(self, name: str) -> None:
        (self.directory / f"{name}.pid").unlink(missing_ok=True)

    def _read(self, name: str) -> tuple[int, str, int, str] | None:
        try:
            pid, started, parent, parent_started = (self.directory / f"{name}.pid").read_text().split()
            return int(pid), started, int(parent), parent_started
        except (FileNotFoundError, ValueError):
            return None

    def running(self, name: str) -> int | None:
        """The pid recorded for `name` when that very process still runs."""
        recorded = self._read(name)
        if recorded is None:
            return None
        pid, started, _, _ = recorded
        return pid if start_time(pid) == started else None

    def end_leftover(self, name: str, *, wait_seconds: float = 10.0) -> bool:
        """When the process that started `name` is gone, SIGKILL what is left of `name`: the
        program and, when it leads a process group, that group (what it started, when it is
        gone itself); wait until all of it is gone, and forget it. True when something was
        left. A program whose parent still runs is left alone, and so is its file."""
        recorded = self._read(name)
        if recorded is None:
            self.forget(name)
            return False
        pid, started, parent, parent_started = recorded
        if start_time(parent) == parent_started:
            return False
        now = start_time(pid)
        if now is not None and now != started:  # the pid was given to another process since
            self.forget(name)
            return False

        def left() -> list[int]:
            alive = [pid] if start_time(pid) == started else []
            return alive + [member for member in group_members(pid) if member != pid]

        found = bool(left())
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # a process group's id is that of its leader
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if start_time(pid) == started:
                os.kill(pid, signal.SIGKILL)  # one that leads no group of its own
        deadline = time.monotonic() + wait_seconds
        while left() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.forget(name)
        return found

    def end_leftovers(self, *, wait_seconds: float = 10.0) -> list[str]:
        """end_leftover() for every program recorded here; the names something was left of."""
        return [
            path.stem
            for path in sorted(self.directory.glob("*.pid"))
            if self.end_leftover(path.stem, wait_seconds=wait_seconds)
        ]


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (a process group's id is not given to a new
    process while any member lives)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def supervise_until_signalled(supervise: Callable[[threading.Event], None], *, name: str) -> None:
    """Run `supervise(stop)` until SIGINT or SIGTERM sets `stop`; re-raise what it raised.

    It runs in its own thread so that the signal handlers, which run on the main thread,
    never wait on a lock that thread holds.
    """
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            supervise(stop)
        except BaseException as exc:  # handed to the main thread, which raises it
            failure.append(exc)

    thread = threading.Thread(target=run, name=name)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    if failure:
        raise failure[0]
