"""Django's development server (`make dev`'s, and the test suite's) reading chunked bodies.

Django's server reads a request body by its Content-Length only: a chunked body was read as
empty, and its bytes were then taken for the next request on the connection. Production
servers (granian, gunicorn) decode chunked bodies themselves. This server decodes one into
memory, up to the largest body Sigil accepts and one byte more (so that Sigil's own limits
answer `413` in the contract's envelope), and hands it on with its Content-Length.
"""

from __future__ import annotations

import io

from django.conf import settings
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIServer

MAX_CHUNK_LINE = 1024


class MalformedChunks(ValueError):
    pass


def read_chunked(stream, limit: int) -> tuple[bytes, bool]:
    """Decode a chunked body from `stream`, keeping at most `limit` bytes.

    Returns the body and whether it was read to its end (the stream is left mid-body
    otherwise). Raises MalformedChunks.
    """
    parts, size = [], 0
    while True:
        line = stream.readline(MAX_CHUNK_LINE)
        try:
            chunk = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise MalformedChunks(f"bad chunk size line {line[:40]!r}") from None
        if chunk < 0:
            raise MalformedChunks("negative chunk size")
        if chunk == 0:
            while stream.readline(MAX_CHUNK_LINE) not in (b"\r\n", b"\n", b""):
                pass  # trailer fields are dropped
            return b"".join(parts), True
        if size + chunk > limit:
            parts.append(stream.read(limit - size))
            return b"".join(parts), False
        data = stream.read(chunk)
        if len(data) < chunk:
            raise MalformedChunks("the body ended inside a chunk")
        parts.append(data)
        size += chunk
        if stream.readline(MAX_CHUNK_LINE) not in (b"\r\n", b"\n"):
            raise MalformedChunks("a chunk does not end with CRLF")


class ChunkedBodies:
    """Request handler mixin: a chunked body is decoded before the application sees it."""

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
            return True
        limit = max(settings.SIGIL_DEPLOY_MAX_BODY_BYTES, settings.SIGIL_INVOKE_MAX_BODY_BYTES) + 1
        try:
            body, complete = read_chunked(self.rfile, limit)
        except MalformedChunks as exc:
            self.close_connection = True
            self.send_error(400, f"malformed chunked body: {exc}")
            return False
        if not complete:
            self.close_connection = True  # the rest of the body is still on the connection
        self.socket_rfile = self.rfile
        self.rfile = io.BytesIO(body)
        del self.headers["Transfer-Encoding"]
        del self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(body))
        return True

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        finally:
            rfile = getattr(self, "socket_rfile", None)
            if rfile is not None:
                self.rfile, self.socket_rfile = rfile, None


class ChunkedServer:
    """Server mixin: ChunkedBodies added to whatever request handler the server is given."""

    def __init__(self, server_address, handler_class, *args, **kwargs) -> None:
        handler = type(handler_class.__name__, (ChunkedBodies, handler_class), {})
        super().__init__(server_address, handler, *args, **kwargs)


class ChunkedWSGIServer(ChunkedServer, WSGIServer):
    """`runserver`'s server (it adds threads itself)."""


class ChunkedThreadedWSGIServer(ChunkedServer, ThreadedWSGIServer):
    """The test suite's live server (django.test.testcases.LiveServerThread)."""
