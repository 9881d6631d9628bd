"""The Cloudflare emulator for tests: one started on loopback, a handle on it (its addresses,
credentials and /__emulator/ controls, all over HTTP), and Sigil's Cloudflare client on it."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from capabilities.runtimes.cloudflare import CloudflareClient
from cfemulator.config import DEV_ACCOUNT_ID, DEV_TOKEN, EmulatorConfig
from cfemulator.server import EmulatorServer
from sigil.ports import free_port
from testsupport.processes import wait_until


def emulator_server(*, workerd_binary: str, state_dir: Path, port: int = 0) -> EmulatorServer:
    """An emulator (not started yet) with the development credentials and the start config,
    its account kept under `state_dir`; `port=0` takes a free one when it binds."""
    return EmulatorServer.build(
        workerd_binary=workerd_binary,
        state_dir=state_dir,
        token=DEV_TOKEN,
        account_id=DEV_ACCOUNT_ID,
        config=EmulatorConfig(),
        port=port,
        workerd_port=free_port(),
    )


@dataclass
class EmulatorControl:
    """What a test needs to point Sigil at the emulator and to steer it.

    `configure(script_limit=3, rate_limit="5/2", fail_next=2, ...)` changes the running
    emulator; `reset()` restores the start config and forgets everything.
    """

    url: str
    token: str
    account_id: str
    _session: requests.Session = field(default_factory=requests.Session, repr=False)

    @property
    def api_base(self) -> str:
        return f"{self.url}/client/v4"

    @property
    def subdomain(self) -> str:
        return self.config()["subdomain"]

    def workers_dev_host(self, script: str) -> str:
        """The Host header that reaches `script` on its workers.dev URL."""
        return f"{script}.{self.subdomain}.workers.dev"

    def dispatch_host(self, namespace: str, script: str) -> str:
        """The Host header that reaches a script in a dispatch namespace (emulator only)."""
        return f"{script}.{namespace}.dispatch.localhost"

    def reset(self) -> dict[str, Any]:
        return self._call("POST", "/__emulator/reset")["config"]

    def config(self) -> dict[str, Any]:
        return self._call("GET", "/__emulator/config")["config"]

    def configure(self, **changes: Any) -> dict[str, Any]:
        return self._call("POST", "/__emulator/config", json=changes)["config"]

    def api_calls(self, *, method: str | None = None, path_suffix: str | None = None) -> list[dict[str, Any]]:
        """The API calls received since the last reset, oldest first, optionally filtered."""
        calls = self._call("GET", "/__emulator/requests")["requests"]
        return [
            call
            for call in calls
            if (method is None or call["method"] == method)
            and (path_suffix is None or call["path"].endswith(path_suffix))
        ]

    def dispatches(self) -> list[dict[str, Any]]:
        """The calls made through dispatch namespace bindings since the last reset, oldest first:
        namespace, script, the limits the dispatch Worker asked for, status."""
        return self._call("GET", "/__emulator/dispatches")["dispatches"]

    def processes(self, key_suffix: str = "") -> list[dict[str, Any]]:
        """The scripts' workerd processes (`key`, `name`, `generation`, `pid`, `port`, `state`, `calls`
        in flight, `replaced`), those whose key ends with `key_suffix` (a script's name)."""
        processes = self._call("GET", "/__emulator/processes")["processes"]
        return [process for process in processes if process["key"].endswith(key_suffix)]

    def dynamic_workers(self) -> list[dict[str, Any]]:
        """The Dynamic Workers that Worker Loader bindings handed over since the last reset:
        their loader Worker's process, binding and id, and the name and pid of the process each
        runs in while it has one."""
        return self._call("GET", "/__emulator/dynamic-workers")["dynamic_workers"]

    def worker_request(self, host: str, path: str = "/", method: str = "GET", **kwargs: Any) -> requests.Response:
        """One request to a Worker served by the emulator, addressed by Host header."""
        headers = {**kwargs.pop("headers", {}), "Host": host}
        return self._session.request(method, self.url + path, headers=headers, timeout=30, **kwargs)

    @classmethod
    def of(cls, server: EmulatorServer) -> EmulatorControl:
        """The handle on `server`, once it is bound, with its credentials."""
        return cls(url=server.url, token=server.token, account_id=server.api.account_id)

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self._session.request(method, self.url + path, timeout=10, **kwargs)
        response.raise_for_status()
        return response.json()


def cloudflare_client(emulator: EmulatorControl, redis: Any, **tuning: Any) -> CloudflareClient:
    """Sigil's Cloudflare client on `emulator`'s account, with `tuning` (its retries and
    backoffs) over the client's own defaults. The caller closes it."""
    return CloudflareClient(
        base_url=emulator.api_base, account_id=emulator.account_id, api_token=emulator.token, redis=redis, **tuning
    )


def namespace_upload(client: CloudflareClient, namespace: str, script: str, *, code: str, tags: list[str]) -> None:
    """`code` uploaded as the one module of `script` in dispatch `namespace` through `client`,
    as the account's owner (or a Sigil) puts a script there."""
    client.namespace_script_upload(
        namespace, script, modules={"w.js": code}, main_module="w.js", compatibility_date="2025-01-01", tags=tags
    )


def killed_under_a_call(
    emulator: EmulatorControl, key_suffix: str, call: Callable[[], Any], *, runs: Callable[[], bool]
):
    """`call()`'s answer, the workerd of the script whose key ends with `key_suffix` killed by
    pid (not by the emulator) once `runs()` says the call runs there."""
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(call)
        wait_until(runs, timeout=15, what="the call to run in its script's process")
        [process] = [p for p in emulator.processes(key_suffix) if p["calls"]]
        os.kill(process["pid"], signal.SIGKILL)
        return answer.result()
