"""Reads on capabilities, with the visibility rules of the contract."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db.models import Q, QuerySet
from django.utils import timezone

from agents.models import Agent, AuditEvent
from agents.tokens import Principal
from capabilities import names
from capabilities.books import call_logs, stats
from capabilities.contracts import Contract
from capabilities.models import (
    BreakerState,
    Capability,
    CapabilityStatsWindow,
    CapabilityType,
    CapabilityVersion,
    State,
    VersionPlacement,
)
from capabilities.runtimes import get_runtime
from capabilities.runtimes.errors import RuntimeFailure
from capabilities.visibility import capability_own, capability_visible, visible_q
from sigil.errors import Forbidden, InvalidRequest, NotFound

SEARCH_MAX_CHARS = 200
logger = logging.getLogger(__name__)


def capability_call_base(*, site_url: str) -> str:
    """The base of the URLs agents call capabilities at (`{base}/{agent}/{name}`): the edge's
    while the runtime serves calls at its edge (SIGIL_EDGE on a Cloudflare runtime), else
    `site_url`, this server's. While the runtime cannot say where its edge is (Cloudflare out of
    reach for the account's subdomain), this server's: that URL always works too. Never raises."""
    try:
        edge = get_runtime().edge_url()
    except RuntimeFailure as exc:
        logger.warning("the edge's URL is not known now, so this server's is given: %s", exc)
        return site_url
    return edge or site_url


def visible_to(principal: Principal) -> Q:
    """What an agent may see and call (capabilities.visibility). The placements of staged
    versions in traffic are the split's, never listed on their own."""
    return visible_q(principal) & Q(variant_of__isnull=True)


def capability_get(*, full: str) -> Capability:
    """The capability `full`, unless removed (the owner's view: every agent's). Raises NotFound."""
    capability = (
        Capability.objects.select_related("agent", "current_version", "staged_version")
        .exclude(state=State.REMOVED)
        .filter(full_name=full)
        .first()
    )
    if capability is None:
        raise NotFound(f"no capability {full}")
    return capability


def capability_get_visible(*, principal: Principal, full: str) -> Capability:
    """The capability `full` if the caller may see it: its own, or another agent's public one.

    Another agent's private capability is NotFound, so its existence is not revealed.
    """
    names.split_full_name(full)
    capability = capability_get(full=full)
    if not capability_visible(capability, principal):
        raise NotFound(f"no capability {full}")
    return capability


def capability_get_owned(*, principal: Principal, full: str) -> Capability:
    """The capability `full` for a change by its own agent: NotFound when the caller may not
    see it, Forbidden when it may but it is another agent's."""
    capability = capability_get_visible(principal=principal, full=full)
    if not capability_own(capability, principal):
        raise Forbidden(f"{full} is not under {principal.agent_name}'s prefix")
    return capability


def capability_get_own(*, principal: Principal, full: str) -> Capability:
    """The capability `full` if it is the caller's own. Another agent's is NotFound, public or
    not: what its code said and how its calls ended are its owner's alone."""
    capability = capability_get_visible(principal=principal, full=full)
    if not capability_own(capability, principal):
        raise NotFound(f"no capability {full} of {principal.agent_name}'s")
    return capability


def capability_call_records(*, principal: Principal, full: str, query: call_logs.RecordQuery) -> call_logs.RecordPage:
    """The caller's own capability's call records, newest first, filtered (call_logs.call_records_list).
    Raises NotFound for any capability that is not the caller's."""
    capability = capability_get_own(principal=principal, full=full)
    return call_logs.call_records_list(full=capability.full_name, query=query)


def capability_call_records_follow(
    *, principal: Principal, full: str, after: int | None, seconds: float
) -> Iterator[dict | None]:
    """The caller's own capability's new call records as they are kept (call_logs.call_records_follow),
    for at most `seconds` (SIGIL_LOGS_TAIL_SECONDS at most). Raises NotFound at once for any
    capability that is not the caller's."""
    capability = capability_get_own(principal=principal, full=full)
    seconds = min(seconds, settings.SIGIL_LOGS_TAIL_SECONDS)
    return call_logs.call_records_follow(full=capability.full_name, after=after, seconds=seconds)


def capability_list_visible(
    *,
    principal: Principal,
    type: str | None = None,
    state: str | None = None,
    agent: str | None = None,
    q: str | None = None,
) -> QuerySet[Capability]:
    """The caller's own capabilities and every public one, filtered; removed ones only on request.

    `q` keeps those whose full name or current description contains each of its words
    (case-insensitive), so an agent can look for a capability by what it does.
    """
    # A list shows no code: leaving it unread keeps a page of the catalogue light.
    query = (
        Capability.objects.select_related("agent", "current_version", "staged_version")
        .defer("current_version__code", "staged_version__code")
        .filter(visible_to(principal))
    )
    for name, value in (("agent", agent), ("q", q)):
        # PostgreSQL cannot compare a text holding NUL; no name or description holds one.
        if value is not None and "\x00" in value:
            raise InvalidRequest(f"{name} holds a NUL character (%00); leave it out")
    if type is not None:
        if type not in CapabilityType.values:
            raise InvalidRequest(f"type must be one of {', '.join(CapabilityType.values)}")
        query = query.filter(type=type)
    if state is not None:
        if state not in State.values:
            raise InvalidRequest(f"state must be one of {', '.join(State.values)}")
        query = query.filter(state=state)
        if state == State.REMOVED:
            query = query.filter(agent_id=principal.agent_id)
    else:
        query = query.exclude(state=State.REMOVED)
    if agent is not None:
        query = query.filter(agent__name=agent)
    if q is not None:
        words = q.split()
        if not words or len(q) > SEARCH_MAX_CHARS:
            raise InvalidRequest(f"q must hold at least one word and at most {SEARCH_MAX_CHARS} characters")
        for word in words:
            query = query.filter(Q(full_name__icontains=word) | Q(current_version__description__icontains=word))
    return query.order_by("full_name", "id")


def capability_tools_visible(*, principal: Principal, after: str, limit: int) -> list[tuple[str, Contract]]:
    """The capabilities the caller may call, by full name after `after`, with their contracts:
    what MCP lists as tools. Expired ephemerals are left out (they no longer answer)."""
    rows = (
        Capability.objects.exclude(state=State.REMOVED)
        .filter(visible_to(principal), full_name__gt=after)
        .exclude(expires_at__lte=timezone.now())
        .order_by("full_name")
        .values_list(
            "full_name",
            "current_version__description",
            "current_version__input_schema",
            "current_version__output_schema",
        )[:limit]
    )
    return [
        (full, Contract(description or "", input_schema, output_schema))
        for full, description, input_schema, output_schema in rows
    ]


def capability_deploy_state(capability: Capability) -> dict | None:
    """The latest deploy when it is not (yet) the version served: {"version", "status":
    placing | failed | superseded, "error": {"code", "message"} or None}; None once placed."""
    latest = (
        CapabilityVersion.objects.filter(capability_id=capability.pk)
        .order_by("-number")
        .values("number", "placement", "failure")
        .first()
    )
    if latest is None or latest["placement"] == VersionPlacement.PLACED:
        return None
    return {"version": latest["number"], "status": latest["placement"], "error": latest["failure"]}


# The audit events that record a version, and so who made it.
VERSION_EVENTS = (
    "capability.created",
    "capability.deployed",
    "capability.rolled_back",
    "capability.staged",
    "capability.deploy_failed",
)


@dataclass(frozen=True)
class VersionRecord:
    """One version as its agent lists it (GET /_api/capabilities/{full}/versions)."""

    version: int
    sha256: str
    size_bytes: int
    created_at: datetime
    # served: the current version; staged: kept aside for a split; placing, refused or
    # superseded: a deploy that is not (yet) placed; retired: served or staged once, no longer.
    status: str
    deployed_by: str | None  # the audit trail's actor: agent:NAME, owner:USERNAME, system
    restores: int | None  # the version a rollback restored
    description: str
    declares: list[str]  # the contract fields the version sets
    failure: dict | None  # why a refused or superseded version was not placed


def capability_versions(*, capability: Capability) -> QuerySet[CapabilityVersion]:
    """The versions of `capability`, newest first, without their code."""
    return CapabilityVersion.objects.filter(capability_id=capability.pk).defer("code").order_by("-number")


def versions_describe(*, capability: Capability, versions: list[CapabilityVersion]) -> list[VersionRecord]:
    """What each of `versions` is to its capability, and who made it (from the audit trail:
    the capability's own events, since a full name may be reused after a removal)."""
    numbers = [version.number for version in versions]
    events = (
        AuditEvent.objects.filter(
            subject=capability.full_name,
            action__in=VERSION_EVENTS,
            created_at__gte=capability.created_at,
            detail__version__in=numbers,
        )
        .order_by("created_at", "id")
        .values_list("actor", "detail")
    )
    made_by: dict[int, tuple[str, int | None]] = {}
    for actor, detail in events:
        made_by.setdefault(detail["version"], (actor, detail.get("restored_version")))
    records = []
    for version in versions:
        requested = version.requested
        actor, restores = made_by.get(version.number, (requested.get("actor"), requested.get("restores")))
        records.append(
            VersionRecord(
                version=version.number,
                sha256=version.sha,
                size_bytes=version.size_bytes,
                created_at=version.created_at,
                status=_version_status(capability, version),
                deployed_by=actor,
                restores=restores,
                description=version.description,
                declares=[name for name, value in Contract.of(version).as_fields().items() if value],
                failure=version.failure,
            )
        )
    return records


def _version_status(capability: Capability, version: CapabilityVersion) -> str:
    if version.pk == capability.current_version_id:
        return "served"
    if version.pk == capability.staged_version_id:
        return "staged"
    return {
        VersionPlacement.PLACING: "placing",
        VersionPlacement.FAILED: "refused",
        VersionPlacement.SUPERSEDED: "superseded",
    }.get(version.placement, "retired")


def backend_status() -> dict:
    """The runtime's slots and the registry's counts, as GET /_api/status reports them."""
    runtime = get_runtime()
    on_runtime = Capability.objects.filter(backend__in=("", runtime.name))
    used = on_runtime.filter(state=State.LIVE).count()
    if runtime.total_slots is not None:
        # Slots in use, as the seeds' status reports them. Victims still being deleted are
        # `paging_out`, apart: they hold the safety margin, not a slot. Only for a moment after
        # the slots were lowered is more placed than they allow, until the excess is shed.
        used = min(used, runtime.total_slots)
    return {
        "backend": runtime.name,
        "total_slots": runtime.total_slots,
        "used_slots": used,
        "paging_out": on_runtime.filter(state=State.EVICTING).count(),
        "agents": Agent.objects.count(),
        "lru_enabled": runtime.total_slots is not None,
        "eviction_count": AuditEvent.objects.filter(action="capability.evicted").count(),
    }


def capability_stats(*, capability: Capability, since: datetime) -> dict:
    """Calls, errors, cold calls and latency percentiles of `capability` since `since`,
    from the flushed minute windows (the last few seconds may not be flushed yet)."""
    windows = CapabilityStatsWindow.objects.filter(full_name=capability.full_name, window_start__gte=since)
    calls = errors = cold = 0
    page_in_ms = 0.0
    buckets: list[int] = []
    for window in windows:
        calls += window.calls
        errors += window.errors
        cold += window.cold_calls
        page_in_ms += window.page_in_ms_sum
        buckets = stats.add_buckets(buckets, window.latency_buckets)
    return {
        "since": since,
        "calls": calls,
        "errors": errors,
        "error_rate": round(errors / calls, 4) if calls else None,
        "cold_calls": cold,
        "p50_ms": stats.percentile_ms(buckets, 0.50),
        "p95_ms": stats.percentile_ms(buckets, 0.95),
        "mean_page_in_ms": round(page_in_ms / cold, 2) if cold else None,
        "last_access_at": capability.last_access_at,
        "state": capability.state,
        "breaker": capability.breaker_state,
    }


def capabilities_degraded() -> QuerySet[Capability]:
    """The capabilities whose breaker is open (tripped or forced), most recently opened first,
    staged versions in traffic included (each has a breaker of its own)."""
    return (
        Capability.objects.select_related("agent")
        .exclude(state=State.REMOVED)
        .filter(breaker_state=BreakerState.OPEN)
        .order_by("-breaker_opened_at", "full_name")
    )


def binding_declared_by(kind: str, name: str, *, agent_id: int | None = None) -> list[Capability]:
    """The capabilities (not removed; of one agent if given) that declare `KIND:NAME`, ordered
    by full name."""
    declaration = f"{kind}:{name}"
    # Filtered here rather than with a JSON lookup, which SQLite does not have.
    candidates = Capability.objects.exclude(state=State.REMOVED).exclude(bindings=[]).order_by("full_name")
    if agent_id is not None:
        candidates = candidates.filter(agent_id=agent_id)
    return [
        capability
        for capability in candidates.only("full_name", "state", "bindings", "agent_id")
        if declaration in capability.bindings
    ]


def capability_split_report(*, capability: Capability) -> dict | None:
    """The versions of a running traffic split side by side: each one's share, its calls,
    errors and latency since the minute the split began (from the flushed windows; the
    current version's first minute may hold calls from just before), state and breaker.
    None when no split runs."""
    if not capability.has_split:
        return None
    from capabilities.books import routes

    since = capability.split_started_at.replace(second=0, microsecond=0)
    variant = Capability.objects.exclude(state=State.REMOVED).filter(full_name=routes.variant_name(capability)).first()
    return {
        "started_at": capability.split_started_at,
        "caller_header": capability.split_caller_header or None,
        "guard": (
            {"margin": capability.split_guard_margin, "min_calls": capability.split_guard_min_calls}
            if capability.split_guard_margin is not None
            else None
        ),
        "current": {
            "version": capability.current_version.number,
            "weight": 100 - capability.split_weight,
            "stats": capability_stats(capability=capability, since=since),
        },
        "staged": {
            "version": capability.staged_version.number,
            "weight": capability.split_weight,
            "stats": capability_stats(capability=variant, since=since) if variant else None,
        },
    }


def capability_versions_never_served(*, capability: Capability) -> set[int]:
    """The numbers of `capability`'s versions that were staged (deployed with `stage`) and
    never promoted: the code never answered as the current version, only, at most, to a
    split's share of the callers. Read from the audit trail, which records both."""
    events = AuditEvent.objects.filter(
        subject=capability.full_name,
        action__in=["capability.staged", "capability.promoted"],
        created_at__gte=capability.created_at,  # not a removed namesake's
    ).values_list("action", "detail")
    staged = {detail.get("version") for action, detail in events if action == "capability.staged"}
    promoted = {detail.get("version") for action, detail in events if action == "capability.promoted"}
    return {number for number in staged - promoted if isinstance(number, int)}
