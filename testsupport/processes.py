"""Waiting for and looking at the processes that tests start (Linux: reads /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], *, timeout: float, interval: float = 0.05, what: str = "") -> T:
    """Call `condition` until it returns something true, and return that; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        time.sleep(interval)


def stop_session(process: subprocess.Popen, *, timeout: float = 10) -> None:
    """SIGTERM `process` (a server's master stops its own workers), SIGKILL it after `timeout`,
    then SIGKILL its session: workers that outlived their master are still in it (the process
    is started with `start_new_session=True`)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces.
    return raw[raw.rindex(")") + 2 :].split()


def is_alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie counts as exited)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def children(pid: int) -> list[int]:
    """The live direct children of `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and fields[0] != "Z" and int(fields[1]) == pid:
                found.append(int(entry))
    return found


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, whatever its session or process group."""
    found: set[int] = set()
    pending = [pid]
    while pending:
        for child in children(pending.pop()):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def resident_mb(pid: int) -> float:
    """The resident memory (VmRSS) of `pid` in MB; 0 once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0.0)
