"""The Cloudflare API's rate budget, one for every Sigil process, kept in Redis."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import random
import time
import uuid
from collections.abc import Iterator

import redis

from capabilities.runtimes.cloudflare.errors import CloudflareRateLimited, CloudflareUnavailable

logger = logging.getLogger(__name__)


# --- the shared rate budget ---------------------------------------------------------------

# A sliding-window log in one sorted set: members are requests, scores their time (ms, Redis's
# clock, so hosts with skewed clocks agree). Returns 0 and records the request when there is
# room, else how many ms until the oldest request leaves the window. A pause key, set after
# Cloudflare answered 429, makes every process wait out Retry-After. (Reading TIME in a script
# that writes needs Redis 5 or later, which replicates effects rather than scripts.)
_BUDGET_SCRIPT = """
local paused = redis.call('PTTL', KEYS[2])
if paused > 0 then return paused end
local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZCARD', KEYS[1]) < limit then
  redis.call('ZADD', KEYS[1], now, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], window)
  return 0
end
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return math.max(1, tonumber(oldest[2]) + window - now)
"""

# Cloudflare counts a request when it arrives, which is after Sigil admitted it. Stamping it
# again when it has finished keeps Sigil's window ending after Cloudflare's, so a burst one
# window after another can never land inside Cloudflare's window (and lock the token out).
_SETTLE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], 'XX', now, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 0
"""


# The latest moment (monotonic) a wait for room may reach in this context: set around a piece of
# work made of several API calls (a page-in: the upload, the toggle, the victims' deletes), so
# that their waits together stay within one allowance instead of one each.
_WAIT_UNTIL: contextvars.ContextVar[float | None] = contextvars.ContextVar("budget_wait_until", default=None)


@contextlib.contextmanager
def waits_within(seconds: float) -> Iterator[None]:
    """Every wait for room in the block ends `seconds` from now at the latest, in all."""
    until = time.monotonic() + seconds
    outer = _WAIT_UNTIL.get()
    token = _WAIT_UNTIL.set(until if outer is None else min(outer, until))
    try:
        yield
    finally:
        _WAIT_UNTIL.reset(token)


class RateBudget:
    """`limit` requests per `window_seconds`, shared by every process using the same Redis.

    `acquire` waits for room up to `max_wait_seconds`, then raises CloudflareRateLimited;
    `settle` is called when the request has been answered (or has failed).
    """

    def __init__(
        self, *, redis: redis.Redis, key: str, limit: int, window_seconds: float, max_wait_seconds: float
    ) -> None:
        if limit < 1 or window_seconds <= 0:
            raise ValueError("the rate budget needs a limit of at least 1 and a positive window")
        # One hash tag for both keys keeps them in one slot on Redis Cluster.
        self.key = f"{{{key}}}:window"
        self.pause_key = f"{{{key}}}:pause"
        self.limit = limit
        self.window_ms = int(window_seconds * 1000)
        self.max_wait_seconds = max_wait_seconds
        self._acquire_script = redis.register_script(_BUDGET_SCRIPT)
        self._settle_script = redis.register_script(_SETTLE_SCRIPT)
        self._redis = redis

    def acquire(self) -> str:
        """Take one request from the budget, waiting for room; returns its ticket for `settle`.

        Raises CloudflareRateLimited when no room comes within the allowed wait.
        """
        ticket = uuid.uuid4().hex
        started = time.monotonic()
        deadline = min(started + self.max_wait_seconds, _WAIT_UNTIL.get() or float("inf"))
        while True:
            try:
                wait_ms = int(
                    self._acquire_script(keys=[self.key, self.pause_key], args=[self.limit, self.window_ms, ticket])
                )
            except redis.RedisError as exc:
                # Without the shared budget, calling could lock every process out for 5 minutes.
                raise CloudflareUnavailable(f"the Cloudflare rate budget in Redis is unreachable: {exc}") from exc
            if wait_ms <= 0:
                return ticket
            wait = wait_ms / 1000
            remaining = deadline - time.monotonic()
            if wait > remaining:
                # Room will not come within the allowed wait: fail now rather than sleep in vain.
                raise CloudflareRateLimited(
                    f"the Cloudflare API budget ({self.limit} requests per {self.window_ms / 1000:g} s) "
                    f"has no room for {wait:.1f} s, more than the {deadline - started:.1f} s this call may wait",
                    retry_after=wait,
                )
            # A little jitter so that waiters woken by the same expiry do not stampede.
            time.sleep(wait + random.uniform(0, 0.02))

    def settle(self, ticket: str) -> None:
        """Count the request from now on: it has been answered, or has failed."""
        try:
            self._settle_script(keys=[self.key], args=[ticket, self.window_ms])
        except redis.RedisError as exc:
            # The call itself is done; failing it now would only make it run again.
            logger.warning("could not settle a Cloudflare budget ticket in Redis: %s", exc)

    def adopt_policy(self, *, limit: int, window_seconds: float) -> None:
        """Use Cloudflare's stated quota (`Ratelimit-Policy`) when it is tighter than the
        configured one: `limit` requests per `window_seconds`. In this process; every process
        reads the same header on its own calls. A looser policy changes nothing."""
        if limit < 1 or window_seconds <= 0:
            return
        configured = self.limit / self.window_ms
        stated = limit / (window_seconds * 1000)
        if stated < configured:
            logger.warning(
                "Cloudflare states a rate limit of %d requests per %g s, tighter than the %d per %g s "
                "configured (SIGIL_CF_RATE_LIMIT, SIGIL_CF_RATE_WINDOW_SECONDS): using Cloudflare's",
                limit,
                window_seconds,
                self.limit,
                self.window_ms / 1000,
            )
            self.limit, self.window_ms = limit, int(window_seconds * 1000)

    def pause(self, seconds: float) -> None:
        """Make every process wait `seconds` before its next request (after a 429)."""
        milliseconds = max(1, int(seconds * 1000))
        try:
            current = self._redis.pttl(self.pause_key)
            if current is None or current < milliseconds:
                self._redis.set(self.pause_key, b"1", px=milliseconds)
        except redis.RedisError as exc:
            raise CloudflareUnavailable(f"the Cloudflare rate budget in Redis is unreachable: {exc}") from exc
