"""A small process supervisor for the embedded mode (`runsigil`): starts programs in order,
relays their output, restarts those that die (when, as sigil.restarts says), and stops them
all by pid.

However the supervisor ends, its programs end too: each gets SIGTERM from the kernel when
the supervisor dies (sigil.lifetime), and each is recorded in a pid file, so that the
next start ends by SIGKILL whatever of them did not stop."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from sigil.lifetime import PidFiles, die_with_parent
from sigil.logs import relayed_line
from sigil.restarts import Backoff

logger = logging.getLogger(__name__)


class StandIn(Protocol):
    """What holds a program's port while the program does not (sigil_site/stand_in.py)."""

    def open(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Program:
    """A long-running command and how to tell that it serves.

    `ready` is called repeatedly until it returns True; it must be quick and must not raise.
    A program `needed_by_others` is ready, with every program started since the last such
    one (they start together), before the next one is started. A `stand_in` holds the
    program's port whenever the program does not answer there: it is opened once the program
    has exited (died or stopped), and closed once the program is ready after a start, or just
    before the start when the program cannot bind its port beside it (without
    `reuses_port`: SO_REUSEPORT, which granian sets and uvicorn does not).
    """

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    env: dict[str, str] | None = None
    needed_by_others: bool = False
    stop_timeout: float = 10.0
    stand_in: StandIn | None = None
    reuses_port: bool = False


class StartupFailed(Exception):
    """A program exited, or did not become ready, while everything was starting."""

    def __init__(self, program: str, message: str, output: list[str]) -> None:
        super().__init__(f"{program} {message}")
        self.program = program
        self.output = output


@dataclass
class _Child:
    program: Program
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    backoff: Backoff = field(default_factory=Backoff)
    restart_at: float | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    reader: threading.Thread | None = None
    standing_in: bool = False  # its stand-in answers until it is ready


class Supervisor:
    """Runs `programs` as children in their own sessions, so that a Ctrl-C in the terminal
    reaches only the supervisor, which then stops them in the reverse order of their start.

    Each line a child prints is passed to `emit` in the log's format (`log_format`, see
    sigil/logs.py): as it is when it is in that format already, else marked with the
    program's name.
    """

    def __init__(
        self,
        programs: list[Program],
        *,
        emit: Callable[[str], None],
        log_format: str = "text",
        pid_files: PidFiles | None = None,
    ) -> None:
        self.children = [_Child(program) for program in programs]
        self.pid_files = pid_files
        self._emit = emit
        self._log_format = log_format
        self._emit_lock = threading.Lock()
        self._output_lost = False
        self._width = max((len(p.name) for p in programs), default=0)

    def announce(self, text: str) -> None:
        """Write `text` without interleaving it with the children's output."""
        with self._emit_lock:
            if self._output_lost:
                return
            try:
                self._emit(text)
            except (OSError, ValueError):
                # The terminal or pipe is gone (`make run | tee log` after a Ctrl-C): carry on,
                # so that the children are still stopped and their output is still drained.
                self._output_lost = True

    def pids(self) -> dict[str, int]:
        """The pid of each program that is running now."""
        return {c.program.name: c.process.pid for c in self.children if c.process and not _exited(c.process)}

    def run(
        self,
        stop_event: threading.Event,
        *,
        on_ready: Callable[[], None] = lambda: None,
        ready_timeout: float = 60.0,
        poll_seconds: float = 0.2,
    ) -> None:
        """Start everything, call `on_ready`, keep it running until `stop_event` is set, stop it all.

        Raises StartupFailed when a program exits or is not ready within `ready_timeout`
        while starting; everything already started is stopped first. Call it from a thread
        other than the one whose signal handlers set `stop_event`.
        """
        try:
            if not self._start_all(stop_event, ready_timeout, poll_seconds):
                return
            on_ready()
            while not stop_event.wait(poll_seconds):
                self._restart_dead()
        finally:
            self.stop_all()

    def _start_all(self, stop_event: threading.Event, timeout: float, poll_seconds: float) -> bool:
        deadline = time.monotonic() + timeout
        waiting: list[_Child] = []
        for child in self.children:
            self._spawn(child)
            waiting.append(child)
            if child.program.needed_by_others:
                if not self._wait_ready(waiting, stop_event, deadline, poll_seconds):
                    return False
                waiting = []
        return self._wait_ready(waiting, stop_event, deadline, poll_seconds)

    def _wait_ready(self, children: list[_Child], stop_event: threading.Event, deadline: float, poll: float) -> bool:
        pending = list(children)
        while pending:
            for child in list(pending):
                if _exited(child.process):
                    _reap(child.process)
                    self._join_reader(child)
                    raise StartupFailed(
                        child.program.name, f"exited with {child.process.returncode} while starting", list(child.tail)
                    )
                if child.program.ready():
                    self._now_ready(child)
                    pending.remove(child)
            if not pending:
                break
            if time.monotonic() >= deadline:
                names = ", ".join(c.program.name for c in pending)
                raise StartupFailed(names, "did not become ready in time", list(pending[0].tail))
            if stop_event.wait(poll):
                return False
        return True

    def _now_ready(self, child: _Child) -> None:
        if child.standing_in:
            child.program.stand_in.close()
            child.standing_in = False

    def _stand_in(self, child: _Child) -> None:
        """The program has exited: its stand-in holds its port until it is ready again."""
        if child.program.stand_in is not None:
            child.program.stand_in.open()
            child.standing_in = False

    def _spawn(self, child: _Child) -> None:
        program = child.program
        if program.stand_in is not None:
            if program.reuses_port:
                child.standing_in = True
            else:
                program.stand_in.close()
        child.process = subprocess.Popen(
            program.argv,
            env=program.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # SIGTERM, so that each stops as it does on Ctrl-C (Redis writes out its file,
            # Celery hands back its tasks); spawned from the supervising thread, which lives
            # as long as the supervisor does.
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        if self.pid_files is not None:
            self.pid_files.record(program.name, child.process.pid)
        child.started_at = time.monotonic()
        child.restart_at = None
        child.reader = threading.Thread(
            target=self._relay, args=(child, child.process), name=f"relay-{program.name}", daemon=True
        )
        child.reader.start()
        logger.info("started %s (pid %s)", program.name, child.process.pid)

    def _relay(self, child: _Child, process: subprocess.Popen) -> None:
        name = child.program.name
        for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            child.tail.append(line)
            # Read on even when nobody can see it, or the child would block on a full pipe.
            self.announce(relayed_line(name, line, kind=self._log_format, width=self._width))
        process.stdout.close()

    def _join_reader(self, child: _Child) -> None:
        if child.reader is not None:
            child.reader.join(2)

    def _restart_dead(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is None:
                if not _exited(child.process):
                    if child.standing_in and child.program.ready():
                        self._now_ready(child)
                    continue
                _reap(child.process)
                self._stand_in(child)
                ran = now - child.started_at
                delay = child.backoff.after_exit(ran)
                child.restart_at = now + delay
                logger.warning(
                    "%s (pid %s) exited with %s after %.1f s; restarting in %.1f s",
                    child.program.name,
                    child.process.pid,
                    child.process.returncode,
                    ran,
                    delay,
                )
            if now >= child.restart_at:
                self._join_reader(child)
                self._spawn(child)

    def stop_all(self) -> None:
        """Stop every child, last started first: SIGTERM, then SIGKILL to its process group
        after the program's `stop_timeout`. Idempotent."""
        for child in reversed(self.children):
            process = child.process
            if process is None or process.returncode is not None:
                continue
            if not _exited(process):
                logger.info("stopping %s (pid %s)", child.program.name, process.pid)
                os.kill(process.pid, signal.SIGTERM)  # not send_signal(): it may reap the child first
                deadline = time.monotonic() + child.program.stop_timeout
                while not _exited(process) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not _exited(process):
                    logger.warning(
                        "%s did not stop in %g s; killing it", child.program.name, child.program.stop_timeout
                    )
            _reap(process)
            self._stand_in(child)
            self._join_reader(child)
            if self.pid_files is not None:
                self.pid_files.forget(child.program.name)


def _exited(process: subprocess.Popen) -> bool:
    """Whether the child has exited. It is left unreaped, so its pid, which is also its
    process group's id, cannot be taken by another process before `_reap`."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped by another thread meanwhile
        return True


def _reap(process: subprocess.Popen) -> None:
    """SIGKILL what is left of the child's process group, then collect the child's status.

    Each child leads its own process group (start_new_session), so the group holds the
    child and what it started and left behind (a prefork pool), and nothing else.
    """
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
