"""The last good answers of a capability that opted in (`"cache_when_degraded": true` at
deploy), served while its breaker is open: the registry's "answer from cache or 503".

Per capability, `redis_keys.degraded_cache(full)` maps a GET's path and query to its last good
answer (status, headers, body, when), and `redis_keys.degraded_cache_index(full)` orders those
paths by when they were stored, so that only the newest SIGIL_DEGRADED_CACHE_MAX_ENTRIES are
kept. Both keys expire SIGIL_DEGRADED_CACHE_MAX_AGE_SECONDS after the last store, and an
entry older than that is never served. Capabilities without the option cost nothing: the
gateway reads the flag from the route it already holds, and stores nothing for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sigil import redis_keys
from sigil.configured import FromSettings, setting

# Marks an answer served from this cache; its value says why.
CACHE_HEADER = ("X-Sigil-Cache", "degraded")


@dataclass(frozen=True)
class CachedAnswer:
    """A good answer as kept, to be served again while the breaker is open."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    stored_epoch: float


# KEYS: entries, index. ARGV: path and query, the answer (JSON), now (epoch s), most entries,
# max age (s). Stores the answer, drops the oldest beyond the bound, renews the expiry.
_STORE = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if excess > 0 then
  local oldest = redis.call('ZRANGE', KEYS[2], 0, excess - 1)
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, excess - 1)
  redis.call('HDEL', KEYS[1], unpack(oldest))
end
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return 1
"""


@dataclass(frozen=True)
class DegradedCache(FromSettings):
    """The cache's bounds, from settings; one per gateway."""

    max_entries: int = setting("SIGIL_DEGRADED_CACHE_MAX_ENTRIES")
    max_age_seconds: int = setting("SIGIL_DEGRADED_CACHE_MAX_AGE_SECONDS")
    max_body_bytes: int = setting("SIGIL_DEGRADED_CACHE_MAX_BYTES")

    def store(self, redis, *, full: str, target: str, answer: CachedAnswer) -> None:
        """Keep `answer` as the last good one for `target` (path and query). Idempotent."""
        encoded = json.dumps(
            {
                "status": answer.status,
                "reason": answer.reason,
                "headers": answer.headers,
                "body": answer.body.decode("latin-1"),  # bytes as one code point each
                "at": answer.stored_epoch,
            },
            separators=(",", ":"),
        )
        redis.eval(
            _STORE,
            2,
            redis_keys.degraded_cache(full),
            redis_keys.degraded_cache_index(full),
            target,
            encoded,
            f"{answer.stored_epoch:.6f}",
            self.max_entries,
            self.max_age_seconds,
        )

    def lookup(self, redis, *, full: str, target: str, now: float) -> CachedAnswer | None:
        """The last good answer for `target`, unless none or older than the maximum age."""
        raw = redis.hget(redis_keys.degraded_cache(full), target)
        if raw is None:
            return None
        data = json.loads(raw)
        if now - data["at"] > self.max_age_seconds:
            return None
        return CachedAnswer(
            status=data["status"],
            reason=data["reason"],
            headers=[tuple(pair) for pair in data["headers"]],
            body=data["body"].encode("latin-1"),
            stored_epoch=data["at"],
        )
