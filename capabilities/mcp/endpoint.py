"""`/_mcp`: MCP's Streamable HTTP transport, JSON-RPC 2.0, authenticated with an agent's
bearer token. An ASGI application mounted in front of Django (sigil_site/asgi.py), beside the
engine: a tool call of a capability is a CallRequest to the engine, on the event loop, and
holds no thread while the capability runs; what reads the database (tools/list, Sigil's own
tools) runs in the engine's pool.

Two eras of the protocol are spoken, as the official SDK speaks them:

- **2026-07-28, stateless.** No `initialize` and no session: every POST is one JSON-RPC
  request whose `params._meta` carries the protocol version and client capabilities, echoed
  by the `MCP-Protocol-Version` and `Mcp-Method` headers (and `Mcp-Name` for tools/call).
  `server/discover` tells the versions and capabilities; there is no `ping`. Results carry
  `resultType`, and the cacheable ones (`server/discover`, `tools/list`) `ttlMs` and
  `cacheScope`. Errors the envelope checks find answer 400 (404 for an unknown method).
- **2025-06-18 and 2025-11-25, with sessions.** `initialize` negotiates the version (a client
  asking for another one is offered 2025-11-25) and opens a session (`Mcp-Session-Id`, kept in
  Redis for every process, bound to the token that opened it); later requests carry it,
  `ping` answers, `DELETE` ends the session.

A request is routed by its `MCP-Protocol-Version` header, as the SDK's own server does: one
naming a session-era version (or none, as an `initialize` has) takes the session path; any
other the stateless one, whose checks refuse a version it does not speak. The server never
sends requests or notifications of its own: `GET` (a stream for them) is `405`.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from agents import tokens
from agents.selectors import parse_bearer
from agents.tokens import Principal
from capabilities.mcp.tools import InvalidParams, Prefetched, Toolbox, tools_list
from capabilities.parsers import json_depth_over
from sigil import redis_keys
from sigil.errors import (
    InternalError,
    InvalidRequest,
    SigilError,
    TooLarge,
    UnsupportedMediaType,
    error_for_unexpected,
    error_headers,
)
from sigil.redis_client import get_redis

logger = logging.getLogger(__name__)

STATELESS_VERSIONS = ("2026-07-28",)
SESSION_VERSIONS = ("2025-06-18", "2025-11-25")
SUPPORTED_VERSIONS = (*SESSION_VERSIONS, *STATELESS_VERSIONS)
# Versions that belong to the session era, spoken here or not: a request naming one is
# answered on the session path (which refuses the old ones), as the SDK routes them.
HANDSHAKE_ERA = ("2024-11-05", "2025-03-26", *SESSION_VERSIONS)

# JSON-RPC 2.0 and MCP error codes.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
HEADER_MISMATCH = -32020
UNSUPPORTED_PROTOCOL_VERSION = -32022
# The stateless revision's HTTP status for an error (200 for the others, as the SDK has it).
STATELESS_ERROR_STATUS = {
    PARSE_ERROR: 400,
    INVALID_REQUEST: 400,
    INVALID_PARAMS: 400,
    HEADER_MISMATCH: 400,
    UNSUPPORTED_PROTOCOL_VERSION: 400,
    METHOD_NOT_FOUND: 404,
}

META_PROTOCOL_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CLIENT_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"

SERVER_INFO = {"name": "sigil", "title": "Sigil", "version": "1.0"}
CAPABILITIES = {"tools": {"listChanged": False}}
INSTRUCTIONS = (
    "Sigil runs small server-side functions (capabilities) that agents deploy and call. Each tool "
    "is a capability you may call, yours or a public one; its arguments reach it as a JSON body. "
    "With a deploy token, sigil.deploy writes a new capability (an ES module Worker script), which "
    "is a tool at once; sigil.list searches the catalogue, sigil.inspect shows one capability, "
    "sigil.remove removes one of yours, sigil.versions lists a capability's versions, sigil.rollback "
    "restores one, and sigil.logs reads what your capability wrote to its console in each call."
)
# A session nobody uses for a day is forgotten; each request keeps it a day longer.
SESSION_IDLE_SECONDS = 24 * 3600
SESSION_HEADER = "Mcp-Session-Id"


class RpcError(Exception):
    """A JSON-RPC error answer; `status` is its HTTP status where the era does not decide it."""

    def __init__(self, code: int, message: str, *, data: Any = None, status: int | None = None, request_id=None):
        super().__init__(message)
        self.code, self.message, self.data, self.status, self.request_id = code, message, data, status, request_id


@dataclass(frozen=True)
class Exchange:
    """One HTTP request to /_mcp, authenticated. `meta` holds its headers as a WSGI environ
    does (HTTP_*, CONTENT_TYPE, REMOTE_ADDR), the form the throttle and URLs read."""

    meta: dict
    principal: Principal
    session_id: str | None
    session: bytes | None  # the record of the session it names, if that session exists
    prefetched: Prefetched | None  # what a tool call reads from Redis, read with the token


class McpEndpoint:
    """The ASGI application at `/_mcp`. `engine` returns the process's engine."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.toolbox = Toolbox(engine)

    async def __call__(self, scope, receive, send) -> None:
        meta = request_meta(scope)
        try:
            body = await read_body(receive, meta) if meta["REQUEST_METHOD"] == "POST" else b""
            status, headers, body = await self.handle(meta, body)
        except SigilError as error:
            status, headers, body = refusal(error)
        except Exception as exc:
            error = error_for_unexpected(exc)
            if isinstance(error, InternalError):
                logger.exception("request %s failed: %s /_mcp", error.request_id, meta["REQUEST_METHOD"])
            status, headers, body = refusal(error)
        headers = [*headers, ("Content-Length", str(len(body))), ("X-Content-Type-Options", "nosniff")]
        if body:
            headers.append(("Content-Type", "application/json"))
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def handle(self, meta: dict, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        secret = parse_bearer(meta.get("HTTP_AUTHORIZATION"))
        method = meta["REQUEST_METHOD"]
        message = malformed = None
        if method == "POST":
            try:
                message = read_message(meta, body)
            except RpcError as error:
                malformed = error
        exchange = await self.authenticate(meta, secret, message)
        if malformed is not None:
            status = malformed.status or STATELESS_ERROR_STATUS.get(malformed.code, 400)
            return status, [], rpc_error_body(malformed.request_id, **error_fields(malformed))
        if method == "DELETE" and exchange.session_id is not None:
            if exchange.session is None:
                return session_not_found()
            await self.engine().redis.delete(redis_keys.mcp_session(exchange.session_id))
            return 204, [], b""
        if method != "POST":
            # No stream of server-sent messages (GET): this server sends none.
            return 405, [("Allow", "POST, DELETE")], rpc_error_body(None, INVALID_REQUEST, "use POST")
        try:
            version_header = meta.get("HTTP_MCP_PROTOCOL_VERSION")
            if version_header is None or version_header in HANDSHAKE_ERA:
                return await self.session_era(exchange, message)
            return await self.stateless(exchange, message)
        except RpcError as error:  # the message is no JSON-RPC request
            status = error.status or STATELESS_ERROR_STATUS.get(error.code, 400)
            return status, [], rpc_error_body(error.request_id, **error_fields(error))

    async def authenticate(self, meta: dict, secret: str, message: Any) -> Exchange:
        """Who calls, and what the request needs from Redis, in one round trip: the token, the
        failed-token count, the session it names, and for a tool call the tool's route and
        contract. Raises Unauthenticated or RateLimited."""
        engine = self.engine()
        throttle = engine.auth_throttle
        address = throttle.address(meta)
        session_id = meta.get("HTTP_MCP_SESSION_ID")
        token_hash = tokens.hash_secret(secret)
        keys = [redis_keys.token(token_hash), throttle.key(address), redis_keys.mcp_session(session_id or "")]
        tool_keys = Toolbox.prefetch_keys(message)
        cached, failures, session, *tool_values = await engine.redis.mget(keys + tool_keys)
        principal = tokens.decode(token_hash, cached, time.time()) if cached is not None else None
        if principal is not None and tokens.stamp_due(token_hash):  # "last used", at most once a minute
            await engine.redis.hset(redis_keys.TOKENS_USED, token_hash, tokens.stamp_now())
        if principal is None:
            principal = await engine.offload(
                throttle.authenticate, get_redis(), address, secret, cached=cached, failures=failures
            )
        prefetched = Prefetched(cached, failures, *tool_values) if tool_keys else None
        return Exchange(meta, principal, session_id, session if session_id else None, prefetched)

    # The stateless revision (2026-07-28).

    async def stateless(self, exchange: Exchange, message: dict):
        kind, request_id, method, params = message_parts(message)
        if kind != "request":
            return 202, [], b""  # the revision defines no client notifications: nothing to act on
        try:
            check_envelope(exchange.meta, method, params)
            result = await self.answer(exchange, method, params, legacy=False)
        except RpcError as error:
            return STATELESS_ERROR_STATUS.get(error.code, 200), [], rpc_error_body(request_id, **error_fields(error))
        result["resultType"] = "complete"
        result["_meta"] = {META_SERVER_INFO: SERVER_INFO}
        return 200, [], rpc_result_body(request_id, result)

    # The session revisions (2025-06-18, 2025-11-25).

    async def session_era(self, exchange: Exchange, message: dict):
        kind, request_id, method, params = message_parts(message)
        principal, session_id, session = exchange.principal, exchange.session_id, exchange.session
        headers: list[tuple[str, str]] = []
        try:
            if kind == "request" and method == "initialize":
                version, session_id = await open_session(self.engine().redis, principal, params)
                headers.append((SESSION_HEADER, session_id))
                result = {
                    "protocolVersion": version,
                    "capabilities": CAPABILITIES,
                    "serverInfo": SERVER_INFO,
                    "instructions": INSTRUCTIONS,
                }
                return 200, headers, rpc_result_body(request_id, result)
            if session_id is None:
                raise RpcError(INVALID_REQUEST, f"send the {SESSION_HEADER} header that initialize gave", status=400)
            if session is None or session.decode().split("|")[0] != principal.token_hash:
                # Unknown, expired, or opened with another token: all the same to the caller.
                return session_not_found()
            version = session.decode().split("|")[1]
            header = exchange.meta.get("HTTP_MCP_PROTOCOL_VERSION")
            if header is not None and header != version:
                raise RpcError(INVALID_REQUEST, f"this session speaks MCP {version}, not {header}", status=400)
            await self.engine().redis.expire(redis_keys.mcp_session(session_id), SESSION_IDLE_SECONDS)
            if kind != "request":
                return 202, [], b""
            result = {} if method == "ping" else await self.answer(exchange, method, params, legacy=True)
        except RpcError as error:
            return error.status or 200, headers, rpc_error_body(request_id, **error_fields(error))
        return 200, headers, rpc_result_body(request_id, result)

    # What both eras answer.

    async def answer(self, exchange: Exchange, method: str, params: dict, *, legacy: bool) -> dict:
        try:
            if method == "tools/list":
                tools, next_cursor = await self.engine().offload(
                    tools_list, principal=exchange.principal, cursor=params.get("cursor"), legacy=legacy
                )
                result: dict[str, Any] = {"tools": tools}
                if next_cursor is not None:
                    result["nextCursor"] = next_cursor
                if not legacy:
                    result.update(ttlMs=0, cacheScope="private")  # each agent sees its own list
                return result
            if method == "tools/call":
                outcome = await self.toolbox.call(
                    principal=exchange.principal,
                    name=params.get("name"),
                    arguments=params.get("arguments"),
                    meta=exchange.meta,
                    prefetched=exchange.prefetched,
                )
                return outcome.wire(legacy=legacy)
            if method == "server/discover" and not legacy:
                return {
                    "supportedVersions": list(SUPPORTED_VERSIONS),
                    "capabilities": CAPABILITIES,
                    "instructions": INSTRUCTIONS,
                    "ttlMs": 0,
                    "cacheScope": "private",
                }
        except InvalidParams as exc:
            raise RpcError(INVALID_PARAMS, str(exc)) from None
        raise RpcError(METHOD_NOT_FOUND, f"method not found: {method}")


def request_meta(scope) -> dict:
    """The request's method, headers and address in a WSGI environ's names."""
    meta = {"REQUEST_METHOD": scope["method"], "PATH_INFO": scope["path"]}
    for raw_name, raw_value in scope["headers"]:
        name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
        key = name.upper().replace("-", "_")
        key = key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else "HTTP_" + key
        meta[key] = f"{meta[key]}, {value}" if key in meta else value
    client, server = scope.get("client"), scope.get("server")
    meta["REMOTE_ADDR"] = client[0] if client else ""
    meta["SERVER_NAME"], meta["SERVER_PORT"] = (server[0], str(server[1])) if server else ("", "")
    meta["wsgi.url_scheme"] = scope.get("scheme", "http")
    return meta


async def read_body(receive, meta: dict) -> bytes:
    """The request's body, at most the largest request (a deploy through sigil.deploy). Raises
    TooLarge, InvalidRequest."""
    limit = settings.SIGIL_DEPLOY_MAX_BODY_BYTES
    length = meta.get("CONTENT_LENGTH")
    if length:
        try:
            size = int(length)
        except ValueError:
            raise InvalidRequest("Content-Length is not a number") from None
        if size > limit:
            raise TooLarge(f"the request body is over {limit} bytes")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidRequest("the caller closed the connection before its request body was sent")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the request body is over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def read_message(meta: dict, raw: bytes) -> Any:
    """The request's JSON-RPC message. Raises UnsupportedMediaType or RpcError."""
    content_type = meta.get("CONTENT_TYPE", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise UnsupportedMediaType("send the JSON-RPC message as application/json")
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError):
        raise RpcError(PARSE_ERROR, "the body is not JSON", status=400) from None
    if json_depth_over(message, settings.SIGIL_JSON_MAX_DEPTH):
        raise RpcError(INVALID_REQUEST, f"the JSON is nested deeper than {settings.SIGIL_JSON_MAX_DEPTH}", status=400)
    return message


def message_parts(message: Any) -> tuple[str, Any, str | None, dict]:
    """(kind, id, method, params) of one JSON-RPC message; kind is request, notification or
    response. Raises RpcError for what is no JSON-RPC 2.0 message (batches are not, since
    2025-06-18)."""
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, "not a JSON-RPC 2.0 message (one object, jsonrpc 2.0)", status=400)
    if "method" not in message:
        if "result" in message or "error" in message:
            return "response", message.get("id"), None, {}
        raise RpcError(INVALID_REQUEST, "a request needs a method", status=400)
    method, params = message["method"], message.get("params", {})
    request_id = message.get("id")
    if not isinstance(method, str):
        raise RpcError(INVALID_REQUEST, "method must be a string", status=400)
    if "id" not in message:
        return "notification", None, method, params if isinstance(params, dict) else {}
    if isinstance(request_id, bool) or not isinstance(request_id, str | int):
        raise RpcError(INVALID_REQUEST, "id must be a string or an integer", status=400)
    if not isinstance(params, dict):
        raise RpcError(INVALID_PARAMS, "params must be an object", status=400, request_id=request_id)
    return "request", request_id, method, params


def check_envelope(request: dict, method: str, params: dict) -> None:
    """The stateless revision's checks, in the SDK's order: the `_meta` envelope, the headers
    that mirror it, then the version. Raises RpcError."""
    meta = params.get("_meta")
    if not isinstance(meta, dict) or META_PROTOCOL_VERSION not in meta or META_CLIENT_CAPABILITIES not in meta:
        raise RpcError(
            INVALID_PARAMS,
            f"params._meta must carry {META_PROTOCOL_VERSION!r} and {META_CLIENT_CAPABILITIES!r}",
        )
    version = meta[META_PROTOCOL_VERSION]
    if request.get("HTTP_MCP_PROTOCOL_VERSION") != version:
        raise RpcError(HEADER_MISMATCH, "the MCP-Protocol-Version header does not match params._meta")
    if request.get("HTTP_MCP_METHOD") != method:
        raise RpcError(HEADER_MISMATCH, "the Mcp-Method header does not match the method")
    if method == "tools/call" and decode_header_value(request.get("HTTP_MCP_NAME")) != params.get("name"):
        raise RpcError(HEADER_MISMATCH, "the Mcp-Name header does not match params.name")
    if not isinstance(version, str):
        raise RpcError(INVALID_PARAMS, "the protocol version must be a string")
    if version not in STATELESS_VERSIONS:
        raise RpcError(
            UNSUPPORTED_PROTOCOL_VERSION,
            "Unsupported protocol version",
            data={"supported": list(STATELESS_VERSIONS), "requested": version},
        )


def decode_header_value(value: str | None) -> str | None:
    """A header value as MCP encodes it: verbatim, or `=?base64?…?=` for what a header cannot
    carry as it is."""
    if value is None or not (value.startswith("=?base64?") and value.endswith("?=")):
        return value
    try:
        return base64.b64decode(value[9:-2], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


async def open_session(redis, principal: Principal, params: dict) -> tuple[str, str]:
    """Negotiate the version an `initialize` asks for and open a session; (version, id)."""
    requested = params.get("protocolVersion")
    if not isinstance(requested, str):
        raise RpcError(INVALID_PARAMS, "initialize needs params.protocolVersion")
    # The spec's negotiation: the version asked for when spoken here, else the latest one.
    version = requested if requested in SESSION_VERSIONS else SESSION_VERSIONS[-1]
    session_id = secrets.token_hex(16)
    await redis.set(redis_keys.mcp_session(session_id), f"{principal.token_hash}|{version}", ex=SESSION_IDLE_SECONDS)
    return version, session_id


def session_not_found():
    return 404, [], rpc_error_body(None, INVALID_REQUEST, "session not found: initialize a new one")


def error_fields(error: RpcError) -> dict:
    return {"code": error.code, "message": error.message, "data": error.data}


def rpc_result_body(request_id, result: dict) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}).encode()


def rpc_error_body(request_id, code: int, message: str, data: Any = None) -> bytes:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "error": error}).encode()


def refusal(error: SigilError) -> tuple[int, list[tuple[str, str]], bytes]:
    """A request refused before any JSON-RPC: Sigil's status and headers (401 with
    WWW-Authenticate, 429 with Retry-After, ...), and a JSON-RPC error naming Sigil's code."""
    data = {"status": error.status, "code": error.code}
    code = INTERNAL_ERROR if error.status >= 500 else INVALID_REQUEST
    return error.status, list(error_headers(error).items()), rpc_error_body(None, code, error.message, data)


REASONS = {
    200: "OK",
    202: "Accepted",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
