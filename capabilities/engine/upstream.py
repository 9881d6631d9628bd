"""The engine's calls to the runtimes: requests over keep-alive HTTP/1.1 (http1), WebSockets
over aiohttp, and what their failures are to the engine (UpstreamUnreachable, UpstreamTimeout).

The client was chosen by measurement (bench/upstream_clients.py: the CPU per warm call of
aiohttp, httpx and Sigil's own http1 against one local server): http1 spends a fraction of
aiohttp's CPU on the engine's plain requests and streams both ways with backpressure as aiohttp
did; aiohttp stays for the WebSocket handshake and frames, which http1 does not speak.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from capabilities.engine.http1 import Connection, ConnectionFailed, Http1Pool, ReadTimedOut

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


class UpstreamUnreachable(Exception):
    """No connection to the runtime, or it broke: the runtime's fault, not the capability's."""


class UpstreamTimeout(Exception):
    """The runtime accepted the call but the capability did not answer in time."""


class UpstreamClient:
    """One per engine (per event loop): the connection pools to every runtime origin."""

    # Methods that get no `Content-Length: 0` when they carry no body.
    METHODS_WITHOUT_BODY = frozenset({"GET", "HEAD", "DELETE", "TRACE", "OPTIONS", "CONNECT"})

    def __init__(self, *, connect_timeout: float, read_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.pool = Http1Pool(connect_timeout=connect_timeout, read_timeout=read_timeout)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """aiohttp's client, for WebSockets only; built on first use, inside the event loop
        that will run it."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True),
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout
                ),
            )
        return self._session

    async def request(
        self, method: str, url: str, *, headers: dict[str, str], body: AsyncIterator[bytes] | bytes | None
    ) -> UpstreamResponse:
        """Send one request (never retried, but for a kept connection found closed) and
        return once the response head is read.

        `url` is already quoted as it must be sent; `body` is None, bytes, or a stream whose
        length `headers` states (or none: it is sent chunked). Raises UpstreamTimeout or
        UpstreamUnreachable."""
        if body is None and "content-length" not in headers and method.upper() not in self.METHODS_WITHOUT_BODY:
            headers["content-length"] = "0"
        try:
            connection = await self.pool.request(method, url, headers, body)
        except ReadTimedOut as exc:
            raise UpstreamTimeout(f"{url}: read timed out") from exc
        except ConnectionFailed as exc:
            raise UpstreamUnreachable(f"{_origin(url)}: {exc}") from exc
        return UpstreamResponse(self, connection)

    async def websocket(self, url: str, *, headers: dict[str, str], protocols: tuple[str, ...]):
        """Open a WebSocket to `url` (an http(s) URL: the upgrade is asked for on it). Returns
        the client's connection, or the UpstreamResponse of a runtime that did not upgrade.
        Raises UpstreamTimeout or UpstreamUnreachable."""
        try:
            return await self.session.ws_connect(
                URL(url, encoded=True),
                headers=headers,
                protocols=protocols,
                autoclose=False,
                autoping=False,
                max_msg_size=0,
                compress=0,
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0),
            )
        except aiohttp.WSServerHandshakeError as exc:
            raise RefusedUpgrade(exc.status, exc.headers) from exc
        except aiohttp.ServerTimeoutError as exc:
            raise UpstreamTimeout(f"{url}: read timed out") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamUnreachable(f"{_origin(url)}: connection failed ({exc.__class__.__name__})") from exc

    async def close(self) -> None:
        self.pool.close()
        if self._session is not None:
            await self._session.close()
            self._session = None


class RefusedUpgrade(Exception):
    """The runtime answered a WebSocket upgrade with an ordinary response."""

    def __init__(self, status: int, headers) -> None:
        super().__init__(status)
        self.status = status
        self.headers = headers or {}


class UpstreamResponse:
    """The runtime's answer; its connection goes back to the pool once the body is read."""

    __slots__ = ("client", "connection", "headers", "pairs", "reason", "status")

    def __init__(self, client: UpstreamClient, connection: Connection) -> None:
        self.client = client
        self.connection = connection
        self.status = connection.status
        self.reason = connection.reason
        self.pairs = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in connection.raw_headers]
        self.headers = CIMultiDict(self.pairs)

    def header_pairs(self) -> list[tuple[str, str]]:
        """The answer's headers as sent, repeated fields kept apart (Set-Cookie)."""
        return self.pairs

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.stream()])

    async def stream(self) -> AsyncIterator[bytes]:
        """The body as it arrives, at most about READ_CHUNK at a time. Raises UpstreamTimeout or
        UpstreamUnreachable when it stalls or breaks."""
        connection, timeout = self.connection, self.client.read_timeout
        try:
            while chunk := await connection.read_chunk(timeout):
                yield chunk
        except ReadTimedOut as exc:
            connection.close()
            raise UpstreamTimeout("the response body: read timed out") from exc
        except ConnectionFailed as exc:
            raise UpstreamUnreachable(f"the response body: {exc}") from exc

    def ended(self) -> bool:
        """Whether the body has been read to its end."""
        return self.connection.complete and not self.connection.chunks

    def arrived(self) -> bool:
        """Whether the whole body has come from the runtime (read or not yet)."""
        return self.connection.complete

    async def drain(self) -> None:
        """Read the rest of the body, so the connection can serve another request."""
        async for _ in self.stream():
            pass

    def release(self) -> None:
        """Keep the connection if the body was read to its end; close it otherwise."""
        self.client.pool.release(self.connection)


def _origin(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"
