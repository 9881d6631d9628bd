"""The Redis copy of every token's authority, read by the gateway and the API on each call.

`redis_keys.token(sha256)` holds `agent_id|agent_name|scope|expires_epoch|calls|placements` for a
usable token (the last two: the agent's own caps on its calls and placements in flight, empty
for the defaults), a tombstone `-` for a revoked, expired or unknown one, and `-disabled` for a
live token of an agent the owner disabled (so that its refusal can say so). Writers (issue,
revoke, disable)
overwrite it after their transaction commits; readers fill a missing entry only with
SET NX, so a late fill can never resurrect a revoked token.
"""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass
from datetime import datetime

import redis
from django.db.models import Q

from sigil import redis_keys

TOKEN_PREFIX = "sgl_"
TOMBSTONE = b"-"
DISABLED = b"-disabled"
REFUSALS = (TOMBSTONE, DISABLED)
# A positive entry is re-read from the database at least this often; revocations do not
# wait for it (they overwrite the entry), it only bounds drift after manual SQL edits.
POSITIVE_TTL_SECONDS = 300
NEGATIVE_TTL_SECONDS = 30

# A process stamps a token at most this often: "last used" is for an owner pruning unused
# tokens, to the minute; a stamp per request would cost the API one more Redis round trip.
STAMP_INTERVAL_SECONDS = 60


class TokenState(enum.StrEnum):
    USABLE = "usable"
    REVOKED = "revoked"
    EXPIRED = "expired"


def token_state(*, revoked: bool, expires_epoch: float | None, now_epoch: float) -> TokenState:
    """The one rule of a token's usability: usable until it is revoked, and until it expires
    (a token whose expiry is now has expired). Rows (Token.state), the cached entries (decode)
    and the owner's filters (state_filter) all read it here."""
    if revoked:
        return TokenState.REVOKED
    if expires_epoch is not None and expires_epoch <= now_epoch:
        return TokenState.EXPIRED
    return TokenState.USABLE


def state_filter(state: TokenState, now: datetime) -> Q:
    """token_state() as a query on tokens' rows: those in `state` at `now`."""
    expired = Q(expires_at__lte=now)
    return {
        TokenState.USABLE: Q(revoked_at__isnull=True) & ~expired,
        TokenState.REVOKED: Q(revoked_at__isnull=False),
        TokenState.EXPIRED: Q(revoked_at__isnull=True) & expired,
    }[state]


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the token's agent and scope."""

    agent_id: int
    agent_name: str
    scope: str
    token_hash: str
    # The agent's own shares of a server (capabilities/engine/shares.py); 0: the defaults.
    calls_in_flight: int = 0
    placements_in_flight: int = 0

    @property
    def can_deploy(self) -> bool:
        return self.scope == "deploy"


def hash_secret(secret: str) -> str:
    # Tokens are 256 random bits, so a plain sha256 is as strong as a slow hash here.
    return hashlib.sha256(secret.encode()).hexdigest()


def encode(
    agent_id: int,
    agent_name: str,
    scope: str,
    expires_epoch: float | None,
    *,
    calls_in_flight: int | None = None,
    placements_in_flight: int | None = None,
) -> bytes:
    expires = "" if expires_epoch is None else expires_epoch
    return f"{agent_id}|{agent_name}|{scope}|{expires}|{calls_in_flight or ''}|{placements_in_flight or ''}".encode()


def decode(token_hash: str, raw: bytes, now_epoch: float) -> Principal | None:
    """The principal a cached entry grants at `now_epoch`, or None."""
    if raw in REFUSALS:
        return None
    agent_id, agent_name, scope, expires, *shares = raw.decode().split("|")
    # Only a token not revoked has an entry; it may have expired since.
    state = token_state(revoked=False, expires_epoch=float(expires) if expires else None, now_epoch=now_epoch)
    if state != TokenState.USABLE:
        return None
    calls, placements = (int(share or 0) for share in shares) if len(shares) == 2 else (0, 0)
    return Principal(int(agent_id), agent_name, scope, token_hash, calls, placements)


# token hash → when this process last stamped it (time.monotonic()). Bounded by the number
# of usable tokens, which only the owner creates. Threads may race to stamp twice: harmless.
_stamped_at: dict[str, float] = {}


def stamp_due(token_hash: str) -> bool:
    """Whether this process should stamp the token now (and, if so, counts it as stamped):
    false within STAMP_INTERVAL_SECONDS of its last stamp here. No I/O, so an async caller
    can decide before it writes `redis_keys.TOKENS_USED` with its own client."""
    now = time.monotonic()
    last = _stamped_at.get(token_hash)
    if last is not None and now - last < STAMP_INTERVAL_SECONDS:
        return False
    _stamped_at[token_hash] = now
    return True


def stamp_now() -> str:
    """The value of a stamp in redis_keys.TOKENS_USED: epoch seconds, as the gateway's record
    script writes."""
    return f"{time.time():.6f}"


def stamp_used(client: redis.Redis, token_hash: str) -> bool:
    """Record that the token was used now, unless this process did within
    STAMP_INTERVAL_SECONDS (then no Redis round trip at all). Returns whether it wrote."""
    if not stamp_due(token_hash):
        return False
    client.hset(redis_keys.TOKENS_USED, token_hash, stamp_now())
    return True
