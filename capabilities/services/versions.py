"""What deploys, rollbacks and staging share: recording a new version, the answer a deploy
gives, the agent's deploy cool-down and the lock that orders the recording of deploys.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Max
from django.utils import timezone

from agents.models import Agent
from agents.services import audit_record
from agents.tokens import Principal
from capabilities import names
from capabilities.contracts import Contract
from capabilities.models import Capability, CapabilityType, CapabilityVersion, State, VersionPlacement
from capabilities.services.placement_lock import held
from capabilities.services.records import capability_written
from sigil import redis_keys
from sigil.errors import Conflict, Cooldown, InvalidRequest, NotFound
from sigil.leases import Lease
from sigil.redis_client import get_redis


@dataclass(frozen=True)
class DeployResult:
    capability: Capability
    version: CapabilityVersion
    created: bool
    cold_start: bool
    evicted: str | None
    staged: bool = False  # the version was staged, not made current
    # The version is recorded and a Celery task is still placing it (Cloudflare runtimes).
    pending: bool = False

    @classmethod
    def not_placed(cls, capability: Capability, version: CapabilityVersion, **flags: bool) -> DeployResult:
        """The answer to a deploy that placed nothing (yet): `version` serves, is staged, or
        with `pending` is still being placed."""
        created = flags.pop("created", False)
        return cls(capability=capability, version=version, created=created, cold_start=False, evicted=None, **flags)


@dataclass(frozen=True)
class NewVersion:
    """What a deploy records, whether it places the version in the request or in a task."""

    owner: Agent
    existing: Capability | None  # None: the deploy creates the capability
    full: str
    type: str
    expires_at: datetime | None
    code: str
    sha: str
    contract: Contract
    now: datetime

    @classmethod
    def of(cls, capability: Capability, version: CapabilityVersion) -> NewVersion:
        """`version`'s code and contract again, as a new version of `capability` (a rollback)."""
        return cls(
            owner=capability.agent,
            existing=capability,
            full=capability.full_name,
            type=capability.type,
            expires_at=capability.expires_at,
            code=version.code,
            sha=version.sha,
            contract=Contract.of(version),
            now=timezone.now(),
        )

    def capability_locked(self, **create_fields) -> Capability:
        """The capability's row, locked for the transaction: created (with `create_fields`)
        when the deploy creates the capability. Raises Conflict when a concurrent request
        created it first, or removed the one being redeployed since it was read."""
        if self.existing is None:
            try:
                with transaction.atomic():
                    return Capability.objects.create(
                        agent=self.owner,
                        name=self.full.split(names.SEPARATOR, 1)[1],
                        full_name=self.full,
                        type=self.type,
                        expires_at=self.expires_at,
                        created_at=self.now,
                        updated_at=self.now,
                        **create_fields,
                    )
            except IntegrityError as exc:
                raise Conflict(f"{self.full} was created by a concurrent request") from exc
        capability = (
            Capability.objects.select_for_update().exclude(state=State.REMOVED).filter(pk=self.existing.pk).first()
        )
        if capability is None:
            raise Conflict(f"{self.full} was removed by a concurrent request; deploy again")
        return capability

    def create_version(self, capability: Capability, **fields) -> CapabilityVersion:
        return CapabilityVersion.objects.create(
            capability=capability,
            number=next_version_number(capability),
            code=self.code,
            sha=self.sha,
            size_bytes=len(self.code.encode()),
            created_at=self.now,
            **self.contract.as_fields(),
            **fields,
        )


def next_version_number(capability: Capability) -> int:
    """Versions are numbered from 1 and never reused while their rows stay."""
    return (capability.versions.aggregate(n=Max("number"))["n"] or 0) + 1


def actor_of(principal: Principal) -> str:
    return f"agent:{principal.agent_name}"


def latest_accepted(capability: Capability) -> tuple[CapabilityVersion | None, bool]:
    """The version an agent was last told serves or will serve: the newest version still
    being placed after the current one, else the current one; and whether it is pending."""
    current = capability.current_version
    pending = (
        capability.versions.filter(placement=VersionPlacement.PLACING)
        .filter(number__gt=current.number if current else 0)
        .order_by("-number")
        .first()
    )
    return (pending, True) if pending is not None else (current, False)


def cooldown_claim(agent_name: str) -> None:
    """One real deploy per agent per cool-down. Raises Cooldown with the time left."""
    window_ms = int(settings.SIGIL_DEPLOY_COOLDOWN_SECONDS * 1000)
    if window_ms <= 0:
        return
    redis = get_redis()
    key = redis_keys.cooldown(agent_name)
    if not redis.set(key, 1, nx=True, px=window_ms):
        left_ms = max(redis.pttl(key), 1)
        raise Cooldown(
            f"{agent_name} deployed less than {settings.SIGIL_DEPLOY_COOLDOWN_SECONDS:g} s ago; retry later",
            retry_after=left_ms / 1000,
        )


def cooldown_give_back(agent_name: str) -> None:
    """The runtime refused the code (it does not start, or is too large): nothing was
    deployed, so the fixed code need not wait out a cool-down."""
    get_redis().delete(redis_keys.cooldown(agent_name))


# How long a deploy waits for a concurrent deploy of the same capability to be recorded
# (a few database writes and a task sent: never a placement, which runs in the deploy task),
# and the longest a holder keeps the lease (one that died frees it within a lease).
DEPLOY_RECORD_WAIT_SECONDS = 10
DEPLOY_RECORD_LOCK_SECONDS = 30


def deploy_lock(full: str):
    """Hold the lock that orders the recording of deploys of `full` (a context manager).
    Raises Conflict when a concurrent deploy holds it for longer than DEPLOY_RECORD_WAIT_SECONDS."""
    lock = Lease(
        redis_keys.deploy_lock(full),
        hold_seconds=DEPLOY_RECORD_LOCK_SECONDS,
        blocking_timeout=DEPLOY_RECORD_WAIT_SECONDS,
    )
    return held(lock, busy=Conflict(f"{full} is being deployed by another request; retry when it is done"))


def stage_allowed(capability_type: str) -> None:
    """Raise InvalidRequest for a type that has no staged versions (ephemerals are their own
    quick experiments)."""
    if capability_type == CapabilityType.EPHEMERAL:
        raise InvalidRequest("ephemeral capabilities have no staged versions: stage a persistent or normal one")


def stage(
    existing: Capability | None,
    *,
    full: str,
    type: str,
    code: str,
    sha: str,
    bindings: list[str],
    contract: Contract,
    principal: Principal,
) -> DeployResult:
    """Keep `code` as the capability's staged version: a new version, not current, not placed
    (it is placed, and its code checked, when a split sends callers to it). The same code
    as the current or the staged version again changes nothing. Called with the lock that
    orders deploys of `full` held (capability_deploy). Raises NotFound, Conflict,
    InvalidRequest, Cooldown."""
    stage_allowed(type)
    if existing is None:
        raise NotFound(f"no capability {full}: deploy its first version without stage")
    if existing.current_version is None:
        # Its first deploy was refused or is still being placed: nothing to try a version against.
        raise Conflict(f"{full} has no version placed yet: deploy its first version without stage")
    if existing.bindings != bindings:
        raise InvalidRequest("a staged version runs with the capability's bindings: deploy new bindings without stage")
    staged = existing.staged_version
    for version in (existing.current_version, staged):
        if version is not None and version.sha == sha:
            return DeployResult.not_placed(existing, version, staged=version == staged)
    if existing.has_split:
        raise Conflict(f"{full} has a split running with v{staged.number}: promote or abort it first")
    cooldown_claim(principal.agent_name)
    with capability_written(full):
        capability = Capability.objects.select_for_update().exclude(state=State.REMOVED).filter(pk=existing.pk).first()
        if capability is None:
            raise NotFound(f"no capability {full}")
        if capability.has_split:
            raise Conflict(f"{full} has a split running: promote or abort it first")
        number = next_version_number(capability)
        version = CapabilityVersion.objects.create(
            capability=capability,
            number=number,
            code=code,
            sha=sha,
            size_bytes=len(code.encode()),
            **contract.as_fields(),
        )
        capability.staged_version = version
        capability.updated_at = timezone.now()
        capability.save(update_fields=["staged_version", "updated_at"])
        audit_record(
            actor=actor_of(principal),
            action="capability.staged",
            agent_name=principal.agent_name,
            subject=full,
            detail={"version": number, "sha": sha},
        )
    capability.agent = existing.agent
    return DeployResult.not_placed(capability, version, staged=True)
