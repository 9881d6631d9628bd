"""What answers on the web port while runsigil's web server does not: `503 unavailable` with
`Retry-After`, so that a caller during a start, a restart or a stop of `make run` is told to
come back rather than refused a connection.

runsigil opens it as soon as it has checked that the port is free, before the slow part of
a start (migrations, Redis, the runtimes' processes), keeps it beside granian while granian
starts (both bind the port with SO_REUSEPORT, and granian refuses connections until its
worker runs), closes it once granian answers, and opens it again whenever the web server
has exited (stopped by Ctrl-C, or dead and waiting to be started again).
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sigil.errors import Unavailable, envelope, retry_after_header

logger = logging.getLogger(__name__)

# Sigil's own processes take a second or a few to start: a caller that comes back after
# this is answered by the web server, or told again.
RETRY_AFTER_SECONDS = 1
# A request body the stand-in reads (and drops) before it answers; a longer one is cut by
# the connection's close.
MAX_BODY_READ = 1 << 20
MESSAGE = "Sigil is starting or stopping; try again shortly"
# On every answer of the stand-in: how runsigil tells it from the web server's.
STAND_IN_HEADER = "X-Sigil-Stand-In"


class StandIn:
    """A small HTTP/1.1 server on 127.0.0.1:`port` in a thread, answering every request with
    Unavailable's envelope and closing the connection. `open` and `close` are idempotent; a
    port it cannot bind (still held) leaves it closed, said once in the log."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self._server is not None

    def open(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            try:
                server = _Server(("127.0.0.1", self.port), _Handler)
            except OSError as exc:
                logger.warning("nothing answers on port %s until the web server does: %s", self.port, exc)
                return
            server.daemon_threads = True
            self._server = server
            self._thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="stand-in", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._lock:
            if self._server is None:
                return
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)
            self._server = self._thread = None


class _Server(ThreadingHTTPServer):
    # SO_REUSEPORT, as granian binds its port: both listen at once while granian starts,
    # so that no connection finds the port closed, until the stand-in closes.
    allow_reuse_port = True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    body = json.dumps(envelope(Unavailable.code, MESSAGE)).encode()

    def _answer(self) -> None:
        length = self.headers.get("Content-Length", "")
        if length.isdigit():
            self.rfile.read(min(int(length), MAX_BODY_READ))
        self.send_response(Unavailable.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.send_header("Retry-After", retry_after_header(RETRY_AFTER_SECONDS))
        self.send_header(STAND_IN_HEADER, "1")
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(self.body)
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _answer

    def log_message(self, format: str, *args) -> None:
        """Quiet: the access log is the web server's."""
