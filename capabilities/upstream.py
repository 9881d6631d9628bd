"""Keep-alive HTTP/1.1 connections from a gateway process to the runtimes, on http.client.

The gateway's upstream calls are plain (no redirects, no retries, no decoding), and one
through urllib3's pool cost about 130 µs more CPU than the same call on http.client (URL
parsing twice, pool keys, retry and timeout objects): over a quarter of a warm call's cost
in the server (bench/invoke.py).
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
from collections.abc import Iterator
from urllib.parse import urlsplit

# RFC 9110 §7.6.1 connection-specific fields, never forwarded by a proxy in either direction.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)

READ_CHUNK = 64 * 1024


class UpstreamUnreachable(Exception):
    """No connection to the runtime, or it broke: the runtime's fault, not the capability's."""


class UpstreamTimeout(Exception):
    """The runtime accepted the call but the capability did not answer in time."""


class UpstreamConnections:
    """Idle connections kept per origin and reused last in, first out."""

    # Idle connections kept per origin; a burst beyond it opens (and then closes) extra ones.
    MAX_IDLE = 32
    # Methods that get no `Content-Length: 0` when they carry no body.
    METHODS_WITHOUT_BODY = frozenset({"GET", "HEAD", "DELETE", "TRACE", "OPTIONS", "CONNECT"})

    def __init__(self, *, connect_timeout: float, read_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle: dict[str, list[http.client.HTTPConnection]] = {}

    def request(
        self, method: str, base_url: str, target: str, *, headers: dict[str, str], body, size: int | None
    ) -> UpstreamResponse:
        """Send one request (never retried) and return once the response head is read.

        `target` is the request line's path and query; `body` is None, bytes, or a stream
        of `size` bytes. Raises UpstreamTimeout or UpstreamUnreachable.
        """
        idle = self.idle.setdefault(base_url, [])
        connection = self.reuse(idle) or self.connect(base_url)
        try:
            given = {name.lower() for name in headers}
            connection.putrequest(
                method, target, skip_host="host" in given, skip_accept_encoding="accept-encoding" in given
            )
            for name, value in headers.items():
                connection.putheader(name, value)
            if "content-length" not in given:
                if isinstance(body, bytes):
                    connection.putheader("Content-Length", str(len(body)))
                elif body is None and method.upper() not in self.METHODS_WITHOUT_BODY:
                    connection.putheader("Content-Length", "0")
            connection.endheaders()
            if isinstance(body, bytes):
                connection.send(body)
            elif body is not None:
                while size > 0 and (chunk := body.read(min(size, READ_CHUNK))):
                    connection.send(chunk)
                    size -= len(chunk)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise _upstream_error(exc, target) from exc
        except BaseException:
            connection.close()
            raise
        return UpstreamResponse(response, connection, idle)

    def reuse(self, idle: list[http.client.HTTPConnection]) -> http.client.HTTPConnection | None:
        while idle:
            try:
                connection = idle.pop()
            except IndexError:  # another thread took the last one
                return None
            # Readable while idle means the peer closed it: drop it rather than send a
            # request that would fail, since requests are never retried.
            if connection.sock is not None and not _readable(connection.sock):
                return connection
            connection.close()
        return None

    def connect(self, base_url: str) -> http.client.HTTPConnection:
        origin = urlsplit(base_url)
        factory = http.client.HTTPSConnection if origin.scheme == "https" else http.client.HTTPConnection
        connection = factory(origin.hostname, origin.port, timeout=self.connect_timeout)
        try:
            connection.connect()
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamUnreachable(f"cannot connect to {base_url}: {exc.__class__.__name__}") from exc
        connection.sock.settimeout(self.read_timeout)
        return connection


class UpstreamResponse:
    """The runtime's answer; its connection goes back to the pool once the body is read."""

    def __init__(self, response: http.client.HTTPResponse, connection: http.client.HTTPConnection, idle: list):
        self.status = response.status
        self.reason = response.reason
        self.headers = response.headers
        self.response = response
        self.connection = connection
        self.idle = idle

    @property
    def data(self) -> bytes:
        return b"".join(self.stream(READ_CHUNK))

    def stream(self, amount: int) -> Iterator[bytes]:
        """The body as it arrives: a chunked one chunk by chunk (a capability may stream).

        Raises UpstreamTimeout or UpstreamUnreachable when it stalls or breaks."""
        read = self.response.read1 if self.response.chunked else self.response.read
        try:
            while chunk := read(amount):
                yield chunk
            if self.response.length:
                raise http.client.IncompleteRead(b"", self.response.length)
        except (OSError, http.client.HTTPException) as exc:
            raise _upstream_error(exc, "the response body") from exc

    def drain_conn(self) -> None:
        """Read the rest of the body, so the connection can serve another request."""
        for _ in self.stream(READ_CHUNK):
            pass

    def release_conn(self) -> None:
        """Keep the connection if the body was read to its end; close it otherwise."""
        connection, self.connection = self.connection, None
        if connection is None:
            return
        if self.response.isclosed() and not self.response.will_close and len(self.idle) < UpstreamConnections.MAX_IDLE:
            self.idle.append(connection)
        else:
            connection.close()


def _upstream_error(exc: OSError | http.client.HTTPException, what: str) -> Exception:
    if isinstance(exc, socket.timeout):
        return UpstreamTimeout(f"{what}: read timed out")
    return UpstreamUnreachable(f"{what}: connection failed ({exc.__class__.__name__})")


def _readable(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
