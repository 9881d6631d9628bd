"""Hosts of the production layout (docs/operations.md): each a web server and a Celery worker
with a var directory of its own, all on one database, one Redis and one Cloudflare account
(the emulator), as two machines would run them."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import requests

from sigil.ports import free_port
from testsupport.celery_workers import process_environment, start_worker_process
from testsupport.processes import wait_until
from testsupport.servers import ROOT, server_command


class Host:
    """A web server (uvicorn, one worker process, with its async-call runners) and a Celery
    worker (solo pool) consuming `queues`, each in a session of its own so that `kill` takes
    the host down whole, as a machine that dies."""

    def __init__(self, settings, *, name: str, queues: str, port: int | None = None, **extra: str) -> None:
        self.name = name
        self.var_dir = Path(tempfile.mkdtemp(prefix=f"sigil-host-{name}-"))
        self.port = port or free_port()  # a host started again where it was: the same port
        extra = {"SIGIL_VAR_DIR": str(self.var_dir), **extra}
        self.web = subprocess.Popen(
            server_command("uvicorn", port=self.port, workers=1),
            cwd=ROOT,
            env=process_environment(settings, **extra),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.worker = start_worker_process(settings, queue=queues, **extra)
        wait_until(self.healthy, timeout=60, what=f"host {name} to answer /_health")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/_health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def kill(self) -> None:
        """SIGKILL to the web server and the worker, and nothing else: nothing stops in order."""
        for process in (self.web, self.worker):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def stop(self) -> None:
        for process in (self.web, self.worker):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.kill()
        shutil.rmtree(self.var_dir, ignore_errors=True)
