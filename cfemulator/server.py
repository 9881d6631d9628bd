"""The emulator's HTTP server: the API, the workers.dev proxy to workerd, and /__emulator/ controls.

It listens on 127.0.0.1 only. One thread per connection (keep-alive is honoured), so many
concurrent clients are served at once (`cfemulator.handler`); the account state is guarded by
`CloudflareApi`. This module holds the emulator's parts together: the account, the scripts'
processes, the CPU meter, the start check of uploads and the connections to workerd.

- `/client/v4/...`               the Cloudflare API (see `cfemulator.api`)
- Host `{script}.{sub}.workers.dev` the script, run by a workerd process of its own
                                 (`cfemulator.scripts`), stopped with Cloudflare's error
                                 1102 when a call runs past its CPU limit (`cfemulator.limits`)
- Host `{script}.{ns}.dispatch.localhost` a script of a dispatch namespace, as a dispatch
                                 namespace binding reaches it
- `/{script}.{sub}.workers.dev/...` the workers.dev door: that script at `/...`, for a URL
                                 curl calls without a Host header
- header `x-cfemulator-kv`       a KV binding's read or write, from a bound script (and
                                 `x-cfemulator-kv-location`, the script's process)
- headers `x-cfemulator-dynamic-*` a Worker Loader binding's Dynamic Workers: the hand-over
                                 of their code, their calls and their tail events
                                 (`cfemulator.dynamic`)
- `GET  /__emulator/requests`    the API calls received: method, path, status, code, time
- `GET  /__emulator/dispatches`  the calls made through dispatch namespace bindings
- `GET  /__emulator/processes`   the scripts' workerd processes: key, version, pid, port, state,
                                 calls in flight, and whether a newer version replaced it
- `GET  /__emulator/dynamic-workers` the Dynamic Workers handed over by Worker Loader
                                 bindings, each with the process it runs in while it has one
- `POST /__emulator/reset`       forget scripts, namespaces, KV, counters and the log
- `GET|POST /__emulator/config`  read or change script_limit, latency, fault_rate,
                                 fault_seed, fail_next, rate_limit ("N/S"),
                                 script_max_bytes, subdomain, default_cpu_ms,
                                 cpu_grace_ms, propagation_delay,
                                 kv_propagation_seconds, kv_miss_cache_seconds,
                                 empty_delete_answers, dynamic_idle_seconds

Bodies stream both ways through the proxy to a script's workerd (`cfemulator.proxy`), and
WebSocket upgrades pass through as on Cloudflare (`cfemulator.tunnel`); the account's state is kept in
`account.pickle` under the state directory (`cfemulator.state`), so it survives a restart.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import urllib3
from urllib3 import HTTPHeaderDict

from capabilities.workerd.host import WorkerdHost
from cfemulator.api import API_PREFIX, CloudflareApi
from cfemulator.compat import read_runtime
from cfemulator.config import EmulatorConfig
from cfemulator.cpumeter import CpuMeter
from cfemulator.dynamic import DynamicWorkers
from cfemulator.envelope import ApiError
from cfemulator.handler import HttpServer
from cfemulator.hostcode import HostUnanswered, start_problem
from cfemulator.scripts import ScriptProcesses
from cfemulator.tails import TailRelay
from cfemulator.timings import CallTimings
from cfemulator.tunnel import Handshake, open_upgrade

LISTEN_ADDRESS = "127.0.0.1"
# The process that runs uploads' start checks, beside the scripts' own (their keys hold a colon).
START_CHECK_NAME = "start-check"
# Cloudflare's limit on a script's top-level code at upload (reference §7.3).
STARTUP_CPU_MS = 1000
STARTUP_EXCEEDED = "Script startup exceeded CPU time limit."


class EmulatorServer:
    """The emulator: a threaded HTTP server on 127.0.0.1 in front of `api` and `workerd`.

    `start()` runs it in a background thread (tests); `serve_forever()` in the caller's
    (the management command). `port=0` picks a free port; `port` then tells which.
    Each script is served by a supervised process of its own (`scripts`), and so is each
    Dynamic Worker of a Worker Loader (`dynamic`), their calls metered by `meter`; uploads are
    started in one more (`start_check`). `workerd` is a plain loader
    host over the same code directory, for running bundles without the proxy (benchmarks).
    """

    def __init__(self, *, api: CloudflareApi, workerd: WorkerdHost, token: str, port: int = 0) -> None:
        self.api = api
        self.workerd = workerd
        self.token = token
        self.scripts = ScriptProcesses(
            binary=workerd.binary,
            state_dir=workerd.state_dir.parent / "scripts",
            code_dir=workerd.code_dir,
            secret=workerd.secret,
        )
        self.meter = CpuMeter(grace_ms=lambda: self.api.config.cpu_grace_ms)
        self.dynamic = DynamicWorkers(scripts=self.scripts, idle_seconds=lambda: self.api.config.dynamic_idle_seconds)
        self.timings = CallTimings()
        self.tails = TailRelay(api=api, scripts=self.scripts, dynamic=self.dynamic, timings=self.timings)
        self._requested_port = port
        self._http: HttpServer | None = None
        self._thread: threading.Thread | None = None
        self._pools_lock = threading.Lock()
        self._pools: dict[int, urllib3.HTTPConnectionPool] = {}

    @classmethod
    def build(
        cls,
        *,
        workerd_binary: str,
        state_dir: Path,
        token: str,
        account_id: str,
        config: EmulatorConfig,
        port: int = 0,
        workerd_port: int,
    ) -> EmulatorServer:
        """An emulator with its own workerd processes (own code directory, ports and secret) under `state_dir`."""
        state_dir = Path(state_dir)
        workerd = WorkerdHost(
            binary=workerd_binary,
            port=workerd_port,
            code_dir=state_dir / "code",
            state_dir=state_dir / "workerd",
            secret=secrets.token_hex(32),
        )
        api = CloudflareApi(
            token=token,
            account_id=account_id,
            code_dir=workerd.code_dir,
            config=config,
            seal_key=workerd.secret,
            # Bound late: the server that runs the checks is made from this account.
            start_check=lambda loader_id: server.start_check(loader_id),
            # The account outlives the process, as a Cloudflare account does.
            state_file=state_dir / "account.pickle",
            runtime=read_runtime(workerd_binary),
        )
        server = cls(api=api, workerd=workerd, token=token, port=port)
        return server

    @property
    def url(self) -> str:
        return f"http://{LISTEN_ADDRESS}:{self.port}"

    @property
    def port(self) -> int:
        """The port it listens on. Raises RuntimeError before `bind`."""
        if self._http is None:
            raise RuntimeError("the emulator is not bound yet")
        return self._http.server_address[1]

    @property
    def api_base(self) -> str:
        return f"{self.url}{API_PREFIX}"

    def bind(self) -> None:
        """Open the listening socket on 127.0.0.1 (never any other address)."""
        self._http = HttpServer((LISTEN_ADDRESS, self._requested_port), self)
        self.scripts.emulator_port = self.port

    def start(self) -> None:
        """Start workerd and serve in a background thread."""
        self.workerd.start()
        self.bind()
        self.meter.start()
        self.dynamic.start()
        self._thread = threading.Thread(target=self._http.serve_forever, name="cfemulator", daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        """Serve in this thread until shutdown() is called or an exception (a signal) stops it."""
        if self._http is None:
            self.bind()
        self.meter.start()
        self.dynamic.start()
        self._http.serve_forever()

    def stop(self) -> None:
        """Stop serving, close the socket, and stop workerd."""
        if self._http is not None:
            if self._thread is not None:
                self._http.shutdown()
                self._thread.join(timeout=5)
                self._thread = None
            self._http.server_close()
            self._http.close_connections()
            self._http = None
        self.meter.stop()
        self.dynamic.stop()
        self.dynamic.reset()
        with self._pools_lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
        self.scripts.stop_all()
        self.workerd.stop()

    def reset(self) -> None:
        """Forget the account's state and its Dynamic Workers, and stop every script's workerd."""
        self.api.reset()
        self.dynamic.reset()
        self.scripts.stop_all()

    def start_check(self, loader_id: str) -> str | None:
        """Start uploaded code, as Cloudflare does at upload: None when it starts, else why not.

        It runs in a supervised process of its own, under Cloudflare's startup limit, so code
        whose top level never ends is refused (10021's "Script startup exceeded CPU time
        limit.") instead of holding the account. Raises ApiError 500 when it cannot be asked.
        """
        try:
            running = self.scripts.acquire(START_CHECK_NAME, sha=loader_id.rpartition("@")[2])
        except (RuntimeError, TimeoutError) as exc:
            raise ApiError(500, 10002, f"the emulator's workerd for start checks is not serving: {exc}") from exc
        pid = running.pid
        if pid is None:
            raise ApiError(500, 10002, "the emulator's workerd for start checks is restarting; try again")
        with self.meter.call(
            pid=pid, stop=running.stop_for_cpu, limit_ms=STARTUP_CPU_MS, silent=running.silent
        ) as ticket:
            try:
                return start_problem(port=running.port, host_secret=self.scripts.secret, loader_id=loader_id)
            except FileNotFoundError:
                raise ApiError(
                    500, 10002, f"the emulator's workerd did not find the script it was just given ({loader_id})"
                ) from None
            except HostUnanswered as exc:
                if ticket.exceeded:
                    return STARTUP_EXCEEDED
                raise ApiError(500, 10002, f"the emulator's workerd could not start the script: {exc}") from exc

    # --- the script processes' connections, for the request handler ---------------------------

    def proxy(
        self, method: str, target: str, headers: HTTPHeaderDict, body: Iterator[bytes] | None, *, port: int
    ) -> urllib3.BaseHTTPResponse:
        """Send one request to the workerd listening on `port`; its body is read as it arrives.

        The request body is sent as the caller sends it (with `headers`' Content-Length if
        given, else chunked); the answer comes back unread (`preload_content=False`), so the
        caller relays it as workerd produces it and must close it.
        """
        with self._pools_lock:
            pool = self._pools.get(port)
            if pool is None:
                pool = self._pools[port] = urllib3.HTTPConnectionPool(
                    LISTEN_ADDRESS,
                    port,
                    maxsize=64,
                    block=False,
                    retries=False,
                    timeout=urllib3.Timeout(connect=5.0, read=60.0),
                )
        return pool.urlopen(
            method,
            target,
            body=body,
            headers=headers,
            redirect=False,
            retries=False,
            preload_content=False,
            decode_content=False,
            assert_same_host=False,
        )

    def upgrade(self, method: str, target: str, headers: HTTPHeaderDict, *, port: int) -> Handshake:
        """Send one WebSocket upgrade to the workerd listening on `port`, on a connection of its
        own, and read its answer's head (`cfemulator.tunnel`). Raises HandshakeFailed."""
        return open_upgrade(
            (LISTEN_ADDRESS, port), method, target, headers.items(), connect_timeout=5.0, read_timeout=60.0
        )
