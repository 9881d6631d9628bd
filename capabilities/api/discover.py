"""The control API's reads (the Discover and Call groups): the catalogue, one capability,
its calls' records (also as they arrive), whether it is ready, an asynchronous call's result."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_serializer,
    inline_serializer,
)
from rest_framework import serializers
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.permissions import HasDeployScope
from capabilities import selectors, services
from capabilities.api.pages import PAGE_PARAMETERS, PagedApi
from capabilities.api.schema import AUTHENTICATED, NOT_FOUND, error_responses, operation
from capabilities.api.serializers import (
    DEPLOY_STATE,
    CallAcceptedSerializer,
    CallRecordSerializer,
    CapabilityDetailSerializer,
    CapabilitySerializer,
)
from capabilities.books import call_logs
from capabilities.models import State
from capabilities.services import async_calls
from capabilities.visibility import capability_own


class CapabilityListApi(PagedApi):
    @operation(
        "listCapabilities",
        "Discover",
        "List the capabilities this agent may call",
        {200: CapabilitySerializer(many=True)},
        AUTHENTICATED,
        parameters=[
            OpenApiParameter("type", str, enum=["persistent", "normal", "ephemeral"]),
            OpenApiParameter("state", str, enum=State.values),
            OpenApiParameter("agent", str),
            OpenApiParameter(
                "q",
                {"type": "string", "pattern": r"\S", "maxLength": selectors.SEARCH_MAX_CHARS},
                description="Words to look for in each capability's full name and description "
                "(case-insensitive; every word must appear).",
            ),
            *PAGE_PARAMETERS,
        ],
    )
    def get(self, request):
        """Its own and every public one, by full name, a page at a time."""
        query = selectors.capability_list_visible(
            principal=request.user,
            type=request.query_params.get("type"),
            state=request.query_params.get("state"),
            agent=request.query_params.get("agent"),
            q=request.query_params.get("q"),
        )
        return self.answer_page(
            query, lambda page: CapabilitySerializer(page, many=True, context={"request": request}).data
        )


class CapabilityDetailApi(APIView):
    def get_permissions(self):
        return [HasDeployScope()] if self.request.method == "DELETE" else super().get_permissions()

    @operation("inspectCapability", "Discover", "Inspect a capability", {200: CapabilityDetailSerializer}, NOT_FOUND)
    def get(self, request, full: str):
        """Its owner also sees its code, its totals (`stats`) and its last 24 hours (`recent`)."""
        capability = selectors.capability_get_visible(principal=request.user, full=full)
        return Response(CapabilityDetailSerializer(capability, context={"request": request}).data)

    @operation("removeCapability", "Deploy", "Remove a capability", {204: None}, NOT_FOUND)
    def delete(self, request, full: str):
        """It stops serving at once; its script is deleted in the background. Needs a deploy token."""
        services.capability_remove(principal=request.user, full=full)
        return Response(status=204)


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
        responses={200: OutputSerializer, **error_responses(*NOT_FOUND)},
    )
    def get(self, request, full: str):
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        page = selectors.capability_call_records(
            principal=request.user, full=full, query=call_logs.RecordQuery(**filters.validated_data)
        )
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
            **error_responses(*NOT_FOUND),
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
            **error_responses(*NOT_FOUND),
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
        own = capability_own(capability, request.user)
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
    answer: the status, headers and body the capability (or the engine) gave it."""

    @extend_schema(
        operation_id="asyncCallResult",
        tags=["Call"],
        summary="The result of an asynchronous call",
        responses={
            (200, "*/*"): OpenApiResponse(description="The call has run: its own status, headers and body"),
            202: CallAcceptedSerializer,
            **error_responses(*NOT_FOUND),
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
