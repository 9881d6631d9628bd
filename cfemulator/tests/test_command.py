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
