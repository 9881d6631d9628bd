"""Writes on capabilities: deploy, remove, page in, expiry, stats and breaker bookkeeping.

Every rule of the seeds lives here (or in names.py); API views, tasks, the admin and
commands call these functions and translate their results.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Max, Q, Sum
from django.utils import timezone

from agents.models import Agent, Token
from agents.services import agent_notify, audit_record
from agents.tokens import Principal
from capabilities import bindings as binding_rules
from capabilities import names, pager, routes, stats
from capabilities.models import (
    BreakerState,
    Capability,
    CapabilityStatsWindow,
    CapabilityType,
    CapabilityVersion,
    State,
)
from capabilities.runtimes import get_runtime, runtime_for
from capabilities.runtimes.base import (
    CodeBundle,
    Runtime,
    RuntimeRejected,
    RuntimeUnavailable,
    ScriptTooLarge,
    code_sha,
)
from capabilities.tasks import capability_page_out as capability_page_out_task
from capabilities.tasks import capability_release_slot as capability_release_slot_task
from sigil_site.errors import (
    Conflict,
    Cooldown,
    Forbidden,
    InvalidRequest,
    NotFound,
    RateLimited,
    SigilError,
    TooLarge,
    UpstreamError,
)
from sigil_site.redis_client import get_redis

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeployResult:
    capability: Capability
    version: CapabilityVersion
    created: bool
    cold_start: bool
    evicted: str | None


def _actor(principal: Principal) -> str:
    return f"agent:{principal.agent_name}"


def _placement_lock(full: str, *, blocking: bool):
    seconds = settings.SIGIL_PLACEMENT_LOCK_SECONDS
    return get_redis().lock(f"sigil:lock:place:{full}", timeout=seconds, blocking=blocking, blocking_timeout=seconds)


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


def _claim_cooldown(agent_name: str) -> None:
    """One real deploy per agent per cool-down. Raises Cooldown with the time left."""
    window_ms = int(settings.SIGIL_DEPLOY_COOLDOWN_SECONDS * 1000)
    if window_ms <= 0:
        return
    redis = get_redis()
    key = f"sigil:cooldown:{agent_name}"
    if not redis.set(key, 1, nx=True, px=window_ms):
        left_ms = max(redis.pttl(key), 1)
        raise Cooldown(
            f"{agent_name} deployed less than {settings.SIGIL_DEPLOY_COOLDOWN_SECONDS:g} s ago; retry later",
            retry_after=left_ms / 1000,
        )


@dataclass(frozen=True)
class Placement:
    slot: str
    backend: str  # the runtime that placed it: what the capability's row records
    cold_start: bool  # this placement paged the capability in (bounded runtimes only)
    evicted: str | None  # the victim chosen to make room, if any


# How long a page-in waits for background page-outs to free the safety margin.
ROOM_WAIT_SECONDS = 30


def _place_with_room(
    *, full: str, capability_type: str, expires_at: datetime | None, bundle: CodeBundle, was_evicting: bool
) -> Placement:
    """Place `bundle` for `full`; on a runtime with a slot limit, claim a slot first and
    evict the least recently used capability when the runtime is full.

    Call with the capability's placement lock held. Raises the errors of `_place`, and
    UpstreamError when no room frees up in time.
    """
    runtime = get_runtime()
    if runtime.total_slots is None:
        return Placement(slot=_place(full, bundle, runtime), backend=runtime.name, cold_start=False, evicted=None)
    if was_evicting:
        pager.pager_drop_evicting(full)
    deadline = time.monotonic() + ROOM_WAIT_SECONDS
    while True:
        claim = pager.pager_claim_slot(
            full=full,
            capability_type=capability_type,
            now=time.time(),
            slots=runtime.total_slots,
            safety_margin=runtime.safety_margin,
            expires_epoch=expires_at.timestamp() if expires_at else None,
        )
        if claim.outcome != "full":
            break
        if time.monotonic() > deadline:
            raise UpstreamError(f"no room on the runtime for {full}: every slot is live and page-outs are pending")
        time.sleep(0.05)
    if claim.victim:
        _mark_evicting(claim.victim)
    try:
        slot = _place(full, bundle, runtime)
    except SigilError:
        if claim.outcome != "live":
            pager.pager_forget(full)
        raise
    return Placement(slot=slot, backend=runtime.name, cold_start=claim.outcome != "live", evicted=claim.victim)


def _mark_evicting(victim: str) -> None:
    """The victim keeps serving while its page-out runs in the background."""
    with transaction.atomic():
        capability = (
            Capability.objects.select_for_update()
            .select_related("agent")
            .filter(full_name=victim, state=State.LIVE)
            .first()
        )
        if capability is None:
            return
        capability.state = State.EVICTING
        capability.updated_at = timezone.now()
        capability.save(update_fields=["state", "updated_at"])
        capability_page_out_task.delay_on_commit(full=victim)
    routes.route_publish(capability)


def _slot_for(full: str, runtime: Runtime) -> str:
    """The runtime slot `full` uses: the one it was given before on this runtime (so a pooled
    script keeps its workers.dev name across evictions), else the runtime's name for it, made
    longer while another capability already holds that name (a hash collision never
    overwrites). A slot on another runtime (before a switch of SIGIL_BACKEND) is not reused."""
    current = (
        Capability.objects.exclude(state=State.REMOVED).filter(full_name=full).values_list("slot", "backend").first()
    )
    if current and current[0] and current[1] in ("", runtime.name):
        return current[0]
    for attempt in range(8):
        slot = runtime.slot_for(full, attempt=attempt)
        taken = (
            Capability.objects.exclude(state=State.REMOVED)
            .exclude(full_name=full)
            .filter(slot=slot, backend__in=("", runtime.name))
            .exists()
        )
        if not taken:
            return slot
    raise Conflict(f"no free runtime name for {full}")


def _place(full: str, bundle: CodeBundle, runtime: Runtime) -> str:
    """Put `bundle` on `runtime` for `full`; return the slot. Runtime errors become API errors."""
    slot = _slot_for(full, runtime)
    try:
        runtime.place(slot=slot, bundle=bundle)
    except ScriptTooLarge as exc:
        raise TooLarge(f"the runtime refused the script as too large: {exc}") from exc
    except RuntimeRejected as exc:
        raise InvalidRequest(f"the runtime refused the script: {exc}") from exc
    except RuntimeUnavailable as exc:
        raise UpstreamError(f"the runtime could not place {full}: {exc}") from exc
    return slot


def capability_deploy(
    *,
    principal: Principal,
    code: str,
    name: str | None = None,
    agent: str | None = None,
    type: str | None = None,
    ttl: int | None = None,
    bindings: list[str] | None = None,
    is_public: bool = False,
    now: datetime | None = None,
) -> DeployResult:
    """Deploy a new capability or a new version of one, and place it on the runtime.

    The same code again is idempotent: no new version, no runtime call, no cool-down.
    Raises InvalidRequest, Forbidden, TooLarge, Conflict (another type holds the name, or a
    concurrent deploy of it), Cooldown, RateLimited (too many ephemerals), UpstreamError.
    """
    now = now or timezone.now()
    bindings = list(bindings or [])
    type, name, ttl = _validate_deploy(
        principal=principal, agent=agent, name=name, code=code, type=type, ttl=ttl, bindings=bindings
    )
    sha = code_sha(code)
    resolved = binding_rules.bindings_resolve(bindings, supported_kinds=get_runtime().binding_kinds)
    owner = Agent.objects.get(pk=principal.agent_id)

    existing = None
    if name is not None:
        full = names.full_name(owner.name, name)
        existing = (
            Capability.objects.select_related("current_version")
            .exclude(state=State.REMOVED)
            .filter(full_name=full)
            .first()
        )
        if existing is None and type == CapabilityType.EPHEMERAL:
            raise NotFound(f"no ephemeral capability {full}: deploy with name null to create one")
        if existing is not None and existing.type != type:
            raise Conflict(f"{full} is a {existing.type} capability; it cannot be redeployed as {type}")
        unchanged = existing is not None and existing.current_version and existing.current_version.sha == sha
        if unchanged and existing.bindings == bindings:
            return _redeploy_unchanged(existing, principal=principal, is_public=is_public)
    elif type == CapabilityType.EPHEMERAL:
        live_ephemerals = Capability.objects.filter(
            agent=owner, type=CapabilityType.EPHEMERAL, expires_at__gt=now
        ).exclude(state=State.REMOVED)
        if live_ephemerals.count() >= settings.SIGIL_EPHEMERAL_MAX_PER_AGENT:
            raise RateLimited(
                f"{owner.name} already has {settings.SIGIL_EPHEMERAL_MAX_PER_AGENT} live ephemeral capabilities"
            )
        full = _unused_ephemeral_name(owner.name)

    _claim_cooldown(owner.name)
    lock = _placement_lock(full, blocking=False)
    if not lock.acquire():
        raise Conflict(f"{full} is being deployed by another request; retry when it is done")
    try:
        expires_at = existing.expires_at if existing else (now + timedelta(seconds=ttl) if ttl is not None else None)
        placement = _place_with_room(
            full=full,
            capability_type=type,
            expires_at=expires_at,
            bundle=(bundle := CodeBundle.from_code(code, bindings=resolved)),
            was_evicting=existing is not None and existing.state == State.EVICTING,
        )
        capability, version, created = _record_deploy(
            owner=owner,
            existing=existing,
            full=full,
            type=type,
            expires_at=expires_at,
            code=code,
            sha=sha,
            slot=placement.slot,
            backend=placement.backend,
            bundle_sha=bundle.sha,
            bindings=bindings,
            is_public=is_public,
            now=now,
            principal=principal,
        )
        routes.route_publish(capability)
    finally:
        lock.release()
    return DeployResult(
        capability=capability,
        version=version,
        created=created,
        cold_start=placement.cold_start,
        evicted=placement.evicted,
    )


def _unused_ephemeral_name(agent_name: str) -> str:
    for _ in range(20):
        full = names.full_name(agent_name, names.new_ephemeral_name())
        if not Capability.objects.filter(full_name=full).exists():
            return full
    raise Conflict("could not find a free ephemeral name; retry")


def _record_deploy(
    *,
    owner: Agent,
    existing: Capability | None,
    full: str,
    type: str,
    expires_at: datetime | None,
    code: str,
    sha: str,
    slot: str,
    backend: str,
    bundle_sha: str,
    bindings: list[str],
    is_public: bool,
    now: datetime,
    principal: Principal,
) -> tuple[Capability, CapabilityVersion, bool]:
    with transaction.atomic():
        if existing is None:
            try:
                with transaction.atomic():
                    capability = Capability.objects.create(
                        agent=owner,
                        name=full.split(names.SEPARATOR, 1)[1],
                        full_name=full,
                        type=type,
                        is_public=is_public,
                        bindings=bindings,
                        state=State.LIVE,
                        slot=slot,
                        placed_sha=bundle_sha,
                        backend=backend,
                        expires_at=expires_at,
                        created_at=now,
                        updated_at=now,
                    )
            except IntegrityError as exc:
                raise Conflict(f"{full} was created by a concurrent request") from exc
            number = 1
        else:
            capability = Capability.objects.select_for_update().get(pk=existing.pk)
            number = (capability.versions.aggregate(n=Max("number"))["n"] or 0) + 1
        version = CapabilityVersion.objects.create(
            capability=capability, number=number, code=code, sha=sha, size_bytes=len(code.encode()), created_at=now
        )
        capability.current_version = version
        capability.is_public = is_public
        capability.bindings = bindings
        capability.state = State.LIVE
        capability.slot = slot
        capability.placed_sha = bundle_sha
        capability.backend = backend
        capability.updated_at = now
        capability.save()
        audit_record(
            actor=_actor(principal),
            action="capability.created" if existing is None else "capability.deployed",
            agent_name=owner.name,
            subject=full,
            detail={"version": number, "sha": sha, "type": type, "public": is_public, "bindings": bindings},
        )
    capability.agent = owner
    return capability, version, existing is None


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
    if get_runtime().total_slots is not None:
        pager.pager_mark_leaving(full)
    return capability


def capability_release_slot(*, capability_id: int) -> bool:
    """Delete a removed capability's code from the runtime. Idempotent.

    Does nothing when the capability is not removed, or when a newer capability of the same
    name already holds the slot. Raises RuntimeUnavailable (transient) for the task to retry.
    """
    capability = Capability.objects.filter(pk=capability_id).first()
    if capability is None or capability.state != State.REMOVED or not capability.slot:
        return False
    with _placement_lock(capability.full_name, blocking=True):
        runtime = runtime_for(capability.backend)
        successor = (
            Capability.objects.exclude(state=State.REMOVED)
            .filter(slot=capability.slot, backend__in=_same_runtime(runtime))
            .exists()
        )
        if successor:
            return False
        runtime.remove(slot=capability.slot)
        if not Capability.objects.exclude(state=State.REMOVED).filter(full_name=capability.full_name).exists():
            pager.pager_drop_evicting(capability.full_name)
    return True


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


def capability_flush_stats(*, batch_size: int = 500, now: datetime | None = None) -> int:
    """Move the hot path's counters from Redis into the database; return how many capabilities.

    Each capability's totals grow, and the calls land in the current minute's stats window.
    Counters are read-and-reset atomically, so a second run right after changes nothing.
    """
    now = now or timezone.now()
    window_start = now.replace(second=0, microsecond=0)
    redis = get_redis()
    fulls = [m.decode() for m in redis.spop(stats.DIRTY_KEY, batch_size) or []]
    for full in fulls:
        taken = stats.stats_take(full)
        if taken.calls == 0:
            continue
        with transaction.atomic():
            capability = (
                Capability.objects.select_for_update().exclude(state=State.REMOVED).filter(full_name=full).first()
            )
            if capability is not None:
                capability.calls_total += taken.calls
                capability.errors_total += taken.errors
                capability.latency_ms_total += taken.latency_ms
                capability.cold_calls_total += taken.cold_calls
                capability.page_in_ms_total += taken.page_in_ms
                capability.latency_buckets_total = stats.add_buckets(capability.latency_buckets_total, taken.buckets)
                if taken.last_access_epoch is not None:
                    capability.last_access_at = datetime.fromtimestamp(taken.last_access_epoch, tz=UTC)
                    capability.inactive_at = None  # called again: active
                capability.save(
                    update_fields=[
                        "calls_total",
                        "errors_total",
                        "latency_ms_total",
                        "cold_calls_total",
                        "page_in_ms_total",
                        "latency_buckets_total",
                        "last_access_at",
                        "inactive_at",
                    ]
                )
            window, _ = CapabilityStatsWindow.objects.select_for_update().get_or_create(
                full_name=full,
                window_start=window_start,
                defaults={"agent_name": full.split(names.SEPARATOR, 1)[0]},
            )
            window.calls += taken.calls
            window.errors += taken.errors
            window.cold_calls += taken.cold_calls
            window.latency_ms_sum += taken.latency_ms
            window.page_in_ms_sum += taken.page_in_ms
            window.latency_buckets = stats.add_buckets(window.latency_buckets, taken.buckets)
            window.save()
            _alert_on_error_rate(window)
    _flush_token_use(redis)
    return len(fulls)


def _alert_on_error_rate(window: CapabilityStatsWindow) -> None:
    """Tell the agent when a capability's error rate in this minute crosses the threshold;
    at most once per SIGIL_ALERT_COOLDOWN_SECONDS per capability."""
    if window.calls < settings.SIGIL_ALERT_MIN_CALLS:
        return
    rate = window.errors / window.calls
    if rate < settings.SIGIL_ALERT_ERROR_RATE:
        return
    if not get_redis().set(
        f"sigil:alert:error-rate:{window.full_name}", 1, nx=True, ex=settings.SIGIL_ALERT_COOLDOWN_SECONDS
    ):
        return
    detail = {
        "error_rate": round(rate, 4),
        "calls": window.calls,
        "errors": window.errors,
        "window_start": window.window_start.isoformat(),
    }
    audit_record(
        actor="system",
        action="capability.error_rate_alert",
        agent_name=window.agent_name,
        subject=window.full_name,
        detail=detail,
    )
    agent_notify(
        agent_name=window.agent_name,
        event="capability.error_rate_alert",
        payload={"capability": window.full_name, **detail},
    )


def _flush_token_use(redis) -> None:
    pipe = redis.pipeline(transaction=True)
    pipe.hgetall(stats.TOKENS_USED_KEY)
    pipe.delete(stats.TOKENS_USED_KEY)
    used, _ = pipe.execute()
    for token_hash, stamp in used.items():
        Token.objects.filter(secret_hash=token_hash.decode()).update(
            last_used_at=datetime.fromtimestamp(float(stamp), tz=UTC)
        )


def capability_record_breaker(*, full: str, state: str, at_epoch: float) -> None:
    """Persist a breaker transition seen by the gateway, with an audit event. Idempotent."""
    opened_at = datetime.fromtimestamp(at_epoch, tz=UTC) if state == BreakerState.OPEN else None
    with transaction.atomic():
        capability = Capability.objects.exclude(state=State.REMOVED).filter(full_name=full).first()
        if capability is None or capability.breaker_state == state:
            return
        capability.breaker_state = state
        capability.breaker_opened_at = opened_at
        capability.save(update_fields=["breaker_state", "breaker_opened_at"])
        action = "capability.degraded" if state == BreakerState.OPEN else "capability.recovered"
        audit_record(actor="system", action=action, agent_name=capability.agent.name, subject=full)
        if state == BreakerState.OPEN:
            agent_notify(
                agent_name=capability.agent.name,
                event=action,
                payload={"capability": full, "reason": "circuit breaker opened after repeated failures"},
            )


def capability_reset_breaker(*, capability: Capability, actor: str) -> None:
    """Close a capability's breaker now (the owner's reset). Idempotent."""
    get_redis().delete(stats.breaker_key(capability.full_name), stats.failures_key(capability.full_name))
    capability_record_breaker(full=capability.full_name, state=BreakerState.CLOSED, at_epoch=timezone.now().timestamp())
    audit_record(
        actor=actor, action="capability.breaker_reset", agent_name=capability.agent.name, subject=capability.full_name
    )


# Cloudflare's longest CPU time per invocation on the Paid plan (reference §7.3).
MAX_CPU_MS = 300_000


def capability_set_cpu_limit(*, capability: Capability, cpu_ms: int | None, actor: str) -> None:
    """Give a capability its own CPU limit per call in ms (None: SIGIL_CPU_MS again), on the
    platform and loader runtimes; calls after this one use it. Idempotent.

    Raises InvalidRequest when it is not between 1 and 300000 ms.
    """
    if cpu_ms is not None and not 1 <= cpu_ms <= MAX_CPU_MS:
        raise InvalidRequest(f"a CPU limit is 1 to {MAX_CPU_MS} ms")
    with transaction.atomic():
        changed = (
            Capability.objects.exclude(state=State.REMOVED)
            .filter(pk=capability.pk)
            .exclude(cpu_ms=cpu_ms)
            .update(cpu_ms=cpu_ms, updated_at=timezone.now())
        )
        if not changed:
            return
        audit_record(
            actor=actor,
            action="capability.cpu_limit_set",
            agent_name=capability.agent.name,
            subject=capability.full_name,
            detail={"cpu_ms": cpu_ms},
        )
    capability.refresh_from_db()
    routes.route_publish(capability)


def capability_page_in(*, full: str, reason: str = "call") -> tuple[routes.CachedRoute, bool]:
    """Make `full` live on the runtime (the cold path); return its fresh route and whether
    this call placed it.

    Concurrent callers for the same capability wait on one lock, so one placement serves
    them all. Raises NotFound, UpstreamError.
    """
    with _placement_lock(full, blocking=True):
        capability = (
            Capability.objects.select_related("agent", "current_version")
            .exclude(state=State.REMOVED)
            .filter(full_name=full)
            .first()
        )
        if capability is None or capability.current_version is None:
            raise NotFound(f"no capability {full}")
        placed = capability.state not in routes.SERVED_STATES
        if placed:
            started = time.perf_counter()
            bundle = CodeBundle.from_code(
                capability.current_version.code,
                bindings=binding_rules.bindings_resolve(
                    capability.bindings, supported_kinds=get_runtime().binding_kinds
                ),
            )
            placement = _place_with_room(
                full=full,
                capability_type=capability.type,
                expires_at=capability.expires_at,
                bundle=bundle,
                was_evicting=False,
            )
            with transaction.atomic():
                Capability.objects.filter(pk=capability.pk).update(
                    state=State.LIVE,
                    slot=placement.slot,
                    placed_sha=bundle.sha,
                    backend=placement.backend,
                    updated_at=timezone.now(),
                )
                audit_record(
                    actor="system",
                    action="capability.paged_in",
                    agent_name=capability.agent.name,
                    subject=full,
                    detail={
                        "evicted": placement.evicted,
                        "reason": reason,
                        "ms": round((time.perf_counter() - started) * 1000, 1),
                    },
                )
            capability.refresh_from_db()
        routes.route_publish(capability)
    return routes.decode(routes.encode(capability)), placed


# A victim still answering calls is deleted once they finish, or after this many checks
# (the gateway treats a call that then finds no script as a miss and pages in again).
PAGE_OUT_INFLIGHT_CHECKS = 50


class StillInFlight(Exception):
    """The victim is still serving calls; the page-out task retries shortly."""


def capability_page_out(*, full: str, attempt: int = 0) -> bool:
    """Delete an evicting capability's script from the runtime and mark it paged out.

    Idempotent: does nothing unless `full` is still evicting (a deploy may have made it
    live again, or it was removed). Raises StillInFlight while calls to it are in flight,
    RuntimeUnavailable when the runtime fails transiently.
    """
    with _placement_lock(full, blocking=True):
        capability = Capability.objects.select_related("agent").filter(full_name=full, state=State.EVICTING).first()
        if capability is None:
            return False
        if pager.pager_inflight(full) > 0 and attempt < PAGE_OUT_INFLIGHT_CHECKS:
            raise StillInFlight(full)
        runtime_for(capability.backend).remove(slot=capability.slot)
        with transaction.atomic():
            changed = Capability.objects.filter(pk=capability.pk, state=State.EVICTING).update(
                state=State.PAGED_OUT, placed_sha="", updated_at=timezone.now()
            )
            if changed:
                audit_record(
                    actor="system", action="capability.evicted", agent_name=capability.agent.name, subject=full
                )
        pager.pager_drop_evicting(full)
        capability.refresh_from_db()
        routes.route_publish(capability)
    return bool(changed)


def runtime_provision(*, actor: str) -> list[str]:
    """Create what the current runtime needs besides capabilities (the platform runtime's
    namespace and dispatch Worker, the loader runtime's KV namespace and loader Worker);
    return what was done. Idempotent. Raises RuntimeUnavailable, RuntimeRejected."""
    runtime = get_runtime()
    done = runtime.provision()
    if done:
        audit_record(actor=actor, action="runtime.provisioned", subject=runtime.name, detail={"done": done})
    return done


def _same_runtime(runtime: Runtime) -> tuple[str, ...]:
    """The `backend` values of rows placed on `runtime` ("" for rows from before it was recorded)."""
    return ("", runtime.name) if runtime is get_runtime() else (runtime.name,)


def _placement_in_progress(full: str) -> bool:
    return bool(get_redis().exists(f"sigil:lock:place:{full}"))


def capability_reconcile() -> dict[str, int]:
    """Compare what the runtime holds with the registry, and repair both sides.

    Scripts no capability should have (a worker killed mid-page-in, a lost delete) are
    deleted; capabilities the registry thinks live but the runtime lacks are marked paged
    out, so their next call pages them in. Placements in progress are left alone. The
    pager's sets are then rebuilt from the registry. Safe to run at any time.
    Raises RuntimeUnavailable when the runtime cannot list its slots.
    """
    runtime = get_runtime()
    placed = set(runtime.list_slots())
    # Only this runtime's placements: during a switch of SIGIL_BACKEND, capabilities still on
    # the previous runtime are the switch's to move, not missing here.
    on_this_runtime = Capability.objects.filter(backend__in=_same_runtime(runtime))
    served = dict(on_this_runtime.filter(state__in=routes.SERVED_STATES).values_list("slot", "full_name"))
    owners: dict[str, list[str]] = {}
    for slot, full in on_this_runtime.filter(slot__in=placed - set(served)).values_list("slot", "full_name"):
        owners.setdefault(slot, []).append(full)

    orphans = 0
    for slot in sorted(placed - set(served)):
        if any(_placement_in_progress(full) for full in owners.get(slot, [])):
            continue
        runtime.remove(slot=slot)
        audit_record(
            actor="system", action="runtime.orphan_removed", subject=slot, detail={"owners": owners.get(slot, [])}
        )
        orphans += 1

    repaired = 0
    for slot, full in served.items():
        if slot in placed or _placement_in_progress(full):
            continue
        with transaction.atomic():
            capability = (
                Capability.objects.select_related("agent")
                .filter(full_name=full, state__in=routes.SERVED_STATES, backend__in=_same_runtime(runtime))
                .first()
            )
            if capability is None:
                continue
            capability.state = State.PAGED_OUT
            capability.placed_sha = ""
            capability.updated_at = timezone.now()
            capability.save(update_fields=["state", "placed_sha", "updated_at"])
            audit_record(
                actor="system",
                action="capability.repaired",
                agent_name=capability.agent.name,
                subject=full,
                detail={"reason": "not on the runtime", "slot": slot},
            )
        routes.route_publish(capability)
        repaired += 1

    corrected = pager.pager_sync(is_placing=_placement_in_progress) if runtime.total_slots is not None else 0
    return {"orphans_removed": orphans, "repaired": repaired, "pager_corrected": corrected}


def capability_mark_missing(*, full: str, slot: str | None = None, backend: str | None = None) -> None:
    """The runtime answered that `full`'s script is gone: record it as paged out so the
    next placement puts it back. Idempotent.

    With `slot` and `backend` (the placement the call went to), nothing changes when the
    capability has been placed elsewhere since (a switch of runtime): the call's route was
    merely out of date.
    """
    with transaction.atomic():
        capability = (
            Capability.objects.select_related("agent").filter(full_name=full, state__in=routes.SERVED_STATES).first()
        )
        if capability is None:
            return
        moved = capability.slot != slot or bool(backend and capability.backend and capability.backend != backend)
        if slot is not None and moved:
            return
        Capability.objects.filter(pk=capability.pk).update(
            state=State.PAGED_OUT, placed_sha="", updated_at=timezone.now()
        )
        audit_record(
            actor="system",
            action="capability.repaired",
            agent_name=capability.agent.name,
            subject=full,
            detail={"reason": "the runtime no longer had its script"},
        )
    pager.pager_forget(full)


# --- switching SIGIL_BACKEND -------------------------------------------------------------


@dataclass(frozen=True)
class SwitchStep:
    """What switching one capability to the current runtime did.

    `outcome`: "moved" (placed on the new runtime), "reassigned" (not placed anywhere, now
    due to page in on the new runtime), "already" (nothing to do) or "gone" (removed).
    `source`/`old_slot` name the previous placement, which the caller removes later.
    """

    full: str
    outcome: str
    source: str = ""
    old_slot: str = ""
    new_slot: str = ""


def capability_switch_backend(*, full: str, actor: str) -> SwitchStep:
    """Move `full` to the runtime SIGIL_BACKEND names, leaving its previous placement alone.

    A served capability is placed on the new runtime first, and only then recorded there,
    so the gateway serves it from the previous runtime until this returns. On a runtime
    with a slot limit that is full, it is recorded as paged out instead (a switch never
    evicts): its next call pages it in. Idempotent, one audit event per move.
    Raises InvalidRequest (the new runtime cannot give a binding it declared), TooLarge,
    UpstreamError; the capability then stays where it was.
    """
    runtime = get_runtime()
    with _placement_lock(full, blocking=True):
        capability = (
            Capability.objects.select_related("agent", "current_version")
            .exclude(state=State.REMOVED)
            .filter(full_name=full)
            .first()
        )
        if capability is None:
            return SwitchStep(full=full, outcome="gone")
        if capability.backend in ("", runtime.name):
            return SwitchStep(full=full, outcome="already", source=capability.backend, new_slot=capability.slot)
        source, old_slot = capability.backend, capability.slot
        bundle = None
        if capability.state in routes.SERVED_STATES and capability.current_version is not None:
            bundle = CodeBundle.from_code(
                capability.current_version.code,
                bindings=binding_rules.bindings_resolve(capability.bindings, supported_kinds=runtime.binding_kinds),
            )
        # The pager's sets speak for the new runtime: this capability is not placed there yet.
        pager.pager_forget(full)
        if bundle is not None and runtime.total_slots is not None:
            live, _ = pager.pager_used_slots()
            if live >= runtime.total_slots:
                bundle = None
        if bundle is not None:
            placement = _place_with_room(
                full=full,
                capability_type=capability.type,
                expires_at=capability.expires_at,
                bundle=bundle,
                was_evicting=False,
            )
            slot, backend, state, placed_sha = placement.slot, placement.backend, State.LIVE, bundle.sha
        else:
            slot, backend = _slot_for(full, runtime), runtime.name
            state = State.FAILED if capability.state == State.FAILED else State.PAGED_OUT
            placed_sha = ""
        with transaction.atomic():
            Capability.objects.filter(pk=capability.pk).update(
                state=state, slot=slot, placed_sha=placed_sha, backend=backend, updated_at=timezone.now()
            )
            audit_record(
                actor=actor,
                action="capability.switched",
                agent_name=capability.agent.name,
                subject=full,
                detail={
                    "from": source,
                    "to": backend,
                    "from_slot": old_slot,
                    "to_slot": slot,
                    "placed": bundle is not None,
                },
            )
        capability.refresh_from_db()
        routes.route_publish(capability)
    return SwitchStep(
        full=full,
        outcome="moved" if bundle is not None else "reassigned",
        source=source,
        old_slot=old_slot,
        new_slot=slot,
    )


def capability_adopt_backend(*, backend: str) -> int:
    """Record `backend` as the runtime of every capability placed before Sigil recorded
    runtimes (an empty `backend` field); return how many. Idempotent."""
    fulls = list(Capability.objects.exclude(state=State.REMOVED).filter(backend="").values_list("full_name", flat=True))
    for full in fulls:
        with transaction.atomic():
            changed = (
                Capability.objects.exclude(state=State.REMOVED)
                .filter(full_name=full, backend="")
                .update(backend=backend)
            )
        if changed:
            capability = Capability.objects.select_related("agent").exclude(state=State.REMOVED).get(full_name=full)
            routes.route_publish(capability)
    return len(fulls)


def runtime_release_previous(*, backend: str, slot: str, actor: str) -> bool:
    """Delete `slot` from the runtime `backend` unless a capability placed there holds it;
    return whether it did. Idempotent. Raises RuntimeUnavailable (transient)."""
    runtime = runtime_for(backend)
    if Capability.objects.exclude(state=State.REMOVED).filter(backend=backend, slot=slot).exists():
        return False
    runtime.remove(slot=slot)
    audit_record(actor=actor, action="runtime.slot_released", subject=slot, detail={"backend": backend})
    return True


def runtime_sweep_previous(*, backend: str, actor: str) -> list[str]:
    """Delete every slot the runtime `backend` holds that no capability placed there holds
    (what an interrupted switch left behind); return them. Placements in progress are left
    alone. Idempotent. Raises RuntimeUnavailable (transient)."""
    runtime = runtime_for(backend)
    held = set(Capability.objects.exclude(state=State.REMOVED).filter(backend=backend).values_list("slot", flat=True))
    owners = dict(Capability.objects.filter(backend=backend).values_list("slot", "full_name"))
    released = []
    for slot in sorted(set(runtime.list_slots()) - held):
        if slot in owners and _placement_in_progress(owners[slot]):
            continue
        runtime.remove(slot=slot)
        audit_record(actor=actor, action="runtime.slot_released", subject=slot, detail={"backend": backend})
        released.append(slot)
    return released


def capability_evict(*, full: str, actor: str) -> bool:
    """Page `full` out now (the owner's "evict"): its script is deleted from the runtime and
    its next call pages it back in. Returns False when it was not placed. Idempotent.

    Unlike an eviction chosen by the pager, it does not wait for calls in flight.
    Raises RuntimeUnavailable when the runtime fails transiently.
    """
    with _placement_lock(full, blocking=True):
        with transaction.atomic():
            capability = (
                Capability.objects.select_for_update()
                .select_related("agent")
                .filter(full_name=full, state__in=routes.SERVED_STATES)
                .first()
            )
            if capability is None:
                return False
            capability.state = State.EVICTING
            capability.save(update_fields=["state"])
            audit_record(
                actor=actor, action="capability.evict_requested", agent_name=capability.agent.name, subject=full
            )
        if get_runtime().total_slots is not None:
            pager.pager_mark_leaving(full)
    return capability_page_out(full=full, attempt=PAGE_OUT_INFLIGHT_CHECKS)


def capability_mark_inactive(*, now: datetime | None = None, batch_size: int = 500) -> int:
    """Mark normal capabilities not called for SIGIL_INACTIVE_AFTER_DAYS as inactive and tell
    their agents; return how many. Persistent ones are never touched; a later call clears
    the mark (the stats flush does). Idempotent: a marked capability is not marked again."""
    now = now or timezone.now()
    cutoff = now - timedelta(days=settings.SIGIL_INACTIVE_AFTER_DAYS)
    stale = (
        Capability.objects.filter(type=CapabilityType.NORMAL, inactive_at__isnull=True)
        .exclude(state=State.REMOVED)
        .filter(Q(last_access_at__lt=cutoff) | Q(last_access_at__isnull=True, created_at__lt=cutoff))
        .select_related("agent")[:batch_size]
    )
    marked = 0
    for capability in stale:
        with transaction.atomic():
            claimed = Capability.objects.filter(pk=capability.pk, inactive_at__isnull=True).update(inactive_at=now)
            if not claimed:
                continue  # another run got there first
            detail = {"last_access_at": capability.last_access_at.isoformat() if capability.last_access_at else None}
            audit_record(
                actor="system",
                action="capability.inactive",
                agent_name=capability.agent.name,
                subject=capability.full_name,
                detail=detail,
            )
            agent_notify(
                agent_name=capability.agent.name,
                event="capability.inactive",
                payload={"capability": capability.full_name, **detail},
            )
        marked += 1
    return marked


def capability_prewarm(*, now: datetime | None = None) -> list[str]:
    """Page in the most called capabilities of the last SIGIL_PREWARM_WINDOW_SECONDS that are
    not live, up to SIGIL_PREWARM_TOP_N; return their names. Only on runtimes with a pager."""
    runtime = get_runtime()
    if runtime.total_slots is None:
        return []
    now = now or timezone.now()
    since = now - timedelta(seconds=settings.SIGIL_PREWARM_WINDOW_SECONDS)
    top = list(
        CapabilityStatsWindow.objects.filter(window_start__gte=since)
        .values("full_name")
        .annotate(calls=Sum("calls"))
        .order_by("-calls", "full_name")
        .values_list("full_name", flat=True)[: min(settings.SIGIL_PREWARM_TOP_N, runtime.total_slots)]
    )
    cold = set(
        Capability.objects.filter(full_name__in=top, state__in=(State.PAGED_OUT,)).values_list("full_name", flat=True)
    )
    warmed = []
    for full in (f for f in top if f in cold):
        try:
            capability_page_in(full=full, reason="prewarm")
        except NotFound:
            continue  # removed since the window was counted
        warmed.append(full)
    return warmed


def capability_set_public(*, capability: Capability, is_public: bool, actor: str) -> bool:
    """Make a capability public (callable by every agent) or private (its agent's only), for
    the owner. Returns False when it already was. Raises NotFound when it was removed."""
    with transaction.atomic():
        if not Capability.objects.filter(pk=capability.pk).exclude(state=State.REMOVED).exists():
            raise NotFound(f"no capability {capability.full_name}")
        changed = Capability.objects.filter(pk=capability.pk, is_public=not is_public).update(
            is_public=is_public, updated_at=timezone.now()
        )
        if changed:
            audit_record(
                actor=actor,
                action="capability.updated",
                agent_name=capability.agent.name,
                subject=capability.full_name,
                detail={"public": is_public},
            )
    capability.refresh_from_db()
    if changed:
        routes.route_publish(capability)
    return bool(changed)


# A forced breaker stays open until the owner resets it; the gateway reads "open until" as
# an epoch, so "forever" is a date far enough away (its Retry-After is capped at one
# cool-down, see Gateway.enter_open_breaker).
FORCED_DEGRADED_SECONDS = 10 * 365 * 86400


def capability_force_degraded(*, capability: Capability, actor: str) -> None:
    """Open a capability's breaker until the owner resets it (capability_reset_breaker):
    the gateway answers every call 503 `degraded` without trying the code. Idempotent.

    A call already in flight that succeeds closes the breaker, as it would close one
    opened by failures. Raises NotFound when the capability was removed.
    """
    full = capability.full_name
    if not Capability.objects.filter(pk=capability.pk).exclude(state=State.REMOVED).exists():
        raise NotFound(f"no capability {full}")
    now = time.time()
    pipe = get_redis().pipeline(transaction=True)
    pipe.set(stats.breaker_key(full), f"{now + FORCED_DEGRADED_SECONDS:.3f}")
    pipe.delete(stats.trial_key(full))
    pipe.execute()
    with transaction.atomic():
        Capability.objects.filter(pk=capability.pk, breaker_state=BreakerState.CLOSED).update(
            breaker_state=BreakerState.OPEN, breaker_opened_at=datetime.fromtimestamp(now, tz=UTC)
        )
        audit_record(actor=actor, action="capability.forced_degraded", agent_name=capability.agent.name, subject=full)
    capability.refresh_from_db()


def capability_rollback(*, capability: Capability, version_number: int, actor: str) -> DeployResult:
    """Serve the code of an earlier version again, placed exactly as a deploy places code.

    The rollback is a new version, numbered after the latest, with the old version's code:
    history only grows, the version an agent reads never goes back, and the audit trail
    says which version was restored. The capability keeps its current bindings and public
    flag (they are not versioned), and the agent's deploy cool-down does not apply.
    Rolling back to the code that is already current changes nothing (as a deploy of the
    same code does). Raises NotFound (no such version, or the capability was removed),
    Conflict (a deploy of it is in progress), and what placing code raises (TooLarge,
    InvalidRequest, UpstreamError).
    """
    full = capability.full_name
    target = CapabilityVersion.objects.filter(capability_id=capability.pk, number=version_number).first()
    if target is None:
        raise NotFound(f"{full} has no version {version_number}")
    # A removed capability is not found whoever holds its lock (its slot release may).
    if not Capability.objects.exclude(state=State.REMOVED).filter(pk=capability.pk).exists():
        raise NotFound(f"no capability {full}")
    lock = _placement_lock(full, blocking=False)
    if not lock.acquire():
        raise Conflict(f"{full} is being deployed; retry when it is done")
    try:
        current = (
            Capability.objects.select_related("agent", "current_version")
            .exclude(state=State.REMOVED)
            .filter(pk=capability.pk)
            .first()
        )
        if current is None:
            raise NotFound(f"no capability {full}")
        if current.current_version is not None and current.current_version.sha == target.sha:
            return DeployResult(
                capability=current, version=current.current_version, created=False, cold_start=False, evicted=None
            )
        bundle = CodeBundle.from_code(
            target.code,
            bindings=binding_rules.bindings_resolve(current.bindings, supported_kinds=get_runtime().binding_kinds),
        )
        placement = _place_with_room(
            full=full,
            capability_type=current.type,
            expires_at=current.expires_at,
            bundle=bundle,
            was_evicting=current.state == State.EVICTING,
        )
        now = timezone.now()
        with transaction.atomic():
            locked = Capability.objects.select_for_update().get(pk=current.pk)
            number = (locked.versions.aggregate(n=Max("number"))["n"] or 0) + 1
            version = CapabilityVersion.objects.create(
                capability=locked,
                number=number,
                code=target.code,
                sha=target.sha,
                size_bytes=target.size_bytes,
                created_at=now,
            )
            locked.current_version = version
            locked.state = State.LIVE
            locked.slot = placement.slot
            locked.placed_sha = bundle.sha
            locked.updated_at = now
            locked.save(update_fields=["current_version", "state", "slot", "placed_sha", "updated_at"])
            audit_record(
                actor=actor,
                action="capability.rolled_back",
                agent_name=current.agent.name,
                subject=full,
                detail={"version": number, "restored_version": target.number, "sha": target.sha},
            )
        locked.agent = current.agent
        routes.route_publish(locked)
    finally:
        lock.release()
    capability.refresh_from_db()
    return DeployResult(
        capability=locked, version=version, created=False, cold_start=placement.cold_start, evicted=placement.evicted
    )


def capability_prune_stats(*, now: datetime | None = None, batch_size: int = 10_000) -> int:
    """Delete minute windows older than SIGIL_STATS_RETENTION_DAYS; return how many.

    Totals on each capability are kept; only the per-minute history goes. Safe to overlap
    with itself: each run deletes one bounded batch of the oldest rows.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(days=settings.SIGIL_STATS_RETENTION_DAYS)
    old = list(
        CapabilityStatsWindow.objects.filter(window_start__lt=cutoff)
        .order_by("window_start")
        .values_list("pk", flat=True)[:batch_size]
    )
    deleted, _ = CapabilityStatsWindow.objects.filter(pk__in=old).delete()
    return deleted
