"""What each call leaves behind in Redis (counters, access stamp, breaker), written in one
round trip after the response, and read back in batches by the flush task."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from sigil_site.redis_client import get_redis

# Upper bounds (ms) of the latency histogram's buckets; one more bucket holds the rest.
LATENCY_BUCKETS_MS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)

DIRTY_KEY = "sigil:stats:dirty"
TOKENS_USED_KEY = "sigil:tokens:used"


def stats_key(full: str) -> str:
    return f"sigil:stats:{full}"


def failures_key(full: str) -> str:
    return f"sigil:breaker:failures:{full}"


def breaker_key(full: str) -> str:
    """Holds the epoch until which the breaker stays open; absent means closed."""
    return f"sigil:breaker:open:{full}"


def trial_key(full: str) -> str:
    return f"sigil:breaker:trial:{full}"


def bucket_field(latency_ms: float) -> str:
    """The stats hash field counting calls in the histogram bucket of `latency_ms`."""
    return f"b{bisect.bisect_left(LATENCY_BUCKETS_MS, latency_ms)}"


# KEYS: stats, failures, breaker, trial, dirty set, tokens-used hash, the pager's LRU set for
#       the capability's type, its in-flight counter
# ARGV: full name, token hash, now (epoch s), latency ms, ok (1/0), is trial (1/0),
#       threshold, cool-down seconds, held an in-flight count (1/0), histogram bucket field,
#       page-in ms ('' for a warm call)
# Returns "opened" or "closed" when the breaker changed, "" otherwise.
RECORD_CALL = """
local stats, failures, breaker, trial, dirty, used = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local lru, inflight = KEYS[7], KEYS[8]
local full, token, now, latency = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local ok, is_trial = ARGV[5] == '1', ARGV[6] == '1'
local threshold, cooldown = tonumber(ARGV[7]), tonumber(ARGV[8])
-- XX: stamp only capabilities the pager holds as live; an unbounded runtime has no set.
redis.call('ZADD', lru, 'XX', now, full)
if ARGV[9] == '1' then redis.call('DECR', inflight) end
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
if is_trial then redis.call('DEL', trial) end
if not ok then redis.call('HINCRBY', stats, 'errors', 1) end
-- Open for longer than a cool-down: forced by the owner, and only the owner's reset closes
-- it; a call that was already in flight neither closes nor shortens it.
local open_until = tonumber(redis.call('GET', breaker) or '')
if open_until and open_until - now > cooldown then return '' end
if ok then
  redis.call('DEL', failures)
  if redis.call('DEL', breaker) == 1 then return 'closed' end
  return ''
end
local count = redis.call('INCR', failures)
if is_trial or count >= threshold then
  local was_open = redis.call('EXISTS', breaker)
  redis.call('SET', breaker, tostring(now + cooldown))
  if was_open == 1 and not is_trial then return '' end
  return 'opened'
end
return ''
"""

# KEYS: stats hash. Reads and clears the counters in one step, so that calls made while a
# flush runs are counted by the next one rather than lost.
TAKE_STATS = """
local values = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
return values
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


def stats_take(full: str) -> CallStats:
    """Read and reset the counters recorded for `full` since the last flush."""
    raw = get_redis().eval(TAKE_STATS, 1, stats_key(full))
    values = {raw[i].decode(): raw[i + 1].decode() for i in range(0, len(raw), 2)}
    return CallStats(
        calls=int(values.get("calls", 0)),
        errors=int(values.get("errors", 0)),
        latency_ms=float(values.get("latency_ms", 0.0)),
        last_access_epoch=float(values["last_access"]) if "last_access" in values else None,
        cold_calls=int(values.get("cold", 0)),
        page_in_ms=float(values.get("page_in_ms", 0.0)),
        buckets=[int(values.get(f"b{i}", 0)) for i in range(len(LATENCY_BUCKETS_MS) + 1)],
    )


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
