"""Capabilities as MCP tools, and Sigil's own tools for agents that hold a deploy token.

A capability's tool is named by its full name (`alice--add`: letters, digits and hyphens,
within MCP's tool-name rules), described by its contract's description, and takes the
arguments its `input_schema` declares (any object when it declares none). A call is a
CallRequest to the engine itself, in-process: the same token rules, shares, breaker, timeout,
stats and paging as a direct `POST /{agent}/{capability}` with the arguments as its JSON body.

Sigil's own tools are named `sigil.*` (a dot never appears in a full name) and call the same
services as the control API, so they meet the same rules, cool-down and audit events.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from agents.tokens import Principal
from capabilities import contracts, names, selectors, services
from capabilities.books import call_logs, contract_copies, routes
from capabilities.contracts import Contract
from capabilities.engine.values import CallRequest
from capabilities.engine.values import Prefetched as CallPrefetched
from sigil import redis_keys
from sigil.errors import InvalidRequest, SigilError

PAGE_SIZE = 100
OWN_PREFIX = "sigil."
JSON_TYPES = ("application/json", "+json")


@dataclass(frozen=True)
class Prefetched:
    """What the endpoint read from Redis for a tool call of a capability, with the token: the
    values of the engine's call_keys() and of the tool's contract copy."""

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
    "sigil.versions": (
        "The versions of one of your capabilities, newest first: number, sha256, contract summary, when and "
        "by whom each was made, and its status (served, staged, placing, refused, superseded or retired).",
        {
            "type": "object",
            "properties": {
                "capability": {"type": "string", "description": "Full name, e.g. alice--add."},
                "limit": {"type": "integer", "minimum": 1, "maximum": 200},
                "offset": {"type": "integer", "minimum": 0},
            },
            "required": ["capability"],
            "additionalProperties": False,
        },
    ),
    "sigil.rollback": (
        "Roll one of your capabilities back to an earlier version: its code and contract are served again, "
        "as a new version. Counts as a deploy for the cool-down.",
        {
            "type": "object",
            "properties": {
                "capability": {"type": "string", "description": "Full name, e.g. alice--add."},
                "version": {"type": "integer", "minimum": 1, "description": "The version to restore."},
            },
            "required": ["capability", "version"],
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
    """Answers tools/call. `engine` returns the process's engine."""

    def __init__(self, engine: Callable[[], Any]) -> None:
        self.engine = engine

    @staticmethod
    def prefetch_keys(message: Any) -> list[str]:
        """The Redis keys a tool call of a capability reads besides the token and the failed-token
        count (its route, contract and breaker), so that the endpoint reads them all in one round
        trip and the engine needs none of its own; none for any other message."""
        if not isinstance(message, dict) or message.get("method") != "tools/call":
            return []
        params = message.get("params")
        name = params.get("name") if isinstance(params, dict) else None
        if not isinstance(name, str) or name in OWN_TOOLS:
            return []
        return [redis_keys.route(name), redis_keys.contract(name), redis_keys.breaker_open(name)]

    async def call(
        self, *, principal: Principal, name: Any, arguments: Any, meta: dict, prefetched: Prefetched | None = None
    ) -> ToolResult:
        """Run one tool call; `prefetched` holds what the endpoint read for it (prefetch_keys()).
        Raises InvalidParams for a tool the caller cannot call."""
        if not isinstance(name, str):
            raise InvalidParams("params.name must be the tool's name")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise InvalidParams("params.arguments must be an object")
        engine = self.engine()
        if name in OWN_TOOLS:
            if not principal.can_deploy:
                raise InvalidParams(f"{name} needs a deploy token")
            return await engine.offload(self.call_own, principal=principal, name=name, arguments=arguments, meta=meta)
        try:
            names.split_full_name(name)
        except InvalidRequest:
            raise InvalidParams(f"no tool {name}") from None
        if prefetched is None:
            route_raw, contract_raw, breaker_raw = await engine.redis.mget(
                redis_keys.route(name), redis_keys.contract(name), redis_keys.breaker_open(name)
            )
        else:
            route_raw, contract_raw, breaker_raw = prefetched.route, prefetched.contract, prefetched.breaker
        if route_raw is None:
            route_raw = await engine.offload(routes.route_load, name)
        if not routes.route_visible(routes.decode(route_raw), principal.agent_name):
            raise InvalidParams(f"no tool {name}")
        contract = contract_copies.decode(contract_raw or await engine.offload(contract_copies.contract_load, name))
        if contract is None:
            raise InvalidParams(f"no tool {name}")
        if contract.input_schema is not None:
            problem = contracts.schema_problem(contract.input_schema, arguments)
            if problem is not None:
                return failure(f"the arguments do not match {name}'s input schema: {problem}")
        token = prefetched.token if prefetched is not None else None
        failures = prefetched.failures if prefetched is not None else None
        # What the engine reads before a call, so that it reads nothing again.
        values = CallPrefetched(token=token, route=route_raw, breaker=breaker_raw, auth_failures=failures)
        status, headers, body = await self.through_engine(name, arguments, meta, values)
        return self.result(name, contract, status, headers, body)

    @staticmethod
    def result(full: str, contract: Contract, status: int, headers: dict[str, str], body: bytes) -> ToolResult:
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

    async def through_engine(
        self, full: str, arguments: dict, meta: dict, prefetched: CallPrefetched
    ) -> tuple[int, dict[str, str], bytes]:
        """POST the arguments to the capability through the engine, in-process, as the caller:
        its credentials and address go with it; the MCP client's other headers are not the
        tool's."""
        from sigil.request_id import current_request_id

        agent, name = names.split_full_name(full)
        body = json.dumps(arguments).encode()
        headers = {
            "authorization": meta.get("HTTP_AUTHORIZATION", ""),
            "content-type": "application/json",
            "accept": "application/json, text/plain;q=0.9, */*;q=0.5",
        }
        if "HTTP_HOST" in meta:
            headers["host"] = meta["HTTP_HOST"]
        engine = self.engine()
        request = CallRequest(
            agent=agent,
            name=name,
            rest="/",
            method="POST",
            query="",
            headers=headers,
            body=body,
            length=len(body),
            address=engine.auth_throttle.address(meta),
            request_id=current_request_id() or "",
            prefetched=prefetched,
        )
        answer = await engine.call(request)
        complete = False
        try:
            data = b"".join([chunk async for chunk in answer.chunks()])
            complete = True
        finally:
            await answer.close(complete=complete)  # records the call (stats, breaker)
        return answer.status, {key.lower(): value for key, value in answer.headers}, data

    def call_own(self, *, principal: Principal, name: str, arguments: dict, meta: dict) -> ToolResult:
        from capabilities import api  # the control API's serializers: one shape for REST and MCP

        _, schema = OWN_TOOLS[name]
        problem = contracts.schema_problem(schema, arguments)
        if problem is not None:
            return failure(f"the arguments do not match {name}'s input schema: {problem}")
        caller = Caller(principal, _base_url(meta))
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
            elif name == "sigil.versions":
                capability = selectors.capability_get_owned(principal=principal, full=arguments["capability"])
                query = selectors.capability_versions(capability=capability)
                offset = arguments.get("offset", 0)
                page = list(query[offset : offset + arguments.get("limit", 50)])
                records = selectors.versions_describe(capability=capability, versions=page)
                answer = {"count": query.count(), "versions": api.VersionSerializer(records, many=True).data}
            elif name == "sigil.rollback":
                result = services.capability_rollback_by_agent(
                    principal=principal, full=arguments["capability"], version_number=arguments["version"]
                )
                answer = {**api.deploy_answer(caller, result), "tool": result.capability.full_name}
            elif name == "sigil.logs":
                query = call_logs.RecordQuery(
                    request_id=arguments.get("request_id"),
                    level=arguments.get("level"),
                    since=arguments.get("since"),
                    before=arguments.get("before"),
                    limit=arguments.get("limit", 20),
                )
                page = selectors.capability_call_records(principal=principal, full=arguments["capability"], query=query)
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


def _base_url(meta: dict) -> str:
    host = meta.get("HTTP_HOST") or f"{meta.get('SERVER_NAME', '')}:{meta.get('SERVER_PORT', '')}"
    return f"{meta.get('wsgi.url_scheme', 'http')}://{host}"
