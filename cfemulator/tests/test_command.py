"""`manage.py cfemulator` serves the API on 127.0.0.1 with its options, and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
from django.conf import settings

from sigil.ports import free_port, port_is_open
from testsupport.processes import command_line, descendants, wait_until

MANAGE = Path(settings.BASE_DIR) / "manage.py"


def test_command_serves_with_its_options_and_stops_workerd_on_sigterm(tmp_path):
    port, workerd_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            str(MANAGE),
            "cfemulator",
            "--port",
            str(port),
            "--workerd-port",
            str(workerd_port),
            "--script-limit",
            "1",
            "--propagation-delay",
            "2.5",
            "--token",
            "command-test-token",
            "--account-id",
            "acc0",
            "--state-dir",
            str(tmp_path),
            "--plan",
            "free",
            "--no-workers-for-platforms",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "CF_API_TOKEN": ""},
    )
    try:
        deadline = time.monotonic() + 20
        while not port_is_open(port):
            assert process.poll() is None, process.stdout.read().decode()
            assert time.monotonic() < deadline, "the emulator did not listen within 20 s"
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}/client/v4/accounts/acc0/workers/scripts"
        auth = {"Authorization": "Bearer command-test-token"}
        meta = '{"main_module": "w.js", "compatibility_date": "2025-01-01"}'
        # A Worker the loader host can serve: one with a fetch handler.
        worker = b"export default { fetch() { return new Response('ok') } }"

        def upload(name: str, metadata: str = meta) -> requests.Response:
            files = [
                ("metadata", (None, metadata)),
                ("w.js", ("w.js", worker, "application/javascript+module")),
            ]
            return requests.put(f"{base}/{name}", headers=auth, files=files, timeout=10)

        loads = meta[:-1] + ', "bindings": [{"type": "worker_loader", "name": "LOADER"}]}'
        refused = upload("loads", loads).json()["errors"][0]  # a free account
        assert (refused["code"], refused["message"]) == (10021, "binding LOADER of type worker_loader is invalid")
        namespaces = requests.get(base.replace("/scripts", "/dispatch/namespaces"), headers=auth, timeout=10)
        assert namespaces.status_code == 403  # no Workers for Platforms subscription
        config = requests.get(f"http://127.0.0.1:{port}/__emulator/config", timeout=10).json()["config"]
        assert config["propagation_delay"] == 2.5
        assert upload("first").status_code == 200
        assert upload("second").json()["errors"][0]["code"] == 10037
        assert port_is_open(workerd_port)
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=15)[0].decode()
    assert process.returncode == 0, output
    assert f"http://127.0.0.1:{port}/client/v4" in output
    assert "command-test-token" not in output
    assert not port_is_open(workerd_port)


def _workerd_of(command: subprocess.Popen, workerd_port: int) -> int | None:
    """The pid of the emulator's own workerd (the one on `workerd_port`), when it runs."""
    config = f"workerd-{workerd_port}.capnp"
    return next((pid for pid in descendants(command.pid) if config in command_line(pid)), None)


def _served(workerd_port: int) -> bool:
    try:
        # The loader host answers anything, with its 403 to a call without Sigil's secret.
        return requests.get(f"http://127.0.0.1:{workerd_port}/", timeout=2).status_code == 403
    except requests.ConnectionError:
        return False


def test_the_emulators_workerd_killed_by_pid_is_served_again_and_started_once(tmp_path):
    port, workerd_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            str(MANAGE),
            "cfemulator",
            "--port",
            str(port),
            "--workerd-port",
            str(workerd_port),
            "--state-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    killed: list[int] = []
    try:
        wait_until(lambda: port_is_open(port) and _served(workerd_port), timeout=20, what="the emulator to serve")
        for _ in range(2):  # supervised for good, not only once
            killed.append(wait_until(lambda: _workerd_of(process, workerd_port), timeout=5, what="its workerd"))
            os.kill(killed[-1], signal.SIGKILL)
            wait_until(
                lambda: _workerd_of(process, workerd_port) not in (None, *killed) and _served(workerd_port),
                timeout=10,
                what="its workerd to be started again",
            )
            assert process.poll() is None
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=15)[0].decode()
    assert process.returncode == 0, output
    # Its supervisor saw each death (it watched the process it started) and never started a
    # second one beside the first.
    for pid in killed:
        assert output.count(f"workerd (pid {pid}) exited with -9") == 1, output
    assert "did not start" not in output and "held by another process" not in output, output
