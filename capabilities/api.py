"""The control API of API.md: thin views that translate JSON, call one service, translate back."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpResponse, HttpResponseRedirect, JsonResponse, StreamingHttpResponse
from django.template.loader import render_to_string
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    extend_schema_serializer,
    extend_schema_view,
    inline_serializer,
)
from redis import RedisError
from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.permissions import AllowAny
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from agents import services as agent_services
from agents.authentication import BearerTokenAuthentication, OwnerTokenAuthentication, StaffSessionAuthentication
from agents.models import Agent
from agents.permissions import HasDeployScope, IsOwner
from agents.throttle import FailedAuthThrottle
from capabilities import breaker, call_logs, contracts, cost, failures, selectors, services
from capabilities.metrics import metrics_render
from capabilities.models import Capability, State
from capabilities.parsers import LimitedJSONParser
from capabilities.runtimes import get_runtime
from capabilities.runtimes.errors import RuntimeUnavailable
from capabilities.services import async_calls
from sigil.errors import (
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    RateLimited,
    Unauthenticated,
    error_response,
)
from sigil.redis_client import get_redis


class StrictBooleanField(serializers.BooleanField):
    """Only JSON true/false: "yes" or 1 for a flag is a mistake worth a 400."""

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class StrictIntegerField(serializers.IntegerField):
    """Only JSON integers: "3600" or 3600.5 for a ttl is a mistake worth a 400."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictCharField(serializers.CharField):
    """Only JSON strings, taken exactly as sent: DRF would otherwise turn 42 into "42" and
    trim " ping" to "ping", so a name would not be the one the agent wrote."""

    def __init__(self, **kwargs):
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


@extend_schema_field(
    {
        "type": "object",
        "properties": {
            "code": {
                "type": "string",
                "description": "What went wrong, for programs: invalid_request, unauthenticated, forbidden, "
                "not_found, conflict, too_large, cooldown, rate_limited, quota_exceeded, upstream_error, "
                "capability_error, degraded, unavailable, timeout, internal_error",
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


# What each status means, as API.md's error table has it; every view documents the ones it
# can answer, so that a client (and the schema fuzz test) knows every status to expect.
ERROR_STATUSES = {
    400: "invalid_request: malformed JSON, a field of the wrong type, a name that breaks a rule",
    401: "unauthenticated: no token (send Authorization: Bearer <token>), an unknown, revoked or expired one, "
    "or one of an agent the owner disabled (with WWW-Authenticate)",
    403: "forbidden: wrong scope, or another agent's prefix",
    404: "not_found: no such capability, or one the caller may not know exists",
    405: "invalid_request: the method is not one this path answers",
    406: "invalid_request: the client accepts no JSON",
    409: "conflict: a name taken by another type, or a concurrent deploy",
    413: "too_large: code or body over its limit",
    415: "invalid_request: a body that is not application/json",
    429: "cooldown, rate_limited or quota_exceeded, with Retry-After",
    502: "upstream_error: the runtime failed",
    503: "degraded, or a dependency is down",
    504: "timeout: the runtime did not answer in time",
}
# What any call with a token may meet, whatever it asks.
AUTHENTICATED = (400, 401, 403, 405, 406, 429)


# One example answer per status, as the API really words it.
ERROR_EXAMPLES = {
    400: ("invalid_request", "capability name 'Bad_Name' must match ^[a-z0-9][a-z0-9-]{0,40}$ with no '--'"),
    401: (
        "unauthenticated",
        "send Authorization: Bearer <token>, an agent's deploy or invoke token (the owner issues them)",
    ),
    403: ("forbidden", "deploying needs a token with the deploy scope"),
    404: ("not_found", "no capability xiaoju--nothing"),
    405: ("invalid_request", 'Method "PUT" not allowed.'),
    406: ("invalid_request", "Could not satisfy the request Accept header."),
    409: ("conflict", "xiaoju--ping is a normal capability; it cannot be redeployed as persistent"),
    413: ("too_large", "code is 10485761 bytes; the limit is 10485760 bytes"),
    415: (
        "invalid_request",
        'send the body as JSON with Content-Type: application/json (this request has Content-Type "text/plain")',
    ),
    429: ("cooldown", "xiaoju deployed less than 5 s ago; retry later"),
    502: ("upstream_error", "the runtime could not place xiaoju--ping: Cloudflare answered 500"),
    503: ("unavailable", "Sigil's Redis is unreachable; try again shortly"),
    504: ("timeout", "xiaoju--ping is still being placed after 30 s; try again shortly"),
}


def error_responses(*statuses: int) -> dict[int, OpenApiResponse]:
    return {
        status: OpenApiResponse(
            ErrorSerializer,
            description=ERROR_STATUSES[status],
            examples=[
                OpenApiExample(
                    ERROR_EXAMPLES[status][0],
                    value={"error": {"code": ERROR_EXAMPLES[status][0], "message": ERROR_EXAMPLES[status][1]}},
                    response_only=True,
                    status_codes=[str(status)],
                )
            ],
        )
        for status in statuses
    }


def capability_url(request, capability: Capability) -> str:
    base = settings.SIGIL_PUBLIC_URL.rstrip("/") or request.build_absolute_uri("/").rstrip("/")
    return f"{base}/{capability.agent.name}/{capability.name}"


class ContractExampleSerializer(serializers.Serializer):
    """One example of a contract, for the schema: what the capability takes and answers."""

    input = serializers.JSONField(required=False, help_text="A JSON body matching input_schema.")
    output = serializers.JSONField(required=False, help_text="What the capability answers, matching output_schema.")
    description = serializers.CharField(required=False)


class ContractFields(serializers.Serializer):
    """The contract of a version (capabilities/contracts.py), as deploy takes it and the
    catalogue shows it. Checked by the contract's own rules, which name the field."""

    description = StrictCharField(
        required=False,
        allow_null=True,
        allow_blank=True,
        help_text=f"What the capability does, in plain text (at most {contracts.DESCRIPTION_MAX_CHARS} characters).",
    )
    input_schema = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text='JSON Schema (draft 2020-12) of the JSON object it takes; "type": "object" at the root.',
    )
    output_schema = serializers.JSONField(
        required=False, allow_null=True, help_text="JSON Schema (draft 2020-12) of the JSON it answers."
    )
    examples = ContractExampleSerializer(
        many=True,
        required=False,
        allow_null=True,
        help_text=f"At most {contracts.EXAMPLES_MAX} input/output pairs, each checked against the schemas.",
    )


class CapabilitySerializer(serializers.ModelSerializer):
    """A capability as agents see it, with its current version's contract; the code only
    for its owner."""

    capability = serializers.CharField(source="full_name")
    agent = serializers.CharField(source="agent.name")
    version = serializers.IntegerField(source="current_version.number", allow_null=True)
    sha256 = serializers.CharField(source="current_version.sha", allow_null=True)
    public = serializers.BooleanField(source="is_public")
    url = serializers.SerializerMethodField()
    breaker = serializers.CharField(source="breaker_state")
    stats = serializers.SerializerMethodField()
    description = serializers.CharField(source="current_version.description", default="")
    input_schema = serializers.JSONField(source="current_version.input_schema", default=None)
    output_schema = serializers.JSONField(source="current_version.output_schema", default=None)
    examples = ContractExampleSerializer(source="current_version.examples", many=True, default=list)
    staged_version = serializers.IntegerField(source="staged_version.number", allow_null=True, default=None)
    inactive_at = serializers.DateTimeField(
        allow_null=True,
        help_text="When a normal capability was marked inactive for going SIGIL_INACTIVE_AFTER_DAYS without a "
        "call (its agent was told); null while it is in use. The next call clears it.",
    )

    class Meta:
        model = Capability
        fields = [
            "capability",
            "agent",
            "name",
            "description",
            "type",
            "public",
            "state",
            "version",
            "staged_version",
            "sha256",
            "bindings",
            "url",
            "created_at",
            "updated_at",
            "expires_at",
            "last_access_at",
            "inactive_at",
            "breaker",
            "stats",
            "input_schema",
            "output_schema",
            "examples",
        ]

    def get_url(self, obj) -> str:
        return capability_url(self.context["request"], obj)

    def get_stats(self, obj) -> dict | None:
        """Totals since the capability was created; its owner's to read."""
        if obj.agent_id != self.context["request"].user.agent_id:
            return None
        calls = obj.calls_total
        return {
            "calls": calls,
            "errors": obj.errors_total,
            "mean_latency_ms": round(obj.latency_ms_total / calls, 3) if calls else None,
        }


DEPLOY_STATE = inline_serializer(
    "DeployState",
    {
        "version": serializers.IntegerField(),
        "status": serializers.ChoiceField(["placing", "failed", "superseded"]),
        "error": inline_serializer(
            "DeployError", {"code": serializers.CharField(), "message": serializers.CharField()}, allow_null=True
        ),
    },
    allow_null=True,
)


class CapabilityDetailSerializer(CapabilitySerializer):
    code = serializers.SerializerMethodField()
    recent = serializers.SerializerMethodField()
    failures = serializers.SerializerMethodField()
    split = serializers.SerializerMethodField()
    breaker_detail = serializers.SerializerMethodField()
    deploy = serializers.SerializerMethodField()

    class Meta(CapabilitySerializer.Meta):
        fields = [
            *CapabilitySerializer.Meta.fields,
            "recent",
            "failures",
            "breaker_detail",
            "split",
            "deploy",
            "code",
            "cache_when_degraded",
        ]

    def get_failures(self, obj) -> list[dict] | None:
        """The recent failures, newest first (time, status, code, message, duration, request
        id, version), for the owner only."""
        if obj.agent_id != self.context["request"].user.agent_id:
            return None
        return [failure.as_dict() for failure in failures.failures_list(full=obj.full_name)]

    def get_breaker_detail(self, obj) -> dict | None:
        """Why the breaker is where it is (forced by whom, or tripped by which failures' request
        ids) and until when, for the owner only."""
        if obj.agent_id != self.context["request"].user.agent_id:
            return None
        return breaker.breaker_describe(full=obj.full_name).as_dict()

    def get_split(self, obj) -> dict | None:
        """The traffic split running, its versions side by side, for the owner only."""
        if obj.agent_id != self.context["request"].user.agent_id:
            return None
        return split_body(obj)

    @extend_schema_field(DEPLOY_STATE)
    def get_deploy(self, obj) -> dict | None:
        """The owner's latest deploy while it is not the version served: being placed (on the
        Cloudflare runtimes, by a Celery task), failed with its error, or superseded."""
        if obj.agent_id != self.context["request"].user.agent_id:
            return None
        return selectors.capability_deploy_state(obj)

    def get_recent(self, obj) -> dict | None:
        """The last 24 hours' calls, errors and latency percentiles, for the owner only."""
        if obj.agent_id != self.context["request"].user.agent_id:
            return None
        return selectors.capability_stats(capability=obj, since=timezone.now() - timedelta(hours=24))

    def get_code(self, obj) -> str | None:
        owner = obj.agent_id == self.context["request"].user.agent_id
        return obj.current_version.code if owner and obj.current_version else None


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


class AcceptedSerializer(serializers.Serializer):
    """Every 202 Sigil answers, a deploy still being placed or a call not yet run: the seeds'
    `status`, `callback` (the URL to poll) and `eta_seconds` (how long to wait before polling),
    plus what each kind adds."""

    status = serializers.CharField(help_text="What is under way: deploying, accepted or running")
    callback = serializers.CharField(help_text="Where to GET the outcome, relative to this server")
    eta_seconds = serializers.IntegerField(help_text="Seconds to wait before polling callback")


@extend_schema_serializer(component_name="CallAccepted")
class CallAcceptedSerializer(AcceptedSerializer):
    """202 for an asynchronous call not yet run: as the gateway answers `Prefer: respond-async`,
    and as its status URL answers until the call has run."""

    status = serializers.ChoiceField(["accepted", "running"])
    call = serializers.CharField(help_text="The call's id")
    capability = serializers.CharField(help_text="The capability called, agent--name")
    status_url = serializers.CharField(help_text="The same as callback")


class CapabilityDeployApi(APIView):
    permission_classes = [HasDeployScope]
    parser_classes = [LimitedJSONParser]

    @extend_schema_serializer(component_name="Deploy")
    class InputSerializer(ContractFields):
        agent = StrictCharField(required=False, allow_null=True, help_text="The token's agent; any other is a 403")
        name = StrictCharField(
            required=False,
            allow_null=True,
            help_text="The capability's name under the agent; null creates an ephemeral one (t-…)",
        )
        code = StrictCharField(help_text="An ES module Worker script whose default export has a fetch handler")
        type = serializers.ChoiceField(
            choices=["persistent", "normal", "ephemeral"],
            required=False,
            allow_null=True,
            help_text="Omitted: the capability's own on a redeploy; persistent for a new name, ephemeral for null",
        )
        ttl = StrictIntegerField(required=False, allow_null=True, help_text="Seconds an ephemeral capability lives")
        bindings = serializers.ListField(
            child=StrictCharField(),
            required=False,
            default=list,
            help_text="KIND:NAME of each binding the owner granted this agent, e.g. KV:CACHE",
        )
        # Omitted: a redeploy keeps the capability's value, a new capability is private.
        public = StrictBooleanField(
            required=False, help_text="Whether other agents may call it. Omitted: kept on a redeploy, else false"
        )
        stage = StrictBooleanField(
            required=False,
            default=False,
            help_text="Keep the new version aside, for a traffic split, without making it current",
        )
        cache_when_degraded = StrictBooleanField(
            required=False,
            allow_null=True,
            default=None,
            help_text="While its breaker is open, answer a GET it answered before from the last good response. "
            "Omitted: kept on a redeploy, else false",
        )

    @extend_schema_serializer(component_name="Deployed")
    class OutputSerializer(serializers.Serializer):
        capability = serializers.CharField(help_text="Its full name, agent--name")
        url = serializers.CharField(help_text="Where to call it")
        version = serializers.IntegerField()
        staged = serializers.BooleanField()
        expires_at = serializers.DateTimeField(allow_null=True)
        cold_start = serializers.BooleanField(help_text="Whether placing it started code anew")
        evicted = serializers.CharField(allow_null=True, help_text="The capability paged out to make room, if any")

    @extend_schema_serializer(component_name="DeployAccepted")
    class PendingSerializer(AcceptedSerializer):
        """202: the version is recorded and still being placed; poll `callback`."""

        status = serializers.ChoiceField(["deploying"])
        capability = serializers.CharField()
        url = serializers.CharField()
        version = serializers.IntegerField()
        expires_at = serializers.DateTimeField(allow_null=True)

    @extend_schema(
        operation_id="deployCapability",
        tags=["Deploy"],
        summary="Deploy a capability, or a new version of it",
        description=(
            "Creates the capability (201) or deploys a new version (200); the same code and bindings again "
            "change nothing (200, same version). The code must start: code that does not is a 400 with the "
            "runtime's own words, and the previous version keeps serving. Fields left out of a redeploy "
            "(`type`, `public`) keep the capability's values. One real deploy per agent per "
            "SIGIL_DEPLOY_COOLDOWN_SECONDS (429 cooldown)."
        ),
        request=InputSerializer,
        responses={
            200: OutputSerializer,
            201: OutputSerializer,
            202: PendingSerializer,
            **error_responses(*AUTHENTICATED, 404, 409, 413, 415, 502, 503, 504),
        },
        examples=[
            OpenApiExample(
                "A capability with its contract",
                request_only=True,
                value=ADD_DEPLOY,
            ),
            OpenApiExample(
                "A named capability",
                request_only=True,
                value={
                    "name": "ping",
                    "code": 'export default { async fetch(request) { return new Response("pong") } }',
                    "description": "Answers pong.",
                },
            ),
            OpenApiExample(
                "A public capability with a binding",
                request_only=True,
                value={
                    "name": "weather",
                    "type": "normal",
                    "public": True,
                    "bindings": ["SECRET:WEATHER_KEY"],
                    "code": "export default { async fetch(request, env) { "
                    "return fetch(`https://api.example.com/?key=${env.WEATHER_KEY}`) } }",
                },
            ),
            OpenApiExample(
                "An ephemeral capability for an hour",
                request_only=True,
                value={
                    "name": None,
                    "ttl": 3600,
                    "code": "export default { fetch: () => new Response('hi') }",
                    "description": "Says hi, for an hour.",
                },
            ),
            OpenApiExample(
                "Deployed",
                response_only=True,
                status_codes=["201"],
                value={
                    "capability": "xiaoju--add",
                    "url": "https://sigil.example.com/xiaoju/add",
                    "version": 1,
                    "staged": False,
                    "expires_at": None,
                    "cold_start": True,
                    "evicted": None,
                },
            ),
            OpenApiExample(
                "Still being placed",
                response_only=True,
                status_codes=["202"],
                value={
                    "status": "deploying",
                    "callback": "/_status/xiaoju--add",
                    "eta_seconds": 5,
                    "capability": "xiaoju--add",
                    "url": "https://sigil.example.com/xiaoju/add",
                    "version": 2,
                    "expires_at": None,
                },
            ),
        ],
    )
    def post(self, request):
        if not isinstance(request.data, dict):
            raise InvalidRequest("the body must be a JSON object")
        unknown = set(request.data) - set(self.InputSerializer().fields)
        if unknown:
            raise InvalidRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        result = services.capability_deploy(
            principal=request.user,
            agent=data.get("agent"),
            name=data.get("name"),
            code=data["code"],
            type=data.get("type"),
            ttl=data.get("ttl"),
            bindings=data["bindings"],
            is_public=data.get("public"),
            stage=data["stage"],
            # The raw values: the contract's rules check them (the serializer only documents them).
            contract={name: request.data[name] for name in contracts.FIELDS if name in request.data},
            cache_when_degraded=data["cache_when_degraded"],
        )
        if result.pending:
            # As a cold call with respond-async: the status URL says when it is placed.
            return Response(self.PendingSerializer(deploy_answer(request, result)).data, status=202)
        return Response(deploy_answer(request, result), status=201 if result.created else 200)


def deploy_answer(request, result: services.DeployResult) -> dict:
    """What a deploy answers, over REST and MCP alike; a deploy whose placement is still
    under way (on the Cloudflare runtimes) says where to follow it instead."""
    body = {
        "capability": result.capability.full_name,
        "url": capability_url(request, result.capability),
        "version": result.version.number,
        "expires_at": result.capability.expires_at,
    }
    if result.pending:
        callback = f"/_status/{result.capability.full_name}"
        return {**body, "status": "deploying", "callback": callback, "eta_seconds": DEPLOY_ETA_SECONDS}
    body.update(staged=result.staged, cold_start=result.cold_start, evicted=result.evicted)
    return CapabilityDeployApi.OutputSerializer(body).data


class CapabilityPagination(LimitOffsetPagination):
    default_limit = 50
    max_limit = 200


class CapabilityListApi(APIView):
    pagination_class = CapabilityPagination  # so that the schema shows the page's shape

    @extend_schema(
        operation_id="listCapabilities",
        tags=["Discover"],
        summary="List the capabilities this agent may call",
        description="Its own and every public one, by full name, a page at a time.",
        parameters=[
            OpenApiParameter("type", str, enum=["persistent", "normal", "ephemeral"]),
            OpenApiParameter("state", str, enum=State.values),
            OpenApiParameter("agent", str),
            OpenApiParameter(
                "q",
                str,
                description="Words to look for in each capability's full name and description "
                "(case-insensitive; every word must appear).",
            ),
            OpenApiParameter("limit", int),
            OpenApiParameter("offset", int),
        ],
        responses={200: CapabilitySerializer(many=True), **error_responses(*AUTHENTICATED)},
    )
    def get(self, request):
        query = selectors.capability_list_visible(
            principal=request.user,
            type=request.query_params.get("type"),
            state=request.query_params.get("state"),
            agent=request.query_params.get("agent"),
            q=request.query_params.get("q"),
        )
        paginator = CapabilityPagination()
        page = paginator.paginate_queryset(query, request, view=self)
        return paginator.get_paginated_response(
            CapabilitySerializer(page, many=True, context={"request": request}).data
        )


class CapabilityDetailApi(APIView):
    def get_permissions(self):
        return [HasDeployScope()] if self.request.method == "DELETE" else super().get_permissions()

    @extend_schema(
        operation_id="inspectCapability",
        tags=["Discover"],
        summary="Inspect a capability",
        description="Its owner also sees its code, its totals (`stats`) and its last 24 hours (`recent`).",
        responses={200: CapabilityDetailSerializer, **error_responses(*AUTHENTICATED, 404)},
    )
    def get(self, request, full: str):
        capability = selectors.capability_get_visible(principal=request.user, full=full)
        return Response(CapabilityDetailSerializer(capability, context={"request": request}).data)

    @extend_schema(
        operation_id="removeCapability",
        tags=["Deploy"],
        summary="Remove a capability",
        description="It stops serving at once; its script is deleted in the background. Needs a deploy token.",
        responses={204: None, **error_responses(*AUTHENTICATED, 404)},
    )
    def delete(self, request, full: str):
        services.capability_remove(principal=request.user, full=full)
        return Response(status=204)


class CallLogLineSerializer(serializers.Serializer):
    level = serializers.ChoiceField(list(call_logs.LEVELS))
    at = serializers.FloatField(allow_null=True, help_text="When it was written (epoch seconds).")
    text = serializers.CharField(allow_blank=True)
    cut = serializers.BooleanField(help_text="The line was cut at SIGIL_LOGS_LINE_BYTES.")


class CallExceptionSerializer(serializers.Serializer):
    name = serializers.CharField(allow_blank=True)
    message = serializers.CharField(allow_blank=True)
    stack = serializers.CharField(allow_blank=True)


class CallRecordSerializer(serializers.Serializer):
    seq = serializers.IntegerField(help_text="The record's place in Sigil's sequence (the paging cursor).")
    at = serializers.FloatField(help_text="When the call started (epoch seconds).")
    request_id = serializers.CharField(help_text="The X-Request-Id the caller saw.")
    outcome = serializers.CharField(help_text="How the call ended, in the runtime's words: ok, exception, …")
    status = serializers.IntegerField(allow_null=True, help_text="The status the capability answered, if it did.")
    wall_ms = serializers.FloatField(allow_null=True)
    cpu_ms = serializers.FloatField(allow_null=True, help_text="Where the runtime reports it (0 on workerd).")
    cold = serializers.BooleanField(help_text="The first call its isolate served.")
    version = serializers.IntegerField(allow_null=True)
    logs = CallLogLineSerializer(many=True)
    lines_cut = serializers.IntegerField(help_text="Lines past SIGIL_LOGS_LINES_PER_CALL, not kept.")
    lines_shortened = serializers.IntegerField(help_text="Lines cut at SIGIL_LOGS_LINE_BYTES.")
    exception = CallExceptionSerializer(allow_null=True, help_text="The uncaught exception, with its stack.")
    runtime_truncated = serializers.BooleanField(help_text="The runtime itself dropped some of the call's events.")


class CapabilityLogsApi(APIView):
    """GET /_api/capabilities/{full}/logs: the owner's records of its capability's calls."""

    class FilterSerializer(serializers.Serializer):
        request_id = serializers.CharField(required=False, max_length=64)
        level = serializers.ChoiceField(list(call_logs.LEVELS), required=False)
        since = serializers.FloatField(required=False, min_value=0)
        before = serializers.IntegerField(required=False, min_value=1)
        limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=20)

    @extend_schema_serializer(component_name="CallRecordPage")
    class OutputSerializer(serializers.Serializer):
        capability = serializers.CharField()
        records = CallRecordSerializer(many=True)
        next = serializers.CharField(allow_null=True, help_text="The next (older) page, or null.")
        lost = serializers.IntegerField(help_text="Records of this capability that could not be kept.")

    @extend_schema(
        operation_id="capabilityLogs",
        tags=["Discover"],
        summary="What a capability's calls said and how they ended",
        description="Its own agent's only (another agent gets 404): each call's console lines, uncaught "
        "exception and outcome, newest first, by the call's `X-Request-Id`.",
        parameters=[
            OpenApiParameter("request_id", str, description="The call's X-Request-Id."),
            OpenApiParameter(
                "level",
                str,
                enum=list(call_logs.LEVELS),
                description="Calls with a line at this level or above (error: also an uncaught exception).",
            ),
            OpenApiParameter("since", float, description="Calls made at or after this time (epoch seconds)."),
            OpenApiParameter("before", int, description="The cursor of the page (`next` gives it)."),
            OpenApiParameter("limit", int, description="At most this many records (1 to 100, 20 by default)."),
        ],
        responses={200: OutputSerializer, **error_responses(*AUTHENTICATED, 404)},
    )
    def get(self, request, full: str):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        page = selectors.capability_call_records(principal=request.user, full=full, **filters.validated_data)
        next_url = None
        if page.next_before is not None:
            query = request.query_params.copy()
            query["before"] = str(page.next_before)
            next_url = request.build_absolute_uri(f"{request.path}?{query.urlencode()}")
        lost = call_logs.call_records_lost(full=full)
        body = {"capability": full, "records": page.records, "next": next_url, "lost": lost}
        return Response(self.OutputSerializer(body).data)


class EventStreamRenderer(JSONRenderer):
    """Lets a caller that accepts only `text/event-stream` in; what DRF renders for it (an
    error) is the contract's JSON all the same."""

    media_type = "text/event-stream"
    format = "event-stream"


class CapabilityLogsTailApi(APIView):
    """GET /_api/capabilities/{full}/logs/tail: the owner's new call records as they arrive."""

    renderer_classes = [JSONRenderer, EventStreamRenderer]

    class FilterSerializer(serializers.Serializer):
        seconds = serializers.FloatField(required=False, min_value=0.1)
        after = serializers.IntegerField(required=False, min_value=0)

    @extend_schema(
        operation_id="capabilityLogsTail",
        tags=["Discover"],
        summary="Follow a capability's call records as they arrive",
        description="Server-Sent Events: one `record` event per new call record (its `id` is the record's "
        "`seq`; send it back as `Last-Event-ID` or `after` to resume), a comment line every few seconds "
        "while there is none. It ends when the caller closes it, after `seconds`, or after "
        "SIGIL_LOGS_TAIL_SECONDS. Its own agent's only (another agent gets 404).",
        parameters=[
            OpenApiParameter("seconds", float, description="How long to stream (at most SIGIL_LOGS_TAIL_SECONDS)."),
            OpenApiParameter("after", int, description="Start after this record's `seq` (default: from now)."),
        ],
        responses={
            (200, "text/event-stream"): OpenApiResponse(str, description="The records, as Server-Sent Events."),
            **error_responses(*AUTHENTICATED, 404),
        },
    )
    def get(self, request, full: str):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        after = filters.validated_data.get("after")
        resume = request.headers.get("Last-Event-ID", "")
        if after is None and resume.isdigit():
            after = int(resume)
        records = selectors.capability_call_records_follow(
            principal=request.user,
            full=full,
            after=after,
            seconds=filters.validated_data.get("seconds", settings.SIGIL_LOGS_TAIL_SECONDS),
        )
        response = StreamingHttpResponse(_server_sent(records), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"  # a proxy in front passes each event on at once
        return response


async def _server_sent(records) -> AsyncIterator[bytes]:
    """The records as events. Asynchronous, so that Django's ASGI handler sends each event as
    it comes (it would read a plain iterator to its end first); each wait for the next record
    runs in a thread."""
    yield b": following\n\n"  # the headers and a first line at once: the caller knows it is on
    following = sync_to_async(next, thread_sensitive=False)
    while (record := await following(records, _ENDED)) is not _ENDED:
        if record is None:
            yield b": still here\n\n"
            continue
        data = json.dumps(CallRecordSerializer(record).data, separators=(",", ":"))
        yield f"id: {record['seq']}\nevent: record\ndata: {data}\n\n".encode()


_ENDED = object()


def split_body(capability: Capability) -> dict | None:
    report = selectors.capability_split_report(capability=capability)
    return None if report is None else SplitSerializer(report).data


class VersionStatsSerializer(serializers.Serializer):
    calls = serializers.IntegerField()
    errors = serializers.IntegerField()
    error_rate = serializers.FloatField(allow_null=True)
    cold_calls = serializers.IntegerField()
    p50_ms = serializers.FloatField(allow_null=True)
    p95_ms = serializers.FloatField(allow_null=True)
    state = serializers.CharField()
    breaker = serializers.CharField()


class SplitVersionSerializer(serializers.Serializer):
    version = serializers.IntegerField()
    weight = serializers.IntegerField()
    stats = VersionStatsSerializer(allow_null=True)


class SplitGuardSerializer(serializers.Serializer):
    margin = serializers.FloatField()
    min_calls = serializers.IntegerField()


class SplitSerializer(serializers.Serializer):
    """A running split: both versions' shares and figures since it began."""

    started_at = serializers.DateTimeField()
    caller_header = serializers.CharField(allow_null=True)
    guard = SplitGuardSerializer(allow_null=True)
    current = SplitVersionSerializer()
    staged = SplitVersionSerializer()


def reject_unknown_fields(data, serializer: serializers.Serializer) -> None:
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    unknown = set(data) - set(serializer.fields)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(sorted(unknown))}")


class CapabilitySplitApi(APIView):
    """PUT starts or changes the split of calls between the current and the staged version;
    GET shows it (the owner's)."""

    parser_classes = [LimitedJSONParser]

    def get_permissions(self):
        return [HasDeployScope()] if self.request.method == "PUT" else super().get_permissions()

    @extend_schema_serializer(component_name="SplitRequest")
    class InputSerializer(serializers.Serializer):
        weight = StrictIntegerField(min_value=0, max_value=100)
        caller_header = StrictCharField(required=False, allow_null=True, allow_blank=True)
        guard = inline_serializer(
            "SplitGuardInput",
            {
                "margin": serializers.FloatField(min_value=0, max_value=1),
                "min_calls": StrictIntegerField(required=False, min_value=1),
            },
            required=False,
            allow_null=True,
        )

    @extend_schema(
        operation_id="getSplit",
        tags=["Deploy"],
        summary="The traffic split between the current and the staged version",
        responses={200: SplitSerializer, **error_responses(*AUTHENTICATED, 404)},
    )
    def get(self, request, full: str):
        capability = selectors.capability_get_owned(principal=request.user, full=full)
        body = split_body(capability)
        if body is None:
            raise NotFound(f"{full} has no traffic split")
        return Response(body)

    @extend_schema(
        operation_id="setSplit",
        tags=["Deploy"],
        summary="Start or change a traffic split",
        request=InputSerializer,
        responses={200: SplitSerializer, **error_responses(*AUTHENTICATED, 404, 409, 413, 415, 502, 504)},
    )
    def put(self, request, full: str):
        reject_unknown_fields(request.data, self.InputSerializer())
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        capability = selectors.capability_get_owned(principal=request.user, full=full)
        guard = data.get("guard")
        capability = services.capability_split_set(
            capability=capability,
            weight=data["weight"],
            caller_header=data.get("caller_header") or "",
            guard=services.SplitGuard(**guard) if guard else None,
            actor=f"agent:{request.user.agent_name}",
        )
        return Response(split_body(capability))


class CapabilitySplitEndApi(APIView):
    """POST …/split/promote or …/split/abort: end the split one way or the other."""

    permission_classes = [HasDeployScope]
    end = staticmethod(services.capability_promote)

    def post(self, request, full: str):
        capability = selectors.capability_get_owned(principal=request.user, full=full)
        self.end(capability=capability, actor=f"agent:{request.user.agent_name}")
        capability = selectors.capability_get_owned(principal=request.user, full=full)
        return Response(CapabilityDetailSerializer(capability, context={"request": request}).data)


SPLIT_END_RESPONSES = {200: CapabilityDetailSerializer, **error_responses(*AUTHENTICATED, 404, 409, 413, 502, 504)}


@extend_schema_view(
    post=extend_schema(
        operation_id="promoteSplit",
        tags=["Deploy"],
        summary="End the traffic split by making the staged version current",
        request=None,
        responses=SPLIT_END_RESPONSES,
    )
)
class CapabilityPromoteApi(CapabilitySplitEndApi):
    end = staticmethod(services.capability_promote)


@extend_schema_view(
    post=extend_schema(
        operation_id="abortSplit",
        tags=["Deploy"],
        summary="End the traffic split by sending every call to the current version again",
        request=None,
        responses=SPLIT_END_RESPONSES,
    )
)
class CapabilitySplitAbortApi(CapabilitySplitEndApi):
    end = staticmethod(services.capability_split_abort)


@extend_schema_serializer(component_name="Version")
class VersionSerializer(serializers.Serializer):
    """One version of a capability, as its agent lists them (selectors.VersionRecord)."""

    version = serializers.IntegerField()
    sha256 = serializers.CharField()
    size_bytes = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    status = serializers.ChoiceField(
        ["served", "staged", "placing", "refused", "superseded", "retired"],
        help_text="served: the current version; staged: kept aside for a traffic split; placing: being placed; "
        "refused: the runtime or a rule refused it (failure says why); superseded: a newer deploy came before it "
        "was placed; retired: served or staged before, no longer",
    )
    deployed_by = serializers.CharField(
        allow_null=True,
        help_text="Who made it: agent:NAME, owner:USERNAME (the admin), owner:cli (manage.py) or system",
    )
    restores = serializers.IntegerField(allow_null=True, help_text="The version a rollback restored, if it is one")
    description = serializers.CharField(help_text="The contract's description")
    declares = serializers.ListField(
        child=serializers.ChoiceField(list(contracts.FIELDS)), help_text="The contract fields it sets"
    )
    failure = inline_serializer(
        "VersionFailure", {"code": serializers.CharField(), "message": serializers.CharField()}, allow_null=True
    )


class CapabilityVersionsApi(APIView):
    """GET /_api/capabilities/{full}/versions: the owner's history of a capability."""

    pagination_class = CapabilityPagination  # so that the schema shows the page's shape

    @extend_schema(
        operation_id="listVersions",
        tags=["Deploy"],
        summary="The versions of one of your capabilities, newest first",
        description="Each version's number, sha256, contract summary, when and by whom it was made, and whether it "
        "is served, staged or was refused. Only the capability's own agent may list them (any of its tokens); "
        "`POST …/rollback` restores one.",
        parameters=[OpenApiParameter("limit", int), OpenApiParameter("offset", int)],
        responses={200: VersionSerializer(many=True), **error_responses(*AUTHENTICATED, 404)},
    )
    def get(self, request, full: str):
        capability = selectors.capability_get_owned(principal=request.user, full=full)
        paginator = CapabilityPagination()
        page = paginator.paginate_queryset(selectors.capability_versions(capability=capability), request, view=self)
        records = selectors.versions_describe(capability=capability, versions=list(page))
        return paginator.get_paginated_response(VersionSerializer(records, many=True).data)


class CapabilityRollbackApi(APIView):
    """POST /_api/capabilities/{full}/rollback: serve an earlier version's code and contract again."""

    permission_classes = [HasDeployScope]
    parser_classes = [LimitedJSONParser]

    @extend_schema_serializer(component_name="Rollback")
    class InputSerializer(serializers.Serializer):
        version = StrictIntegerField(min_value=1, help_text="The version to restore, as GET …/versions lists it")

    @extend_schema(
        operation_id="rollbackCapability",
        tags=["Deploy"],
        summary="Roll one of your capabilities back to an earlier version",
        description="Its code and its contract are restored together, as a new version numbered after the latest "
        "(`restores` in the version list names the old one). Needs a deploy token; counts as a deploy for the "
        "agent's cool-down (429 cooldown); audited as `capability.rolled_back`. Rolling back to what is served "
        "changes nothing (200, same version). A version that was refused, superseded or is still placing is a "
        "400; the staged version a 409 (promote it instead). Answers as a deploy does, `202` while it is still "
        "being placed.",
        request=InputSerializer,
        responses={
            200: CapabilityDeployApi.OutputSerializer,
            202: CapabilityDeployApi.PendingSerializer,
            **error_responses(*AUTHENTICATED, 404, 409, 413, 415, 502, 503, 504),
        },
        examples=[OpenApiExample("Back to version 1", request_only=True, value={"version": 1})],
    )
    def post(self, request, full: str):
        reject_unknown_fields(request.data, self.InputSerializer())
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        result = services.capability_rollback_by_agent(
            principal=request.user, full=full, version_number=serializer.validated_data["version"]
        )
        if result.pending:
            return Response(CapabilityDeployApi.PendingSerializer(deploy_answer(request, result)).data, status=202)
        return Response(deploy_answer(request, result))


class AgentA2aApi(APIView):
    """GET/PUT /_api/agent/a2a: where the calling agent receives its alerts as A2A messages."""

    @extend_schema_serializer(component_name="AgentA2aChange")
    class InputSerializer(serializers.Serializer):
        agent_card_url = serializers.CharField(
            allow_blank=True, max_length=500, help_text="The agent's A2A Agent Card URL; empty stops the messages."
        )

    @extend_schema_serializer(component_name="AgentA2a")
    class OutputSerializer(serializers.Serializer):
        agent = serializers.CharField()
        agent_card_url = serializers.CharField(allow_blank=True)

    def get_permissions(self):
        return [HasDeployScope()] if self.request.method == "PUT" else super().get_permissions()

    @extend_schema(
        operation_id="agentA2a",
        tags=["Deploy"],
        summary="Where this agent's alerts go as A2A messages",
        responses={200: OutputSerializer, **error_responses(*AUTHENTICATED)},
    )
    def get(self, request):
        agent = Agent.objects.get(pk=request.user.agent_id)
        return Response(self.OutputSerializer({"agent": agent.name, "agent_card_url": agent.a2a_card_url}).data)

    @extend_schema(
        operation_id="setAgentA2a",
        tags=["Deploy"],
        summary="Receive this agent's alerts as A2A messages",
        description="Its alerts (error spike, degraded, split aborted, inactive) are then also sent to the "
        "agent behind this Agent Card, as A2A messages. A public http(s) URL only, as for callbacks. "
        "Needs a deploy token.",
        request=InputSerializer,
        responses={200: OutputSerializer, **error_responses(*AUTHENTICATED)},
    )
    def put(self, request):
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        agent = Agent.objects.get(pk=request.user.agent_id)
        agent_services.agent_set_a2a(
            agent=agent, url=serializer.validated_data["agent_card_url"], actor=f"agent:{agent.name}"
        )
        return Response(self.OutputSerializer({"agent": agent.name, "agent_card_url": agent.a2a_card_url}).data)


class StatusApi(APIView):
    @extend_schema(
        operation_id="runtimeStatus",
        tags=["Operate"],
        summary="The runtime and its slots",
        responses={
            200: inline_serializer(
                "RuntimeStatus",
                {
                    "backend": serializers.CharField(),
                    "total_slots": serializers.IntegerField(allow_null=True),
                    "used_slots": serializers.IntegerField(),
                    "paging_out": serializers.IntegerField(),
                    "agents": serializers.IntegerField(),
                    "lru_enabled": serializers.BooleanField(),
                    "eviction_count": serializers.IntegerField(),
                },
            ),
            **error_responses(*AUTHENTICATED),
        },
    )
    def get(self, request):
        return Response(selectors.backend_status())


# What a 202 for a deploy still being placed suggests waiting before polling its status.
DEPLOY_ETA_SECONDS = 5


class CapabilityWarmingStatusApi(APIView):
    """GET /_status/{full}: whether a capability being paged in, or deployed, is ready."""

    @extend_schema(
        operation_id="warmingStatus",
        tags=["Discover"],
        summary="Whether a capability being paged in is ready",
        description="The URL a `202` answer to a call with `Prefer: respond-async` points to.",
        responses={
            200: inline_serializer(
                "WarmingStatus",
                {
                    "status": serializers.ChoiceField(["ready", "warming", "deploying", "failed"]),
                    "capability": serializers.CharField(),
                    "deploy": DEPLOY_STATE,
                },
            ),
            **error_responses(*AUTHENTICATED, 404),
        },
    )
    def get(self, request, full: str):
        """`deploying` while its latest deploy is being placed, `failed` when that deploy
        failed and no version of it is served; else `ready` or `warming` (being paged in).
        `deploy` (its owner's only) says which version and why it failed."""
        capability = selectors.capability_get_visible(principal=request.user, full=full)
        deploy = selectors.capability_deploy_state(capability)
        if deploy and deploy["status"] == "placing":
            status = "deploying"
        elif capability.state == State.FAILED:
            status = "failed"
        else:
            status = "ready" if capability.state in (State.LIVE, State.EVICTING) else "warming"
        own = capability.agent_id == request.user.agent_id
        return Response({"status": status, "capability": capability.full_name, "deploy": deploy if own else None})


# What a pending call's 202 suggests waiting before polling again (its Retry-After too).
CALL_POLL_SECONDS = 1


def call_accepted_body(call_id: str, *, capability: str, status: str) -> dict:
    """The 202 of a call not yet run, in the one 202 shape (AcceptedSerializer)."""
    url = f"/_api/calls/{call_id}"
    return CallAcceptedSerializer(
        {
            "status": status,
            "callback": url,
            "eta_seconds": CALL_POLL_SECONDS,
            "call": call_id,
            "capability": capability,
            "status_url": url,
        }
    ).data


class CallStatusApi(APIView):
    """GET /_api/calls/{id}: an asynchronous call, pending (202) or, once it has run, its own
    answer: the status, headers and body the capability (or the gateway) gave it."""

    @extend_schema(
        operation_id="asyncCallResult",
        tags=["Call"],
        summary="The result of an asynchronous call",
        responses={
            (200, "*/*"): OpenApiResponse(description="The call has run: its own status, headers and body"),
            202: CallAcceptedSerializer,
            **error_responses(*AUTHENTICATED, 404),
        },
    )
    def get(self, request, call_id: str):
        call = async_calls.async_call_get(principal=request.user, call_id=call_id)
        if call.result is None:
            body = call_accepted_body(call.call_id, capability=call.capability, status=call.state)
            pending = Response(body, status=202)
            pending["Retry-After"] = str(CALL_POLL_SECONDS)
            return pending
        answer = HttpResponse(call.result.body, status=call.result.status)
        for name, value in call.result.headers:
            answer[name] = value
        answer["X-Sigil-Call"] = call.call_id
        if call.result.truncated:
            answer["X-Sigil-Result-Truncated"] = "true"
        return answer


class CostApi(APIView):
    """GET /_api/cost?days=N: the owner's monthly cost estimate per runtime (capabilities/cost.py)."""

    authentication_classes = [OwnerTokenAuthentication, StaffSessionAuthentication, BearerTokenAuthentication]
    permission_classes = [IsOwner]

    @extend_schema(
        operation_id="costEstimate",
        tags=["Operate"],
        summary="What the recorded traffic would cost on each runtime, a month",
        parameters=[OpenApiParameter("days", float, description="the window, in days (default 30)")],
        responses={
            200: OpenApiResponse(description="The estimate: usage, a bill per runtime, the pool's figures, the prices"),
            **error_responses(*AUTHENTICATED),
        },
    )
    def get(self, request):
        days = _days(request.query_params.get("days"))
        return Response(cost.cost_estimate(now=timezone.now(), days=days).as_json())


def _days(raw: str | None) -> float:
    if raw is None:
        return cost.DAYS_PER_MONTH
    try:
        days = float(raw)
    except ValueError as exc:
        raise InvalidRequest("days must be a number") from exc
    if not 0 < days <= settings.SIGIL_STATS_RETENTION_DAYS:
        raise InvalidRequest(f"days must be over 0 and at most {settings.SIGIL_STATS_RETENTION_DAYS}")
    return days


HEALTH = inline_serializer(
    "Health",
    {
        "status": serializers.ChoiceField(["ok", "failing"]),
        "backend": serializers.CharField(),
        "capabilities": serializers.IntegerField(allow_null=True),
        "agents": serializers.IntegerField(allow_null=True),
        "checks": serializers.DictField(child=serializers.CharField()),
        "left_on_previous_runtimes": serializers.DictField(child=serializers.IntegerField(), required=False),
        "warnings": serializers.ListField(child=serializers.CharField(), required=False),
    },
)


class HealthApi(APIView):
    authentication_classes = []
    permission_classes = [AllowAny]

    @extend_schema(
        operation_id="health",
        tags=["Operate"],
        summary="Health check",
        description="No token. 200 when the database, Redis and the runtime answer; 503 naming what fails, "
        "also when capabilities are still placed on a runtime used before SIGIL_BACKEND changed that no longer "
        "answers (`left_on_previous_runtimes` counts them per runtime while any are left).",
        responses={200: HEALTH, 503: HEALTH, **error_responses(405, 406)},
    )
    def get(self, request):
        checks = {"database": "ok", "redis": "ok", "runtime": "ok"}
        counts = {"capabilities": None, "agents": None}
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
            counts = {
                "capabilities": Capability.objects.exclude(state=State.REMOVED).filter(variant_of__isnull=True).count(),
                "agents": Agent.objects.count(),
            }
        except Exception as exc:
            checks["database"] = f"failing: {exc.__class__.__name__}"
        try:
            get_redis().ping()
        except Exception as exc:
            checks["redis"] = f"failing: {exc.__class__.__name__}"
        try:
            get_runtime().check()
        except RuntimeUnavailable as exc:
            checks["runtime"] = f"failing: {exc}"
        left_behind = []
        if checks["database"] == "ok":
            left_behind = services.runtimes_left_behind()
            gone = [left.describe() for left in left_behind if left.failure]
            checks["previous_runtimes"] = "failing: " + "; ".join(gone) if gone else "ok"
        healthy = all(value == "ok" for value in checks.values())
        body = {"status": "ok" if healthy else "failing", "backend": settings.SIGIL_BACKEND, **counts, "checks": checks}
        try:
            # Worth the owner's attention, but Sigil still serves: not a failing check.
            warning = services.runtime_account_warning()
        except RedisError:  # reported above, as the redis check
            warning = None
        warnings = [warning] if warning else []
        # Still served where they are: the owner has a switch to finish, not an outage.
        warnings += [left.describe() for left in left_behind if not left.failure]
        if warnings:
            body["warnings"] = warnings
        if left_behind:
            body["left_on_previous_runtimes"] = {left.backend: left.capabilities for left in left_behind}
        return Response(body, status=200 if healthy else 503)


def index_view(request):
    """GET /: a browser goes to the owner's console; any other client gets a small JSON index
    of where things are (the banner's first URL, so it must answer something useful)."""
    if request.method not in ("GET", "HEAD"):
        return method_not_allowed("/")
    if "text/html" in request.headers.get("Accept", ""):
        return HttpResponseRedirect("/admin/")
    base = settings.SIGIL_PUBLIC_URL.rstrip("/") or request.build_absolute_uri("/").rstrip("/")
    index = {
        "service": "sigil",
        "calls": f"{base}/{{agent}}/{{capability}}",
        "schema": f"{base}/_api/schema",
        "docs": f"{base}/_api/schema/docs",
        "mcp": f"{base}/_mcp",
        "llms_txt": f"{base}/llms.txt",
        "health": f"{base}/_health",
        "admin": f"{base}/admin/",
    }
    return JsonResponse(index, json_dumps_params={"indent": 2})


# Exempt from Django's CSRF check, whose refusal is an HTML page outside the envelope: neither
# reads a cookie, so a forged request gains nothing, and any other method is refused below.
@csrf_exempt
def llms_txt_view(request):
    """GET /llms.txt: a short guide for agents (the llms.txt convention), in plain text."""
    if request.method not in ("GET", "HEAD"):
        return method_not_allowed("/llms.txt")
    base = settings.SIGIL_PUBLIC_URL.rstrip("/") or request.build_absolute_uri("/").rstrip("/")
    cooldown = settings.SIGIL_DEPLOY_COOLDOWN_SECONDS
    context = {
        "base": base,
        # One field a line, indented as the guide's code block.
        "add_deploy": "{" + ",\n     ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in ADD_DEPLOY.items()) + "}",
        "cooldown": f"{cooldown:g}" if cooldown > 0 else None,
        "inactive_days": settings.SIGIL_INACTIVE_AFTER_DAYS,
    }
    text = render_to_string("llms.txt", context)
    return HttpResponse(text, content_type="text/plain; charset=utf-8")


@csrf_exempt
def metrics_view(request):
    """Prometheus scrape endpoint, behind SIGIL_METRICS_TOKEN (off while it is empty); wrong
    tokens count against the caller's address as agents' tokens do (agents.throttle)."""
    if request.method not in ("GET", "HEAD"):
        return method_not_allowed("/metrics")
    expected = settings.SIGIL_METRICS_TOKEN
    if not expected:
        return error_response(NotFound("metrics are off: set SIGIL_METRICS_TOKEN to turn them on"))
    throttle = FailedAuthThrottle.from_settings()
    given = request.META.get("HTTP_AUTHORIZATION", "")
    address = throttle.address(request.META)
    try:
        throttle.verify_shared_secret(
            get_redis(),
            address,
            given,
            f"Bearer {expected}",
            refusal="send Authorization: Bearer <SIGIL_METRICS_TOKEN>",
        )
    except (RateLimited, Unauthenticated) as exc:
        return error_response(exc)
    return HttpResponse(metrics_render(), content_type="text/plain; version=0.0.4; charset=utf-8")


def method_not_allowed(path: str) -> HttpResponse:
    response = error_response(MethodNotAllowed(f"{path} answers GET"))
    response["Allow"] = "GET, HEAD"
    return response
