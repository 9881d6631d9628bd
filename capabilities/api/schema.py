"""What the OpenAPI document says beyond the serializers: the error envelope and each
operation's error responses (written from the error catalogue, sigil/errors.py), and the
deploy's examples."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    extend_schema_serializer,
)
from rest_framework import serializers

from sigil import errors
from sigil.error_docs import by_status, error_description, error_example


@extend_schema_field(
    {
        "type": "object",
        "properties": {
            "code": {
                "type": "string",
                "description": "What went wrong, for programs: "
                + ", ".join(dict.fromkeys(kind.code for kind in errors.error_kinds())),
            },
            "message": {"type": "string", "description": "The same for people, naming the field or limit at fault"},
        },
        "required": ["code", "message"],
    }
)
class ErrorBodyField(serializers.JSONField):
    """The envelope's inside, kept inline so that the envelope is one schema."""


@extend_schema_serializer(component_name="Error")
class ErrorSerializer(serializers.Serializer):
    """Every error Sigil answers, on the API and the call route alike: a code for programs and a
    message for people."""

    error = ErrorBodyField()


# What any call with a token may meet, whatever it asks; every view documents these and the
# errors of its own, so that a client (and the schema fuzz test) knows every status to expect.
AUTHENTICATED = (
    errors.InvalidRequest,
    errors.Unauthenticated,
    errors.Forbidden,
    errors.MethodNotAllowed,
    errors.NotAcceptable,
    errors.RateLimited,
)
# What a view that reads or writes a capability of its agent's adds.
NOT_FOUND = (*AUTHENTICATED, errors.NotFound)
# What a deploy (or a rollback, which is one) adds: the placement and its limits.
DEPLOYING = (
    *NOT_FOUND,
    errors.Conflict,
    errors.TooLarge,
    errors.UnsupportedMediaType,
    errors.Cooldown,
    errors.UpstreamError,
    errors.Unavailable,
    errors.Timeout,
)


def error_responses(*kinds: type[errors.SigilError]) -> dict[int, OpenApiResponse]:
    """The responses of an operation that can answer `kinds`: one per status, with the codes it
    stands for and an example of each, as the catalogue has them."""
    return {
        status: OpenApiResponse(
            ErrorSerializer,
            description=error_description(group),
            examples=[
                OpenApiExample(kind.code, value=error_example(kind), response_only=True, status_codes=[str(status)])
                for kind in group
            ],
        )
        for status, group in by_status(kinds).items()
    }


View = TypeVar("View", bound=Callable[..., Any])


def operation(
    operation_id: str, tag: str, summary: str, answers: dict, kinds: tuple[type[errors.SigilError], ...], **more: Any
) -> Callable[[View], View]:
    """`extend_schema` for one operation: its id, its group, its summary, what it answers when it
    succeeds and the errors it can answer (as error_responses documents them); its description is
    the method's docstring as one paragraph (without one, the view's, as drf-spectacular does)."""

    def document(method: View) -> View:
        description = " ".join(method.__doc__.split()) if method.__doc__ else None
        responses = {**answers, **error_responses(*kinds)}
        return extend_schema(
            operation_id=operation_id, tags=[tag], summary=summary, description=description, responses=responses, **more
        )(method)

    return document


# A deploy with its contract: the example of the schema, /llms.txt and docs/contract.md.
ADD_DEPLOY = {
    "name": "add",
    "code": "export default { async fetch(request) { const {a, b} = await request.json(); "
    "return Response.json({sum: a + b}) } }",
    "description": "Adds two numbers.",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
    "output_schema": {"type": "object", "properties": {"sum": {"type": "number"}}},
    "examples": [{"input": {"a": 1, "b": 2}, "output": {"sum": 3}}],
}


# What a deploy may be sent, by name.
DEPLOY_REQUESTS = {
    "A capability with its contract": ADD_DEPLOY,
    "A named capability": {
        "name": "ping",
        "code": 'export default { async fetch(request) { return new Response("pong") } }',
        "description": "Answers pong.",
    },
    "A public capability with a binding": {
        "name": "weather",
        "type": "normal",
        "public": True,
        "bindings": ["SECRET:WEATHER_KEY"],
        "code": "export default { async fetch(request, env) { "
        "return fetch(`https://api.example.com/?key=${env.WEATHER_KEY}`) } }",
    },
    "An ephemeral capability for an hour": {
        "name": None,
        "ttl": 3600,
        "code": "export default { fetch: () => new Response('hi') }",
        "description": "Says hi, for an hour.",
    },
}
ADD_DEPLOYED = {"capability": "xiaoju--add", "url": "https://sigil.example.com/xiaoju/add", "expires_at": None}
# What it answers, by status: placed at once, or still being placed.
DEPLOY_ANSWERS = {
    "201": ("Deployed", {**ADD_DEPLOYED, "version": 1, "staged": False, "cold_start": True, "evicted": None}),
    "202": (
        "Still being placed",
        {"status": "deploying", "callback": "/_status/xiaoju--add", "eta_seconds": 5, **ADD_DEPLOYED, "version": 2},
    ),
}
DEPLOY_EXAMPLES = [
    *(OpenApiExample(name, value=value, request_only=True) for name, value in DEPLOY_REQUESTS.items()),
    *(
        OpenApiExample(name, value=value, response_only=True, status_codes=[status])
        for status, (name, value) in DEPLOY_ANSWERS.items()
    ),
]
