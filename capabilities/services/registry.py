"""The registry's writes: deploying (validation, names, cool-down, versions), removing,
expiring ephemerals, and rolling back to an earlier version.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Max
from django.utils import timezone

from agents.models import Agent
from agents.services import audit_record
from agents.tokens import Principal
from capabilities import bindings as binding_rules
from capabilities import call_logs, contract_copies, failures, names, pager, routes, selectors
from capabilities.contracts import Contract, contract_merge
from capabilities.jobs import capability_place_version as capability_place_version_task
from capabilities.jobs import capability_release_slot as capability_release_slot_task
from capabilities.models import Capability, CapabilityType, CapabilityVersion, State, VersionPlacement
from capabilities.runtimes import get_runtime
from capabilities.runtimes.base import CodeBundle, code_sha
from capabilities.runtimes.errors import RuntimeUnavailable
from capabilities.services.placement import (
    Placement,
    bundle_for,
    placement_lock,
    placement_lock_key,
    placement_lock_within,
    placement_room,
)
from capabilities.services.splits import stage_allowed
from sigil import leases
from sigil.errors import (
    Conflict,
    Cooldown,
    Forbidden,
    InvalidRequest,
    NotFound,
    RateLimited,
    SigilError,
    Timeout,
    TooLarge,
    UpstreamError,
    error_for_unexpected,
    error_from_code,
)
from sigil.redis_client import get_redis
from sigil.work import retry_countdown

logger = logging.getLogger(__name__)


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
            number=_next_version_number(capability),
            code=self.code,
            sha=self.sha,
            size_bytes=len(self.code.encode()),
            created_at=self.now,
            **self.contract.as_fields(),
            **fields,
        )


def _actor(principal: Principal) -> str:
    return f"agent:{principal.agent_name}"


def _validate_deploy(
    *,
    principal: Principal,
    agent: str | None,
    name: str | None,
    code: str,
    type: str | None,
    ttl: int | None,
    bindings: list[str],
) -> tuple[str, str | None, int | None]:
    """Check a deploy's input against the rules; return (type, name, ttl). Raises on the first broken rule."""
    if not principal.can_deploy:
        raise Forbidden("deploying needs a token with the deploy scope")
    if agent is not None and agent != principal.agent_name:
        raise Forbidden(f"this token belongs to {principal.agent_name!r}; it cannot deploy for {agent!r}")
    if type is None:
        type = CapabilityType.EPHEMERAL if name is None else CapabilityType.PERSISTENT
    if type not in CapabilityType.values:
        raise InvalidRequest(f"type must be one of {', '.join(CapabilityType.values)}")
    if name is None and type != CapabilityType.EPHEMERAL:
        raise InvalidRequest(f"name is required for {type} capabilities (null names are for ephemerals)")
    if name is not None:
        names.validate_capability_name(name, ephemeral=type == CapabilityType.EPHEMERAL)
        if type == CapabilityType.EPHEMERAL and not name.startswith(names.EPHEMERAL_PREFIX):
            raise InvalidRequest("ephemeral capabilities are named t-{hash6} by Sigil: send name null")
    if type == CapabilityType.EPHEMERAL:
        ttl = settings.SIGIL_EPHEMERAL_DEFAULT_TTL_SECONDS if ttl is None else ttl
        if not 1 <= ttl <= settings.SIGIL_EPHEMERAL_MAX_TTL_SECONDS:
            raise InvalidRequest(f"ttl must be between 1 and {settings.SIGIL_EPHEMERAL_MAX_TTL_SECONDS} seconds")
    elif ttl is not None:
        raise InvalidRequest("ttl applies to ephemeral capabilities only")
    if not code.strip():
        raise InvalidRequest("code must be a non-empty ES module Worker script")
    size = len(code.encode())
    if size > settings.SIGIL_SCRIPT_MAX_BYTES:
        raise TooLarge(f"code is {size} bytes; the limit is {settings.SIGIL_SCRIPT_MAX_BYTES} bytes")
    for binding in bindings:
        binding_rules.parse_declaration(binding)
    return type, name, ttl


def _cooldown_key(agent_name: str) -> str:
    return f"sigil:cooldown:{agent_name}"


def _claim_cooldown(agent_name: str) -> None:
    """One real deploy per agent per cool-down. Raises Cooldown with the time left."""
    window_ms = int(settings.SIGIL_DEPLOY_COOLDOWN_SECONDS * 1000)
    if window_ms <= 0:
        return
    redis = get_redis()
    key = _cooldown_key(agent_name)
    if not redis.set(key, 1, nx=True, px=window_ms):
        left_ms = max(redis.pttl(key), 1)
        raise Cooldown(
            f"{agent_name} deployed less than {settings.SIGIL_DEPLOY_COOLDOWN_SECONDS:g} s ago; retry later",
            retry_after=left_ms / 1000,
        )


def capability_deploy(
    *,
    principal: Principal,
    code: str,
    name: str | None = None,
    agent: str | None = None,
    type: str | None = None,
    ttl: int | None = None,
    bindings: list[str] | None = None,
    is_public: bool | None = None,
    contract: Mapping[str, Any] | None = None,
    stage: bool = False,
    cache_when_degraded: bool | None = None,
    now: datetime | None = None,
) -> DeployResult:
    """Deploy a new capability or a new version of one, and place it on the runtime; with
    `stage`, a new version of an existing capability is kept aside instead (see
    services.splits), neither current nor placed.

    A field left as None was not sent: a redeploy keeps the capability's value for it
    (`_keep_omitted`), a new capability gets the default.
    `contract` holds the contract fields the agent sent (description, input_schema,
    output_schema, examples); those it omits keep their current value. The same code,
    bindings and contract again is idempotent: no new version, no runtime call, no cool-down.
    Raises InvalidRequest, Forbidden (also for a binding not granted to the agent), TooLarge,
    Conflict (another type holds the name, or a concurrent deploy of it), Cooldown,
    RateLimited (too many ephemerals), UpstreamError.
    """
    now = now or timezone.now()
    bindings = list(bindings or [])
    kept = _keep_omitted(
        _existing_capability(principal, agent=agent, name=name), {"type": type, "is_public": is_public}
    )
    type, is_public = kept["type"], kept["is_public"]
    type, name, ttl = _validate_deploy(
        principal=principal, agent=agent, name=name, code=code, type=type, ttl=ttl, bindings=bindings
    )
    sha = code_sha(code)
    resolved = binding_rules.bindings_resolve(
        bindings, agent_id=principal.agent_id, supported_kinds=get_runtime().binding_kinds
    )
    owner = Agent.objects.get(pk=principal.agent_id)

    if name is None:
        if stage:
            stage_allowed(type)
        live_ephemerals = Capability.objects.filter(
            agent=owner, type=CapabilityType.EPHEMERAL, expires_at__gt=now
        ).exclude(state=State.REMOVED)
        if live_ephemerals.count() >= settings.SIGIL_EPHEMERAL_MAX_PER_AGENT:
            raise RateLimited(
                f"{owner.name} already has {settings.SIGIL_EPHEMERAL_MAX_PER_AGENT} live ephemeral capabilities"
            )
        full = _unused_ephemeral_name(owner.name)
    else:
        full = names.full_name(owner.name, name)
    asked = DeployAsked(
        principal=principal,
        owner=owner,
        full=full,
        named=name is not None,
        type=type,
        ttl=ttl,
        code=code,
        sha=sha,
        bindings=bindings,
        resolved=resolved,
        is_public=is_public,
        contract=contract or {},
        stage=stage,
        cache_when_degraded=cache_when_degraded,
        now=now,
    )
    # Linearizable per capability: what this deploy compares itself with (the version that
    # serves, or the one still being placed) is read under the lock that orders deploys of
    # `full`, so a deploy never answers a no-op from a state a concurrent deploy is changing.
    if get_runtime().places_in_background:
        # Only the recording is ordered here; the placements are, by the placement lock
        # each deploy task waits on in turn (a version deployed after it supersedes it).
        with _deploy_lock(full):
            ordered = _deploy_ordered(asked)
        return deploy_awaited(ordered)
    # The placement is made in the request: a deploy waits its turn behind the one being placed.
    with placement_lock_within(full, wait_seconds=None):
        return _deploy_ordered(asked)


@dataclass(frozen=True)
class DeployAsked:
    """A deploy's input once checked, before it is compared with the capability's state."""

    principal: Principal
    owner: Agent
    full: str
    named: bool
    type: str
    ttl: int | None
    code: str
    sha: str
    bindings: list[str]
    resolved: Any
    is_public: bool
    contract: Mapping[str, Any]
    stage: bool
    cache_when_degraded: bool | None
    now: datetime


# How long a deploy waits for a concurrent deploy of the same capability to be recorded
# (a few database writes and a task sent: never a placement, which runs in the deploy task),
# and how long the lock outlives a process that died holding it.
DEPLOY_RECORD_WAIT_SECONDS = 10
DEPLOY_RECORD_LOCK_SECONDS = 30


@contextmanager
def _deploy_lock(full: str) -> Iterator[None]:
    """Hold the lock that orders the recording of deploys of `full`. Raises Conflict when a
    concurrent deploy holds it for longer than DEPLOY_RECORD_WAIT_SECONDS."""
    lock = get_redis().lock(
        f"sigil:lock:deploy:{full}",
        timeout=DEPLOY_RECORD_LOCK_SECONDS,
        blocking_timeout=DEPLOY_RECORD_WAIT_SECONDS,
    )
    if not lock.acquire():
        raise Conflict(f"{full} is being deployed by another request; retry when it is done")
    try:
        yield
    finally:
        lock.release()


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


def _deploy_ordered(asked: DeployAsked) -> DeployResult | Queued:
    """The part of a deploy that reads the capability's state and acts on it; called with
    the lock that orders deploys of `asked.full` held."""
    full = asked.full
    existing = None
    wanted = contract_merge(Contract(), asked.contract)
    if asked.named:
        existing = (
            Capability.objects.select_related("agent", "current_version", "staged_version")
            .exclude(state=State.REMOVED)
            .filter(full_name=full)
            .first()
        )
        if existing is None and asked.type == CapabilityType.EPHEMERAL:
            raise NotFound(f"no ephemeral capability {full}: deploy with name null to create one")
        if existing is not None and existing.type != asked.type:
            raise Conflict(f"{full} is a {existing.type} capability; it cannot be redeployed as {asked.type}")
        latest, pending = latest_accepted(existing) if existing is not None else (None, False)
        wanted = contract_merge(Contract.of(latest), asked.contract)
        if asked.stage:
            return _stage(
                existing,
                full=full,
                type=asked.type,
                code=asked.code,
                sha=asked.sha,
                bindings=asked.bindings,
                contract=wanted,
                principal=asked.principal,
            )
        if latest is not None and latest.sha == asked.sha and wanted == Contract.of(latest):
            if pending and latest.requested.get("bindings", []) == asked.bindings:
                if latest.requested.get("public") == asked.is_public:
                    # The same deploy as the one still being placed: it is the one that will serve.
                    # (Its own cache_when_degraded, if it sent one, applies once it is placed.)
                    return DeployResult(
                        capability=existing,
                        version=latest,
                        created=existing.current_version_id is None,
                        cold_start=False,
                        evicted=None,
                        pending=True,
                    )
            elif not pending and existing.bindings == asked.bindings:
                result = _redeploy_unchanged(existing, principal=asked.principal, is_public=asked.is_public)
                return _set_cache_when_degraded(result, asked.cache_when_degraded, principal=asked.principal)

    owner = asked.owner
    _claim_cooldown(owner.name)
    now = asked.now
    ttl = asked.ttl
    expires_at = existing.expires_at if existing else (now + timedelta(seconds=ttl) if ttl is not None else None)
    new = NewVersion(
        owner=owner,
        existing=existing,
        full=full,
        type=asked.type,
        expires_at=expires_at,
        code=asked.code,
        sha=asked.sha,
        contract=wanted,
        now=now,
    )
    if get_runtime().places_in_background:
        requested = {
            "bindings": asked.bindings,
            "public": asked.is_public,
            "cache_when_degraded": asked.cache_when_degraded,
            "actor": _actor(asked.principal),
        }
        return _deploy_in_background(new, requested)
    bundle = CodeBundle.from_code(asked.code, bindings=asked.resolved)
    with placement_room(full=full, capability_type=asked.type, expires_at=expires_at) as room:
        try:
            placement = room.place(bundle)
        except (InvalidRequest, TooLarge):
            # The runtime refused the code (it does not start, or is too large): nothing
            # was deployed, so the fixed code need not wait out a cool-down.
            get_redis().delete(_cooldown_key(owner.name))
            raise
        capability, version = _record_deploy(
            new,
            placement,
            bundle_sha=bundle.sha,
            bindings=asked.bindings,
            is_public=asked.is_public,
            principal=asked.principal,
        )
    routes.route_publish(capability)
    contract_copies.contract_publish(capability)
    result = DeployResult(
        capability=capability,
        version=version,
        created=existing is None,
        cold_start=placement.cold_start,
        evicted=placement.evicted,
    )
    return _set_cache_when_degraded(result, asked.cache_when_degraded, principal=asked.principal)


def _set_cache_when_degraded(result: DeployResult, value: bool | None, *, principal: Principal) -> DeployResult:
    """Turn the cached answer while degraded on or off as the deploy asked; omitted keeps it."""
    capability = result.capability
    if value is None or capability.cache_when_degraded == value:
        return result
    with transaction.atomic():
        Capability.objects.filter(pk=capability.pk).update(cache_when_degraded=value, updated_at=timezone.now())
        audit_record(
            actor=_actor(principal),
            action="capability.updated",
            agent_name=capability.agent.name,
            subject=capability.full_name,
            detail={"cache_when_degraded": value},
        )
    capability.cache_when_degraded = value
    routes.route_publish(capability)
    return result


# What a redeploy keeps when the agent leaves a field out, read from the capability; a new
# capability gets the default instead (None: decided by the deploy's rules, as for `type`).
KEPT_WHEN_OMITTED = {"type": None, "is_public": False}


def _existing_capability(principal: Principal, *, agent: str | None, name: str | None) -> Capability | None:
    """The capability a deploy would replace, if any (another agent's is refused later)."""
    if name is None or (agent is not None and agent != principal.agent_name):
        return None
    return (
        Capability.objects.exclude(state=State.REMOVED)
        .filter(full_name=names.full_name(principal.agent_name, name))
        .first()
    )


def _keep_omitted(existing: Capability | None, sent: dict) -> dict:
    """`sent` with each omitted (None) field of KEPT_WHEN_OMITTED filled from `existing`, or
    with its default when there is no capability yet."""
    return {
        field: value
        if value is not None
        else (getattr(existing, field) if existing is not None else KEPT_WHEN_OMITTED[field])
        for field, value in sent.items()
    }


def _stage(
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
    as the current or the staged version again changes nothing."""
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
            return DeployResult(
                capability=existing,
                version=version,
                created=False,
                cold_start=False,
                evicted=None,
                staged=version == staged,
            )
    if existing.has_split:
        raise Conflict(f"{full} has a split running with v{staged.number}: promote or abort it first")
    # Called with the lock that orders deploys of `full` held (capability_deploy).
    _claim_cooldown(principal.agent_name)
    with transaction.atomic():
        capability = Capability.objects.select_for_update().exclude(state=State.REMOVED).filter(pk=existing.pk).first()
        if capability is None:
            raise NotFound(f"no capability {full}")
        if capability.has_split:
            raise Conflict(f"{full} has a split running: promote or abort it first")
        number = _next_version_number(capability)
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
            actor=_actor(principal),
            action="capability.staged",
            agent_name=principal.agent_name,
            subject=full,
            detail={"version": number, "sha": sha},
        )
    capability.agent = existing.agent
    return DeployResult(
        capability=capability, version=version, created=False, cold_start=False, evicted=None, staged=True
    )


# --- Deploys placed by a Celery task (runtimes with `places_in_background`) ---------------
#
# The request records the version (`placing`) and queues its placement; the task places it,
# makes it current, and announces the outcome on a Redis list the request waits on for up to
# SIGIL_DEPLOY_WAIT_SECONDS. A request that stops waiting answers 202; the outcome stays on
# the version (inspect's `deploy`, `/_status/{full}`).

# How long an outcome waits on its list for a request that is still waiting on it.
OUTCOME_KEEP_SECONDS = 120


def _outcome_key(version_id: int) -> str:
    return f"sigil:deploy:outcome:{version_id}"


@dataclass(frozen=True)
class Queued:
    """A version recorded and handed to the deploy task, whose outcome is still to be awaited
    (`deploy_awaited`), after the lock that orders deploys is released."""

    new: NewVersion
    capability: Capability
    version: CapabilityVersion


def _deploy_in_background(new: NewVersion, requested: dict) -> Queued:
    """Record the new version and hand its placement to a Celery task. `requested` holds what
    applies once it is placed."""
    # Called with the lock that orders deploys of `full` held, never its placement lock: a
    # placement under way (an earlier deploy's task, a page-in) ends before this version's
    # task places it, and an earlier version not yet placed is superseded by this one.
    capability, version = _record_pending(new, requested)
    capability_place_version_task.delay(version_id=version.pk)
    return Queued(new, capability, version)


def deploy_awaited(queued: DeployResult | Queued) -> DeployResult:
    """The answer to a deploy: a queued placement's outcome once it comes within
    SIGIL_DEPLOY_WAIT_SECONDS (pending when it has not). Raises the error a refused
    placement recorded."""
    if isinstance(queued, DeployResult):
        return queued
    new, capability, version = queued.new, queued.capability, queued.version
    outcome = _await_outcome(version.pk, seconds=settings.SIGIL_DEPLOY_WAIT_SECONDS)
    if outcome is None:
        return DeployResult(
            capability=capability,
            version=version,
            created=new.existing is None,
            cold_start=False,
            evicted=None,
            pending=True,
        )
    if outcome["status"] != VersionPlacement.PLACED:
        _forget_refused(version)
        raise error_from_code(outcome["code"], outcome["message"], retry_after=outcome.get("retry_after"))
    capability.refresh_from_db()
    capability.agent = new.owner
    return DeployResult(
        capability=capability,
        version=version,
        created=new.existing is None or new.existing.current_version_id is None,
        cold_start=outcome["cold_start"],
        evicted=outcome["evicted"],
    )


def _record_pending(new: NewVersion, requested: dict) -> tuple[Capability, CapabilityVersion]:
    """A new version, not yet placed. A new capability is recorded without a current version
    (not served: its calls are 404 until the version is placed)."""
    with transaction.atomic():
        capability = new.capability_locked(
            is_public=requested["public"], bindings=requested["bindings"], state=State.PAGED_OUT
        )
        version = new.create_version(capability, placement=VersionPlacement.PLACING, requested=requested)
    capability.agent = new.owner
    return capability, version


def _await_outcome(version_id: int, *, seconds: float) -> dict | None:
    """The placement's outcome, or None when it has not come within `seconds`. Waits in
    short blocking reads, each well inside the Redis client's socket timeout."""
    redis = get_redis()
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        popped = redis.blpop([_outcome_key(version_id)], timeout=min(1.0, max(left, 0.01)))
        if popped is not None:
            return json.loads(popped[1])
    return None


def _forget_refused(version: CapabilityVersion) -> None:
    """A deploy refused while its request still waited leaves nothing, as one placed in the
    request does: the version goes, and so does a capability it would have created. The
    audit trail keeps the failure."""
    with transaction.atomic():
        CapabilityVersion.objects.filter(pk=version.pk).delete()
        Capability.objects.filter(pk=version.capability_id, current_version=None, versions__isnull=True).delete()


def deploy_owner_key(version_id: int) -> str:
    """The lease of the task placing a version, held while it works on it: a version nobody
    owns (nor `deploy_retry_key`) was stranded by a dead worker (services/reaper.py)."""
    return f"sigil:deploy:owner:{version_id}"


def deploy_retry_key(version_id: int) -> str:
    """Set, for its countdown and a lease, while a retry of the version's task is due."""
    return f"sigil:deploy:retry:{version_id}"


# Failures that may pass: the runtime unreachable, no room yet, the lock held too long.
TRANSIENT_DEPLOY_FAILURES = (UpstreamError, Timeout)


def capability_place_version(*, version_id: int, retries: int = 0, max_retries: int = 0) -> dict:
    """Place a version recorded by a deploy (the Celery task's work) and make it current;
    record and announce the outcome: {"status": "placed", "cold_start", "evicted"} or
    {"status": "failed" | "superseded", "code", "message"}.

    A version whose row is gone, whose capability was removed, or that a newer deploy
    came after is not placed (superseded). A transient failure (the runtime unreachable, no
    room, the lock held too long) raises RuntimeUnavailable, with the countdown to try again
    as its retry_after, while `retries` (the tries that failed so far) is under `max_retries`;
    the last try's failure, and any other, is recorded on the
    version, audited, and shown by inspect. Idempotent: a version placed or failed already
    gets its recorded outcome.
    """
    full = CapabilityVersion.objects.filter(pk=version_id).values_list("capability__full_name", flat=True).first()
    if full is None:
        logger.info("version %s is gone (its capability was redeployed or removed): nothing to place", version_id)
        return {"status": VersionPlacement.SUPERSEDED, "code": "not_found", "message": "the version no longer exists"}
    owner = leases.Lease(
        deploy_owner_key(version_id), hold_seconds=2 * settings.SIGIL_PLACEMENT_LOCK_SECONDS, blocking=False
    )
    owner.acquire()  # not acquired: a duplicate delivery is at work, the placement lock orders them
    redis = get_redis()
    redis.delete(deploy_retry_key(version_id))
    last_try = retries >= max_retries
    try:
        with placement_lock_within(full, wait_seconds=None):
            outcome = _place_version(version_id, last_try=last_try)
    except TRANSIENT_DEPLOY_FAILURES as exc:
        if not last_try:
            countdown = retry_countdown(retries=retries)
            # The worker holds the retry, unacknowledged, for its countdown.
            redis.set(deploy_retry_key(version_id), 1, px=int((countdown + leases.lease_seconds()) * 1000))
            logger.warning(
                "placing version %s of %s failed, trying again in %.0f s: %s", version_id, full, countdown, exc
            )
            raise RuntimeUnavailable(str(exc), retry_after=countdown) from exc
        outcome = _record_failed(version_id, exc)
    except SigilError as exc:
        outcome = _record_failed(version_id, exc)
    except Exception as exc:
        error = error_for_unexpected(exc, request_id=f"deploy-{version_id}")
        logger.exception("placing version %s of %s failed (%s)", version_id, full, error.message)
        outcome = _record_failed(version_id, error)
    finally:
        if owner.owned():
            owner.release()
    _announce(version_id, outcome)
    return outcome


# How often a stranded deploy is sent again before it is ended as failed.
DEPLOY_RESENDS = 3


def capability_reap_deploys() -> dict[str, int]:
    """Deploys and rollbacks placed by a task that nobody owns any more (the worker placing
    them died, its message not yet given back by the broker): a version still `placing` a
    lease after it was recorded, with no task's lease on it (`deploy_owner_key`), no retry
    due and its capability's placement lock free, is sent to the deploy queue again, up to
    DEPLOY_RESENDS times; then it is recorded as failed (502 upstream_error). Each step is
    audited. Idempotent (a resent task finds the version placed, and does nothing); returns
    counts.
    """
    redis = get_redis()
    recorded_before = timezone.now() - timedelta(seconds=leases.lease_seconds())
    stranded = CapabilityVersion.objects.select_related("capability__agent").filter(
        placement=VersionPlacement.PLACING, created_at__lt=recorded_before
    )
    resent = failed = 0
    for version in stranded:
        full = version.capability.full_name
        if redis.exists(deploy_owner_key(version.pk), deploy_retry_key(version.pk), placement_lock_key(full)):
            continue
        sends_key = f"sigil:deploy:resent:{version.pk}"
        sends = redis.incr(sends_key)
        redis.expire(sends_key, 86400)
        if sends > DEPLOY_RESENDS:
            error = UpstreamError(
                f"v{version.number} of {full} was not placed: the worker placing it was lost, "
                f"and no worker placed it after {DEPLOY_RESENDS} resends"
            )
            _announce(version.pk, _record_failed(version.pk, error))
            failed += 1
            continue
        audit_record(
            actor="system",
            action="capability.deploy_resent",
            agent_name=version.capability.agent.name,
            subject=full,
            detail={"version": version.number, "resend": sends, "reason": "no worker owns its placement"},
        )
        capability_place_version_task.delay(version_id=version.pk)
        resent += 1
    return {"deploys_resent": resent, "deploys_failed": failed}


def _announce(version_id: int, outcome: dict) -> None:
    """Hand the outcome to the request waiting on it, if it still is."""
    redis = get_redis()
    redis.rpush(_outcome_key(version_id), json.dumps(outcome))
    redis.expire(_outcome_key(version_id), OUTCOME_KEEP_SECONDS)


def _place_version(version_id: int, *, last_try: bool) -> dict:
    version = CapabilityVersion.objects.select_related("capability__agent").filter(pk=version_id).first()
    if version is None:
        return {"status": VersionPlacement.SUPERSEDED, "code": "not_found", "message": "the version no longer exists"}
    capability = version.capability
    if version.placement != VersionPlacement.PLACING:  # delivered twice: done already
        return _outcome_of(version)
    if capability.state == State.REMOVED:
        return _record_superseded(version, f"{capability.full_name} was removed before v{version.number} was placed")
    # A newer deploy (being placed, or placed) supersedes this one; a newer one refused does
    # not, nor does a staged version (kept aside, not deployed).
    newer = (
        capability.versions.filter(
            number__gt=version.number, placement__in=(VersionPlacement.PLACING, VersionPlacement.PLACED)
        )
        .exclude(pk=capability.staged_version_id or 0)
        .order_by("number")
        .values_list("number", flat=True)
    )
    if newer:
        return _record_superseded(version, f"v{newer[0]} was deployed before v{version.number} was placed")
    runtime = get_runtime()
    try:
        resolved = binding_rules.bindings_resolve(
            version.requested.get("bindings", []), agent_id=capability.agent_id, supported_kinds=runtime.binding_kinds
        )
        bundle = CodeBundle.from_code(version.code, bindings=resolved, cpu_ms=capability.cpu_ms, version=version.number)
        room_for = {
            "full": capability.full_name,
            "capability_type": capability.type,
            "expires_at": capability.expires_at,
        }
        with placement_room(**room_for) as room:
            placement = room.place(bundle)
            placed = _record_placed(version, placement=placement, bundle_sha=bundle.sha)
    except SigilError as exc:
        if isinstance(exc, TRANSIENT_DEPLOY_FAILURES) and not last_try:
            raise
        if isinstance(exc, (InvalidRequest, TooLarge)):
            # Refused code: nothing was deployed, so the fixed code need not wait out a cool-down.
            get_redis().delete(_cooldown_key(capability.agent.name))
        return _record_failed(version_id, exc)
    routes.route_publish(placed)
    contract_copies.contract_publish(placed)
    return {"status": VersionPlacement.PLACED, "cold_start": placement.cold_start, "evicted": placement.evicted}


def _record_placed(version: CapabilityVersion, *, placement: Placement, bundle_sha: str) -> Capability:
    requested = version.requested
    now = timezone.now()
    with transaction.atomic():
        capability = Capability.objects.select_for_update().select_related("agent").get(pk=version.capability_id)
        created = capability.current_version_id is None
        capability.current_version = version
        capability.is_public = requested.get("public", capability.is_public)
        capability.bindings = requested.get("bindings", capability.bindings)
        if requested.get("cache_when_degraded") is not None:
            capability.cache_when_degraded = requested["cache_when_degraded"]
        capability.state = State.LIVE
        capability.slot = placement.slot
        capability.placed_sha = bundle_sha
        capability.backend = placement.backend
        capability.updated_at = now
        capability.save()
        CapabilityVersion.objects.filter(pk=version.pk).update(placement=VersionPlacement.PLACED, failure=None)
        if requested.get("restores") is not None:  # a rollback, audited as the one in the request is
            action = "capability.rolled_back"
            detail = {"version": version.number, "restored_version": requested["restores"], "sha": version.sha}
        else:
            action = "capability.created" if created else "capability.deployed"
            detail = {
                "version": version.number,
                "sha": version.sha,
                "type": capability.type,
                "public": capability.is_public,
                "bindings": capability.bindings,
            }
        audit_record(
            actor=requested.get("actor", "system"),
            action=action,
            agent_name=capability.agent.name,
            subject=capability.full_name,
            detail=detail,
        )
    return capability


def _record_failed(version_id: int, error: SigilError) -> dict:
    failure: dict = {"code": error.code, "message": error.message}
    if error.retry_after is not None:
        failure["retry_after"] = error.retry_after
    with transaction.atomic():
        version = CapabilityVersion.objects.select_related("capability__agent").filter(pk=version_id).first()
        if version is None:
            return {"status": VersionPlacement.FAILED, **failure}
        CapabilityVersion.objects.filter(pk=version_id).update(placement=VersionPlacement.FAILED, failure=failure)
        capability = version.capability
        # A capability that never had a version placed has nothing to serve.
        Capability.objects.filter(pk=capability.pk, current_version=None).exclude(state=State.REMOVED).update(
            state=State.FAILED, updated_at=timezone.now()
        )
        audit_record(
            actor=version.requested.get("actor", "system"),
            action="capability.deploy_failed",
            agent_name=capability.agent.name,
            subject=capability.full_name,
            detail={"version": version.number, **failure},
        )
    return {"status": VersionPlacement.FAILED, **failure}


def _record_superseded(version: CapabilityVersion, message: str) -> dict:
    failure = {"code": "conflict", "message": message}
    CapabilityVersion.objects.filter(pk=version.pk).update(placement=VersionPlacement.SUPERSEDED, failure=failure)
    return {"status": VersionPlacement.SUPERSEDED, **failure}


def _outcome_of(version: CapabilityVersion) -> dict:
    if version.placement == VersionPlacement.PLACED:
        return {"status": VersionPlacement.PLACED, "cold_start": False, "evicted": None}
    return {"status": version.placement, **(version.failure or {"code": "conflict", "message": "not placed"})}


def _unused_ephemeral_name(agent_name: str) -> str:
    for _ in range(20):
        full = names.full_name(agent_name, names.new_ephemeral_name())
        if not Capability.objects.filter(full_name=full).exists():
            return full
    raise Conflict("could not find a free ephemeral name; retry")


def _record_deploy(
    new: NewVersion,
    placement: Placement,
    *,
    bundle_sha: str,
    bindings: list[str],
    is_public: bool,
    principal: Principal,
) -> tuple[Capability, CapabilityVersion]:
    """A new version placed in the request, made current."""
    with transaction.atomic():
        capability = new.capability_locked(is_public=is_public, bindings=bindings, state=State.LIVE)
        version = new.create_version(capability)
        capability.current_version = version
        capability.is_public = is_public
        capability.bindings = bindings
        capability.state = State.LIVE
        capability.slot = placement.slot
        capability.placed_sha = bundle_sha
        capability.backend = placement.backend
        capability.updated_at = new.now
        capability.save()
        audit_record(
            actor=_actor(principal),
            action="capability.created" if new.existing is None else "capability.deployed",
            agent_name=new.owner.name,
            subject=new.full,
            detail={
                "version": version.number,
                "sha": new.sha,
                "type": new.type,
                "public": is_public,
                "bindings": bindings,
                "contract": [name for name, value in new.contract.as_fields().items() if value],
            },
        )
    capability.agent = new.owner
    return capability, version


def _next_version_number(capability: Capability) -> int:
    """Versions are numbered from 1 and never reused while their rows stay."""
    return (capability.versions.aggregate(n=Max("number"))["n"] or 0) + 1


def _redeploy_unchanged(capability: Capability, *, principal: Principal, is_public: bool) -> DeployResult:
    """Same code and bindings again: keep the version; only the public flag may change."""
    if capability.is_public != is_public:
        with transaction.atomic():
            Capability.objects.filter(pk=capability.pk).update(is_public=is_public, updated_at=timezone.now())
            audit_record(
                actor=_actor(principal),
                action="capability.updated",
                agent_name=principal.agent_name,
                subject=capability.full_name,
                detail={"public": is_public},
            )
        capability.refresh_from_db()
        routes.route_publish(capability)
    return DeployResult(
        capability=capability, version=capability.current_version, created=False, cold_start=False, evicted=None
    )


def capability_remove(*, principal: Principal, full: str) -> Capability:
    """An agent removes one of its capabilities: stop serving now, delete from the runtime
    in the background. The row and its versions stay (state removed) for the audit trail.

    Raises Forbidden (not the caller's prefix, or no deploy scope) or NotFound.
    """
    agent_name, _ = names.split_full_name(full)
    if not principal.can_deploy:
        raise Forbidden("removing needs a token with the deploy scope")
    if agent_name != principal.agent_name:
        raise Forbidden(f"{full} is not under {principal.agent_name}'s prefix")
    return _remove(full=full, actor=_actor(principal), action="capability.removed")


def capability_remove_as_owner(*, full: str, actor: str) -> Capability:
    """The owner removes any capability, as capability_remove does. Raises NotFound."""
    return _remove(full=full, actor=actor, action="capability.removed")


def _remove(*, full: str, actor: str, action: str, only_if_expired_by: datetime | None = None) -> Capability:
    # Under the placement lock: a deploy or page-in under way finishes first (it would
    # otherwise record the capability live again), and the pager's sets change with the row.
    with placement_lock(full, blocking=True):
        now = timezone.now()
        with transaction.atomic():
            query = Capability.objects.select_for_update().exclude(state=State.REMOVED).filter(full_name=full)
            if only_if_expired_by is not None:
                query = query.filter(expires_at__lte=only_if_expired_by)
            capability = query.first()
            if capability is None:
                raise NotFound(f"no capability {full}")
            capability.state = State.REMOVED
            capability.removed_at = now
            capability.updated_at = now
            capability.save(update_fields=["state", "removed_at", "updated_at"])
            audit_record(actor=actor, action=action, agent_name=capability.agent.name, subject=full)
            capability_release_slot_task.delay_on_commit(capability_id=capability.pk)
        routes.route_withdraw(full)
        # A capability deployed later under the same name starts with no failures (nor call
        # records) of this one.
        failures.failures_forget(full=full)
        call_logs.call_records_forget(full=full)
        # One never placed (its first deploy still queued) holds no slot to give back.
        if get_runtime().total_slots is not None and capability.slot:
            pager.pager_mark_leaving(full, now=now.timestamp())
    # The placement of a staged version in traffic goes with its capability.
    for variant in Capability.objects.filter(variant_of=capability).exclude(state=State.REMOVED):
        try:
            _remove(full=variant.full_name, actor=actor, action=action)
        except NotFound:
            continue
    return capability


def capability_expire_ephemerals(*, now: datetime | None = None, batch_size: int = 200) -> int:
    """Remove ephemerals whose TTL has passed; return how many. Safe to overlap with itself."""
    now = now or timezone.now()
    expired = list(
        Capability.objects.filter(type=CapabilityType.EPHEMERAL, expires_at__lte=now)
        .exclude(state=State.REMOVED)
        .values_list("full_name", flat=True)[:batch_size]
    )
    count = 0
    for full in expired:
        try:
            _remove(full=full, actor="system", action="capability.expired", only_if_expired_by=now)
        except NotFound:
            continue  # removed meanwhile by its agent or a concurrent expiry run
        count += 1
    return count


def capability_rollback(
    *, capability: Capability, version_number: int, actor: str, cooldown: bool = False
) -> DeployResult:
    """Serve the code of an earlier version again, placed exactly as a deploy places code.

    The rollback is a new version, numbered after the latest, with the old version's code
    and contract: history only grows, the version an agent reads never goes back, and the audit trail
    says which version was restored. The capability keeps its current bindings and public
    flag (they are not versioned). The agent's deploy cool-down applies only with `cooldown`
    (an agent's own rollback, capability_rollback_by_agent), as to a deploy: claimed once
    the rollback changes something, given back when the runtime refuses the code.
    Rolling back to the code and contract that are already current changes nothing (as a
    deploy of the same code does). Raises NotFound (no such version, or the capability was removed),
    Conflict (a deploy of it is in progress), Cooldown, and what placing code raises (TooLarge,
    InvalidRequest, UpstreamError).
    """
    full = capability.full_name
    target = CapabilityVersion.objects.filter(capability_id=capability.pk, number=version_number).first()
    if target is None:
        raise NotFound(f"{full} has no version {version_number}")
    # A removed capability is not found whoever holds its lock (its slot release may).
    if not Capability.objects.exclude(state=State.REMOVED).filter(pk=capability.pk).exists():
        raise NotFound(f"no capability {full}")
    if get_runtime().places_in_background:
        with _deploy_lock(full):
            ordered = _rollback_in_background(capability, target=target, actor=actor, cooldown=cooldown)
        return deploy_awaited(ordered)
    lock = placement_lock(full, blocking=False)
    if not lock.acquire():
        raise Conflict(f"{full} is being deployed; retry when it is done")
    try:
        current, unchanged = _rollback_start(capability, target)
        if unchanged is not None:
            return unchanged
        if cooldown:
            _claim_cooldown(current.agent.name)
        bundle = bundle_for(target.code, current, get_runtime())
        with placement_room(full=full, capability_type=current.type, expires_at=current.expires_at) as room:
            try:
                placement = room.place(bundle)
            except (InvalidRequest, TooLarge):
                if cooldown:  # nothing was placed: as for a refused deploy
                    get_redis().delete(_cooldown_key(current.agent.name))
                raise
            locked = _record_rollback(current, target=target, placement=placement, bundle_sha=bundle.sha, actor=actor)
        routes.route_publish(locked)
        contract_copies.contract_publish(locked)
    finally:
        lock.release()
    capability.refresh_from_db()
    return DeployResult(
        capability=locked,
        version=locked.current_version,
        created=False,
        cold_start=placement.cold_start,
        evicted=placement.evicted,
    )


# Why a version's code may not be restored by its agent, by its placement: it never ran.
NOT_RESTORABLE = {
    VersionPlacement.FAILED: "was refused when it was deployed",
    VersionPlacement.SUPERSEDED: "was never placed (a newer deploy came first)",
    VersionPlacement.PLACING: "is still being placed",
}


def capability_rollback_by_agent(*, principal: Principal, full: str, version_number: int) -> DeployResult:
    """An agent rolls one of its capabilities back to an earlier version (REST and MCP): the
    owner's rollback (capability_rollback), audited with the agent as actor and under the
    agent's deploy cool-down. The restored version carries the old version's contract with
    its code. Only a version whose code the runtime accepted may be restored.

    Raises Forbidden (no deploy scope, another agent's capability), NotFound, InvalidRequest
    (a version refused, superseded or still placing), Conflict (the staged version, which a
    split or a promote puts in service; a deploy in progress), Cooldown, and what placing
    code raises. Idempotent: rolling back to the code and contract served changes nothing.
    """
    if not principal.can_deploy:
        raise Forbidden("rolling back needs a token with the deploy scope")
    capability = selectors.capability_get_owned(principal=principal, full=full)
    target = CapabilityVersion.objects.filter(capability_id=capability.pk, number=version_number).first()
    if target is None:
        raise NotFound(f"{full} has no version {version_number}: GET /_api/capabilities/{full}/versions lists them")
    if target.placement in NOT_RESTORABLE:
        raise InvalidRequest(f"v{version_number} of {full} {NOT_RESTORABLE[target.placement]}; roll back to another")
    if target.pk == capability.staged_version_id:
        raise Conflict(
            f"v{version_number} of {full} is staged, never served: start a split with it, or promote it "
            f"(POST /_api/capabilities/{full}/split/promote)"
        )
    return capability_rollback(
        capability=capability, version_number=version_number, actor=_actor(principal), cooldown=True
    )


def _rollback_start(capability: Capability, target: CapabilityVersion) -> tuple[Capability, DeployResult | None]:
    """The capability as it is now, and the rollback's answer already when its current
    version has the target's code and contract (nothing to do). Raises NotFound."""
    current = (
        Capability.objects.select_related("agent", "current_version")
        .exclude(state=State.REMOVED)
        .filter(pk=capability.pk)
        .first()
    )
    if current is None:
        raise NotFound(f"no capability {capability.full_name}")
    version = current.current_version
    if version is None or (version.sha, Contract.of(version)) != (target.sha, Contract.of(target)):
        return current, None
    return current, DeployResult(capability=current, version=version, created=False, cold_start=False, evicted=None)


def _rollback_in_background(
    capability: Capability, *, target: CapabilityVersion, actor: str, cooldown: bool
) -> DeployResult | Queued:
    """A rollback on a runtime whose placements run in Celery: the target's code and contract
    recorded as a new version and placed by the deploy task, as a deploy is (202 when it
    takes longer than SIGIL_DEPLOY_WAIT_SECONDS)."""
    current, unchanged = _rollback_start(capability, target)
    if unchanged is not None:
        return unchanged
    if cooldown:
        _claim_cooldown(current.agent.name)  # the task gives it back if the code is refused
    new = NewVersion(
        owner=current.agent,
        existing=current,
        full=current.full_name,
        type=current.type,
        expires_at=current.expires_at,
        code=target.code,
        sha=target.sha,
        contract=Contract.of(target),
        now=timezone.now(),
    )
    requested = {"bindings": current.bindings, "public": current.is_public, "actor": actor, "restores": target.number}
    return _deploy_in_background(new, requested)


def _record_rollback(
    current: Capability, *, target: CapabilityVersion, placement: Placement, bundle_sha: str, actor: str
) -> Capability:
    full = current.full_name
    now = timezone.now()
    with transaction.atomic():
        locked = Capability.objects.select_for_update().get(pk=current.pk)
        number = _next_version_number(locked)
        version = CapabilityVersion.objects.create(
            capability=locked,
            number=number,
            code=target.code,
            sha=target.sha,
            size_bytes=target.size_bytes,
            created_at=now,
            **Contract.of(target).as_fields(),
        )
        locked.current_version = version
        locked.state = State.LIVE
        locked.slot = placement.slot
        locked.placed_sha = bundle_sha
        locked.backend = placement.backend
        locked.updated_at = now
        locked.save(update_fields=["current_version", "state", "slot", "placed_sha", "backend", "updated_at"])
        audit_record(
            actor=actor,
            action="capability.rolled_back",
            agent_name=current.agent.name,
            subject=full,
            detail={"version": number, "restored_version": target.number, "sha": target.sha},
        )
    locked.agent = current.agent
    return locked
