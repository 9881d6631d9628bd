"""The emulator's HTTP server: the API, the workers.dev proxy to workerd, and /__emulator/ controls.

It listens on 127.0.0.1 only. One thread per connection (keep-alive is honoured), so many
concurrent clients are served at once; the account state is guarded by `CloudflareApi`.

- `/client/v4/...`               the Cloudflare API (see `cfemulator.api`)
- Host `{script}.{sub}.workers.dev` the script, run by a workerd process of its own
                                 (`cfemulator.scripts`), stopped with Cloudflare's error
                                 1102 when a call runs past its CPU limit (`cfemulator.limits`)
- Host `{script}.{ns}.dispatch.localhost` a script of a dispatch namespace, as a dispatch
                                 namespace binding reaches it
- header `x-cfemulator-kv`       a KV binding's read or write, from a bound script
- `GET  /__emulator/requests`    the API calls received: method, path, status, code, time
- `GET  /__emulator/dispatches`  the calls made through dispatch namespace bindings
- `POST /__emulator/reset`       forget scripts, namespaces, KV, counters and the log
- `GET|POST /__emulator/config`  read or change script_limit, latency, fault_rate,
                                 fault_seed, fail_next, rate_limit ("N/S"),
                                 script_max_bytes, subdomain, default_cpu_ms,
                                 cpu_grace_ms, propagation_delay,
                                 kv_miss_cache_seconds, empty_delete_answers

Bodies stream both ways through the proxy to a script's workerd, and WebSocket upgrades pass
through as on Cloudflare (`cfemulator.tunnel`); the account's state is kept in
`account.pickle` under the state directory (`cfemulator.state`), so it survives a restart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import urllib3
from urllib3 import HTTPHeaderDict

from capabilities.runtimes.base import Route
from capabilities.runtimes.errors import RuntimeRejected, RuntimeUnavailable
from capabilities.runtimes.loader_host import loader_host_start_check
from capabilities.workerd.host import WorkerdHost
from cfemulator.api import MAX_BODY_BYTES, ApiRequest, CloudflareApi, EmulatorConfig, WorkerTarget
from cfemulator.bound import (
    CALL_HEADER,
    EXCEEDED_HEADER,
    KV_HEADER,
    LIMITS_HEADER,
    METER_CPU_HEADER,
    METER_HEADER,
    NOT_FOUND_HEADER,
    ORIGINAL_HOST_HEADER,
    has_worker_loader,
)
from cfemulator.cpumeter import CpuMeter, Ticket
from cfemulator.envelope import ApiError
from cfemulator.limits import call_cpu_ms, exceeded_answer
from cfemulator.scripts import ScriptProcesses
from cfemulator.tunnel import (
    UPGRADE_HEADERS,
    Handshake,
    HandshakeFailed,
    is_websocket_upgrade,
    open_upgrade,
    relay,
)

logger = logging.getLogger(__name__)

LISTEN_ADDRESS = "127.0.0.1"
# Accepted-but-not-yet-served connections; the stdlib default of 5 refuses bursts.
_BACKLOG = 512
# The emulator frames every body itself: a known length is passed on, anything else is chunked.
# RFC 9110 §7.6.1 connection-specific fields, and the length the emulator writes itself.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)
# Bodies are relayed in pieces of at most this many bytes, as they arrive.
_PIECE = 64 * 1024
_WORKER_HOST_SUFFIXES = (".workers.dev", ".dispatch.localhost")
_HOST_HEADERS = frozenset(
    {"x-sigil-secret", "x-sigil-loader-id", "x-sigil-validate", "x-sigil-retire", "x-sigil-store", "x-sigil-cpu-ms"}
)
# Sent by the emulator itself on every answer; a Worker's own (or a nested emulator
# answer's, through a dispatch namespace) would repeat them.
_OWN_HEADERS = frozenset({"content-type", "server", "date"})
_NOT_PASSED = _HOP_BY_HOP | _OWN_HEADERS
# What the emulator's loader host adds to the answer of a plain script it runs (its mark
# for Sigil's gateway, capabilities/runtimes/host/host.js): on Cloudflare the script's
# answer reaches the caller as the script made it, so the mark is taken off again.
_LOADER_HOST_MARKS = frozenset({"x-sigil-host"})


@dataclass(eq=False)
class MeteredCall:
    """A call to a script with a Worker Loader, as `EmulatorServer.meter_mark` knows it by `id`."""

    id: str
    ticket: Ticket
    pid: int
    # Its Dynamic Worker is to throw Cloudflare's "exceeded CPU" at once, when it begins.
    replaying_stop: bool = False


def _unmarked(headers: Iterable[tuple[str, str]], *, unmark: bool) -> list[tuple[str, str]]:
    """`headers`, less the loader host's marks when `unmark` (a plain script's answer)."""
    return [(name, value) for name, value in headers if not (unmark and name.lower() in _LOADER_HOST_MARKS)]


class BodyTooLarge(Exception):
    """The request body is over MAX_BODY_BYTES."""


class LimitExceeded(Exception):
    """The call ran past a limit ("cpu" or "memory") and its script's process was stopped."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EmulatorServer:
    """The emulator: a threaded HTTP server on 127.0.0.1 in front of `api` and `workerd`.

    `start()` runs it in a background thread (tests); `serve_forever()` in the caller's
    (the management command). `port=0` picks a free port; `port` then tells which.
    Each script is served by a supervised process of its own (`scripts`), its calls metered
    by `meter`; uploads are started in one more (`start_check`). `workerd` is a plain loader
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
        # The calls in flight to scripts with a Worker Loader, by the id they were sent with
        # (CALL_HEADER): their Dynamic Workers' limits are metered on them (`meter_mark`).
        self._calls: dict[str, MeteredCall] = {}
        # By process: the call whose Dynamic Worker was let start and has not given the event
        # loop back yet (`meter_mark`); the others' begin waits on `_calls_changed`.
        self._loop_holders: dict[int, str] = {}
        self._calls_lock = threading.Lock()
        self._calls_changed = threading.Condition(self._calls_lock)
        self._requested_port = port
        self._http: _HttpServer | None = None
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
        )
        server = cls(api=api, workerd=workerd, token=token, port=port)
        return server

    @property
    def port(self) -> int:
        if self._http is None:
            raise RuntimeError("the emulator is not bound yet")
        return self._http.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{LISTEN_ADDRESS}:{self.port}"

    @property
    def api_base(self) -> str:
        return f"{self.url}/client/v4"

    def bind(self) -> None:
        """Open the listening socket on 127.0.0.1 (never any other address)."""
        self._http = _HttpServer((LISTEN_ADDRESS, self._requested_port), self)
        self.scripts.emulator_port = self.port

    def start(self) -> None:
        """Start workerd and serve in a background thread."""
        self.workerd.start()
        self.bind()
        self.meter.start()
        self._thread = threading.Thread(target=self._http.serve_forever, name="cfemulator", daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        """Serve in this thread until shutdown() is called or an exception (a signal) stops it."""
        if self._http is None:
            self.bind()
        self.meter.start()
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
        with self._pools_lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
        self.scripts.stop_all()
        self.workerd.stop()

    def reset(self) -> None:
        """Forget the account's state and stop every script's workerd."""
        self.api.reset()
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
        route = Route(
            base_url=f"http://{LISTEN_ADDRESS}:{running.port}",
            headers=(("X-Sigil-Secret", self.scripts.secret), ("X-Sigil-Loader-Id", loader_id)),
        )
        pid = running.pid
        if pid is None:
            raise ApiError(500, 10002, "the emulator's workerd for start checks is restarting; try again")
        with self.meter.call(
            pid=pid, stop=running.stop_for_cpu, limit_ms=STARTUP_CPU_MS, silent=running.silent
        ) as ticket:
            try:
                if loader_host_start_check(_START_CHECKS, route):
                    return None
            except RuntimeRejected as exc:
                return str(exc)
            except RuntimeUnavailable as exc:
                if ticket.exceeded:
                    return STARTUP_EXCEEDED
                raise ApiError(500, 10002, f"the emulator's workerd could not start the script: {exc}") from exc
        raise ApiError(500, 10002, f"the emulator's workerd did not find the script it was just given ({loader_id})")

    # --- called by the request handler --------------------------------------------------------

    @contextlib.contextmanager
    def metered_call(self, ticket: Ticket, *, pid: int, replaying_stop: bool = False) -> Iterator[MeteredCall]:
        """The call metered by `ticket` on process `pid`, known to `meter_mark` by its id while
        the block runs. `replaying_stop`: the call is sent again after its Dynamic Worker was
        stopped, and that Worker's entrypoint is to throw at once instead of running again
        (see `_run`); the call's `replaying_stop` tells whether it has yet."""
        call = secrets.token_hex(8)
        marked = MeteredCall(call, ticket, pid, replaying_stop)
        with self._calls_lock:
            self._calls[call] = marked
        try:
            yield marked
        finally:
            with self._calls_changed:
                self._calls.pop(call, None)
                if self._loop_holders.get(pid) == call:
                    del self._loop_holders[pid]
                self._calls_changed.notify_all()

    def meter_mark(self, call: str, phase: str, cpu_ms: int) -> int:
        """A Worker Loader's entrypoint, in the call `call`, starts ("begin") a Dynamic Worker
        limited to `cpu_ms`, which gave the event loop back ("yield": it awaits) or ended
        ("end"). Returns the status the entrypoint is answered: 204, 404 for an unknown call,
        429 when the Worker is to throw Cloudflare's "exceeded CPU" at once (the replay of a
        call whose Dynamic Worker was stopped).

        A begin waits while another call's Dynamic Worker on the same process holds its event
        loop: the meter can then tell which Worker spins when the process must be stopped
        (`cfemulator.cpumeter`), where the order the emulator answered begins in is not the
        order workerd started them in. It costs nothing a single-threaded workerd would not
        make the call wait for anyway, but the round trip of the "yield".
        """
        with self._calls_changed:
            metered = self._calls.get(call)
            if metered is None:
                return 404
            if phase != "begin":
                if self._loop_holders.get(metered.pid) == call:
                    del self._loop_holders[metered.pid]
                    self._calls_changed.notify_all()
                if phase == "yield":
                    metered.ticket.gave_back_loop()
                else:
                    metered.ticket.run_dynamic(None)
                return 204
            if metered.replaying_stop:
                metered.replaying_stop = False
                return 429
            deadline = time.monotonic() + LOOP_HELD_SECONDS
            while (holder := self._loop_holders.get(metered.pid, call)) != call and call in self._calls:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._calls_changed.wait(left)
            if call not in self._calls:
                return 404
            metered.ticket.run_dynamic(cpu_ms if cpu_ms > 0 else None)
            if holder == call:
                self._loop_holders[metered.pid] = call
            else:
                metered.ticket.gave_back_loop()  # it runs beside the holder, which keeps the blame
        return 204

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


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = _BACKLOG
    block_on_close = False

    def __init__(self, address: tuple[str, int], emulator: EmulatorServer) -> None:
        self.emulator = emulator
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _RequestHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Hang up on every client, as a stopped process would: a keep-alive connection
        must not go on being served by a stopped emulator."""
        with self._open_lock:
            open_now, self._open = self._open, set()
        for connection in open_now:
            with contextlib.suppress(OSError):  # already gone
                connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-answer is routine; anything else is an emulator bug.
        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            return
        logger.exception("the Cloudflare emulator failed on a request from %s", client_address)


class _RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "cloudflare"
    # Idle keep-alive connections are closed after this, so threads do not pile up.
    timeout = 120
    # Headers and body go out in separate writes; with Nagle on, the client's delayed ACK
    # would add 40 ms to every keep-alive answer.
    disable_nagle_algorithm = True
    server: _HttpServer

    def do_request(self) -> None:
        emulator = self.server.emulator
        split = urlsplit(self.path)
        host = (self.headers.get("Host") or "").split(":", 1)[0].lower()
        if host.endswith(_WORKER_HOST_SUFFIXES) and self.headers.get(KV_HEADER) is None:
            # A script's call streams both ways, as on Cloudflare: its body is not read here.
            self._serve_worker(host, split)
            return
        try:
            body = self._read_body()
        except (BodyTooLarge, ValueError) as exc:
            self._refuse_body(exc)
            return
        kv_namespace = self.headers.get(KV_HEADER)
        meter = self.headers.get(METER_HEADER)
        if meter is not None:
            try:
                cpu_ms = int(self.headers.get(METER_CPU_HEADER) or 0)
            except ValueError:
                cpu_ms = 0
            self._send(emulator.meter_mark(self.headers.get(CALL_HEADER) or "", meter, cpu_ms), b"", None)
        elif kv_namespace is not None:
            response = emulator.api.kv_binding(
                self.command,
                kv_namespace,
                split.path,
                parse_qs(split.query, keep_blank_values=True),
                {name.lower(): value for name, value in self.headers.items()},
                body,
            )
            self._send(response.status, response.body, response.content_type, response.headers)
        elif split.path.startswith("/__emulator/"):
            self._control(split.path, body)
        else:
            request = ApiRequest(
                method=self.command,
                path=split.path,
                query=parse_qs(split.query, keep_blank_values=True),
                headers={name.lower(): value for name, value in self.headers.items()},
                body=body,
            )
            response = emulator.api.handle(request)
            self._send(response.status, response.body, response.content_type, response.headers)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_request

    def _refuse_body(self, exc: Exception) -> None:
        """A body over the limit (413), or whose Content-Length or chunk size is not a number
        (400): either way the stream cannot be trusted, so the connection ends."""
        self.close_connection = True
        if isinstance(exc, BodyTooLarge):
            self._send(413, b"request body too large", "text/plain")
        else:
            self._send(400, b"malformed request body framing", "text/plain")

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    # --- workers.dev ----------------------------------------------------------------------------

    def _serve_worker(self, host: str, split: Any) -> None:
        emulator = self.server.emulator
        target = emulator.api.resolve_host(host)
        limits = self.headers.get(LIMITS_HEADER)
        if target is None:
            # The body is left unread, so the connection cannot be reused.
            self.close_connection = True
            # The reference does not say what a workers.dev host without a Worker answers;
            # a plain 404 is what a client can rely on. The header tells the emulator's
            # dispatch namespace binding to throw "Worker not found" instead.
            self._log_dispatch(host, limits, 404)  # before answering: whoever got the answer may read the log
            self._send(
                404,
                f"No Worker is served at {host}\n".encode(),
                "text/plain; charset=utf-8",
                [(NOT_FOUND_HEADER, "1")],
            )
            return
        try:
            body = _RequestBody(self)
        except (BodyTooLarge, ValueError) as exc:
            self._refuse_body(exc)
            return
        # Cloudflare hands a WebSocket request to the Worker with its upgrade; it has no body.
        upgrade = body.finished and is_websocket_upgrade(self.command, self.headers.get("Upgrade"))
        headers = HTTPHeaderDict()
        original_host = self.headers.get(ORIGINAL_HOST_HEADER)
        for name, value in self.headers.items():
            lower = name.lower()
            hop_by_hop = lower in _HOP_BY_HOP and not (upgrade and lower in UPGRADE_HEADERS)
            if hop_by_hop or lower in (LIMITS_HEADER, ORIGINAL_HOST_HEADER, CALL_HEADER):
                continue
            if lower == "host" and original_host:
                value = original_host
            # A script run by the loader host must not be reachable with a caller's own secret
            # or loader id; a bound script runs alone and gets every header, as on Cloudflare.
            if lower in _HOST_HEADERS and not target.runs_bound:
                continue
            headers.add(name, value)
        if body.length:  # urllib3 frames an empty one as the method expects
            headers["Content-Length"] = str(body.length)
        path = split.path + (f"?{split.query}" if split.query else "")

        def send(port: int) -> Any:
            if upgrade:
                return emulator.upgrade(self.command, path, headers, port=port)
            return emulator.proxy(self.command, path, headers, body.pieces(), port=port)

        def answered(upstream: Any) -> None:
            self._log_dispatch(host, limits, upstream.status, target)
            if upgrade:
                self._pass_upgrade(upstream, unmark=not target.runs_bound)
            else:
                self._relay(upstream, unmark=not target.runs_bound)

        try:
            self._run(target, headers, body, limits, send, answered)
        except LimitExceeded as exceeded:
            answer = exceeded_answer(host=original_host or host, accept=self.headers.get("Accept"))
            extra = [(EXCEEDED_HEADER, exceeded.reason)] if host.endswith(".dispatch.localhost") else []
            self._log_dispatch(host, limits, answer.status, target)
            self._send(answer.status, answer.body, answer.content_type, answer.headers + extra)
        except BodyTooLarge:
            self._send(413, b"request body too large", "text/plain")
        except ValueError:
            self._send(400, b"malformed request body framing", "text/plain")
        except (urllib3.exceptions.HTTPError, HandshakeFailed) as exc:
            logger.warning("workerd did not answer for %s: %s", target.name, exc)
            self._send(502, b"the emulator's workerd did not answer\n", "text/plain")
        except (RuntimeError, TimeoutError) as exc:
            logger.warning("workerd could not start for %s: %s", target.name, exc)
            self._send(502, f"the emulator could not run {target.name}: {exc}\n".encode(), "text/plain")
        finally:
            if not body.finished:
                # What the script did not read is still on the socket: the next request
                # on it could not be told from it.
                self.close_connection = True

    def _run(
        self,
        target: WorkerTarget,
        headers: HTTPHeaderDict,
        body: _RequestBody,
        limits: str | None,
        send: Callable[[int], Any],
        answered: Callable[[Any], None],
    ) -> None:
        """Run one call in the script's own workerd: `send(port)` sends it there and returns
        the answer, which is metered against the call's CPU limit until `answered` has relayed
        it (a streamed answer, or a WebSocket session, keeps the script running).

        Raises LimitExceeded when it ran past it before answering, RuntimeError when workerd
        cannot start, urllib3's errors or HandshakeFailed when workerd does not answer.
        """
        emulator = self.server.emulator
        limit_ms = call_cpu_ms(target.upload.limits, _parse_limits(limits), default=emulator.api.config.default_cpu_ms)
        if not target.runs_bound:
            headers["X-Sigil-Secret"] = emulator.scripts.secret
            headers["X-Sigil-Loader-Id"] = f"{target.name}@{target.sha}"
        # Its Dynamic Workers' limits are metered on the call (cfemulator.bound, METER_HEADER).
        metered = target.runs_bound and has_worker_loader(target.upload)
        # On Cloudflare a Dynamic Worker past its limit throws into its loader Worker, which
        # answers the call itself, and the other Dynamic Workers never notice; here the whole
        # process had to be stopped. So a call without a body is sent again, to the fresh
        # process: the stopped Worker's entrypoint then throws Cloudflare's error at once (the
        # loader Worker's own code answers), and a call that only shared the process runs again,
        # as often as another call's runaway stops the process under it (up to MAX_REPLAYS).
        replaying_stop = False
        replays = 0
        restarted = False
        stopped_pid: int | None = None
        deadline = 0.0
        while True:
            running = emulator.scripts.acquire(target.key, sha=target.sha, upload=target.upload)
            pid = running.pid
            if stopped_pid is not None and pid in (stopped_pid, None) and time.monotonic() < deadline:
                time.sleep(0.02)  # the supervisor is replacing the stopped process
                continue
            if pid is None:  # stopped between its start and now: it is being started again
                if not restarted:
                    restarted = True
                    continue
                raise RuntimeError(f"workerd for {target.name} keeps stopping")
            sent_at = time.time()
            with (
                emulator.meter.call(
                    pid=pid, stop=running.stop_for_cpu, limit_ms=limit_ms, silent=running.silent
                ) as ticket,
                emulator.metered_call(ticket, pid=pid, replaying_stop=replaying_stop) as call,
            ):
                if metered:
                    headers[CALL_HEADER] = call.id
                try:
                    upstream = send(running.port)
                except (urllib3.exceptions.HTTPError, HandshakeFailed) as exc:
                    replayable = metered and replays < MAX_REPLAYS and not body.chunked and not body.length
                    # A replay to throw at once that was stopped before it threw still has to.
                    replaying_stop = call.replaying_stop or ticket.dynamic_exceeded
                    if ticket.exceeded:
                        if replayable and ticket.stopped_by_dynamic:
                            replays, stopped_pid = replays + 1, pid
                            deadline = time.monotonic() + REPLACED_WITHIN_SECONDS
                            continue
                        raise LimitExceeded("cpu") from None
                    reason = running.stopped_for(sent_at)
                    if reason is not None:
                        # Stopped for another call's Dynamic Worker (it reached the process as
                        # the meter stopped it): on Cloudflare this call's isolate would not
                        # have noticed, so a bodiless one runs again.
                        if replayable:
                            replays, stopped_pid = replays + 1, pid
                            deadline = time.monotonic() + REPLACED_WITHIN_SECONDS
                            continue
                        raise LimitExceeded(reason) from None
                    # Refused: the process was stopped (another call ran past a limit) before
                    # this one reached it. Nothing ran (no body was read), so it goes to the
                    # fresh one.
                    refused = isinstance(exc, urllib3.exceptions.NewConnectionError) or getattr(exc, "refused", False)
                    if not restarted and refused and not body.started:
                        restarted = True
                        continue
                    raise
                answered(upstream)
                return

    def _relay(self, upstream: urllib3.BaseHTTPResponse, *, unmark: bool = False) -> None:
        """Send workerd's answer on as it arrives: each chunk as workerd writes it; `unmark`
        takes off the headers the emulator's loader host added (a plain script's answer).

        Once the status line is out, a failure can no longer be answered: the connection is
        closed before the body's end, which the client sees as a truncated answer (as a
        Worker that fails mid-stream is seen on Cloudflare).
        """
        headers = _unmarked(upstream.headers.items(), unmark=unmark)
        complete = False
        try:
            pieces = (
                upstream.read_chunked(decode_content=False)
                if upstream.chunked
                else upstream.stream(_PIECE, decode_content=False)
            )
            self._send_streamed(upstream.status, headers, pieces)
            complete = True
        except urllib3.exceptions.HTTPError as exc:
            logger.warning("workerd's answer broke off: %s", exc)
        finally:
            if complete:
                upstream.release_conn()
            else:
                self.close_connection = True
                upstream.close()

    def _pass_upgrade(self, handshake: Handshake, *, unmark: bool = False) -> None:
        """Answer a WebSocket upgrade as workerd did: a 101 is passed on with its own head, and
        the connection becomes a byte relay until both sides hang up (`cfemulator.tunnel`);
        any other answer is relayed as an ordinary one. `unmark` as for `_relay`."""
        try:
            if not handshake.upgraded:
                try:
                    self._send_streamed(
                        handshake.status, _unmarked(handshake.headers(), unmark=unmark), handshake.pieces()
                    )
                except HandshakeFailed as exc:
                    logger.warning("workerd's answer broke off: %s", exc)
                    self.close_connection = True
                return
            self.close_connection = True  # the connection is the session's now
            self.send_response(handshake.status)
            for name, value in _unmarked(handshake.headers(), unmark=unmark):
                if name.lower() not in _OWN_HEADERS:
                    self.send_header(name, value)
            self.end_headers()
            relay(self.connection, self.rfile, handshake)
        finally:
            handshake.close()

    def _send_streamed(self, status: int, headers: list[tuple[str, str]], pieces: Iterable[bytes]) -> None:
        """Send an answer whose body is `pieces`, each written as it comes: with the
        Content-Length given in `headers`, else chunked. Raises what `pieces` raises."""
        passed = [(name, value) for name, value in headers if name.lower() not in _NOT_PASSED]
        length = next((value for name, value in headers if name.lower() == "content-length"), None)
        content_type = next((value for name, value in headers if name.lower() == "content-type"), None)
        bodiless = self.command == "HEAD" or status in (204, 304)
        chunked = length is None and not bodiless
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        for name, value in passed:
            self.send_header(name, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif length is not None:
            self.send_header("Content-Length", length)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if bodiless:
            return
        for piece in pieces:
            if not piece:
                continue
            if chunked:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            else:
                self.wfile.write(piece)
            self.wfile.flush()
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _log_dispatch(self, host: str, limits: str | None, status: int, target: WorkerTarget | None = None) -> None:
        """Calls through a dispatch namespace binding are logged with the limits they asked for."""
        if not host.endswith(".dispatch.localhost"):
            return
        parsed = _parse_limits(limits)
        script, _, rest = host.partition(".")
        namespace = target.namespace if target else rest.split(".", 1)[0]
        self.server.emulator.api.record_dispatch(namespace=namespace, script=script, limits=parsed, status=status)

    # --- /__emulator/ ---------------------------------------------------------------------------

    def _control(self, path: str, body: bytes) -> None:
        api = self.server.emulator.api
        if path == "/__emulator/requests" and self.command == "GET":
            self._send_json(200, {"requests": api.request_log()})
        elif path == "/__emulator/dispatches" and self.command == "GET":
            self._send_json(200, {"dispatches": api.dispatch_log()})
        elif path == "/__emulator/reset" and self.command == "POST":
            self.server.emulator.reset()
            self._send_json(200, {"config": api.config.to_json()})
        elif path == "/__emulator/config" and self.command in ("GET", "POST"):
            if self.command == "POST":
                try:
                    changes = json.loads(body or b"{}")
                    if not isinstance(changes, dict):
                        raise ValueError("the body must be a JSON object of settings")
                    api.configure(changes)
                except ValueError as exc:
                    self._send_json(400, {"error": str(exc)})
                    return
            self._send_json(200, {"config": api.config.to_json()})
        else:
            self._send_json(404, {"error": f"no emulator control {self.command} {path}"})

    # --- plumbing -------------------------------------------------------------------------------

    def _read_body(self) -> bytes:
        """The whole body of an API or control call (a script's call streams instead)."""
        pieces = _RequestBody(self).pieces()
        return b"".join(pieces) if pieces is not None else b""

    def _send_json(self, status: int, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(
        self, status: int, body: bytes, content_type: str | None, headers: list[tuple[str, str]] | None = None
    ) -> None:
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        for name, value in headers or []:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class _RequestBody:
    """A call's request body, read from the client only as workerd takes it.

    `length` is the Content-Length when the client sent one, None when it is chunked (it is
    then sent on chunked). Raises BodyTooLarge or ValueError (bad framing) when made, or
    while read for a chunked body.
    """

    def __init__(self, handler: BaseHTTPRequestHandler) -> None:
        self._rfile = handler.rfile
        self.chunked = "chunked" in (handler.headers.get("Transfer-Encoding") or "").lower()
        self.length: int | None = None
        if not self.chunked:
            self.length = int(handler.headers.get("Content-Length") or 0)
            if self.length < 0:
                raise ValueError("negative Content-Length")
            if self.length > MAX_BODY_BYTES:
                raise BodyTooLarge
        self.started = False
        self.finished = not self.chunked and not self.length

    def pieces(self) -> Iterator[bytes] | None:
        """The body for urllib3: None when there is none, else its pieces as they arrive."""
        if self.finished:
            return None
        return self._read_chunked() if self.chunked else self._read_length()

    def _read_length(self) -> Iterator[bytes]:
        self.started = True
        left = self.length or 0
        while left:
            piece = self._rfile.read(min(left, _PIECE))
            if not piece:
                raise ConnectionError("the client hung up before the end of its body")
            left -= len(piece)
            yield piece
        self.finished = True

    def _read_chunked(self) -> Iterator[bytes]:
        self.started = True
        total = 0
        while True:
            size = int(self._rfile.readline(1024).split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                # Trailer fields, if any, end with an empty line.
                while self._rfile.readline(8192) not in (b"\r\n", b"\n", b""):
                    pass
                self.finished = True
                return
            total += size
            if total > MAX_BODY_BYTES:
                raise BodyTooLarge
            while size:
                piece = self._rfile.read(min(size, _PIECE))
                if not piece:
                    raise ConnectionError("the client hung up before the end of its body")
                size -= len(piece)
                yield piece
            self._rfile.readline(8)


def _parse_limits(header: str | None) -> Any:
    """A dispatch binding's limits as it sent them: JSON, else the raw text."""
    try:
        return json.loads(header) if header else None
    except ValueError:
        return header


# How long a call whose Dynamic Worker was stopped waits for its process to be replaced.
REPLACED_WITHIN_SECONDS = 10.0
# How many times one call is sent again after a Dynamic Worker's stop (see `_run`): a call
# stopped that often is answered with error 1102 instead of waiting on.
MAX_REPLAYS = 3
# How long a Dynamic Worker's begin waits for another one to give the event loop back before
# it runs anyway, beside it: a Worker that holds the loop that long spins (and is stopped at
# its limit) or computes, which workerd would have made the waiting one wait for as well.
LOOP_HELD_SECONDS = 5.0
# The process that runs uploads' start checks, beside the scripts' own (their keys hold a colon).
START_CHECK_NAME = "start-check"
# Cloudflare's limit on a script's top-level code at upload (reference §7.3).
STARTUP_CPU_MS = 1000
STARTUP_EXCEEDED = "Script startup exceeded CPU time limit."
_START_CHECKS = urllib3.PoolManager(timeout=urllib3.Timeout(connect=5.0, read=30.0), retries=False)
