import http.client
import json
import os
import signal
import sys
import threading
import time

import pytest

from sigil.ports import free_port
from sigil_site.stand_in import StandIn
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


class RecordedStandIn(StandIn):
    """The real stand-in, recording when the supervisor opens and closes it."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.events: list[str] = []

    def open(self) -> None:
        self.events.append("open")
        super().open()

    def close(self) -> None:
        self.events.append("close")
        super().close()


def answer(port: int) -> tuple[int, str | None, bytes] | None:
    """(status, Retry-After, body) of a GET on `port`; None when the connection is refused."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/alice/echo")
        response = connection.getresponse()
        return response.status, response.getheader("Retry-After"), response.read()
    except ConnectionRefusedError:
        return None
    finally:
        connection.close()


def web_server(port: int, *, reuses_port: bool) -> list[str]:
    """A program answering 404 on `port`, with SO_REUSEPORT or not, after a second's start."""
    return python(
        "import http.server as s, time; time.sleep(1)\n"
        f"class Server(s.HTTPServer): allow_reuse_port = {reuses_port}\n"
        f"Server(('127.0.0.1', {port}), s.SimpleHTTPRequestHandler).serve_forever()"
    )


class Answers:
    """GETs on a port from a thread until stopped, each answer's status filed: None when the
    connection was refused, "broken" when it broke (the program killed under it)."""

    def __init__(self, port: int) -> None:
        self.port, self.statuses, self.stop = port, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                answered = answer(self.port)
            except OSError:
                answered = ("broken",)
            self.statuses.append(answered[0] if answered else None)
            time.sleep(0.01)

    def end(self) -> set:
        self.stop.set()
        self.thread.join(10)
        return set(self.statuses)


@pytest.mark.parametrize("reuses_port", [True, False], ids=["beside-it", "before-it"])
def test_a_stand_in_answers_503_on_the_port_while_its_program_does_not_hold_it(reuses_port):
    port = free_port()
    stand_in = RecordedStandIn(port)
    stand_in.open()
    status, retry_after, body = answer(port)
    assert (status, retry_after) == (503, "1")
    assert json.loads(body)["error"]["code"] == "unavailable"

    serves = lambda: (answer(port) or (0, "stand-in"))[1] is None  # noqa: E731 (the program's 404)
    program = Program(
        "web", web_server(port, reuses_port=reuses_port), ready=serves, stand_in=stand_in, reuses_port=reuses_port
    )
    answers = Answers(port)
    with Running([program]) as running:
        # While it started (a second): beside a program that shares its port, no connection
        # was refused; before one that does not, its port was closed for that second.
        seen = answers.end() - {"broken"}
        assert 404 in seen and (None in seen) is not reuses_port, seen
        first = running.supervisor.pids()["web"]
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: running.supervisor.pids().get("web") not in (None, first), timeout=10, what="a restart")
        wait_until(serves, timeout=10, what="the program to answer again")
        wait_until(lambda: stand_in.events.count("close") == 2, timeout=5, what="the stand-in to close again")
    # Stopped: the stand-in holds the port again, until its owner closes it.
    assert answer(port)[:2] == (503, "1")
    assert stand_in.events == ["open", "close", "open", "close", "open"]
    stand_in.close()
    assert answer(port) is None
