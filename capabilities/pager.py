"""The LRU pager for runtimes with a slot limit: which capabilities are live, and which to
evict to make room (sigil-backend-lru.md).

Its state lives in Redis sorted sets, so choosing a victim is a few O(log n) reads however
many capabilities are registered:

- `sigil:lru:{type}` (ephemeral, normal, persistent): live capabilities by last access;
- `sigil:lru:expiry`: live ephemerals by expiry time, so expired ones go first;
- `sigil:lru:evicting`: victims still placed while their page-out runs in the background.

A slot is claimed and a victim chosen in one Lua script, so two page-ins never pick the
same victim or overfill the runtime. The database stays the truth: `pager_rebuild` makes
the sets again from the registry whenever Redis has lost them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from capabilities.models import Capability, CapabilityType, State
from sigil_site.redis_client import get_redis

# Eviction order of the seed: expired ephemerals, then ephemerals, normals, persistents.
CLASS_ORDER = (CapabilityType.EPHEMERAL, CapabilityType.NORMAL, CapabilityType.PERSISTENT)
EXPIRY_KEY = "sigil:lru:expiry"
EVICTING_KEY = "sigil:lru:evicting"
BUILT_KEY = "sigil:lru:built"
EVICTIONS_KEY = "sigil:lru:evictions"


def lru_key(capability_type: str) -> str:
    return f"sigil:lru:{capability_type}"


def inflight_key(full: str) -> str:
    return f"sigil:inflight:{full}"


LRU_KEYS = [lru_key(t) for t in CLASS_ORDER]

# KEYS: lru:ephemeral, lru:normal, lru:persistent, expiry, evicting
# ARGV: full, type, now, slots, safety margin, expires epoch or ''
# Returns {'live'} | {'claimed'} | {'evicted', victim} | {'full'}
CLAIM_SLOT = """
local full, kind, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local slots, margin, expires = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local classes = {KEYS[1], KEYS[2], KEYS[3]}
local expiry, evicting = KEYS[4], KEYS[5]
for _, key in ipairs(classes) do
  if redis.call('ZSCORE', key, full) then return {'live'} end
end
local function admit()
  redis.call('ZADD', 'sigil:lru:' .. kind, now, full)
  if expires ~= '' then redis.call('ZADD', expiry, tonumber(expires), full) end
end
local used = redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[3])
if used < slots then admit() return {'claimed'} end
-- Full: the newcomer goes into the safety margin while a victim is paged out.
if redis.call('ZCARD', evicting) >= margin then return {'full'} end
local victim = redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, 1)[1]
if not victim then
  for _, key in ipairs(classes) do
    victim = redis.call('ZRANGE', key, 0, 0)[1]
    if victim then break end
  end
end
if not victim then return {'full'} end
for _, key in ipairs(classes) do redis.call('ZREM', key, victim) end
redis.call('ZREM', expiry, victim)
redis.call('ZADD', evicting, now, victim)
redis.call('INCR', 'sigil:lru:evictions')
admit()
return {'evicted', victim}
"""


@dataclass(frozen=True)
class Claim:
    """The outcome of asking for a slot: `live` (already), `claimed`, `evicted` or `full`."""

    outcome: str
    victim: str | None = None


def pager_claim_slot(
    *, full: str, capability_type: str, now: float, slots: int, safety_margin: int, expires_epoch: float | None
) -> Claim:
    """Reserve a slot for `full`, choosing a victim when the runtime is full. Atomic."""
    pager_ensure_built()
    result = get_redis().eval(
        CLAIM_SLOT,
        5,
        *LRU_KEYS,
        EXPIRY_KEY,
        EVICTING_KEY,
        full,
        capability_type,
        f"{now:.6f}",
        slots,
        safety_margin,
        "" if expires_epoch is None else f"{expires_epoch:.6f}",
    )
    outcome = result[0].decode()
    return Claim(outcome, result[1].decode() if len(result) > 1 else None)


def pager_forget(full: str) -> None:
    """Drop `full` from every set: it is no longer placed (paged out or removed)."""
    pipe = get_redis().pipeline(transaction=True)
    for key in LRU_KEYS:
        pipe.zrem(key, full)
    pipe.zrem(EXPIRY_KEY, full)
    pipe.zrem(EVICTING_KEY, full)
    pipe.execute()


def pager_mark_leaving(full: str) -> None:
    """`full` was removed but its script is still on the runtime: it stops counting as live
    and counts against the safety margin until the background delete is done."""
    pipe = get_redis().pipeline(transaction=True)
    for key in LRU_KEYS:
        pipe.zrem(key, full)
    pipe.zrem(EXPIRY_KEY, full)
    pipe.zadd(EVICTING_KEY, {full: 0})
    pipe.execute()


def pager_drop_evicting(full: str) -> None:
    """`full` no longer holds margin: its script is deleted, or a deploy made it live again."""
    get_redis().zrem(EVICTING_KEY, full)


def pager_used_slots() -> tuple[int, int]:
    """(live, evicting) as the pager counts them."""
    pipe = get_redis().pipeline(transaction=False)
    for key in LRU_KEYS:
        pipe.zcard(key)
    pipe.zcard(EVICTING_KEY)
    *live, evicting = pipe.execute()
    return sum(live), evicting


def pager_inflight(full: str) -> int:
    value = get_redis().get(inflight_key(full))
    return int(value) if value else 0


def pager_ensure_built() -> None:
    """Rebuild the sets from the registry if Redis has lost them (restart, flush)."""
    redis = get_redis()
    if redis.exists(BUILT_KEY):
        return
    with redis.lock("sigil:lock:lru-rebuild", timeout=60, blocking_timeout=60):
        if not redis.exists(BUILT_KEY):
            pager_rebuild()


def pager_rebuild() -> None:
    """Make the sets again from the database: live rows by last access, evicting rows apart."""
    pipe = get_redis().pipeline(transaction=True)
    pipe.delete(*LRU_KEYS, EXPIRY_KEY, EVICTING_KEY)
    for full, row in _registry_rows().items():
        _admit(pipe, full, row)
    pipe.set(BUILT_KEY, 1)
    pipe.execute()


def pager_sync(*, is_placing: Callable[[str], bool]) -> int:
    """Make the sets agree with the registry, leaving capabilities being placed alone.

    Used by reconcile: unlike a rebuild, it never drops a slot claimed by a page-in that
    has not reached the database yet. Returns how many names it corrected.
    """
    pager_ensure_built()
    redis = get_redis()
    pipe = redis.pipeline(transaction=False)
    for key in (*LRU_KEYS, EVICTING_KEY):
        pipe.zrange(key, 0, -1)
    present = {m.decode() for members in pipe.execute() for m in members}
    rows = _registry_rows()
    corrections = [name for name in present ^ set(rows) if not is_placing(name)]
    pipe = redis.pipeline(transaction=True)
    for full in corrections:
        if full in rows:
            _admit(pipe, full, rows[full])
        else:
            for key in (*LRU_KEYS, EXPIRY_KEY, EVICTING_KEY):
                pipe.zrem(key, full)
    pipe.execute()
    return len(corrections)


def _registry_rows() -> dict[str, tuple]:
    from capabilities.runtimes import get_runtime

    # Only placements on this runtime take its slots: during a switch of SIGIL_BACKEND the
    # capabilities still on the previous runtime are not here yet.
    rows = Capability.objects.filter(
        state__in=(State.LIVE, State.EVICTING), backend__in=("", get_runtime().name)
    ).values_list("full_name", "type", "state", "last_access_at", "updated_at", "expires_at")
    return {row[0]: row[1:] for row in rows.iterator()}


def _admit(pipe, full: str, row: tuple) -> None:
    capability_type, state, last_access_at, updated_at, expires_at = row
    stamp = (last_access_at or updated_at).timestamp()
    if state == State.EVICTING:
        pipe.zadd(EVICTING_KEY, {full: stamp})
        return
    pipe.zadd(lru_key(capability_type), {full: stamp})
    if expires_at is not None:
        pipe.zadd(EXPIRY_KEY, {full: expires_at.timestamp()})
