import os
import signal
import sys
import threading
import time

import pytest

from sigil_site.supervisor import Program, StartupFailed, Supervisor
from testsupport.processes import descendants, is_alive, wait_until


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


SLEEPER = python("import time; print('up', flush=True); time.sleep(60)")


class Running:
    """A supervisor running in a thread, as runsigil runs it."""

    def __init__(self, programs: list[Program]) -> None:
        self.lines: list[str] = []
        self.supervisor = Supervisor(programs, emit=self.lines.append)
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(
            target=self.supervisor.run, args=(self.stop,), kwargs={"on_ready": self.ready.set}, daemon=True
        )

    def __enter__(self) -> "Running":
        self.thread.start()
        wait_until(self.ready.is_set, timeout=10, what="the programs to be ready")
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(15)
        assert not self.thread.is_alive()


def test_a_program_that_dies_is_started_again():
    with Running([Program("sleeper", SLEEPER, ready=lambda: True)]) as running:
        first = running.supervisor.pids()["sleeper"]
        os.kill(first, signal.SIGKILL)

        def restarted_pid() -> int | None:
            pid = running.supervisor.pids().get("sleeper")
            return pid if pid != first else None

        second = wait_until(restarted_pid, timeout=5, what="a restart")
    assert not is_alive(first)
    assert not is_alive(second)


def test_each_line_a_program_prints_is_passed_on_with_its_name():
    with Running([Program("talker", SLEEPER, ready=lambda: True)]) as running:
        wait_until(lambda: "talker | up" in running.lines, timeout=5, what="the relayed line")


def test_a_program_that_exits_while_starting_fails_the_start_with_its_output():
    supervisor = Supervisor(
        [Program("doomed", python("print('no config', flush=True); raise SystemExit(3)"), ready=lambda: False)],
        emit=lambda line: None,
    )
    with pytest.raises(StartupFailed, match="doomed exited with 3") as failure:
        supervisor.run(threading.Event())
    assert failure.value.output == ["no config"]


def test_a_program_others_need_is_ready_before_the_next_one_starts(tmp_path):
    marker = tmp_path / "ready"
    first = Program(
        "first",
        python(f"import pathlib, time; time.sleep(0.3); pathlib.Path({str(marker)!r}).touch(); time.sleep(60)"),
        ready=marker.exists,
        needed_by_others=True,
    )
    # Exits at once, failing the start, if it is started before `first` is ready.
    second = Program(
        "second", python(f"import os, time; assert os.path.exists({str(marker)!r}); time.sleep(60)"), ready=lambda: True
    )
    with Running([first, second]) as running:
        assert set(running.supervisor.pids()) == {"first", "second"}


def test_stopping_kills_a_program_that_ignores_sigterm_and_what_it_left_behind():
    stubborn = python(
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "time.sleep(60)"
    )
    with Running([Program("stubborn", stubborn, ready=lambda: True, stop_timeout=0.5)]) as running:
        pid = running.supervisor.pids()["stubborn"]
        left_behind = wait_until(lambda: descendants(pid), timeout=5, what="the grandchild")
        stopping_at = time.monotonic()
    # Leaving the block stopped everything: SIGTERM, then SIGKILL to the group after 0.5 s.
    assert time.monotonic() - stopping_at < 5
    wait_until(lambda: not any(is_alive(stray) for stray in {pid, *left_behind}), timeout=2, what="all to be gone")


def test_output_that_cannot_be_written_is_still_read_so_programs_do_not_block():
    def broken_pipe(line: str) -> None:
        raise BrokenPipeError

    # Far more than a pipe holds: the program blocks unless its output is read.
    chatty = python("import time\nfor _ in range(5000): print('x' * 100)\nprint('done', flush=True)\ntime.sleep(60)")
    supervisor = Supervisor([Program("chatty", chatty, ready=lambda: True)], emit=broken_pipe)
    stop = threading.Event()
    thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_until(lambda: "done" in supervisor.children[0].tail, timeout=10, what="the last line")
    finally:
        stop.set()
        thread.join(15)
    assert not thread.is_alive()
