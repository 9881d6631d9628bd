"""WebSockets through the engine: the caller's session relayed to the capability's, frame by
frame, under the same token rules, visibility, breaker, shares and stats as any call.

A session counts as one call (status 101, its duration the session's), and ends when either
side closes, or after SIGIL_WEBSOCKET_MAX_SECONDS (closed with 1001, going away). A capability
that answers the upgrade without accepting it is a call that answered that status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
from django.conf import settings

from capabilities.engine.answers import call_headers
from capabilities.engine.calls import Call
from capabilities.engine.recording import Recorder
from capabilities.engine.sending import Sender, runtime_failed_itself
from capabilities.engine.upstream import RefusedUpgrade, UpstreamTimeout, UpstreamUnreachable
from capabilities.engine.values import CallAnswer, CallRequest
from capabilities.runtimes.base import Route, Runtime
from sigil.errors import Timeout, UpstreamError

logger = logging.getLogger("capabilities.engine")

# The handshake's own fields: the engine's client writes its own for the runtime.
HANDSHAKE_HEADERS = ("sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions", "sec-websocket-protocol")
GOING_AWAY = 1001


async def websocket_open(
    sender: Sender, request: CallRequest, call: Call, target: Route, runtime: Runtime
) -> CallAnswer:
    """Ask the capability at `target` (placed on `runtime`) to take a WebSocket; the answer
    carries the session to relay, or the capability's refusal. Raises Timeout, UpstreamError
    or Unavailable as a call would (the runtime's own failure is no refusal of the capability's)."""
    recorder = sender.recorder
    url, headers = sender.upstream_request(request, target)
    for name in HANDSHAKE_HEADERS:
        headers.pop(name, None)
    protocols = tuple(
        part.strip() for part in request.headers.get("sec-websocket-protocol", "").split(",") if part.strip()
    )
    call.sent_at = time.time()
    try:
        upstream = await sender.upstream.websocket(url, headers=headers, protocols=protocols)
    except RefusedUpgrade as refused:
        if runtime.failed_itself(refused):
            raise runtime_failed_itself(call.full, refused.status, refused.headers.get("retry-after")) from None
        call.finished = True
        status = refused.status

        async def recorded(complete: bool) -> None:
            await recorder.finish(call, status=status)

        return CallAnswer(status, "", [("Content-Length", "0")], b"", on_close=recorded)
    except UpstreamTimeout as exc:
        error = Timeout(f"{call.full} did not answer within {sender.upstream.read_timeout:g} s")
        await recorder.finish(call, status=error.status, code=error.code, message=error.message)
        raise error from exc
    except UpstreamUnreachable as exc:
        raise UpstreamError(f"the runtime could not be reached for {call.full}: {exc}") from exc
    call.finished = True
    session = WebSocketSession(recorder, upstream, call, settings.SIGIL_WEBSOCKET_MAX_SECONDS)
    return CallAnswer(101, "Switching Protocols", call_headers(call), b"", on_close=session.close, websocket=session)


class WebSocketSession:
    """The runtime's side of one relayed WebSocket."""

    def __init__(self, recorder: Recorder, upstream: aiohttp.ClientWebSocketResponse, call, max_seconds: float) -> None:
        self.recorder = recorder
        self.upstream = upstream
        self.call = call
        self.max_seconds = max_seconds
        self.ok = True

    @property
    def subprotocol(self) -> str | None:
        return self.upstream.protocol

    async def relay(self, receive, send) -> None:
        """Pass frames both ways (ASGI `receive`/`send` on the caller's side) until one side
        closes or the session's time is up."""
        to_capability = asyncio.create_task(self._from_caller(receive))
        to_caller = asyncio.create_task(self._from_capability(send))
        done, pending = await asyncio.wait(
            {to_capability, to_caller}, timeout=self.max_seconds, return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if not done:  # the session's time is up
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": GOING_AWAY})
        if not self.upstream.closed:
            with contextlib.suppress(Exception):
                await self.upstream.close(code=GOING_AWAY)

    async def _from_caller(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                await self.upstream.close(code=message.get("code", 1000))
                return
            if message.get("text") is not None:
                await self.upstream.send_str(message["text"])
            elif message.get("bytes") is not None:
                await self.upstream.send_bytes(message["bytes"])

    async def _from_capability(self, send) -> None:
        while True:
            message = await self.upstream.receive()
            if message.type == aiohttp.WSMsgType.TEXT:
                await send({"type": "websocket.send", "text": message.data})
            elif message.type == aiohttp.WSMsgType.BINARY:
                await send({"type": "websocket.send", "bytes": message.data})
            elif message.type == aiohttp.WSMsgType.PING:
                await self.upstream.pong(message.data)
            elif message.type == aiohttp.WSMsgType.PONG:
                continue
            else:  # CLOSE, CLOSING, CLOSED or ERROR: the capability's side ended
                if message.type == aiohttp.WSMsgType.ERROR:
                    self.ok = False
                    logger.warning("%s's WebSocket broke: %s", self.call.full, self.upstream.exception())
                code = self.upstream.close_code or 1000
                with contextlib.suppress(Exception):
                    await send({"type": "websocket.close", "code": code if 1000 <= code < 5000 else 1011})
                return

    async def close(self, complete: bool) -> None:
        if not self.upstream.closed:
            with contextlib.suppress(Exception):
                await self.upstream.close(code=GOING_AWAY)
        await self.recorder.finish(self.call, status=101, ok=self.ok)
