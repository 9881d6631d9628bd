"""What the OpenAPI schema (/_api/schema, /_api/schema/docs) says beyond the views: its
operation groups, and the routes served outside DRF's views, which drf-spectacular cannot
see: the capability call (capabilities/engine/, mounted by sigil_site/asgi.py), /_mcp, /llms.txt and /metrics."""

from __future__ import annotations

from capabilities.names import FULL_NAME_PATTERN
from sigil import errors
from sigil.error_docs import openapi_error_responses

# The groups of the docs page, by what a reader wants to do, in this order.
TAGS = [
    {
        "name": "Deploy",
        "description": "Deploy a capability or a new version of it, split traffic between two versions, and "
        "remove it. Needs a deploy token.",
    },
    {
        "name": "Call",
        "description": "Call a capability at `/{agent}/{capability}` with an invoke token (or none, if it is "
        "public). The request reaches the capability as sent; its response comes back unchanged. An "
        "asynchronous call's result is fetched from its status URL.",
    },
    {
        "name": "Discover",
        "description": "List the capabilities an agent may call, inspect one (its code and statistics for its "
        "owner), and follow a capability being paged in.",
    },
    {
        "name": "Operate",
        "description": "The runtime's state, a health check for load balancers, Prometheus metrics, and "
        "what the traffic would cost on each runtime.",
    },
]

CALL_OPERATION = {
    "tags": ["Call"],
    "summary": "Call a capability",
    "description": (
        "Any method. The path after the capability's name, the query, the headers (but `Authorization`) and "
        "the body reach the capability's `fetch` handler; its status, headers and body come back as they are. "
        "Errors of Sigil's own are in the error envelope. With `Prefer: respond-async`, any call answers `202` at "
        "once with the status URL (`/_api/calls/{call}`) where its result will be; with `X-Callback-Url` too, "
        "the result is also POSTed there, signed with the agent's webhook secret."
    ),
    "parameters": [
        {"name": "agent", "in": "path", "required": True, "schema": {"type": "string"}, "example": "xiaoju"},
        {"name": "capability", "in": "path", "required": True, "schema": {"type": "string"}, "example": "ping"},
        {
            "name": "Prefer",
            "in": "header",
            "required": False,
            "schema": {"type": "string", "example": "respond-async"},
            "description": "`respond-async`: answer `202` at once and run the call in the background. Other "
            "preferences are ignored, as RFC 7240 asks.",
        },
        {
            "name": "X-Callback-Url",
            "in": "header",
            "required": False,
            "schema": {"type": "string", "format": "uri"},
            "description": "With `Prefer: respond-async`: an http(s) URL at a public address (unless the operator "
            "allows its network) where the result is POSTed once the call has run.",
        },
    ],
    "security": [{"bearerAuth": []}, {}],
    "responses": {
        "200": {"description": "The capability's own response (any status it answers, any content)."},
        "202": {
            "description": "`Prefer: respond-async`: the call is accepted (`status` `accepted`); poll `callback` "
            "(the same as `status_url`) after `eta_seconds` for its result.",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CallAccepted"}}},
        },
        **openapi_error_responses(
            errors.InvalidRequest,
            errors.Unauthenticated,
            errors.NotFound,
            errors.TooLarge,
            errors.RateLimited,
            errors.UpstreamError,
            errors.CapabilityError,
            errors.Degraded,
            errors.Unavailable,
            errors.Timeout,
            about={
                errors.InvalidRequest: "an X-Callback-Url that is not http(s) or is at a private address",
                errors.Unauthenticated: "no token for a private capability, or a bad one",
                errors.TooLarge: "the body is over SIGIL_INVOKE_MAX_BODY_BYTES",
            },
        ),
    },
}

METRICS_OPERATION = {
    "tags": ["Operate"],
    "operationId": "metrics",
    "summary": "Prometheus metrics",
    "description": (
        "Prometheus text format, or OpenMetrics when the Accept header asks for `application/openmetrics-text`. "
        "Off (404) until `SIGIL_METRICS_TOKEN` is set; then it needs that token as "
        "a bearer token (not an agent's). Wrong tokens count against the caller's address as agents' "
        "tokens do. Any method but GET and HEAD is `405 invalid_request`."
    ),
    "security": [{"metricsToken": []}],
    "responses": {
        "200": {
            "description": "The metrics",
            "content": {
                "text/plain": {"schema": {"type": "string"}},
                "application/openmetrics-text": {"schema": {"type": "string"}},
            },
        },
        **openapi_error_responses(
            errors.Unauthenticated,
            errors.NotFound,
            errors.RateLimited,
            about={
                errors.Unauthenticated: "not the metrics token",
                errors.NotFound: "metrics are off",
                errors.RateLimited: "too many failing tokens from this address",
            },
        ),
    },
}

CALL_METHODS = ("get", "post", "put", "patch", "delete")
# The methods whose body generated clients should send: the call takes any body and passes it
# on as sent. Documented as a JSON object (what a capability's input_schema describes; a
# generated client then sends its argument as JSON), and as bytes of any other type.
CALL_BODY_METHODS = ("post", "put", "patch")
CALL_REQUEST_BODY = {
    "required": False,
    "description": "Reaches the capability as sent. A capability with a contract takes the JSON object its "
    "`input_schema` describes (GET /_api/capabilities/{agent}--{name} shows it); Sigil does not check it on "
    "this path (MCP's tools/call does), and any other content type is passed on too.",
    "content": {
        "application/json": {
            "schema": {"type": "object", "additionalProperties": True},
            "example": {"a": 1, "b": 2},
        },
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    },
}

# What /_mcp answers to a request it refuses before reading any JSON-RPC (capabilities/mcp/
# endpoint.py's `refusal`): a JSON-RPC error whose data carries Sigil's status and code.
MCP_REFUSAL = {
    "type": "object",
    "properties": {
        "jsonrpc": {"type": "string", "enum": ["2.0"]},
        "id": {"type": "string", "nullable": True, "description": "null: refused before the request was read"},
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "integer", "description": "the JSON-RPC error code"},
                "message": {"type": "string"},
                "data": {
                    "type": "object",
                    "properties": {"status": {"type": "integer"}, "code": {"type": "string"}},
                    "required": ["status", "code"],
                },
            },
            "required": ["code", "message", "data"],
        },
    },
    "required": ["jsonrpc", "error"],
}

MCP_OPERATION = {
    "tags": ["Call"],
    "operationId": "mcp",
    "summary": "MCP: the capabilities you may call as tools",
    "description": (
        "An MCP server on the Streamable HTTP transport: one JSON-RPC 2.0 request per POST (protocol 2026-07-28, "
        "stateless; or 2025-11-25 and 2025-06-18 after `initialize`, with `Mcp-Session-Id`). `tools/list` lists "
        "the capabilities the token's agent may call, named `{agent}--{name}`; `tools/call` POSTs the arguments "
        "to one as JSON. With a deploy token, Sigil's own tools come first: `sigil.deploy`, `sigil.list`, "
        "`sigil.inspect`, `sigil.remove`, `sigil.versions`, `sigil.rollback`. See /llms.txt and docs/contract.md."
    ),
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "jsonrpc": {"type": "string", "enum": ["2.0"]},
                        "id": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
                        "method": {"type": "string", "example": "tools/list"},
                        "params": {"type": "object"},
                    },
                    "required": ["jsonrpc", "method"],
                },
                "example": {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}},
            }
        },
    },
    "security": [{"bearerAuth": []}],
    "responses": {
        "200": {
            "description": "The JSON-RPC response (a result, or an error object)",
            "content": {"application/json": {"schema": {"type": "object"}}},
        },
        "202": {"description": "A notification or a response: nothing to answer"},
        "400": {"description": "A JSON-RPC error the transport answers with 400 (a missing envelope, a wrong version)"},
        "404": {"description": "An unknown session, or an unknown method (stateless revision)"},
        # Refused before any JSON-RPC, but answered in JSON-RPC's error shape, not the envelope.
        **{
            status: {**response, "content": {"application/json": {"schema": MCP_REFUSAL}}}
            for status, response in openapi_error_responses(
                errors.Unauthenticated,
                errors.TooLarge,
                errors.UnsupportedMediaType,
                about={
                    errors.Unauthenticated: "no token or a bad one; the JSON-RPC error's data names the code",
                    errors.TooLarge: "the body is over SIGIL_DEPLOY_MAX_BODY_BYTES",
                },
            ).items()
        },
    },
}

LLMS_TXT_OPERATION = {
    "tags": ["Discover"],
    "operationId": "llmsTxt",
    "summary": "A plain-text guide for agents (the llms.txt convention)",
    "description": "How to authenticate, deploy with a contract, call (also asynchronously), search, manage "
    "versions and roll back, over REST and MCP, with this server's URLs. No token.",
    "security": [{}],
    "responses": {
        "200": {"description": "The guide", "content": {"text/plain": {"schema": {"type": "string"}}}},
    },
}


def document_outside_routes(result: dict, generator, request, public) -> dict:
    """drf-spectacular's postprocessing hook: add the call route, /_mcp, /llms.txt and
    /metrics, and the rule of a full capability name to every `{full}` in a path."""
    paths = result.setdefault("paths", {})
    paths["/{agent}/{capability}"] = {
        method: {
            **CALL_OPERATION,
            "operationId": f"callCapability{method.capitalize()}",
            **({"requestBody": CALL_REQUEST_BODY} if method in CALL_BODY_METHODS else {}),
        }
        for method in CALL_METHODS
    }
    paths["/_mcp"] = {"post": MCP_OPERATION}
    for operations in paths.values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if (parameter["name"], parameter["in"]) == ("full", "path"):
                    parameter["schema"]["pattern"] = FULL_NAME_PATTERN
    paths["/llms.txt"] = {"get": LLMS_TXT_OPERATION}
    paths["/metrics"] = {"get": METRICS_OPERATION}
    schemes = result.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes["metricsToken"] = {"type": "http", "scheme": "bearer", "description": "SIGIL_METRICS_TOKEN"}
    return result
