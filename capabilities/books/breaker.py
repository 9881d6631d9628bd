"""The circuit breaker of each capability: its states, its Redis keys and its Lua, in one place.

- **closed** (no key): calls go through; each failure (a 5xx, an exception, a timeout, a
  limit exceeded) counts, each success resets the count.
- **open** for SIGIL_BREAKER_COOLDOWN_SECONDS after SIGIL_BREAKER_THRESHOLD failures in a
  row: calls are refused `503 degraded` with the time left as Retry-After.
- **half-open** once the cool-down has passed: exactly one trial call goes through; its
  success closes the breaker, its failure opens it for another cool-down.
- **forced** by the owner: open with no end, a flag rather than a time; only the owner's
  reset closes it, and a call in flight when it was forced neither closes nor shortens it.

The gateway reads the open key in the MGET it sends before every call, and records a call's
outcome inside stats.RECORD_CALLS (which includes RECORD_OUTCOME_LUA), so the breaker costs no
round trip of its own. The breaker only decides and reports: what follows a refusal or a
transition (the database's copy of the state, the split guard) is the services' to send
(capabilities/services/observability.py: breaker_enter, breaker_changed).
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field

from capabilities.books import failures
from capabilities.models import BreakerState
from sigil import redis_keys
from sigil.configured import FromSettings, setting
from sigil.errors import Degraded
from sigil.redis_client import get_redis

# The open key's value when the owner forced the breaker; otherwise it holds the epoch
# (seconds) the cool-down ends at.
FORCED = b"forced"


class Status(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"
    FORCED = "forced"


def status_of(raw: bytes | None, *, now: float) -> Status:
    """The state an open key's value (as read from Redis) stands for at `now`."""
    if raw is None:
        return Status.CLOSED
    if raw == FORCED:
        return Status.FORCED
    return Status.OPEN if now < float(raw) else Status.HALF_OPEN


# A Lua function for the script that records a call's outcome (stats.RECORD_CALLS).
# breaker_record(open, failures, trial: keys; now: epoch s; ok, is_trial: booleans; threshold;
# cooldown: s) returns 'opened' or 'closed' when the breaker changed, '' otherwise.
RECORD_OUTCOME_LUA = """
local function breaker_record(open, failures, trial, now, ok, is_trial, threshold, cooldown)
  if is_trial then redis.call('DEL', trial) end
  local state = redis.call('GET', open)
  if state == 'forced' then return '' end
  if ok then
    redis.call('DEL', failures)
    if redis.call('DEL', open) == 1 then return 'closed' end
    return ''
  end
  local count = redis.call('INCR', failures)
  if is_trial or count >= threshold then
    redis.call('SET', open, tostring(now + cooldown))
    -- already open (calls that were in flight when it opened): not a new transition
    if state and not is_trial then return '' end
    return 'opened'
  end
  return ''
end
"""


def published(raw: bytes | None) -> str | float | None:
    """The breaker as the edge reads it (a route's "brk" in Workers KV) from its open key's
    value: None while closed, "forced" while forced, else the epoch its cool-down ends at
    (open before it, half-open after)."""
    if raw is None:
        return None
    return FORCED.decode() if raw == FORCED else float(raw)


def transition(change: bytes | str | None) -> BreakerState | None:
    """The state a breaker script's answer ('opened', 'closed'; '' for none) moved to, or None."""
    if not change:
        return None
    return BreakerState.OPEN if change in (b"opened", "opened") else BreakerState.CLOSED


@dataclass(frozen=True)
class Breaker(FromSettings):
    """The breaker rules with their settings; one per gateway, or built where needed."""

    threshold: int = setting("SIGIL_BREAKER_THRESHOLD")
    cooldown_seconds: float = setting("SIGIL_BREAKER_COOLDOWN_SECONDS")

    def enter(self, redis, *, full: str, raw: bytes, now: float) -> bool:
        """Admit a call to a capability whose open key holds `raw`; return True when the call
        is the half-open breaker's one trial (its outcome must then be recorded as one).

        Raises Degraded while open or forced, or while another trial is in progress.
        """
        status = status_of(raw, now=now)
        if status == Status.FORCED:
            # No end to announce: ask the caller to look again after one cool-down.
            raise Degraded(f"{full} was made degraded by Sigil's owner", retry_after=self.cooldown_seconds)
        if status == Status.OPEN:
            raise Degraded(f"{full} is degraded after repeated failures", retry_after=float(raw) - now)
        ttl_ms = int(self.cooldown_seconds * 1000) or 1000
        if not redis.set(redis_keys.breaker_trial(full), 1, nx=True, px=ttl_ms):
            raise Degraded(f"{full} is degraded; a trial call is in progress", retry_after=1)
        return True


def breaker_reset(*, full: str) -> None:
    """Close `full`'s breaker now, forced or not, forgetting its failures. Idempotent."""
    get_redis().delete(
        redis_keys.breaker_open(full),
        redis_keys.breaker_failures(full),
        redis_keys.breaker_trial(full),
        redis_keys.breaker_forced_by(full),
    )


def breaker_force(*, full: str, actor: str = "", now: float | None = None) -> None:
    """Open `full`'s breaker until breaker_reset, noting `actor` as who forced it; any trial
    in progress ends. Idempotent (forcing again keeps the first actor and time)."""
    now = time.time() if now is None else now
    pipe = get_redis().pipeline(transaction=True)
    pipe.set(redis_keys.breaker_open(full), FORCED)
    pipe.set(redis_keys.breaker_forced_by(full), json.dumps({"by": actor, "at": round(now, 3)}), nx=True)
    pipe.delete(redis_keys.breaker_trial(full))
    pipe.execute()


@dataclass(frozen=True)
class BreakerReport:
    """Why a breaker is where it is: forced by whom, or tripped by which failures, and until when."""

    status: Status
    failures_in_a_row: int
    forced_by: str | None = None
    forced_at_epoch: float | None = None
    opened_at_epoch: float | None = None
    until_epoch: float | None = None  # when a trial call may go through; None while forced
    tripped_by: list[failures.Failure] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "state": str(self.status),
            "failures_in_a_row": self.failures_in_a_row,
            "forced_by": self.forced_by,
            "forced_at": self.forced_at_epoch,
            "opened_at": self.opened_at_epoch,
            "until": self.until_epoch,
            "tripped_by": [f.request_id for f in self.tripped_by],
        }


def breaker_describe(*, full: str, now: float | None = None) -> BreakerReport:
    """The breaker of `full` now, with the reason it is open. Reads Redis only."""
    now = time.time() if now is None else now
    raw, count, forced_raw = get_redis().mget(
        redis_keys.breaker_open(full), redis_keys.breaker_failures(full), redis_keys.breaker_forced_by(full)
    )
    status = status_of(raw, now=now)
    in_a_row = int(count or 0)
    if status == Status.CLOSED:
        return BreakerReport(status=status, failures_in_a_row=in_a_row)
    if status == Status.FORCED:
        forced = json.loads(forced_raw) if forced_raw else {}
        return BreakerReport(
            status=status,
            failures_in_a_row=in_a_row,
            forced_by=forced.get("by") or "unknown",
            forced_at_epoch=forced.get("at"),
        )
    rules = Breaker.from_settings()
    until = float(raw)
    opened = until - rules.cooldown_seconds
    # The failures recorded up to the moment it opened: at most a threshold's worth of them.
    recent = failures.failures_list(full=full, limit=rules.threshold + 5)
    tripped = [f for f in recent if f.at_epoch <= opened + 0.01][: rules.threshold]
    return BreakerReport(
        status=status,
        failures_in_a_row=in_a_row,
        opened_at_epoch=round(opened, 3),
        until_epoch=round(until, 3),
        tripped_by=tripped,
    )
