"""The shapes of the control API's answers (and of the parts of its requests that several
views share): what a capability, its calls' records, its split and its versions look like."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.utils import timezone
from drf_spectacular.utils import extend_schema_field, extend_schema_serializer, inline_serializer
from rest_framework import serializers

from capabilities import contracts, selectors
from capabilities.books import breaker, call_logs, failures
from capabilities.models import Capability
from capabilities.visibility import capability_own


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


def capability_url(request, capability: Capability) -> str:
    """Where agents call `capability`: at the edge while it is on, else on this server."""
    site = settings.SIGIL_PUBLIC_URL.rstrip("/") or request.build_absolute_uri("/").rstrip("/")
    return f"{selectors.capability_call_base(site_url=site)}/{capability.agent.name}/{capability.name}"


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


class OwnerField(serializers.SerializerMethodField):
    """A field only the capability's own agent reads (capabilities.visibility): null for
    every other caller, whose request never runs its method."""

    def to_representation(self, value):
        if not capability_own(value, self.context["request"].user):
            return None
        return super().to_representation(value)


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
    stats = OwnerField()
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
        """Totals since the capability was created, for the owner only: the calls its code
        ran, their errors, and the calls Sigil refused without running it (`refused`), with
        every answer that carried an error code counted by code (`codes`: `degraded`,
        `rate_limited`, `capability_error`, ...), as the owner's dashboard counts them."""
        calls = obj.calls_total
        return {
            "calls": calls,
            "errors": obj.errors_total,
            "refused": obj.refused_total,
            "codes": obj.codes_total,
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
    code = OwnerField()
    recent = OwnerField()
    failures = OwnerField()
    split = OwnerField()
    breaker_detail = OwnerField()
    deploy = OwnerField()

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
        return [failure.as_dict() for failure in failures.failures_list(full=obj.full_name)]

    def get_breaker_detail(self, obj) -> dict | None:
        """Why the breaker is where it is (forced by whom, or tripped by which failures' request
        ids) and until when, for the owner only."""
        return breaker.breaker_describe(full=obj.full_name).as_dict()

    def get_split(self, obj) -> dict | None:
        """The traffic split running, its versions side by side, for the owner only."""
        return split_body(obj)

    @extend_schema_field(DEPLOY_STATE)
    def get_deploy(self, obj) -> dict | None:
        """The owner's latest deploy while it is not the version served: being placed (on the
        Cloudflare runtimes, by a Celery task), failed with its error, or superseded."""
        return selectors.capability_deploy_state(obj)

    def get_recent(self, obj) -> dict | None:
        """The last 24 hours' calls, errors and latency percentiles, for the owner only."""
        return selectors.capability_stats(capability=obj, since=timezone.now() - timedelta(hours=24))

    def get_code(self, obj) -> str | None:
        """Its code, for the owner only."""
        return obj.current_version.code if obj.current_version else None


# A deploy with its contract: the example of the schema, /llms.txt and the README.


class AcceptedSerializer(serializers.Serializer):
    """Every 202 Sigil answers, a deploy still being placed or a call not yet run: the seeds'
    `status`, `callback` (the URL to poll) and `eta_seconds` (how long to wait before polling),
    plus what each kind adds."""

    status = serializers.CharField(help_text="What is under way: deploying, accepted or running")
    callback = serializers.CharField(help_text="Where to GET the outcome, relative to this server")
    eta_seconds = serializers.IntegerField(help_text="Seconds to wait before polling callback")


@extend_schema_serializer(component_name="CallAccepted")
class CallAcceptedSerializer(AcceptedSerializer):
    """202 for an asynchronous call not yet run: as the engine answers `Prefer: respond-async`,
    and as its status URL answers until the call has run."""

    status = serializers.ChoiceField(["accepted", "running"])
    call = serializers.CharField(help_text="The call's id")
    capability = serializers.CharField(help_text="The capability called, agent--name")
    status_url = serializers.CharField(help_text="The same as callback")


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
    wall_ms = serializers.FloatField(
        allow_null=True, help_text="The call's wall time in ms, from its start until it was over."
    )
    cpu_ms = serializers.FloatField(
        allow_null=True,
        help_text="The CPU time its code used, in ms; null: not given by this runtime (the local runtime's workerd).",
    )
    cold = serializers.BooleanField(help_text="The first call its isolate served.")
    version = serializers.IntegerField(allow_null=True)
    logs = CallLogLineSerializer(many=True)
    lines_cut = serializers.IntegerField(help_text="Lines past SIGIL_LOGS_LINES_PER_CALL, not kept.")
    lines_shortened = serializers.IntegerField(help_text="Lines cut at SIGIL_LOGS_LINE_BYTES.")
    exception = CallExceptionSerializer(allow_null=True, help_text="The uncaught exception, with its stack.")
    runtime_truncated = serializers.BooleanField(help_text="The runtime itself dropped some of the call's events.")


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
