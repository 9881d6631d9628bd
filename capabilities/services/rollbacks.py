"""Rolling a capability back to an earlier version: the owner's rollback and the agent's."""

from __future__ import annotations

from agents.tokens import Principal
from capabilities import selectors
from capabilities.contracts import Contract
from capabilities.models import Capability, CapabilityVersion, DeployRequest, State, VersionPlacement
from capabilities.runtimes import get_runtime
from capabilities.services import versions
from capabilities.services.deploy_task import Queued, deploy_awaited, deploy_in_background
from capabilities.services.placement_lock import held, placement_lock
from capabilities.services.records import (
    Placement,
    capability_audit,
    capability_current,
    capability_written,
    record_live,
)
from capabilities.services.room import bundle_for, room_for
from capabilities.services.versions import DeployResult
from sigil.errors import Conflict, Forbidden, InvalidRequest, NotFound, TooLarge

# Why a version's code may not be restored by its agent, by its placement: it never ran.
NOT_RESTORABLE = {
    VersionPlacement.FAILED: "was refused when it was deployed",
    VersionPlacement.SUPERSEDED: "was never placed (a newer deploy came first)",
    VersionPlacement.PLACING: "is still being placed",
}


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
        with versions.deploy_lock(full):
            ordered = _rollback_in_background(capability, target=target, actor=actor, cooldown=cooldown)
        return deploy_awaited(ordered)
    with held(placement_lock(full, blocking=False), busy=Conflict(f"{full} is being deployed; retry when it is done")):
        current, unchanged = _rollback_start(capability, target)
        if unchanged is not None:
            return unchanged
        if cooldown:
            versions.cooldown_claim(current.agent.name)
        bundle = bundle_for(target.code, current, get_runtime())
        with room_for(current) as room:
            try:
                placement = room.place(bundle)
            except (InvalidRequest, TooLarge):
                if cooldown:  # nothing was placed: as for a refused deploy
                    versions.cooldown_give_back(current.agent.name)
                raise
            locked = _record_rollback(current, target=target, placement=placement, bundle_sha=bundle.sha, actor=actor)
    capability.refresh_from_db()
    return DeployResult(
        capability=locked,
        version=locked.current_version,
        created=False,
        cold_start=placement.cold_start,
        evicted=placement.evicted,
    )


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
        capability=capability, version_number=version_number, actor=versions.actor_of(principal), cooldown=True
    )


def _rollback_start(capability: Capability, target: CapabilityVersion) -> tuple[Capability, DeployResult | None]:
    """The capability as it is now, and the rollback's answer already when its current
    version has the target's code and contract (nothing to do). Raises NotFound."""
    current = capability_current(capability.full_name, "agent", "current_version")
    if current is None or current.pk != capability.pk:
        raise NotFound(f"no capability {capability.full_name}")
    version = current.current_version
    if version is None or (version.sha, Contract.of(version)) != (target.sha, Contract.of(target)):
        return current, None
    return current, DeployResult.not_placed(current, version)


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
        versions.cooldown_claim(current.agent.name)  # the task gives it back if the code is refused
    new = versions.NewVersion.of(current, target)
    request = DeployRequest(bindings=current.bindings, public=current.is_public, actor=actor, restores=target.number)
    return deploy_in_background(new, request)


def _record_rollback(
    current: Capability, *, target: CapabilityVersion, placement: Placement, bundle_sha: str, actor: str
) -> Capability:
    new = versions.NewVersion.of(current, target)
    with capability_written(current.full_name):
        locked = new.capability_locked()
        version = new.create_version(locked)
        record_live(locked, placement, bundle_sha=bundle_sha, version=version, now=new.now)
        capability_audit(
            current,
            actor=actor,
            action="capability.rolled_back",
            detail={"version": version.number, "restored_version": target.number, "sha": target.sha},
        )
    locked.agent = current.agent
    return locked
