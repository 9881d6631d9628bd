"""The emulator's HTTP front: one thread per connection (keep-alive is honoured), routing
each request to the API, a script (`cfemulator.proxy`), a KV binding, a Worker Loader's Dynamic
Workers (their hand-over, their calls, their tail events: `cfemulator.dynamic`) or the
/__emulator/ controls."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import SplitResult, parse_qs

from cfemulator.api_common import ApiRequest
from cfemulator.bodies import BodyTooLarge, RequestBody
from cfemulator.bound import (
    DYNAMIC_CALL_HEADER,
    DYNAMIC_REGISTER_HEADER,
    DYNAMIC_TAIL_HEADER,
    KV_HEADER,
    TAIL_HEADER,
)
from cfemulator.proxy import WorkerProxy

logger = logging.getLogger(__name__)

# Accepted-but-not-yet-served connections; the stdlib default of 5 refuses bursts.
_BACKLOG = 512
_WORKER_HOST_SUFFIXES = (".workers.dev", ".dispatch.localhost")
# The workers.dev door: `/{script}.{subdomain}.workers.dev/{path}` on the emulator's own host
# reaches that Worker at `/{path}`, so a URL of Sigil's Worker is one curl calls as it is
# (without a Host header it could not choose, nor a name it could resolve).
_DOOR = re.compile(r"/([a-z0-9_][a-z0-9_-]*\.[a-z0-9-]+\.workers\.dev)(/.*)?")


class HttpServer(ThreadingHTTPServer):
    """The listening socket and its connections, each served by a RequestHandler thread."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = _BACKLOG
    block_on_close = False

    def __init__(self, address: tuple[str, int], emulator: Any) -> None:
        # `emulator` is the cfemulator.server.EmulatorServer this front serves (which imports
        # this module, so it is not named here).
        self.emulator = emulator
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, RequestHandler)

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


def request_target(target: str) -> SplitResult:
    """A request line's target (origin-form) as its path and query. Not urlsplit: a path that
    starts with `//` is a path here, never an authority."""
    path, _, query = target.partition("?")
    return SplitResult("", "", path, query.partition("#")[0], "")


class RequestHandler(WorkerProxy, BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "cloudflare"
    # Idle keep-alive connections are closed after this, so threads do not pile up.
    timeout = 120
    # Headers and body go out in separate writes; with Nagle on, the client's delayed ACK
    # would add 40 ms to every keep-alive answer.
    disable_nagle_algorithm = True
    server: HttpServer

    def parse_request(self) -> bool:
        """The request line as sent. Python's server folds a path's leading slashes into one
        (gh-87389, against open redirects of its own file server); Cloudflare hands a Worker
        the path as the caller sent it, `//x` and all."""
        if not super().parse_request():
            return False
        words = self.requestline.split()
        if len(words) == 3 and words[1].startswith("//"):
            self.path = words[1]
        return True

    def do_request(self) -> None:
        emulator = self.server.emulator
        split = request_target(self.path)
        host = (self.headers.get("Host") or "").split(":", 1)[0].lower()
        if host.endswith(_WORKER_HOST_SUFFIXES) and self.headers.get(KV_HEADER) is None:
            # A script's call streams both ways, as on Cloudflare: its body is not read here.
            self._serve_worker(host, split)
            return
        if self.headers.get(DYNAMIC_CALL_HEADER) is not None:
            self._serve_dynamic(split)  # streams both ways, as a script's call does
            return
        door = _DOOR.fullmatch(split.path)
        if door is not None:
            self._serve_worker(door.group(1), split._replace(path=door.group(2) or "/"), door=True)
            return
        try:
            body = RequestBody(self).whole()
        except (BodyTooLarge, ValueError) as exc:
            self._refuse_body(exc)
            return
        kv_namespace = self.headers.get(KV_HEADER)
        tailed = self.headers.get(TAIL_HEADER)
        dynamic_tailed = self.headers.get(DYNAMIC_TAIL_HEADER)
        if tailed is not None:
            self._send(emulator.tails.received(tailed, body), b"", None)
        elif dynamic_tailed is not None:
            self._send(emulator.tails.received_dynamic(dynamic_tailed, body), b"", None)
        elif self.headers.get(DYNAMIC_REGISTER_HEADER) is not None:
            self._register_dynamic(self.headers[DYNAMIC_REGISTER_HEADER], body)
        elif kv_namespace is not None:
            response = emulator.api.kv_binding(self._api_request(split, body), kv_namespace)
            self._send(response.status, response.body, response.content_type, response.headers)
        elif split.path.startswith("/__emulator/"):
            self._control(split.path, body)
        else:
            response = emulator.api.handle(self._api_request(split, body))
            self._send(response.status, response.body, response.content_type, response.headers)

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_request

    def _register_dynamic(self, owner: str, body: bytes) -> None:
        """A Worker Loader binding hands over a Dynamic Worker's code: its key, or why not (400)."""
        try:
            key = self.server.emulator.dynamic.register(owner=owner, body=body)
        except ValueError as exc:
            self._send(400, str(exc).encode(), "text/plain; charset=utf-8")
            return
        self._send_json(200, {"key": key})

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

    # --- /__emulator/ ---------------------------------------------------------------------------

    def _control(self, path: str, body: bytes) -> None:
        api = self.server.emulator.api
        if path == "/__emulator/requests" and self.command == "GET":
            self._send_json(200, {"requests": api.request_log()})
        elif path == "/__emulator/dispatches" and self.command == "GET":
            self._send_json(200, {"dispatches": api.dispatch_log()})
        elif path == "/__emulator/processes" and self.command == "GET":
            self._send_json(200, {"processes": self.server.emulator.scripts.describe()})
        elif path == "/__emulator/dynamic-workers" and self.command == "GET":
            self._send_json(200, {"dynamic_workers": self.server.emulator.dynamic.snapshot()})
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

    def _api_request(self, split: SplitResult, body: bytes) -> ApiRequest:
        """The call as the account answers it (an API call, or a KV binding's)."""
        return ApiRequest(
            method=self.command,
            path=split.path,
            query=parse_qs(split.query, keep_blank_values=True),
            headers={name.lower(): value for name, value in self.headers.items()},
            body=body,
        )

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
