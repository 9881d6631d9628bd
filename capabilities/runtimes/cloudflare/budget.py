"""The Cloudflare API's rate budget, one for every Sigil process, kept in Redis, served by class
of work (capabilities/runtimes/api_work.py)."""

from __future__ import annotations

import logging
import math
import random
import time
import uuid

import redis

from capabilities.runtimes.api_work import ApiClass, current_api_class, wait_allowance
from capabilities.runtimes.cloudflare.errors import CloudflareRateLimited, CloudflareUnavailable
from sigil import redis_keys

logger = logging.getLogger(__name__)


# --- the shared rate budget ---------------------------------------------------------------

# Of the window, what each class may fill (ApiClass, in the order the budget serves them): a
# page-in may take the whole window, and each class below it leaves the rest to those above it,
# so a busy class never holds room the work above it waits for. Housekeeping also has a share
# of its own (SIGIL_CF_HOUSEKEEPING_SHARE): however idle the rest, it never takes more.
CEILINGS = {
    ApiClass.PAGE_IN: 1.0,
    ApiClass.DEPLOY: 0.95,
    ApiClass.PAGE_OUT: 0.85,
    ApiClass.HOUSEKEEPING: 0.6,
}

# A sliding-window log in sorted sets: members are requests, scores their time (ms, Redis's
# clock, so hosts with skewed clocks agree); every request is in the window's set, and
# housekeeping's in a set of their own too. KEYS: the window, the pause, housekeeping's.
# ARGV: how many requests the class may have in the window (its ceiling), how many of its own
# (0: no cap of its own), the window (ms), the ticket. Records the request and returns 0 when
# there is room; else how many ms until there is room for this class: until enough of the
# window's requests leave it that its count is under the class's ceiling (and under its own
# cap), or until the pause ends (set after Cloudflare answered 429, or said the token has
# nothing left), whichever is later. (Reading TIME in a script that writes needs Redis 5 or
# later, which replicates effects rather than scripts.)
_BUDGET_SCRIPT = """
local ceiling = tonumber(ARGV[1])
local own_cap = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function until_under(key, cap)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  local count = redis.call('ZCARD', key)
  if count < cap then return 0 end
  local leaving = redis.call('ZRANGE', key, count - cap, count - cap, 'WITHSCORES')
  return math.max(1, tonumber(leaving[2]) + window - now)
end
local wait = until_under(KEYS[1], ceiling)
if own_cap > 0 then wait = math.max(wait, until_under(KEYS[3], own_cap)) end
local paused = redis.call('PTTL', KEYS[2])
if paused > wait then wait = paused end
if wait > 0 then return wait end
redis.call('ZADD', KEYS[1], now, ARGV[4])
redis.call('PEXPIRE', KEYS[1], window)
if own_cap > 0 then
  redis.call('ZADD', KEYS[3], now, ARGV[4])
  redis.call('PEXPIRE', KEYS[3], window)
end
return 0
"""

# Cloudflare counts a request when it arrives, which is after Sigil admitted it. Stamping it
# again when it has finished keeps Sigil's window ending after Cloudflare's, so a burst one
# window after another can never land inside Cloudflare's window (and lock the token out).
_SETTLE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, key in ipairs(KEYS) do
  if redis.call('ZADD', key, 'XX', 'CH', now, ARGV[1]) > 0 then redis.call('PEXPIRE', key, ARGV[2]) end
end
return 0
"""


class RateBudget:
    """`limit` requests per `window_seconds`, shared by every process using the same Redis,
    served by class (ApiClass): each class may fill the window up to its ceiling (CEILINGS),
    and housekeeping no more than `housekeeping_share` of it with its own requests.

    `acquire` takes room for the current work's class, waiting for it up to `max_wait_seconds`
    (and within the work's allowance, api_work.waits_within) unless the class never waits,
    then raises CloudflareRateLimited at once; `settle` is called when the request has been
    answered (or has failed).
    """

    def __init__(
        self,
        *,
        redis: redis.Redis,
        keys: redis_keys.BudgetKeys,
        limit: int,
        window_seconds: float,
        max_wait_seconds: float,
        housekeeping_share: float = 0.2,
    ) -> None:
        if limit < 1 or window_seconds <= 0:
            raise ValueError("the rate budget needs a limit of at least 1 and a positive window")
        if not 0 < housekeeping_share <= CEILINGS[ApiClass.HOUSEKEEPING]:
            raise ValueError(
                f"housekeeping's share of the rate budget must be over 0 and at most {CEILINGS[ApiClass.HOUSEKEEPING]}"
            )
        self.key, self.pause_key, self.housekeeping_key = keys
        self.limit = limit
        self.window_ms = int(window_seconds * 1000)
        self.max_wait_seconds = max_wait_seconds
        self.housekeeping_share = housekeeping_share
        self._acquire_script = redis.register_script(_BUDGET_SCRIPT)
        self._settle_script = redis.register_script(_SETTLE_SCRIPT)
        self._redis = redis

    def ceiling(self, api_class: ApiClass) -> int:
        """How many requests the window may hold once `api_class` has taken one: its share of
        the limit, at least one, so that a budget too small to divide still serves every class."""
        return max(1, math.ceil(CEILINGS[api_class] * self.limit))

    def own_cap(self, api_class: ApiClass) -> int:
        """How many requests of its own `api_class` may have in the window; 0: no cap of its own."""
        if api_class is not ApiClass.HOUSEKEEPING:
            return 0
        return max(1, math.floor(self.housekeeping_share * self.limit))

    def allowed_wait(self, api_class: ApiClass | None = None) -> float:
        """How long work of `api_class` (by default the current work's) may wait for room now:
        nothing for a class that never waits, else the budget's longest wait within the work's
        own allowance."""
        api_class = api_class or current_api_class()
        if not api_class.waits:
            return 0.0
        allowance = wait_allowance()
        return self.max_wait_seconds if allowance is None else min(self.max_wait_seconds, allowance)

    def acquire(self, api_class: ApiClass | None = None) -> str:
        """Take one request from the budget for `api_class` (by default the current work's),
        waiting for room if its class waits; returns its ticket for `settle`.

        Raises CloudflareRateLimited at once when room will not come within the wait allowed,
        with `retry_after` the time until this class has room; CloudflareUnavailable when Redis
        is unreachable.
        """
        api_class = api_class or current_api_class()
        ticket = uuid.uuid4().hex
        allowed = self.allowed_wait(api_class)
        deadline = time.monotonic() + allowed
        while True:
            wait_ms = self._room(api_class, ticket=ticket)
            if wait_ms <= 0:
                return ticket
            wait = wait_ms / 1000
            if time.monotonic() + wait > deadline:
                # Room will not come within the allowed wait: fail now rather than sleep in vain.
                raise CloudflareRateLimited(
                    f"the Cloudflare API budget ({self.limit} requests per {self.window_ms / 1000:g} s) "
                    f"has no room for {api_class.value} for {wait:.1f} s",
                    retry_after=wait,
                    why=no_room(api_class, wait=wait, allowed=allowed),
                )
            # A little jitter so that waiters woken by the same expiry do not stampede.
            time.sleep(wait + random.uniform(0, 0.02))

    def _room(self, api_class: ApiClass, *, ticket: str) -> int:
        """The budget script's answer: 0 when it took room for `ticket`, else ms until room."""
        try:
            return int(
                self._acquire_script(
                    keys=[self.key, self.pause_key, self.housekeeping_key],
                    args=[self.ceiling(api_class), self.own_cap(api_class), self.window_ms, ticket],
                )
            )
        except redis.RedisError as exc:
            # Without the shared budget, calling could lock every process out for 5 minutes.
            raise CloudflareUnavailable(f"the Cloudflare rate budget in Redis is unreachable: {exc}") from exc

    def settle(self, ticket: str) -> None:
        """Count the request from now on: it has been answered, or has failed."""
        try:
            self._settle_script(keys=[self.key, self.housekeeping_key], args=[ticket, self.window_ms])
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


def no_room(api_class: ApiClass, *, wait: float, allowed: float) -> str:
    """The one sentence a caller is told when `api_class` has no room for `wait` s and may wait
    `allowed` s: Sigil's words, Cloudflare's limits left to the log."""
    seconds = max(1, math.ceil(wait))
    if not api_class.waits:
        return f"Cloudflare's API budget has no room for housekeeping for {seconds} s, and housekeeping never waits"
    return f"Cloudflare's API budget has no room for {seconds} s, longer than this call may wait ({allowed:.3g} s)"
