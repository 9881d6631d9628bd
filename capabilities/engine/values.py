"""What goes into the engine and what comes out: a CallRequest in, a CallAnswer out.

Each entry point builds its CallRequest (the HTTP adapter from an ASGI request, MCP from a tool
call, the async runner from an accepted call's record); none reaches the engine any other way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Prefetched:
    """What a caller already read from Redis with its own round trip: the values of the call's
    read (engine.call_keys), so the engine does not read them again."""

    token: bytes | None
    route: bytes | None
    breaker: bytes | None
    auth_failures: bytes | None


@dataclass(slots=True)
class CallRequest:
    """One call of `/{agent}/{capability}{rest}` as the caller sent it."""

    agent: str
    name: str
    rest: str  # the path after the capability's, quoted as sent ("/" for none)
    method: str
    query: str  # the query string as sent, without "?"
    headers: dict[str, str]  # lower-case names; the caller's credentials included
    body: AsyncIterator[bytes] | bytes = b""
    length: int | None = None  # Content-Length, when the caller gave one
    chunked: bool = False  # a body of unknown length follows
    address: str = ""  # the caller's address, for the failed-token brake
    request_id: str = ""
    # An accepted asynchronous call runs as the token that sent it (its hash: Sigil never
    # keeps the secret), and waits out a placement as long as the placement may take.
    accepted_token_hash: str | None = None
    prefetched: Prefetched | None = None
    websocket: bool = False  # the caller asks for a WebSocket (the ASGI adapter relays it)
    via_edge: bool = False  # handed on by Sigil's edge, whose signed mark named `address`

    @property
    def has_body(self) -> bool:
        return bool(self.length) or self.chunked


@dataclass(slots=True)
class CallAnswer:
    """The answer to a call: its head, and its body as bytes or as a stream the adapter sends
    as the caller reads it. `close()` must be awaited once the body was sent (or given up):
    it records the call."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes | AsyncIterator[bytes] = b""
    on_close: Callable[[bool], Awaitable[None]] | None = None
    # Set for a WebSocket the runtime accepted: the adapter relays frames through it.
    websocket: object | None = None
    code: str | None = None  # Sigil's error code, for an answer Sigil wrote as an error
    # For a streamed body: whether the chunk just taken was its last, so the adapter sends
    # it as the end of the answer (one message fewer) without waiting for the stream to end.
    body_ended: Callable[[], bool] | None = None
    # For a streamed body: whether all of it has come from the runtime already, so its sending
    # waits on nothing but the caller (the adapter need not watch for the caller leaving).
    body_arrived: Callable[[], bool] | None = None
    closed: bool = field(default=False, repr=False)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, whether it came whole or as a stream."""
        if isinstance(self.body, bytes):
            if self.body:
                yield self.body
            return
        async for chunk in self.body:
            yield chunk

    async def close(self, *, complete: bool = True) -> None:
        """Record the call; `complete` says whether the caller got the whole body."""
        if self.closed:
            return
        self.closed = True
        if self.on_close is not None:
            await self.on_close(complete)
