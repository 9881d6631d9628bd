"""HTTP/1.1 from the engine to the runtimes: keep-alive connections on asyncio's protocol layer.

The engine's upstream requests are plain (no redirects, cookies, decoding, proxies or headers
of the client's own), so a general client's work per request is mostly spent on what they do
not need; this one writes the request in one write, parses the answer with httptools (the
llhttp parser), and keeps nothing per request beyond the answer's chunks not yet read.

Both directions stream with backpressure: a request body is written by its own task as it is
read from the caller, waiting whenever the socket's buffer is full, while the answer is read
(a capability may answer as it reads); an answer is read only as fast as it is consumed: past
READ_CHUNK unread bytes the socket stops being read until the consumer takes them.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator

import httptools

# The most bytes read from the runtime ahead of the consumer: what a call holds of its answer.
READ_CHUNK = 64 * 1024
# Idle connections kept per origin; a burst beyond it opens (and then closes) extra ones.
MAX_IDLE = 64
# An idle connection older than this is closed rather than reused: the runtime may have
# dropped it meanwhile, and a request written into a dropped connection is lost.
IDLE_SECONDS = 30.0
# RFC 9110 §9.2.2: the methods a request may be sent twice with.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


class ConnectionFailed(Exception):
    """No connection to the origin, or it broke before the answer was whole."""


class ReadTimedOut(Exception):
    """Nothing arrived from the origin for as long as a read may wait."""


class Http1Pool:
    """Keep-alive connections to any number of origins, for one event loop."""

    def __init__(self, *, connect_timeout: float, read_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def request(
        self, method: str, url: str, headers: dict[str, str], body: AsyncIterator[bytes] | bytes | None
    ) -> Connection:
        """Send one request; return its connection once the answer's head is read. An
        idempotent request that finds a kept connection closed under it is sent once more on a
        new one, when its body can be sent again and no byte of an answer came: the origin
        most likely dropped the idle connection as the request went out, and if it did take
        it, taking it twice is what idempotent means."""
        scheme, _, rest = url.partition("://")
        netloc, _, path = rest.partition("/")
        host, port = _host_port(netloc, scheme)
        origin = (scheme, host, port)
        streamed = body is not None and not isinstance(body, bytes)
        chunked = streamed and "content-length" not in headers
        head = _request_head(method, "/" + path, netloc, headers, body, chunked=chunked)
        connection = await self._connection(origin)
        try:
            await connection.exchange(method, head, body, self.read_timeout, chunked=chunked)
        except ConnectionFailed:
            if not connection.reused or connection.answer_started or streamed or method not in IDEMPOTENT:
                raise
            connection = await self._connection(origin)
            await connection.exchange(method, head, body, self.read_timeout, chunked=chunked)
        return connection

    def release(self, connection: Connection) -> None:
        """Keep the connection for the next request to its origin if its exchange is over
        cleanly; close it otherwise."""
        if not connection.reusable():
            connection.close()
            return
        idle = self.idle.setdefault(connection.origin, [])
        if len(idle) >= MAX_IDLE:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    def close(self) -> None:
        for idle in self.idle.values():
            for connection in idle:
                connection.close()
        self.idle.clear()

    async def _connection(self, origin: tuple[str, str, int]) -> Connection:
        idle = self.idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < IDLE_SECONDS:
                connection.reused = True
                return connection
            connection.close()
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if scheme == "https" else None
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(
                    lambda: Connection(origin), host, port, ssl=tls, server_hostname=host if tls else None
                ),
                self.connect_timeout,
            )
        except (OSError, ssl.SSLError) as exc:  # a timeout is an OSError too
            raise ConnectionFailed(f"connection failed ({exc.__class__.__name__})") from exc
        return connection

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls


class Connection(asyncio.Protocol):
    """One connection and the exchange on it: the answer's head once read, its body chunks
    not yet consumed, and the task writing a streamed request body."""

    def __init__(self, origin: tuple[str, str, int]) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.answer_started: bool = False  # any byte of an answer arrived
        self.status = 0
        self.reason = ""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.head_read = False
        self.keep_alive = False  # as the answer's head says (the parser forgets once it is whole)
        self.complete = False
        self.no_body = False  # HEAD: a length but no body
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.reading_paused = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.writable: asyncio.Future | None = None
        self.writer: asyncio.Task | None = None

    # The exchange, as the pool and UpstreamResponse drive it.

    async def exchange(self, method: str, head: bytes, body, read_timeout: float, *, chunked: bool) -> None:
        if self.reused:
            self._reset()
        self.no_body = method == "HEAD"
        # The peer may have closed a kept connection before connection_lost() has run; uvloop
        # then refuses the write (RuntimeError) rather than dropping it.
        if self.transport.is_closing():
            self.closed = True
            raise ConnectionFailed("connection closed (before the request was sent)")
        if body is None or isinstance(body, bytes):
            self.transport.write(head + body if body else head)
        else:
            self.transport.write(head)
            self.writer = asyncio.ensure_future(self._write_body(body, chunked=chunked))
        try:
            await self._until(lambda: self.head_read, read_timeout)
        except BaseException:
            self.close()
            raise

    async def read_chunk(self, read_timeout: float) -> bytes:
        """The next bytes of the answer's body, b"" at its end."""
        while not self.chunks:
            if self.complete:
                return b""
            await self._until(lambda: self.chunks or self.complete, read_timeout)
        chunk = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self._take_all())
        self.buffered -= len(chunk)
        if self.reading_paused and self.buffered < READ_CHUNK and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()
        return chunk

    def reusable(self) -> bool:
        return (
            self.complete
            and not self.closed
            and self.error is None
            and (self.writer is None or self.writer.done())
            and self.keep_alive
        )

    def close(self) -> None:
        if self.writer is not None and not self.writer.done():
            self.writer.cancel()
        if not self.closed:
            self.closed = True
            self.transport.close()

    def _framed(self) -> bool:
        return any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in self.raw_headers)

    def _take_all(self):
        while self.chunks:
            yield self.chunks.popleft()

    async def _until(self, ready, timeout: float) -> None:
        """Wait until `ready()`, failing with what broke the exchange, or ReadTimedOut when
        nothing arrives for `timeout` seconds."""
        loop = asyncio.get_running_loop()
        while not ready():
            if self.error is not None:
                raise self.error
            self.waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, _expire, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self.waiter = None

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.close()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)
        self._stop_writing()

    def _stop_writing(self) -> None:
        # The body's writer, if it waits for room, stops: the exchange's error is the reader's.
        if self.writable is not None and not self.writable.done():
            self.writable.cancel()

    async def _write_body(self, body: AsyncIterator[bytes], *, chunked: bool) -> None:
        """Write the request body as it is read; what it raises (the caller went away, or sent
        too much) ends the exchange with that error."""
        try:
            async for chunk in body:
                if not chunk:
                    continue
                if self.closed or self.transport.is_closing():
                    return
                self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                if self.writable is not None:
                    await self.writable
            if chunked and not (self.closed or self.transport.is_closing()):
                self.transport.write(b"0\r\n\r\n")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    # asyncio's protocol callbacks.

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.answer_started = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # a 101 to a plain request: the head is read; nothing after it is HTTP
        except httptools.HttpParserError as exc:
            self._fail(ConnectionFailed(f"the answer is not HTTP/1.1 ({exc})"))

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.head_read and not self.complete and not self._framed():
            self.complete = True  # a body without a length or chunks ends with the connection
            self._wake()
        if not self.complete:
            self._fail(ConnectionFailed(f"connection closed ({exc.__class__.__name__ if exc else 'end of stream'})"))
        else:
            self._stop_writing()

    def pause_writing(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    # httptools' parser callbacks.

    def on_status(self, reason: bytes) -> None:
        self.reason += reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.reason, self.raw_headers = "", []  # an interim answer (100 Continue): the real one follows
            return
        self.status = status
        self.head_read = True
        self.keep_alive = self.parser.should_keep_alive()
        if self.no_body:
            self.complete = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.no_body:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > READ_CHUNK and not self.reading_paused and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.head_read:
            self.complete = True
            self._wake()


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimedOut())


def _host_port(netloc: str, scheme: str) -> tuple[str, int]:
    default = 443 if scheme == "https" else 80
    if netloc.startswith("["):  # [IPv6]:port
        host, _, port = netloc[1:].partition("]")
        return host, int(port[1:]) if port.startswith(":") else default
    host, _, port = netloc.partition(":")
    return host, int(port) if port else default


def _request_head(method: str, target: str, netloc: str, headers: dict[str, str], body, *, chunked: bool) -> bytes:
    """The request line and header block; a streamed body of no stated length goes chunked."""
    lines = [f"{method} {target} HTTP/1.1"]
    if "host" not in headers:
        lines.append(f"host: {netloc}")
    lines.extend(f"{name}: {value}" for name, value in headers.items())
    if chunked:
        lines.append("transfer-encoding: chunked")
    elif isinstance(body, bytes) and "content-length" not in headers:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
