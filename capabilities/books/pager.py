"""The LRU pager for runtimes with a slot limit: which capabilities are placed, and which to
evict to make room (sigil-backend-lru.md).

The policy is plain Python (`eviction_order`, `victims_needed`, and prewarm's
`prewarm_plan`): pure functions over candidates, slot counts and `now`. The Lua below runs
the same policy atomically on the pager's Redis state, and is tested against those
functions; it touches only keys passed in KEYS. The state, one sorted set per place a
capability can be in (keys named in sigil/redis_keys.py):

- `lru(type)` (ephemeral, normal, persistent): placed and served, by last access;
  `LRU_EXPIRY` indexes the ephemerals among them by expiry time;
- `LRU_PLACING`: being placed (a page-in, a deploy) by the holder of its placement
  lock: it holds a slot, and is never chosen as a victim;
- `LRU_EVICTING`: victims and removed capabilities whose script is still on the
  runtime until their delete is done (they count against the safety margin).

Invariant: a capability is in at most one of these places (the expiry index aside), and
the database agrees: live rows in an LRU set, evicting rows in the evicting set.
`pager_sync` (run by reconcile) repairs any disagreement; `pager_rebuild` makes the sets
again from the registry when Redis has lost them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from capabilities.models import CapabilityType, State
from sigil import leases, redis_keys
from sigil.redis_client import get_redis

# Eviction order of the seed: expired ephemerals, then ephemerals, normals, persistents.
CLASS_ORDER = (CapabilityType.EPHEMERAL, CapabilityType.NORMAL, CapabilityType.PERSISTENT)


LRU_KEYS = [redis_keys.lru(t) for t in CLASS_ORDER]
# Every key the scripts below touch, in this order.
PAGER_KEYS = [
    *LRU_KEYS,
    redis_keys.LRU_EXPIRY,
    redis_keys.LRU_PLACING,
    redis_keys.LRU_EVICTING,
    redis_keys.LRU_EVICTIONS,
]


# --- the policy, as plain Python ---------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A placed capability the pager may evict (or has: a victim), with what its rank and
    its restoring take: its type, last access and (ephemerals) expiry, epoch s."""

    full: str
    type: str
    last_access: float
    expires: float | None = None


def eviction_order(candidates: Iterable[Candidate], *, now: float) -> list[Candidate]:
    """The candidates, first victim first: expired ephemerals (earliest expiry first), then
    ephemerals, normals and persistents, each by last access, oldest first. Ties go by name,
    as Redis orders equal scores."""
    return sorted(candidates, key=lambda c: eviction_rank(c, now=now))


def eviction_rank(c: Candidate, *, now: float) -> tuple:
    """Where `c` stands in eviction_order at `now`: the smaller, the sooner it goes."""
    if c.expires is not None and c.expires <= now:
        return (0, c.expires, c.full)
    return (1 + CLASS_ORDER.index(c.type), c.last_access, c.full)


def victims_needed(*, used: int, leaving: int, slots: int, margin: int) -> int | None:
    """How many victims admitting one more capability takes, or None when it must wait.

    `used` counts the capabilities placed or being placed, `leaving` the scripts still on the
    runtime while their delete runs. Scripts on the runtime never pass slots + margin, so a
    newcomer waits while victims are deleted; it evicts as many as bring `used` back to
    `slots` (more than one only after the slots were lowered).
    """
    if used + leaving + 1 > slots + margin:
        return None
    return max(0, used + 1 - slots)


def excess(*, used: int, slots: int) -> int:
    """How many placed capabilities are over the slots (after the slots were lowered)."""
    return max(0, used - slots)


@dataclass(frozen=True)
class PrewarmPlan:
    """What a prewarm run does: page in `place`, hottest first, paging out `evict` (least
    valuable first) for the room that free slots do not give."""

    place: tuple[str, ...] = ()
    evict: tuple[str, ...] = ()


def prewarm_plan(
    *, top: Sequence[str], cold: Collection[str], candidates: Iterable[Candidate], used: int, slots: int, now: float
) -> PrewarmPlan:
    """How prewarm places the hourly `top` (the most called capabilities, hottest first, at
    most `slots` of them) and keeps it placed: it pages in those of them that are `cold` (not
    placed, and placeable), into free slots first (`slots` less the `used` ones, placed or
    being placed), then into the slots of `candidates` (the capabilities served now) that are
    not in `top`, least valuable first in the pager's eviction_order. A capability of `top`
    is never evicted, for another one of `top` nor for anything else. Nothing while more are
    placed than there are slots (they were lowered: shedding the excess comes first).
    """
    if used > slots:
        return PrewarmPlan()
    wanted = [full for full in top if full in cold]
    kept = set(top)
    evictable = [candidate.full for candidate in eviction_order(candidates, now=now) if candidate.full not in kept]
    free = slots - used
    place = wanted[: free + len(evictable)]
    return PrewarmPlan(place=tuple(place), evict=tuple(evictable[: max(0, len(place) - free)]))


# --- the same policy, run atomically in Redis ------------------------------------------------

# Shared by the scripts, whose KEYS are always PAGER_KEYS (in that order).
_LUA_COMMON = """
local classes = {KEYS[1], KEYS[2], KEYS[3]}
local expiry, placing, evicting, evictions = KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local function live_count()
  return redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[3])
end
-- Where `full` is served from: its class index and score, or nil.
local function find(full)
  for i, key in ipairs(classes) do
    local score = redis.call('ZSCORE', key, full)
    if score then return i, score end
  end
end
-- Move the next victim of the policy (eviction_order) to the evicting set; return what
-- restoring it takes: name, class index, last access, expiry ('' when none).
local function evict_next(now)
  local victim = redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, 1)[1]
  if victim and not find(victim) then
    redis.call('ZREM', expiry, victim)  -- a stale index entry: not served, not a candidate
    return evict_next(now)
  end
  if not victim then
    for _, key in ipairs(classes) do
      victim = redis.call('ZRANGE', key, 0, 0)[1]
      if victim then break end
    end
  end
  local class, score = find(victim)
  local expires = redis.call('ZSCORE', expiry, victim) or ''
  redis.call('ZREM', classes[class], victim)
  redis.call('ZREM', expiry, victim)
  redis.call('ZADD', evicting, now, victim)
  redis.call('INCR', evictions)
  return {victim, tostring(class), score, expires}
end
-- evict_next() `count` times; the victims' fields are appended to `result`, returned.
local function evict(now, count, result)
  for _ = 1, count do
    for _, field in ipairs(evict_next(now)) do table.insert(result, field) end
  end
  return result
end
"""

# ARGV: full, now, slots, safety margin, the most victims it may take (-1: as many as needed)
# Returns {outcome, previous score, victim fields...}: outcome 'full' (nothing changed),
# 'no-room' (nothing changed: it would take more victims than it may), 'claimed' (a new
# placement), 'live' (it was served: a new version) or 'rescued' (it was evicting, its
# script still there); then four fields per victim.
CLAIM_SLOT = (
    _LUA_COMMON
    + """
local full, now = ARGV[1], tonumber(ARGV[2])
local slots, margin = tonumber(ARGV[3]), tonumber(ARGV[4])
local class, score = find(full)
if class or redis.call('ZSCORE', placing, full) then
  -- Already counted: it stays counted, but out of the victims' reach while placed again.
  -- (A stale entry in `placing` is a dead placer's, as the caller holds the lock.)
  if class then redis.call('ZREM', classes[class], full) end
  redis.call('ZREM', expiry, full)
  redis.call('ZADD', placing, now, full)
  return {class and 'live' or 'claimed', score or ''}
end
local was_evicting = redis.call('ZSCORE', evicting, full)
local used, leaving = live_count() + redis.call('ZCARD', placing), redis.call('ZCARD', evicting)
if was_evicting then leaving = leaving - 1 end
-- victims_needed()
if used + leaving + 1 > slots + margin then return {'full', ''} end
local needed = math.max(0, used + 1 - slots)
if needed > live_count() then return {'full', ''} end  -- the rest is being placed
local max_victims = tonumber(ARGV[5])
if max_victims >= 0 and needed > max_victims then return {'no-room', ''} end
redis.call('ZREM', evicting, full)
redis.call('ZADD', placing, now, full)
return evict(now, needed, {was_evicting and 'rescued' or 'claimed', was_evicting or ''})
"""
)

# ARGV: now, slots. Moves the excess over `slots` (excess()) to the evicting set, in the
# policy's order; returns four fields per victim.
SHED_EXCESS = (
    _LUA_COMMON
    + """
local now, slots = tonumber(ARGV[1]), tonumber(ARGV[2])
return evict(now, math.min(live_count(), live_count() + redis.call('ZCARD', placing) - slots), {})
"""
)

# ARGV: full, class index (1-3), score (its access time), expiry ('' when none).
# A placement is recorded: serve it from its class. Idempotent.
SETTLE = (
    _LUA_COMMON
    + """
local full, home = ARGV[1], tonumber(ARGV[2])
redis.call('ZREM', placing, full)
redis.call('ZREM', evicting, full)
for i, key in ipairs(classes) do
  if i ~= home then redis.call('ZREM', key, full) end
end
redis.call('ZADD', classes[home], ARGV[3], full)
if ARGV[4] ~= '' then redis.call('ZADD', expiry, ARGV[4], full) end
return 1
"""
)

# ARGV: full, class index, score, expiry ('' when none).
# A victim whose eviction is called off goes back where it was, if it is still evicting.
RESTORE = (
    _LUA_COMMON
    + """
local full = ARGV[1]
if redis.call('ZREM', evicting, full) == 0 then return 0 end
redis.call('ZADD', classes[tonumber(ARGV[2])], ARGV[3], full)
if ARGV[4] ~= '' then redis.call('ZADD', expiry, ARGV[4], full) end
return 1
"""
)


@dataclass(frozen=True)
class Claim:
    """The outcome of asking for a slot: `full` (wait and ask again), `no-room` (it would
    take more victims than it may), `claimed` (a new placement), `live` (placed already: a
    new version) or `rescued` (it was evicting and its script is still there); the victims
    it evicted; and the score it had before."""

    outcome: str
    victims: tuple[Candidate, ...] = ()
    previous_score: float | None = None


def _run(script: str, *args) -> list:
    return get_redis().eval(script, len(PAGER_KEYS), *PAGER_KEYS, *args)


def _victims(fields: list) -> tuple[Candidate, ...]:
    decoded = [f.decode() if isinstance(f, bytes) else str(f) for f in fields]
    return tuple(
        Candidate(
            full=decoded[i],
            type=CLASS_ORDER[int(decoded[i + 1]) - 1],
            last_access=float(decoded[i + 2]),
            expires=float(decoded[i + 3]) if decoded[i + 3] else None,
        )
        for i in range(0, len(decoded), 4)
    )


def _class_index(capability_type: str) -> int:
    return CLASS_ORDER.index(capability_type) + 1


def _epoch(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def pager_claim_slot(*, full: str, now: float, slots: int, safety_margin: int, max_victims: int | None = None) -> Claim:
    """Take a slot for `full` (which then sits in `placing`), choosing victims when the
    runtime is full, at most `max_victims` of them (None: as many as needed; 0: a free slot
    or nothing). Atomic. Call with `full`'s placement lock held, and end the claim with
    `pager_settle` or `pager_release`. The sets must be built (`pager_ensure_built`)."""
    limit = -1 if max_victims is None else max_victims
    result = _run(CLAIM_SLOT, full, repr(float(now)), slots, safety_margin, limit)
    outcome, previous = result[0].decode(), result[1].decode()
    return Claim(outcome, _victims(result[2:]), float(previous) if previous else None)


def pager_settle(*, full: str, capability_type: str, now: float, expires_epoch: float | None) -> None:
    """`full` is placed and recorded live: serve it from its class, accessed `now`."""
    _run(SETTLE, full, _class_index(capability_type), repr(float(now)), _epoch(expires_epoch))


def pager_release(*, full: str, claim: Claim, capability_type: str, expires_epoch: float | None) -> None:
    """A claim whose placement failed: `full` goes back where it was before the claim (served
    with its old score, still evicting, or nowhere). Its victims are restored apart, with
    `pager_restore`, once the database has them live again."""
    if claim.outcome == "live":
        pager_settle(full=full, capability_type=capability_type, now=claim.previous_score, expires_epoch=expires_epoch)
        return
    pipe = get_redis().pipeline(transaction=True)
    pipe.zrem(redis_keys.LRU_PLACING, full)
    if claim.outcome == "rescued":
        pipe.zadd(redis_keys.LRU_EVICTING, {full: claim.previous_score})
    pipe.execute()


def pager_restore(victim: Candidate) -> bool:
    """Put a victim whose eviction was called off back in its class, with its old access
    time; only if it is still evicting. Returns whether it was."""
    return bool(_run(RESTORE, victim.full, _class_index(victim.type), repr(victim.last_access), _epoch(victim.expires)))


def pager_shed_excess(*, now: float, slots: int) -> tuple[Candidate, ...]:
    """Move the capabilities over `slots` to the evicting set, least valuable first. Atomic.
    The sets must be built (`pager_ensure_built`)."""
    return _victims(_run(SHED_EXCESS, repr(float(now)), slots))


def pager_forget(full: str) -> None:
    """Drop `full` from the served and evicting sets: its script is gone (paged out, lost).
    A claim under way (`placing`) is left to its placer, who holds the lock."""
    pipe = get_redis().pipeline(transaction=True)
    for key in (*LRU_KEYS, redis_keys.LRU_EXPIRY, redis_keys.LRU_EVICTING):
        pipe.zrem(key, full)
    pipe.execute()


def pager_mark_leaving(full: str, *, now: float) -> None:
    """`full` was removed or evicted but its script is still on the runtime: it stops
    counting as placed and counts against the safety margin until its delete is done."""
    pipe = get_redis().pipeline(transaction=True)
    for key in (*LRU_KEYS, redis_keys.LRU_EXPIRY, redis_keys.LRU_PLACING):
        pipe.zrem(key, full)
    pipe.zadd(redis_keys.LRU_EVICTING, {full: now})
    pipe.execute()


def pager_drop_evicting(full: str) -> None:
    """`full`'s script is deleted: it no longer holds margin."""
    get_redis().zrem(redis_keys.LRU_EVICTING, full)


@dataclass(frozen=True)
class Usage:
    placed: int  # served from an LRU set
    placing: int
    evicting: int

    @property
    def used(self) -> int:
        return self.placed + self.placing


def pager_usage() -> Usage:
    """How the pager counts the runtime's scripts now."""
    pipe = get_redis().pipeline(transaction=False)
    for key in (*LRU_KEYS, redis_keys.LRU_PLACING, redis_keys.LRU_EVICTING):
        pipe.zcard(key)
    *live, placing, evicting = pipe.execute()
    return Usage(sum(live), placing, evicting)


def pager_inflight_enter(full: str) -> str:
    """A call to `full` is in flight in this process (one round trip: the count, and the
    process's liveness renewed with it). Returns the process's id:
    what `pager_inflight_leave`, or the stats' RECORD_CALLS as its in-flight argument, takes
    back. A count stops counting once its process is no longer live (leases.this_process)."""
    pipe = get_redis().pipeline(transaction=False)
    process = pager_inflight_enter_queue(pipe, full)
    pipe.execute()
    return process


def pager_inflight_enter_queue(pipe, full: str) -> str:
    """Queue pager_inflight_enter()'s commands on `pipe`, a pipeline of either Redis client
    (the engine's is asyncio's), and return the process's id; the caller executes it."""
    process = leases.mark_live(pipe)
    pipe.hincrby(redis_keys.inflight_by_process(full), process, 1)
    return process


def pager_inflight_leave(full: str, *, process: str, pipe=None) -> None:
    """The call counted by `pager_inflight_enter` (which returned `process`) has ended;
    queued on `pipe` when given."""
    (pipe or get_redis()).hincrby(redis_keys.inflight_by_process(full), process, -1)


def pager_candidates() -> list[Candidate]:
    """Every capability served from the LRU sets, as the policy sees it (for prewarm_plan)."""
    pipe = get_redis().pipeline(transaction=False)
    for key in LRU_KEYS:
        pipe.zrange(key, 0, -1, withscores=True)
    pipe.zrange(redis_keys.LRU_EXPIRY, 0, -1, withscores=True)
    *served, expiring = pipe.execute()
    expires = {member.decode(): score for member, score in expiring}
    return [
        Candidate(full=member.decode(), type=kind, last_access=score, expires=expires.get(member.decode()))
        for kind, members in zip(CLASS_ORDER, served, strict=True)
        for member, score in members
    ]


def pager_inflight(full: str) -> int:
    """The calls in flight to `full` in live processes. The counts of processes no longer
    live are dropped: their calls died with them."""
    redis = get_redis()
    by_process = redis.hgetall(redis_keys.inflight_by_process(full))
    counts = {process.decode(): int(count) for process, count in by_process.items()}
    live = leases.processes_live(sorted(counts))
    dead = [process for process, is_live in live.items() if not is_live]
    if dead:
        redis.hdel(redis_keys.inflight_by_process(full), *dead)
    return sum(max(0, counts[process]) for process, is_live in live.items() if is_live)


# KEYS: the placing set, the placement lock's key. ARGV: full.
# A placing entry whose placer's lock is gone (the placer died) gives its slot back.
DROP_UNHELD_PLACING = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
return redis.call('ZREM', KEYS[1], ARGV[1])
"""


def pager_placing() -> list[str]:
    return [member.decode() for member in get_redis().zrange(redis_keys.LRU_PLACING, 0, -1)]


def pager_drop_unheld_placing(full: str, *, lock_key: str) -> bool:
    """Drop `full` from `placing` unless `lock_key` (its placement lock) is held: its placer
    died mid-placement. Atomic. Returns whether it was dropped."""
    return bool(get_redis().eval(DROP_UNHELD_PLACING, 2, redis_keys.LRU_PLACING, lock_key, full))


def pager_note_chosen(full: str, victims: Iterable[str]) -> None:
    """A placement of `full` chose `victims`: if it dies before it ends, they are paged out."""
    victims = list(victims)
    if victims:
        pipe = get_redis().pipeline(transaction=True)
        pipe.sadd(redis_keys.lru_chosen(full), *victims)
        pipe.expire(redis_keys.lru_chosen(full), 86400)
        pipe.execute()


def pager_take_chosen(full: str) -> list[str]:
    """The victims a placement of `full` chose, forgotten: it has ended (or died)."""
    pipe = get_redis().pipeline(transaction=True)
    pipe.smembers(redis_keys.lru_chosen(full))
    pipe.delete(redis_keys.lru_chosen(full))
    return sorted(member.decode() for member in pipe.execute()[0])


class RegistryRow(NamedTuple):
    """A live or evicting capability as the registry records it, handed to the pager by the
    service that reads the registry (the pager reads no database)."""

    type: str
    state: str
    last_access_at: datetime | None
    updated_at: datetime
    expires_at: datetime | None


def pager_ensure_built(*, rows: Callable[[], Mapping[str, RegistryRow]]) -> None:
    """Rebuild the sets from `rows()` (the registry's live and evicting rows, called only
    then) if Redis has lost them (restart, flush)."""
    redis = get_redis()
    if redis.exists(redis_keys.LRU_BUILT):
        return
    # A lease: a process that dies mid-rebuild holds up the others for a lease, not a minute.
    with leases.Lease(redis_keys.LRU_REBUILD_LOCK, hold_seconds=60, blocking_timeout=60):
        if not redis.exists(redis_keys.LRU_BUILT):
            pager_rebuild(rows())


def pager_rebuild(rows: Mapping[str, RegistryRow]) -> None:
    """Make the sets again from the registry's `rows`: live rows by last access, evicting rows apart."""
    pipe = get_redis().pipeline(transaction=True)
    pipe.delete(*LRU_KEYS, redis_keys.LRU_EXPIRY, redis_keys.LRU_PLACING, redis_keys.LRU_EVICTING)
    for full, row in rows.items():
        _place_as_recorded(pipe, full, row)
    pipe.set(redis_keys.LRU_BUILT, 1)
    pipe.execute()


def pager_locations() -> dict[str, set[str]]:
    """Every name in the pager's sets, with the places it is in (an LRU key, `placing` or
    `evicting`; the expiry index aside). For reconcile, and for tests of the invariant."""
    pipe = get_redis().pipeline(transaction=False)
    places = (*LRU_KEYS, redis_keys.LRU_PLACING, redis_keys.LRU_EVICTING)
    for key in places:
        pipe.zrange(key, 0, -1)
    found: dict[str, set[str]] = {}
    for key, members in zip(places, pipe.execute(), strict=True):
        for member in members:
            found.setdefault(member.decode(), set()).add(key)
    return found


def expected_place(capability_type: str, state: str) -> str | None:
    """Where the registry says a capability belongs in the pager's sets."""
    if state == State.LIVE:
        return redis_keys.lru(capability_type)
    if state == State.EVICTING:
        return redis_keys.LRU_EVICTING
    return None


def pager_sync(*, rows: Mapping[str, RegistryRow], is_placing: Callable[[str], bool]) -> list[str]:
    """Make the sets agree with the registry, leaving capabilities being placed alone: a live
    row in its LRU set only, an evicting row in the evicting set only, anything else in
    none (a placing entry nobody holds the lock for is a dead placer's).

    Used by reconcile: unlike a rebuild, it never drops a slot claimed by a page-in that has
    not reached the database yet. Returns the names it corrected.
    """
    pager_ensure_built(rows=lambda: rows)
    found = pager_locations()
    corrected = []
    for full in sorted(set(found) | set(rows)):
        want = expected_place(rows[full].type, rows[full].state) if full in rows else None
        if found.get(full, set()) == ({want} if want else set()) or is_placing(full):
            continue
        pipe = get_redis().pipeline(transaction=True)
        for key in (*LRU_KEYS, redis_keys.LRU_EXPIRY, redis_keys.LRU_PLACING, redis_keys.LRU_EVICTING):
            if key != want:
                pipe.zrem(key, full)
        if want:
            _place_as_recorded(pipe, full, rows[full])
        pipe.execute()
        corrected.append(full)
    return corrected


def _place_as_recorded(pipe, full: str, row: RegistryRow) -> None:
    capability_type, state, last_access_at, updated_at, expires_at = row
    stamp = (last_access_at or updated_at).timestamp()
    if state == State.EVICTING:
        pipe.zadd(redis_keys.LRU_EVICTING, {full: stamp})
        return
    # NX: a score already there (a later access the stats have not flushed) is kept.
    pipe.zadd(redis_keys.lru(capability_type), {full: stamp}, nx=True)
    if expires_at is not None:
        pipe.zadd(redis_keys.LRU_EXPIRY, {full: expires_at.timestamp()})
