"""The engine's HTTP and WebSocket edge: an ASGI request to a CallRequest, its CallAnswer back.

Bodies stream both ways: the caller's upload reaches the capability as it arrives, and the
capability's answer reaches the caller as it is written and only as fast as the caller reads
it (the server's `send` waits while its buffer is full, and the upstream client stops reading
meanwhile): the engine holds at most one read chunk (64 KiB) of an answer per call. A caller
that goes away ends its call: its upstream request is cut and the call recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from urllib.parse import quote, unquote, unquote_to_bytes

from agents.throttle import client_address
from capabilities.engine.engine import Engine
from capabilities.engine.values import CallRequest
from sigil.edge_handoff import handoff_client
from sigil.errors import InvalidRequest

# What PATH_INFO-style re-quoting keeps as it is, so the capability sees the path the caller sent.
PATH_SAFE = "/:@!$&'()*+,;=-._~"


class CallerGone(InvalidRequest):
    """The caller closed its connection before its request body was sent."""


def call_request(scope, body, *, request_id: str, proxies: int, edge_key: str = "") -> CallRequest:
    """The CallRequest of an ASGI HTTP or WebSocket scope; `body` is its body stream. A call the
    edge handed on with its signed mark (sigil/edge_handoff.py, verified with `edge_key`) is the
    caller's whose address the mark names."""
    raw_path = scope.get("raw_path") or scope["path"].encode()
    path = raw_path.decode("latin-1")
    agent, _, tail = path.lstrip("/").partition("/")
    name, slash, rest = tail.partition("/")
    headers: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        header, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
        if header in headers:  # repeated fields joined, as a WSGI environ has them
            value = headers[header] + ("; " if header == "cookie" else ", ") + value
        headers[header] = value
    length = headers.get("content-length")
    try:
        size = int(length) if length else None
    except ValueError:
        size = -1  # refused by the engine's checks below
    client = scope.get("client")
    address = client_address(
        {"REMOTE_ADDR": client[0] if client else "", "HTTP_X_FORWARDED_FOR": headers.get("x-forwarded-for", "")},
        proxies=proxies,
    )
    via_edge = None
    if edge_key and "x-sigil-edge" in headers:
        method = scope.get("method", "GET")
        via_edge = handoff_client(headers, method=method, path=path, key=edge_key, now=time.time())
    return CallRequest(
        agent=unquote(agent),
        name=unquote(name),
        rest="/" + quote(unquote_to_bytes(rest), safe=PATH_SAFE) if slash else "/",
        method=scope.get("method", "GET"),
        query=scope.get("query_string", b"").decode("latin-1"),
        headers=headers,
        body=body,
        length=size,
        chunked="chunked" in headers.get("transfer-encoding", "").lower(),
        address=via_edge or address,
        request_id=request_id,
        websocket=scope["type"] == "websocket",
        via_edge=via_edge is not None,
    )


class RequestBody:
    """The caller's body as the engine reads it, chunk by chunk from ASGI `receive`."""

    def __init__(self, receive) -> None:
        self.receive = receive
        self.done = False

    async def __aiter__(self):
        while not self.done:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.done = True
                raise CallerGone("the caller closed the connection before its request body was sent")
            if not message.get("more_body", False):
                self.done = True
            chunk = message.get("body", b"")
            if chunk:
                yield chunk


async def serve_http(
    engine: Engine, scope, receive, send, *, request_id: str, proxies: int, edge_key: str = ""
) -> None:
    body = RequestBody(receive)
    request = call_request(scope, body.__aiter__(), request_id=request_id, proxies=proxies, edge_key=edge_key)
    if not request.has_body:
        body.done = True
    answer = await engine.call(request)
    stream = answer.body
    complete = False
    watcher = None
    try:
        await send(
            {
                "type": "http.response.start",
                "status": answer.status,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers],
            }
        )
        if isinstance(stream, bytes):
            await send({"type": "http.response.body", "body": stream})
        else:
            arrived = answer.body_arrived is not None and answer.body_arrived()
            if body.done and not arrived:  # nothing more to read from the caller: what comes now is its leaving
                watcher = asyncio.create_task(_cancel_when_gone(receive, asyncio.current_task()))
            ended = False
            async for chunk in stream:
                ended = answer.body_ended is not None and answer.body_ended()
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
            if not ended:
                await send({"type": "http.response.body", "body": b""})
        complete = True
    except asyncio.CancelledError:
        if watcher is None or not watcher.done():
            raise  # not the caller leaving: the server is stopping
    except OSError:
        pass  # the connection broke under the server's send
    finally:
        if watcher is not None:
            watcher.cancel()
        if not isinstance(stream, bytes):
            with contextlib.suppress(Exception):
                await stream.aclose()
        await answer.close(complete=complete)


async def _cancel_when_gone(receive, task: asyncio.Task) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            task.cancel()
            return


async def serve_websocket(
    engine: Engine, scope, receive, send, *, request_id: str, proxies: int, edge_key: str = ""
) -> None:
    connect = await receive()
    if connect["type"] != "websocket.connect":
        return
    request = call_request(scope, b"", request_id=request_id, proxies=proxies, edge_key=edge_key)
    request.length = None
    answer = await engine.call(request)
    try:
        session = answer.websocket
        if session is not None:
            headers = [
                (k.encode("latin-1"), v.encode("latin-1"))
                for k, v in answer.headers
                if k.lower() != "sec-websocket-protocol"
            ]
            await send({"type": "websocket.accept", "subprotocol": session.subprotocol, "headers": headers})
            await session.relay(receive, send)
        elif "websocket.http.response" in scope.get("extensions", {}):
            # Refused in the contract's envelope, as an HTTP answer to the upgrade.
            await send(
                {
                    "type": "websocket.http.response.start",
                    "status": answer.status,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers],
                }
            )
            body = answer.body if isinstance(answer.body, bytes) else b""
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1008})
    finally:
        await answer.close()
