"""The control API of API.md: thin views that translate JSON, call one service, translate back."""

from __future__ import annotations

import hmac
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    inline_serializer,
)
from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.models import Agent
from agents.permissions import HasDeployScope
from capabilities import selectors, services
from capabilities.metrics import metrics_render
from capabilities.models import Capability, State
from capabilities.parsers import LimitedJSONParser
from capabilities.runtimes import get_runtime
from capabilities.runtimes.errors import RuntimeUnavailable
from sigil_site.errors import InvalidRequest, NotFound, Unauthenticated, error_response
from sigil_site.redis_client import get_redis


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


class ErrorSerializer(serializers.Serializer):
    """The contract's error envelope, for the schema: {"error": {"code": ..., "message": ...}}."""

    error = inline_serializer("ErrorDetail", {"code": serializers.CharField(), "message": serializers.CharField()})


# What each status means, as API.md's error table has it; every view documents the ones it
# can answer, so that a client (and the schema fuzz test) knows every status to expect.
ERROR_STATUSES = {
    400: "invalid_request: malformed JSON, a field of the wrong type, a name that breaks a rule",
    401: "unauthenticated: no token, or an unknown, revoked or expired one (with WWW-Authenticate)",
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


def error_responses(*statuses: int) -> dict[int, OpenApiResponse]:
    return {status: OpenApiResponse(ErrorSerializer, description=ERROR_STATUSES[status]) for status in statuses}


def capability_url(request, capability: Capability) -> str:
    base = settings.SIGIL_PUBLIC_URL.rstrip("/") or request.build_absolute_uri("/").rstrip("/")
    return f"{base}/{capability.agent.name}/{capability.name}"


class CapabilitySerializer(serializers.ModelSerializer):
    """A capability as agents see it; the code only for its owner."""

    capability = serializers.CharField(source="full_name")
    agent = serializers.CharField(source="agent.name")
    version = serializers.IntegerField(source="current_version.number", allow_null=True)
    sha256 = serializers.CharField(source="current_version.sha", allow_null=True)
    public = serializers.BooleanField(source="is_public")
    url = serializers.SerializerMethodField()
    breaker = serializers.CharField(source="breaker_state")
    stats = serializers.SerializerMethodField()

    class Meta:
        model = Capability
        fields = [
            "capability",
            "agent",
            "name",
            "type",
            "public",
            "state",
            "version",
            "sha256",
            "bindings",
            "url",
            "created_at",
            "updated_at",
            "expires_at",
            "last_access_at",
            "breaker",
            "stats",
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
    deploy = serializers.SerializerMethodField()

    class Meta(CapabilitySerializer.Meta):
        fields = [*CapabilitySerializer.Meta.fields, "recent", "deploy", "code"]

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


class CapabilityDeployApi(APIView):
    permission_classes = [HasDeployScope]
    parser_classes = [LimitedJSONParser]

    class InputSerializer(serializers.Serializer):
        agent = StrictCharField(required=False, allow_null=True)
        name = StrictCharField(required=False, allow_null=True)
        code = StrictCharField()
        type = serializers.ChoiceField(choices=["persistent", "normal", "ephemeral"], required=False, allow_null=True)
        ttl = StrictIntegerField(required=False, allow_null=True)
        bindings = serializers.ListField(child=StrictCharField(), required=False, default=list)
        public = StrictBooleanField(required=False, default=False)

    class OutputSerializer(serializers.Serializer):
        capability = serializers.CharField()
        url = serializers.CharField()
        version = serializers.IntegerField()
        expires_at = serializers.DateTimeField(allow_null=True)
        cold_start = serializers.BooleanField()
        evicted = serializers.CharField(allow_null=True)

    class PendingSerializer(serializers.Serializer):
        """202: the version is recorded and still being placed; poll `callback`."""

        capability = serializers.CharField()
        url = serializers.CharField()
        version = serializers.IntegerField()
        expires_at = serializers.DateTimeField(allow_null=True)
        status = serializers.ChoiceField(["deploying"])
        callback = serializers.CharField()
        eta_seconds = serializers.IntegerField()

    @extend_schema(
        request=InputSerializer,
        responses={
            200: OutputSerializer,
            201: OutputSerializer,
            202: PendingSerializer,
            **error_responses(*AUTHENTICATED, 404, 409, 413, 415, 502, 503, 504),
        },
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
            is_public=data["public"],
        )
        body = {
            "capability": result.capability.full_name,
            "url": capability_url(request, result.capability),
            "version": result.version.number,
            "expires_at": result.capability.expires_at,
        }
        if result.pending:
            # As a cold call with respond-async: the status URL says when it is placed.
            pending = {**body, "status": "deploying", "callback": f"/_status/{result.capability.full_name}"}
            pending["eta_seconds"] = DEPLOY_ETA_SECONDS
            return Response(self.PendingSerializer(pending).data, status=202)
        body.update(cold_start=result.cold_start, evicted=result.evicted)
        return Response(self.OutputSerializer(body).data, status=201 if result.created else 200)


class CapabilityPagination(LimitOffsetPagination):
    default_limit = 50
    max_limit = 200


class CapabilityListApi(APIView):
    pagination_class = CapabilityPagination  # so that the schema shows the page's shape

    @extend_schema(
        parameters=[
            OpenApiParameter("type", str, enum=["persistent", "normal", "ephemeral"]),
            OpenApiParameter("state", str, enum=State.values),
            OpenApiParameter("agent", str),
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
        )
        paginator = CapabilityPagination()
        page = paginator.paginate_queryset(query, request, view=self)
        return paginator.get_paginated_response(
            CapabilitySerializer(page, many=True, context={"request": request}).data
        )


class CapabilityDetailApi(APIView):
    def get_permissions(self):
        return [HasDeployScope()] if self.request.method == "DELETE" else super().get_permissions()

    @extend_schema(responses={200: CapabilityDetailSerializer, **error_responses(*AUTHENTICATED, 404)})
    def get(self, request, full: str):
        capability = selectors.capability_get_visible(principal=request.user, full=full)
        return Response(CapabilityDetailSerializer(capability, context={"request": request}).data)

    @extend_schema(responses={204: None, **error_responses(*AUTHENTICATED, 404)})
    def delete(self, request, full: str):
        services.capability_remove(principal=request.user, full=full)
        return Response(status=204)


class StatusApi(APIView):
    @extend_schema(
        responses={
            200: inline_serializer(
                "Status",
                {
                    "backend": serializers.CharField(),
                    "total_slots": serializers.IntegerField(allow_null=True),
                    "used_slots": serializers.IntegerField(),
                    "agents": serializers.IntegerField(),
                    "lru_enabled": serializers.BooleanField(),
                    "eviction_count": serializers.IntegerField(),
                },
            ),
            **error_responses(*AUTHENTICATED),
        }
    )
    def get(self, request):
        return Response(selectors.backend_status())


# What a 202 for a deploy still being placed suggests waiting before polling its status.
DEPLOY_ETA_SECONDS = 5


class CapabilityWarmingStatusApi(APIView):
    """GET /_status/{full}: whether a capability being paged in, or deployed, is ready."""

    @extend_schema(
        responses={
            200: inline_serializer(
                "Warming",
                {
                    "status": serializers.ChoiceField(["ready", "warming", "deploying", "failed"]),
                    "capability": serializers.CharField(),
                    "deploy": DEPLOY_STATE,
                },
            ),
            **error_responses(*AUTHENTICATED, 404),
        }
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


HEALTH = inline_serializer(
    "Health",
    {
        "status": serializers.ChoiceField(["ok", "failing"]),
        "backend": serializers.CharField(),
        "capabilities": serializers.IntegerField(allow_null=True),
        "agents": serializers.IntegerField(allow_null=True),
        "checks": serializers.DictField(child=serializers.CharField()),
    },
)


class HealthApi(APIView):
    authentication_classes = []
    permission_classes = [AllowAny]

    @extend_schema(responses={200: HEALTH, 503: HEALTH, **error_responses(405, 406)})
    def get(self, request):
        checks = {"database": "ok", "redis": "ok", "runtime": "ok"}
        counts = {"capabilities": None, "agents": None}
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
            counts = {
                "capabilities": Capability.objects.exclude(state=State.REMOVED).count(),
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
        healthy = all(value == "ok" for value in checks.values())
        body = {"status": "ok" if healthy else "failing", "backend": settings.SIGIL_BACKEND, **counts, "checks": checks}
        return Response(body, status=200 if healthy else 503)


def metrics_view(request):
    """Prometheus scrape endpoint, behind SIGIL_METRICS_TOKEN (off while it is empty)."""
    expected = settings.SIGIL_METRICS_TOKEN
    if not expected:
        return error_response(NotFound("metrics are off: set SIGIL_METRICS_TOKEN to turn them on"))
    given = request.META.get("HTTP_AUTHORIZATION", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {expected}".encode()):
        return error_response(Unauthenticated("send Authorization: Bearer <SIGIL_METRICS_TOKEN>"))
    return HttpResponse(metrics_render(), content_type="text/plain; version=0.0.4; charset=utf-8")
