"""The registry: capabilities and every version of their code."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db import models
from django.db.models import Q
from django.utils import timezone

from agents.models import Agent


class CapabilityType(models.TextChoices):
    PERSISTENT = "persistent", "persistent"
    NORMAL = "normal", "normal"
    EPHEMERAL = "ephemeral", "ephemeral"


class State(models.TextChoices):
    LIVE = "live", "live"  # placed on the runtime and served
    PAGED_OUT = "paged_out", "paged out"  # registered, not on the runtime; a call pages it in
    EVICTING = "evicting", "evicting"  # chosen as a victim; still served until deleted
    FAILED = "failed", "failed"  # the last placement failed for good
    REMOVED = "removed", "removed"  # removed by its agent, the owner or TTL expiry


class BreakerState(models.TextChoices):
    CLOSED = "closed", "closed"
    OPEN = "open", "open"


class Capability(models.Model):
    """A named Worker script owned by an agent. At most one non-removed row per full name."""

    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="capabilities")
    name = models.CharField(max_length=41)
    full_name = models.CharField(max_length=90, db_index=True)
    type = models.CharField(max_length=10, choices=CapabilityType.choices)
    is_public = models.BooleanField(default=False)
    bindings = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=10, choices=State.choices, default=State.PAGED_OUT, db_index=True)
    slot = models.CharField(max_length=80, blank=True, help_text="The runtime's name for the placement.")
    placed_sha = models.CharField(
        max_length=64,
        blank=True,
        help_text="The sha256 of the bundle the runtime holds: the code with its bindings' values, "
        "not the version's code sha.",
    )
    backend = models.CharField(
        max_length=20,
        blank=True,
        help_text="The runtime (SIGIL_BACKEND) the slot belongs to; empty for rows placed before it was recorded.",
    )
    cpu_ms = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="CPU limit per call in ms on the platform and loader runtimes; empty means SIGIL_CPU_MS.",
    )
    current_version = models.ForeignKey(
        "CapabilityVersion", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True, db_index=True)
    removed_at = models.DateTimeField(null=True, blank=True)
    # Flushed from Redis by the stats task; the hot path never writes these rows.
    last_access_at = models.DateTimeField(null=True, blank=True)
    calls_total = models.BigIntegerField(default=0)
    errors_total = models.BigIntegerField(default=0)
    latency_ms_total = models.FloatField(default=0.0)
    cold_calls_total = models.BigIntegerField(default=0)
    page_in_ms_total = models.FloatField(default=0.0)
    latency_buckets_total = models.JSONField(default=list, blank=True)
    refused_total = models.BigIntegerField(default=0, help_text="Answers Sigil gave without running the code.")
    statuses_total = models.JSONField(default=dict, blank=True, help_text="Every answer, by status class.")
    codes_total = models.JSONField(default=dict, blank=True, help_text="Every answer with an error code, by code.")
    breaker_state = models.CharField(max_length=8, choices=BreakerState.choices, default=BreakerState.CLOSED)
    breaker_opened_at = models.DateTimeField(null=True, blank=True)
    inactive_at = models.DateTimeField(
        null=True, blank=True, help_text="Set when a normal capability went uncalled for SIGIL_INACTIVE_AFTER_DAYS."
    )
    # A version deployed without being made current, and the share of calls sent to it.
    staged_version = models.ForeignKey(
        "CapabilityVersion", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    split_weight = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="Percent of callers sent to the staged version; empty when no split runs."
    )
    split_caller_header = models.CharField(
        max_length=100, blank=True, help_text="The header whose value keeps a caller on one version; empty: its token."
    )
    split_started_at = models.DateTimeField(null=True, blank=True)
    split_guard_margin = models.FloatField(
        null=True,
        blank=True,
        help_text="Abort the split when the staged version's error rate exceeds the current one's by this much.",
    )
    split_guard_min_calls = models.PositiveIntegerField(null=True, blank=True)
    # Set on the placement of a staged version in traffic ({full}--v{n}): a capability of its
    # own for the runtime, the pager, stats and the breaker, never listed to agents.
    variant_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.CASCADE, related_name="variants")
    cache_when_degraded = models.BooleanField(
        default=False,
        help_text="While its breaker is open, a GET answered before is answered from its last good response.",
    )

    class Meta:
        verbose_name_plural = "capabilities"
        ordering = ["full_name"]
        constraints = [
            models.UniqueConstraint(
                fields=["full_name"], condition=~Q(state="removed"), name="one_current_capability_per_name"
            )
        ]

    def __str__(self) -> str:
        return self.full_name

    @property
    def is_ephemeral(self) -> bool:
        return self.type == CapabilityType.EPHEMERAL

    @property
    def has_split(self) -> bool:
        return self.split_weight is not None

    @property
    def page_id(self) -> int:
        """The capability whose admin page shows this one: a staged version in traffic has no
        page of its own, its capability's shows it."""
        return self.variant_of_id or self.pk


class VersionPlacement(models.TextChoices):
    PLACED = "placed", "placed"  # on the runtime (it is, or was, the current version)
    PLACING = "placing", "placing"  # recorded; a Celery task is placing it
    FAILED = "failed", "failed"  # the runtime or a rule refused it; `failure` says why
    SUPERSEDED = "superseded", "superseded"  # a newer deploy, or a removal, came first


@dataclass(frozen=True)
class DeployRequest:
    """What a deploy or a rollback placed by the deploy task asked for besides the code,
    applied to the capability once its version is placed: the request records it as the
    version's `requested` JSON (`to_json`), the task reads it back (`from_json`).

    `public` None keeps the capability's flag, `cache_when_degraded` None its setting;
    `restores` is the version a rollback restores (None for a deploy)."""

    bindings: list[str] = field(default_factory=list)
    public: bool | None = None
    actor: str = "system"
    cache_when_degraded: bool | None = None
    restores: int | None = None

    def to_json(self) -> dict:
        return {
            "bindings": list(self.bindings),
            "public": self.public,
            "actor": self.actor,
            "cache_when_degraded": self.cache_when_degraded,
            "restores": self.restores,
        }

    @classmethod
    def from_json(cls, data: dict) -> DeployRequest:
        """The request as stored, by any version of Sigil: a key it lacks takes its default."""
        return cls(
            bindings=list(data.get("bindings") or []),
            public=data.get("public"),
            actor=data.get("actor") or "system",
            cache_when_degraded=data.get("cache_when_degraded"),
            restores=data.get("restores"),
        )


class CapabilityVersion(models.Model):
    """One deployed code of a capability, numbered from 1: the seeds' `code:` backup.

    On the Cloudflare runtimes a version is recorded before it is placed (by a Celery task):
    `placement` follows it, and `requested` keeps what its deploy asked for besides the code
    (a DeployRequest: bindings, public, ...), applied to the capability once the version is
    placed.
    """

    capability = models.ForeignKey(Capability, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    code = models.TextField()
    sha = models.CharField(max_length=64)
    size_bytes = models.PositiveIntegerField()
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    # The contract (capabilities/contracts.py): part of the version, as the code is.
    description = models.TextField(blank=True)
    input_schema = models.JSONField(null=True, blank=True, help_text="JSON Schema (2020-12) of the JSON it takes.")
    output_schema = models.JSONField(null=True, blank=True, help_text="JSON Schema (2020-12) of the JSON it answers.")
    examples = models.JSONField(default=list, blank=True, help_text="A few {input, output} pairs.")
    placement = models.CharField(max_length=10, choices=VersionPlacement.choices, default=VersionPlacement.PLACED)
    requested = models.JSONField(default=dict, blank=True)
    failure = models.JSONField(null=True, blank=True, help_text='Why placing it failed: {"code": ..., "message": ...}.')

    class Meta:
        ordering = ["capability", "-number"]
        constraints = [models.UniqueConstraint(fields=["capability", "number"], name="one_version_number")]

    def __str__(self) -> str:
        return f"{self.capability.full_name} v{self.number}"

    @property
    def deploy_request(self) -> DeployRequest:
        return DeployRequest.from_json(self.requested or {})


class BindingKind(models.TextChoices):
    VAR = "VAR", "plain text variable"
    SECRET = "SECRET", "secret text"
    KV = "KV", "Workers KV namespace"
    D1 = "D1", "D1 database"
    R2 = "R2", "R2 bucket"
    SERVICE = "SERVICE", "service (another Worker)"
    QUEUE = "QUEUE", "queue"


class Binding(models.Model):
    """A resource the owner offers to capabilities under one name, e.g. `KV:CACHE`.

    A capability declares the bindings it needs, among those granted to its agent
    (BindingGrant), and gets exactly those. `value` is what the kind needs (a KV namespace
    id, a D1 database id, a bucket, a service or queue name, or the text of a variable); a
    secret is kept encrypted, or named by an environment variable of the Sigil processes.
    """

    kind = models.CharField(max_length=8, choices=BindingKind.choices)
    name = models.CharField(max_length=64, help_text="The name the capability sees in env, e.g. CACHE.")
    value = models.TextField(blank=True)
    secret_env = models.CharField(
        max_length=100, blank=True, help_text="For SECRET: the environment variable holding the secret."
    )
    secret_encrypted = models.TextField(blank=True, editable=False)
    description = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    updated_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["kind", "name"]
        constraints = [models.UniqueConstraint(fields=["kind", "name"], name="one_binding_per_kind_and_name")]

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


class BindingGrant(models.Model):
    """The owner's leave for one agent to declare one binding.

    An agent may declare only the bindings granted to it; a grant taken back leaves the
    binding out of that agent's capabilities from their next placement (services queue one).
    """

    binding = models.ForeignKey(Binding, on_delete=models.CASCADE, related_name="grants")
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="binding_grants")
    granted_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["binding", "agent"]
        constraints = [models.UniqueConstraint(fields=["binding", "agent"], name="one_grant_per_binding_and_agent")]

    def __str__(self) -> str:
        return f"{self.binding} to {self.agent}"


class CapabilityStatsWindow(models.Model):
    """One minute of a capability's calls, flushed from Redis: the dashboard's and the
    agents' source for rates and percentiles over time."""

    full_name = models.CharField(max_length=90)
    agent_name = models.CharField(max_length=31, db_index=True)
    window_start = models.DateTimeField(db_index=True)
    calls = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    cold_calls = models.PositiveIntegerField(default=0)
    latency_ms_sum = models.FloatField(default=0.0)
    page_in_ms_sum = models.FloatField(default=0.0)
    latency_buckets = models.JSONField(default=list, help_text="Counts per bucket of stats.LATENCY_BUCKETS_MS.")
    refused = models.PositiveIntegerField(default=0)
    statuses = models.JSONField(default=dict, blank=True, help_text='Answers by status class, e.g. {"5xx": 3}.')
    codes = models.JSONField(default=dict, blank=True, help_text='Answers by error code, e.g. {"degraded": 3}.')

    class Meta:
        ordering = ["-window_start", "full_name"]
        constraints = [models.UniqueConstraint(fields=["full_name", "window_start"], name="one_stats_window")]

    def __str__(self) -> str:
        return f"{self.full_name} @ {self.window_start:%Y-%m-%d %H:%M}"


class StatsFlush(models.Model):
    """A batch of counters the stats flush has applied, by the id it was claimed under in
    Redis: a flush that retries a batch finds it here and does not count it twice."""

    flush_id = models.CharField(max_length=32, unique=True)
    applied_at = models.DateTimeField(default=timezone.now, db_index=True)

    def __str__(self) -> str:
        return self.flush_id
