"""Sigil's application with `/_mcp` served by the official MCP Python SDK's server instead of
Sigil's own protocol code: what bench/mcp_sdk.py measures against the application as shipped.

Only the protocol layer differs. The SDK's `StreamableHTTPSessionManager` (stateless, JSON
answers: Sigil never streams) parses the JSON-RPC envelope, checks the 2026-07-28 `_meta`
and headers, dispatches and writes the answer; its `tools/list` and `tools/call` handlers are
Sigil's own `tools_list` and `Toolbox.call`, as the shipped endpoint calls them. The SDK has no
hook for Sigil's agent tokens (its auth is an OAuth resource server), so the request is
authenticated before the SDK sees it by the shipped endpoint's own `authenticate` (one Redis
round trip for the token, the failed-token count and the tool's route, contract and breaker),
which needs the body read first; the SDK then reads it again from a replay.

Served by granian from the checkout's root: `--factory bench.mcp_sdk_server:application` (bench/ itself
must not be on sys.path, where bench/mcp.py would shadow the SDK's `mcp` package).
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from mcp.types.version import MODERN_PROTOCOL_VERSIONS

from sigil_site.asgi import SigilApplication, django_application

# Where the authenticated request waits for the SDK's handlers, in the ASGI scope.
EXCHANGE = "sigil.mcp_exchange"

# Sigil's own modules once Django is set up (by sigil_site.asgi, above).
from agents.selectors import parse_bearer  # noqa: E402
from capabilities.mcp.endpoint import (  # noqa: E402
    INSTRUCTIONS,
    INVALID_PARAMS,
    McpEndpoint,
    read_body,
    refusal,
    request_meta,
)
from capabilities.mcp.tools import InvalidParams, tools_list  # noqa: E402
from sigil.errors import SigilError  # noqa: E402


class SdkMcpEndpoint:
    """`/_mcp` on the SDK's server, behind Sigil's authentication. `engine` returns the
    process's engine."""

    def __init__(self, engine, *, sdk_defaults: bool = False) -> None:
        self.engine = engine
        self.shipped = McpEndpoint(engine)  # for its authenticate() and toolbox only
        self.server = Server(
            "sigil",
            version="1.0",
            title="Sigil",
            instructions=INSTRUCTIONS,
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
            # Sigil's tools declare no Mcp-Param headers: without this the SDK runs tools/list
            # (every page, through the database) before each tools/call with arguments to find out.
            get_tool_input_schema=None if sdk_defaults else lambda name: None,
        )
        if not sdk_defaults:
            self.server.middleware = []  # no OpenTelemetry span per message: Sigil has none either
        self.manager = StreamableHTTPSessionManager(
            self.server,
            json_response=True,
            stateless=True,
            max_request_body_size=settings.SIGIL_DEPLOY_MAX_BODY_BYTES,
        )

    async def __call__(self, scope, receive, send) -> None:
        meta = request_meta(scope)
        try:
            body = await read_body(receive, meta) if meta["REQUEST_METHOD"] == "POST" else b""
            try:
                message: Any = json.loads(body) if body else None
            except ValueError:
                message = None  # the SDK answers the parse error
            secret = parse_bearer(meta.get("HTTP_AUTHORIZATION"))
            exchange = await self.shipped.authenticate(meta, secret, message)
        except SigilError as error:
            status, headers, answer = refusal(error)
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [
                        (k.lower().encode("latin-1"), v.encode("latin-1"))
                        for k, v in [*headers, ("Content-Type", "application/json")]
                    ],
                }
            )
            await send({"type": "http.response.body", "body": answer})
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.manager.handle_request({**scope, EXCHANGE: exchange}, replay, send)

    async def list_tools(self, ctx, params) -> dict:
        exchange = ctx.request.scope[EXCHANGE]
        legacy = ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS
        cursor = params.cursor if params is not None else None
        try:
            tools, next_cursor = await self.engine().offload(
                tools_list, principal=exchange.principal, cursor=cursor, legacy=legacy
            )
        except InvalidParams as exc:
            raise MCPError(INVALID_PARAMS, str(exc)) from None
        result: dict[str, Any] = {"tools": tools}
        if next_cursor is not None:
            result["nextCursor"] = next_cursor
        if not legacy:
            result.update(ttlMs=0, cacheScope="private", resultType="complete")
        return result

    async def call_tool(self, ctx, params) -> dict:
        exchange = ctx.request.scope[EXCHANGE]
        try:
            outcome = await self.shipped.toolbox.call(
                principal=exchange.principal,
                name=params.name,
                arguments=params.arguments,
                meta=exchange.meta,
                prefetched=exchange.prefetched,
            )
        except InvalidParams as exc:
            raise MCPError(INVALID_PARAMS, str(exc)) from None
        legacy = ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS
        # The SDK checks the result's shape against the revision's, and leaves resultType to the handler.
        return outcome.wire(legacy=legacy) if legacy else {**outcome.wire(legacy=legacy), "resultType": "complete"}


class SdkApplication(SigilApplication):
    """Sigil's application, `/_mcp` on the SDK; the SDK's session manager runs with the server."""

    def __init__(self, django_app, *, sdk_defaults: bool = False) -> None:
        super().__init__(django_app)
        self.mcp = SdkMcpEndpoint(self.get_engine, sdk_defaults=sdk_defaults)

    async def lifespan(self, receive, send) -> None:
        async with self.mcp.manager.run():
            await super().lifespan(receive, send)


def application() -> SdkApplication:
    """The SDK as Sigil would configure it (granian --factory)."""
    return SdkApplication(django_application)


def application_with_sdk_defaults() -> SdkApplication:
    """The SDK's server as it comes: an OpenTelemetry span per message (a no-op without an
    exporter), and tools/list run to find a called tool's Mcp-Param headers."""
    return SdkApplication(django_application, sdk_defaults=True)
