"""The Redis copy of every token's authority, read by the gateway and the API on each call.

`sigil:token:{sha256}` holds `agent_id|agent_name|scope|expires_epoch` for a usable token
and a tombstone `-` for a revoked, expired or unknown one. Writers (issue, revoke, disable)
overwrite it after their transaction commits; readers fill a missing entry only with
SET NX, so a late fill can never resurrect a revoked token.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import redis

TOKEN_PREFIX = "sgl_"
TOMBSTONE = b"-"
# A positive entry is re-read from the database at least this often; revocations do not
# wait for it (they overwrite the entry), it only bounds drift after manual SQL edits.
POSITIVE_TTL_SECONDS = 300
NEGATIVE_TTL_SECONDS = 30

# Last-use stamps: token hash → epoch seconds (as text) of its latest use, moved into
# Token.last_used_at by the stats flush. The gateway's record script stamps every call it
# records; the API and MCP stamp through stamp_used().
USED_KEY = "sigil:tokens:used"
# A process stamps a token at most this often: "last used" is for an owner pruning unused
# tokens, to the minute; a stamp per request would cost the API one more Redis round trip.
STAMP_INTERVAL_SECONDS = 60


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the token's agent and scope."""

    agent_id: int
    agent_name: str
    scope: str
    token_hash: str

    @property
    def can_deploy(self) -> bool:
        return self.scope == "deploy"


def hash_secret(secret: str) -> str:
    # Tokens are 256 random bits, so a plain sha256 is as strong as a slow hash here.
    return hashlib.sha256(secret.encode()).hexdigest()


def cache_key(token_hash: str) -> str:
    return f"sigil:token:{token_hash}"


def encode(agent_id: int, agent_name: str, scope: str, expires_epoch: float | None) -> bytes:
    return f"{agent_id}|{agent_name}|{scope}|{'' if expires_epoch is None else expires_epoch}".encode()


def decode(token_hash: str, raw: bytes, now_epoch: float) -> Principal | None:
    """The principal a cached entry grants at `now_epoch`, or None."""
    if raw == TOMBSTONE:
        return None
    agent_id, agent_name, scope, expires = raw.decode().split("|")
    if expires and float(expires) <= now_epoch:
        return None
    return Principal(int(agent_id), agent_name, scope, token_hash)


# token hash → when this process last stamped it (time.monotonic()). Bounded by the number
# of usable tokens, which only the owner creates. Threads may race to stamp twice: harmless.
_stamped_at: dict[str, float] = {}


def stamp_used(client: redis.Redis, token_hash: str) -> bool:
    """Record that the token was used now, unless this process did within
    STAMP_INTERVAL_SECONDS (then no Redis round trip at all). Returns whether it wrote."""
    now = time.monotonic()
    last = _stamped_at.get(token_hash)
    if last is not None and now - last < STAMP_INTERVAL_SECONDS:
        return False
    _stamped_at[token_hash] = now
    client.hset(USED_KEY, token_hash, f"{time.time():.6f}")
    return True
