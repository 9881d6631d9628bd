"""Sigil served by the production servers docs/operations.md names, in processes of their own."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import requests

from testsupport.capability_code import ECHO
from testsupport.processes import stop_session, wait_until

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("granian", "uvicorn")
SIGIL_APPLICATION = "sigil_site.asgi:application"


def server_command(server: str, *, port: int, workers: int, application: str = SIGIL_APPLICATION) -> list[str]:
    """How each ASGI server docs/operations.md names runs Sigil's application (the engine in front
    of Django), or with the same settings another `application` (module:attribute, imported from
    the checkout's root): a benchmark's floor."""
    bin_dir = Path(sys.executable).parent
    bind = ["--workers", str(workers), "--host", "127.0.0.1", "--port", str(port)]
    if server == "uvicorn":
        return [
            str(bin_dir / "uvicorn"),
            application,
            *bind,
            "--timeout-keep-alive",
            "75",
            "--log-level",
            "warning",
            "--no-access-log",
        ]
    if server == "granian":
        return [
            str(bin_dir / "granian"),
            "--interface",
            "asgi",
            "--loop",
            "uvloop",
            *bind,
            "--http",
            "1",
            "--backpressure",
            "8192",
            "--log-level",
            "warning",
            application,
        ]
    raise ValueError(f"unknown server {server!r}")


def database_url(settings_dict: dict) -> str:
    """A DATABASE_URL naming the database `settings_dict` (Django's connection settings) uses."""
    if settings_dict["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{settings_dict['NAME']}"
    user = quote(settings_dict.get("USER") or "", safe="")
    password = quote(settings_dict.get("PASSWORD") or "", safe="")
    host, port = settings_dict.get("HOST") or "localhost", settings_dict.get("PORT") or 5432
    return f"postgres://{user}:{password}@{host}:{port}/{settings_dict['NAME']}"


@contextlib.contextmanager
def served(server: str, *, port: int, environment: dict[str, str], log: Path):
    """Sigil under `server` on 127.0.0.1:`port`, sharing this process's database and Redis;
    yields its base URL once `/_health` answers, and stops it (and only it) on the way out."""
    from django.db import connection

    env = {
        **os.environ,
        "DATABASE_URL": database_url(connection.settings_dict),
        "SIGIL_ACCESS_LOG": "false",
        **environment,
    }
    with log.open("wb") as output:
        process = subprocess.Popen(
            server_command(server, port=port, workers=1),
            cwd=ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"{server} exited with {process.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(requests.RequestException):
                return requests.get(f"{url}/_health", timeout=5).status_code == 200
            return False

        wait_until(healthy, timeout=60, interval=0.2, what=f"Sigil under {server} to answer")
        yield url
    finally:
        stop_session(process, timeout=15)


def chunks(data: bytes, size: int = 7):
    """A body requests sends with Transfer-Encoding: chunked (it has no length)."""
    return (data[i : i + size] for i in range(0, len(data), size))


def deploy_and_echo_chunked(base_url: str, agent, session: requests.Session) -> None:
    body = json.dumps({"name": "echo", "code": ECHO}).encode()
    deployed = session.post(
        f"{base_url}/_api/deploy",
        data=chunks(body),
        headers={**agent.headers(agent.deploy_token), "Content-Type": "application/json"},
        timeout=30,
    )
    assert deployed.status_code in (200, 201), deployed.text
    echoed = session.post(
        f"{base_url}/{agent.name}/echo",
        data=chunks(b"a body sent in chunks, " * 1000),
        headers=agent.headers(agent.invoke_token),
        timeout=30,
    )
    assert echoed.status_code == 207, echoed.text
    assert echoed.json()["body"] == "a body sent in chunks, " * 1000
