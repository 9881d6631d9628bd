"""The registry's deploys: validation, names, the cool-down, and a new version placed in the
request (services/deploy_task.py places it on the Cloudflare runtimes). Versions
(versions.py), rollbacks (rollbacks.py) and removals (removal.py) live beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any

from django.conf import settings
from django.utils import timezone

from agents.models import Agent
from agents.services import audit_record
from agents.tokens import Principal
from capabilities import bindings as binding_rules
from capabilities import names
from capabilities.contracts import Contract, contract_merge
from capabilities.models import Capability, CapabilityType, CapabilityVersion, DeployRequest, State
from capabilities.runtimes import get_runtime
from capabilities.runtimes.base import CodeBundle, code_sha
from capabilities.services.deploy_task import Queued, deploy_awaited, deploy_in_background
from capabilities.services.placement_lock import placement_lock_within
from capabilities.services.records import Placement, capability_audit, capability_written, record_live
from capabilities.services.room import placement_room
from capabilities.services.versions import (
    DeployResult,
    NewVersion,
    actor_of,
    cooldown_claim,
    cooldown_give_back,
    deploy_lock,
    latest_accepted,
    stage,
    stage_allowed,
)
from sigil.errors import Conflict, Forbidden, InvalidRequest, NotFound, RateLimited, TooLarge


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
    runtime = get_runtime()
    resolved = binding_rules.bindings_resolve(
        bindings, agent_id=principal.agent_id, supported_kinds=runtime.binding_kinds
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
        code=code,
        resolved=resolved,
        contract=contract or {},
        applies=DeployRequest(
            bindings=bindings, public=is_public, cache_when_degraded=cache_when_degraded, actor=actor_of(principal)
        ),
        stage=stage,
        expires_at=now + timedelta(seconds=ttl) if ttl is not None else None,
        now=now,
        in_background=runtime.places_in_background,
    )
    # Linearizable per capability: what this deploy compares itself with (the version that
    # serves, or the one still being placed) is read under the lock that orders deploys of
    # `full`, so a deploy never answers a no-op from a state a concurrent deploy is changing.
    if asked.in_background:
        # Only the recording is ordered here; the placements are, by the placement lock
        # each deploy task waits on in turn (a version deployed after it supersedes it).
        with deploy_lock(full):
            ordered = _deploy_ordered(asked)
        return deploy_awaited(ordered)
    # The placement is made in the request: a deploy waits its turn behind the one being placed.
    with placement_lock_within(full, wait_seconds=None):
        return _deploy_ordered(asked)


@dataclass(frozen=True)
class DeployAsked:
    """A deploy's input once checked, before it is compared with the capability's state: what
    it sends, where it goes, and what applies to the capability once its version is placed."""

    principal: Principal
    owner: Agent
    full: str
    named: bool  # False: a new ephemeral, named by Sigil
    type: str
    code: str
    resolved: Any  # the bindings as the runtime gets them (bindings.bindings_resolve)
    contract: Mapping[str, Any]  # the contract's fields sent; those omitted keep their value
    # The bindings and the public flag (omitted ones already kept), the cached answer while
    # degraded and who deploys: kept as they are on the version when a task places it.
    applies: DeployRequest
    stage: bool
    expires_at: datetime | None  # of the capability, when this deploy creates it
    now: datetime
    # Whether the runtime places in a Celery task (the deploy answers when it is recorded),
    # decided once: how the deploy is ordered and how it is placed both follow it.
    in_background: bool

    @cached_property
    def sha(self) -> str:
        return code_sha(self.code)


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
            return stage(
                existing,
                full=full,
                type=asked.type,
                code=asked.code,
                sha=asked.sha,
                bindings=asked.applies.bindings,
                contract=wanted,
                principal=asked.principal,
            )
        if latest is not None and latest.sha == asked.sha and wanted == Contract.of(latest):
            placing = latest.deploy_request
            applies = asked.applies
            if pending and (placing.bindings, placing.public) == (applies.bindings, applies.public):
                # The same deploy as the one still being placed: it is the one that will serve.
                # (Its own cache_when_degraded, if it sent one, applies once it is placed.)
                created = existing.current_version_id is None
                return DeployResult.not_placed(existing, latest, created=created, pending=True)
            elif not pending and existing.bindings == applies.bindings:
                result = _redeploy_unchanged(existing, actor=applies.actor, is_public=applies.public)
                return _set_cache_when_degraded(result, applies.cache_when_degraded, actor=applies.actor)

    owner = asked.owner
    cooldown_claim(owner.name)
    now = asked.now
    expires_at = existing.expires_at if existing else asked.expires_at
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
    if asked.in_background:
        return deploy_in_background(new, asked.applies)
    bundle = CodeBundle.from_code(asked.code, bindings=asked.resolved)
    with placement_room(full=full, capability_type=asked.type, expires_at=expires_at) as room:
        try:
            placement = room.place(bundle)
        except (InvalidRequest, TooLarge):
            cooldown_give_back(owner.name)
            raise
        capability, version = _record_deploy(new, placement, bundle_sha=bundle.sha, asked=asked)
    result = DeployResult(
        capability=capability,
        version=version,
        created=existing is None,
        cold_start=placement.cold_start,
        evicted=placement.evicted,
    )
    return _set_cache_when_degraded(result, asked.applies.cache_when_degraded, actor=asked.applies.actor)


def _set_cache_when_degraded(result: DeployResult, value: bool | None, *, actor: str) -> DeployResult:
    """Turn the cached answer while degraded on or off as the deploy asked; omitted keeps it."""
    capability = result.capability
    if value is not None and capability.cache_when_degraded != value:
        _update(capability, actor=actor, detail={"cache_when_degraded": value}, cache_when_degraded=value)
    return result


def _update(capability: Capability, *, actor: str, detail: dict, **fields: Any) -> None:
    """Change what a redeploy changes without a new version (the public flag, the cached
    answer while degraded), audited as `capability.updated` with `detail`."""
    with capability_written(capability.full_name):
        Capability.objects.filter(pk=capability.pk).update(**fields, updated_at=timezone.now())
        capability_audit(capability, actor=actor, action="capability.updated", detail=detail)
    for name, value in fields.items():
        setattr(capability, name, value)


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


def _unused_ephemeral_name(agent_name: str) -> str:
    for _ in range(20):
        full = names.full_name(agent_name, names.new_ephemeral_name())
        if not Capability.objects.filter(full_name=full).exists():
            return full
    raise Conflict("could not find a free ephemeral name; retry")


def _record_deploy(
    new: NewVersion, placement: Placement, *, bundle_sha: str, asked: DeployAsked
) -> tuple[Capability, CapabilityVersion]:
    """A new version placed in the request, made current with the bindings and public flag
    `asked` for."""
    fields = {"is_public": asked.applies.public, "bindings": asked.applies.bindings}
    with capability_written(new.full):
        capability = new.capability_locked(state=State.LIVE, **fields)
        version = new.create_version(capability)
        record_live(capability, placement, bundle_sha=bundle_sha, version=version, now=new.now, **fields)
        audit_record(
            actor=asked.applies.actor,
            action="capability.created" if new.existing is None else "capability.deployed",
            agent_name=new.owner.name,
            subject=new.full,
            detail={
                "version": version.number,
                "sha": new.sha,
                "type": new.type,
                "public": asked.applies.public,
                "bindings": asked.applies.bindings,
                "contract": [name for name, value in new.contract.as_fields().items() if value],
            },
        )
    capability.agent = new.owner
    return capability, version


def _redeploy_unchanged(capability: Capability, *, actor: str, is_public: bool) -> DeployResult:
    """Same code and bindings again: keep the version; only the public flag may change."""
    if capability.is_public != is_public:
        _update(capability, actor=actor, detail={"public": is_public}, is_public=is_public)
    return DeployResult.not_placed(capability, capability.current_version)
