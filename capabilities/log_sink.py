"""Where the local runtime's workerd processes hand over the calls' records: a small HTTP
server on 127.0.0.1, run beside them by the supervisor (runworkerd), never by the web
process, so a burst of logging costs the web server nothing.

The loader host's tail posts `{"records": [...], "dropped": n}` with the shared internal
secret (which capability code never sees); each batch is kept as a batch pushed from
Cloudflare is (capabilities.services.call_records.call_records_batch_keep). Batches are small
(the calls that ended within 50 ms of each other), and bounded here (LogLimits.batch_bytes).
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import redis

from capabilities.books.call_logs import call_records_undelivered
from capabilities.log_limits import LogLimits
from capabilities.runtimes.local import LocalRuntime, local_limits, local_processes
from capabilities.services.call_records import call_records_batch_keep
from capabilities.workerd.group import WorkerdGroup

logger = logging.getLogger(__name__)

SECRET_HEADER = "X-Sigil-Secret"


class LogSink:
    """An HTTP server taking the tail's batches on 127.0.0.1:`port` (0: any free port, bound
    at once so that the workerd configs can name it before it serves)."""

    def __init__(self, *, secret: str, limits: LogLimits, port: int = 0) -> None:
        self.secret = secret
        self.limits = limits
        self.max_body = limits.batch_bytes
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _handler_for(self))
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> None:
        """Serve in a daemon thread. Idempotent."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.server.serve_forever, name="log-sink", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop serving and release the port. Idempotent."""
        if self._thread is not None:
            self.server.shutdown()
            self._thread.join(5)
            self._thread = None
        self.server.server_close()


def _handler_for(sink: LogSink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            given = self.headers.get(SECRET_HEADER, "")
            if not hmac.compare_digest(given.encode(), sink.secret.encode()):
                self._answer(403)
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if length < 0 or length > sink.max_body:
                call_records_undelivered()
                self._answer(413)
                self.close_connection = True
                return
            try:
                body = json.loads(self.rfile.read(length))
                if not isinstance(body["records"], list):
                    raise ValueError("records is not a list")
            except (ValueError, KeyError, TypeError) as exc:
                call_records_undelivered()
                logger.warning("the log sink could not read a batch: %s", exc)
                self._answer(400)
                return
            try:
                call_records_batch_keep(batch=body, backend=LocalRuntime.name, limits=sink.limits)
            except redis.RedisError as exc:
                logger.warning("the log sink could not keep a batch: %s", exc)
                self._answer(503)
                return
            self._answer(204)

        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args) -> None:
            pass  # one line per batch would drown the supervisor's log

    return Handler


def local_workerd_group(*, own_session: bool = True) -> WorkerdGroup:
    """The local runtime's supervised workerd processes, as Sigil's settings describe them,
    with this sink beside them when call records are on (what runworkerd runs).
    `own_session=False` keeps them in the caller's process group."""
    from django.conf import settings

    return local_processes().group(
        code_dir=settings.SIGIL_CODE_DIR,
        binary=settings.SIGIL_WORKERD_BIN,
        secret=settings.SIGIL_INTERNAL_SECRET,
        limits=local_limits(cpu_ms=settings.SIGIL_CPU_MS, memory_mb=settings.SIGIL_WORKERD_MEMORY_MB),
        own_session=own_session,
        log_sink=LogSink(secret=settings.SIGIL_INTERNAL_SECRET, limits=LogLimits.from_settings())
        if settings.SIGIL_LOGS_ENABLED
        else None,
    )
