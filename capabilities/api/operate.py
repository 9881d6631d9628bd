"""The control API's operations (the Operate group) and Sigil's plain paths: the runtime's
status, the cost estimate, the health check, `/`, /llms.txt and /metrics."""

from __future__ import annotations

import json

from django.conf import settings
from django.db import connection
from django.http import HttpResponse, HttpResponseRedirect, JsonResponse
from django.template.loader import render_to_string
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from redis import RedisError
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.authentication import BearerTokenAuthentication, OwnerTokenAuthentication, StaffSessionAuthentication
from agents.models import Agent
from agents.permissions import IsOwner
from agents.throttle import FailedAuthThrottle
from capabilities import cost, selectors, services
from capabilities.api.schema import ADD_DEPLOY, AUTHENTICATED, error_responses
from capabilities.metrics import metrics_render
from capabilities.models import Capability, State
from capabilities.runtimes import get_runtime, runtime_class
from capabilities.runtimes.errors import RuntimeUnavailable
from sigil import errors
from sigil.redis_client import get_redis


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
        raise errors.InvalidRequest("days must be a number") from exc
    if not 0 < days <= settings.SIGIL_STATS_RETENTION_DAYS:
        raise errors.InvalidRequest(f"days must be over 0 and at most {settings.SIGIL_STATS_RETENTION_DAYS}")
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
        responses={200: HEALTH, 503: HEALTH, **error_responses(errors.MethodNotAllowed, errors.NotAcceptable)},
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
            # Worth the owner's attention, but Sigil still serves: not failing checks.
            warnings = [w for w in (services.runtime_account_warning(), services.edge_warning()) if w]
        except RedisError:  # reported above, as the redis check
            warnings = []
        warnings += runtime_class(settings.SIGIL_BACKEND).settings_warnings(settings)
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
        "calls": f"{selectors.capability_call_base(site_url=base)}/{{agent}}/{{capability}}",
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
        return errors.error_response(errors.NotFound("metrics are off: set SIGIL_METRICS_TOKEN to turn them on"))
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
    except (errors.RateLimited, errors.Unauthenticated) as exc:
        return errors.error_response(exc)
    body, content_type = metrics_render(accept=request.META.get("HTTP_ACCEPT", ""))
    return HttpResponse(body, content_type=content_type)


def method_not_allowed(path: str) -> HttpResponse:
    response = errors.error_response(errors.MethodNotAllowed(f"{path} answers GET"))
    response["Allow"] = "GET, HEAD"
    return response
