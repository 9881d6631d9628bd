"""Capabilities as MCP tools, and Sigil's own tools for agents that hold a deploy token.

A capability's tool is named by its full name (`alice--add`: letters, digits and hyphens,
within MCP's tool-name rules), described by its contract's description, and takes the
arguments its `input_schema` declares (any object when it declares none). A call goes through
the gateway itself, in-process: the same token rules, breaker, timeout, stats and paging as a
direct `POST /{agent}/{capability}` with the arguments as its JSON body.

Sigil's own tools are named `sigil.*` (a dot never appears in a full name) and call the same
services as the control API, so they meet the same rules, cool-down and audit events.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from agents.tokens import Principal
from capabilities import breaker, call_logs, contract_copies, contracts, names, routes, selectors, services
from capabilities.contracts import Contract
from capabilities.gateway import PREFETCHED
from sigil_site.errors import InvalidRequest, SigilError
from sigil_site.redis_client import get_redis

PAGE_SIZE = 100
OWN_PREFIX = "sigil."
# What a tool call passes on from the MCP request to the gateway's: the credentials, and what
# the failed-token throttle and URLs read. The MCP client's other headers are not the tool's.
PASSED_ENVIRON = (
    "HTTP_AUTHORIZATION",
    "HTTP_HOST",
    "HTTP_X_FORWARDED_FOR",
    "REMOTE_ADDR",
    "SERVER_NAME",
    "SERVER_PORT",
    "SERVER_PROTOCOL",
    "wsgi.url_scheme",
    "wsgi.errors",
    "wsgi.version",
    "wsgi.multithread",
    "wsgi.multiprocess",
    "wsgi.run_once",
)
JSON_TYPES = ("application/json", "+json")


@dataclass(frozen=True)
class Prefetched:
    """What the endpoint read from Redis for a tool call of a capability, with the token: the
    values of the gateway's call_keys() and of the tool's contract copy."""

    token: bytes | None
    failures: bytes | None
    route: bytes | None
    contract: bytes | None
    breaker: bytes | None


class InvalidParams(Exception):
    """A tools/* request the protocol refuses (JSON-RPC -32602): unknown tool, bad cursor."""


@dataclass(frozen=True)
class ToolResult:
    text: str
    structured: Any = None
    is_error: bool = False

    def wire(self, *, legacy: bool) -> dict:
        result: dict[str, Any] = {"content": [{"type": "text", "text": self.text}], "isError": self.is_error}
        # Through 2025-11-25 structured content must be an object; from 2026-07-28 any JSON.
        if self.structured is not None and (not legacy or isinstance(self.structured, dict)):
            result["structuredContent"] = self.structured
        return result


def failure(text: str) -> ToolResult:
    return ToolResult(text, is_error=True)


def sigil_failure(error: SigilError) -> ToolResult:
    return failure(f"{error.code}: {error.message}")


# Sigil's own tools: (name, description, input schema). Their arguments are the control
# API's fields, checked by the same services.
OWN_TOOLS = {
    "sigil.deploy": (
        "Deploy a capability (a new one, or a new version of yours) and get the tool that calls it. "
        "code is an ES module Worker script: export default { async fetch(request, env) { ... } }; "
        "a tool call reaches it as a POST whose JSON body is the call's arguments, and its answer "
        "(text, or JSON) is the tool's result. Give it a description and an input_schema so that "
        "models know how to call it.",
        {
            "type": "object",
            "properties": {
                "name": {"type": ["string", "null"], "description": "Short name, e.g. add; null for an ephemeral."},
                "code": {"type": "string", "description": "The ES module Worker script."},
                "type": {"enum": ["persistent", "normal", "ephemeral"]},
                "ttl": {"type": "integer", "description": "Seconds an ephemeral lives."},
                "bindings": {"type": "array", "items": {"type": "string"}},
                "public": {"type": "boolean", "description": "Whether other agents may call it."},
                "description": {"type": "string", "description": "What it does, for the models that call it."},
                "input_schema": {"type": "object", "description": "JSON Schema (2020-12) of its arguments."},
                "output_schema": {"type": "object", "description": "JSON Schema (2020-12) of its JSON answer."},
                "examples": {"type": "array", "items": {"type": "object"}},
            },
            "required": ["code"],
            "additionalProperties": False,
        },
    ),
    "sigil.list": (
        "List the capabilities you may call (yours and every public one), optionally searching "
        "their names and descriptions with q.",
        {
            "type": "object",
            "properties": {
                "q": {"type": "string"},
                "agent": {"type": "string"},
                "type": {"enum": ["persistent", "normal", "ephemeral"]},
                "limit": {"type": "integer", "minimum": 1, "maximum": 200},
                "offset": {"type": "integer", "minimum": 0},
            },
            "additionalProperties": False,
        },
    ),
    "sigil.inspect": (
        "One capability's details: contract, version, state, and for your own its code and stats.",
        {
            "type": "object",
            "properties": {"capability": {"type": "string", "description": "Full name, e.g. alice--add."}},
            "required": ["capability"],
            "additionalProperties": False,
        },
    ),
    "sigil.logs": (
        "What one of your capabilities' calls said and how they ended: each call's console lines, "
        "uncaught exception (with its stack) and outcome, newest first. Filter by the call's "
        "request_id (the X-Request-Id it answered with), a level (calls with a line at it or above) "
        "or since (epoch seconds); page with before (the next_before of the previous page).",
        {
            "type": "object",
            "properties": {
                "capability": {"type": "string", "description": "Full name, e.g. alice--add."},
                "request_id": {"type": "string", "maxLength": 64},
                "level": {"enum": ["debug", "info", "log", "warn", "error"]},
                "since": {"type": "number", "minimum": 0},
                "before": {"type": "integer", "minimum": 1},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            },
            "required": ["capability"],
            "additionalProperties": False,
        },
    ),
    "sigil.remove": (
        "Remove one of your capabilities: it stops answering at once.",
        {
            "type": "object",
            "properties": {"capability": {"type": "string", "description": "Full name, e.g. alice--add."}},
            "required": ["capability"],
            "additionalProperties": False,
        },
    ),
}


def tool_for(full: str, contract: Contract, *, legacy: bool) -> dict:
    tool: dict[str, Any] = {
        "name": full,
        "description": contract.description or f"Capability {full} (it declares no description).",
        "inputSchema": contract.input_schema or contracts.OPEN_OBJECT,
    }
    output = contract.output_schema
    # Through 2025-11-25 an output schema must describe an object; from 2026-07-28 any JSON.
    if output is not None and (not legacy or output.get("type") == "object"):
        tool["outputSchema"] = output
    return tool


def tools_list(*, principal: Principal, cursor: str | None, legacy: bool) -> tuple[list[dict], str | None]:
    """One page of the tools `principal` may call, and the cursor of the next page (or None).

    Sigil's own tools come first on the first page, for a deploy token only.
    """
    after = _decode_cursor(cursor) if cursor is not None else ""
    tools = []
    if cursor is None and principal.can_deploy:
        tools = [
            {"name": name, "description": description, "inputSchema": schema}
            for name, (description, schema) in OWN_TOOLS.items()
        ]
    rows = selectors.capability_tools_visible(principal=principal, after=after, limit=PAGE_SIZE + 1)
    tools += [tool_for(full, contract, legacy=legacy) for full, contract in rows[:PAGE_SIZE]]
    next_cursor = _encode_cursor(rows[PAGE_SIZE - 1][0]) if len(rows) > PAGE_SIZE else None
    return tools, next_cursor


def _encode_cursor(full: str) -> str:
    return base64.urlsafe_b64encode(full.encode()).decode()


def _decode_cursor(cursor: Any) -> str:
    try:
        full = base64.b64decode(cursor.encode(), altchars=b"-_", validate=True).decode()
    except (AttributeError, binascii.Error, UnicodeError, ValueError):
        full = None
    if full is None or _encode_cursor(full) != cursor:
        raise InvalidParams("the cursor is not one this server gave")
    return full


@dataclass
class Caller:
    """What the control API's serializers read of a request: who calls, and the site's URL."""

    user: Principal
    base_url: str

    def build_absolute_uri(self, path: str = "/") -> str:
        return self.base_url + path


class Toolbox:
    """Answers tools/call. `gateway` returns the process's gateway (a WSGI application)."""

    def __init__(self, gateway: Callable[[], Any]) -> None:
        self.gateway = gateway

    @staticmethod
    def prefetch_keys(message: Any) -> list[str]:
        """The Redis keys a tool call of a capability reads besides the token and the failed-token
        count (its route, contract and breaker), so that the endpoint reads them all in one round
        trip and the gateway needs none of its own; none for any other message."""
        if not isinstance(message, dict) or message.get("method") != "tools/call":
            return []
        params = message.get("params")
        name = params.get("name") if isinstance(params, dict) else None
        if not isinstance(name, str) or name in OWN_TOOLS:
            return []
        return [routes.key(name), contract_copies.key(name), breaker.open_key(name)]

    def call(
        self, *, principal: Principal, name: Any, arguments: Any, environ: dict, prefetched: Prefetched | None = None
    ) -> ToolResult:
        """Run one tool call; `prefetched` holds what the endpoint read for it (prefetch_keys()).
        Raises InvalidParams for a tool the caller cannot call."""
        if not isinstance(name, str):
            raise InvalidParams("params.name must be the tool's name")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise InvalidParams("params.arguments must be an object")
        if name in OWN_TOOLS:
            if not principal.can_deploy:
                raise InvalidParams(f"{name} needs a deploy token")
            return self.call_own(principal=principal, name=name, arguments=arguments, environ=environ)
        try:
            names.split_full_name(name)
        except InvalidRequest:
            raise InvalidParams(f"no tool {name}") from None
        if prefetched is None:
            route_raw, contract_raw = get_redis().mget(routes.key(name), contract_copies.key(name))
        else:
            route_raw, contract_raw = prefetched.route, prefetched.contract
        if route_raw is None:
            route_raw = routes.route_load(name)
        if not routes.route_visible(routes.decode(route_raw), principal.agent_name):
            raise InvalidParams(f"no tool {name}")
        contract = contract_copies.decode(contract_raw or contract_copies.contract_load(name))
        if contract is None:
            raise InvalidParams(f"no tool {name}")
        if contract.input_schema is not None:
            problem = contracts.schema_problem(contract.input_schema, arguments)
            if problem is not None:
                return failure(f"the arguments do not match {name}'s input schema: {problem}")
        gateway_values = None
        if prefetched is not None:  # what the gateway reads, so that it reads nothing again
            gateway_values = (prefetched.token, route_raw, prefetched.breaker, prefetched.failures)
        return self.call_capability(name, arguments, contract, environ, gateway_values)

    def call_capability(
        self, full: str, arguments: dict, contract: Contract, environ: dict, gateway_values: tuple | None
    ) -> ToolResult:
        status, headers, body = self.through_gateway(full, arguments, environ, gateway_values)
        text = body.decode(errors="replace")
        if status >= 400:
            if "x-sigil-capability" not in headers:  # Sigil's own refusal, in the error envelope
                try:
                    error = json.loads(body)["error"]
                    return failure(f"{error['code']}: {error['message']}")
                except (ValueError, KeyError, TypeError):
                    pass
            return failure(f"{full} answered {status}: {text}")
        if contract.output_schema is None or not headers.get("content-type", "").split(";")[0].endswith(JSON_TYPES):
            return ToolResult(text)
        try:
            answer = json.loads(body)
        except ValueError:
            return failure(f"{full} answered JSON that does not parse: {text[:500]}")
        problem = contracts.schema_problem(contract.output_schema, answer)
        if problem is not None:
            return failure(f"{full} answered JSON that does not match its output schema: {problem}")
        return ToolResult(text, structured=answer)

    def through_gateway(
        self, full: str, arguments: dict, environ: dict, gateway_values: tuple | None
    ) -> tuple[int, dict[str, str], bytes]:
        """POST the arguments to the capability through the gateway application, in-process."""
        agent, name = names.split_full_name(full)
        body = json.dumps(arguments).encode()
        call = {key: environ[key] for key in PASSED_ENVIRON if key in environ}
        call.update(
            {
                "REQUEST_METHOD": "POST",
                "PATH_INFO": f"/{agent}/{name}",
                "QUERY_STRING": "",
                "CONTENT_TYPE": "application/json",
                "CONTENT_LENGTH": str(len(body)),
                "HTTP_ACCEPT": "application/json, text/plain;q=0.9, */*;q=0.5",
                "wsgi.input": io.BytesIO(body),
            }
        )
        if gateway_values is not None:
            call[PREFETCHED] = gateway_values
        answer: dict[str, Any] = {}
        chunks: list[bytes] = []

        def start_response(status, headers, exc_info=None):
            answer["status"], answer["headers"] = status, headers
            return chunks.append

        response = self.gateway()(call, start_response)
        try:
            chunks.extend(response)
        finally:
            if hasattr(response, "close"):
                response.close()  # records the call (stats, breaker), as a WSGI server does
        headers = {key.lower(): value for key, value in answer["headers"]}
        return int(answer["status"][:3]), headers, b"".join(chunks)

    def call_own(self, *, principal: Principal, name: str, arguments: dict, environ: dict) -> ToolResult:
        from capabilities import api  # the control API's serializers: one shape for REST and MCP

        _, schema = OWN_TOOLS[name]
        problem = contracts.schema_problem(schema, arguments)
        if problem is not None:
            return failure(f"the arguments do not match {name}'s input schema: {problem}")
        caller = Caller(principal, _base_url(environ))
        try:
            if name == "sigil.deploy":
                result = services.capability_deploy(
                    principal=principal,
                    name=arguments.get("name"),
                    code=arguments["code"],
                    type=arguments.get("type"),
                    ttl=arguments.get("ttl"),
                    bindings=arguments.get("bindings", []),
                    is_public=arguments.get("public"),
                    contract={field: arguments[field] for field in contracts.FIELDS if field in arguments},
                )
                answer = {**api.deploy_answer(caller, result), "tool": result.capability.full_name}
            elif name == "sigil.list":
                query = selectors.capability_list_visible(
                    principal=principal, type=arguments.get("type"), agent=arguments.get("agent"), q=arguments.get("q")
                )
                offset = arguments.get("offset", 0)
                page = query[offset : offset + arguments.get("limit", 50)]
                listed = api.CapabilitySerializer(page, many=True, context={"request": caller}).data
                answer = {"count": query.count(), "capabilities": listed}
            elif name == "sigil.inspect":
                capability = selectors.capability_get_visible(principal=principal, full=arguments["capability"])
                answer = api.CapabilityDetailSerializer(capability, context={"request": caller}).data
            elif name == "sigil.logs":
                page = selectors.capability_call_records(
                    principal=principal,
                    full=arguments["capability"],
                    request_id=arguments.get("request_id"),
                    level=arguments.get("level"),
                    since=arguments.get("since"),
                    before=arguments.get("before"),
                    limit=arguments.get("limit", 20),
                )
                answer = {
                    "capability": arguments["capability"],
                    "records": api.CallRecordSerializer(page.records, many=True).data,
                    "next_before": page.next_before,
                    "lost": call_logs.call_records_lost(full=arguments["capability"]),
                }
            else:
                services.capability_remove(principal=principal, full=arguments["capability"])
                answer = {"removed": arguments["capability"]}
        except SigilError as error:
            return sigil_failure(error)
        structured = json.loads(json.dumps(answer, cls=DjangoJSONEncoder))
        return ToolResult(json.dumps(structured), structured=structured)


def _base_url(environ: dict) -> str:
    host = environ.get("HTTP_HOST") or f"{environ.get('SERVER_NAME', '')}:{environ.get('SERVER_PORT', '')}"
    return f"{environ.get('wsgi.url_scheme', 'http')}://{host}"
