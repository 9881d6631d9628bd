"""Deploys placed by a Celery task (runtimes with `places_in_background`).

The request records the version (`placing`) with what it asked for (a DeployRequest) and
queues its placement; the task places it, makes it current, and announces the outcome on a
Redis list the request waits on for up to SIGIL_DEPLOY_WAIT_SECONDS. A request that stops
waiting answers 202; the outcome stays on the version (inspect's `deploy`, `/_status/{full}`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from capabilities import bindings as binding_rules
from capabilities.jobs import capability_place_version as capability_place_version_task
from capabilities.models import Capability, CapabilityVersion, DeployRequest, State, VersionPlacement
from capabilities.runtimes import get_runtime
from capabilities.runtimes.base import CodeBundle
from capabilities.runtimes.errors import RuntimeUnavailable
from capabilities.services.placement_lock import placement_lock_within
from capabilities.services.records import Placement, capability_audit, capability_written, record_live
from capabilities.services.room import room_for
from capabilities.services.versions import DeployResult, NewVersion, cooldown_give_back
from sigil import leases, redis_keys
from sigil.errors import (
    InvalidRequest,
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

# How long an outcome waits on its list for a request that is still waiting on it.
OUTCOME_KEEP_SECONDS = 120
# How often a stranded deploy is sent again before it is ended as failed.
DEPLOY_RESENDS = 3
# Failures that may pass: the runtime unreachable, no room yet, the lock held too long.
TRANSIENT_DEPLOY_FAILURES = (UpstreamError, Timeout)


@dataclass(frozen=True)
class Queued:
    """A version recorded and handed to the deploy task, whose outcome is still to be awaited
    (`deploy_awaited`), after the lock that orders deploys is released."""

    new: NewVersion
    capability: Capability
    version: CapabilityVersion


def deploy_in_background(new: NewVersion, request: DeployRequest) -> Queued:
    """Record the new version and hand its placement to a Celery task. `request` holds what
    applies once it is placed."""
    # Called with the lock that orders deploys of `full` held, never its placement lock: a
    # placement under way (an earlier deploy's task, a page-in) ends before this version's
    # task places it, and an earlier version not yet placed is superseded by this one.
    with capability_written(new.full) as write:
        # A new capability is recorded without a current version (not served: its calls are
        # 404 until the version is placed).
        capability = new.capability_locked(
            is_public=bool(request.public), bindings=request.bindings, state=State.PAGED_OUT
        )
        version = new.create_version(capability, placement=VersionPlacement.PLACING, requested=request.to_json())
        if new.existing is not None:
            write.unchanged()  # only a version is added: the row serves as it did
    capability.agent = new.owner
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
        return DeployResult.not_placed(capability, version, created=new.existing is None, pending=True)
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


def _await_outcome(version_id: int, *, seconds: float) -> dict | None:
    """The placement's outcome, or None when it has not come within `seconds`. Waits in
    short blocking reads, each well inside the Redis client's socket timeout."""
    redis = get_redis()
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        popped = redis.blpop([redis_keys.deploy_outcome(version_id)], timeout=min(1.0, max(left, 0.01)))
        if popped is not None:
            return json.loads(popped[1])
    return None


def _forget_refused(version: CapabilityVersion) -> None:
    """A deploy refused while its request still waited leaves nothing, as one placed in the
    request does: the version goes, and so does a capability it would have created. The
    audit trail keeps the failure."""
    with capability_written(version.capability.full_name) as write:
        CapabilityVersion.objects.filter(pk=version.pk).delete()
        deleted, _ = Capability.objects.filter(
            pk=version.capability_id, current_version=None, versions__isnull=True
        ).delete()
        if not deleted:
            write.unchanged()  # only the version went: the capability serves as it did


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
        return _gone()
    owner = leases.Lease(
        redis_keys.deploy_owner(version_id), hold_seconds=2 * settings.SIGIL_PLACEMENT_LOCK_SECONDS, blocking=False
    )
    owner.acquire()  # not acquired: a duplicate delivery is at work, the placement lock orders them
    redis = get_redis()
    redis.delete(redis_keys.deploy_retry(version_id))
    last_try = retries >= max_retries
    try:
        with placement_lock_within(full, wait_seconds=None):
            outcome = _place_version(version_id, last_try=last_try)
    except TRANSIENT_DEPLOY_FAILURES as exc:
        if not last_try:
            countdown = retry_countdown(retries=retries)
            # The worker holds the retry, unacknowledged, for its countdown.
            redis.set(redis_keys.deploy_retry(version_id), 1, px=int((countdown + leases.lease_seconds()) * 1000))
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


def capability_reap_deploys() -> dict[str, int]:
    """Deploys and rollbacks placed by a task that nobody owns any more (the worker placing
    them died, its message not yet given back by the broker): a version still `placing` a
    lease after it was recorded, with no task's lease on it (`redis_keys.deploy_owner`), no retry
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
        if redis.exists(
            redis_keys.deploy_owner(version.pk), redis_keys.deploy_retry(version.pk), redis_keys.place_lock(full)
        ):
            continue
        sends_key = redis_keys.deploy_resent(version.pk)
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
        capability_audit(
            version.capability,
            actor="system",
            action="capability.deploy_resent",
            detail={"version": version.number, "resend": sends, "reason": "no worker owns its placement"},
        )
        capability_place_version_task.delay(version_id=version.pk)
        resent += 1
    return {"deploys_resent": resent, "deploys_failed": failed}


def _announce(version_id: int, outcome: dict) -> None:
    """Hand the outcome to the request waiting on it, if it still is."""
    redis = get_redis()
    redis.rpush(redis_keys.deploy_outcome(version_id), json.dumps(outcome))
    redis.expire(redis_keys.deploy_outcome(version_id), OUTCOME_KEEP_SECONDS)


def _gone() -> dict:
    return {"status": VersionPlacement.SUPERSEDED, "code": "not_found", "message": "the version no longer exists"}


def _place_version(version_id: int, *, last_try: bool) -> dict:
    version = CapabilityVersion.objects.select_related("capability__agent").filter(pk=version_id).first()
    if version is None:
        return _gone()
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
            version.deploy_request.bindings, agent_id=capability.agent_id, supported_kinds=runtime.binding_kinds
        )
        bundle = CodeBundle.from_code(version.code, bindings=resolved, cpu_ms=capability.cpu_ms, version=version.number)
        with room_for(capability) as room:
            placement = room.place(bundle)
            _record_placed(version, placement=placement, bundle_sha=bundle.sha)
    except SigilError as exc:
        if isinstance(exc, TRANSIENT_DEPLOY_FAILURES) and not last_try:
            raise
        if isinstance(exc, (InvalidRequest, TooLarge)):
            cooldown_give_back(capability.agent.name)
        return _record_failed(version_id, exc)
    return {"status": VersionPlacement.PLACED, "cold_start": placement.cold_start, "evicted": placement.evicted}


def _record_placed(version: CapabilityVersion, *, placement: Placement, bundle_sha: str) -> Capability:
    asked = version.deploy_request
    with capability_written(version.capability.full_name):
        capability = Capability.objects.select_for_update().select_related("agent").get(pk=version.capability_id)
        created = capability.current_version_id is None
        also = {"is_public": capability.is_public if asked.public is None else asked.public, "bindings": asked.bindings}
        if asked.cache_when_degraded is not None:
            also["cache_when_degraded"] = asked.cache_when_degraded
        record_live(capability, placement, bundle_sha=bundle_sha, version=version, **also)
        CapabilityVersion.objects.filter(pk=version.pk).update(placement=VersionPlacement.PLACED, failure=None)
        if asked.restores is not None:  # a rollback, audited as the one in the request is
            action = "capability.rolled_back"
            detail = {"version": version.number, "restored_version": asked.restores, "sha": version.sha}
        else:
            action = "capability.created" if created else "capability.deployed"
            detail = {
                "version": version.number,
                "sha": version.sha,
                "type": capability.type,
                "public": capability.is_public,
                "bindings": capability.bindings,
            }
        capability_audit(capability, actor=asked.actor, action=action, detail=detail)
    return capability


def _record_failed(version_id: int, error: SigilError) -> dict:
    failure: dict = {"code": error.code, "message": error.message}
    if error.retry_after is not None:
        failure["retry_after"] = error.retry_after
    version = CapabilityVersion.objects.select_related("capability__agent").filter(pk=version_id).first()
    if version is None:
        return {"status": VersionPlacement.FAILED, **failure}
    capability = version.capability
    with capability_written(capability.full_name) as write:
        CapabilityVersion.objects.filter(pk=version_id).update(placement=VersionPlacement.FAILED, failure=failure)
        # A capability that never had a version placed has nothing to serve.
        never_placed = Capability.objects.filter(pk=capability.pk, current_version=None).exclude(state=State.REMOVED)
        if not never_placed.update(state=State.FAILED, updated_at=timezone.now()):
            write.unchanged()  # only the version failed: the capability serves as it did
        capability_audit(
            capability,
            actor=version.deploy_request.actor,
            action="capability.deploy_failed",
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
