"""The Redis copy of each capability's route, read by the gateway on every call.

`redis_keys.route(full)` holds a small JSON document (owner, visibility, expiry, state, slot,
code sha, the runtime the slot is on, CPU limit, the version number, and while a traffic
split runs, where it sends a share of the callers) or a tombstone `-`. Services write it
after their transaction commits (write-through, never just delete), and the gateway fills
a missing entry from the database with SET NX, so a fill that raced a deploy can never hide
the new version.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from django.db.models import QuerySet

from capabilities.models import Capability, State
from capabilities.visibility import may_see
from sigil import redis_keys
from sigil.redis_client import get_redis

TOMBSTONE = b"-"
TTL_SECONDS = 3600
NEGATIVE_TTL_SECONDS = 30
SERVED_STATES = (State.LIVE, State.EVICTING)


@dataclass(frozen=True, slots=True)
class CachedRoute:
    capability_id: int
    agent: str
    type: str
    is_public: bool
    expires_epoch: float | None
    state: str
    slot: str
    sha: str
    backend: str = ""  # the runtime the slot is on; "" is the process's own
    cpu_ms: int | None = None
    version: int | None = None  # the number of the version whose code the slot holds
    split: Split | None = None
    cache_when_degraded: bool = False


def route_visible(route: CachedRoute | None, agent_name: str) -> bool:
    """Whether an agent may call the capability behind `route` (capabilities.visibility)."""
    return route is not None and may_see(route.agent == agent_name, route.is_public)


@dataclass(frozen=True, slots=True)
class Split:
    """A traffic split as the engine applies it: callers whose key hashes below `weight`
    (of 100) go to `variant`, the staged version's own route; the key is the request header
    `caller_header` (lower case; "" for none) when the caller sends it, else its token."""

    variant: str
    weight: int
    caller_header: str


def encode(capability: Capability) -> bytes:
    split = None
    if capability.has_split:
        split = [variant_name(capability), capability.split_weight, capability.split_caller_header.lower()]
    return json.dumps(
        {
            "id": capability.pk,
            "agent": capability.agent.name,
            "type": capability.type,
            "public": capability.is_public,
            "exp": capability.expires_at.timestamp() if capability.expires_at else None,
            "state": capability.state,
            "slot": capability.slot,
            "sha": capability.placed_sha,
            "backend": capability.backend,
            "cpu": capability.cpu_ms,
            "ver": _placed_version(capability),
            "split": split,
            "cache": capability.cache_when_degraded,
        },
        separators=(",", ":"),
    ).encode()


# Routes decoded in this process, by their cached bytes: a warm call finds its route here
# instead of parsing it again. Any change to a route changes its bytes; bounded by clearing.
_decoded: dict[bytes, CachedRoute] = {}
DECODED_KEPT = 4096


def decode(raw: bytes) -> CachedRoute | None:
    if raw == TOMBSTONE:
        return None
    route = _decoded.get(raw)
    if route is None:
        if len(_decoded) >= DECODED_KEPT:
            _decoded.clear()
        route = _decoded[raw] = _decode(raw)
    return route


def _decode(raw: bytes) -> CachedRoute:
    data = json.loads(raw)
    return CachedRoute(
        data["id"],
        data["agent"],
        data["type"],
        data["public"],
        data["exp"],
        data["state"],
        data["slot"],
        data["sha"],
        data.get("backend", ""),
        data.get("cpu"),
        data.get("ver"),
        _split(data["split"]) if data.get("split") else None,
        data.get("cache", False),
    )


def _placed_version(capability: Capability) -> int | None:
    """The number of the current version: every placement places it (a deploy, a rollback
    and a page-in all publish the route after placing), so it is the one that answers."""
    return capability.current_version.number if capability.current_version_id else None


def variant_name(capability: Capability) -> str:
    """The full name of the placement of `capability`'s staged version: `{full}--v{n}`, which
    no capability can have (names hold no `--`)."""
    return f"{capability.full_name}--v{capability.staged_version.number}"


def _split(value: list) -> Split:
    variant, weight, header = value
    if header.startswith("HTTP_"):  # written before the engine keyed it by header name
        header = header[5:].replace("_", "-").lower()
    return Split(variant, weight, header)


def route_row(full: str) -> Capability | None:
    """The capability row behind `full`'s copies (its route and contract), or None when
    there is none but removed ones."""
    return _route_rows().filter(full_name=full).first()


# Names looked up in one query: well within every database's limit on a query's parameters.
ROWS_PER_QUERY = 500


def route_rows(fulls: Iterable[str] | None = None) -> dict[str, Capability]:
    """route_row of each of `fulls` that has one (of every capability not removed when
    `fulls` is None), by full name. One query per ROWS_PER_QUERY names."""
    if fulls is None:
        return {capability.full_name: capability for capability in _route_rows()}
    wanted = sorted(set(fulls))
    rows: dict[str, Capability] = {}
    for start in range(0, len(wanted), ROWS_PER_QUERY):
        chunk = wanted[start : start + ROWS_PER_QUERY]
        rows.update((capability.full_name, capability) for capability in _route_rows().filter(full_name__in=chunk))
    return rows


def _route_rows() -> QuerySet[Capability]:
    return (
        Capability.objects.select_related("agent", "current_version", "staged_version")
        .defer("current_version__code", "staged_version__code")
        .exclude(state=State.REMOVED)
    )


def fill(name: str, value: bytes, *, ttl: int) -> bytes:
    """Cache `value` read from the database at `name` unless a writer got there first (SET
    NX), and return what the key holds: a fill that raced a write never hides it."""
    redis = get_redis()
    if not redis.set(name, value, ex=ttl, nx=True):
        value = redis.get(name) or value
    return value


def route_load(full: str) -> bytes:
    """Read the route from the database and cache it unless a writer got there first."""
    capability = route_row(full)
    if capability is None:
        return fill(redis_keys.route(full), TOMBSTONE, ttl=NEGATIVE_TTL_SECONDS)
    return fill(redis_keys.route(full), encode(capability), ttl=TTL_SECONDS)
