"""Keep-alive HTTP/1.1 connections from the engine to the runtimes, on aiohttp's client.

The engine's upstream calls are plain: no redirects, no retries, no cookies, no decoding, no
headers of the client's own. aiohttp was chosen by measurement (bench/upstream_clients.py:
the CPU per warm call of aiohttp, httpx and a bare asyncio client against one workerd); it
streams a request body as it arrives and reads an answer only as fast as it is consumed (its
buffer pauses the socket past 64 KiB), and it speaks WebSocket to the same upstreams.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from multidict import CIMultiDictProxy
from yarl import URL

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

# The most bytes read from the runtime ahead of the caller: what the engine holds per call.
READ_CHUNK = 64 * 1024
# Idle connections kept per origin; a burst beyond it opens (and then closes) extra ones.
MAX_IDLE = 64


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
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        # Built on first use, inside the event loop that will run it.
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=60, enable_cleanup_closed=True, ttl_dns_cache=300
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout
                ),
                read_bufsize=READ_CHUNK,
                max_line_size=16 * 1024,
                max_field_size=16 * 1024,
            )
        return self._session

    async def request(
        self, method: str, url: str, *, headers: dict[str, str], body: AsyncIterator[bytes] | bytes | None
    ) -> UpstreamResponse:
        """Send one request (never retried) and return once the response head is read.

        `url` is already quoted as it must be sent; `body` is None, bytes, or a stream whose
        length `headers` states (or none: it is sent chunked). Raises UpstreamTimeout or
        UpstreamUnreachable."""
        if body is None and "content-length" not in headers and method.upper() not in self.METHODS_WITHOUT_BODY:
            headers["content-length"] = "0"
        try:
            response = await self.session.request(
                method,
                URL(url, encoded=True),
                headers=headers,
                data=body,
                allow_redirects=False,
                compress=None,
                chunked=None,
            )
        except aiohttp.ServerTimeoutError as exc:
            raise UpstreamTimeout(f"{url}: read timed out") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamUnreachable(f"{_origin(url)}: connection failed ({exc.__class__.__name__})") from exc
        return UpstreamResponse(response)

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

    __slots__ = ("headers", "reason", "response", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.status = response.status
        self.reason = response.reason or ""
        self.headers: CIMultiDictProxy[str] = response.headers

    def header_pairs(self) -> list[tuple[str, str]]:
        """The answer's headers as sent, repeated fields kept apart (Set-Cookie)."""
        return [(name.decode("latin-1"), value.decode("latin-1")) for name, value in self.response.raw_headers]

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.stream()])

    async def stream(self) -> AsyncIterator[bytes]:
        """The body as it arrives, at most READ_CHUNK at a time. Raises UpstreamTimeout or
        UpstreamUnreachable when it stalls or breaks."""
        content = self.response.content
        try:
            while chunk := await content.readany():
                yield chunk
        except aiohttp.ServerTimeoutError as exc:
            raise UpstreamTimeout("the response body: read timed out") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamUnreachable(f"the response body: connection failed ({exc.__class__.__name__})") from exc

    async def drain(self) -> None:
        """Read the rest of the body, so the connection can serve another request."""
        async for _ in self.stream():
            pass

    def release(self) -> None:
        """Keep the connection if the body was read to its end; close it otherwise."""
        if self.response.content.at_eof():
            self.response.release()
        else:
            self.response.close()


def _origin(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"
