"""The ports of the emulator's workerd processes: chosen by the kernel and held by the
emulator for as long as their process may run, so that a second checkout's emulator (or any
program asking for a free port) is never given one, even while its process restarts."""

from __future__ import annotations

import errno
import os
import signal
import socket

import pytest

from testsupport.capability_code import PONG
from testsupport.cast import wait_for


def plain_bind_refused(port: int) -> bool:
    """Whether another program's bind to `port` (as a server that picked it would do) is refused."""
    with socket.socket() as other:
        try:
            other.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


@pytest.mark.parametrize("backend", ["worker-pool", "platform"])
def test_a_scripts_port_stays_the_emulators_while_its_workerd_restarts(backend, request, alice, settings):
    emulator = request.getfixturevalue(backend.replace("-", "_"))
    assert alice.deploy(name="ping", code=PONG).status_code == 201
    assert alice.call("/alice/ping").text == "pong"
    [process] = [p for p in emulator.processes() if p["state"] == "serving" and p["port"]][:1]
    port, pid = process["port"], process["pid"]
    assert plain_bind_refused(port)

    os.kill(pid, signal.SIGKILL)  # the supervisor starts it again, on the same port
    assert plain_bind_refused(port)  # held while nothing listens there

    def restarted() -> dict | None:
        again = next(p for p in emulator.processes() if p["name"] == process["name"])
        return again if again["state"] == "serving" and again["pid"] not in (None, pid) else None

    wait_for(restarted, message="the script's workerd started again")
    assert restarted()["port"] == port
    assert alice.call("/alice/ping").text == "pong"
