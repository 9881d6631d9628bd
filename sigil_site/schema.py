"""What the OpenAPI schema (/_api/schema, /_api/schema/docs) says beyond the views: its
operation groups, and the two routes served outside Django's views, the capability call
(sigil_site/wsgi.py's gateway) and /metrics, which drf-spectacular cannot see."""

from __future__ import annotations

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

ERROR_REF = {"$ref": "#/components/schemas/Error"}


def _error_response(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}


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
            "schema": {"type": "string", "enum": ["respond-async"]},
            "description": "`respond-async`: answer `202` at once and run the call in the background.",
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
        "202": {"description": "`Prefer: respond-async`: the call is accepted; its result will be at the status URL."},
        "400": _error_response("invalid_request: an X-Callback-Url that is not http(s) or is at a private address"),
        "401": _error_response("unauthenticated: no token for a private capability, or a bad one"),
        "404": _error_response("not_found: no such capability, or one the caller may not know exists"),
        "413": _error_response("too_large: the body is over SIGIL_INVOKE_MAX_BODY_BYTES"),
        "429": _error_response("rate_limited: too many failing tokens from this address"),
        "502": _error_response("capability_error: the capability threw, or ran past its memory"),
        "503": _error_response("degraded (its breaker is open) or unavailable, with Retry-After"),
        "504": _error_response("timeout: no answer within SIGIL_INVOKE_TIMEOUT_SECONDS, or past its CPU limit"),
    },
}

METRICS_OPERATION = {
    "tags": ["Operate"],
    "operationId": "metrics",
    "summary": "Prometheus metrics",
    "description": (
        "Prometheus text format. Off (404) until `SIGIL_METRICS_TOKEN` is set; then it needs that token as "
        "a bearer token (not an agent's)."
    ),
    "security": [{"metricsToken": []}],
    "responses": {
        "200": {"description": "The metrics", "content": {"text/plain": {"schema": {"type": "string"}}}},
        "401": _error_response("unauthenticated: not the metrics token"),
        "404": _error_response("not_found: metrics are off"),
    },
}

CALL_METHODS = ("get", "post", "put", "patch", "delete")


def document_outside_routes(result: dict, generator, request, public) -> dict:
    """drf-spectacular's postprocessing hook: add the call route and /metrics."""
    paths = result.setdefault("paths", {})
    paths["/{agent}/{capability}"] = {
        method: {**CALL_OPERATION, "operationId": f"callCapability{method.capitalize()}"} for method in CALL_METHODS
    }
    paths["/metrics"] = {"get": METRICS_OPERATION}
    schemes = result.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes["metricsToken"] = {"type": "http", "scheme": "bearer", "description": "SIGIL_METRICS_TOKEN"}
    return result
