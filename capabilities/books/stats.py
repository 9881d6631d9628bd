"""What each call leaves behind in Redis (counters, access stamp, and through the breaker's
Lua its breaker update), written in one round trip after the response, and read back in
batches by the flush task."""

from __future__ import annotations

import bisect
import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from capabilities.books import breaker
from sigil import redis_keys
from sigil.redis_client import get_redis

# Upper bounds (ms) of the latency histogram's buckets; one more bucket holds the rest.
LATENCY_BUCKETS_MS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)

# Answers that named no registered capability (a path that is no capability, one that does
# not exist, a 401 before the route was known) are counted under this name: no agent or
# capability can have it, and the totals still add up to every answer.
UNROUTED = "-"
# The same answers' running totals by status class and code are kept for /metrics (the
# per-minute windows are pruned, so they cannot give a counter), in Redis only
# (redis_keys.STATS_UNROUTED_TOTALS).


def bucket_field(latency_ms: float) -> str:
    """The stats hash field counting calls in the histogram bucket of `latency_ms`."""
    return f"b{bisect.bisect_left(LATENCY_BUCKETS_MS, latency_ms)}"


def status_class(status: int) -> str:
    """`503` → `5xx`: answers are counted by class, so their labels are a fixed few."""
    return f"{status // 100}xx"


def status_field(status: int) -> str:
    """The stats hash field counting answers of `status`'s class."""
    return f"s:{status_class(status)}"


def code_field(code: str | None) -> str:
    """The stats hash field counting answers with Sigil's error `code` ('' for none)."""
    return f"e:{code}" if code else ""


# At most one guard run is asked for per staged version in this long, however many of its
# answers are refusals.
SPLIT_GUARD_DEBOUNCE_MS = 500


def split_refusal_count(redis, *, variant: str) -> bool:
    """Count one call sent to the staged version `variant` of a split and refused by its own
    breaker: the split guard counts it as a failed answer of that version (the caller got no
    answer of the current one either). Returns whether a guard run should be asked for now
    (at most once per SPLIT_GUARD_DEBOUNCE_MS). One round trip."""
    pipe = redis.pipeline(transaction=False)
    pipe.incr(redis_keys.split_refused(variant))
    pipe.set(redis_keys.split_guard_due(variant), 1, nx=True, px=SPLIT_GUARD_DEBOUNCE_MS)
    return bool(pipe.execute()[1])


def split_refusals(variant: str) -> int:
    """How many calls to the staged version `variant` its breaker refused."""
    return int(get_redis().get(redis_keys.split_refused(variant)) or 0)


def split_forget(variant: str) -> None:
    get_redis().delete(redis_keys.split_refused(variant), redis_keys.split_guard_due(variant))


def edge_reports_count_queue(pipe, *, applied: int, lost: int) -> None:
    """Queue the count of a batch's reports on `pipe` (the transaction that applies them)."""
    if applied:
        pipe.hincrby(redis_keys.EDGE_REPORTS, "applied", applied)
    if lost:
        pipe.hincrby(redis_keys.EDGE_REPORTS, "lost", lost)


def edge_reports_counts() -> tuple[int, int]:
    """The edge's reports applied, and those lost on the way (counted by the edge, as dropped)."""
    applied, lost = get_redis().hmget(redis_keys.EDGE_REPORTS, "applied", "lost")
    return int(applied or 0), int(lost or 0)


def live_counts(full: str) -> tuple[int, int]:
    """The calls and errors of `full` the gateway recorded that no flush has claimed yet."""
    calls, errors = get_redis().hmget(redis_keys.stats(full), "calls", "errors")
    return int(calls or 0), int(errors or 0)


# One answer the capability's code did not give, counted atomically in one command: what
# answer_count_call() passes it. A script (not a MULTI) so that the engine sends it on its one
# pipelined connection, where a burst of refusals costs no connection of its own.
ANSWER_COUNT = """
local stats, dirty, unrouted_totals = KEYS[1], KEYS[2], KEYS[3]
local status_field, code_field, member = ARGV[1], ARGV[2], ARGV[3]
if ARGV[4] == '1' then redis.call('HINCRBY', stats, 'refused', 1) end
redis.call('HINCRBY', stats, status_field, 1)
if code_field ~= '' then redis.call('HINCRBY', stats, code_field, 1) end
redis.call('SADD', dirty, member)
if ARGV[5] == '1' then
  redis.call('HINCRBY', unrouted_totals, status_field, 1)
  if code_field ~= '' then redis.call('HINCRBY', unrouted_totals, code_field, 1) end
end
return 1
"""


def answer_count_call(*, full: str | None, status: int, code: str | None) -> tuple[list[str], list]:
    """ANSWER_COUNT's keys and arguments for one answer on `full` (UNROUTED when the path
    named no registered capability). A 202 (paging in behind `respond-async`) is answered,
    not refused."""
    member = full or UNROUTED
    keys = [redis_keys.stats(member), redis_keys.STATS_DIRTY, redis_keys.STATS_UNROUTED_TOTALS]
    return keys, [status_field(status), code_field(code), member, int(status >= 400), int(not full)]


def answer_count(*, full: str | None, status: int, code: str | None) -> None:
    """Count one answer the capability's code did not give (a refusal: 401, 404, 429, 503
    degraded, ...; or a 202 while it pages in) on `full`, or on UNROUTED when the path named
    no registered capability.
    One round trip; the flush moves it to the database with the calls."""
    keys, args = answer_count_call(full=full, status=status, code=code)
    get_redis().register_script(ANSWER_COUNT)(keys=keys, args=args)


def answer_count_queue(pipe, *, full: str | None, status: int, code: str | None) -> None:
    """Queue answer_count() on `pipe`, a transaction of the synchronous client that also
    applies other changes; the caller executes it."""
    keys, args = answer_count_call(full=full, status=status, code=code)
    get_redis().register_script(ANSWER_COUNT)(keys=keys, args=args, client=pipe)


def unrouted_totals() -> tuple[dict[str, int], dict[str, int]]:
    """Answers that named no capability since Redis started keeping them: (by status class, by code)."""
    raw = {k.decode(): int(v) for k, v in get_redis().hgetall(redis_keys.STATS_UNROUTED_TOTALS).items()}
    return _split_answers(raw)


def _split_answers(values: dict) -> tuple[dict[str, int], dict[str, int]]:
    statuses = {k[2:]: int(v) for k, v in values.items() if k.startswith("s:")}
    codes = {k[2:]: int(v) for k, v in values.items() if k.startswith("e:")}
    return statuses, codes


def add_counts(a: dict[str, int] | None, b: dict[str, int] | None) -> dict[str, int]:
    """Key-wise sum of two count maps (by status class or by code)."""
    total = dict(a or {})
    for key, value in (b or {}).items():
        total[key] = total.get(key, 0) + value
    return total


# Applies CallRecords in the order given, each as RECORD_KEYS keys and RECORD_ARGS arguments
# (CallRecord.keys() and .args(), concatenated):
# keys: stats, the breaker's failures, open and trial keys, dirty set, tokens-used hash, the
#       pager's LRU set for the capability's type, its in-flight counts
#       (redis_keys.inflight_by_process), its failure records,
#       the access log
# args: full name, token hash, now (epoch s), latency ms, ok (1/0), is trial (1/0),
#       threshold, cool-down seconds, the in-flight count held (0: none, else the process id
#       pager.pager_inflight_enter returned), histogram bucket field,
#       page-in ms ('' for a warm call), status class field, error code field (''),
#       failure record ('' for a success), failure records kept, the capability's type,
#       the access log's length (0: off)
# Returns, for each record, "opened" or "closed" when it changed the breaker, "" otherwise.
RECORD_KEYS = 10
RECORD_ARGS = 17
# One record is record_call(KEYS, ARGV): its parameters shadow the script's own, so its body
# reads as a script applying one record.
RECORD_CALLS = (
    breaker.RECORD_OUTCOME_LUA
    + """
local function record_call(KEYS, ARGV)
local stats, failures, open, trial, dirty, used = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local lru, inflight = KEYS[7], KEYS[8]
local full, token, now, latency = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local ok = ARGV[5] == '1'
-- XX: stamp only capabilities the pager holds as live; an unbounded runtime has no set. GT: a
-- call that ended earlier, applied later (the edge's report of it), never moves it back.
redis.call('ZADD', lru, 'XX', 'GT', now, full)
if ARGV[9] ~= '0' and ARGV[9] ~= '' then
  redis.call('HINCRBY', inflight, ARGV[9], -1)
end
redis.call('HINCRBY', stats, 'calls', 1)
redis.call('HINCRBYFLOAT', stats, 'latency_ms', latency)
redis.call('HINCRBY', stats, ARGV[10], 1)
if ARGV[11] ~= '' then
  redis.call('HINCRBY', stats, 'cold', 1)
  redis.call('HINCRBYFLOAT', stats, 'page_in_ms', ARGV[11])
end
redis.call('HSET', stats, 'last_access', ARGV[3])
redis.call('SADD', dirty, full)
redis.call('HSET', used, token, ARGV[3])
redis.call('HINCRBY', stats, ARGV[12], 1)
if ARGV[13] ~= '' then redis.call('HINCRBY', stats, ARGV[13], 1) end
if not ok then redis.call('HINCRBY', stats, 'errors', 1) end
if ARGV[14] ~= '' then
  redis.call('LPUSH', KEYS[9], ARGV[14])
  redis.call('LTRIM', KEYS[9], 0, tonumber(ARGV[15]) - 1)
end
local log_length = tonumber(ARGV[17])
if log_length > 0 then
  redis.call('RPUSH', KEYS[10], ARGV[3] .. '|' .. full .. '|' .. ARGV[16])
  redis.call('LTRIM', KEYS[10], -log_length, -1)
end
return breaker_record(open, failures, trial, now, ok, ARGV[6] == '1', tonumber(ARGV[7]), tonumber(ARGV[8]))
end
"""
    + f"local per_key, per_arg = {RECORD_KEYS}, {RECORD_ARGS}"
    + """
local changes = {}
for i = 0, #KEYS / per_key - 1 do
  local keys, args = {}, {}
  for j = 1, per_key do keys[j] = KEYS[i * per_key + j] end
  for j = 1, per_arg do args[j] = ARGV[i * per_arg + j] end
  changes[i + 1] = record_call(keys, args)
end
return changes
"""
)


class RecordedCall(Protocol):
    """What a CallRecord reads of the call it records (the engine's Call)."""

    full: str  # what was placed and called: a staged version's own name in a split
    capability_type: str
    token_hash: str
    is_trial: bool
    inflight_process: str | None  # the process whose in-flight count the call holds (pager_inflight_enter)
    page_in_ms: float | None


@dataclass(frozen=True, slots=True)
class CallRecord:
    """What one call that reached the capability's code leaves behind, applied by RECORD_CALLS
    (with the records of other calls that ended meanwhile, in one round trip): its counters,
    access stamp, LRU stamp, in-flight release, breaker outcome, failure record (for a
    failure) and access-pattern entry."""

    call: RecordedCall
    at_epoch: float
    latency_ms: float
    status: int
    ok: bool
    code: str | None = None  # Sigil's error code, when Sigil answered for the capability
    failure: str = ""  # failures.failure_encode() of a failure; "" for a success

    def keys(self) -> list[str]:
        full = self.call.full
        return [
            redis_keys.stats(full),
            redis_keys.breaker_failures(full),
            redis_keys.breaker_open(full),
            redis_keys.breaker_trial(full),
            redis_keys.STATS_DIRTY,
            redis_keys.TOKENS_USED,
            redis_keys.lru(self.call.capability_type),
            redis_keys.inflight_by_process(full),
            redis_keys.failures(full),
            redis_keys.ACCESS_LOG,
        ]

    def args(self, *, rules: breaker.Breaker, failures_kept: int, access_log_length: int) -> list:
        call = self.call
        return [
            call.full,
            call.token_hash,
            f"{self.at_epoch:.6f}",
            f"{self.latency_ms:.3f}",
            int(self.ok),
            int(call.is_trial),
            rules.threshold,
            rules.cooldown_seconds,
            call.inflight_process or 0,
            bucket_field(self.latency_ms),
            "" if call.page_in_ms is None else f"{call.page_in_ms:.3f}",
            status_field(self.status),
            code_field(self.code),
            self.failure,
            failures_kept,
            call.capability_type,
            access_log_length,
        ]


# The flush moves counters to the database in three steps, each safe to die after: claim a
# batch (this script: the counters move, atomically, into a batch hash named by a fresh
# flush id, listed in redis_keys.STATS_PENDING), apply it in one database transaction that
# records the flush id (so a batch is applied at most once), then release it (delete the
# batch). A flush that died leaves its batch pending, and the next flush applies it (unless
# its transaction had committed) and releases it: every call counted reaches the database once.
#
# KEYS: dirty set, pending index, the new batch, then the stats hash of each candidate
# ARGV: flush id, claim time (epoch s), then each candidate's full name, in KEYS' order
# Returns how many capabilities the batch holds (0: nothing claimed, nothing pending).
CLAIM_STATS = """
local dirty, pending, batch = KEYS[1], KEYS[2], KEYS[3]
local taken = 0
for i = 3, #ARGV do
  local full, stats = ARGV[i], KEYS[i + 1]
  redis.call('SREM', dirty, full)
  local values = redis.call('HGETALL', stats)
  if #values > 0 then
    redis.call('HSET', batch, full, cjson.encode(values))
    redis.call('DEL', stats)
    taken = taken + 1
  end
end
if taken > 0 then redis.call('ZADD', pending, ARGV[2], ARGV[1]) end
return taken
"""


@dataclass(frozen=True)
class CallStats:
    calls: int
    errors: int
    latency_ms: float
    last_access_epoch: float | None
    cold_calls: int = 0
    page_in_ms: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_MS) + 1))
    refused: int = 0  # answers the capability's code did not give
    statuses: dict[str, int] = field(default_factory=dict)  # every answer, by status class
    codes: dict[str, int] = field(default_factory=dict)  # every answer with an error code, by code

    @classmethod
    def from_fields(cls, values: dict[str, str]) -> CallStats:
        """From a stats hash's fields, as RECORD_CALLS and answer_count write them."""
        statuses, codes = _split_answers(values)
        return cls(
            refused=int(values.get("refused", 0)),
            statuses=statuses,
            codes=codes,
            calls=int(values.get("calls", 0)),
            errors=int(values.get("errors", 0)),
            latency_ms=float(values.get("latency_ms", 0.0)),
            last_access_epoch=float(values["last_access"]) if "last_access" in values else None,
            cold_calls=int(values.get("cold", 0)),
            page_in_ms=float(values.get("page_in_ms", 0.0)),
            buckets=[int(values.get(f"b{i}", 0)) for i in range(len(LATENCY_BUCKETS_MS) + 1)],
        )


@dataclass(frozen=True)
class StatsBatch:
    """Counters claimed by one flush, waiting to be applied and released."""

    flush_id: str
    claimed_epoch: float
    calls: dict[str, CallStats]  # by full name


def stats_claim(*, now_epoch: float, batch_size: int) -> StatsBatch | None:
    """Move the counters of up to `batch_size` dirty capabilities into a new pending batch;
    None when no capability has counted a call since the last claim."""
    redis = get_redis()
    candidates = [m.decode() for m in redis.srandmember(redis_keys.STATS_DIRTY, batch_size) or []]
    if not candidates:
        return None
    flush_id = uuid.uuid4().hex
    keys = [
        redis_keys.STATS_DIRTY,
        redis_keys.STATS_PENDING,
        redis_keys.stats_batch(flush_id),
        *(redis_keys.stats(full) for full in candidates),
    ]
    if not redis.eval(CLAIM_STATS, len(keys), *keys, flush_id, f"{now_epoch:.6f}", *candidates):
        return None
    return _batch_read(redis, flush_id, now_epoch)


def stats_pending(*, limit: int) -> list[StatsBatch]:
    """Batches claimed by flushes that did not release them (they died, or are running), oldest first."""
    redis = get_redis()
    batches = []
    for flush_id, claimed in redis.zrange(redis_keys.STATS_PENDING, 0, limit - 1, withscores=True):
        batches.append(_batch_read(redis, flush_id.decode(), claimed))
    return batches


def stats_release(flush_id: str) -> None:
    """Forget a batch once the database holds it. Idempotent."""
    pipe = get_redis().pipeline(transaction=True)
    pipe.delete(redis_keys.stats_batch(flush_id))
    pipe.zrem(redis_keys.STATS_PENDING, flush_id)
    pipe.execute()


# KEYS: tokens-used hash. ARGV: token hash, stamp, token hash, stamp, ...
# Forgets each stamp the database now holds, unless a newer call has replaced it meanwhile.
FORGET_STAMPS = """
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
return 0
"""


def tokens_used_read() -> dict[str, str]:
    """The last-use stamp (epoch s, as text) of each token used since its stamp was flushed."""
    return {k.decode(): v.decode() for k, v in get_redis().hgetall(redis_keys.TOKENS_USED).items()}


def tokens_used_forget(stamps: dict[str, str]) -> None:
    """Drop the stamps the database now holds; a token used again since keeps its new one."""
    if stamps:
        args = [item for pair in stamps.items() for item in pair]
        get_redis().eval(FORGET_STAMPS, 1, redis_keys.TOKENS_USED, *args)


def _batch_read(redis, flush_id: str, claimed_epoch: float) -> StatsBatch:
    calls = {}
    for full, encoded in redis.hgetall(redis_keys.stats_batch(flush_id)).items():
        flat = json.loads(encoded)
        calls[full.decode()] = CallStats.from_fields(dict(zip(flat[::2], flat[1::2], strict=True)))
    return StatsBatch(flush_id=flush_id, claimed_epoch=claimed_epoch, calls=calls)


def percentile_ms(buckets: list[int], fraction: float) -> float | None:
    """Estimate a latency percentile from histogram counts (linear within a bucket)."""
    total = sum(buckets)
    if total == 0:
        return None
    rank = fraction * total
    seen = 0
    for index, count in enumerate(buckets):
        if count and seen + count >= rank:
            lower = LATENCY_BUCKETS_MS[index - 1] if index else 0.0
            upper = LATENCY_BUCKETS_MS[index] if index < len(LATENCY_BUCKETS_MS) else LATENCY_BUCKETS_MS[-1] * 2
            return round(lower + (upper - lower) * (rank - seen) / count, 3)
        seen += count
    return float(LATENCY_BUCKETS_MS[-1])


def add_buckets(a: list[int] | None, b: list[int] | None) -> list[int]:
    """Bucket-wise sum of two histograms; a missing or short one counts as zeros."""
    width = len(LATENCY_BUCKETS_MS) + 1
    a = list(a or []) + [0] * (width - len(a or []))
    b = list(b or []) + [0] * (width - len(b or []))
    return [x + y for x, y in zip(a, b, strict=True)]
