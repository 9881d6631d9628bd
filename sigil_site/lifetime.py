"""Processes that end with the process that started them, however it ends.

Two means, because one alone leaves a gap:

- The kernel's parent-death signal (Linux `prctl(PR_SET_PDEATHSIG)`), set in the child
  between fork and exec: when its parent dies, even by SIGKILL, the child gets the signal.
  Chosen over keeping the children in the parent's process group, which a `kill -9` of the
  parent's pid alone (not its group) does not reach, and which a Ctrl-C in a terminal would
  reach directly, behind the supervisor's back. The signal follows the *thread* that
  started the child: start children from a thread that lives as long as they should.
- Pid files (`PidFiles`) for what a parent-death signal cannot end: a program that takes
  its time over SIGTERM, or whatever its own children left. A start ends, by SIGKILL to
  its process group, what a previous run recorded and left behind, before it binds ports.

Imports nothing of Sigil's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
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
    """`directory/NAME.pid` for each running program: its pid (the leader of its process
    group) and start time."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def record(self, name: str, pid: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{name}.pid"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{pid} {start_time(pid) or ''}\n")
        os.replace(tmp, path)

    def forget(self, name: str) -> None:
        (self.directory / f"{name}.pid").unlink(missing_ok=True)

    def _read(self, name: str) -> tuple[int, str] | None:
        try:
            pid_text, _, started = (self.directory / f"{name}.pid").read_text().strip().partition(" ")
            return int(pid_text), started
        except (FileNotFoundError, ValueError):
            return None

    def running(self, name: str) -> int | None:
        """The pid recorded for `name` when that very process still runs."""
        recorded = self._read(name)
        if recorded is None:
            return None
        pid, started = recorded
        return pid if started and start_time(pid) == started else None

    def end_leftovers(self, *, wait_seconds: float = 10.0) -> list[str]:
        """SIGKILL what is left of the process group of every program recorded here (the
        program, or what it started when it is gone itself), wait until all of it is gone,
        and remove the files. Returns the names of the programs something was left of."""
        ended = []
        for path in sorted(self.directory.glob("*.pid")):
            recorded = self._read(path.stem)
            if recorded is not None:
                pid, started = recorded
                now = start_time(pid)
                # A pid taken by another process since: its group is not the one recorded.
                if (now is None or now == started) and group_members(pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                    ended.append(path.stem)
                    deadline = time.monotonic() + wait_seconds
                    while group_members(pid) and time.monotonic() < deadline:
                        time.sleep(0.05)
            path.unlink(missing_ok=True)
        return ended


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
