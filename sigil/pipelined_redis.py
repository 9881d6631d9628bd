"""One pipelined asyncio connection to Redis, for the commands every warm call sends.

A warm call sends two commands: its MGET before it is forwarded and its record's script
after. redis-py's asyncio client spends about 100 µs of CPU on each (a connection taken from
its pool and given back under a lock, a timeout context, its packer and parser layers), more
than the rest of the call's own work in Sigil; this connection spends about a tenth of that.
Every command of the event loop goes down the one connection in order, and Redis answers in
that order, so each waits on its own future: nothing is held per command but that future and
its timer. Everything else (pipelines, the cold path) stays on redis-py.

Failures are redis-py's exceptions, so the callers' handling of an unreachable Redis stays
one: a connection that cannot be made or breaks fails what is waiting on it with
ConnectionError and the next command connects again; a command Redis has not answered within
the timeout fails with TimeoutError, and closes the connection (later answers would be out of
step); an error reply is ResponseError (NoScriptError for an unknown script, BusyLoadingError,
a ConnectionError, while a restarted Redis reads its data back).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ssl

import hiredis
from redis.connection import parse_url
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ConnectionError,
    InvalidResponse,
    NoScriptError,
    ResponseError,
    TimeoutError,
)


class PipelinedRedis:
    """Commands to the Redis at one URL (redis://, rediss:// or unix://), on one connection per
    event loop. Replies are as redis-py gives them undecoded: bytes, ints, lists, None."""

    def __init__(self, url: str, *, timeout: float) -> None:
        options = parse_url(url)
        self.path: str | None = options.get("path")
        self.host: str = options.get("host", "localhost")
        self.port: int = int(options.get("port", 6379))
        self.tls = url.startswith("rediss://")
        self.timeout = timeout
        self.hello: list[tuple] = []  # what each new connection sends first
        if options.get("password"):
            username = options.get("username")
            self.hello.append(("AUTH", username, options["password"]) if username else ("AUTH", options["password"]))
        if options.get("db"):
            self.hello.append(("SELECT", options["db"]))
        self._connection: _Connection | None = None
        self._connecting: asyncio.Future | None = None
        self._shas: dict[str, str] = {}

    async def execute(self, *args):
        """Send one command and return its reply."""
        connection = self._connection
        if connection is None or connection.closed:
            connection = await self._connect()
        return await connection.send(args, self.timeout)

    async def mget(self, keys) -> list:
        return await self.execute("MGET", *keys)

    async def run_script(self, source: str, keys, args):
        """EVALSHA of `source`, loading it once when this Redis does not know it yet (a
        restarted Redis forgets its scripts)."""
        sha = self._shas.get(source)
        if sha is None:
            sha = self._shas[source] = hashlib.sha1(source.encode()).hexdigest()
        try:
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.execute("SCRIPT", "LOAD", source)
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)

    async def aclose(self) -> None:
        if self._connection is not None:
            self._connection.close(ConnectionError("the client was closed"))
            self._connection = None

    async def _connect(self) -> _Connection:
        # Calls that find no connection share the one being made.
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if self._connecting is connecting and connecting.done():
                self._connecting = None

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            if self.path:
                connect = loop.create_unix_connection(_Connection, self.path)
            else:
                context = ssl.create_default_context() if self.tls else None
                connect = loop.create_connection(_Connection, self.host, self.port, ssl=context)
            _, connection = await asyncio.wait_for(connect, self.timeout)
        except OSError as exc:  # asyncio.TimeoutError is one too
            where = self.path or f"{self.host}:{self.port}"
            raise ConnectionError(f"Error connecting to {where}: {exc.__class__.__name__} {exc}") from exc
        try:
            for command in self.hello:
                await connection.send(command, self.timeout)
        except BaseException:
            connection.close(ConnectionError("the connection was refused its AUTH or SELECT"))
            raise
        self._connection = connection
        return connection


class _Connection(asyncio.Protocol):
    """The socket, its reply parser, and the futures of the commands sent, oldest first."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(protocolError=InvalidResponse, replyError=ResponseError)
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            while (reply := self.reader.gets()) is not False:
                future = self.waiting.popleft()
                if future.done():  # its caller gave up; the reply is dropped in step
                    continue
                if isinstance(reply, ResponseError):
                    future.set_exception(_reply_error(reply))
                else:
                    future.set_result(reply)
        except (InvalidResponse, IndexError) as exc:
            self.close(ConnectionError(f"Redis sent what it was not asked for: {exc}"))

    def connection_lost(self, exc) -> None:
        self.close(ConnectionError(f"Connection closed by server: {exc or 'end of stream'}"))

    def send(self, args: tuple, timeout: float) -> asyncio.Future:
        # The peer may have closed the socket before connection_lost() has run; uvloop then
        # refuses the write (RuntimeError) rather than dropping it.
        if self.closed or self.transport.is_closing():
            raise ConnectionError("Connection closed by server")
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        self.transport.write(hiredis.pack_command(args))
        return self._within(future, timeout)

    async def _within(self, future: asyncio.Future, timeout: float):
        timer = asyncio.get_running_loop().call_later(timeout, self._timed_out, future)
        try:
            return await future
        finally:
            timer.cancel()

    def _timed_out(self, future: asyncio.Future) -> None:
        if not future.done():
            future.set_exception(TimeoutError("Timeout reading from Redis"))
            self.close(ConnectionError("an earlier command timed out"))

    def close(self, error: Exception) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)


def _reply_error(reply: ResponseError) -> ResponseError:
    """The error as redis-py classes it, for the replies this client's callers tell apart."""
    message = str(reply)
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    if message.startswith(("WRONGPASS", "NOAUTH", "ERR invalid password")):
        return AuthenticationError(message)
    if message.startswith("LOADING"):  # restarted, reading its data back: unavailable for now
        return BusyLoadingError(message)
    return reply
