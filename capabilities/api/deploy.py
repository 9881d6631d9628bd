"""The control API's writes (the Deploy group): deploy, traffic splits, versions and
rollback, where an agent's alerts go. Thin views: they check the shape, call one service and
translate its answer."""

from __future__ import annotations

from drf_spectacular.utils import (
    OpenApiExample,
    extend_schema,
    extend_schema_serializer,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from agents import services as agent_services
from agents.models import Agent
from agents.permissions import HasDeployScope
from capabilities import contracts, selectors, services
from capabilities.api.pages import PAGE_PARAMETERS, PagedApi
from capabilities.api.schema import AUTHENTICATED, DEPLOY_EXAMPLES, DEPLOYING, NOT_FOUND, error_responses, operation
from capabilities.api.serializers import (
    AcceptedSerializer,
    CapabilityDetailSerializer,
    ContractFields,
    SplitSerializer,
    StrictBooleanField,
    StrictCharField,
    StrictIntegerField,
    VersionSerializer,
    capability_url,
    split_body,
)
from capabilities.parsers import LimitedJSONParser
from sigil.errors import Conflict, InvalidRequest, NotFound, Timeout, TooLarge, UnsupportedMediaType, UpstreamError

# What a 202 for a deploy still being placed suggests waiting before polling its status.
DEPLOY_ETA_SECONDS = 5


def reject_unknown_fields(data, serializer: serializers.Serializer) -> None:
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    unknown = set(data) - set(serializer.fields)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(sorted(unknown))}")


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
            **error_responses(*DEPLOYING),
        },
        examples=DEPLOY_EXAMPLES,
    )
    def post(self, request):
        reject_unknown_fields(request.data, self.InputSerializer())
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
        responses={200: SplitSerializer, **error_responses(*NOT_FOUND)},
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
        responses={
            200: SplitSerializer,
            **error_responses(*NOT_FOUND, Conflict, TooLarge, UnsupportedMediaType, UpstreamError, Timeout),
        },
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
    end = staticmethod(services.capability_promote)  # split_end_api gives each way its own

    def post(self, request, full: str):
        capability = selectors.capability_get_owned(principal=request.user, full=full)
        self.end(capability=capability, actor=f"agent:{request.user.agent_name}")
        capability = selectors.capability_get_owned(principal=request.user, full=full)
        return Response(CapabilityDetailSerializer(capability, context={"request": request}).data)


SPLIT_END_RESPONSES = {
    200: CapabilityDetailSerializer,
    **error_responses(*NOT_FOUND, Conflict, TooLarge, UpstreamError, Timeout),
}


def split_end_api(name: str, end, *, operation_id: str, summary: str) -> type[CapabilitySplitEndApi]:
    """The view of one way to end a split, documented as its own operation."""
    view = type(name, (CapabilitySplitEndApi,), {"end": staticmethod(end), "__doc__": CapabilitySplitEndApi.__doc__})
    schema = extend_schema(
        operation_id=operation_id, tags=["Deploy"], summary=summary, request=None, responses=SPLIT_END_RESPONSES
    )
    return extend_schema_view(post=schema)(view)


CapabilityPromoteApi = split_end_api(
    "CapabilityPromoteApi",
    services.capability_promote,
    operation_id="promoteSplit",
    summary="End the traffic split by making the staged version current",
)
CapabilitySplitAbortApi = split_end_api(
    "CapabilitySplitAbortApi",
    services.capability_split_abort,
    operation_id="abortSplit",
    summary="End the traffic split by sending every call to the current version again",
)


class CapabilityVersionsApi(PagedApi):
    """GET /_api/capabilities/{full}/versions: the owner's history of a capability."""

    @extend_schema(
        operation_id="listVersions",
        tags=["Deploy"],
        summary="The versions of one of your capabilities, newest first",
        description="Each version's number, sha256, contract summary, when and by whom it was made, and whether it "
        "is served, staged or was refused. Only the capability's own agent may list them (any of its tokens); "
        "`POST …/rollback` restores one.",
        parameters=PAGE_PARAMETERS,
        responses={200: VersionSerializer(many=True), **error_responses(*NOT_FOUND)},
    )
    def get(self, request, full: str):
        capability = selectors.capability_get_owned(principal=request.user, full=full)
        return self.answer_page(
            selectors.capability_versions(capability=capability),
            lambda page: VersionSerializer(
                selectors.versions_describe(capability=capability, versions=page), many=True
            ).data,
        )


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
            **error_responses(*DEPLOYING),
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

    @operation(
        "agentA2a", "Deploy", "Where this agent's alerts go as A2A messages", {200: OutputSerializer}, AUTHENTICATED
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


class AgentWebhookApi(APIView):
    """GET /_api/agent/webhook: where the calling agent's alerts are posted, and the key that
    signs them and its calls' callbacks."""

    permission_classes = [HasDeployScope]

    @extend_schema_serializer(component_name="AgentWebhook")
    class OutputSerializer(serializers.Serializer):
        agent = serializers.CharField()
        webhook_url = serializers.CharField(
            allow_blank=True, help_text="Where the owner has the agent's alerts posted; empty: none."
        )
        webhook_secret = serializers.CharField(
            help_text="The HMAC-SHA256 key of the X-Sigil-Signature header of every alert and callback "
            "(created when the agent had none)."
        )

    @operation(
        "agentWebhook",
        "Deploy",
        "The key that signs this agent's alerts and callbacks",
        {200: OutputSerializer},
        AUTHENTICATED,
    )
    def get(self, request):
        """Every alert and every asynchronous call's callback carries `X-Sigil-Signature: sha256=<hex>`,
        the HMAC-SHA256 of its body under this key; a receiver checks it before trusting the body.
        The key is created on first need when the owner has set none. Needs a deploy token."""
        agent = Agent.objects.get(pk=request.user.agent_id)
        secret = agent_services.agent_webhook_secret(agent=agent)
        data = {"agent": agent.name, "webhook_url": agent.webhook_url, "webhook_secret": secret}
        return Response(self.OutputSerializer(data).data, headers={"Cache-Control": "no-store"})
